// What a decode step must read, and a prefill must compute, on the GPU that does the most under
// tensor parallelism `tp` (attention heads split) and expert parallelism `ep` (routed experts
// split): the counts behind the floors that moe-bench prints beside its figures. Matrices only
// (norms, biases and the one embedding row a token reads are negligible), in parameters.
#pragma once

#include "model/config.h"

namespace moe {

struct StepReads {
  // Parameters outside the routed experts: attention, router, shared expert and its gate, dense
  // MLPs, lm_head. Under tp the GPU's share of the attention heads; latent attention's shared
  // projections (q_a, kv_a) whole.
  double fixed = 0;
  // One routed expert's parameters in one layer, over ep: each GPU holds 1/ep of the experts,
  // and under uniform routing a batch's tokens split evenly over them.
  double per_expert = 0;
  // The same two in bytes, by the weights' format: 2 a parameter in bf16; in an FP8 config 1 (and
  // its block scales) for the matrices a published FP8 checkpoint stores in FP8, 2 for those it
  // keeps in 16 bits (routers, the shared-expert gate, lm_head).
  double fixed_bytes = 0, per_expert_bytes = 0;
  // KV cache bytes (bf16) per token of context over all layers: the GPU's key/value heads, or
  // the latent row, which every GPU keeps whole.
  double kv_token_bytes = 0;
  // Causal attention FLOPs of a prefill of n tokens are 2 * attention_width * n * (n + 1): over
  // all layers and the GPU's heads, (QK width + PV width) / 2 per head.
  double attention_width = 0;
};

StepReads step_reads(const ModelConfig& c, int tp = 1, int ep = 1);

}  // namespace moe
