// Picks the next token from a row of logits: greedy when temperature is 0, otherwise softmax at
// the temperature, restricted to the top_k most likely tokens (0: all) and then to the smallest
// set whose probability reaches top_p (1: all). Seeded, so a run can be repeated exactly.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace moe {

struct SamplingParams {
  float temperature = 0.0f;
  int top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 0;
};

// Throws kInvalidArgument for a negative temperature or top_k, or top_p outside (0, 1].
void validate_sampling(const SamplingParams& params);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t sample(const float* logits, int64_t vocab);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

}  // namespace moe
