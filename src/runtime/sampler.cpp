#include "runtime/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "moe/errors.h"

namespace moe {

void validate_sampling(const SamplingParams& p) {
  MOE_CHECK(p.temperature >= 0.0f && std::isfinite(p.temperature), kInvalidArgument,
            "temperature must be >= 0, got {}", p.temperature);
  MOE_CHECK(p.top_k >= 0, kInvalidArgument, "top-k must be >= 0, got {}", p.top_k);
  MOE_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, kInvalidArgument, "top-p must be in (0, 1], got {}",
            p.top_p);
}

SamplingParams effective_sampling(const SamplingParams& params, int64_t vocab) {
  SamplingParams p = params;
  if (p.temperature < kGreedyTemperature || p.top_k == 1) {
    p.temperature = 0.0f;
    p.top_k = 0;
    p.top_p = 1.0f;
  }
  if (vocab > 0 && p.top_k >= vocab) p.top_k = 0;
  return p;
}

Sampler::Sampler(const SamplingParams& params) : params_(params) { validate_sampling(params); }

void Sampler::set_params(const SamplingParams& params) {
  validate_sampling(params);
  params_ = params;
}

namespace {

// Higher logit first; ties to the lower id, as the argmax.
bool before(float la, int32_t ia, float lb, int32_t ib) { return la > lb || (la == lb && ia < ib); }

// e^x for x <= 0, in a form the compiler vectorizes (no library call, no branch): x = n ln 2 + r
// with |r| <= ln 2 / 2, e^r by its Taylor series to degree 7 (relative error under 1e-8), 2^n in
// the exponent bits. x is clamped at -87: a token that far below the best one weighs 1.6e-38 of
// it instead of less, which no number of draws can tell apart.
inline float exp_nonpositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 split for exact n * ln2_hi
  x = std::max(x, -87.0f);
  const float n = std::floor(x * kLog2e + 0.5f);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return p * scale;
}

// Nucleus bins: the scaled logit x = (l - max) / T in [-kBinRange, 0], kBinsPerNat bins a nat.
constexpr int kBinsPerNat = 4;
constexpr int kBinRange = 64;
constexpr int kBins = kBinsPerNat * kBinRange + 1;  // the last holds everything below -64
constexpr int kSubBins = 256;                       // the bin where the nucleus ends, split again
constexpr int64_t kBlock = 1024;                    // weights summed per block, for the draw's walk

// A uniform number in [0, 1) for draw `draw` of the stream `seed`: splitmix64's finaliser over
// the pair, 53 bits kept.
double uniform(uint64_t seed, int64_t draw) {
  auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  return static_cast<double>(mix(mix(seed) ^ static_cast<uint64_t>(draw)) >> 11) * 0x1.0p-53;
}

}  // namespace

