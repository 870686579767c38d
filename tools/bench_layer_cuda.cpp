// moe-bench layer --device cuda: the routed experts of one MoE layer on one GPU, bf16 or FP8
// (--dtype fp8: E4M3 weights with a scale per 128 x 128 block), over a sweep of token counts (the
// path each M takes by the heuristics, and the other paths where they can run at that M: GEMV up
// to 256 tokens, mma.sync GEMM, wgmma GEMM on sm_90 for bf16). Each point: CUDA-graph replays
// with the L2 cache flushed before each, timed with events; the floor is max(bytes / measured
// copy bandwidth, FLOPs / matmul rate: the peers' bf16 rate, or the FP8 rate measured here), with
// vLLM's fused_moe on an H100 beside it where the peers measured that shape and dtype; the error
// is against the CPU reference (on the exact FP8 values for fp8) on up to 128 of the M rows.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <memory>
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

// A peer's time at one M, with the experts its routing draw touched (its bytes): the draws are
// random, so at small M a peer may have read fewer experts than this run does.
struct PeerPoint {
  double us = 0;  // 0: not measured
  int64_t touched = 0;
};

PeerPoint peer_at(const int64_t m, const double* us, const int64_t* touched) {
  static const int64_t ms[] = {1, 8, 32, 128, 512, 2048, 8192};
  for (int i = 0; us && i < 7; ++i)
    if (ms[i] == m) return {us[i], touched[i]};
  return {};
}

// vLLM fused_moe (Triton), µs, from shared/peers/README.md (moe_layer_h100.jsonl and
// moe_layer_h200.jsonl): routing and alignment excluded. The H200 figures where the device here
// is an H200, else the H100 ones (the same routing draws on both).
PeerPoint vllm_bf16(const char* name, int64_t m, bool h200) {
  static const double qwen_h100[] = {50.0, 196.9, 374.1, 436.8, 497.0, 642.0, 1581.0};
  static const double qwen_h200[] = {38.0, 138.0, 266.0, 309.0, 339.0, 516.0, 1479.0};
  static const int64_t qwen_touched[] = {8, 53, 113, 128, 128, 128, 128};
  static const double dsv2_h100[] = {57.0, 232.0, 397.0, 524.0, 619.0, 1232.0, 4059.0};
  static const double dsv2_h200[] = {46.0, 167.0, 271.0, 400.0, 469.0, 1057.0, 3516.0};
  static const int64_t dsv2_touched[] = {6, 34, 61, 64, 64, 64, 64};
  const std::string n(name);
  if (n == "qwen3-30b-a3b") return peer_at(m, h200 ? qwen_h200 : qwen_h100, qwen_touched);
  if (n == "deepseek-v2-lite") return peer_at(m, h200 ? dsv2_h200 : dsv2_h100, dsv2_touched);
  return {};
}

// vLLM fused_moe on the W8A8 128 x 128 block path, µs, H100, activation quantisation included
// (shared/peers/README.md, vllm_fp8_layer_h100.txt).
PeerPoint vllm_fp8(const char* name, int64_t m) {
  static const double qwen[] = {34.8, 113.5, 217.5, 262.9, 304.5, 555.9, 1769.2};
  static const int64_t qwen_touched[] = {8, 46, 108, 128, 128, 128, 128};
  static const double dsv3[] = {153.0, 975.3, 2495.1, 3879.4, 4124.7, 5191.2, 12235.6};
  static const int64_t dsv3_touched[] = {8, 62, 165, 254, 256, 256, 256};
  const std::string n(name);
  if (n == "qwen3-30b-a3b") return peer_at(m, qwen, qwen_touched);
  if (n == "deepseek-v3") return peer_at(m, dsv3, dsv3_touched);
  return {};
}

