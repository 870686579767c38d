// libFuzzer target for the step messages (runtime/step_wire.h): the input is decoded as a step
// plan and as a step result. A moe::Error is a normal outcome. A message that decodes must encode
// back to the very same bytes (the format has one spelling of each plan and result), so a
// decoder that accepts something it should not, or drops a field, is a finding too; so are any
// other exception escaping the library (std::bad_alloc from a forged count among them), a crash,
// a sanitizer report, or a run over libFuzzer's -rss_limit_mb.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <vector>

#include "moe/errors.h"
#include "runtime/step_wire.h"

namespace {

[[noreturn]] void die(const char* what, size_t size) {
  std::fprintf(stderr, "fuzz_step_wire: %s (input of %zu bytes)\n", what, size);
  std::abort();
}

template <typename Decode, typename Encode>
void round_trip(std::span<const uint8_t> bytes, Decode decode, Encode encode, const char* what) {
  try {
    const auto value = decode(bytes);
    const std::vector<uint8_t> again = encode(value);
    if (again.size() != bytes.size() || !std::equal(again.begin(), again.end(), bytes.begin())) die(what, bytes.size());
  } catch (const moe::Error&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_step_wire: %s\n", e.what());
    die("an exception other than moe::Error", bytes.size());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const uint8_t> bytes(data, size);
  round_trip(bytes, moe::runtime::decode_plan, moe::runtime::encode_plan, "a decoded plan encodes differently");
  round_trip(bytes, moe::runtime::decode_result, moe::runtime::encode_result, "a decoded result encodes differently");
  return 0;
}
