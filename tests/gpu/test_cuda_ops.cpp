// The small CUDA ops (src/backend/cuda/ops/ops.cu) against the CPU kernels on the same bf16-exact
// inputs, outputs poisoned first. Bounds, per element of a bf16 output: the kernels compute in
// f32 as the CPU does and differ only in reduction order and libm rounding (a few f32 ulps), so
// the bf16 result is the reference rounded to bf16 (error <= 2^-8 relative) or, when the f32
// value sits next to a rounding midpoint, the neighbouring bf16 value (<= 2^-7 relative). Hence
// |gpu - ref| <= 2^-7 |ref| + a floor of 1e-5 of the tensor's largest value for results near 0
// (cancellation in a rotation or a product). f32 outputs that involve no reduction are exact.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/ops/ops_launch.h"
#include "core/thread_pool.h"
#include "gpu_test_util.h"
#include "model/rope.h"

namespace moe {
namespace {

using gputest::DeviceBuffer;
using gputest::from_bf16;
using gputest::random_bf16_exact;
using gputest::to_bf16;
namespace k = cuda::kernels;

// Number of elements outside |got - ref| <= 2^-7 |ref| + 1e-5 max|ref| (NaN counts as outside).
size_t bf16_mismatches(const std::vector<uint16_t>& got, const std::vector<float>& ref) {
  float top = 0.0f;
  for (float r : ref) top = std::max(top, std::abs(r));
  size_t bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const float g = bf16_to_f32(got[i]);
    const float allowed = std::ldexp(std::abs(ref[i]), -7) + 1e-5f * top;
    if (!(std::abs(g - ref[i]) <= allowed)) {
      if (bad < 5) ADD_FAILURE() << "element " << i << ": gpu " << g << " cpu " << ref[i];
      ++bad;
    }
  }
  return bad;
}

TEST(CudaOps, EmbedGathersRowsAndZeroesBadIds) {
  REQUIRE_GPU();
  std::mt19937 rng(1);
  for (int hidden : {64, 72, 30}) {  // 16-byte path, and the scalar path (30 % 8 != 0)
    const int vocab = 50, tokens = 7;
    const auto table = random_bf16_exact(static_cast<size_t>(vocab) * hidden, rng, 1.0f);
    const std::vector<int32_t> ids = {3, 0, 49, -1, 50, 17, 3};
    DeviceBuffer<uint16_t> dt(to_bf16(table));
    DeviceBuffer<int32_t> di(ids);
    DeviceBuffer<float> out(static_cast<size_t>(tokens) * hidden);
    out.poison();
    ASSERT_EQ(k::embed(dt.get(), di.get(), tokens, hidden, vocab, out.get(), nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = out.download();
    // Exact: a bf16 -> f32 widening.
    for (int t = 0; t < tokens; ++t)
      for (int i = 0; i < hidden; ++i) {
        const bool ok = ids[t] >= 0 && ids[t] < vocab;
        const float want = ok ? table[static_cast<size_t>(ids[t]) * hidden + i] : 0.0f;
        ASSERT_EQ(got[static_cast<size_t>(t) * hidden + i], want) << "hidden " << hidden << " t " << t;
      }
  }
}

// add_rms_norm with 0, 1 or 2 branches, with and without an output; rms_norm from f32.
void run_norm_case(int rows, int width, int branches, bool with_out, uint32_t seed) {
  std::mt19937 rng(seed);
  const size_t n = static_cast<size_t>(rows) * width;
  std::vector<float> x(n);
  std::normal_distribution<float> d(0.0f, 2.0f);
  for (auto& v : x) v = d(rng);  // the residual stream is f32, not bf16-rounded
  const auto b1 = random_bf16_exact(n, rng, 1.0f), b2 = random_bf16_exact(n, rng, 0.5f);
  std::vector<float> w(static_cast<size_t>(width));
  for (auto& v : w) v = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
  const float eps = 1e-6f;

  std::vector<float> xr = x;
  for (size_t i = 0; i < n; ++i) {
    if (branches >= 1) xr[i] += b1[i];
    if (branches >= 2) xr[i] += b2[i];
  }
  std::vector<float> ref(n);
  ThreadPool pool(1);
  cpu::rms_norm(pool, xr.data(), w.data(), ref.data(), rows, width, eps);

  DeviceBuffer<float> dx(x), dw(w);
  DeviceBuffer<uint16_t> db1(to_bf16(b1)), db2(to_bf16(b2)), out(n);
  out.poison();
  ASSERT_EQ(k::add_rms_norm(dx.get(), branches >= 1 ? db1.get() : nullptr,
                            branches >= 2 ? db2.get() : nullptr, dw.get(), rows, width, eps,
                            with_out ? out.get() : nullptr, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The residual update is the same f32 additions in the same order: exact.
  EXPECT_EQ(dx.download(), xr) << "rows " << rows << " width " << width << " branches " << branches;
  if (with_out) {
    EXPECT_EQ(bf16_mismatches(out.download(), ref), 0u)
        << "rows " << rows << " width " << width << " branches " << branches;
  }

  // rms_norm: the same reference from the (updated) f32 rows.
  DeviceBuffer<float> din(xr);
  DeviceBuffer<uint16_t> out2(n);
  out2.poison();
  ASSERT_EQ(k::rms_norm(din.get(), dw.get(), rows, width, eps, out2.get(), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(bf16_mismatches(out2.download(), ref), 0u) << "rms_norm width " << width;
}

TEST(CudaOps, AddRmsNormMatchesCpu) {
  REQUIRE_GPU();
  // Widths: register path (multiples of 4 up to 16384), the two-pass path (odd width, and one
  // wider than the register path holds), tiny rows.
  const int widths[] = {64, 2048, 7168, 16384, 20, 1001, 16388};
  uint32_t seed = 10;
  for (int width : widths)
    for (int branches = 0; branches <= 2; ++branches) run_norm_case(5, width, branches, true, ++seed);
  run_norm_case(3, 512, 2, false, 99);  // the residual add alone
  run_norm_case(1, 4, 1, true, 100);
}

TEST(CudaOps, SiluMulMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(5);
  for (int inter : {768, 1408, 20, 7}) {
    const int tokens = 9;
    const auto gu = random_bf16_exact(static_cast<size_t>(tokens) * 2 * inter, rng, 2.0f);
    std::vector<float> ref(static_cast<size_t>(tokens) * inter);
    cpu::silu_mul(gu.data(), ref.data(), tokens, inter);
    DeviceBuffer<uint16_t> dgu(to_bf16(gu)), act(ref.size());
    act.poison();
    ASSERT_EQ(k::silu_mul(dgu.get(), tokens, inter, act.get(), nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(bf16_mismatches(act.download(), ref), 0u) << "inter " << inter;
  }
}

TEST(CudaOps, SigmoidScaleRowsMatchesCpu) {
  REQUIRE_GPU();
  std::mt19937 rng(6);
  for (int width : {2048, 24, 13}) {
    const int rows = 6;
    const auto y = random_bf16_exact(static_cast<size_t>(rows) * width, rng, 1.0f);
    std::vector<float> gate = {-3.0f, 0.0f, 2.5f, -40.0f, 40.0f, 0.7f};
    std::vector<float> ref(y.size());
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < width; ++i) {
        const size_t j = static_cast<size_t>(r) * width + i;
        ref[j] = y[j] * (1.0f / (1.0f + std::exp(-gate[static_cast<size_t>(r)])));
      }
    DeviceBuffer<uint16_t> dy(to_bf16(y));
    DeviceBuffer<float> dg(gate);
    ASSERT_EQ(k::sigmoid_scale_rows(dy.get(), dg.get(), rows, width, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(bf16_mismatches(dy.download(), ref), 0u) << "width " << width;
  }
}

// ---- prepare_qkv ------------------------------------------------------------------------------

struct QkvCase {
  int q_heads, kv_heads, head_dim, rot_dim;
  int qk_norm;  // 0, 1 per head, 2 full width
  bool rope_half, bias;
  float clip;
};

constexpr uint16_t kSentinel = 0x3f9d;  // an ordinary bf16 (about 1.23), so NaN checks cannot hide it

// rope: the rotary table (model/rope.h); the plain one of theta 10000 unless given. tokens: 6
// with the fixed positions and slots below, or more (a prefill's grouped blocks) with random ones.
// qkv_offset: elements the input starts past a 256-byte boundary (2: only 4-byte aligned, which
// sends the usual layout to the general kernel instead of the two-heads-a-warp one).
void run_qkv_case(const QkvCase& c, uint32_t seed, const RopeScaling& scaling = {}, int tokens = 6,
                  int qkv_offset = 0) {
  std::mt19937 rng(seed);
  const int block_size = 4, num_blocks = tokens == 6 ? 5 : (tokens + 3) / block_size + 2;
  const int hd = c.head_dim, qw = c.q_heads * hd, kw = c.kv_heads * hd, width = qw + 2 * kw;
  const auto qkv = random_bf16_exact(static_cast<size_t>(tokens) * width, rng, 1.5f);
  const auto bias = random_bf16_exact(static_cast<size_t>(width), rng, 0.5f);
  const int norm_q = c.qk_norm == 2 ? qw : hd, norm_k = c.qk_norm == 2 ? kw : hd;
  std::vector<float> qn(static_cast<size_t>(norm_q)), kn(static_cast<size_t>(norm_k));
  for (auto& v : qn) v = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
  for (auto& v : kn) v = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
  RopeTable table;
  if (c.rot_dim > 0) table = rope_table(scaling, 10000.0, c.rot_dim);
  const std::vector<float>& inv_freq = table.inv_freq;
  std::vector<int32_t> positions = {0, 1, 17, 4095, 70000, 3};
  // Scattered over blocks, out of order; token 4 is padding and writes nothing.
  std::vector<int32_t> slots = {2 * block_size + 3, 4 * block_size + 0, 0 * block_size + 1,
                                3 * block_size + 2, -1, 1 * block_size + 0};
  if (tokens != 6) {  // distinct cache rows in a random order, every seventh token padding
    positions.resize(static_cast<size_t>(tokens));
    for (auto& x : positions) x = std::uniform_int_distribution<int32_t>(0, 70000)(rng);
    slots.resize(static_cast<size_t>(num_blocks) * block_size);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(static_cast<size_t>(tokens));
    for (size_t t = 3; t < slots.size(); t += 7) slots[t] = -1;
  }

  // The CPU reference in Model::attention's order.
  ThreadPool pool(1);
  std::vector<float> q(static_cast<size_t>(tokens) * qw), kk(static_cast<size_t>(tokens) * kw),
      v(static_cast<size_t>(tokens) * kw);
  for (int t = 0; t < tokens; ++t)
    for (int i = 0; i < width; ++i) {
      float x = qkv[static_cast<size_t>(t) * width + i] + (c.bias ? bias[static_cast<size_t>(i)] : 0.0f);
      if (i < qw) q[static_cast<size_t>(t) * qw + i] = x;
      else if (i < qw + kw) kk[static_cast<size_t>(t) * kw + i - qw] = x;
      else v[static_cast<size_t>(t) * kw + i - qw - kw] = x;
    }
  if (c.qk_norm != 0) {  // ops::rms_norm_groups: groups as wide as the weight
    cpu::rms_norm(pool, q.data(), qn.data(), q.data(), static_cast<int64_t>(q.size()) / norm_q, norm_q, 1e-6f);
    cpu::rms_norm(pool, kk.data(), kn.data(), kk.data(), static_cast<int64_t>(kk.size()) / norm_k, norm_k, 1e-6f);
  }
  if (c.clip > 0.0f)
    for (auto* x : {&q, &kk, &v})
      for (auto& e : *x) e = std::clamp(e, -c.clip, c.clip);
  auto rope = c.rope_half ? cpu::rope_half : cpu::rope_interleaved;
  rope(q.data(), tokens, c.q_heads, hd, c.rot_dim, positions.data(), inv_freq.data(), table.cos_sin_scale);
  rope(kk.data(), tokens, c.kv_heads, hd, c.rot_dim, positions.data(), inv_freq.data(), table.cos_sin_scale);

  std::vector<uint16_t> qkv_bits(static_cast<size_t>(qkv_offset), 0);
  const auto bits = to_bf16(qkv);
  qkv_bits.insert(qkv_bits.end(), bits.begin(), bits.end());
  DeviceBuffer<uint16_t> dqkv(qkv_bits);  // bf16-exact: the reference reads the same values
  DeviceBuffer<float> dbias(bias), dqn(qn), dkn(kn), dfreq(inv_freq.empty() ? std::vector<float>{0.0f} : inv_freq);
  DeviceBuffer<int32_t> dpos(positions), dslots(slots);
  const size_t cache_elems = static_cast<size_t>(num_blocks) * block_size * kw;
  const std::vector<uint16_t> sentinel(cache_elems, kSentinel);
  DeviceBuffer<uint16_t> kc(sentinel), vc(sentinel), qo(q.size());
  qo.poison();
  k::QkvParams p;
  p.tokens = tokens;
  p.q_heads = c.q_heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = hd;
  p.bias = c.bias ? dbias.get() : nullptr;
  p.qk_norm = c.qk_norm;
  p.q_norm = dqn.get();
  p.k_norm = dkn.get();
  p.eps = 1e-6f;
  p.clip = c.clip;
  p.rope_half = c.rope_half ? 1 : 0;
  p.rot_dim = c.rot_dim;
  p.inv_freq = dfreq.get();
  p.rope_scale = table.cos_sin_scale;
  p.positions = dpos.get();
  p.slots = dslots.get();
  p.k_cache = kc.get();
  p.v_cache = vc.get();
  p.q_out = qo.get();
  ASSERT_EQ(k::prepare_qkv(dqkv.get() + qkv_offset, p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const std::string what = "heads " + std::to_string(c.q_heads) + "/" + std::to_string(c.kv_heads) +
                           " hd " + std::to_string(hd) + " rot " + std::to_string(c.rot_dim) +
                           " norm " + std::to_string(c.qk_norm) + (c.rope_half ? " half" : " interleaved") +
                           (c.bias ? " bias" : "") + " clip " + std::to_string(c.clip) + " rope " +
                           rope_type_name(scaling.type) + " tokens " + std::to_string(tokens) +
                           " offset " + std::to_string(qkv_offset);
  EXPECT_EQ(bf16_mismatches(qo.download(), q), 0u) << "q: " << what;
  const auto kg = kc.download(), vg = vc.download();
  std::vector<uint16_t> kw_got, vw_got;
  std::vector<float> kw_ref, vw_ref;
  std::vector<bool> written(static_cast<size_t>(num_blocks) * block_size, false);
  for (int t = 0; t < tokens; ++t) {
    if (slots[static_cast<size_t>(t)] < 0) continue;
    const size_t s = static_cast<size_t>(slots[static_cast<size_t>(t)]);
    written[s] = true;
    kw_got.insert(kw_got.end(), kg.begin() + s * kw, kg.begin() + (s + 1) * kw);
    vw_got.insert(vw_got.end(), vg.begin() + s * kw, vg.begin() + (s + 1) * kw);
    kw_ref.insert(kw_ref.end(), kk.begin() + t * kw, kk.begin() + (t + 1) * kw);
    vw_ref.insert(vw_ref.end(), v.begin() + t * kw, v.begin() + (t + 1) * kw);
  }
  EXPECT_EQ(bf16_mismatches(kw_got, kw_ref), 0u) << "k: " << what;
  EXPECT_EQ(bf16_mismatches(vw_got, vw_ref), 0u) << "v: " << what;
  size_t touched = 0;
  for (size_t s = 0; s < written.size(); ++s)
    if (!written[s])
      for (int i = 0; i < kw; ++i)
        touched += (kg[s * kw + i] != kSentinel) + (vg[s * kw + i] != kSentinel);
  EXPECT_EQ(touched, 0u) << "cache rows of no token changed: " << what;
}

TEST(CudaOps, PrepareQkvMatchesCpuInEveryMode) {
  REQUIRE_GPU();
  uint32_t seed = 40;
  for (int hd : {8, 16, 32, 64, 128, 256})
    for (int norm = 0; norm <= 2; ++norm)
      for (bool half : {true, false}) {
        run_qkv_case({4, 2, hd, hd, norm, half, norm != 1, 0.0f}, ++seed);
        run_qkv_case({6, 3, hd, hd, norm, half, true, 1.1f}, ++seed);  // clip after the norm
      }
  // Partial rotation (only the leading features rotate) and a head count past one block tile.
  run_qkv_case({16, 4, 64, 32, 1, true, false, 0.0f}, 90);
  run_qkv_case({16, 4, 64, 32, 1, false, true, 0.0f}, 91);
  run_qkv_case({3, 1, 24, 0, 2, true, true, 0.0f}, 92);  // no rotation at all
  // YaRN (Qwen3's factor 4 over a short original context): interpolated frequencies and cos and
  // sin scaled by its attention factor 1.139.
  RopeScaling yarn;
  yarn.type = RopeType::kYarn;
  yarn.factor = 4.0;
  yarn.original_max_position = 64;
  run_qkv_case({4, 2, 128, 128, 1, true, false, 0.0f}, 93, yarn);
  run_qkv_case({4, 2, 64, 64, 0, false, true, 0.0f}, 94, yarn);
  // Prefill sizes, where a block takes several tokens (the last group short: 1027 = 4 x 256 + 3).
  for (int norm = 0; norm <= 2; ++norm) {
    run_qkv_case({8, 2, 128, 128, norm, true, norm == 2, 0.0f}, 95 + norm, {}, 1027);
    run_qkv_case({6, 3, 64, 32, norm, false, true, 1.1f}, 98 + norm, {}, 1026);
    // The usual layout (two heads a warp) at every head size it takes, with an odd head count so
    // that a half-warp holds no head, bias and clip.
    run_qkv_case({5, 1, 64, 64, norm, true, norm != 1, norm == 1 ? 1.1f : 0.0f}, 101 + norm, {}, 1027);
    run_qkv_case({3, 1, 256, 256, norm, true, true, 0.0f}, 104 + norm, {}, 1026);
  }
  // Decode sizes with an odd head count, and the usual layout from an input aligned to 4 bytes
  // only, which the general kernel takes.
  run_qkv_case({5, 1, 128, 128, 1, true, true, 0.0f}, 107);
  run_qkv_case({4, 2, 128, 128, 1, true, false, 0.0f}, 108, {}, 6, 2);
  run_qkv_case({8, 2, 128, 128, 2, true, true, 1.1f}, 109, {}, 1027, 2);
}

TEST(CudaOps, RejectsUnsupportedSizes) {
  REQUIRE_GPU();
  k::QkvParams p;
  p.tokens = 1;
  p.q_heads = p.kv_heads = 1;
  p.head_dim = 258;  // above kQkvMaxHeadDim
  EXPECT_EQ(k::prepare_qkv(nullptr, p, nullptr), cudaErrorInvalidValue);
  p.head_dim = 7;  // odd
  EXPECT_EQ(k::prepare_qkv(nullptr, p, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(k::add_rms_norm(nullptr, nullptr, nullptr, nullptr, 1, 0, 1e-6f, nullptr, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace moe
