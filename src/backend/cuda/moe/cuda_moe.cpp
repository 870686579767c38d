#include "backend/cuda_moe.h"

#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_arena.h"
#include "backend/cuda/moe/moe_decode_launch.h"
#include "backend/cuda/moe/moe_heuristics.h"
#include "backend/cuda/moe/moe_wgmma_launch.h"

namespace moe::cuda {

namespace h = heuristics;

namespace {

// The workspace, carved in one order by both workspace_bytes() and forward().
struct Layout {
  size_t offsets = 0, order = 0, active = 0, num_active = 0, tile_expert = 0, tile_row = 0,
         num_tiles = 0, plan_counts = 0, act = 0, part = 0, x_fp8 = 0, x_scales = 0, act_fp8 = 0,
         act_scales = 0, total = 0;
};

// Whether FP8 experts can take a W8A8 GEMM path (wgmma or mma.sync) for some token count up to
// max_tokens: the GEMV path takes the rest. The wgmma rule (prefer_gemv_fp8) leaves the GEMV
// sooner than the mma.sync one (prefer_gemv), so its test covers both.
bool fp8_gemm_reachable(const ExpertShape& s, int64_t max_tokens) {
  if (!h::gemm_supports(s.hidden, s.inter)) return false;
  if (!h::gemv_supports(s.hidden, s.inter)) return true;
  return !h::prefer_gemv_fp8(max_tokens, s.top_k, s.experts) || max_tokens > h::kGemvMaxTokensBesideGemm;
}

int64_t scale_cols(int64_t width) { return (width + 127) / 128; }

Layout layout(const ExpertShape& s, int64_t max_tokens, const WeightFormat& format) {
  const bool gemv = h::gemv_supports(s.hidden, s.inter), gemm = h::gemm_supports(s.hidden, s.inter);
  const size_t slots = static_cast<size_t>(max_tokens * s.top_k);
  // Row tiles: the smallest tile gives the most.
  const size_t tiles = gemm ? static_cast<size_t>(h::max_row_tiles(max_tokens * s.top_k, s.experts, 64)) : 0;
  size_t part = 0;
  if (gemm) part = slots * s.hidden * 2;
  if (h::wgmma_supports(s.hidden, s.inter)) {
    // Split-K pieces of the down projection (f32), for the few token counts small enough to use
    // them; the split count only falls as the tokens, hence the row tiles, grow.
    for (int tile_m : {64, 128, 256}) {
      for (int64_t t = 1; t <= max_tokens; ++t) {
        const int splits = h::wgmma_down_splits(h::max_row_tiles(t * s.top_k, s.experts, tile_m),
                                                s.hidden, s.inter);
        if (splits == 1) break;
        part = std::max(part, static_cast<size_t>(splits * t * s.top_k * s.hidden) * 4);
      }
    }
  }
  if (gemv) {
    const int64_t gemv_tokens = gemm ? std::min(max_tokens, h::kGemvMaxTokensBesideGemm) : max_tokens;
    part = std::max(part, static_cast<size_t>(gemv_tokens * s.top_k * s.hidden) * 4);
  }
  Layout l;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align_up(std::max<size_t>(bytes, 1));
    return here;
  };
  l.offsets = take((s.experts + 1) * 4);
  l.order = take(slots * 4);
  l.active = take(s.experts * 4);
  l.num_active = take(4);
  l.tile_expert = take(tiles * 4);
  l.tile_row = take(tiles * 4);
  l.num_tiles = take(8);  // the row tiles of tile_m and of the plan's alternative
  l.plan_counts = take(static_cast<size_t>(kernels::kMaxPlanBlocks) * s.experts * 4);
  l.act = take(slots * s.inter * 2);
  l.part = take(part);
  // FP8 experts on the GEMM path: x and act quantised per row and 128 columns.
  if (format.scaled() && fp8_gemm_reachable(s, max_tokens)) {
    l.x_fp8 = take(static_cast<size_t>(max_tokens * s.hidden));
    l.x_scales = take(static_cast<size_t>(max_tokens * scale_cols(s.hidden)) * 4);
    l.act_fp8 = take(slots * s.inter);
    l.act_scales = take(slots * static_cast<size_t>(scale_cols(s.inter)) * 4);
  }
  l.total = at;
  return l;
}

void check_shape(const ExpertShape& s, int64_t max_tokens) {
  // top_k may exceed the experts held: under expert parallelism a token's k slots span every
  // rank's experts, and a rank of fewer than k experts skips the others' slots (-1).
  MOE_CHECK(s.experts >= 1 && s.hidden >= 1 && s.inter >= 1 && s.top_k >= 1,
            kInvalidArgument, "bad expert shape: {} experts, hidden {}, inter {}, top-{}", s.experts,
            s.hidden, s.inter, s.top_k);
  MOE_CHECK(max_tokens >= 1 && max_tokens <= h::kMaxTokens, kInvalidArgument,
            "max_tokens must be 1 to {}, got {}", h::kMaxTokens, max_tokens);
  MOE_CHECK(s.experts <= kernels::kMaxExperts, kUnsupported,
            "the CUDA experts handle 1 to {} experts per device, got {}", kernels::kMaxExperts,
            s.experts);
  MOE_CHECK(experts_support(s, ExpertPath::kAuto), kUnsupported,
            "the CUDA experts need hidden and intermediate widths that are multiples of 8 and at "
            "most {} (GEMV path) or multiples of 64 and at most {} (GEMM path); got {} and {}",
            h::kGemvMaxWidth, h::kGemmMaxWidth, s.hidden, s.inter);
}

const char* path_name(ExpertPath p) {
  switch (p) {
    case ExpertPath::kGemv: return "GEMV";
    case ExpertPath::kGemm: return "GEMM";
    case ExpertPath::kWgmma: return "wgmma";
    default: return "automatic";
  }
}

}  // namespace

