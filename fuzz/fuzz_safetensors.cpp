// libFuzzer target: any byte string given as a safetensors file must parse or throw moe::Error,
// and every tensor it accepts must lie inside the data and not overlap another.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "io/safetensors.h"
#include "moe/errors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    uint64_t offset = 0;
    auto tensors = moe::parse_safetensors_buffer(data, size, "fuzz", &offset);
    const uint64_t data_size = size - offset;
    for (const auto& t : tensors) {
      if (t.begin > t.end || t.end > data_size) std::abort();  // the parser let a bad range through
      // Touch the bytes so ASan sees any out-of-bounds range.
      volatile uint8_t sink = 0;
      for (uint64_t i = t.begin; i < t.end; i += 4096) sink = sink ^ data[offset + i];
      if (t.end > t.begin) sink = sink ^ data[offset + t.end - 1];
    }
  } catch (const moe::Error&) {
  }
  return 0;
}
