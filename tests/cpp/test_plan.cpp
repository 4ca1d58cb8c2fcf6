// The memory and time plan (train/plan.h): its parameter classes against the components'
// declarations, what ZeRO, expert parallelism, the optimizer precision and activation
// checkpointing change, the suggestions, and that a model far beyond any machine is planned at
// once, without allocating it. (Its accuracy against measured runs: tests/python/test_plan.py.)
#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>

#include "automoe/core/error.h"
#include "automoe/model/components.h"
#include "automoe/model/config.h"
#include "automoe/train/plan.h"
#include "automoe/train/recipe.h"

namespace automoe::train {
namespace {

using nlohmann::json;

json qwen3(int64_t layers = 4, int64_t experts = 8, int64_t hidden = 64) {
  return {{"model_type", "qwen3_moe"},   {"vocab_size", 1000},         {"hidden_size", hidden},
          {"intermediate_size", 2 * hidden}, {"moe_intermediate_size", hidden / 2},
          {"num_hidden_layers", layers},
          {"num_attention_heads", 4},    {"num_key_value_heads", 2},    {"head_dim", 16},
          {"num_experts", experts},      {"num_experts_per_tok", 2},    {"mlp_only_layers", json::array()},
          {"max_position_embeddings", 4096}};
}

Recipe recipe(json changes = json::object()) {
  json r = {{"model", {{"path", "m"}, {"dtype", "bfloat16"}}},
            {"data", {{"train", "t.jsonl"}, {"seq_len", 128}}},
            {"checkpoint", {{"dir", "run"}}}};
  r.merge_patch(changes);
  return Recipe::parse(r.dump(), "r.yaml");
}

double item(const RankPlan& p, const std::string& name) {
  for (const MemoryItem& m : p.memory) {
    if (m.name == name) return m.bytes;
  }
  return 0;
}

struct Params {
  double dense = 0, experts = 0;
};
Params params_of(const ModelSpec& spec) {
  Params n;
  for (const ParamDecl& d : parameter_layout(spec)) {
    double k = 1;
    for (int64_t x : d.shape) k *= static_cast<double>(x);
    (d.routed_expert ? n.experts : n.dense) += k;
  }
  return n;
}

TEST(Plan, WeightsMastersAndMomentsComeFromTheComponentDeclarations) {
  const ModelSpec spec = parse_config(qwen3().dump(), "c.json").spec;
  const Params n = params_of(spec);
  const json f32 = {{"optimizer", {{"master_weights", "float32"}, {"state_dtype", "float32"}}}};
  const RankPlan p = plan_rank(spec, recipe(f32), 1, 0, false);
  EXPECT_DOUBLE_EQ(item(p, "weights"), 2 * (n.dense + n.experts));
  EXPECT_DOUBLE_EQ(item(p, "master weights"), 4 * (n.dense + n.experts));
  EXPECT_DOUBLE_EQ(item(p, "optimizer moments"), 8 * (n.dense + n.experts));
  EXPECT_TRUE(p.fits);  // no memory given: nothing to compare with
  // The default ("auto") for one bf16 process: remainders and 8-bit moments.
  const RankPlan d = plan_rank(spec, recipe(), 1, 0, false);
  EXPECT_EQ(d.master_weights, "remainders");
  EXPECT_EQ(d.state_dtype, "8bit");
  EXPECT_DOUBLE_EQ(item(d, "master weights"), 2 * (n.dense + n.experts));
  // float32: the weights are the masters.
  const RankPlan f = plan_rank(spec, recipe({{"model", {{"dtype", "float32"}}}}), 1, 0, false);
  EXPECT_DOUBLE_EQ(item(f, "weights"), 4 * (n.dense + n.experts));
  EXPECT_DOUBLE_EQ(item(f, "master weights"), 0);
}

TEST(Plan, ExpertParallelismAndZeroShardWhatTheEngineShards) {
  const ModelSpec spec = parse_config(qwen3().dump(), "c.json").spec;
  const Params n = params_of(spec);
  // ep 2 x dp 2, ZeRO-1: each rank holds half the experts; masters and moments of dense tensors
  // are sliced over the 4 ranks, the experts' over their 2 data-parallel replicas.
  const RankPlan p = plan_rank(
      spec, recipe({{"parallel", {{"ep", 2}, {"zero", 1}}}, {"train", {{"grad_accumulation_steps", 4}}}}),
      4, 0, false);
  EXPECT_EQ(p.ep, 2);
  EXPECT_EQ(p.dp, 2);
  EXPECT_DOUBLE_EQ(item(p, "weights"), 2 * (n.dense + n.experts / 2));
  EXPECT_DOUBLE_EQ(item(p, "master weights"), 4 * (n.dense / 4 + n.experts / 2 / 2));
  EXPECT_DOUBLE_EQ(item(p, "optimizer moments"), 8 * (n.dense / 4 + n.experts / 2 / 2));
}

TEST(Plan, LeanerPrecisionAndCheckpointingNeedLess) {
  const ModelSpec spec = parse_config(qwen3().dump(), "c.json").spec;
  const Params n = params_of(spec);
  const RankPlan full = plan_rank(
      spec, recipe({{"optimizer", {{"master_weights", "float32"}, {"state_dtype", "float32"}}}}), 1,
      0, false);
  const RankPlan lean = plan_rank(
      spec, recipe({{"optimizer", {{"master_weights", "remainders"}, {"state_dtype", "8bit"}}}}), 1, 0,
      false);
  EXPECT_DOUBLE_EQ(item(lean, "master weights"), 2 * (n.dense + n.experts));
  EXPECT_LT(item(lean, "optimizer moments"), 0.3 * item(full, "optimizer moments"));
  EXPECT_LT(lean.peak_bytes, full.peak_bytes);
  const RankPlan ckpt =
      plan_rank(spec, recipe({{"train", {{"activation_checkpointing", true}}}}), 1, 0, false);
  EXPECT_LT(item(ckpt, "activations (one micro-batch)"), item(full, "activations (one micro-batch)"));
  // Longer sequences need more activation memory.
  const RankPlan longer = plan_rank(spec, recipe({{"data", {{"seq_len", 1024}}}}), 1, 0, false);
  EXPECT_GT(item(longer, "activations (one micro-batch)"), 4 * item(full, "activations (one micro-batch)"));
}

TEST(Plan, ARunThatDoesNotFitGetsConfigurationsThatDo) {
  const ModelSpec spec = parse_config(qwen3(4, 64, 512).dump(), "c.json").spec;
  const Recipe rc = recipe({{"train", {{"grad_accumulation_steps", 8}}}});
  const RankPlan alone = plan_rank(spec, rc, 1, 0, false);
  PlanTarget t;
  t.nproc_per_node = 4;
  t.rank_memory_bytes = 0.5 * alone.peak_bytes;  // half of what one process needs
  t.peak_tflops = 1.0;
  const Plan plan = make_plan(spec, rc, t);
  ASSERT_FALSE(plan.suggestions.empty());
  for (const RankPlan& s : plan.suggestions) {
    EXPECT_TRUE(s.fits) << s.describe();
    EXPECT_LE(s.peak_bytes, t.rank_memory_bytes) << s.describe();
    EXPECT_GT(s.tokens_per_s, 0);
  }
  for (size_t i = 1; i < plan.suggestions.size(); ++i) {
    EXPECT_GE(plan.suggestions[i - 1].tokens_per_s * 1.001, plan.suggestions[i].tokens_per_s);
  }
  const json j = json::parse(plan.to_json());
  EXPECT_EQ(j["suggestions"].size(), plan.suggestions.size());
  EXPECT_NE(plan.to_text().find("configurations that fit"), std::string::npos);
}

TEST(Plan, ModelsBeyondAnyMachineArePlannedAtOnceWithoutAllocating) {
  // (The config reader's bounds: at most 4096 layers and 65536 experts; beyond, a clear error.)
  for (const auto& [layers, experts] : {std::pair<int64_t, int64_t>{1000, 128},
                                        std::pair<int64_t, int64_t>{4096, 65536}}) {
    const ModelSpec spec = parse_config(qwen3(layers, experts, 4096).dump(), "c.json").spec;
    PlanTarget t;
    t.device = "cuda";
    t.nproc_per_node = 8;
    const auto t0 = std::chrono::steady_clock::now();
    const Plan plan = make_plan(spec, recipe(), t);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_LT(s, 1.0) << layers << " layers, " << experts << " experts";
    EXPECT_FALSE(plan.chosen.fits);
    EXPECT_NE(plan.to_text().find("DOES NOT FIT"), std::string::npos);
  }
  try {
    parse_config(qwen3(4, 1000000000).dump(), "c.json");
    ADD_FAILURE() << "10^9 experts accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_experts"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace automoe::train
