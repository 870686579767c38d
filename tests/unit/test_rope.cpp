// Scaled rotary embeddings: both spellings of config.json, refusals of what is not implemented,
// and the tables checked against the definitions (YaRN paper, Llama 3.1) evaluated here in
// double precision. Whole-model agreement with transformers is in the fixture tests.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include <nlohmann/json.hpp>

#include "model/rope.h"
#include "test_util.h"

namespace moe {
namespace {

using nlohmann::json;
using test::expect_error;

RopeScaling parse(const std::string& text, int64_t max_positions = 163840) {
  return parse_rope_scaling(HfConfig(json::parse(text), "config.json"), max_positions);
}

double plain_inv_freq(double theta, int64_t i, int64_t dim) { return 1.0 / std::pow(theta, 2.0 * i / dim); }

TEST(Rope, AbsentOrDefaultIsPlainRope) {
  EXPECT_EQ(parse(R"({"rope_theta": 10000})").type, RopeType::kDefault);
  EXPECT_EQ(parse(R"({"rope_scaling": null})").type, RopeType::kDefault);
  EXPECT_EQ(parse(R"({"rope_parameters": {"rope_type": "default", "rope_theta": 5}})").type, RopeType::kDefault);
  const RopeTable t = rope_table(RopeScaling{}, 10000.0, 64);
  ASSERT_EQ(t.inv_freq.size(), 32u);
  EXPECT_EQ(t.cos_sin_scale, 1.0f);
  for (int64_t i = 0; i < 32; ++i)
    EXPECT_NEAR(t.inv_freq[static_cast<size_t>(i)], plain_inv_freq(10000.0, i, 64), 1e-6 * plain_inv_freq(10000.0, i, 64));
}

// DeepSeek-V3's config.json as published, and the same embedding as transformers 5 writes it.
TEST(Rope, LegacyAndNewSpellingsReadTheSame) {
  const RopeScaling legacy = parse(R"({"rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1,
      "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
      "type": "yarn"}})");
  const RopeScaling modern = parse(R"({"rope_parameters": {"rope_theta": 10000, "beta_fast": 32,
      "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
      "original_max_position_embeddings": 4096, "rope_type": "yarn"}})");
  for (const RopeScaling* r : {&legacy, &modern}) {
    EXPECT_EQ(r->type, RopeType::kYarn);
    EXPECT_EQ(r->factor, 40.0);
    EXPECT_EQ(r->original_max_position, 4096);
    EXPECT_EQ(r->beta_fast, 32.0);
    EXPECT_EQ(r->beta_slow, 1.0);
    EXPECT_EQ(r->mscale, 1.0);
    EXPECT_EQ(r->mscale_all_dim, 1.0);
  }
  // Both present and agreeing (transformers 5 re-saving a legacy config) is fine; disagreeing is not.
  EXPECT_EQ(parse(R"({"rope_scaling": {"type": "linear", "factor": 2},
                      "rope_parameters": {"rope_type": "linear", "factor": 2, "rope_theta": 100}})").factor, 2.0);
  auto e = expect_error([] {
    parse(R"({"rope_scaling": {"type": "yarn", "factor": 4},
              "rope_parameters": {"rope_type": "yarn", "factor": 8}})");
  });
  EXPECT_EQ(e.kind(), ErrorKind::kConfig);
  EXPECT_NE(e.message().find("disagree on 'factor'"), std::string::npos) << e.message();
}

// Qwen3's recipe: factor 4 over 32,768, every other value a default.
TEST(Rope, YarnDefaultsAndAttentionFactor) {
  const RopeScaling r = parse(R"({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 32768}})", 40960);
  EXPECT_EQ(r.beta_fast, 32.0);
  EXPECT_EQ(r.beta_slow, 1.0);
  EXPECT_TRUE(r.truncate);
  // 0.1 ln 4 + 1
  EXPECT_NEAR(rope_table(r, 1e6, 128).cos_sin_scale, 1.1386294, 1e-6);
  // No DeepSeek softmax correction without mscale_all_dim.
  EXPECT_EQ(yarn_softmax_mscale_squared(r), 1.0);
  // transformers 5: without a factor, the ratio of the extended to the original context.
  EXPECT_EQ(parse(R"({"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 1024}})", 8192)
                .factor,
            8.0);
  // Zero or null optional values mean their defaults, as transformers' `value or default`.
  EXPECT_EQ(parse(R"({"rope_scaling": {"type": "yarn", "factor": 2, "beta_fast": 0, "beta_slow": null}})")
                .beta_fast,
            32.0);
}

