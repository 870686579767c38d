// The activations' E4M3 quantisation for the W8A8 GEMMs. The quantising kernel (quantize_rows_fp8
// and its block-major form) against a host encoder written from the format alone: every code the
// nearest E4M3 value to value x (1 / scale), ties to the even code, saturating at 448; every scale
// max |value| / 448 of its row's 128 columns. The producers that write a projection's input
// quantised in place of bf16 (the routed experts' folded norm here, the wgmma attention kernel in
// test_cuda_attention.cpp) against that kernel run on their bf16 output, bit for bit.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/cuda/ops/fp8_blocks_launch.h"
#include "backend/cuda_moe.h"
#include "moe/errors.h"
#include "moe/tensor.h"
#include "gpu_test_util.h"

namespace moe {
namespace {

using gputest::DeviceBuffer;

// The E4M3 code nearest to t by searching the 127 finite magnitudes (0x7f is NaN), ties to the
// even code (RNE's even mantissa), magnitudes past 448 to 448 (saturating conversion).
uint8_t nearest_e4m3(float t) {
  const uint8_t sign = std::signbit(t) ? 0x80 : 0x00;
  const float a = std::fabs(t);
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const float d = std::fabs(f8e4m3_to_f32(static_cast<uint8_t>(c)) - a),
                b = std::fabs(f8e4m3_to_f32(static_cast<uint8_t>(best)) - a);
    if (d < b || (d == b && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(sign | best);
}

struct Quantised {
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // [rows, blocks]
};

Quantised quantise_on_host(const std::vector<float>& x, int64_t rows, int64_t cols) {
  const int64_t blocks = (cols + 127) / 128;
  Quantised q{std::vector<uint8_t>(x.size()), std::vector<float>(static_cast<size_t>(rows * blocks))};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t end = std::min(cols, (b + 1) * 128);
      float amax = 0.f;
      for (int64_t c = b * 128; c < end; ++c) amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * cols + c)]));
      const float scale = amax > 0.f ? amax / 448.f : 1.f, inverse = 1.f / scale;
      q.scales[static_cast<size_t>(r * blocks + b)] = scale;
      for (int64_t c = b * 128; c < end; ++c)
        q.codes[static_cast<size_t>(r * cols + c)] = nearest_e4m3(x[static_cast<size_t>(r * cols + c)] * inverse);
    }
  return q;
}

