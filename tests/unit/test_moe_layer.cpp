// The plan, the two execution modes and the EP backends on a synthetic layer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "dist/rank_group.h"
#include "moe/ep/ep_backend.h"
#include "moe/experts.h"
#include "moe/plan.h"
#include "moe/errors.h"

namespace moe {
namespace {

TEST(Plan, CountsOffsetsOrderAndInverse) {
  // 3 tokens x k=2 over 4 experts; expert 2 gets nothing, expert 1 three slots.
  std::vector<int32_t> ids{1, 3, 0, 1, 1, 3};
  ExpertPlan p;
  make_plan(ids.data(), 3, 2, 4, p);
  EXPECT_EQ(p.counts, (std::vector<int32_t>{1, 3, 0, 2}));
  EXPECT_EQ(p.offsets, (std::vector<int32_t>{0, 1, 4, 4, 6}));
  // Expert 0: slot 2; expert 1: slots 0, 3, 4 (stable); expert 3: slots 1, 5.
  EXPECT_EQ(p.order, (std::vector<int32_t>{2, 0, 3, 4, 1, 5}));
  for (size_t pos = 0; pos < p.order.size(); ++pos) EXPECT_EQ(p.inverse[static_cast<size_t>(p.order[pos])], static_cast<int32_t>(pos));
  // Slots marked -1 take no row.
  std::vector<int32_t> some{-1, 2, 2, -1};
  make_plan(some.data(), 2, 2, 3, p);
  EXPECT_EQ(p.counts, (std::vector<int32_t>{0, 0, 2}));
  EXPECT_EQ(p.inverse, (std::vector<int32_t>{-1, 0, 1, -1}));
  std::vector<int32_t> bad{0, 7};
  EXPECT_THROW(make_plan(bad.data(), 1, 2, 4, p), Error);
}

struct Layer {
  int64_t experts, hidden, inter;
  ExpertWeights w;
  Layer(int64_t e, int64_t h, int64_t i, uint32_t seed) : experts(e), hidden(h), inter(i) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 0.2f);
    w = zero_experts(e, h, i);
    for (int64_t j = 0; j < w.gate_up.numel(); ++j) w.gate_up.data<float>()[j] = d(rng);
    for (int64_t j = 0; j < w.down.numel(); ++j) w.down.data<float>()[j] = d(rng);
  }
  // The block of experts [first, first + n) as a rank would hold it.
  ExpertWeights slice(int64_t first, int64_t n) const {
    ExpertWeights s = w;
    s.num_local = n;
    s.gate_up = w.gate_up.rows(first, first + n);
    s.down = w.down.rows(first, first + n);
    return s;
  }
};

// FFN of one expert in double precision, for an independent reference.
std::vector<double> ffn(const Layer& l, int64_t e, const float* x) {
  std::vector<double> act(static_cast<size_t>(l.inter)), y(static_cast<size_t>(l.hidden));
  const float* gu = l.w.gate_up.data<float>() + e * 2 * l.inter * l.hidden;
  const float* dn = l.w.down.data<float>() + e * l.hidden * l.inter;
  for (int64_t i = 0; i < l.inter; ++i) {
    double g = 0, u = 0;
    for (int64_t d = 0; d < l.hidden; ++d) {
      g += double(gu[i * l.hidden + d]) * x[d];
      u += double(gu[(l.inter + i) * l.hidden + d]) * x[d];
    }
    act[static_cast<size_t>(i)] = g / (1 + std::exp(-g)) * u;
  }
  for (int64_t d = 0; d < l.hidden; ++d)
    for (int64_t i = 0; i < l.inter; ++i) y[static_cast<size_t>(d)] += dn[d * l.inter + i] * act[static_cast<size_t>(i)];
  return y;
}

