// The kernels that move tokens between expert-parallel ranks (ep_exchange.cu): plain pointers and
// sizes, no library types. Rows travel once per (token, destination rank), with the token's k
// expert ids localised to that rank (-1 for the slots other ranks hold), so a token routed to two
// experts of one rank crosses the link once and that rank's experts combine its slots locally.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::cuda::kernels {

constexpr int kEpMaxRanks = 8;

// The routing every rank holds (attention is replicated) and who owns which expert: rank p owns
// the global experts [first[p], first[p + 1]).
struct EpRouting {
  const int32_t* ids = nullptr;    // [tokens, top_k], global expert ids
  const float* weights = nullptr;  // [tokens, top_k]
  int top_k = 0;
  int ranks = 0;
  int first[kEpMaxRanks + 1] = {};
};

// Where a source's rows for each destination rank go: row i of destination p is x[p] + i * hidden
// (bf16), its localised ids ids[p] + i * top_k, weights w[p] + i * top_k and, when token[p] is set,
// the global index of its token token[p][i]. Rows [count_p, pad_rows) get ids -1 and token -1
// (padded layouts: the receiver runs them as empty rows).
struct EpDest {
  uint16_t* x[kEpMaxRanks] = {};
  int32_t* ids[kEpMaxRanks] = {};
  float* w[kEpMaxRanks] = {};
  int32_t* token[kEpMaxRanks] = {};
  int pad_rows = 0;
};

// Completion flags written into peers (p2p): after every row of a kernel has landed, its last block
// stores the current epoch (*epoch + 1) into flag[q] for each rank q. `done` counts finished
// blocks and is left at zero.
struct EpSignal {
  unsigned long long* flag[kEpMaxRanks] = {};
  const unsigned long long* epoch = nullptr;
  unsigned* done = nullptr;
};

// A bounded wait: status gets (stage << 8 | peer) + 1 when flag[peer] has not reached the current
// epoch within timeout_ns, and nothing waits once status is set (the host reports it).
struct EpWait {
  const unsigned long long* flag = nullptr;  // [ranks], local memory the peers write
  const unsigned long long* epoch = nullptr;
  long long timeout_ns = 0;
  int* status = nullptr;
  int stage = 0;
};

// For the shard tokens [begin, begin + count): pos[t * ranks + p] = the row of token t among
// those this rank sends to p (in token order), -1 when p owns none of its experts; counts[p].
// One block (count up to 65536).
cudaError_t ep_plan(const EpRouting& r, int begin, int count, int* pos, int* counts,
                    cudaStream_t stream);

// Writes the shard's rows to their places in local send buffers (and the padding rows).
cudaError_t ep_pack(const uint16_t* x, const EpRouting& r, int begin, int count, int hidden,
                    const int* pos, const int* counts, const EpDest& dest, cudaStream_t stream);

// p2p dispatch in one launch: block b < count takes shard token begin + b, claims its row at
// every rank that owns one of its experts with an atomic on cursor[p] (so rows land in no fixed
// order; each row's result depends only on its own token) and writes it into that rank's memory.
// The last block then pads every destination's slice to dest.pad_rows (ids and token -1),
// signals every rank (sig), leaves cursor and sig.done at zero, and waits (bounded, `wait`) for
// every rank's rows to this one: the experts can run as soon as the kernel ends.
struct P2pDispatch {
  EpDest dest;
  EpSignal sig;
  EpWait wait;
  int* cursor = nullptr;  // [ranks], zero before the first launch
};
cudaError_t ep_dispatch_p2p(const uint16_t* x, const EpRouting& r, int begin, int count,
                            int hidden, const P2pDispatch& d, cudaStream_t stream);

// ids[i] -> the local index on the rank that owns [first, first + num), or -1.
cudaError_t ep_localize(const int32_t* ids, int n, int first, int num, int32_t* out,
                        cudaStream_t stream);

// out[t] for the shard tokens: the sum, in rank order and f32, of part[p] + pos[t * ranks + p] *
// hidden over the ranks p with pos >= 0 (rows that came back from the experts of p), rounded to
// bf16 once; zero when no rank has a slot.
struct EpParts {
  const uint16_t* part[kEpMaxRanks] = {};
};
cudaError_t ep_unpack_sum(const EpParts& parts, const int* pos, int count, int ranks, int hidden,
                          uint16_t* out, cudaStream_t stream);

// p2p combine, owner side: every received row with token >= 0 (y row i, its token token[i]) is
// written to each rank q at dest[q] + token * hidden; then sig.
struct EpRowsOut {
  uint16_t* dest[kEpMaxRanks] = {};
};
cudaError_t ep_send_back(const uint16_t* y, const int32_t* token, int rows, int hidden, int ranks,
                         const EpRowsOut& out, const EpSignal& sig, cudaStream_t stream);

// p2p combine, every rank: waits (bounded) for each owner's rows, then out[t] for all tokens = the
// sum in rank order of comb + (p * stride + t) * hidden over the owners p of t's slots (from the
// routing), rounded once; the last block advances *epoch (the end of the layer's exchange).
cudaError_t ep_reduce(const EpRouting& r, const uint16_t* comb, long long stride, int tokens,
                      int hidden, const EpWait& w, unsigned long long* epoch, unsigned* done,
                      uint16_t* out, cudaStream_t stream);

}  // namespace moe::cuda::kernels