int32_t Sampler::sample(const float* logits, int64_t vocab, int64_t draw) {
  const SamplingParams p = effective_sampling(params_, vocab);
  int64_t best = 0;  // the first maximum, as torch.argmax
  for (int64_t i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;
  if (p.temperature == 0.0f) return static_cast<int32_t>(best);
  const float mx = logits[best], inv_t = 1.0f / p.temperature;
  const double u = uniform(params_.seed, draw);

  if (p.top_k > 0) {
    // The k best by one pass that keeps the worst of them at the front of a heap: most tokens
    // cost one comparison. Then only they are ordered (top_p needs the order) and weighed.
    const auto k = static_cast<size_t>(p.top_k);
    auto worse = [&](int32_t a, int32_t b) { return before(logits[a], a, logits[b], b); };  // heap: worst on top
    ids_.clear();
    for (int32_t i = 0; i < static_cast<int32_t>(vocab); ++i) {
      if (ids_.size() < k) {
        ids_.push_back(i);
        std::push_heap(ids_.begin(), ids_.end(), worse);
      } else if (before(logits[i], i, logits[ids_.front()], ids_.front())) {
        std::pop_heap(ids_.begin(), ids_.end(), worse);
        ids_.back() = i;
        std::push_heap(ids_.begin(), ids_.end(), worse);
      }
    }
    std::sort(ids_.begin(), ids_.end(), worse);
    weights_.resize(ids_.size());
    double sum = 0.0;
    for (size_t j = 0; j < ids_.size(); ++j) sum += weights_[j] = exp_nonpositive((logits[ids_[j]] - mx) * inv_t);
    size_t keep = ids_.size();
    if (p.top_p < 1.0f) {
      const double target = static_cast<double>(p.top_p) * sum;
      double cumulative = 0.0;
      keep = 0;
      while (keep < ids_.size() && cumulative < target) cumulative += weights_[keep++];
      sum = cumulative;
    }
    double r = u * sum;
    for (size_t j = 0; j < keep; ++j)
      if ((r -= weights_[j]) <= 0.0) return ids_[j];
    return ids_[keep - 1];
  }

  // Every token a candidate: one pass weighs them all (vectorized), summing per block.
  weights_.resize(static_cast<size_t>(vocab));
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  block_sums_.assign(static_cast<size_t>(blocks), 0.0);
  double sum = 0.0;
  float* w = weights_.data();
  for (int64_t i = 0; i < vocab; ++i) w[i] = exp_nonpositive((logits[i] - mx) * inv_t);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(vocab, lo + kBlock);
    // Eight running sums (a vector's worth): at most 128 terms of at most 1 each.
    float lanes[8] = {};
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8)
      for (int j = 0; j < 8; ++j) lanes[j] += w[i + j];
    double block = 0.0;
    for (float lane : lanes) block += lane;
    for (; i < hi; ++i) block += w[i];
    block_sums_[static_cast<size_t>(b)] = block;
    sum += block;
  }
  if (p.top_p >= 1.0f) {
    double r = u * sum;
    for (int64_t b = 0; b < blocks; ++b) {
      if (r > block_sums_[static_cast<size_t>(b)] && b + 1 < blocks) {
        r -= block_sums_[static_cast<size_t>(b)];
        continue;
      }
      const int64_t lo = b * kBlock, hi = std::min(vocab, lo + kBlock);
      for (int64_t i = lo; i < hi; ++i)
        if ((r -= weights_[static_cast<size_t>(i)]) <= 0.0) return static_cast<int32_t>(i);
      return static_cast<int32_t>(hi - 1);
    }
    return static_cast<int32_t>(best);
  }

  // Top-p over every token, by selection: the mass of each bin of the scaled logit tells which bin
  // the nucleus ends in; tokens of higher bins are all in, and only that bin's are ordered. Bins
  // follow the logit, so this is the nucleus of the sorted order exactly.
  bins_.resize(static_cast<size_t>(vocab));
  const float per_nat = inv_t * static_cast<float>(kBinsPerNat);
  for (int64_t i = 0; i < vocab; ++i)
    bins_[static_cast<size_t>(i)] =
        static_cast<uint16_t>(std::min((mx - logits[i]) * per_nat, static_cast<float>(kBins - 1)));
  bin_mass_.assign(kBins, 0.0);
  for (int64_t i = 0; i < vocab; ++i) bin_mass_[bins_[static_cast<size_t>(i)]] += w[i];
  const double target = static_cast<double>(p.top_p) * sum;
  double above = 0.0;
  int last = 0;
  while (last < kBins - 1 && above + bin_mass_[static_cast<size_t>(last)] < target) above += bin_mass_[static_cast<size_t>(last++)];
  ids_.clear();
  size_t full = 0;  // ids_[0, full) lie in bins before `last`
  for (int32_t i = 0; i < static_cast<int32_t>(vocab); ++i)
    if (bins_[static_cast<size_t>(i)] < last) ids_.push_back(i);
  full = ids_.size();
  for (int32_t i = 0; i < static_cast<int32_t>(vocab); ++i)
    if (bins_[static_cast<size_t>(i)] == last) ids_.push_back(i);
  // A flat distribution puts thousands of tokens in that bin: split it once more, 256 ways, so
  // that only the tokens of the sub-bin where the nucleus ends are sorted.
  auto sub_of = [&](int32_t id) {
    const float x = ((mx - logits[id]) * per_nat - static_cast<float>(last)) * static_cast<float>(kSubBins);
    return std::clamp(static_cast<int>(x), 0, kSubBins - 1);
  };
  sub_mass_.assign(kSubBins, 0.0);
  for (size_t j = full; j < ids_.size(); ++j) sub_mass_[static_cast<size_t>(sub_of(ids_[j]))] += w[ids_[j]];
  int sub = 0;
  while (sub < kSubBins - 1 && above + sub_mass_[static_cast<size_t>(sub)] < target) above += sub_mass_[static_cast<size_t>(sub++)];
  const auto begin = ids_.begin() + static_cast<std::ptrdiff_t>(full);
  const auto inside = std::stable_partition(begin, ids_.end(), [&](int32_t id) { return sub_of(id) < sub; });
  const auto crossing = std::stable_partition(inside, ids_.end(), [&](int32_t id) { return sub_of(id) == sub; });
  ids_.erase(crossing, ids_.end());
  full = static_cast<size_t>(inside - ids_.begin());
  auto order = [&](int32_t a, int32_t b) { return before(logits[a], a, logits[b], b); };
  std::sort(ids_.begin() + static_cast<std::ptrdiff_t>(full), ids_.end(), order);
  double cumulative = above;
  size_t keep = full;
  while (keep < ids_.size() && cumulative < target) cumulative += weights_[static_cast<size_t>(ids_[keep++])];
  double r = u * cumulative;
  for (size_t j = 0; j < keep; ++j)
    if ((r -= weights_[static_cast<size_t>(ids_[j])]) <= 0.0) return ids_[j];
  return ids_[keep - 1];
}

}  // namespace moe
