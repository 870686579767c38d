// FP8 block-scaled weights on the GPU (E4M3 codes, one f32 scale per 128 x 128 block) against
// the CPU reference on the exactly dequantised weights: the routed experts' GEMV path reading the
// codes (one token, the direct and the grouped forms) and their W8A8 GEMM paths past it (mma.sync,
// and wgmma on sm_90), on ragged routing, idle experts, every token on one expert and widths with
// partial edge blocks;
// the dense projection's FP8 GEMV, its tensor-core kernel for 4-32 rows (every code widened
// exactly), its W8A8 form on cuBLASLt's block-scaled GEMM and its widened cuBLASLt form; and the engine's weight store
// holding a checkpoint's FP8 tensors as stored (its bytes are those of the files, not a bf16
// copy), also for a GPU's share of the attention heads under tp. Outputs poisoned first. Skipped, visibly, where no CUDA device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <cstdio>
#include <fstream>
#include <random>
#include <tuple>

#include <nlohmann/json.hpp>

#include "backend/cuda/engine/device_model.h"
#include "backend/cuda/engine/projection.h"
#include "backend/cuda/moe/moe_heuristics.h"
#include "backend/cuda/ops/fill_launch.h"
#include "backend/cuda/ops/fp8_blocks_launch.h"
#include "backend/cuda/ops/gemm_fp8_rows_launch.h"
#include "backend/cuda_engine.h"
#include "backend/cuda_moe.h"
#include "gpu_test_util.h"
#include "io/checkpoint.h"
#include "model/config.h"
#include "moe/experts.h"
#include "../unit/test_util.h"

namespace moe {
namespace {

using cuda::ExpertPath;
using gputest::DeviceBuffer;

int64_t blocks(int64_t n) { return (n + 127) / 128; }

// count x [rows, cols] FP8 weights: random codes (no NaN), a random scale per block, and the
// f32 values code x scale that the CPU loader dequantises to.
struct Fp8Matrices {
  std::vector<uint8_t> codes;
  std::vector<float> scales, values;
};

Fp8Matrices random_fp8(int64_t count, int64_t rows, int64_t cols, float magnitude, std::mt19937& rng) {
  Fp8Matrices m;
  const size_t n = static_cast<size_t>(count * rows * cols);
  m.codes.resize(n);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& q : m.codes) {
    do q = static_cast<uint8_t>(byte(rng));
    while ((q & 0x7f) == 0x7f);  // NaN
  }
  m.scales.resize(static_cast<size_t>(count * blocks(rows) * blocks(cols)));
  std::uniform_real_distribution<float> spread(0.5f, 2.0f);
  for (auto& s : m.scales) s = spread(rng) * magnitude / 448.0f;
  m.values.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t c = static_cast<int64_t>(i) % cols, r = static_cast<int64_t>(i) / cols % rows,
                  e = static_cast<int64_t>(i) / cols / rows;
    m.values[i] = f8e4m3_to_f32(m.codes[i]) * m.scales[static_cast<size_t>((e * blocks(rows) + r / 128) * blocks(cols) + c / 128)];
  }
  return m;
}

// sqrt(Σ (y - want)² / Σ want²) over rows [from, to) and the first n columns of y (rows ldy
// apart); infinite where an output is not finite (a poisoned one left unwritten).
double relative_error(const std::vector<float>& y, int64_t ldy, int64_t n, int64_t from, int64_t to,
                      const std::function<double(int64_t, int64_t)>& want) {
  double num = 0, den = 0;
  for (int64_t i = from; i < to; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const double got = y[static_cast<size_t>(i * ldy + j)], w = want(i, j);
      if (!std::isfinite(got)) return INFINITY;
      num += (got - w) * (got - w);
      den += w * w;
    }
  return std::sqrt(num / den);
}

cuda::DeviceMatrix fp8_matrix(const DeviceBuffer<uint8_t>& codes, const DeviceBuffer<float>& scales, int64_t count,
                              int64_t rows, int64_t cols) {
  cuda::DeviceMatrix m;
  m.data = codes.get();
  m.format = cuda::kFp8Blocks;
  m.scales = scales.get();
  m.rows = rows;
  m.cols = cols;
  m.count = count;
  return m;
}

struct Fp8Layer {
  ExpertWeights w;  // the dequantised values, for the reference
  DeviceBuffer<uint8_t> gate_up, down;
  DeviceBuffer<float> gate_up_scales, down_scales;
};

Fp8Layer make_layer(int64_t experts, int64_t hidden, int64_t inter, std::mt19937& rng) {
  const Fp8Matrices gu = random_fp8(experts, 2 * inter, hidden, 0.08f, rng);
  const Fp8Matrices dn = random_fp8(experts, hidden, inter, 0.08f, rng);
  Fp8Layer l{zero_experts(experts, hidden, inter), DeviceBuffer<uint8_t>(gu.codes), DeviceBuffer<uint8_t>(dn.codes),
             DeviceBuffer<float>(gu.scales), DeviceBuffer<float>(dn.scales)};
  std::copy(gu.values.begin(), gu.values.end(), l.w.gate_up.data<float>());
  std::copy(dn.values.begin(), dn.values.end(), l.w.down.data<float>());
  return l;
}

// The GEMV path reads the codes and bf16 activations: the bf16 experts' bound (test_cuda_moe.cpp;
// act and the partial sums are rounded to bf16). The GEMM path is W8A8: x and act are quantised
// to E4M3 per row and 128 columns, each value to within 2^-4 of itself (about 3.6% RMS), once
// before gate_up and once before down, which leaves the output about 5-6% off the exact product.
constexpr double kGemvBound = 1e-2;
constexpr double kW8A8Bound = 1e-1;

