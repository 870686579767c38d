// Greedy decoding through a cuda::Engine, shared by the one-GPU and the multi-GPU engine tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "backend/cuda_engine.h"

namespace moe::test {

// One sequence: its prefill's token, then greedy decode steps until there are n tokens.
inline std::vector<int32_t> greedy_tokens(cuda::Engine& e, const std::vector<int32_t>& ids, size_t n) {
  const int32_t s = e.open();
  std::vector<int32_t> got{e.prefill(s, ids, SamplingParams{})};
  std::vector<int32_t> seqs{s};
  std::vector<SamplingParams> g(1);
  while (got.size() < n) {
    std::vector<int32_t> last{got.back()};
    got.push_back(e.decode(seqs, last, g)[0]);
  }
  e.close(s);
  return got;
}

// Several prompts, each opened and prefilled, then `steps` greedy decode steps: the sequences in
// one batch a step (`together`) or each decoded alone. Each prompt's tokens, its prefill's first;
// the sequences stay open, their ids in *seqs.
inline std::vector<std::vector<int32_t>> greedy_prompts(cuda::Engine& e,
                                                        const std::vector<std::vector<int32_t>>& prompts,
                                                        int steps, bool together, std::vector<int32_t>* seqs) {
  std::vector<std::vector<int32_t>> out(prompts.size());
  std::vector<int32_t> last;
  seqs->clear();
  for (const auto& p : prompts) {
    seqs->push_back(e.open());
    last.push_back(e.prefill(seqs->back(), p, SamplingParams{}));
    out[seqs->size() - 1].push_back(last.back());
  }
  for (int step = 0; step < steps; ++step) {
    if (together) {
      std::vector<SamplingParams> g(seqs->size());
      last = e.decode(*seqs, last, g);
    } else {
      for (size_t s = 0; s < seqs->size(); ++s) {
        std::vector<int32_t> one{(*seqs)[s]}, tok{last[s]};
        std::vector<SamplingParams> g(1);
        last[s] = e.decode(one, tok, g)[0];
      }
    }
    for (size_t s = 0; s < seqs->size(); ++s) out[s].push_back(last[s]);
  }
  return out;
}

}  // namespace moe::test
