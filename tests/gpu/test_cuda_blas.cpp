// Dense projections on the GPU (the few-row kernel and cuBLASLt) against the CPU reference on
// bf16-exact values, outputs poisoned first. Skipped, visibly, where no CUDA device exists.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/cpu/kernels.h"
#include "backend/cuda/ops/blas.h"
#include "gpu_test_util.h"

namespace moe {
namespace {

using gputest::DeviceBuffer;

// f32 output: products of bf16 values are exact in f32, so only the summation order differs:
// within 1e-5 of the largest |y|. bf16 output: one more rounding, 2^-8 of each element.
void check(int64_t m, int64_t n, int64_t k, cuda::OutType out, int64_t ldy, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "m=" << m << " n=" << n << " k=" << k << " ldy=" << ldy
                                    << (out == cuda::OutType::kF32 ? " f32" : " bf16"));
  std::mt19937 rng(seed);
  auto x = gputest::random_bf16_exact(static_cast<size_t>(m * k), rng, 1.0f);
  auto w = gputest::random_bf16_exact(static_cast<size_t>(n * k), rng, 0.05f);
  std::vector<float> ref(static_cast<size_t>(m * n));
  ThreadPool pool(2);
  cpu::linear(pool, x.data(), w.data(), nullptr, ref.data(), m, k, n);
  DeviceBuffer<uint16_t> dx(gputest::to_bf16(x)), dw(gputest::to_bf16(w));
  cuda::Blas blas;
  std::vector<float> got(static_cast<size_t>(m * n));
  if (out == cuda::OutType::kF32) {
    DeviceBuffer<float> dy(static_cast<size_t>(m * ldy));
    dy.poison();
    blas.linear(dx.get(), dw.get(), dy.get(), out, m, n, k, nullptr, ldy);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto all = dy.download();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) got[static_cast<size_t>(r * n + c)] = all[static_cast<size_t>(r * ldy + c)];
    // Columns past n belong to someone else: they must still hold the poison.
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = n; c < ldy; ++c) ASSERT_TRUE(std::isnan(all[static_cast<size_t>(r * ldy + c)]));
    EXPECT_LE(gputest::max_rel_error(got, ref), 1e-5);
  } else {
    DeviceBuffer<uint16_t> dy(static_cast<size_t>(m * ldy));
    dy.poison();
    blas.linear(dx.get(), dw.get(), dy.get(), out, m, n, k, nullptr, ldy);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    auto all = gputest::from_bf16(dy.download());
    double scale = 0;
    for (float v : ref) scale = std::max(scale, std::fabs(static_cast<double>(v)));
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) {
        const float g = all[static_cast<size_t>(r * ldy + c)], e = ref[static_cast<size_t>(r * n + c)];
        ASSERT_TRUE(std::isfinite(g)) << r << "," << c;
        ASSERT_LE(std::fabs(g - e), std::fabs(e) * (1.0 / 256) + 1e-5 * scale) << r << "," << c;
      }
  }
}

// Shapes cover the kernel's k-split choices: none (many rows or short k), 4 warps per row
// group (128 x 1024) and 8 (128 x 4096, 2 x 2048: the router and the shared-expert gate).
TEST(CudaBlas, FewRowKernelMatchesCpu) {
  REQUIRE_GPU();
  uint32_t seed = 1;
  for (int64_t m : {1, 2, 5, 8})
    for (auto [n, k] : {std::pair<int64_t, int64_t>{1, 16}, {13, 72}, {17, 64}, {5120, 2048},
                        {128, 4096}, {128, 1024}, {2, 2048}, {1, 2056}})
      for (auto out : {cuda::OutType::kF32, cuda::OutType::kBf16}) check(m, n, k, out, n, seed++);
}

TEST(CudaBlas, CublasLtRowsMatchCpu) {
  REQUIRE_GPU();
  uint32_t seed = 100;
  for (int64_t m : {9, 24, 300})
    for (auto [n, k] : {std::pair<int64_t, int64_t>{1, 16}, {13, 72}, {768, 2048}})
      for (auto out : {cuda::OutType::kF32, cuda::OutType::kBf16}) check(m, n, k, out, n, seed++);
}

// Three projections writing the column blocks of one output, as the engine does for q, k, v
// when they are not stored back to back.
TEST(CudaBlas, StridedOutputLeavesOtherColumnsAlone) {
  REQUIRE_GPU();
  check(1, 40, 64, cuda::OutType::kF32, 72, 7);
  check(4, 40, 64, cuda::OutType::kF32, 72, 8);
  check(20, 40, 64, cuda::OutType::kF32, 72, 9);
}

}  // namespace
}  // namespace moe