struct Routing {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// Random distinct ascending experts per token; `skew` sends most tokens to expert 0.
Routing make_routing(int64_t tokens, int64_t k, int64_t experts, uint32_t seed, bool all_to_first = false) {
  std::mt19937 rng(seed);
  Routing r;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> pick(static_cast<size_t>(experts));
    for (int64_t e = 0; e < experts; ++e) pick[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    if (!all_to_first) std::shuffle(pick.begin(), pick.end(), rng);
    pick.resize(static_cast<size_t>(k));
    std::sort(pick.begin(), pick.end());
    for (int32_t e : pick) {
      r.ids.push_back(e);
      r.weights.push_back(std::uniform_real_distribution<float>(0.1f, 1.0f)(rng));
    }
  }
  return r;
}

Tensor random_tokens(int64_t t, int64_t h, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  Tensor x = Tensor::zeros({t, h});
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = d(rng);
  return x;
}

TEST(Experts, NaiveAndGroupedMatchReferenceAndEachOther) {
  Layer l(6, 24, 16, 3);
  ThreadPool pool(2);
  Arena ws("ws", 1 << 20);
  std::vector<int32_t> all{0, 1, 2, 3, 4, 5};
  for (bool skewed : {false, true}) {
    const int64_t t = 13, k = 2;
    Tensor x = random_tokens(t, l.hidden, 9);
    Routing r = make_routing(t, k, l.experts, 5, skewed);  // skewed: every token on experts 0, 1
    Tensor naive = Tensor::zeros({t, l.hidden}), grouped = Tensor::zeros({t, l.hidden});
    std::fill(naive.data<float>(), naive.data<float>() + naive.numel(), NAN);  // poison
    std::fill(grouped.data<float>(), grouped.data<float>() + grouped.numel(), NAN);
    ExpertPlan plan;
    run_experts(ExecMode::kNaive, pool, ws, l.w, all, x, r.ids.data(), r.weights.data(), k, naive, plan);
    run_experts(ExecMode::kGrouped, pool, ws, l.w, all, x, r.ids.data(), r.weights.data(), k, grouped, plan);
    for (int64_t i = 0; i < t; ++i) {
      std::vector<double> ref(static_cast<size_t>(l.hidden));
      for (int64_t j = 0; j < k; ++j) {
        auto y = ffn(l, r.ids[static_cast<size_t>(i * k + j)], x.data<float>() + i * l.hidden);
        for (int64_t d = 0; d < l.hidden; ++d) ref[static_cast<size_t>(d)] += r.weights[static_cast<size_t>(i * k + j)] * y[static_cast<size_t>(d)];
      }
      for (int64_t d = 0; d < l.hidden; ++d) {
        ASSERT_NEAR(naive.data<float>()[i * l.hidden + d], ref[static_cast<size_t>(d)], 1e-4);
        ASSERT_EQ(naive.data<float>()[i * l.hidden + d], grouped.data<float>()[i * l.hidden + d]);
      }
    }
  }
}

TEST(Experts, ExpertsOfOtherRanksContributeNothing) {
  Layer l(4, 8, 8, 4);
  ThreadPool pool(1);
  Arena ws("ws", 1 << 16);
  Tensor x = random_tokens(3, 8, 2);
  std::vector<int32_t> ids{0, 2, 2, 3, 1, 3};
  std::vector<float> w{0.5f, 0.5f, 1.0f, 1.0f, 1.0f, 1.0f};
  std::vector<int32_t> only_three{-1, -1, -1, 0};  // this rank holds expert 3 only
  ExpertWeights mine = l.slice(3, 1);
  for (ExecMode mode : {ExecMode::kNaive, ExecMode::kGrouped}) {
    Tensor out = Tensor::zeros({3, 8});
    std::fill(out.data<float>(), out.data<float>() + out.numel(), NAN);
    ExpertPlan plan;
    run_experts(mode, pool, ws, mine, only_three, x, ids.data(), w.data(), 2, out, plan);
    for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(out.data<float>()[d], 0.0f);  // token 0: no expert 3
    auto y = ffn(l, 3, x.data<float>() + 8);
    for (int64_t d = 0; d < 8; ++d) EXPECT_NEAR(out.data<float>()[8 + d], y[static_cast<size_t>(d)], 1e-5);
  }
}

// Runs the layer on `ep` ranks with `backend`; returns rank 0's output and the summed stats.
std::pair<Tensor, EpStats> run_ep(const Layer& l, dist::EpBackend backend, int ep, ExecMode exec,
                                  const Tensor& x, const Routing& r, int64_t k) {
  const int64_t t = x.dim(0);
  std::vector<Tensor> outs(static_cast<size_t>(ep));
  std::vector<EpStats> stats(static_cast<size_t>(ep));
  dist::run_ranks(ep, [&](int rank, dist::Communicator& comm) {
    ThreadPool pool(1);
    Arena ws("ws", 1 << 20);
    ExpertPlacement placement(l.experts, ep, rank);
    ExpertWeights mine = l.slice(placement.first_expert(), placement.num_local());
    auto be = make_ep_backend(backend);
    EpContext ctx{comm, pool, ws, placement, stats[static_cast<size_t>(rank)]};
    Tensor out = Tensor::zeros({t, l.hidden});
    std::fill(out.data<float>(), out.data<float>() + out.numel(), NAN);
    ExpertPlan plan;
    ep_moe_forward(*be, ctx, exec, mine, plan, x, r.ids.data(), r.weights.data(), k, out);
    outs[static_cast<size_t>(rank)] = out;
  });
  EpStats total;
  for (const auto& s : stats) {
    total.dispatch_bytes += s.dispatch_bytes;
    total.combine_bytes += s.combine_bytes;
  }
  for (int rank = 1; rank < ep; ++rank)  // every rank ends with the same full output
    EXPECT_EQ(std::memcmp(outs[0].raw(), outs[static_cast<size_t>(rank)].raw(), outs[0].nbytes()), 0);
  return {outs[0], total};
}

TEST(ExpertParallel, EveryBackendMatchesOneRank) {
  Layer l(10, 16, 12, 11);  // 10 experts: ep 3 and 4 give uneven blocks
  ThreadPool pool(1);
  Arena ws("ws", 1 << 20);
  const int64_t t = 17, k = 3;
  Tensor x = random_tokens(t, l.hidden, 21);
  std::vector<int32_t> all(10);
  for (int e = 0; e < 10; ++e) all[static_cast<size_t>(e)] = e;
  for (bool skewed : {false, true}) {
    Routing r = make_routing(t, k, l.experts, 8, skewed);
    Tensor ref = Tensor::zeros({t, l.hidden});
    ExpertPlan plan;
    run_experts(ExecMode::kNaive, pool, ws, l.w, all, x, r.ids.data(), r.weights.data(), k, ref, plan);
    for (auto backend : {dist::EpBackend::kLocalAllreduce, dist::EpBackend::kAllgatherReducescatter,
                         dist::EpBackend::kAlltoallPadded, dist::EpBackend::kAlltoallPacked})
      for (int ep : {1, 2, 3, 4})
        for (ExecMode exec : {ExecMode::kNaive, ExecMode::kGrouped}) {
          auto [out, stats] = run_ep(l, backend, ep, exec, x, r, k);
          float worst = 0;
          for (int64_t i = 0; i < out.numel(); ++i)
            worst = std::max(worst, std::fabs(out.data<float>()[i] - ref.data<float>()[i]));
          EXPECT_LE(worst, 1e-5f) << dist::ep_backend_name(backend) << " ep=" << ep << " "
                                  << exec_mode_name(exec) << (skewed ? " skewed" : "");
        }
  }
}

TEST(ExpertParallel, MeasuredBytesEqualTheFormulas) {
  Layer l(8, 32, 16, 1);
  const int64_t t = 64, k = 2, b = 4;  // f32 activations on the CPU
  Tensor x = random_tokens(t, l.hidden, 4);
  Routing r = make_routing(t, k, l.experts, 6);
  for (int ep : {2, 4}) {
    const uint64_t ideal = static_cast<uint64_t>(t * k * l.hidden * b);  // one direction
    auto packed = run_ep(l, dist::EpBackend::kAlltoallPacked, ep, ExecMode::kGrouped, x, r, k).second;
    EXPECT_EQ(packed.dispatch_bytes, ideal) << "ep " << ep;
    EXPECT_EQ(packed.combine_bytes, ideal);
    auto padded = run_ep(l, dist::EpBackend::kAlltoallPadded, ep, ExecMode::kGrouped, x, r, k).second;
    EXPECT_EQ(padded.dispatch_bytes, static_cast<uint64_t>(ep) * ideal) << "ep " << ep;
    EXPECT_EQ(padded.combine_bytes, static_cast<uint64_t>(ep) * ideal);
  }
}

}  // namespace
}  // namespace moe
