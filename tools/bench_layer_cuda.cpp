// moe-bench layer --device cuda: the routed experts of one MoE layer on one GPU, bf16, over a
// sweep of token counts (the path each M takes by the heuristics, and the other paths where they
// can run at that M: GEMV up to 256 tokens, mma.sync GEMM, wgmma GEMM on sm_90). Each point: CUDA-graph replays with the L2 cache flushed before each, timed
// with events; the floor is max(bytes / measured copy bandwidth, FLOPs / bf16 matmul rate), with
// vLLM's fused_moe on an H100 beside it where the peers measured that shape; the error is against
// the CPU reference on up to 128 of the M rows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda_moe.h"
#include "backend/device_info.h"
#include "bench_common.h"
#include "bench_layer.h"
#include "core/arena.h"
#include "moe/errors.h"
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

// vLLM fused_moe (Triton), µs, from shared/peers/README.md (moe_layer_h100.jsonl and
// moe_layer_h200.jsonl): routing and alignment excluded. The H200 figures where the device here
// is an H200, else the H100 ones. 0: not measured.
double vllm_us(const char* name, int64_t m, bool h200) {
  static const int64_t ms[] = {1, 8, 32, 128, 512, 2048, 8192};
  static const double qwen_h100[] = {50.0, 196.9, 374.1, 436.8, 497.0, 642.0, 1581.0};
  static const double qwen_h200[] = {38.0, 138.0, 266.0, 309.0, 339.0, 516.0, 1479.0};
  static const double dsv2_h100[] = {57.0, 232.0, 397.0, 524.0, 619.0, 1232.0, 4059.0};
  static const double dsv2_h200[] = {46.0, 167.0, 271.0, 400.0, 469.0, 1057.0, 3516.0};
  const std::string n(name);
  const double* row = n == "qwen3-30b-a3b" ? (h200 ? qwen_h200 : qwen_h100)
                      : n == "deepseek-v2-lite" ? (h200 ? dsv2_h200 : dsv2_h100) : nullptr;
  for (int i = 0; row && i < 7; ++i)
    if (ms[i] == m) return row[i];
  return 0;
}

// The bf16 matmul rate the peers measured on an H100 (748 TFLOP/s): the compute half of the floor
// (an H200 measured about 790; the H100 figure is kept so floors compare across the two).
constexpr double kMatmulFlops = 748e12;

const char* path_name(cuda::ExpertPath p) {
  return p == cuda::ExpertPath::kGemv ? "gemv" : p == cuda::ExpertPath::kWgmma ? "wgmma" : "gemm";
}

}  // namespace

