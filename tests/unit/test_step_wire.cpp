// The step messages (runtime/step_wire.h): plans and results come back from their bytes exactly
// as they went in, and the decoder refuses every malformed message with kFormat before it
// allocates for it: each truncation, forged counts and shapes, out-of-range flags and enums,
// non-finite sampling parameters, trailing bytes, another tag, version or kind.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "runtime/step_wire.h"
#include "test_util.h"

namespace moe::runtime {
namespace {

StepPlan random_plan(std::mt19937& rng, int rows) {
  StepPlan p;
  std::uniform_int_distribution<int32_t> id(0, 151935);
  const int tokens = rows * 3 + 1;
  for (int i = 0; i < tokens; ++i) p.tokens.push_back(id(rng));
  for (int i = 0; i < rows; ++i) {
    StepRow r;
    r.seq = static_cast<int32_t>(rng() % 1000);
    r.offset = i * 3;
    r.count = 1 + static_cast<int32_t>(rng() % 3);
    r.sample = rng() % 2 == 0;
    r.sampling.temperature = std::uniform_real_distribution<float>(0.0f, 2.0f)(rng);
    r.sampling.top_k = static_cast<int>(rng() % 100);
    r.sampling.top_p = std::uniform_real_distribution<float>(0.05f, 1.0f)(rng);
    r.sampling.seed = (uint64_t{rng()} << 32) | rng();
    r.draw = static_cast<int64_t>(rng()) * 1000;
    r.logits = static_cast<RowLogits>(rng() % 3);
    p.rows.push_back(r);
  }
  return p;
}

void expect_same(const StepPlan& a, const StepPlan& b) {
  ASSERT_EQ(a.tokens, b.tokens);
  ASSERT_EQ(a.rows.size(), b.rows.size());
  for (size_t i = 0; i < a.rows.size(); ++i) {
    const StepRow &x = a.rows[i], &y = b.rows[i];
    EXPECT_EQ(x.seq, y.seq) << i;
    EXPECT_EQ(x.offset, y.offset) << i;
    EXPECT_EQ(x.count, y.count) << i;
    EXPECT_EQ(x.sample, y.sample) << i;
    EXPECT_EQ(x.sampling.temperature, y.sampling.temperature) << i;
    EXPECT_EQ(x.sampling.top_k, y.sampling.top_k) << i;
    EXPECT_EQ(x.sampling.top_p, y.sampling.top_p) << i;
    EXPECT_EQ(x.sampling.seed, y.sampling.seed) << i;
    EXPECT_EQ(x.draw, y.draw) << i;
    EXPECT_EQ(x.logits, y.logits) << i;
  }
}

StepResult sample_result() {
  StepResult r;
  r.tokens = {17, -1, 151935, 0};
  r.logits.resize(4);
  r.logits[0] = Tensor::zeros({1, 5});
  const float row[5] = {1.5f, -std::numeric_limits<float>::infinity(), 0.0f, -0.0f, 3.25e-20f};
  std::memcpy(r.logits[0].data<float>(), row, sizeof(row));
  r.logits[2] = Tensor::zeros({3, 2});  // a row that asked for every position
  for (int i = 0; i < 6; ++i) r.logits[2].data<float>()[i] = static_cast<float>(i) - 2.5f;
  return r;  // rows 1 and 3 asked for none
}

ErrorKind plan_error(const std::vector<uint8_t>& bytes, std::string* why = nullptr) {
  return test::error_kind_of([&] { decode_plan(bytes); }, why);
}
ErrorKind result_error(const std::vector<uint8_t>& bytes, std::string* why = nullptr) {
  return test::error_kind_of([&] { decode_result(bytes); }, why);
}

TEST(StepWire, PlansComeBackAsTheyWent) {
  std::mt19937 rng(5);
  for (int rows : {0, 1, 7, 64}) {
    const StepPlan p = random_plan(rng, rows);
    expect_same(p, decode_plan(encode_plan(p)));
  }
  StepPlan extremes;
  extremes.tokens = {std::numeric_limits<int32_t>::max(), std::numeric_limits<int32_t>::min()};
  StepRow r;
  r.seq = std::numeric_limits<int32_t>::max();
  r.sampling.seed = std::numeric_limits<uint64_t>::max();
  r.draw = std::numeric_limits<int64_t>::min();
  r.logits = RowLogits::kAll;
  extremes.rows = {r};
  expect_same(extremes, decode_plan(encode_plan(extremes)));
}

TEST(StepWire, ResultsComeBackBitForBit) {
  const StepResult r = sample_result();
  const StepResult back = decode_result(encode_result(r));
  EXPECT_EQ(back.tokens, r.tokens);
  ASSERT_EQ(back.logits.size(), 4u);
  EXPECT_FALSE(back.logits[1].defined());
  EXPECT_FALSE(back.logits[3].defined());
  for (int i : {0, 2}) {
    ASSERT_TRUE(back.logits[i].defined()) << i;
    EXPECT_EQ(back.logits[i].shape(), r.logits[i].shape()) << i;
    EXPECT_EQ(std::memcmp(back.logits[i].data<float>(), r.logits[i].data<float>(), r.logits[i].nbytes()), 0) << i;
  }
  // -0.0 and the infinity kept as they were, not as equal values.
  EXPECT_TRUE(std::signbit(back.logits[0].data<float>()[3]));
  EXPECT_TRUE(std::isinf(back.logits[0].data<float>()[1]));
}

TEST(StepWire, EveryTruncationIsRefused) {
  std::mt19937 rng(6);
  const std::vector<uint8_t> plan = encode_plan(random_plan(rng, 3));
  for (size_t n = 0; n < plan.size(); ++n)
    EXPECT_EQ(plan_error(std::vector<uint8_t>(plan.begin(), plan.begin() + static_cast<long>(n))), ErrorKind::kFormat)
        << "plan cut to " << n << " of " << plan.size() << " bytes";
  const std::vector<uint8_t> result = encode_result(sample_result());
  for (size_t n = 0; n < result.size(); ++n)
    EXPECT_EQ(result_error(std::vector<uint8_t>(result.begin(), result.begin() + static_cast<long>(n))),
              ErrorKind::kFormat)
        << "result cut to " << n << " of " << result.size() << " bytes";
}

TEST(StepWire, TrailingBytesTagVersionAndKindAreChecked) {
  std::mt19937 rng(7);
  const std::vector<uint8_t> plan = encode_plan(random_plan(rng, 2));
  std::string why;
  std::vector<uint8_t> longer = plan;
  longer.push_back(0);
  EXPECT_EQ(plan_error(longer, &why), ErrorKind::kFormat);
  EXPECT_NE(why.find("1 bytes past its end"), std::string::npos) << why;

  std::vector<uint8_t> tag = plan;
  tag[0] = 'x';
  EXPECT_EQ(plan_error(tag, &why), ErrorKind::kFormat);
  EXPECT_NE(why.find("not a step message"), std::string::npos) << why;

  std::vector<uint8_t> version = plan;
  version[4] = static_cast<uint8_t>(kStepWireVersion + 1);  // little-endian u16 at byte 4
  EXPECT_EQ(plan_error(version, &why), ErrorKind::kFormat);
  EXPECT_NE(why.find("format version " + std::to_string(kStepWireVersion + 1) + ", this build reads version " +
                     std::to_string(kStepWireVersion)),
            std::string::npos)
      << why;

  // A plan handed to the result decoder, and a result to the plan decoder.
  EXPECT_EQ(result_error(plan, &why), ErrorKind::kFormat);
  EXPECT_NE(why.find("kind"), std::string::npos) << why;
  EXPECT_EQ(plan_error(encode_result(sample_result())), ErrorKind::kFormat);
}

// Byte offsets in a plan message: 8 header bytes, the token count (4), the tokens, the row count
// (4), then 42 bytes a row in the order of step_wire.cpp.
TEST(StepWire, ForgedCountsAndFieldsAreRefusedBeforeAllocating) {
  StepPlan p;
  p.tokens = {1, 2, 3};
  StepRow r;
  r.count = 3;
  p.rows = {r};
  const std::vector<uint8_t> good = encode_plan(p);
  ASSERT_EQ(good.size(), 8u + 4 + 12 + 4 + 42);
  std::string why;

  std::vector<uint8_t> tokens = good;
  const uint32_t huge = 0xffffffffu;
  std::memcpy(tokens.data() + 8, &huge, 4);
  EXPECT_EQ(plan_error(tokens, &why), ErrorKind::kFormat);
  EXPECT_NE(why.find("4294967295 items"), std::string::npos) << why;

  std::vector<uint8_t> rows = good;
  std::memcpy(rows.data() + 24, &huge, 4);
  EXPECT_EQ(plan_error(rows, &why), ErrorKind::kFormat);

  const size_t row0 = 28;
  std::vector<uint8_t> sample = good;
  sample[row0 + 12] = 2;
  EXPECT_EQ(plan_error(sample, &why), ErrorKind::kFormat);
  EXPECT_NE(why.find("sample flag 2"), std::string::npos) << why;

  std::vector<uint8_t> logits = good;
  logits[row0 + 41] = 3;
  EXPECT_EQ(plan_error(logits, &why), ErrorKind::kFormat);
  EXPECT_NE(why.find("logits of kind 3"), std::string::npos) << why;

  std::vector<uint8_t> temperature = good;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(temperature.data() + row0 + 13, &nan, 4);
  EXPECT_EQ(plan_error(temperature, &why), ErrorKind::kFormat);
  EXPECT_NE(why.find("non-finite"), std::string::npos) << why;

  // A result whose one logits tensor claims [65536, 65536] (16 GiB) in a 32-byte message.
  StepResult res;
  res.tokens = {4};
  res.logits.resize(1);
  res.logits[0] = Tensor::zeros({1, 1});
  std::vector<uint8_t> shape = encode_result(res);
  const uint32_t side = 65536;
  std::memcpy(shape.data() + 8 + 4 + 4 + 4, &side, 4);
  std::memcpy(shape.data() + 8 + 4 + 4 + 4 + 4, &side, 4);
  EXPECT_EQ(result_error(shape, &why), ErrorKind::kFormat);
  EXPECT_NE(why.find("larger than the message"), std::string::npos) << why;

  std::vector<uint8_t> half = encode_result(res);
  const uint32_t zero = 0;
  std::memcpy(half.data() + 8 + 4 + 4 + 4, &zero, 4);  // [0, 1]: neither a tensor nor none
  EXPECT_EQ(result_error(half, &why), ErrorKind::kFormat);
  EXPECT_NE(why.find("[0, 1]"), std::string::npos) << why;
}

}  // namespace
}  // namespace moe::runtime