// The error of a run against the bound of the path it took, and its output.
struct Checked {
  double rel;
  ExpertPath path;
  std::vector<float> y;
  bool ok() const { return rel <= (path == ExpertPath::kGemv ? kGemvBound : kW8A8Bound); }
};

// The Hopper path's code is sm_90a: it runs on compute capability 9.0 only.
using gputest::device_is_sm90;

// Relative Frobenius error of the GPU experts on FP8 weights against run_experts on their
// values, over up to 64 rows spread across the tokens (every row checked for poison).
Checked expert_error(const Fp8Layer& l, int64_t tokens, int64_t k, const std::vector<int32_t>& ids, ExpertPath path,
                     int64_t max_tokens, std::mt19937& rng) {
  const int64_t hidden = l.w.hidden;
  const cuda::ExpertShape shape{l.w.num_local, hidden, l.w.inter, k};
  const cuda::Experts gpu(fp8_matrix(l.gate_up, l.gate_up_scales, shape.experts, 2 * shape.inter, hidden),
                          fp8_matrix(l.down, l.down_scales, shape.experts, hidden, shape.inter), shape, max_tokens);
  DeviceBuffer<unsigned char> ws(cuda::Experts::workspace_bytes(shape, max_tokens, cuda::kFp8Blocks));
  ws.poison();
  if (path == ExpertPath::kAuto) path = gpu.path_for(tokens);
  const auto x = gputest::random_bf16_exact(static_cast<size_t>(tokens * hidden), rng, 1.0f);
  std::vector<float> weights(ids.size());
  for (auto& v : weights) v = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);
  DeviceBuffer<uint16_t> dx(gputest::to_bf16(x)), dy(static_cast<size_t>(tokens * hidden));
  DeviceBuffer<int32_t> dids(ids);
  DeviceBuffer<float> dw(weights);
  dy.poison();
  gpu.forward(dx.get(), dids.get(), dw.get(), tokens, dy.get(), ws.get(), nullptr, path);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> y = gputest::from_bf16(dy.download());
  for (float v : y)
    if (!std::isfinite(v)) return Checked{INFINITY, path, y};

  std::vector<int64_t> rows;
  for (int64_t t = 0; t < tokens; t += std::max<int64_t>(1, tokens / 64)) rows.push_back(t);
  const TokenSample sample = sample_tokens(rows, hidden, k, ids, weights, [&](int64_t t, float* row) {
    std::copy_n(x.begin() + t * hidden, hidden, row);
  });
  std::vector<int32_t> all(static_cast<size_t>(l.w.num_local));
  for (size_t e = 0; e < all.size(); ++e) all[e] = static_cast<int32_t>(e);
  ThreadPool pool(0);
  Arena arena("ws", 1 << 20);
  ExpertPlan plan;
  Tensor ref = Tensor::zeros({sample.x.dim(0), hidden});
  run_experts(ExecMode::kNaive, pool, arena, l.w, all, sample.x, sample.ids.data(), sample.weights.data(), k, ref,
              plan);
  double num = 0, den = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    for (int64_t h = 0; h < hidden; ++h) {
      const double got = y[static_cast<size_t>(rows[i] * hidden + h)], want = ref.data<float>()[static_cast<int64_t>(i) * hidden + h];
      num += (got - want) * (got - want);
      den += want * want;
    }
  return Checked{den > 0 ? std::sqrt(num / den) : INFINITY, path, y};
}

// Relative Frobenius distance of two outputs over every element.
double distance(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * static_cast<double>(a[i] - b[i]);
    den += b[i] * static_cast<double>(b[i]);
  }
  return den > 0 ? std::sqrt(num / den) : INFINITY;
}

// k distinct experts per token drawn with weight skew^e: ragged, the last experts idle for
// small skew.
std::vector<int32_t> route(int64_t experts, int64_t tokens, int64_t k, double skew, std::mt19937& rng) {
  std::vector<double> p(static_cast<size_t>(experts));
  for (size_t e = 0; e < p.size(); ++e) p[e] = std::pow(skew, static_cast<double>(e));
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < tokens; ++t) {
    const auto pick = gputest::draw_experts(p, k, rng);
    ids.insert(ids.end(), pick.begin(), pick.end());
  }
  return ids;
}

TEST(CudaFp8, ExpertsOnTheQwenShapeFromDecodeToPrefill) {
  REQUIRE_GPU();
  std::mt19937 rng(11);
  const Fp8Layer l = make_layer(128, 2048, 768, rng);
  // 2000 tokens: 125 rows an expert, 128-row tiles on the Hopper path. 16 tokens route as many
  // rows as there are experts, the last M on the Hopper path's blocks of 128 weight rows; 17 the
  // first on its blocks of 256 (wgmma_fp8_narrow_tiles).
  for (int64_t tokens : {1, 3, 8, 16, 17, 33, 200, 300, 2000}) {
    const auto ids = route(128, tokens, 8, 0.97, rng);
    for (ExpertPath p : {ExpertPath::kAuto, ExpertPath::kGemv, ExpertPath::kGemm, ExpertPath::kWgmma}) {
      if (p == ExpertPath::kGemv && tokens > 256) continue;
      if (p == ExpertPath::kWgmma && !device_is_sm90()) continue;
      const Checked c = expert_error(l, tokens, 8, ids, p, 2048, rng);
      EXPECT_TRUE(c.ok()) << "M=" << tokens << " path " << static_cast<int>(c.path) << ": " << c.rel;
      std::printf("qwen shape M=%lld path %d: rel %.2e\n", static_cast<long long>(tokens), static_cast<int>(c.path), c.rel);
    }
  }
}