bool experts_support(const ExpertShape& s, ExpertPath path, const WeightFormat& format) {
  const bool gemv = h::gemv_supports(s.hidden, s.inter), gemm = h::gemm_supports(s.hidden, s.inter);
  switch (path) {
    case ExpertPath::kGemv: return gemv;
    case ExpertPath::kGemm: return gemm;
    case ExpertPath::kWgmma:
      return format.scaled() ? h::wgmma_fp8_supports(s.hidden, s.inter) : h::wgmma_supports(s.hidden, s.inter);
    default: return gemv || gemm;
  }
}

namespace {

// A layer's expert matrices as the kernels read them: count x [rows, cols] contiguous, bf16 or
// FP8 in 128 x 128 blocks.
const void* expert_matrices(const DeviceMatrix& m, int64_t rows, int64_t cols, int64_t count, const char* what) {
  MOE_CHECK(m.count == count && m.rows == rows && m.cols == cols && m.matrix_stride() == rows * cols,
            kInvalidArgument, "{}: {} x [{}, {}] (stride {}) where {} x [{}, {}] contiguous was expected", what,
            m.count, m.rows, m.cols, m.matrix_stride(), count, rows, cols);
  if (m.format == kFp8Blocks) return m.data;
  return m.bf16_data(what);
}

}  // namespace

Experts::Experts(const DeviceMatrix& gate_up, const DeviceMatrix& down, ExpertShape shape, int64_t max_tokens,
                 int device)
    : Experts(expert_matrices(gate_up, 2 * shape.inter, shape.hidden, shape.experts, "the experts' gate_up"),
              expert_matrices(down, shape.hidden, shape.inter, shape.experts, "the experts' down"), shape, max_tokens,
              device) {
  MOE_CHECK(gate_up.format == down.format, kUnsupported, "the experts' gate_up is {} but their down is {}",
            gate_up.format.name(), down.format.name());
  if (!gate_up.format.scaled()) return;
  MOE_CHECK(shape.inter % 128 == 0 && shape.hidden % 16 == 0, kUnsupported,
            "FP8 experts on CUDA need an intermediate width that is a multiple of 128 and a hidden width that "
            "is a multiple of 16; got {} and {}",
            shape.inter, shape.hidden);
  format_ = gate_up.format;
  gate_up_scales_ = gate_up.scales;
  down_scales_ = down.scales;
}