// The real DeepSeek-V3 table: dimensions that turn more than beta_fast = 32 times over the
// original 4096 positions keep their frequency, those turning fewer than beta_slow = 1 times are
// divided by the factor, and the ramp between them runs over dimensions floor(10.47) = 10 to
// ceil(22.51) = 23 (d ln(4096 / (2 pi beta)) / (2 ln 10000) with d = 64).
TEST(Rope, YarnTableFollowsThePaper) {
  const RopeScaling r = parse(R"({"rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
      "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}})");
  const RopeTable t = rope_table(r, 10000.0, 64);
  ASSERT_EQ(t.inv_freq.size(), 32u);
  for (int64_t i = 0; i < 32; ++i) {
    const double plain = plain_inv_freq(10000.0, i, 64), got = t.inv_freq[static_cast<size_t>(i)];
    if (i <= 10) {
      EXPECT_NEAR(got, plain, 5e-7 * plain) << i;
    } else if (i >= 23) {
      EXPECT_NEAR(got, plain / 40.0, 5e-7 * plain / 40.0) << i;
    } else {
      const double keep = 1.0 - (i - 10) / 13.0;  // the ramp from dimension 10 to 23
      const double expected = plain / 40.0 * (1.0 - keep) + plain * keep;
      EXPECT_NEAR(got, expected, 1e-6 * expected) << i;
    }
  }
  // mscale == mscale_all_dim: no factor on cos and sin; the softmax takes m^2, m = 0.1 ln 40 + 1.
  EXPECT_EQ(t.cos_sin_scale, 1.0f);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(yarn_softmax_mscale_squared(r), m * m, 1e-12);
  EXPECT_NEAR(m * m, 1.8738542, 1e-6);
  // DeepSeek-V2-Lite: mscale_all_dim 0.707.
  const RopeScaling lite = parse(R"({"rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
      "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"}})");
  const double ml = 0.0707 * std::log(40.0) + 1.0;
  EXPECT_NEAR(yarn_softmax_mscale_squared(lite), ml * ml, 1e-12);
  // mscale != mscale_all_dim: cos and sin take their ratio.
  const RopeScaling odd = parse(R"({"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.9,
      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}})");
  EXPECT_NEAR(rope_table(odd, 10000.0, 64).cos_sin_scale, (0.09 * std::log(40.0) + 1.0) / m, 1e-6);
}

TEST(Rope, YarnWithoutTruncationRampsOverFractionalDimensions) {
  const RopeScaling r = parse(R"({"rope_parameters": {"rope_type": "yarn", "factor": 40, "truncate": false,
      "original_max_position_embeddings": 4096}})");
  EXPECT_FALSE(r.truncate);
  const RopeTable t = rope_table(r, 10000.0, 64);
  const double low = 64 * std::log(4096 / (32 * 2 * std::numbers::pi)) / (2 * std::log(10000.0));
  const double high = 64 * std::log(4096 / (2 * std::numbers::pi)) / (2 * std::log(10000.0));
  for (int64_t i : {11, 16, 22}) {
    const double keep = 1.0 - (i - low) / (high - low);
    const double plain = plain_inv_freq(10000.0, i, 64);
    const double expected = plain / 40.0 * (1.0 - keep) + plain * keep;
    EXPECT_NEAR(t.inv_freq[static_cast<size_t>(i)], expected, 1e-6 * expected) << i;
  }
}