TEST(CudaFp8, PartialEdgeBlocksIdleExpertsAndOneExpertForAll) {
  REQUIRE_GPU();
  std::mt19937 rng(12);
  // hidden 448: three and a half blocks of columns (gate_up) and of rows (down).
  const Fp8Layer l = make_layer(16, 448, 256, rng);
  for (int64_t tokens : {1, 4, 40, 150, 280}) {
    for (ExpertPath p : {ExpertPath::kAuto, ExpertPath::kGemv, ExpertPath::kGemm}) {
      if (p == ExpertPath::kGemv && tokens > 256) continue;
      const Checked skewed = expert_error(l, tokens, 4, route(16, tokens, 4, 0.5, rng), p, 300, rng);
      EXPECT_TRUE(skewed.ok()) << "skewed, M=" << tokens << " path " << static_cast<int>(skewed.path) << ": " << skewed.rel;
      const std::vector<int32_t> one(static_cast<size_t>(tokens), 5);  // top-1, all on expert 5
      const Checked all = expert_error(l, tokens, 1, one, p, 300, rng);
      EXPECT_TRUE(all.ok()) << "one expert, M=" << tokens << " path " << static_cast<int>(all.path) << ": " << all.rel;
    }
  }
}

// The Hopper W8A8 GEMM (wgmma on E4M3, stages of one scale block) against the CPU and against
// the mma.sync W8A8 GEMM on every element: both quantise the same activations and scale the same
// products, so they differ only by f32 summation order (and the bf16 roundings it can flip).
// hidden 384: down's 256-column tiles end past the last row block; 16 experts leave the grids
// small, so 64-row tiles take 128 weight rows and down splits k; one expert for all takes
// several 128-row tiles of one expert.
TEST(CudaFp8, HopperGemmMatchesTheCpuAndTheMmaSyncGemm) {
  REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the wgmma path needs compute capability 9.0";
  std::mt19937 rng(15);
  const Fp8Layer l = make_layer(16, 384, 256, rng);
  for (int64_t tokens : {10, 40, 150, 280, 1000}) {
    struct Case {
      const char* what;
      int64_t k;
      std::vector<int32_t> ids;
    };
    const std::vector<Case> cases = {{"skewed", 4, route(16, tokens, 4, 0.5, rng)},
                                     {"one expert", 1, std::vector<int32_t>(static_cast<size_t>(tokens), 5)}};
    for (const Case& c : cases) {
      const uint32_t seed = rng();
      std::mt19937 a(seed), b(seed);  // the same activations and routing weights for both paths
      const Checked wgmma = expert_error(l, tokens, c.k, c.ids, ExpertPath::kWgmma, 1024, a);
      const Checked gemm = expert_error(l, tokens, c.k, c.ids, ExpertPath::kGemm, 1024, b);
      EXPECT_TRUE(wgmma.ok()) << c.what << ", M=" << tokens << ": " << wgmma.rel;
      EXPECT_TRUE(gemm.ok()) << c.what << ", M=" << tokens << ": " << gemm.rel;
      const double d = distance(wgmma.y, gemm.y);
      EXPECT_LE(d, 1e-2) << c.what << ", M=" << tokens;
      std::printf("%s M=%lld: wgmma rel %.2e, mma.sync rel %.2e, apart %.2e\n", c.what,
                  static_cast<long long>(tokens), wgmma.rel, gemm.rel, d);
    }
  }
}

// FP8 wgmma items of 64 rows x 256 weight rows quantise act in gate_up's epilogue (the two
// consumers agreeing on each row's scale), where the mma.sync GEMM runs the separate quantising
// kernel on bf16 act. Both are meant to give down the same codes and scales, so the two paths
// may differ only as the test above allows. 32 experts of hidden 1024 keep the 64-row blocks
// wide (checked first: otherwise this would test the other tiles); inter 384 gives each row
// three scale blocks; the skewed routing gives the first experts several tiles and the last
// ones partial ones.
TEST(CudaFp8, HopperActQuantisedInTheEpilogueMatchesTheQuantisingKernel) {
  REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the wgmma path needs compute capability 9.0";
  namespace hx = cuda::heuristics;
  int device = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  std::mt19937 rng(16);
  const int64_t experts = 32, hidden = 1024, inter = 384, k = 4;
  const Fp8Layer l = make_layer(experts, hidden, inter, rng);
  for (int64_t tokens : {60, 300}) {
    const int64_t slots = tokens * k;
    ASSERT_EQ(hx::wgmma_fp8_tile_m(tokens, k, experts), 64) << "M=" << tokens;
    ASSERT_FALSE(hx::wgmma_narrow_tiles(hx::max_row_tiles(slots, experts, 64), hidden, sms) ||
                 hx::wgmma_fp8_narrow_tiles(slots, experts))
        << "M=" << tokens << ": the 64-row blocks would be narrow";
    const auto ids = route(experts, tokens, k, 0.97, rng);
    const uint32_t seed = rng();
    std::mt19937 a(seed), b(seed);  // the same activations and routing weights for both paths
    const Checked wgmma = expert_error(l, tokens, k, ids, ExpertPath::kWgmma, 512, a);
    const Checked gemm = expert_error(l, tokens, k, ids, ExpertPath::kGemm, 512, b);
    EXPECT_TRUE(wgmma.ok()) << "M=" << tokens << ": " << wgmma.rel;
    EXPECT_TRUE(gemm.ok()) << "M=" << tokens << ": " << gemm.rel;
    const double d = distance(wgmma.y, gemm.y);
    EXPECT_LE(d, 1e-2) << "M=" << tokens;
    std::printf("act quantised in the epilogue, M=%lld: wgmma rel %.2e, mma.sync rel %.2e, apart %.2e\n",
                static_cast<long long>(tokens), wgmma.rel, gemm.rel, d);
  }
}