Experts::Experts(const void* gate_up, const void* down, ExpertShape shape, int64_t max_tokens,
                 int device)
    : gate_up_(gate_up), down_(down), shape_(shape), max_tokens_(max_tokens), device_(device) {
  check_shape(shape, max_tokens);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    MOE_THROW(kUnsupported, "no CUDA device {} (this machine has {})", device, count);
  }
  MOE_CHECK(gate_up != nullptr && down != nullptr, kInvalidArgument, "null expert weights");
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    major = minor = 0;
  }
  sm90_ = major == 9 && minor == 0;
}

size_t Experts::workspace_bytes(const ExpertShape& shape, int64_t max_tokens, const WeightFormat& format) {
  check_shape(shape, max_tokens);
  return layout(shape, max_tokens, format).total;
}

size_t Experts::weight_bytes() const {
  const size_t values = static_cast<size_t>(shape_.experts) * 3 * shape_.hidden * shape_.inter;
  if (!format_.scaled()) return values * 2;
  const auto blocks = [](int64_t n) { return static_cast<size_t>((n + 127) / 128); };
  const size_t scales = static_cast<size_t>(shape_.experts) *
                        (blocks(2 * shape_.inter) * blocks(shape_.hidden) + blocks(shape_.hidden) * blocks(shape_.inter));
  return values + scales * 4;
}

ExpertPath Experts::path_for(int64_t tokens) const {
  // FP8: the GEMV in its direct form where the wgmma W8A8 GEMM runs (prefer_gemv_fp8), else where the
  // bf16 experts would take it; the W8A8 GEMM past it.
  const bool wgmma = format_.scaled() ? h::wgmma_fp8_supports(shape_.hidden, shape_.inter)
                                      : h::wgmma_supports(shape_.hidden, shape_.inter);
  const ExpertPath large = sm90_ && wgmma ? ExpertPath::kWgmma : ExpertPath::kGemm;
  if (!h::gemm_supports(shape_.hidden, shape_.inter)) return ExpertPath::kGemv;
  if (!h::gemv_supports(shape_.hidden, shape_.inter)) return large;
  const bool gemv = format_.scaled() && large == ExpertPath::kWgmma
                        ? h::prefer_gemv_fp8(tokens, shape_.top_k, shape_.experts)
                        : h::prefer_gemv(tokens, shape_.top_k, shape_.experts);
  return gemv ? ExpertPath::kGemv : large;
}

void Experts::forward(const uint16_t* x, const int32_t* ids, const float* weights, int64_t tokens,
                      uint16_t* y, void* workspace, void* stream, ExpertPath path) const {
  MOE_CHECK(y != nullptr, kInvalidArgument, "null output");
  run(x, ids, weights, tokens, y, nullptr, nullptr, workspace, stream, path);
}

void Experts::forward_then_norm(const uint16_t* x, const int32_t* ids, const float* weights,
                                int64_t tokens, const NextNorm& next, void* workspace,
                                void* stream, ExpertPath path) const {
  MOE_CHECK(next.residual && next.weight && next.normed, kInvalidArgument,
            "the folded norm needs its residual, weight and output");
  MOE_CHECK(shape_.hidden <= 8192, kUnsupported, "the folded norm takes hidden up to 8192, got {}",
            shape_.hidden);
  MOE_CHECK(next.code_rows == 0 || (next.codes && next.scales && next.code_rows > 0 && next.code_rows <= tokens &&
                                    shape_.hidden % 128 == 0),
            kInvalidArgument, "the folded norm's {} FP8 rows of {} need codes, scales and a hidden of 128-column blocks",
            next.code_rows, tokens);
  run(x, ids, weights, tokens, nullptr, &next, nullptr, workspace, stream, path);
}

