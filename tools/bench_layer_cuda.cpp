// moe-bench layer --device cuda: the routed experts of one MoE layer on one GPU (the decode-path
// kernels), bf16, over a sweep of token counts. Each point: CUDA-graph replays with the L2 cache
// flushed before each, timed with events; the floor is the bytes the layer must move over the
// copy bandwidth measured here, and the error is against the CPU reference.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda_moe.h"
#include "bench_common.h"
#include "bench_layer.h"
#include "core/arena.h"
#include "moe/router.h"

namespace moe::bench {

namespace {

struct DeviceMem {
  void* p = nullptr;
  explicit DeviceMem(size_t bytes) { MOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1))); }
  ~DeviceMem() { cudaFree(p); }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

double copy_bandwidth(cudaStream_t stream) {
  const size_t bytes = 1ull << 30;
  DeviceMem a(bytes), b(bytes);
  cudaEvent_t e0, e1;
  MOE_CUDA_CHECK(cudaEventCreate(&e0));
  MOE_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> ms;
  for (int i = 0; i < 6; ++i) {
    MOE_CUDA_CHECK(cudaEventRecord(e0, stream));
    MOE_CUDA_CHECK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, stream));
    MOE_CUDA_CHECK(cudaEventRecord(e1, stream));
    MOE_CUDA_CHECK(cudaEventSynchronize(e1));
    float t;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
    if (i) ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return 2.0 * bytes / (summarize(ms).median * 1e-3);  // read + write
}

}  // namespace

