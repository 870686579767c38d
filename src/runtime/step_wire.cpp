#include "runtime/step_wire.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/byte_io.h"
#include "moe/errors.h"

namespace moe::runtime {

// The messages are the host's own bytes: every machine this runs on is little-endian.
static_assert(std::endian::native == std::endian::little, "the step messages are little-endian");

namespace {

// The first 8 bytes of every message: a tag, the format version, the kind.
constexpr char kMagic[4] = {'m', 'o', 'e', 'S'};
enum class Kind : uint16_t { kPlan = 1, kResult = 2 };

const char* kind_name(Kind k) { return k == Kind::kPlan ? "step plan" : "step result"; }

class Writer : public ByteWriter {
 public:
  // A token list: its u32 count, then the ids.
  void put_tokens(const std::vector<int32_t>& tokens) {
    MOE_CHECK(tokens.size() <= std::numeric_limits<uint32_t>::max(), kInvalidArgument,
              "step message: {} tokens do not fit a message", tokens.size());
    put(static_cast<uint32_t>(tokens.size()));
    put_all(tokens.data(), tokens.size());
  }
  void header(Kind kind) {
    put_all(kMagic, 4);
    put(kStepWireVersion);
    put(static_cast<uint16_t>(kind));
  }
};

// Reads the message front to back; a read past its end is one kFormat line naming the field.
class Reader {
 public:
  Reader(std::span<const uint8_t> bytes, Kind kind) : in_(bytes), kind_(kind) {
    MOE_CHECK(in_.left() >= 8, kFormat, "{}: truncated in its header (8 bytes needed at byte 0, {} left)",
              kind_name(kind_), in_.left());
    char magic[4];
    get_all(magic, 4, "its header");
    MOE_CHECK(std::memcmp(magic, kMagic, 4) == 0, kFormat, "{}: not a step message (bad tag)", kind_name(kind_));
    const auto version = get<uint16_t>("its version");
    MOE_CHECK(version == kStepWireVersion, kFormat, "{}: format version {}, this build reads version {}",
              kind_name(kind_), version, kStepWireVersion);
    const auto k = get<uint16_t>("its kind");
    MOE_CHECK(k == static_cast<uint16_t>(kind_), kFormat, "{}: the message is of kind {}, not {}", kind_name(kind_),
              k, static_cast<uint16_t>(kind_));
  }
  template <typename T>
  T get(const char* what) {
    T v;
    get_all(&v, 1, what);
    return v;
  }
  // A count of items of `item_bytes` each that must all be in the message.
  size_t count(size_t item_bytes, const char* what) {
    const auto n = get<uint32_t>(what);
    MOE_CHECK(item_bytes == 0 || n <= in_.left() / item_bytes, kFormat,
              "{}: {} says {} items of {} bytes, but {} bytes are left", kind_name(kind_), what, n, item_bytes,
              in_.left());
    return n;
  }
  template <typename T>
  void get_all(T* p, size_t n, const char* what) {
    MOE_CHECK(in_.read(p, n), kFormat, "{}: truncated in {} ({} bytes needed at byte {}, {} left)", kind_name(kind_),
              what, n * sizeof(T), in_.at(), in_.left());
  }
  std::vector<int32_t> get_tokens() {
    std::vector<int32_t> tokens(count(4, "the token count"));
    get_all(tokens.data(), tokens.size(), "the tokens");
    return tokens;
  }
  void finish() {
    MOE_CHECK(in_.left() == 0, kFormat, "{}: {} bytes past its end", kind_name(kind_), in_.left());
  }
  const char* name() const { return kind_name(kind_); }

