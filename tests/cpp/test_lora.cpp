// LoRA (model/lora.h) on the tiny spec: which weights a PEFT config targets and under which PEFT
// names, the decoder with adapters against the decoder with merged weights (every experts
// backend), the PEFT adapter directory round trip, and the errors that name the target.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "automoe/core/error.h"
#include "automoe/model/decoder.h"
#include "automoe/model/lora.h"
#include "tiny_spec.h"

namespace automoe {
namespace {

using automoe::testing::tiny_spec;

LoraConfig attention_and_experts() {
  LoraConfig c;
  c.r = 4;
  c.lora_alpha = 8;
  c.target_modules = {"q_proj", "down_proj"};
  c.target_parameters = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  return c;
}

const LoraSite& site(const std::vector<LoraSite>& sites, const std::string& base) {
  for (const auto& s : sites) {
    if (s.base() == base) return s;
  }
  throw std::runtime_error("no site " + base);
}

// Qwen2-MoE's names: PEFT reads its dense MLPs' gate/up/down_proj as such (for Qwen3-MoE and
// others it reads those names as the experts: see PeftReadsQwen3DenseMlpNamesAsExperts).
ModelSpec tiny_qwen2_spec() {
  ModelSpec s = tiny_spec();
  s.model_type = "qwen2_moe";
  return s;
}

TEST(Lora, PeftReadsQwen3DenseMlpNamesAsExperts) {
  const ModelSpec s = tiny_spec();
  try {
    plan_lora(s, parameter_layout(s), attention_and_experts(), true);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("selects model.layers.1.mlp.down_proj (a dense or shared-expert MLP)"),
              std::string::npos) << e.what();
  }
  LoraConfig all = attention_and_experts();
  all.target_modules = {"all-linear"};  // skips them, as PEFT's all-linear does
  for (const auto& site : plan_lora(s, parameter_layout(s), all, true)) {
    EXPECT_EQ(site.base().find("mlp.down_proj"), std::string::npos) << site.base();
  }
}

TEST(Lora, RouterWeightTakesAnAdapterThroughTargetParameters) {
  const ModelSpec s = tiny_spec();
  LoraConfig c;
  c.r = 2;
  c.target_parameters = {"mlp.gate.weight"};
  auto sites = plan_lora(s, parameter_layout(s), c, true);
  ASSERT_EQ(sites.size(), 1u);
  EXPECT_EQ(sites[0].peft_key(true), "base_model.model.model.layers.0.mlp.gate.lora_A.weight");
  at::manual_seed(0);
  NamedTensors params;
  for (const auto& d : parameter_layout(s)) params.emplace_back(d.name, at::randn(d.shape) * 0.3);
  init_lora(sites, at::TensorOptions().dtype(at::kFloat), 1);
  sites[0].b = at::randn(sites[0].b.sizes());
  NamedTensors merged = params;
  merged[sites[0].slot].second = merge_lora(sites[0], params[sites[0].slot].second);
  Decoder adapted(s, BackendConfig{}, params);
  adapted.set_adapters(sites);
  const Decoder reference(s, BackendConfig{}, merged);
  const at::Tensor ids = at::randint(0, s.vocab_size, {2, 9}, at::kLong);
  EXPECT_TRUE(at::allclose(adapted.forward(ForwardArgs{ids}).logits,
                           reference.forward(ForwardArgs{ids}).logits, 1e-5, 1e-6));
}

TEST(Lora, PlanFollowsPeftMatchingNamesAndNesting) {
  const ModelSpec s = tiny_qwen2_spec();  // layer 0 MoE, layer 1 dense
  const auto sites = plan_lora(s, parameter_layout(s), attention_and_experts(), true);
  // q_proj in both layers, the dense layer's down_proj, and both expert tensors of layer 0 (a
  // target_modules entry never selects the experts' fused tensors).
  ASSERT_EQ(sites.size(), 5u);
  const LoraSite& gu = site(sites, "model.layers.0.mlp.experts.gate_up_proj");
  const LoraSite& dn = site(sites, "model.layers.0.mlp.experts.down_proj");
  EXPECT_TRUE(gu.experts);
  EXPECT_EQ(gu.experts_count, 5);
  EXPECT_EQ(gu.out, 16);  // 2I
  EXPECT_EQ(gu.in, 16);   // H
  // PEFT wraps gate_up_proj (declared first) inside down_proj's wrapper.
  EXPECT_EQ(gu.peft_key(true), "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight");
  EXPECT_EQ(dn.peft_key(false), "base_model.model.model.layers.0.mlp.experts.lora_B.weight");
  const LoraSite& q = site(sites, "model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(q.peft_key(true), "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(q.a_name(), "model.layers.1.self_attn.q_proj.lora_A.weight");
  EXPECT_DOUBLE_EQ(q.scaling, 2.0);
  EXPECT_NO_THROW(site(sites, "model.layers.1.mlp.down_proj.weight"));
}

TEST(Lora, MoeRankScalingAndRsloraSetRankAndScaling) {
  const ModelSpec s = tiny_qwen2_spec();
  LoraConfig c = attention_and_experts();
  c.moe_rank_scaling = true;
  c.use_rslora = true;
  const auto sites = plan_lora(s, parameter_layout(s), c, true);
  const LoraSite& gu = site(sites, "model.layers.0.mlp.experts.gate_up_proj");
  EXPECT_EQ(gu.r, 2);  // r / top_k
  EXPECT_DOUBLE_EQ(gu.scaling, 8.0 / std::sqrt(2.0));
  EXPECT_EQ(site(sites, "model.layers.0.self_attn.q_proj.weight").r, 4);
  // The export records the experts' rank as PEFT rank_pattern entries.
  const auto cfg = nlohmann::json::parse(peft_adapter_config(c, sites, "/base"));
  EXPECT_EQ(cfg["rank_pattern"]["experts.gate_up_proj"], 2);
  EXPECT_EQ(cfg["rank_pattern"]["experts.down_proj"], 2);
  EXPECT_EQ(cfg["use_rslora"], true);
}

class LoraBackends : public ::testing::TestWithParam<std::string> {};

TEST_P(LoraBackends, AdaptersEqualTheMergedWeights) {
  const ModelSpec s = tiny_qwen2_spec();
  at::manual_seed(0);
  NamedTensors params;
  for (const auto& d : parameter_layout(s)) params.emplace_back(d.name, at::randn(d.shape) * 0.3);
  BackendConfig backend = BackendConfig::from_map({{"experts", GetParam()}}, "test");
  auto sites = plan_lora(s, parameter_layout(s), attention_and_experts(), true);
  init_lora(sites, at::TensorOptions().dtype(at::kFloat), 1);
  for (auto& site : sites) site.b = at::randn(site.b.sizes()) * 0.2;  // B starts at zero
  NamedTensors merged = params;
  for (const auto& site : sites) merged[site.slot].second = merge_lora(site, params[site.slot].second);
  Decoder adapted(s, backend, params);
  adapted.set_adapters(sites);
  const Decoder reference(s, backend, merged);
  const at::Tensor ids = at::randint(0, s.vocab_size, {2, 9}, at::kLong);
  const at::Tensor got = adapted.forward(ForwardArgs{ids}).logits;
  const at::Tensor want = reference.forward(ForwardArgs{ids}).logits;
  EXPECT_LT(((got - want).abs().max() / want.abs().max()).item<double>(), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Experts, LoraBackends, ::testing::Values("grouped", "torch_mm", "eager"));

TEST(Lora, PeftAdapterDirectoryRoundTrips) {
  const ModelSpec s = tiny_qwen2_spec();
  LoraConfig c = attention_and_experts();
  auto sites = plan_lora(s, parameter_layout(s), c, true);
  init_lora(sites, at::TensorOptions().dtype(at::kFloat), 2);
  for (auto& site : sites) site.b = at::randn(site.b.sizes());
  const auto dir = std::filesystem::temp_directory_path() / "automoe_test_lora_adapter";
  std::filesystem::remove_all(dir);
  write_peft_adapter(dir.string(), c, sites, "/base", at::kFloat);
  LoraConfig back_config;
  const auto back = read_peft_adapter(dir.string(), s, &back_config);
  ASSERT_EQ(back.size(), sites.size());
  for (size_t i = 0; i < sites.size(); ++i) {
    EXPECT_EQ(back[i].base(), sites[i].base());
    EXPECT_TRUE(at::equal(back[i].a, sites[i].a)) << sites[i].base();
    EXPECT_TRUE(at::equal(back[i].b, sites[i].b)) << sites[i].base();
  }
  EXPECT_EQ(back_config.target_parameters, c.target_parameters);
  std::filesystem::remove_all(dir);
}

TEST(Lora, TargetsThatCannotWorkAreRefusedByName) {
  const ModelSpec s = tiny_spec();
  const auto layout = parameter_layout(s);
  auto expect_error = [&](LoraConfig c, const std::string& what) {
    try {
      plan_lora(s, layout, c, true);
      FAIL() << "expected an error containing: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  LoraConfig c;
  c.target_modules = {"gate"};
  expect_error(c, "selects model.layers.0.mlp.gate (a router)");
  c.target_modules = {"q_projection"};
  expect_error(c, "\"q_projection\" matches no linear layer");
  c.target_modules = {"k_proj"};
  c.r = 13;  // k_proj is [12, 16]
  expect_error(c, "rank 13 on model.layers.0.self_attn.k_proj (12 x 16)");
  c = LoraConfig{};
  c.target_parameters = {"self_attn.q_proj.weight"};
  expect_error(c, "a linear layer's weight; target linear layers with target_modules");
  c = LoraConfig{};
  c.target_modules = {"lm_head"};
  expect_error(c, "(the LM head)");
}

TEST(Lora, DecoderRefusesAnAdapterItWouldNotRun) {
  const ModelSpec s = tiny_spec();
  NamedTensors params;
  for (const auto& d : parameter_layout(s)) params.emplace_back(d.name, at::randn(d.shape));
  Decoder model(s, BackendConfig{}, params);
  LoraSite norm;
  norm.module = "model.layers.0";
  norm.param = "input_layernorm.weight";
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].first == "model.layers.0.input_layernorm.weight") norm.slot = static_cast<int64_t>(i);
  }
  norm.module = "model.layers.0.input_layernorm";
  norm.param = "weight";
  norm.r = 1;
  norm.a = at::zeros({1, 1});
  norm.b = at::zeros({16, 1});
  EXPECT_THROW(model.set_adapters({norm}), Error);
}

}  // namespace
}  // namespace automoe