// The same for 128-row tiles (128 x 256 items quantise act in their epilogue, whole scale blocks
// a consumer; 128 x 128 items leave it to the quantising kernel). Token counts that take 128-row
// tiles (checked first), with skewed routing so that some experts have several tiles and others
// a partial one.
TEST(CudaFp8, HopperActOf128RowTilesMatchesTheQuantisingKernel) {
  REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the wgmma path needs compute capability 9.0";
  std::mt19937 rng(17);
  const int64_t experts = 32, hidden = 1024, inter = 384, k = 4;
  const Fp8Layer l = make_layer(experts, hidden, inter, rng);
  for (int64_t tokens : {1100, 2600}) {
    ASSERT_EQ(cuda::heuristics::wgmma_fp8_tile_m(tokens, k, experts), 128) << "M=" << tokens;
    const auto ids = route(experts, tokens, k, 0.97, rng);
    const uint32_t seed = rng();
    std::mt19937 a(seed), b(seed);
    const Checked wgmma = expert_error(l, tokens, k, ids, ExpertPath::kWgmma, 4096, a);
    const Checked gemm = expert_error(l, tokens, k, ids, ExpertPath::kGemm, 4096, b);
    EXPECT_TRUE(wgmma.ok()) << "M=" << tokens << ": " << wgmma.rel;
    EXPECT_TRUE(gemm.ok()) << "M=" << tokens << ": " << gemm.rel;
    const double d = distance(wgmma.y, gemm.y);
    EXPECT_LE(d, 1e-2) << "M=" << tokens;
    std::printf("128-row tiles, M=%lld: wgmma rel %.2e, mma.sync rel %.2e, apart %.2e\n",
                static_cast<long long>(tokens), wgmma.rel, gemm.rel, d);
  }
}

// The block width of the FP8 wgmma path at the row counts it was measured at (H100, 2026-11-27,
// bench/gpu_fp8_decode_h100.md): 128 weight rows while the routed rows are at most the experts, else
// the general rule's, which for these shapes is 256.
TEST(CudaFp8, HopperBlocksNarrowOnlyWhereExpertsAverageAtMostOneRow) {
  namespace hx = cuda::heuristics;
  struct Shape {
    int64_t experts, top_k, hidden;
  };
  const Shape qwen{128, 8, 2048}, deepseek{256, 8, 7168};
  for (const auto& [shape, tokens, narrow] : {std::tuple{qwen, 4, true}, {qwen, 8, true}, {qwen, 16, true},
                                              {qwen, 17, false}, {qwen, 32, false}, {deepseek, 8, true},
                                              {deepseek, 32, true}, {deepseek, 64, false}}) {
    const int64_t slots = tokens * shape.top_k;
    EXPECT_EQ(hx::wgmma_fp8_narrow_tiles(slots, shape.experts), narrow) << "M=" << tokens;
    const int tile = hx::wgmma_fp8_tile_m(tokens, shape.top_k, shape.experts);
    EXPECT_FALSE(hx::wgmma_narrow_tiles(hx::max_row_tiles(slots, shape.experts, tile), shape.hidden, 132))
        << "M=" << tokens << ": the general rule alone would already narrow the blocks";
  }
}

TEST(CudaFp8, ExpertsRefuseWhatTheyCannotRun) {
  REQUIRE_GPU();
  std::mt19937 rng(13);
  const Fp8Layer l = make_layer(4, 256, 192, rng);  // inter 192: the up half starts inside a block
  const cuda::ExpertShape shape{4, 256, 192, 2};
  std::string why;
  EXPECT_EQ(test::error_kind_of(
                [&] {
                  cuda::Experts e(fp8_matrix(l.gate_up, l.gate_up_scales, 4, 384, 256),
                                  fp8_matrix(l.down, l.down_scales, 4, 256, 192), shape, 8);
                },
                &why),
            ErrorKind::kUnsupported);
  EXPECT_NE(why.find("multiple of 128"), std::string::npos) << why;
  // Set up for token counts the GEMV takes (8 tokens spread over 64 experts): no room for the
  // quantised activations of a forced GEMM path.
  const Fp8Layer ok = make_layer(64, 256, 128, rng);
  const cuda::ExpertShape s2{64, 256, 128, 2};
  const cuda::Experts e(fp8_matrix(ok.gate_up, ok.gate_up_scales, 64, 256, 256),
                        fp8_matrix(ok.down, ok.down_scales, 64, 256, 128), s2, 8);
  DeviceBuffer<unsigned char> ws(cuda::Experts::workspace_bytes(s2, 8, cuda::kFp8Blocks));
  DeviceBuffer<uint16_t> x(256 * 2), y(256 * 2);
  DeviceBuffer<int32_t> ids(std::vector<int32_t>{0, 1, 2, 3});
  DeviceBuffer<float> w(std::vector<float>{1, 1, 1, 1});
  EXPECT_EQ(test::error_kind_of(
                [&] { e.forward(x.get(), ids.get(), w.get(), 2, y.get(), ws.get(), nullptr, ExpertPath::kGemm); }, &why),
            ErrorKind::kUnsupported);
  EXPECT_NE(why.find("FP8"), std::string::npos) << why;
  // The Hopper path takes stages of one 128-column block: hidden 448 goes to the mma.sync GEMM.
  if (device_is_sm90()) {
    const Fp8Layer edge = make_layer(4, 448, 256, rng);
    const cuda::ExpertShape s3{4, 448, 256, 2};
    const cuda::Experts e3(fp8_matrix(edge.gate_up, edge.gate_up_scales, 4, 512, 448),
                           fp8_matrix(edge.down, edge.down_scales, 4, 448, 256), s3, 64);
    EXPECT_EQ(e3.path_for(64), ExpertPath::kGemm);
    DeviceBuffer<unsigned char> ws3(cuda::Experts::workspace_bytes(s3, 64, cuda::kFp8Blocks));
    DeviceBuffer<uint16_t> x3(448 * 2), y3(448 * 2);
    EXPECT_EQ(test::error_kind_of(
                  [&] { e3.forward(x3.get(), ids.get(), w.get(), 2, y3.get(), ws3.get(), nullptr, ExpertPath::kWgmma); },
                  &why),
              ErrorKind::kUnsupported);
    EXPECT_NE(why.find("multiples of 128"), std::string::npos) << why;
  }
}

