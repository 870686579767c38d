// The CUDA engine's step buffers: the per-step metadata the host uploads before each step and the
// activations and scratch of the largest step, each carved from one arena (or measured first by an
// ArenaSizer with the same calls). Used by engine::Rank (engine_rank.h) only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "model/config.h"

namespace moe::cuda::engine {

// Per-step inputs, laid out once for the largest step; the host fills a pinned copy and sends
// it with one copy before each step (outside any graph, so graphs read fixed addresses).
struct StepMeta {
  int32_t *ids, *positions, *slots, *seq_starts, *context_lens, *block_tables;
  float *temperature, *top_p;
  int32_t *top_k, *step;
  uint64_t* seed;
  // One value: rows from it on are padding (a decode step's rows past its sequences up to the
  // graph's bucket, a prefill chunk's past its tokens), which the router sends to no expert.
  int32_t* live_rows;
};

template <typename A>
StepMeta carve_meta(A& a, int64_t tokens, int64_t seqs, int64_t max_blocks) {
  StepMeta m{};
  m.ids = a.template take_n<int32_t>(static_cast<size_t>(tokens));
  m.positions = a.template take_n<int32_t>(static_cast<size_t>(tokens));
  m.slots = a.template take_n<int32_t>(static_cast<size_t>(tokens));
  m.seq_starts = a.template take_n<int32_t>(static_cast<size_t>(seqs + 1));
  m.context_lens = a.template take_n<int32_t>(static_cast<size_t>(seqs));
  m.block_tables = a.template take_n<int32_t>(static_cast<size_t>(seqs * max_blocks));
  m.temperature = a.template take_n<float>(static_cast<size_t>(seqs));
  m.top_p = a.template take_n<float>(static_cast<size_t>(seqs));
  m.top_k = a.template take_n<int32_t>(static_cast<size_t>(seqs));
  m.step = a.template take_n<int32_t>(static_cast<size_t>(seqs));
  m.seed = a.template take_n<uint64_t>(static_cast<size_t>(seqs));
  m.live_rows = a.template take_n<int32_t>(1);
  return m;
}

// Activations and scratch of one step of up to `tokens` rows.
struct Workspace {
  float* x;              // residual stream [T, H]
  uint16_t* h;           // normalised [T, H]
  float* qkv;            // bf16 [T, (heads + 2 kv_heads) * head_dim] at its start; MLA: f32 q [T, heads * (nope + rope)]
  uint16_t* q;           // [T, heads * head_dim]; MLA: q_full [T, heads, lora + rope]
  uint16_t* attn;        // [T, heads * head_dim]; MLA: [T, heads * v]
  // Latent attention only (empty for GQA models).
  float *mla_qa, *mla_kv;   // [T, q_lora], [T, lora + rope]
  uint16_t *mla_qa_normed, *mla_q_nope, *mla_o_lat;  // [T, q_lora], [T, heads * nope], [T, heads * lora]
  uint16_t *branch, *branch2;  // [T, H]: attention / MLP / routed experts; shared expert
  float* router_logits;  // [T, E]
  int32_t* topk_ids;
  int32_t* local_ids;    // topk_ids as this rank's expert indices (-1: another rank's), ep > 1
  float* topk_weights;
  uint16_t *ffn_gate_up, *ffn_act;
  float* shared_gate;    // [T]
  void* experts;
  void* attention;
  uint16_t* normed;      // [logit rows, H]
  float* logits;         // [logit rows, vocab]
  int32_t* sampled;      // [logit rows]
  unsigned* counter;     // the fused decode router's block counter: zeroed at load, left zero
};

struct Shapes {
  int64_t tokens, logit_rows, experts_ws, attention_ws;
};

template <typename A>
Workspace carve_workspace(A& a, const ModelConfig& c, const Shapes& s) {
  const size_t t = static_cast<size_t>(s.tokens), hidden = static_cast<size_t>(c.hidden_size);
  const MlaConfig& m = c.mla;
  const bool mla = c.attention == AttentionKind::kMla;
  const size_t heads = static_cast<size_t>(c.num_heads);
  const size_t qw = mla ? heads * static_cast<size_t>(std::max(m.kv_lora_rank + m.qk_rope_head_dim, m.v_head_dim))
                        : static_cast<size_t>(c.num_heads * c.head_dim);
  const size_t qkvw = mla ? heads * static_cast<size_t>(m.qk_head_dim())
                          : static_cast<size_t>((c.num_heads + 2 * c.num_kv_heads) * c.head_dim);
  const size_t inter = static_cast<size_t>(std::max(c.intermediate_size, c.moe.shared_intermediate));
  const size_t experts = static_cast<size_t>(std::max<int64_t>(c.moe.num_experts, 1));
  const size_t k = static_cast<size_t>(std::max<int64_t>(c.moe.top_k, 1));
  const size_t rows = static_cast<size_t>(s.logit_rows);
  Workspace w{};
  w.x = a.template take_n<float>(t * hidden);
  w.h = a.template take_n<uint16_t>(t * hidden);
  w.qkv = a.template take_n<float>(t * qkvw);
  w.q = a.template take_n<uint16_t>(t * qw);
  w.attn = a.template take_n<uint16_t>(t * qw);
  w.mla_qa = a.template take_n<float>(mla ? t * static_cast<size_t>(m.q_lora_rank) : 0);
  w.mla_kv = a.template take_n<float>(mla ? t * static_cast<size_t>(m.kv_lora_rank + m.qk_rope_head_dim) : 0);
  w.mla_qa_normed = a.template take_n<uint16_t>(mla ? t * static_cast<size_t>(m.q_lora_rank) : 0);
  w.mla_q_nope = a.template take_n<uint16_t>(mla ? t * heads * static_cast<size_t>(m.qk_nope_head_dim) : 0);
  w.mla_o_lat = a.template take_n<uint16_t>(mla ? t * heads * static_cast<size_t>(m.kv_lora_rank) : 0);
  w.branch = a.template take_n<uint16_t>(t * hidden);
  w.branch2 = a.template take_n<uint16_t>(t * hidden);
  w.router_logits = a.template take_n<float>(t * experts);
  w.topk_ids = a.template take_n<int32_t>(t * k);
  w.local_ids = a.template take_n<int32_t>(t * k);
  w.topk_weights = a.template take_n<float>(t * k);
  w.ffn_gate_up = a.template take_n<uint16_t>(t * 2 * inter);
  w.ffn_act = a.template take_n<uint16_t>(t * inter);
  w.shared_gate = a.template take_n<float>(t);
  w.experts = a.template take(static_cast<size_t>(s.experts_ws));
  w.attention = a.template take(static_cast<size_t>(s.attention_ws));
  w.normed = a.template take_n<uint16_t>(rows * hidden);
  w.logits = a.template take_n<float>(rows * static_cast<size_t>(c.vocab_size));
  w.sampled = a.template take_n<int32_t>(rows);
  w.counter = a.template take_n<unsigned>(1);
  return w;
}

}  // namespace moe::cuda::engine