// count x [rows, cols] FP8 weights for the bench: codes from the whole E4M3 range but NaN, a
// scale per block that keeps every weight within 0.0346 (the bf16 bench's range), and the f32
// values code x scale, which the CPU reference computes with.
struct Fp8Host {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
Fp8Host random_fp8(int64_t count, int64_t rows, int64_t cols, uint64_t seed, float* values) {
  Fp8Host h;
  const size_t n = static_cast<size_t>(count * rows * cols);
  h.codes.resize(n);
  uint64_t z = seed;
  for (size_t i = 0; i < n; ++i) {
    if (i % 8 == 0) z = z * 6364136223846793005ull + 1442695040888963407ull;
    uint8_t q = static_cast<uint8_t>(z >> (8 * (i % 8)));
    if ((q & 0x7f) == 0x7f) q ^= 0x01;  // NaN -> the largest finite code of that sign
    h.codes[i] = q;
  }
  const int64_t br = (rows + 127) / 128, bc = (cols + 127) / 128;
  h.scales.resize(static_cast<size_t>(count * br * bc));
  for (size_t b = 0; b < h.scales.size(); ++b) h.scales[b] = 0.0346f / 448.0f * (0.5f + 0.5f * static_cast<float>(b % 7) / 6);
  float table[256];
  for (int q = 0; q < 256; ++q) table[q] = f8e4m3_to_f32(static_cast<uint8_t>(q));
  size_t i = 0;
  for (int64_t e = 0; e < count; ++e)
    for (int64_t r = 0; r < rows; ++r) {
      const float* row_scales = h.scales.data() + (e * br + r / 128) * bc;
      for (int64_t c = 0; c < cols; ++c, ++i) values[i] = table[h.codes[i]] * row_scales[c / 128];
    }
  return h;
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
  const bool fp8 = a.dtype == "fp8";
  const double matmul_flops = fp8 ? measure_fp8_matmul_rate(0) : kMatmulFlops;

  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // Uniform weights with the std of N(0, 0.02): a normal draw per element takes tens of seconds
  // for a qwen3 layer's 600M weights.
  ExpertWeights w = zero_experts(experts, hidden, inter);
  Fp8Host gate_up8, down8;
  if (fp8) {
    gate_up8 = random_fp8(experts, 2 * inter, hidden, 1, w.gate_up.data<float>());
    down8 = random_fp8(experts, hidden, inter, 2, w.down.data<float>());
  } else {
    fill_uniform_bf16(w.gate_up, 1, 0.0346f);
    fill_uniform_bf16(w.down, 2, 0.0346f);
  }

  std::vector<int64_t> sweep = a.tokens > 0 ? std::vector<int64_t>{a.tokens}
                                            : std::vector<int64_t>{1, 8, 32, 128, 512, 2048, 8192};
  // Set up for at least 512 tokens, whatever the sweep: the GEMM paths' room (FP8's quantised
  // activations) exists only where a layer's token range reaches past the GEMV's, and a single
  // small --tokens must still time every path beside the chosen one.
  const int64_t max_m = std::max<int64_t>(*std::max_element(sweep.begin(), sweep.end()), 512);
  // bf16: the owning DecodeExperts; FP8: the codes and scales uploaded, the core over them.
  std::unique_ptr<cuda::DecodeExperts> bf16_layer;
  std::unique_ptr<DeviceMem> codes_gu, codes_dn, scales_gu, scales_dn, fp8_ws;
  std::unique_ptr<cuda::Experts> fp8_layer;
  const cuda::ExpertShape shape{experts, hidden, inter, top_k};
  if (fp8) {
    auto upload = [](const auto& v) {
      auto d = std::make_unique<DeviceMem>(v.size() * sizeof(v[0]));
      MOE_CUDA_CHECK(cudaMemcpy(d->p, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice));
      return d;
    };
    codes_gu = upload(gate_up8.codes);
    codes_dn = upload(down8.codes);
    scales_gu = upload(gate_up8.scales);
    scales_dn = upload(down8.scales);
    auto matrix = [&](const DeviceMem& c, const DeviceMem& sc, int64_t rows, int64_t cols) {
      cuda::DeviceMatrix m = cuda::DeviceMatrix::bf16(c.p, rows, cols, experts);
      m.format = cuda::kFp8Blocks;
      m.scales = sc.as<float>();
      return m;
    };
    fp8_layer = std::make_unique<cuda::Experts>(matrix(*codes_gu, *scales_gu, 2 * inter, hidden),
                                                matrix(*codes_dn, *scales_dn, hidden, inter), shape, max_m);
    fp8_ws = std::make_unique<DeviceMem>(cuda::Experts::workspace_bytes(shape, max_m, cuda::kFp8Blocks));
  } else {
    bf16_layer = std::make_unique<cuda::DecodeExperts>(w, max_m, top_k);
  }
  const cuda::Experts& core = fp8 ? *fp8_layer : bf16_layer->core();
  auto forward = [&](const DeviceMem& x, const DeviceMem& ids, const DeviceMem& wts, int64_t m, const DeviceMem& y,
                     cuda::ExpertPath path) {
    if (fp8)
      core.forward(x.as<uint16_t>(), ids.as<int32_t>(), wts.as<float>(), m, y.as<uint16_t>(), fp8_ws->p, stream, path);
    else
      bf16_layer->forward(x.as<uint16_t>(), ids.as<int32_t>(), wts.as<float>(), m, y.as<uint16_t>(), stream, path);
  };
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
  doc["dtype"] = a.dtype;
  doc["matmul_TFLOPs"] = matmul_flops / 1e12;
  doc["routing_skew"] = a.routing_skew;
  doc["runs"] = a.runs;
  doc["warmup"] = a.warmup;
  doc["device"] = prop.name;
  doc["copy_GBps"] = copy_bw / 1e9;
  doc["shape"] = {{"experts", experts}, {"hidden", hidden}, {"intermediate", inter}, {"top_k", top_k}};
  doc["method"] = "CUDA graph of the routed-expert kernels (plan, gate_up, down, combine), L2 flushed "
                  "before each replay, events, median of `runs` after `warmup`; routing from random logits "
                  "through the model's router on the host, not timed (routing_skew S > 0: "
                  "S * sin(12.9898 * e) added to expert e's logits; no vLLM figure then, as "
                  "those are for uniform routing); floor = max(bytes / copy bandwidth measured "
                  "here, FLOPs / matmul_TFLOPs: 748 for bf16, the FP8 rate measured here by "
                  "cuBLASLt 8192^3 for fp8; floor_holds false: the floor came out above the time, so the "
                  "rates measured at start were low and it is not valid); rel_err on up to 128 rows; vllm_us: the peer's figure at this M "
                  "(shared/peers), vllm_touched: the experts its routing draw touched, "
                  "vllm_us_at_these_bytes: its time scaled by this run's bytes over those of its draw";
  if (!a.json) {
    std::printf("moe-bench layer %s --device cuda: %s, copy %.0f GB/s measured; %s, routed experts only; "
                "compute floor at %.0f TFLOP/s%s; median of %d graph replays after %d\n",
                name, prop.name, copy_bw / 1e9, fp8 ? "FP8 E4M3 in 128 x 128 blocks" : "bf16", matmul_flops / 1e12,
                fp8 ? " (FP8, measured here)" : " (bf16, the peers' H100 figure)", a.runs, a.warmup);
    if (a.routing_skew > 0)
      std::printf("routing skew %g: expert loads uneven; no vLLM figures (theirs are for uniform routing)\n",
                  a.routing_skew);
    // vllm/t: the peer's time over ours; at_bytes: the same with the peer's time scaled to the
    // bytes this run reads (its draw touched vllm_tch experts, this one `touched`).
    std::printf("%6s %6s %8s %10s %10s %8s %8s %8s %9s %9s %8s %9s %10s\n", "M", "path", "touched",
                "median_us", "floor_us", "GB/s", "TFLOP/s", "floor/t", "vllm_us", "vllm/t", "vllm_tch",
                "at_bytes", "rel_err");
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
    // A router with a correction bias (DeepSeek-V3's) gets a zero one: uniform routing either way.
    const std::vector<float> bias(static_cast<size_t>(experts), 0.0f);
    route(router, logits.data(), router.correction_bias ? bias.data() : nullptr, m, ids.data(), weights.data());
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
    // FP8: a byte a weight and an f32 scale per 128 x 128 block.
    const double weight_bytes = fp8 ? 1.0 + 4.0 / (128.0 * 128.0) : 2.0;
    const double expert_bytes = 3.0 * hidden * inter * weight_bytes, act_bytes = 2.0 * m * hidden * 2;
    const double bytes = static_cast<double>(touched) * expert_bytes + act_bytes;
    const double flops = 2.0 * m * top_k * 3.0 * hidden * inter;
    const double floor_us = std::max(bytes / copy_bw, flops / matmul_flops) * 1e6;
    const bool h200 = std::string(prop.name).find("H200") != std::string::npos;
    const PeerPoint vllm = a.routing_skew > 0 || (fp8 && h200) ? PeerPoint{} : fp8 ? vllm_fp8(name, m)
                                                                                   : vllm_bf16(name, m, h200);
    // The peer's time at this run's bytes: weights scale with the experts touched, the
    // activations are the same M.
    const double vllm_at_bytes =
        vllm.us > 0 ? vllm.us * bytes / (static_cast<double>(vllm.touched) * expert_bytes + act_bytes) : 0.0;

    // The heuristics' path first, then the others where they can run this M (to place the
    // switches); with --modes only the paths it names (checked by run_layer_bench).
    const cuda::ExpertPath chosen = core.path_for(m);
    const std::vector<std::string> named = split_modes(a.modes);
    auto selected = [&](cuda::ExpertPath p) {
      return named.empty() || std::find(named.begin(), named.end(), path_name(p)) != named.end();
    };
    std::vector<cuda::ExpertPath> paths;
    if (selected(chosen)) paths.push_back(chosen);
    const bool sm90 = prop.major == 9 && prop.minor == 0;
    for (cuda::ExpertPath other : {cuda::ExpertPath::kGemv, cuda::ExpertPath::kGemm, cuda::ExpertPath::kWgmma}) {
      if (other == chosen || !selected(other) || !cuda::experts_support(shape, other, core.format())) continue;
      if (other == cuda::ExpertPath::kGemv && m > 256) continue;
      if (other == cuda::ExpertPath::kWgmma && !sm90) continue;
      paths.push_back(other);
    }
    if (paths.empty() && !a.json)
      std::printf("%6lld  --modes %s: none of these paths runs at this M on this GPU\n", (long long)m, a.modes.c_str());
    for (cuda::ExpertPath path : paths) {
      MOE_CUDA_CHECK(cudaMemset(dy.p, 0xff, m * hidden * 2));
      forward(dx, dids, dw, m, dy, path);
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
      forward(dx, dids, dw, m, dy, path);
      MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      std::vector<double> us;
      for (int r = 0; r < a.warmup + a.runs; ++r) {
        MOE_CUDA_CHECK(cudaMemsetAsync(flush.p, r & 0xff, 256u << 20, stream));
        MOE_CUDA_CHECK(cudaEventRecord(e0, stream));
        MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        MOE_CUDA_CHECK(cudaEventRecord(e1, stream));
        MOE_CUDA_CHECK(cudaEventSynchronize(e1));
        float ms;
        MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= a.warmup) us.push_back(ms * 1e3);
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      const Summary s = summarize(us);
      // The floor comes from the copy bandwidth and matmul rate measured once at start; a busy
      // GPU lowers them, and a floor above the measured time is then no floor at all.
      const bool floor_holds = floor_us <= s.median;
      nlohmann::json j{{"M", m}, {"path", path_name(path)}, {"chosen", path == chosen},
                       {"touched", touched}, {"max_rows_per_expert", max_load},
                       {"median_us", s.median}, {"min_us", s.min},
                       {"max_us", s.max}, {"floor_us", floor_us}, {"floor_holds", floor_holds},
                       {"GBps", bytes / (s.median * 1e-6) / 1e9},
                       {"TFLOPs", flops / (s.median * 1e-6) / 1e12}, {"rel_err", rel}};
      if (vllm.us > 0) {
        j["vllm_us"] = vllm.us;
        j["vllm_touched"] = vllm.touched;
        j["vllm_us_at_these_bytes"] = vllm_at_bytes;
      }
      doc["points"].push_back(j);
      if (!a.json) {
        // No vLLM figure for this shape or routing: dashes, not zeros.
        const std::string peer =
            vllm.us > 0 ? fmt::format("{:9.1f} {:9.2f} {:8d} {:9.2f}", vllm.us, vllm.us / s.median, vllm.touched,
                                      vllm_at_bytes / s.median)
                        : fmt::format("{:>9} {:>9} {:>8} {:>9}", "-", "-", "-", "-");
        std::printf("%6lld %5s%s %8lld %10.2f %10.2f %8.0f %8.2f %8.2f %s %10.2e\n",
                    (long long)m, path_name(path), path == chosen ? "*" : " ", (long long)touched,
                    s.median, floor_us, bytes / (s.median * 1e-6) / 1e9,
                    flops / (s.median * 1e-6) / 1e12, floor_us / s.median, peer.c_str(), rel);
        if (!floor_holds)
          std::printf("       the floor is above the measured time: the copy bandwidth or matmul rate measured at "
                      "start was low (another process on the GPU?); floor_us and floor/t of this row are not valid\n");
      }
    }
  }
  if (a.json) std::printf("%s\n", doc.dump(2).c_str());
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace moe::bench
