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
