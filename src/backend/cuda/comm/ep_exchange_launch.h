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
// stores the current epoch (*epoch + 1) into flag[q] for each rank q (with, from the dispatch, the
// number of rows sent to q in the low bits). `done` counts finished blocks and is left at zero.
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
// The last block then signals every rank (sig, with the rows sent to it), leaves cursor and
// sig.done at zero, waits (bounded, `wait`) for every rank's rows to this one and pads this
// rank's own receive slices past the rows each sent (ids and token -1): the experts can run as
// soon as the kernel ends.
struct P2pDispatch {
  EpDest dest;
  EpSignal sig;
  EpWait wait;
  int* cursor = nullptr;  // [ranks], zero before the first launch
  int32_t* recv_ids = nullptr;    // this rank's receive slices: [ranks, dest.pad_rows, top_k]
  int32_t* recv_token = nullptr;  // [ranks, dest.pad_rows]
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

// The experts' partial sums of the received rows, left un-combined (Experts::Partials): row i's
// output is the sum of its slots i * top_k + j with ids >= 0, in slot order, then split order.
struct EpSlotSums {
  const void* sums = nullptr;
  const int32_t* ids = nullptr;  // [rows, top_k] local expert ids, -1 for slots held elsewhere
  int top_k = 0;
  bool bf16 = false;  // bf16 sums, or f32
  int splits = 1;
  long long split_stride = 0;
};

struct EpRowsOut {
  uint16_t* dest[kEpMaxRanks] = {};
};

// The p2p combine, one kernel per rank:
//  1. owner side: every received row i with token[i] >= 0 is summed from its slots (one bf16
//     rounding, as the experts' own combine would store it) and written to each rank q at
//     back.dest[q] + token[i] * hidden; then `sig` (the rank's last block raises the flags);
//  2. every rank: waits (bounded) for each owner's rows, then out[t] for all tokens = the sum in
//     rank order of comb + (p * stride + t) * hidden over the owners p of t's slots (from the
//     routing), rounded once; the last block advances *epoch (the end of the layer's exchange).
// Every block waits in step 2 for flags that step 1 of all blocks raises, so the grid is capped
// at what the device holds at once and loops over rows and tokens.
struct P2pCombine {
  EpSlotSums in;
  const int32_t* token = nullptr;  // [rows] the source token of each received row, -1: padding
  int rows = 0;
  EpRowsOut back;
  EpSignal sig;
  // > 0 (own tokens, data-parallel attention): received rows [s * source_rows, (s + 1) *
  // source_rows) came from rank s, which alone gets their sums back; 0: every rank gets every row.
  int source_rows = 0;
  const uint16_t* comb = nullptr;  // [ranks, stride, hidden] rows back from each owner
  long long stride = 0;
  EpWait wait;
  unsigned long long* epoch = nullptr;
  unsigned* done = nullptr;
};
cudaError_t ep_combine_p2p(const EpRouting& r, const P2pCombine& c, int tokens, int hidden,
                           uint16_t* out, cudaStream_t stream);

}  // namespace moe::cuda::kernels
