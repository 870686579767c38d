// The W8A8 dense projection of up to kW8a8RowsMax rows on wgmma (gemm_fp8_w8a8_rows), called
// directly and through Blas::linear_fp8_blocks, which takes it for those rows on a device of
// compute capability 9.0: against the product of exactly what it is given (x quantised on the
// device, its codes and block-major scales downloaded, times the FP8 weights, decoded exactly, in
// double), on widths with a partial last weight block, row counts that leave the last 64-row tile
// partly empty, k split over blocks and not, f32 and bf16 outputs into wider rows (ldy past n),
// and its results bit for bit the same on a second run. Outputs poisoned first; columns past n
// must stay so.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "backend/cuda/ops/blas.h"
#include "backend/cuda/ops/fp8_blocks_launch.h"
#include "backend/cuda/ops/gemm_fp8_w8a8_launch.h"
#include "gpu_test_util.h"
#include "moe/tensor.h"

namespace moe {
namespace {

using gputest::DeviceBuffer;

int multiprocessors() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

std::vector<uint8_t> random_codes(int64_t count, std::mt19937& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> codes(static_cast<size_t>(count));
  for (auto& q : codes) {
    do q = static_cast<uint8_t>(byte(rng));
    while ((q & 0x7f) == 0x7f);  // NaN
  }
  return codes;
}

std::vector<float> random_scales(int64_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> spread(1e-4f, 4e-4f);
  std::vector<float> scales(static_cast<size_t>(count));
  for (auto& s : scales) s = spread(rng);
  return scales;
}

// An FP8 weight matrix [n, k]: random finite codes and one scale per 128 x 128 block, as a
// checkpoint stores them, and on the device.
struct Weights {
  int64_t n, k;
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // [ceil(n / 128), k / 128]
  DeviceBuffer<uint8_t> d_codes;
  DeviceBuffer<float> d_scales;

  Weights(int64_t rows, int64_t cols, std::mt19937& rng)
      : n(rows),
        k(cols),
        codes(random_codes(rows * cols, rng)),
        scales(random_scales((rows + 127) / 128 * (cols / 128), rng)),
        d_codes(codes),
        d_scales(scales) {
    values.resize(codes.size());
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c)
        values[static_cast<size_t>(r * k + c)] = static_cast<double>(f8e4m3_to_f32(codes[static_cast<size_t>(r * k + c)])) *
                                                 scales[static_cast<size_t>(r / 128 * (k / 128) + c / 128)];
  }
  std::vector<double> values;  // code x scale, [n, k]
};

// m rows of x quantised on the device: codes [m, k], scales block-major [k / 128, m].
struct Input {
  int64_t m, k;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  DeviceBuffer<uint8_t> d_codes;
  DeviceBuffer<float> d_scales;

  Input(int64_t rows, int64_t cols, std::mt19937& rng)
      : m(rows), k(cols), d_codes(static_cast<size_t>(rows * cols)), d_scales(static_cast<size_t>(rows * cols / 128)) {
    const auto x = gputest::random_bf16_exact(static_cast<size_t>(m * k), rng, 1.0f);
    DeviceBuffer<uint16_t> dx(gputest::to_bf16(x));
    EXPECT_EQ(cuda::kernels::quantize_rows_fp8_by_block(dx.get(), static_cast<int>(m), static_cast<int>(k),
                                                        d_codes.get(), d_scales.get(), nullptr),
              cudaSuccess);
    codes = d_codes.download();
    scales = d_scales.download();
    values.resize(codes.size());
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < k; ++c)
        values[static_cast<size_t>(r * k + c)] = static_cast<double>(f8e4m3_to_f32(codes[static_cast<size_t>(r * k + c)])) *
                                                 scales[static_cast<size_t>(c / 128 * m + r)];
  }
  std::vector<double> values;  // code x scale, [m, k]
};

// The exact product of what the kernel is given, [m, n].
std::vector<double> product(const Input& x, const Weights& w) {
  std::vector<double> want(static_cast<size_t>(x.m * w.n));
  for (int64_t i = 0; i < x.m; ++i)
    for (int64_t j = 0; j < w.n; ++j) {
      const double* a = x.values.data() + i * x.k;
      const double* b = w.values.data() + j * w.k;
      double sum = 0;
      for (int64_t c = 0; c < x.k; ++c) sum += a[c] * b[c];
      want[static_cast<size_t>(i * w.n + j)] = sum;
    }
  return want;
}

