// Picks the next token from a row of logits: greedy when temperature is 0, otherwise softmax at
// the temperature, restricted to the top_k most likely tokens (0: all) and then to the smallest
// set whose probability reaches top_p (1: all). Seeded and counter-based: the draw's random number
// is a hash of (seed, draw index), so the same request draws the same tokens however its steps
// were batched, chunked or recomputed.
//
// Cost: one pass over the vocabulary plus a selection of the candidates, never a sort of the
// whole vocabulary: sampling at temperature 1 over 152k logits costs about what the argmax does.
#pragma once

#include <cstdint>
#include <vector>

namespace moe {

// Temperatures below this are treated as greedy (0): dividing logits by a denormal one would
// overflow to inf and give NaN probabilities.
constexpr float kGreedyTemperature = 1e-5f;

struct SamplingParams {
  float temperature = 0.0f;
  int top_k = 0;  // 0, or >= the vocabulary: every token
  float top_p = 1.0f;
  uint64_t seed = 0;
};

// Throws kInvalidArgument for a negative or non-finite temperature, a negative top_k, or top_p
// outside (0, 1].
void validate_sampling(const SamplingParams& params);

// The parameters every sampler (CPU or GPU) actually runs: a temperature under
// kGreedyTemperature becomes 0, a top_k of 1 or of the whole vocabulary is folded in.
SamplingParams effective_sampling(const SamplingParams& params, int64_t vocab);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // Other parameters for the next draws (validated), keeping the scratch buffers.
  void set_params(const SamplingParams& params);
  // Draw number `draw` of this sampler's stream.
  int32_t sample(const float* logits, int64_t vocab, int64_t draw);
  // The next draw: 0, 1, 2, ... over the calls.
  int32_t sample(const float* logits, int64_t vocab) { return sample(logits, vocab, draws_++); }

 private:
  SamplingParams params_;
  int64_t draws_ = 0;
  // Scratch, kept between calls.
  std::vector<int32_t> ids_;        // candidates
  std::vector<float> weights_;      // exp((l - max) / T)
  std::vector<double> block_sums_;  // weights summed per block of the vocabulary
  std::vector<uint16_t> bins_;      // each token's bin of the scaled logit (top_p)
  std::vector<double> bin_mass_;    // weights summed per bin
  std::vector<double> sub_mass_;    // and per sub-bin of the bin where the nucleus ends
};

}  // namespace moe