// The dense projection: y = x · wᵀ in f32 for rows 1 to 32 (the GEMV on the codes for 1-2 rows,
// the tensor-core kernel on them from 3: the weights are exact, only f32 summation order
// differs from the double reference) and 40 (widened to bf16 for cuBLASLt: each weight rounded
// to bf16).
TEST(CudaFp8, DenseProjectionWithPartialBlocks) {
  REQUIRE_GPU();
  std::mt19937 rng(14);
  const int64_t n = 300, k = 464;  // neither a multiple of 128
  const Fp8Matrices w = random_fp8(1, n, k, 0.05f, rng);
  DeviceBuffer<uint8_t> codes(w.codes);
  DeviceBuffer<float> scales(w.scales);
  cuda::Blas blas;
  blas.reserve_widened(static_cast<size_t>(n * k));
  for (int64_t m : {1, 2, 3, 4, 5, 8, 9, 10, 16, 17, 24, 31, 32, 40}) {
    const auto x = gputest::random_bf16_exact(static_cast<size_t>(m * k), rng, 1.0f);
    DeviceBuffer<uint16_t> dx(gputest::to_bf16(x));
    DeviceBuffer<float> dy(static_cast<size_t>(m * n));
    dy.poison();
    cuda::project(blas, dx.get(), fp8_matrix(codes, scales, 1, n, k), dy.get(), cuda::OutType::kF32, m, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const double error = relative_error(dy.download(), n, n, 0, m, [&](int64_t i, int64_t j) {
      double want = 0;
      for (int64_t c = 0; c < k; ++c)
        want += static_cast<double>(x[static_cast<size_t>(i * k + c)]) * w.values[static_cast<size_t>(j * k + c)];
      return want;
    });
    EXPECT_LE(error, m <= cuda::kernels::kFp8RowsMaxRows ? 1e-5 : 5e-3) << "m=" << m;
  }
}

// The tensor-core kernel widens each E4M3 code to bf16 exactly and puts each product where it
// belongs: with one non-zero x per row (a power of two at a column that moves with the row), each
// output is one code times its block's scale, exactly. Every finite code, subnormals and both
// zeros included, sits at the probed columns of some weight row; rows past a 16-row tile, and
// row counts 1-32 that leave x tiles partly empty, check the fragment layout; the scales differ
// per block in both directions.
TEST(CudaFp8, RowsKernelReadsEveryCodeExactlyWhereItBelongs) {
  REQUIRE_GPU();
  const int n = 300, k = 384;  // three column blocks; the last row block partial
  std::vector<uint8_t> codes(static_cast<size_t>(n * k));
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < k; ++c) {
      const uint8_t q = static_cast<uint8_t>((r * 7 + c * 13) % 256);
      codes[static_cast<size_t>(r * k + c)] = (q & 0x7f) == 0x7f ? 0 : q;  // no NaN
    }
  std::vector<float> scales(static_cast<size_t>(blocks(n) * blocks(k)));
  for (size_t b = 0; b < scales.size(); ++b) scales[b] = std::ldexp(1.0f, static_cast<int>(b % 5) - 2);
  DeviceBuffer<uint8_t> dw(codes);
  DeviceBuffer<float> ds(scales);
  for (int m : {1, 4, 8, 9, 15, 16, 17, 23, 24, 25, 31, 32}) {
    std::vector<float> x(static_cast<size_t>(m * k), 0.0f);
    auto column = [&](int i) { return (i * 37 + 5) % k; };
    for (int i = 0; i < m; ++i) x[static_cast<size_t>(i * k + column(i))] = std::ldexp(1.0f, i % 3);
    DeviceBuffer<uint16_t> dx(gputest::to_bf16(x));
    DeviceBuffer<float> dy(static_cast<size_t>(m * n));
    dy.poison();
    ASSERT_EQ(cuda::kernels::gemm_fp8_rows(dx.get(), dw.get(), ds.get(), dy.get(), true, m, n, k, n, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto y = dy.download();
    int wrong = 0;
    for (int i = 0; i < m; ++i)
      for (int r = 0; r < n; ++r) {
        const int c = column(i);
        const float want = f8e4m3_to_f32(codes[static_cast<size_t>(r * k + c)]) *
                           scales[static_cast<size_t>((r / 128) * blocks(k) + c / 128)] * std::ldexp(1.0f, i % 3);
        const float got = y[static_cast<size_t>(i * n + r)];
        if (!(got == want) && wrong++ < 5) ADD_FAILURE() << "m=" << m << " y[" << i << "][" << r << "] = " << got << ", want " << want;
      }
    EXPECT_EQ(wrong, 0) << "m=" << m;
  }
  // Outside its limits it declines with nothing launched.
  DeviceBuffer<float> dy(33 * n);
  DeviceBuffer<uint16_t> dx(33 * k);
  EXPECT_EQ(cuda::kernels::gemm_fp8_rows(dx.get(), dw.get(), ds.get(), dy.get(), true, 33, n, k, n, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::kernels::gemm_fp8_rows(dx.get(), dw.get(), ds.get(), dy.get(), true, 8, n, 120, n, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::kernels::gemm_fp8_rows(dx.get(), dw.get(), nullptr, dy.get(), true, 8, n, k, n, nullptr),
            cudaErrorInvalidValue);
}

// cuBLASLt's block-scaled W8A8 GEMM against the product of exactly what it is given: x quantised
// on the device (its codes and block-major scales downloaded) times the FP8 weights, both decoded
// exactly, so only summation order separates them. Row counts it does not take, and misaligned
// weight scales, are declined with nothing written.
TEST(CudaFp8, BlockScaledGemmMatchesTheQuantisedProduct) {
  REQUIRE_GPU();
  std::mt19937 rng(15);
  const int64_t n = 300, k = 512, kb = k / 128;  // n not a multiple of 128
  // Two matrices of one shape, run in turn through one Blas: each call must use its own scales.
  const Fp8Matrices w[2] = {random_fp8(1, n, k, 0.05f, rng), random_fp8(1, n, k, 0.2f, rng)};
  std::vector<float> shifted = w[0].scales;
  shifted.insert(shifted.begin(), 0.0f);
  DeviceBuffer<uint8_t> codes[2] = {DeviceBuffer<uint8_t>(w[0].codes), DeviceBuffer<uint8_t>(w[1].codes)};
  DeviceBuffer<float> scales[2] = {DeviceBuffer<float>(w[0].scales), DeviceBuffer<float>(w[1].scales)};
  DeviceBuffer<float> misaligned(shifted);
  cuda::Blas blas;
  for (int64_t m : {12, 16, 40, 300}) {
    const auto x = gputest::random_bf16_exact(static_cast<size_t>(m * k), rng, 1.0f);
    DeviceBuffer<uint16_t> dx(gputest::to_bf16(x));
    DeviceBuffer<uint8_t> xq(static_cast<size_t>(m * k));
    DeviceBuffer<float> xs(static_cast<size_t>(m * kb));
    ASSERT_EQ(cuda::kernels::quantize_rows_fp8_by_block(dx.get(), static_cast<int>(m), static_cast<int>(k), xq.get(),
                                                        xs.get(), nullptr),
              cudaSuccess);
    const auto q = xq.download();
    const auto s = xs.download();
    for (int which : {0, 1, 0}) {
      DeviceBuffer<float> dy(static_cast<size_t>(m * n));
      dy.poison();
      ASSERT_TRUE(blas.linear_fp8_blocks(xq.get(), xs.get(), codes[which].get(), scales[which].get(), dy.get(),
                                         cuda::OutType::kF32, m, n, k, nullptr))
          << "m=" << m;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const double error = relative_error(dy.download(), n, n, 0, m, [&](int64_t i, int64_t j) {
        double want = 0;
        for (int64_t c = 0; c < k; ++c)
          want += static_cast<double>(f8e4m3_to_f32(q[static_cast<size_t>(i * k + c)])) *
                  s[static_cast<size_t>(c / 128 * m + i)] * w[which].values[static_cast<size_t>(j * k + c)];
        return want;
      });
      // Measured 2.3e-4 on an H100: cuBLASLt's FP8 products are summed in f32 per block.
      EXPECT_LE(error, 1e-3) << "m=" << m << ", matrix " << which;
    }
    DeviceBuffer<float> dy(static_cast<size_t>(m * n));
    EXPECT_FALSE(blas.linear_fp8_blocks(xq.get(), xs.get(), codes[0].get(), misaligned.get() + 1, dy.get(),
                                        cuda::OutType::kF32, m, n, k, nullptr));
  }
  // Declined: 10 rows (not a multiple of 4), and k of one block (its scale rows would be padded).
  DeviceBuffer<uint8_t> xq(static_cast<size_t>(12 * k));
  DeviceBuffer<float> xs(static_cast<size_t>(12 * kb));
  EXPECT_FALSE(blas.linear_fp8_blocks(xq.get(), xs.get(), codes[0].get(), scales[0].get(), xs.get(),
                                      cuda::OutType::kF32, 10, n, k, nullptr));
  EXPECT_FALSE(blas.linear_fp8_blocks(xq.get(), xs.get(), codes[0].get(), scales[0].get(), xs.get(),
                                      cuda::OutType::kF32, 12, n, 128, nullptr));
}

// The dense projection past 32 rows: W8A8 on the block-scaled GEMM for the rows in multiples of
// four, the GEMV on the codes for the one to three after them; up to 32 rows the codes are read
// directly. Into every other row of a wider output (ldy) whose other columns stay untouched.
// Against the exactly dequantised weights: the direct and GEMV rows within f32 summation, the
// W8A8 rows within the activation rounding of E4M3. Widths of one or two 128-column blocks (the
// tiny fixtures') take the widened bf16 form past 32 rows instead.
TEST(CudaFp8, DenseProjectionPastTheGemvRunsW8A8) {
  REQUIRE_GPU();
  std::mt19937 rng(16);
  struct Shape {
    int64_t n, k, ldy;
    bool bf16;
  };
  // A partial column block into a wider output; the tiny fixtures' one-block k with fewer rows
  // than a block; a bf16 output.
  for (const Shape& sh : {Shape{300, 512, 320, false}, Shape{64, 128, 256, false}, Shape{128, 128, 128, true},
                          Shape{512, 128, 512, true}, Shape{512, 128, 512, false}, Shape{128, 256, 128, true},
                          Shape{512, 512, 512, true}, Shape{384, 1536, 400, false}}) {
    const int64_t n = sh.n, k = sh.k, ldy = sh.ldy;
    const bool w8a8 = k % (128 * cuda::kFp8BlockColumnMultiple) == 0;  // else widened (blas.h)
    const Fp8Matrices w = random_fp8(1, n, k, 0.05f, rng);
    DeviceBuffer<uint8_t> codes(w.codes);
    DeviceBuffer<float> scales(w.scales);
    cuda::Blas blas;
    blas.reserve_widened(static_cast<size_t>(n * k));
    blas.reserve_fp8_rows(301, k);
    for (int64_t m : {9, 13, 32, 33, 35, 40, 301}) {
      const std::string at = "n=" + std::to_string(n) + " k=" + std::to_string(k) + " m=" + std::to_string(m);
      const auto x = gputest::random_bf16_exact(static_cast<size_t>(m * k), rng, 1.0f);
      DeviceBuffer<uint16_t> dx(gputest::to_bf16(x));
      DeviceBuffer<float> dy(static_cast<size_t>(m * ldy));
      DeviceBuffer<uint16_t> dyb(static_cast<size_t>(m * ldy));
      dy.poison();
      dyb.poison();
      cuda::project(blas, dx.get(), fp8_matrix(codes, scales, 1, n, k), sh.bf16 ? static_cast<void*>(dyb.get()) : dy.get(),
                    sh.bf16 ? cuda::OutType::kBf16 : cuda::OutType::kF32, m, nullptr, ldy);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto y = sh.bf16 ? gputest::from_bf16(dyb.download()) : dy.download();
      const int64_t head = m / 4 * 4;
      auto want = [&](int64_t i, int64_t j) {
        double sum = 0;
        for (int64_t c = 0; c < k; ++c)
          sum += static_cast<double>(x[static_cast<size_t>(i * k + c)]) * w.values[static_cast<size_t>(j * k + c)];
        return sum;
      };
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = n; j < ldy; ++j)
          ASSERT_TRUE(std::isnan(y[static_cast<size_t>(i * ldy + j)])) << at << " wrote column " << j;
      if (m <= cuda::kernels::kFp8RowsMaxRows) {
        // Direct: exact weights and x; a bf16 output rounds.
        EXPECT_LE(relative_error(y, ldy, n, 0, m, want), sh.bf16 ? 5e-3 : 1e-5) << at << ", direct";
        continue;
      }
      if (!w8a8) {
        // Widened: each weight rounded to bf16, x exact.
        EXPECT_LE(relative_error(y, ldy, n, 0, m, want), 5e-3) << at << ", widened";
        continue;
      }
      const double w8a8_error = relative_error(y, ldy, n, 0, head, want);
      EXPECT_LE(w8a8_error, 6e-2) << at << ", the W8A8 rows";
      if (head < m) {
        EXPECT_LE(relative_error(y, ldy, n, head, m, want), sh.bf16 ? 5e-3 : 1e-5) << at << ", the GEMV rows";
      }
      // Activation rounding shows: the W8A8 rows are not the GEMV's exact-weight products.
      EXPECT_GE(w8a8_error, 1e-4) << at << ", the W8A8 rows";
    }
  }
}

// Random FP8 weights drawn on the device are the loader's random stream (its own copy of the
// rule here) to E4M3 precision: each code times the block scale within half a step of the value
// (2^-4 of it for normal codes, half the subnormal spacing 2^-9 of the scale below them).
TEST(CudaFp8, RandomWeightsAreTheLoadersStreamInFp8) {
  REQUIRE_GPU();
  const size_t count = 100001;  // odd: the last pair's second value is not written
  const uint64_t state = 0x1234567890abcdefull;
  DeviceBuffer<uint8_t> codes(count + 1);
  codes.poison();
  ASSERT_EQ(cuda::kernels::fill_random_fp8(codes.get(), count, state, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> got = codes.download();
  const float s = cuda::kernels::kRandomFp8Scale, stream_scale = 0.02f * 1.7320508f / 2147483648.0f;
  for (size_t i = 0; i < count; ++i) {
    uint64_t z = state + (i / 2 + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float want = static_cast<float>(static_cast<int32_t>(i % 2 ? z >> 32 : z)) * stream_scale;
    const float value = f8e4m3_to_f32(got[i]) * s;
    ASSERT_LE(std::fabs(value - want), std::fabs(want) / 16 + s / 1024) << "at " << i;
  }
  EXPECT_EQ(got[count], 0xff) << "wrote past the end";
}

// The engine's store keeps a checkpoint's FP8 matrices as stored: its bytes are the files' FP8
// codes at one byte, the 16-bit matrices at two and the scales at four, with no bf16 copy.
TEST(CudaFp8, WeightStoreHoldsTheCheckpointsBytes) {
  REQUIRE_GPU();
  const std::string dir = std::string(MOE_SOURCE_DIR) + "/tests/fixtures/qwen3_moe_fp8";
  const ModelConfig mc = load_model_config(dir);
  cuda::DeviceLoad opts;
  opts.max_tokens = 64;
  const auto model = cuda::load_device_model(dir, mc, opts);
  Checkpoint ckpt(dir);
  size_t want = 0;
  int64_t fp8 = 0;
  for (const std::string& name : ckpt.names()) {
    const TensorInfo& t = ckpt.info(name);
    size_t n = 1;
    for (int64_t d : t.shape) n *= static_cast<size_t>(d);
    if (name.ends_with("_scale_inv")) want += n * 4;
    else if (t.dtype == DType::kF8E4M3) want += n, ++fp8;
    else if (t.shape.size() >= 2) want += n * 2;
  }
  EXPECT_EQ(model->store->payload_bytes(), want);
  EXPECT_GT(model->store->fp8_matrices(), 0);
  EXPECT_EQ(model->store->fp8_pieces(), fp8);
  const cuda::DeviceLayer& l0 = model->layers[0];
  EXPECT_EQ(l0.o.format, cuda::kFp8Blocks);
  EXPECT_EQ(l0.expert_gate_up.format, cuda::kFp8Blocks);
  // q, k and v stay fused only where k's rows end on a block row (the fixture's 64 do not).
  EXPECT_FALSE(l0.qkv_fused);
}

// FP8 attention under tp: where a GPU's share of a projection is whole 128 x 128 blocks it stays
// FP8 (codes and scales copied, no bf16 copy of the matrix), and the split engine gives the
// one-GPU logits within the FP8 bound (test_cuda_engine.cpp: 10% of the largest magnitude).
// Random weights at widths whose shares are whole blocks on two GPUs: grouped-query attention
// (4 heads of 128, 2 key/value heads: 2 x 128 query rows, 128 key and 128 value rows, 256 output
// columns a GPU) and latent attention (q_b rows of 2 heads x 128, output columns of 2 x 64 =
// 128; kv_b's 2 x 160 rows are not whole blocks and are widened, as before).
TEST(CudaFp8, TensorParallelSharesOfWholeBlocksStayFp8) {
  REQUIRE_GPU();
  struct Case {
    const char* fixture;
    nlohmann::json widths;
  };
  const Case cases[] = {
      {"qwen3_moe_fp8", {{"hidden_size", 256}, {"head_dim", 128}}},
      {"deepseek_v3_fp8",
       {{"hidden_size", 256}, {"qk_nope_head_dim", 96}, {"qk_rope_head_dim", 32}, {"qk_head_dim", 128},
        {"head_dim", 32}, {"v_head_dim", 64}}},
  };
  for (const Case& c : cases) {
    test::TempDir dir;
    nlohmann::json config;
    std::ifstream(std::string(MOE_SOURCE_DIR) + "/tests/fixtures/" + c.fixture + "/config.json") >> config;
    config.update(c.widths);
    test::write_file(dir.path() / "config.json", config.dump());
    const ModelConfig mc = load_model_config(dir.str());
    const bool mla = mc.attention == AttentionKind::kMla;
    cuda::DeviceLoad opts;
    opts.random_weights = true;
    opts.seed = 5;
    opts.max_tokens = 64;
    opts.rank = 1;
    opts.ranks = 2;
    opts.tp = 2;
    const auto model = cuda::load_device_model(dir.str(), mc, opts);
    const cuda::DeviceLayer& l0 = model->layers[0];
    EXPECT_EQ(l0.o.format, cuda::kFp8Blocks) << c.fixture << ": the output projection's columns";
    EXPECT_EQ(l0.o.cols, mla ? 2 * 64 : 2 * 128) << c.fixture;
    if (mla) {
      EXPECT_EQ(l0.q_b.format, cuda::kFp8Blocks) << c.fixture << ": q_b's rows";
      EXPECT_EQ(l0.q_b.rows, 2 * 128) << c.fixture;
    } else {
      EXPECT_EQ(l0.q.format, cuda::kFp8Blocks) << c.fixture << ": the stacked q, k and v rows";
      EXPECT_TRUE(l0.qkv_fused);
      EXPECT_EQ(l0.q.rows, 2 * 128 + 128 + 128) << c.fixture;
    }
    if (gputest::gpu_count() < 2 || !gputest::peers_reachable(2)) {
      std::printf("[ %s ] fewer than two GPUs with peer access: the split engine's logits not compared\n", c.fixture);
      continue;
    }
    const std::vector<int32_t> ids{3, 17, 5, 200, 9, 41, 7, 7, 1, 99, 250, 12};
    Tensor logits[2];
    for (int tp = 1; tp <= 2; ++tp) {
      cuda::EngineOptions o;
      o.random_weights = true;
      o.seed = 5;
      o.max_context = 64;
      o.tp = tp;
      o.ep = tp;
      auto engine = cuda::Engine::load(dir.str(), o);
      engine->prefill(engine->open(), ids, SamplingParams{}, &logits[tp - 1], true);
    }
    ASSERT_EQ(logits[0].numel(), logits[1].numel());
    double diff = 0, scale = 0;
    for (int64_t i = 0; i < logits[0].numel(); ++i) {
      const double a = logits[0].data<float>()[i], b = logits[1].data<float>()[i];
      ASSERT_TRUE(std::isfinite(b)) << c.fixture << " at " << i;
      diff = std::max(diff, std::fabs(a - b));
      scale = std::max(scale, std::fabs(a));
    }
    std::printf("[ %s, tp 2 ep 2 ] max |split - one GPU| = %.3g of %.3g\n", c.fixture, diff, scale);
    EXPECT_GT(scale, 0.0) << c.fixture;
    EXPECT_LE(diff, std::max(0.10 * scale, 2e-3)) << c.fixture;
  }
}

}  // namespace
}  // namespace moe