// Widths of whole blocks, a partial last block and one short block; a row count whose units do
// not fill the kernel's last pass; rows of zeros and of one large value; rows_on_device fewer than
// the rows (the rest untouched); both scale layouts.
TEST(CudaFp8ActQuant, CodesAndScalesAreTheNearestOfTheFormat) {
  REQUIRE_GPU();
  std::mt19937 rng(41);
  struct Shape {
    int rows, cols, device_rows;
  };
  for (const Shape& sh : {Shape{2048, 512, -1}, Shape{37, 400, -1}, Shape{5, 48, -1}, Shape{301, 768, 290},
                          Shape{1, 2048, -1}}) {
    auto x = gputest::random_bf16_exact(static_cast<size_t>(sh.rows) * sh.cols, rng, 3.0f);
    for (int c = 0; c < sh.cols; ++c) x[static_cast<size_t>(c)] = 0.f;  // a row of zeros
    if (sh.rows > 2) x[static_cast<size_t>(2 * sh.cols + sh.cols / 2)] = 8192.f;  // exact in bf16, far past the rest
    const Quantised want = quantise_on_host(x, sh.rows, sh.cols);
    const int blocks = (sh.cols + 127) / 128;
    const int done = sh.device_rows < 0 ? sh.rows : sh.device_rows;
    DeviceBuffer<uint16_t> dx(gputest::to_bf16(x));
    DeviceBuffer<int> device_rows(std::vector<int>{done});
    for (bool by_block : {false, true}) {
      DeviceBuffer<uint8_t> q(x.size());
      DeviceBuffer<float> s(static_cast<size_t>(sh.rows) * blocks);
      q.poison();
      s.poison();
      const int* on_device = sh.device_rows < 0 ? nullptr : device_rows.get();
      ASSERT_EQ(by_block ? cuda::kernels::quantize_rows_fp8_by_block(dx.get(), sh.rows, sh.cols, q.get(), s.get(), nullptr)
                         : cuda::kernels::quantize_rows_fp8(dx.get(), sh.rows, on_device, sh.cols, q.get(), s.get(), nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto codes = q.download();
      const auto scales = s.download();
      const int checked = by_block ? sh.rows : done;
      int wrong = 0;
      for (int r = 0; r < checked; ++r)
        for (int b = 0; b < blocks; ++b) {
          const float got = scales[static_cast<size_t>(by_block ? b * sh.rows + r : r * blocks + b)];
          const float expected = want.scales[static_cast<size_t>(r * blocks + b)];
          if (got != expected && wrong++ < 5)
            ADD_FAILURE() << sh.rows << "x" << sh.cols << " scale of row " << r << " block " << b << ": " << got
                          << ", want " << expected;
        }
      for (int r = 0; r < checked; ++r)
        for (int c = 0; c < sh.cols; ++c) {
          const size_t i = static_cast<size_t>(r) * sh.cols + c;
          if (codes[i] != want.codes[i] && wrong++ < 5)
            ADD_FAILURE() << sh.rows << "x" << sh.cols << " code [" << r << "][" << c << "] = " << int{codes[i]}
                          << ", want " << int{want.codes[i]} << " (value " << x[i] << ")";
        }
      // Rows past rows_on_device keep the poison.
      for (int r = checked; r < sh.rows; ++r)
        for (int c = 0; c < sh.cols; ++c)
          if (codes[static_cast<size_t>(r) * sh.cols + c] != codes.back() && wrong++ < 5)
            ADD_FAILURE() << "row " << r << " past the device's row count was written";
      EXPECT_EQ(wrong, 0) << sh.rows << "x" << sh.cols << (by_block ? " by block" : " by row");
    }
  }
}

// A row of 16-byte chunks is the kernel's unit: misaligned rows and widths it cannot split are
// refused with nothing launched.
TEST(CudaFp8ActQuant, RefusesWhatItCannotRead) {
  REQUIRE_GPU();
  DeviceBuffer<uint16_t> x(4 * 256);
  DeviceBuffer<uint8_t> q(4 * 256 + 8);
  DeviceBuffer<float> s(16);
  EXPECT_EQ(cuda::kernels::quantize_rows_fp8(x.get() + 1, 4, nullptr, 128, q.get(), s.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::kernels::quantize_rows_fp8(x.get(), 4, nullptr, 120, q.get(), s.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::kernels::quantize_rows_fp8_by_block(x.get(), 4, 128, q.get() + 4, s.get(), nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::kernels::quantize_rows_fp8(x.get(), 0, nullptr, 128, q.get(), s.get(), nullptr), cudaSuccess);
}

// forward_then_norm with code_rows: the rows below it as codes and block-major scales, bit for bit
// those of the quantising kernel on the bf16 rows the plain call writes, and nothing of them in
// `normed`; the rows after them and the residual as the plain call leaves them. On every path
// whose combine folds the norm (f32 partial sums from the GEMV, bf16 ones from the GEMMs).
TEST(CudaFp8ActQuant, FoldedNormWritesTheNextProjectionsInput) {
  REQUIRE_GPU();
  std::mt19937 rng(43);
  const int64_t experts = 8, hidden = 512, inter = 256, k = 2, tokens = 37, code_rows = 36;
  const size_t n = static_cast<size_t>(tokens * hidden);
  const cuda::ExpertShape shape{experts, hidden, inter, k};
  DeviceBuffer<uint16_t> gate_up(gputest::to_bf16(
      gputest::random_bf16_exact(static_cast<size_t>(experts * 2 * inter * hidden), rng, 0.08f)));
  DeviceBuffer<uint16_t> down(
      gputest::to_bf16(gputest::random_bf16_exact(static_cast<size_t>(experts * hidden * inter), rng, 0.08f)));
  std::vector<int32_t> ids(static_cast<size_t>(tokens * k));
  for (auto& id : ids) id = std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(experts - 1))(rng);
  for (int64_t t = 0; t < tokens; ++t)  // distinct experts a token
    if (ids[static_cast<size_t>(2 * t)] == ids[static_cast<size_t>(2 * t + 1)])
      ids[static_cast<size_t>(2 * t + 1)] = (ids[static_cast<size_t>(2 * t)] + 1) % static_cast<int32_t>(experts);
  std::vector<float> weights(ids.size(), 0.5f), residual(n), norm_w(static_cast<size_t>(hidden));
  for (auto& v : residual) v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
  for (auto& v : norm_w) v = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
  DeviceBuffer<uint16_t> dx(gputest::to_bf16(gputest::random_bf16_exact(n, rng, 1.0f)));
  DeviceBuffer<int32_t> dids(ids);
  DeviceBuffer<float> dw(weights), dnw(norm_w);
  for (cuda::ExpertPath path : {cuda::ExpertPath::kGemv, cuda::ExpertPath::kGemm, cuda::ExpertPath::kWgmma}) {
    if (!cuda::experts_support(shape, path)) continue;
    int major = 0;
    ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
    if (path == cuda::ExpertPath::kWgmma && major != 9) continue;  // sm_90a code
    cuda::Experts gpu(gate_up.get(), down.get(), shape, tokens);
    DeviceBuffer<unsigned char> ws(cuda::Experts::workspace_bytes(shape, tokens));
    // The plain call, then the codes of its bf16 rows from the quantising kernel.
    DeviceBuffer<float> plain_res(residual);
    DeviceBuffer<uint16_t> plain_h(n);
    gpu.forward_then_norm(dx.get(), dids.get(), dw.get(), tokens,
                          cuda::Experts::NextNorm{plain_res.get(), dnw.get(), 1e-6f, plain_h.get()}, ws.get(), nullptr,
                          path);
    DeviceBuffer<uint8_t> want_codes(static_cast<size_t>(code_rows * hidden));
    DeviceBuffer<float> want_scales(static_cast<size_t>(code_rows * hidden / 128));
    ASSERT_EQ(cuda::kernels::quantize_rows_fp8_by_block(plain_h.get(), static_cast<int>(code_rows),
                                                        static_cast<int>(hidden), want_codes.get(), want_scales.get(),
                                                        nullptr),
              cudaSuccess);
    // The codes call.
    DeviceBuffer<float> res(residual);
    DeviceBuffer<uint16_t> h(n);
    DeviceBuffer<uint8_t> codes(static_cast<size_t>(code_rows * hidden));
    DeviceBuffer<float> scales(static_cast<size_t>(code_rows * hidden / 128));
    h.poison();
    codes.poison();
    scales.poison();
    cuda::Experts::NextNorm next{res.get(), dnw.get(), 1e-6f, h.get()};
    next.codes = codes.get();
    next.scales = scales.get();
    next.code_rows = code_rows;
    gpu.forward_then_norm(dx.get(), dids.get(), dw.get(), tokens, next, ws.get(), nullptr, path);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::string where = "path " + std::to_string(static_cast<int>(path));
    EXPECT_EQ(codes.download(), want_codes.download()) << where;
    EXPECT_EQ(scales.download(), want_scales.download()) << where;
    EXPECT_EQ(res.download(), plain_res.download()) << where;
    const auto got_h = h.download(), want_h = plain_h.download();
    int wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint16_t want = i < static_cast<size_t>(code_rows * hidden) ? uint16_t{0xffff} : want_h[i];
      if (got_h[i] != want && wrong++ < 5)
        ADD_FAILURE() << where << ": normed [" << i / hidden << "][" << i % hidden << "] = " << got_h[i] << ", want "
                      << want;
    }
    // Codes asked for more rows than the call has are refused, not run.
    next.code_rows = tokens + 1;
    EXPECT_THROW(gpu.forward_then_norm(dx.get(), dids.get(), dw.get(), tokens, next, ws.get(), nullptr, path), Error)
        << where;
  }
}

}  // namespace
}  // namespace moe