// sqrt(Σ (y - want)² / Σ want²) over the m x n outputs of y (rows ldy apart); infinite where one
// is not finite. `touched`: how many of the columns past n are no longer the poison's NaN.
double error_against(const std::vector<float>& y, int64_t ldy, const std::vector<double>& want, int64_t m,
                     int64_t n, int* touched) {
  double num = 0, den = 0;
  *touched = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double got = y[static_cast<size_t>(i * ldy + j)], w = want[static_cast<size_t>(i * n + j)];
      if (!std::isfinite(got)) return INFINITY;
      num += (got - w) * (got - w);
      den += w * w;
    }
    for (int64_t j = n; j < ldy; ++j) *touched += !std::isnan(y[static_cast<size_t>(i * ldy + j)]);
  }
  return std::sqrt(num / den);
}

std::vector<float> widen(const std::vector<uint16_t>& bits) { return gputest::from_bf16(bits); }

// One call of the kernel itself, f32 or bf16 output; returns y widened to f32.
std::vector<float> run_direct(const Input& x, const Weights& w, bool f32, int64_t ldy, int sms) {
  DeviceBuffer<float> yf(static_cast<size_t>(x.m * ldy));
  DeviceBuffer<uint16_t> yb(static_cast<size_t>(x.m * ldy));
  yf.poison();
  yb.poison();
  void* y = f32 ? static_cast<void*>(yf.get()) : static_cast<void*>(yb.get());
  EXPECT_EQ(cuda::kernels::gemm_fp8_w8a8_rows(x.d_codes.get(), x.d_scales.get(), x.m, w.d_codes.get(),
                                              w.d_scales.get(), y, f32, x.m, w.n, x.k, ldy, sms, nullptr),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return f32 ? yf.download() : widen(yb.download());
}

TEST(CudaFp8W8a8Rows, MatchesTheQuantisedProduct) {
  REQUIRE_GPU();
  if (!gputest::device_is_sm90()) GTEST_SKIP() << "not a compute capability 9.0 device: the wgmma W8A8 rows kernel is not built for it";
  std::mt19937 rng(21);
  const int sms = multiprocessors();
  // n = 300: three tiles of weight rows, the last 44 rows; k split over blocks. n = 128 (sms + 4):
  // more tiles than multiprocessors, so no split.
  const Weights narrow(300, 1024, rng), wide(128 * (sms + 4), 256, rng);
  for (int64_t m : {1, 4, 37, 64, 100, 256}) {
    for (const Weights* w : {&narrow, &wide}) {
      if (w == &wide && (m == 37 || m == 100)) continue;  // the host's reference is slow at this width
      const Input x(m, w->k, rng);
      const auto want = product(x, *w);
      const int splits = cuda::kernels::w8a8_rows_splits(m, w->n, w->k, sms);
      for (bool f32 : {true, false}) {
        const int64_t ldy = w->n + (f32 ? 0 : 6);  // bf16 rows into a wider output
        const auto y = run_direct(x, *w, f32, ldy, sms);
        int touched = 0;
        const double error = error_against(y, ldy, want, m, w->n, &touched);
        // f32 sums of E4M3 products (the tensor cores' per 128 k, then scaled into f32 sums);
        // bf16 output adds its rounding (2^-9 relative).
        EXPECT_LE(error, f32 ? 1e-3 : 4e-3) << "m=" << m << " n=" << w->n << " splits=" << splits << (f32 ? " f32" : " bf16");
        EXPECT_EQ(touched, 0) << "columns past n written, m=" << m << " n=" << w->n;
      }
    }
  }
}

// More k blocks a block than the ring has stages (its stages and the scales asked ahead of them
// wrap around), with and without a split: a multiprocessor count passed small keeps the whole k
// in one block (10 k blocks) or two pieces of 5.
TEST(CudaFp8W8a8Rows, StepsPastTheRing) {
  REQUIRE_GPU();
  if (!gputest::device_is_sm90()) GTEST_SKIP() << "not a compute capability 9.0 device: the wgmma W8A8 rows kernel is not built for it";
  std::mt19937 rng(24);
  const Weights w(300, 1280, rng);
  for (int64_t m : {4, 100}) {
    const Input x(m, w.k, rng);
    const auto want = product(x, w);
    const int tiles = 3 * static_cast<int>((m + 63) / 64);
    for (int sms : {1, 2 * tiles}) {
      const int splits = cuda::kernels::w8a8_rows_splits(m, w.n, w.k, sms);
      ASSERT_EQ(splits, sms == 1 ? 1 : 2) << "m=" << m;
      const auto y = run_direct(x, w, true, w.n, sms);
      int touched = 0;
      EXPECT_LE(error_against(y, w.n, want, m, w.n, &touched), 1e-3) << "m=" << m << " splits=" << splits;
      EXPECT_EQ(touched, 0);
    }
  }
}

TEST(CudaFp8W8a8Rows, SplitSumsDoNotDependOnTiming) {
  REQUIRE_GPU();
  if (!gputest::device_is_sm90()) GTEST_SKIP() << "not a compute capability 9.0 device: the wgmma W8A8 rows kernel is not built for it";
  std::mt19937 rng(22);
  const int sms = multiprocessors();
  const Weights w(260, 2048, rng);
  const Input x(48, 2048, rng);
  ASSERT_GT(cuda::kernels::w8a8_rows_splits(x.m, w.n, x.k, sms), 1) << "the shape was meant to split k";
  const auto first = run_direct(x, w, true, w.n, sms);
  for (int run = 0; run < 4; ++run) {
    const auto again = run_direct(x, w, true, w.n, sms);
    ASSERT_EQ(std::memcmp(first.data(), again.data(), first.size() * sizeof(float)), 0) << "run " << run;
  }
}

TEST(CudaFp8W8a8Rows, DeclinesWhatItDoesNotTake) {
  REQUIRE_GPU();
  std::mt19937 rng(23);
  const Weights w(200, 1024, rng);
  const Input x(8, 1024, rng);
  DeviceBuffer<float> y(static_cast<size_t>(300 * 200));
  const auto call = [&](int64_t m, int64_t k, const void* codes, int64_t ldy) {
    return cuda::kernels::gemm_fp8_w8a8_rows(codes, x.d_scales.get(), 300, w.d_codes.get(), w.d_scales.get(),
                                             y.get(), true, m, w.n, k, ldy, 132, nullptr);
  };
  EXPECT_EQ(call(cuda::kernels::kW8a8RowsMax + 1, 1024, x.d_codes.get(), w.n), cudaErrorInvalidValue);
  EXPECT_EQ(call(0, 1024, x.d_codes.get(), w.n), cudaErrorInvalidValue);
  EXPECT_EQ(call(8, 1000, x.d_codes.get(), w.n), cudaErrorInvalidValue);      // k not whole blocks
  EXPECT_EQ(call(8, 1024, x.d_codes.get() + 1, w.n), cudaErrorInvalidValue);  // misaligned codes
  EXPECT_EQ(call(8, 1024, x.d_codes.get(), w.n - 1), cudaErrorInvalidValue);  // rows of y shorter than n
}

// Through Blas: the rows it takes on this device come out as the cuBLASLt path's did (the same
// bound as CudaFp8.BlockScaledGemmMatchesTheQuantisedProduct), and the row counts past
// kW8a8RowsMax still go to cuBLASLt.
TEST(CudaFp8W8a8Rows, BlasTakesItForItsRows) {
  REQUIRE_GPU();
  std::mt19937 rng(24);
  const Weights w(5120 / 4, 2048, rng);
  cuda::Blas blas;
  for (int64_t m : {8, 64, 128, 256, 260}) {
    const Input x(m, w.k, rng);
    DeviceBuffer<float> y(static_cast<size_t>(m * w.n));
    y.poison();
    ASSERT_TRUE(blas.linear_fp8_blocks(x.d_codes.get(), x.d_scales.get(), w.d_codes.get(), w.d_scales.get(),
                                       y.get(), cuda::OutType::kF32, m, w.n, w.k, nullptr))
        << "m=" << m;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    int touched = 0;
    EXPECT_LE(error_against(y.download(), w.n, product(x, w), m, w.n, &touched), 1e-3) << "m=" << m;
  }
}

}  // namespace
}  // namespace moe