Experts::Partials Experts::forward_partials(const uint16_t* x, const int32_t* ids,
                                            const float* weights, int64_t tokens, void* workspace,
                                            void* stream, ExpertPath path) const {
  Partials p;
  run(x, ids, weights, tokens, nullptr, nullptr, &p, workspace, stream, path);
  return p;
}

Experts::Partials Experts::partials_of(int64_t tokens, void* workspace, ExpertPath path) const {
  Partials p;
  run(nullptr, nullptr, nullptr, tokens, nullptr, nullptr, &p, workspace, nullptr, path);
  return p;
}

// With `partials` set and x null, only describes the sums (partials_of); with x set, runs all
// but the combine (forward_partials).
void Experts::run(const uint16_t* x, const int32_t* ids, const float* weights, int64_t tokens,
                  uint16_t* y, const NextNorm* next, Partials* partials, void* workspace,
                  void* stream, ExpertPath path) const {
  MOE_CHECK(tokens >= 1 && tokens <= max_tokens_, kInvalidArgument,
            "{} tokens: this layer was set up for 1 to {}", tokens, max_tokens_);
  MOE_CHECK(workspace != nullptr, kInvalidArgument, "null workspace");
  if (path == ExpertPath::kAuto) path = path_for(tokens);
  MOE_CHECK(experts_support(shape_, path), kUnsupported,
            "the {} expert path cannot run hidden {} and intermediate {}", path_name(path),
            shape_.hidden, shape_.inter);
  MOE_CHECK(path != ExpertPath::kWgmma || sm90_, kUnsupported,
            "the wgmma expert path needs a device of compute capability 9.0");
  MOE_CHECK(path != ExpertPath::kGemv || !h::gemm_supports(shape_.hidden, shape_.inter) ||
                tokens <= h::kGemvMaxTokensBesideGemm,
            kUnsupported, "the GEMV expert path takes at most {} tokens here, got {}",
            h::kGemvMaxTokensBesideGemm, tokens);
  const Layout l = layout(shape_, max_tokens_, format_);
  auto* base = static_cast<unsigned char*>(workspace);
  kernels::ExpertBuffers b{};
  b.gate_up = gate_up_;
  b.down = down_;
  auto* st = static_cast<cudaStream_t>(stream);
  if (format_.scaled()) {
    MOE_CHECK(path != ExpertPath::kWgmma || h::wgmma_fp8_supports(shape_.hidden, shape_.inter), kUnsupported,
              "the wgmma expert path reads FP8 experts of hidden and intermediate widths that are multiples of "
              "128 only; got {} and {}",
              shape_.hidden, shape_.inter);
    MOE_CHECK(path == ExpertPath::kGemv || l.x_fp8 != 0, kUnsupported,
              "the GEMM expert path on FP8 experts needs them set up for token counts past the GEMV's (room for "
              "the quantised activations)");
    b.gate_up_scales = gate_up_scales_;
    b.down_scales = down_scales_;
    if (l.x_fp8 != 0) {
      b.x_fp8 = base + l.x_fp8;
      b.x_scales = reinterpret_cast<float*>(base + l.x_scales);
      b.act_fp8 = base + l.act_fp8;
      b.act_scales = reinterpret_cast<float*>(base + l.act_scales);
    }
  }
  b.offsets = reinterpret_cast<int*>(base + l.offsets);
  b.order = reinterpret_cast<int*>(base + l.order);
  b.active = reinterpret_cast<int*>(base + l.active);
  b.num_active = reinterpret_cast<int*>(base + l.num_active);
  b.tile_expert = reinterpret_cast<int*>(base + l.tile_expert);
  b.tile_row = reinterpret_cast<int*>(base + l.tile_row);
  b.num_tiles = reinterpret_cast<int*>(base + l.num_tiles);
  b.plan_counts = reinterpret_cast<int*>(base + l.plan_counts);
  b.act = base + l.act;
  b.part = base + l.part;
  b.experts = static_cast<int>(shape_.experts);
  b.hidden = static_cast<int>(shape_.hidden);
  b.inter = static_cast<int>(shape_.inter);
  b.top_k = static_cast<int>(shape_.top_k);
  if (next)
    b.norm = kernels::ResidualNorm{next->residual, next->weight, next->eps, next->normed,
                                   next->codes,    next->scales, static_cast<int>(next->code_rows)};
  const int m = static_cast<int>(tokens);
  kernels::PartialSums sums;
  if (partials) b.leave_partials = &sums;
  // The wgmma row tiles: FP8 runs one tile of 64 or 128 rows (heuristics::wgmma_fp8_tile_m).
  const bool fp8 = format_.scaled();
  const int wgmma_tile = fp8 ? h::wgmma_fp8_tile_m(tokens, shape_.top_k, shape_.experts)
                             : h::wgmma_tile_m(tokens, shape_.top_k, shape_.experts);
  const int wgmma_alt = fp8 ? 0 : h::wgmma_alt_tile(tokens, shape_.top_k, shape_.experts);
  if (partials && x == nullptr) {  // describe only
    if (path == ExpertPath::kWgmma)
      MOE_CUDA_CHECK(kernels::wgmma_partial_sums(b, m, wgmma_tile, &sums));
    else
      sums.bf16 = path == ExpertPath::kGemm;
  } else if (path == ExpertPath::kGemv) {
    MOE_CUDA_CHECK(kernels::launch_decode(b, x, ids, weights, m, y, st));
  } else {
    if (path == ExpertPath::kWgmma)
      MOE_CUDA_CHECK(kernels::launch_prefill_wgmma(b, x, ids, weights, m, wgmma_tile, y, st, wgmma_alt));
    else
      MOE_CUDA_CHECK(kernels::launch_prefill(
          b, x, ids, weights, m, h::gemm_tile_m(tokens, shape_.top_k, shape_.experts), y, st));
  }
  if (partials) *partials = Partials{b.part, sums.bf16, sums.splits, sums.split_stride};
}

