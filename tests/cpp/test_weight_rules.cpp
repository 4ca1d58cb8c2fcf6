// Weight rules are exact inverses: per-expert tensors -> fused [E, ...] -> the same tensors.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>

#include "automoe/core/error.h"
#include "automoe/io/weight_rules.h"

namespace automoe {
namespace {

const WeightRule kGateUp{"mlp.experts.gate_up_proj",
                         {"mlp.experts.{E}.gate_proj.weight", "mlp.experts.{E}.up_proj.weight"},
                         1,
                         std::nullopt};

TEST(WeightRules, FindsRuleBySuffixAndReturnsPrefix) {
  std::string prefix;
  const std::vector<WeightRule> rules{kGateUp};
  EXPECT_EQ(find_rule(rules, "model.layers.3.mlp.experts.gate_up_proj", &prefix), &rules[0]);
  EXPECT_EQ(prefix, "model.layers.3.");
  EXPECT_EQ(find_rule(rules, "model.layers.3.mlp.gate.weight", &prefix), nullptr);
  EXPECT_EQ(disk_name("model.layers.3.", kGateUp.parts[1], 11),
            "model.layers.3.mlp.experts.11.up_proj.weight");
}

TEST(WeightRules, GatherStacksExpertsAndConcatenatesGateUp) {
  at::manual_seed(0);
  const int64_t E = 3, I = 5, H = 7;
  std::map<std::string, at::Tensor> disk;
  for (int64_t e = 0; e < E; ++e) {
    disk[disk_name("p.", kGateUp.parts[0], e)] = at::randn({I, H});
    disk[disk_name("p.", kGateUp.parts[1], e)] = at::randn({I, H});
  }
  const at::Tensor fused =
      gather_experts(kGateUp, "p.", E, [&](const std::string& n) { return disk.at(n); });
  ASSERT_EQ(fused.sizes(), (std::vector<int64_t>{E, 2 * I, H}));
  EXPECT_TRUE(at::equal(fused[1].narrow(0, 0, I), disk.at("p.mlp.experts.1.gate_proj.weight")));
  EXPECT_TRUE(at::equal(fused[2].narrow(0, I, I), disk.at("p.mlp.experts.2.up_proj.weight")));

  const auto back = scatter_experts(kGateUp, "p.", fused);
  ASSERT_EQ(back.size(), disk.size());
  for (const auto& [name, t] : back) EXPECT_TRUE(at::equal(t, disk.at(name))) << name;
}

TEST(WeightRules, TransposeIsUndoneOnSave) {
  const WeightRule rule{"experts.down_proj", {"experts.{E}.w2"}, 0, std::make_pair(1, 2)};
  std::map<std::string, at::Tensor> disk{{"experts.0.w2", at::randn({4, 6})},
                                         {"experts.1.w2", at::randn({4, 6})}};
  const at::Tensor fused =
      gather_experts(rule, "", 2, [&](const std::string& n) { return disk.at(n); });
  EXPECT_EQ(fused.sizes(), (std::vector<int64_t>{2, 6, 4}));
  for (const auto& [name, t] : scatter_experts(rule, "", fused))
    EXPECT_TRUE(at::equal(t, disk.at(name)));
}

TEST(WeightRules, InterleavedPartsAlternateAndSplitBackOnSave) {
  // GPT-OSS style: gate and up interleaved along the last dim (gate at even, up at odd columns).
  WeightRule rule{"experts.gate_up", {"experts.{E}.gate", "experts.{E}.up"}, 2, std::nullopt};
  rule.interleave = true;
  std::map<std::string, at::Tensor> disk;
  for (int e = 0; e < 2; ++e) {
    disk["experts." + std::to_string(e) + ".gate"] = at::randn({3, 4});
    disk["experts." + std::to_string(e) + ".up"] = at::randn({3, 4});
  }
  const at::Tensor fused =
      gather_experts(rule, "", 2, [&](const std::string& n) { return disk.at(n); });
  ASSERT_EQ(fused.sizes(), (std::vector<int64_t>{2, 3, 8}));
  EXPECT_TRUE(at::equal(fused[1].slice(1, 0, 8, 2), disk.at("experts.1.gate")));
  EXPECT_TRUE(at::equal(fused[1].slice(1, 1, 8, 2), disk.at("experts.1.up")));
  const auto back = scatter_experts(rule, "", fused);
  ASSERT_EQ(back.size(), disk.size());
  for (const auto& [name, t] : back) EXPECT_TRUE(at::equal(t, disk.at(name))) << name;
}

TEST(WeightRules, RenamesApplyOneWayAndBack) {
  const std::vector<RenameRule> rules{{".mlp.gate.", ".block_sparse_moe.gate."}};
  EXPECT_EQ(to_disk_name(rules, "model.layers.2.mlp.gate.weight"),
            "model.layers.2.block_sparse_moe.gate.weight");
  EXPECT_EQ(to_memory_name(rules, "model.layers.2.block_sparse_moe.gate.weight"),
            "model.layers.2.mlp.gate.weight");
  EXPECT_EQ(to_disk_name(rules, "model.layers.2.self_attn.q_proj.weight"),
            "model.layers.2.self_attn.q_proj.weight");
}

TEST(WeightRules, RejectsExpertsOfDifferentShapes) {
  std::map<std::string, at::Tensor> disk{
      {"mlp.experts.0.gate_proj.weight", at::zeros({5, 7})},
      {"mlp.experts.1.gate_proj.weight", at::zeros({5, 8})},
  };
  try {
    gather_experts(kGateUp, "", 2, [&](const std::string& n) { return disk.at(n); });
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.experts.1.gate_proj.weight"), std::string::npos);
  }
}

TEST(WeightRules, ParsesLayoutNames) {
  EXPECT_EQ(layout_from_string("fused", "x"), ExpertsLayout::kFused);
  EXPECT_EQ(layout_from_string("per-expert", "x"), ExpertsLayout::kPerExpert);
  EXPECT_THROW(layout_from_string("stacked", "--layout"), Error);
}

}  // namespace
}  // namespace automoe
