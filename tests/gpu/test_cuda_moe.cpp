// The CUDA decode-path experts against the CPU reference, on random data: ragged loads, experts
// with no tokens, every token on one expert. Skipped, visibly, where no CUDA device exists.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backend/cuda_moe.h"
#include "moe/errors.h"
#include "moe/experts.h"

namespace moe {
namespace {

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU test skipped"

// Values that bf16 holds exactly, so the CPU reference and the GPU see the same numbers.
void fill_bf16_exact(Tensor& t, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = bf16_to_f32(f32_to_bf16(d(rng)));
}

template <typename T>
T* to_device(const std::vector<T>& v) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, v.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return static_cast<T*>(p);
}

// Relative Frobenius error of the GPU layer against run_experts on the CPU.
double run_case(int64_t experts, int64_t hidden, int64_t inter, int64_t tokens, int64_t k,
                const std::vector<int32_t>& ids, uint32_t seed) {
  std::mt19937 rng(seed);
  ExpertWeights w;
  w.num_local = experts;
  w.hidden = hidden;
  w.inter = inter;
  w.gate_up = Tensor::zeros({experts, 2 * inter, hidden});
  w.down = Tensor::zeros({experts, hidden, inter});
  fill_bf16_exact(w.gate_up, rng, 0.1f);
  fill_bf16_exact(w.down, rng, 0.1f);
  Tensor x = Tensor::zeros({tokens, hidden});
  fill_bf16_exact(x, rng, 1.0f);
  std::vector<float> weights(static_cast<size_t>(tokens * k));
  for (auto& v : weights) v = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);

  ThreadPool pool(2);
  Arena ws("ws", 1 << 20);
  std::vector<int32_t> all(static_cast<size_t>(experts));
  for (size_t e = 0; e < all.size(); ++e) all[e] = static_cast<int32_t>(e);
  Tensor ref = Tensor::zeros({tokens, hidden});
  ExpertPlan plan;
  run_experts(ExecMode::kNaive, pool, ws, w, all, x, ids.data(), weights.data(), k, ref, plan);

  cuda::DecodeExperts gpu(w, tokens, k);
  std::vector<uint16_t> xb(static_cast<size_t>(x.numel()));
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = f32_to_bf16(x.data<float>()[i]);
  uint16_t* dx = to_device(xb);
  int32_t* dids = to_device(ids);
  float* dw = to_device(weights);
  std::vector<uint16_t> poison(static_cast<size_t>(tokens * hidden), 0xffff);  // NaN
  uint16_t* dy = to_device(poison);
  gpu.forward(dx, dids, dw, tokens, dy, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> yb(poison.size());
  EXPECT_EQ(cudaMemcpy(yb.data(), dy, yb.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  for (void* p : {(void*)dx, (void*)dids, (void*)dw, (void*)dy}) cudaFree(p);
  double num = 0, den = 0;
  for (size_t i = 0; i < yb.size(); ++i) {
    double got = bf16_to_f32(yb[i]), want = ref.data<float>()[i];
    if (!std::isfinite(got)) return INFINITY;  // an unwritten (poisoned) or broken element
    num += (got - want) * (got - want);
    den += want * want;
  }
  return std::sqrt(num / den);
}

// bf16 activations and outputs: a relative error of a few 1e-3 is expected, 1e-2 is the bound.
constexpr double kBound = 1e-2;

TEST(CudaMoe, RaggedRandomRouting) {
  REQUIRE_GPU();
  std::mt19937 rng(3);
  const int64_t e = 10, t = 7, k = 3;
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < t; ++i) {
    std::vector<int32_t> p(static_cast<size_t>(e));
    for (int32_t j = 0; j < e; ++j) p[static_cast<size_t>(j)] = j;
    std::shuffle(p.begin(), p.end(), rng);
    std::sort(p.begin(), p.begin() + k);
    ids.insert(ids.end(), p.begin(), p.begin() + k);
  }
  EXPECT_LE(run_case(e, 256, 128, t, k, ids, 1), kBound);
}

TEST(CudaMoe, MostExpertsIdleAndWidthsNotMultiplesOf256) {
  REQUIRE_GPU();
  // 64 experts, one token with two of them: 62 experts get nothing; widths 1408 and 520 leave
  // partial 16-byte chunk rows per lane.
  EXPECT_LE(run_case(64, 520, 1408, 1, 2, {5, 60}, 2), kBound);
}

TEST(CudaMoe, EveryTokenOnOneExpert) {
  REQUIRE_GPU();
  EXPECT_LE(run_case(8, 128, 64, 32, 1, std::vector<int32_t>(32, 3), 4), kBound);
}

TEST(CudaMoe, QwenShapeAtDecodeSizes) {
  REQUIRE_GPU();
  std::mt19937 rng(9);
  for (int64_t t : {1, 8}) {
    std::vector<int32_t> ids;
    for (int64_t i = 0; i < t; ++i) {
      std::vector<int32_t> p(128);
      for (int32_t j = 0; j < 128; ++j) p[static_cast<size_t>(j)] = j;
      std::shuffle(p.begin(), p.end(), rng);
      std::sort(p.begin(), p.begin() + 8);
      ids.insert(ids.end(), p.begin(), p.begin() + 8);
    }
    EXPECT_LE(run_case(128, 2048, 768, t, 8, ids, 5 + static_cast<uint32_t>(t)), kBound) << "M=" << t;
  }
}

TEST(CudaMoe, RefusesWhatItCannotRun) {
  ExpertWeights w;
  w.num_local = 4;
  w.hidden = 4096;  // wider than the decode path handles
  w.inter = 64;
  w.gate_up = Tensor::zeros({4, 128, 4096});
  w.down = Tensor::zeros({4, 4096, 64});
  EXPECT_THROW(cuda::DecodeExperts(w, 4, 2), Error);
  if (!have_gpu()) {
    w.hidden = 64;
    w.gate_up = Tensor::zeros({4, 128, 64});
    w.down = Tensor::zeros({4, 64, 64});
    EXPECT_THROW(cuda::DecodeExperts(w, 4, 2), Error);  // no device: a clear error, no crash
  }
}

}  // namespace
}  // namespace moe