 private:
  ByteReader in_;
  Kind kind_;
};

// A row on the wire: seq, offset, count (i32), sample (u8), temperature (f32), top_k (i32),
// top_p (f32), seed (u64), draw (i64), logits (u8).
constexpr size_t kRowBytes = 4 + 4 + 4 + 1 + 4 + 4 + 4 + 8 + 8 + 1;

}  // namespace

std::vector<uint8_t> encode_plan(const StepPlan& plan) {
  MOE_CHECK(plan.rows.size() <= std::numeric_limits<uint32_t>::max(), kInvalidArgument,
            "step plan: {} rows do not fit a message", plan.rows.size());
  Writer w;
  w.header(Kind::kPlan);
  w.put_tokens(plan.tokens);
  w.put(static_cast<uint32_t>(plan.rows.size()));
  for (const StepRow& r : plan.rows) {
    w.put(r.seq);
    w.put(r.offset);
    w.put(r.count);
    w.put(static_cast<uint8_t>(r.sample ? 1 : 0));
    w.put(r.sampling.temperature);
    w.put(static_cast<int32_t>(r.sampling.top_k));
    w.put(r.sampling.top_p);
    w.put(r.sampling.seed);
    w.put(r.draw);
    w.put(static_cast<uint8_t>(r.logits));
  }
  return w.take();
}

StepPlan decode_plan(std::span<const uint8_t> bytes) {
  Reader in(bytes, Kind::kPlan);
  StepPlan plan;
  plan.tokens = in.get_tokens();
  plan.rows.resize(in.count(kRowBytes, "the row count"));
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    StepRow& r = plan.rows[i];
    r.seq = in.get<int32_t>("a row");
    r.offset = in.get<int32_t>("a row");
    r.count = in.get<int32_t>("a row");
    const auto sample = in.get<uint8_t>("a row");
    MOE_CHECK(sample <= 1, kFormat, "{}: row {} has sample flag {} (0 or 1)", in.name(), i, sample);
    r.sample = sample == 1;
    r.sampling.temperature = in.get<float>("a row");
    r.sampling.top_k = in.get<int32_t>("a row");
    r.sampling.top_p = in.get<float>("a row");
    MOE_CHECK(std::isfinite(r.sampling.temperature) && std::isfinite(r.sampling.top_p), kFormat,
              "{}: row {} has a non-finite temperature or top_p", in.name(), i);
    r.sampling.seed = in.get<uint64_t>("a row");
    r.draw = in.get<int64_t>("a row");
    const auto logits = in.get<uint8_t>("a row");
    MOE_CHECK(logits <= static_cast<uint8_t>(RowLogits::kAll), kFormat, "{}: row {} asks for logits of kind {} (0-2)",
              in.name(), i, logits);
    r.logits = static_cast<RowLogits>(logits);
  }
  in.finish();
  return plan;
}

std::vector<uint8_t> encode_result(const StepResult& result) {
  Writer w;
  w.header(Kind::kResult);
  w.put_tokens(result.tokens);
  w.put(static_cast<uint32_t>(result.logits.size()));
  for (const Tensor& t : result.logits) {
    if (!t.defined()) {  // a row that asked for none
      w.put(uint32_t{0});
      w.put(uint32_t{0});
      continue;
    }
    MOE_CHECK(t.dtype() == DType::kF32 && t.ndim() == 2 && t.dim(0) >= 1 && t.dim(1) >= 1 &&
                  t.dim(0) <= std::numeric_limits<uint32_t>::max() && t.dim(1) <= std::numeric_limits<uint32_t>::max(),
              kInternal, "step result: logits of {} {} where f32 [rows, vocab] was expected", dtype_name(t.dtype()),
              t.shape_str());
    w.put(static_cast<uint32_t>(t.dim(0)));
    w.put(static_cast<uint32_t>(t.dim(1)));
    w.put_all(t.data<float>(), static_cast<size_t>(t.numel()));
  }
  return w.take();
}

StepResult decode_result(std::span<const uint8_t> bytes) {
  Reader in(bytes, Kind::kResult);
  StepResult result;
  result.tokens = in.get_tokens();
  result.logits.resize(in.count(8, "the logits count"));
  for (Tensor& t : result.logits) {
    const auto rows = in.get<uint32_t>("a logits shape"), cols = in.get<uint32_t>("a logits shape");
    if (rows == 0 && cols == 0) continue;
    MOE_CHECK(rows >= 1 && cols >= 1, kFormat, "{}: logits of shape [{}, {}]", in.name(), rows, cols);
    // The size is checked before the tensor is made: a forged shape must not allocate.
    const uint64_t n = uint64_t{rows} * cols;
    MOE_CHECK(n <= (bytes.size() / 4), kFormat, "{}: logits [{}, {}] are larger than the message", in.name(), rows,
              cols);
    t = Tensor::zeros({rows, cols});
    in.get_all(t.data<float>(), static_cast<size_t>(n), "the logits");
  }
  in.finish();
  return result;
}

}  // namespace moe::runtime