TEST(Rope, LinearAndLlama3Tables) {
  const RopeTable lin = rope_table(parse(R"({"rope_scaling": {"type": "linear", "factor": 2.5}})"), 10000.0, 16);
  for (int64_t i = 0; i < 8; ++i)
    EXPECT_NEAR(lin.inv_freq[static_cast<size_t>(i)], plain_inv_freq(10000.0, i, 16) / 2.5,
                1e-6 * plain_inv_freq(10000.0, i, 16));
  // Llama 3.1's recipe: wavelengths under 8192 / 4 kept, over 8192 / 1 divided by 8, between
  // blended by (8192 / wavelength - 1) / 3.
  const RopeScaling l3 = parse(R"({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})");
  const RopeTable t = rope_table(l3, 500000.0, 128);
  int kept = 0, divided = 0, blended = 0;
  for (int64_t i = 0; i < 64; ++i) {
    const double plain = plain_inv_freq(500000.0, i, 128), wavelen = 2 * std::numbers::pi / plain;
    double expected = plain;
    if (wavelen > 8192) {
      expected = plain / 8, ++divided;
    } else if (wavelen >= 2048) {
      const double smooth = (8192 / wavelen - 1) / 3;
      expected = (1 - smooth) * plain / 8 + smooth * plain, ++blended;
    } else {
      ++kept;
    }
    EXPECT_NEAR(t.inv_freq[static_cast<size_t>(i)], expected, 1e-5 * expected) << i;
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(blended, 0);
}

TEST(Rope, RefusesWhatItDoesNotImplement) {
  struct Case {
    const char* config;
    ErrorKind kind;
    const char* says;
  };
  const Case cases[] = {
      {R"({"rope_scaling": {"type": "dynamic", "factor": 2}})", ErrorKind::kUnsupported, "'dynamic'"},
      {R"({"rope_scaling": {"type": "longrope", "short_factor": [1], "long_factor": [2]}})", ErrorKind::kUnsupported,
       "rope type 'longrope' is not supported (supported: default, linear, llama3, yarn)"},
      {R"({"rope_scaling": {"type": "yarn", "factor": 4, "extrapolation": 2}})", ErrorKind::kUnsupported,
       "key 'extrapolation' is not supported with rope type 'yarn'"},
      {R"({"rope_parameters": {"rope_type": "default", "factor": 4}})", ErrorKind::kUnsupported, "key 'factor'"},
      {R"({"rope_scaling": {"type": "yarn", "factor": 4, "partial_rotary_factor": 0.5}})", ErrorKind::kUnsupported,
       "partial_rotary_factor"},
      {R"({"rope_scaling": {"type": "linear"}})", ErrorKind::kConfig, "needs 'factor'"},
      {R"({"rope_scaling": {"type": "linear", "factor": -2}})", ErrorKind::kConfig, "factor must be positive"},
      {R"({"rope_scaling": {"type": "yarn", "factor": "40"}})", ErrorKind::kConfig, "'factor' must be a finite number"},
      {R"({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 0}})",
       ErrorKind::kConfig, "positive integer"},
      {R"({"rope_scaling": {"type": "yarn", "factor": 4, "truncate": 1}})", ErrorKind::kConfig, "true or false"},
      {R"({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1,
           "original_max_position_embeddings": 8192}})", ErrorKind::kConfig, "low_freq_factor < high_freq_factor"},
      {R"({"rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}})",
       ErrorKind::kConfig, "needs 'original_max_position_embeddings'"},
      {R"({"rope_scaling": [1, 2]})", ErrorKind::kConfig, "'rope_scaling' must be an object"},
      {R"({"rope_scaling": {"type": 3}})", ErrorKind::kConfig, "rope_type must be a string"},
  };
  for (const Case& c : cases) {
    const Error e = expect_error([&] { parse(c.config); });
    EXPECT_EQ(e.kind(), c.kind) << c.config << ": " << e.message();
    EXPECT_NE(e.message().find(c.says), std::string::npos) << e.message();
    EXPECT_EQ(e.message().find('\n'), std::string::npos) << "one line: " << e.message();
  }
}

}  // namespace
}  // namespace moe
