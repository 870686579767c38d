#include "moe/experts.h"

#include <cstring>

#include "backend/cpu/kernels.h"
#include "moe/errors.h"

namespace moe {

ExecMode parse_exec_mode(const std::string& name) {
  if (name == "naive") return ExecMode::kNaive;
  if (name == "grouped") return ExecMode::kGrouped;
  MOE_THROW(kInvalidArgument, "unknown expert execution mode '{}' (valid: naive, grouped)", name);
}

const char* exec_mode_name(ExecMode mode) { return mode == ExecMode::kNaive ? "naive" : "grouped"; }

ExpertWeights zero_experts(int64_t num_local, int64_t hidden, int64_t inter) {
  ExpertWeights w;
  w.num_local = num_local;
  w.hidden = hidden;
  w.inter = inter;
  w.gate_up = Tensor::zeros({num_local, 2 * inter, hidden});
  w.down = Tensor::zeros({num_local, hidden, inter});
  return w;
}

TokenSample sample_tokens(const std::vector<int64_t>& tokens, int64_t hidden, int64_t top_k,
                          const std::vector<int32_t>& ids, const std::vector<float>& weights,
                          const std::function<void(int64_t, float*)>& input) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  TokenSample s{Tensor::zeros({n, hidden}), {}, {}};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = tokens[static_cast<size_t>(i)];
    input(t, s.x.data<float>() + i * hidden);
    s.ids.insert(s.ids.end(), ids.begin() + t * top_k, ids.begin() + (t + 1) * top_k);
    s.weights.insert(s.weights.end(), weights.begin() + t * top_k, weights.begin() + (t + 1) * top_k);
  }
  return s;
}

void fill_uniform_bf16(Tensor& t, uint64_t seed, float scale) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    const float u = static_cast<float>(s >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = bf16_to_f32(f32_to_bf16((2.0f * u - 1.0f) * scale));
  }
}

namespace {

void run_naive(ThreadPool& pool, Arena& ws, const ExpertWeights& w,
               const std::vector<int32_t>& local_of, const Tensor& x, const int32_t* ids,
               const float* weights, int64_t k, Tensor& out) {
  const int64_t t = x.dim(0), h = w.hidden, inter = w.inter;
  std::vector<std::vector<std::pair<int64_t, float>>> rows(static_cast<size_t>(w.num_local));
  for (int64_t s = 0; s < t * k; ++s) {
    int32_t local = ids[s] < 0 ? -1 : local_of[static_cast<size_t>(ids[s])];
    if (local >= 0) rows[static_cast<size_t>(local)].push_back({s / k, weights[s]});
  }
  std::memset(out.raw(), 0, out.nbytes());
  for (int64_t e = 0; e < w.num_local; ++e) {
    const auto& mine = rows[static_cast<size_t>(e)];
    if (mine.empty()) continue;
    const int64_t n = static_cast<int64_t>(mine.size());
    float* xin = static_cast<float*>(ws.allocate(static_cast<size_t>(n * h) * 4));
    float* gu = static_cast<float*>(ws.allocate(static_cast<size_t>(n * 2 * inter) * 4));
    float* act = static_cast<float*>(ws.allocate(static_cast<size_t>(n * inter) * 4));
    float* y = static_cast<float*>(ws.allocate(static_cast<size_t>(n * h) * 4));
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(xin + j * h, x.data<float>() + mine[static_cast<size_t>(j)].first * h, static_cast<size_t>(h) * 4);
    cpu::linear(pool, xin, w.gate_up.data<float>() + e * 2 * inter * h, nullptr, gu, n, h, 2 * inter);
    cpu::silu_mul(gu, act, n, inter);
    cpu::linear(pool, act, w.down.data<float>() + e * h * inter, nullptr, y, n, inter, h);
    for (int64_t j = 0; j < n; ++j) {
      auto [row, weight] = mine[static_cast<size_t>(j)];
      float* o = out.data<float>() + row * h;
      for (int64_t d = 0; d < h; ++d) o[d] += weight * y[j * h + d];
    }
  }
}

void run_grouped(ThreadPool& pool, Arena& ws, const ExpertWeights& w,
                 const std::vector<int32_t>& local_of, const Tensor& x, const int32_t* ids,
                 const float* weights, int64_t k, Tensor& out, ExpertPlan& plan) {
  const int64_t t = x.dim(0), h = w.hidden, inter = w.inter;
  std::vector<int32_t> local_ids(static_cast<size_t>(t * k));
  for (int64_t s = 0; s < t * k; ++s)
    local_ids[static_cast<size_t>(s)] = ids[s] < 0 ? -1 : local_of[static_cast<size_t>(ids[s])];
  make_plan(local_ids.data(), t, k, w.num_local, plan);
  const int64_t rows = plan.offsets.back();
  float* xp = static_cast<float*>(ws.allocate(static_cast<size_t>(rows * h) * 4 + 4));
  float* gu = static_cast<float*>(ws.allocate(static_cast<size_t>(rows * 2 * inter) * 4 + 4));
  float* act = static_cast<float*>(ws.allocate(static_cast<size_t>(rows * inter) * 4 + 4));
  float* y = static_cast<float*>(ws.allocate(static_cast<size_t>(rows * h) * 4 + 4));
  for (int64_t p = 0; p < rows; ++p)
    std::memcpy(xp + p * h, x.data<float>() + (plan.order[static_cast<size_t>(p)] / k) * h, static_cast<size_t>(h) * 4);
  cpu::grouped_linear(pool, xp, w.gate_up.data<float>(), plan.offsets.data(), w.num_local, h,
                      2 * inter, gu);
  cpu::silu_mul(gu, act, rows, inter);
  cpu::grouped_linear(pool, act, w.down.data<float>(), plan.offsets.data(), w.num_local, inter, h, y);
  pool.parallel_for(t, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      float* o = out.data<float>() + i * h;
      std::memset(o, 0, static_cast<size_t>(h) * 4);
      for (int64_t j = 0; j < k; ++j) {
        int32_t pos = plan.inverse[static_cast<size_t>(i * k + j)];
        if (pos < 0) continue;
        const float weight = weights[i * k + j];
        const float* yr = y + static_cast<int64_t>(pos) * h;
        for (int64_t d = 0; d < h; ++d) o[d] += weight * yr[d];
      }
    }
  });
}

}  // namespace

void run_experts(ExecMode mode, ThreadPool& pool, Arena& workspace, const ExpertWeights& w,
                 const std::vector<int32_t>& local_of, const Tensor& x, const int32_t* ids,
                 const float* weights, int64_t top_k, Tensor& out, ExpertPlan& plan) {
  MOE_CHECK(x.ndim() == 2 && x.dim(1) == w.hidden && out.shape() == x.shape(), kShape,
            "experts: x {} out {} for hidden {}", x.shape_str(), out.shape_str(), w.hidden);
  if (mode == ExecMode::kNaive)
    run_naive(pool, workspace, w, local_of, x, ids, weights, top_k, out);
  else
    run_grouped(pool, workspace, w, local_of, x, ids, weights, top_k, out, plan);
}

}  // namespace moe