int run_layer_bench_cuda(const LayerBenchArgs& a, int64_t experts, int64_t hidden, int64_t inter,
                         int64_t top_k, const RouterConfig& router, const char* name) {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) {
    cudaGetLastError();
    gpus = 0;
  }
  MOE_CHECK(gpus >= 1, kUnsupported, "--device cuda needs a CUDA GPU; this machine has none");
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreate(&stream));
  cudaDeviceProp prop;
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double copy_bw = measure_copy_bandwidth(0);

  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // Uniform weights with the std of N(0, 0.02): a normal draw per element takes tens of seconds
  // for a qwen3 layer's 600M weights.
  ExpertWeights w = zero_experts(experts, hidden, inter);
  fill_uniform_bf16(w.gate_up, 1, 0.0346f);
  fill_uniform_bf16(w.down, 2, 0.0346f);

  std::vector<int64_t> sweep = a.tokens > 0 ? std::vector<int64_t>{a.tokens}
                                            : std::vector<int64_t>{1, 8, 32, 128, 512, 2048, 8192};
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
  doc["routing_skew"] = a.routing_skew;
  doc["device"] = prop.name;
  doc["copy_GBps"] = copy_bw / 1e9;
  doc["shape"] = {{"experts", experts}, {"hidden", hidden}, {"intermediate", inter}, {"top_k", top_k}};
  doc["method"] = "CUDA graph of the routed-expert kernels (plan, gate_up, down, combine), L2 flushed "
                  "before each replay, events, median of 50 after 10; routing from random logits "
                  "through the model's router on the host, not timed (routing_skew S > 0: "
                  "S * sin(12.9898 * e) added to expert e's logits; no vLLM figure then, as "
                  "those are for uniform routing); floor = max(bytes / copy bandwidth measured "
                  "here, FLOPs / 748 TFLOP/s); rel_err on up to 128 rows";
  if (!a.json) {
    std::printf("moe-bench layer %s --device cuda: %s, copy %.0f GB/s measured; bf16, routed experts only\n",
                name, prop.name, copy_bw / 1e9);
    if (a.routing_skew > 0)
      std::printf("routing skew %g: expert loads uneven; no vLLM figures (theirs are for uniform routing)\n",
                  a.routing_skew);
    std::printf("%6s %6s %8s %10s %10s %8s %8s %8s %9s %9s %10s\n", "M", "path", "touched",
                "median_us", "floor_us", "GB/s", "TFLOP/s", "floor/t", "vllm_us", "vllm/t", "rel_err");
  }
  for (int64_t m : sweep) {
    std::vector<float> logits(static_cast<size_t>(m * experts));
    for (auto& v : logits) v = nd(rng);
    if (a.routing_skew > 0)
      for (int64_t t = 0; t < m; ++t)
        for (int64_t e = 0; e < experts; ++e)
          logits[static_cast<size_t>(t * experts + e)] +=
              static_cast<float>(a.routing_skew * std::sin(12.9898 * static_cast<double>(e)));
    std::vector<int32_t> ids(static_cast<size_t>(m * top_k));
    std::vector<float> weights(ids.size());
    route(router, logits.data(), nullptr, m, ids.data(), weights.data());
    std::vector<uint16_t> xb(static_cast<size_t>(m * hidden));
    for (auto& v : xb) v = f32_to_bf16(nd(rng));
    MOE_CUDA_CHECK(cudaMemcpy(dx.p, xb.data(), xb.size() * 2, cudaMemcpyHostToDevice));
    MOE_CUDA_CHECK(cudaMemcpy(dids.p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    MOE_CUDA_CHECK(cudaMemcpy(dw.p, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));

    // The CPU reference on up to 128 rows spread over the M (each row depends on its token only).
    const int64_t stride = std::max<int64_t>(1, (m + 127) / 128);
    std::vector<int64_t> rows;
    for (int64_t t = 0; t < m; t += stride) rows.push_back(t);
    const int64_t n = static_cast<int64_t>(rows.size());
    const TokenSample sample = sample_tokens(rows, hidden, top_k, ids, weights, [&](int64_t t, float* row) {
      for (int64_t h = 0; h < hidden; ++h) row[h] = bf16_to_f32(xb[static_cast<size_t>(t * hidden + h)]);
    });
    Tensor ref = Tensor::zeros({n, hidden});
    ExpertPlan plan;
    ws.reset();
    run_experts(ExecMode::kGrouped, pool, ws, w, all, sample.x, sample.ids.data(), sample.weights.data(), top_k, ref,
                plan);

    std::vector<int64_t> load(static_cast<size_t>(experts));
    for (int32_t id : ids) ++load[static_cast<size_t>(id)];
    const int64_t touched = std::count_if(load.begin(), load.end(), [](int64_t n) { return n > 0; });
    const int64_t max_load = *std::max_element(load.begin(), load.end());
    const double bytes = touched * 3.0 * hidden * inter * 2 + 2.0 * m * hidden * 2;
    const double flops = 2.0 * m * top_k * 3.0 * hidden * inter;
    const double floor_us = std::max(bytes / copy_bw, flops / kMatmulFlops) * 1e6;
    const double vllm = a.routing_skew > 0 ? 0.0 : vllm_us(name, m, std::string(prop.name).find("H200") != std::string::npos);

    // The heuristics' path first, then the others where they can run this M (to place the switches).
    const cuda::ExpertPath chosen = layer.core().path_for(m);
    std::vector<cuda::ExpertPath> paths{chosen};
    const cuda::ExpertShape shape{experts, hidden, inter, top_k};
    const bool sm90 = prop.major == 9 && prop.minor == 0;
    for (cuda::ExpertPath other : {cuda::ExpertPath::kGemv, cuda::ExpertPath::kGemm, cuda::ExpertPath::kWgmma}) {
      if (other == chosen || !cuda::experts_support(shape, other)) continue;
      if (other == cuda::ExpertPath::kGemv && m > 256) continue;
      if (other == cuda::ExpertPath::kWgmma && !sm90) continue;
      paths.push_back(other);
    }
    for (cuda::ExpertPath path : paths) {
      MOE_CUDA_CHECK(cudaMemset(dy.p, 0xff, m * hidden * 2));
      layer.forward(dx.as<uint16_t>(), dids.as<int32_t>(), dw.as<float>(), m, dy.as<uint16_t>(), stream, path);
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<uint16_t> yb(static_cast<size_t>(m * hidden));
      MOE_CUDA_CHECK(cudaMemcpy(yb.data(), dy.p, yb.size() * 2, cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      for (uint16_t v : yb)
        if (!std::isfinite(bf16_to_f32(v))) num = INFINITY;  // an element left unwritten
      for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < hidden; ++h) {
          const double want = ref.data<float>()[i * hidden + h];
          const double d = bf16_to_f32(yb[static_cast<size_t>(rows[static_cast<size_t>(i)] * hidden + h)]) - want;
          num += d * d;
          den += want * want;
        }
      const double rel = std::sqrt(num / den);

      cudaGraph_t graph;
      cudaGraphExec_t exec;
      MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      layer.forward(dx.as<uint16_t>(), dids.as<int32_t>(), dw.as<float>(), m, dy.as<uint16_t>(), stream, path);
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
      const Summary s = summarize(us);
      nlohmann::json j{{"M", m}, {"path", path_name(path)}, {"chosen", path == chosen},
                       {"touched", touched}, {"max_rows_per_expert", max_load},
                       {"median_us", s.median}, {"min_us", s.min},
                       {"max_us", s.max}, {"floor_us", floor_us},
                       {"GBps", bytes / (s.median * 1e-6) / 1e9},
                       {"TFLOPs", flops / (s.median * 1e-6) / 1e12}, {"rel_err", rel}};
      if (vllm > 0) j["vllm_us"] = vllm;
      doc["points"].push_back(j);
      if (!a.json) {
        // No vLLM figure for this shape or routing: dashes, not zeros.
        const std::string peer = vllm > 0 ? fmt::format("{:9.1f} {:9.2f}", vllm, vllm / s.median)
                                          : fmt::format("{:>9} {:>9}", "-", "-");
        std::printf("%6lld %5s%s %8lld %10.2f %10.2f %8.0f %8.2f %8.2f %s %10.2e\n",
                    (long long)m, path_name(path), path == chosen ? "*" : " ", (long long)touched,
                    s.median, floor_us, bytes / (s.median * 1e-6) / 1e9,
                    flops / (s.median * 1e-6) / 1e12, floor_us / s.median, peer.c_str(), rel);
      }
    }
  }
  if (a.json) std::printf("%s\n", doc.dump(2).c_str());
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace moe::bench