struct DecodeExperts::State {
  std::vector<void*> owned;
  std::unique_ptr<Experts> core;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  void* alloc(size_t bytes) {
    void* p = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
    owned.push_back(p);
    return p;
  }
};

DecodeExperts::DecodeExperts(const ExpertWeights& host, int64_t max_tokens, int64_t top_k, int device)
    : s_(std::make_unique<State>()) {
  const ExpertShape shape{host.num_local, host.hidden, host.inter, top_k};
  check_shape(shape, max_tokens);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    MOE_THROW(kUnsupported, "no CUDA device {} (this machine has {})", device, count);
  }
  MOE_CUDA_CHECK(cudaSetDevice(device));
  State& s = *s_;
  try {
    auto upload = [&](const Tensor& t) {
      std::vector<uint16_t> bits(static_cast<size_t>(t.numel()));
      for (size_t i = 0; i < bits.size(); ++i) bits[i] = f32_to_bf16(t.data<float>()[i]);
      void* d = s.alloc(bits.size() * 2);
      MOE_CUDA_CHECK(cudaMemcpy(d, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
      return d;
    };
    const void* gate_up = upload(host.gate_up);
    const void* down = upload(host.down);
    s.workspace_bytes = Experts::workspace_bytes(shape, max_tokens);
    s.workspace = s.alloc(s.workspace_bytes);
    s.core = std::make_unique<Experts>(gate_up, down, shape, max_tokens, device);
  } catch (...) {
    for (void* p : s.owned) cudaFree(p);
    s.owned.clear();
    throw;
  }
}

DecodeExperts::~DecodeExperts() {
  if (s_)
    for (void* p : s_->owned) cudaFree(p);
}

void DecodeExperts::forward(const uint16_t* x, const int32_t* ids, const float* weights,
                            int64_t tokens, uint16_t* y, void* stream, ExpertPath path) const {
  s_->core->forward(x, ids, weights, tokens, y, s_->workspace, stream, path);
}

const Experts& DecodeExperts::core() const { return *s_->core; }
size_t DecodeExperts::weight_bytes() const { return s_->core->weight_bytes(); }
size_t DecodeExperts::workspace_bytes() const { return s_->workspace_bytes; }

}  // namespace moe::cuda