int run_layer_bench_cuda(const LayerBenchArgs& a, int64_t experts, int64_t hidden, int64_t inter,
                         int64_t top_k, const RouterConfig& router, const char* name) {
  MOE_CHECK(a.dtype == "bf16", kUnsupported, "--device cuda runs bf16 (pass --dtype bf16)");
  MOE_CHECK(a.ep == 1, kUnsupported, "--device cuda: one GPU here (--ep 1); multi-GPU EP comes later");
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaDeviceProp prop;
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double copy_bw = copy_bandwidth(stream);

  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  ExpertWeights w;
  w.num_local = experts;
  w.hidden = hidden;
  w.inter = inter;
  w.gate_up = Tensor::zeros({experts, 2 * inter, hidden});
  w.down = Tensor::zeros({experts, hidden, inter});
  for (Tensor* t : {&w.gate_up, &w.down})
    for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = bf16_to_f32(f32_to_bf16(0.02f * nd(rng)));

  std::vector<int64_t> sweep = a.tokens > 0 ? std::vector<int64_t>{a.tokens}
                                            : std::vector<int64_t>{1, 2, 4, 8, 16, 32, 64};
  const int64_t max_m = *std::max_element(sweep.begin(), sweep.end());
  cuda::DecodeExperts layer(w, max_m, top_k);
  DeviceMem flush(256u << 20), dx(max_m * hidden * 2), dy(max_m * hidden * 2),
      dids(max_m * top_k * 4), dw(max_m * top_k * 4);
  cudaEvent_t e0, e1;
  MOE_CUDA_CHECK(cudaEventCreate(&e0));
  MOE_CUDA_CHECK(cudaEventCreate(&e1));
  ThreadPool pool(0);
  Arena ws("ws", 64 << 20);
  std::vector<int32_t> all(static_cast<size_t>(experts));
  for (size_t e = 0; e < all.size(); ++e) all[e] = static_cast<int32_t>(e);

  nlohmann::json doc;
  doc["preset"] = name;
  doc["device"] = prop.name;
  doc["copy_GBps"] = copy_bw / 1e9;
  doc["shape"] = {{"experts", experts}, {"hidden", hidden}, {"intermediate", inter}, {"top_k", top_k}};
  doc["method"] = "CUDA graph of the routed-expert kernels (plan, gate_up, down, combine), L2 flushed "
                  "before each replay, events, median of 50 after 10; routing from random logits "
                  "through the model's router on the host, not timed";
  if (!a.json) {
    std::printf("moe-bench layer %s --device cuda: %s, copy %.0f GB/s measured; bf16, routed experts only\n",
                name, prop.name, copy_bw / 1e9);
    std::printf("%6s %8s %10s %10s %10s %8s %9s %10s\n", "M", "touched", "median_us", "floor_us",
                "GB/s", "TFLOP/s", "floor/t", "rel_err");
  }
  for (int64_t m : sweep) {
    std::vector<float> logits(static_cast<size_t>(m * experts));
    for (auto& v : logits) v = nd(rng);
    std::vector<int32_t> ids(static_cast<size_t>(m * top_k));
    std::vector<float> weights(ids.size());
    route(router, logits.data(), nullptr, m, ids.data(), weights.data());
    std::vector<uint16_t> xb(static_cast<size_t>(m * hidden));
    Tensor x = Tensor::zeros({m, hidden});
    for (size_t i = 0; i < xb.size(); ++i) {
      xb[i] = f32_to_bf16(nd(rng));
      x.data<float>()[i] = bf16_to_f32(xb[i]);
    }
    MOE_CUDA_CHECK(cudaMemcpy(dx.p, xb.data(), xb.size() * 2, cudaMemcpyHostToDevice));
    MOE_CUDA_CHECK(cudaMemcpy(dids.p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    MOE_CUDA_CHECK(cudaMemcpy(dw.p, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));
    MOE_CUDA_CHECK(cudaMemset(dy.p, 0xff, m * hidden * 2));
    layer.forward(dx.as<uint16_t>(), dids.as<int32_t>(), dw.as<float>(), m, dy.as<uint16_t>(), stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    // Error against the CPU engine on the same bf16 values.
    std::vector<uint16_t> yb(static_cast<size_t>(m * hidden));
    MOE_CUDA_CHECK(cudaMemcpy(yb.data(), dy.p, yb.size() * 2, cudaMemcpyDeviceToHost));
    Tensor ref = Tensor::zeros({m, hidden});
    ExpertPlan plan;
    ws.reset();
    run_experts(ExecMode::kGrouped, pool, ws, w, all, x, ids.data(), weights.data(), top_k, ref, plan);
    double num = 0, den = 0;
    for (size_t i = 0; i < yb.size(); ++i) {
      double d = bf16_to_f32(yb[i]) - ref.data<float>()[i];
      num += std::isfinite(d) ? d * d : INFINITY;
      den += double(ref.data<float>()[i]) * ref.data<float>()[i];
    }
    const double rel = std::sqrt(num / den);

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    layer.forward(dx.as<uint16_t>(), dids.as<int32_t>(), dw.as<float>(), m, dy.as<uint16_t>(), stream);
    MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<double> us;
    for (int r = 0; r < 60; ++r) {
      MOE_CUDA_CHECK(cudaMemsetAsync(flush.p, r & 0xff, 256u << 20, stream));
      MOE_CUDA_CHECK(cudaEventRecord(e0, stream));
      MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      MOE_CUDA_CHECK(cudaEventRecord(e1, stream));
      MOE_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms;
      MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 10) us.push_back(ms * 1e3);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    std::vector<bool> hit(static_cast<size_t>(experts));
    for (int32_t id : ids) hit[static_cast<size_t>(id)] = true;
    const int64_t touched = std::count(hit.begin(), hit.end(), true);
    const double bytes = touched * 3.0 * hidden * inter * 2 + 2.0 * m * hidden * 2;
    const double flops = 2.0 * m * top_k * 3.0 * hidden * inter;
    const double floor_us = bytes / copy_bw * 1e6;
    const Summary s = summarize(us);
    nlohmann::json j{{"M", m}, {"touched", touched}, {"median_us", s.median}, {"min_us", s.min},
                     {"max_us", s.max}, {"floor_us", floor_us}, {"GBps", bytes / (s.median * 1e-6) / 1e9},
                     {"TFLOPs", flops / (s.median * 1e-6) / 1e12}, {"rel_err", rel}};
    doc["points"].push_back(j);
    if (!a.json)
      std::printf("%6lld %8lld %10.2f %10.2f %10.0f %8.2f %9.2f %10.2e\n", (long long)m,
                  (long long)touched, s.median, floor_us, bytes / (s.median * 1e-6) / 1e9,
                  flops / (s.median * 1e-6) / 1e12, floor_us / s.median, rel);
  }
  if (a.json) std::printf("%s\n", doc.dump(2).c_str());
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace moe::bench
