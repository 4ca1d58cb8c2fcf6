// config.json -> ModelSpec: the keys that change the math are read, and values the engine does not
// implement are refused with an error naming the file and the key.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "automoe/core/error.h"
#include "automoe/model/components.h"
#include "automoe/model/config.h"

namespace automoe {
namespace {

std::vector<bool> moe_layers(const ModelSpec& s) {
  std::vector<bool> out;
  for (int64_t l = 0; l < s.num_layers; ++l) out.push_back(s.is_moe(l));
  return out;
}


nlohmann::json base_config() {
  return {{"model_type", "qwen3_moe"},
          {"vocab_size", 97},
          {"hidden_size", 24},
          {"intermediate_size", 40},
          {"moe_intermediate_size", 12},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 8},
          {"num_local_experts", 5},
          {"num_experts_per_tok", 2},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000.0}}},
          {"dtype", "bfloat16"}};
}

ModelSpec parse(const nlohmann::json& j) { return parse_config(j.dump(), "cfg.json").spec; }

// Expects parse to throw an automoe::Error whose message contains every one of `parts`.
void expect_error(const nlohmann::json& j, std::initializer_list<std::string> parts) {
  try {
    parse(j);
    FAIL() << "expected an error for " << j.dump();
  } catch (const Error& e) {
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message \"" << e.what() << "\" lacks \"" << p << "\"";
  }
}

TEST(Config, ReadsEveryKeyThatChangesTheMath) {
  auto j = base_config();
  j["norm_topk_prob"] = true;
  j["router_aux_loss_coef"] = 0.02;
  j["output_router_logits"] = true;
  j["tie_word_embeddings"] = true;
  j["attention_bias"] = true;
  j["rms_norm_eps"] = 1e-5;
  const ModelSpec s = parse(j);
  EXPECT_EQ(s.model_type, "qwen3_moe");
  EXPECT_EQ(s.vocab_size, 97);
  EXPECT_EQ(s.attn.num_kv_heads, 2);
  EXPECT_EQ(s.attn.head_dim, 8);
  EXPECT_EQ(s.moe.num_experts, 5);
  EXPECT_EQ(s.moe.top_k, 2);
  EXPECT_EQ(s.moe.intermediate_size, 12);
  EXPECT_TRUE(s.moe.norm_topk_prob);
  EXPECT_DOUBLE_EQ(s.moe.router_aux_loss_coef, 0.02);
  EXPECT_TRUE(s.moe.output_router_logits);
  EXPECT_TRUE(s.tie_word_embeddings);
  EXPECT_TRUE(s.attn.qkv_bias);
  EXPECT_TRUE(s.attn.o_bias);
  EXPECT_DOUBLE_EQ(s.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(s.rope.theta, 1000.0);
  EXPECT_EQ(s.dtype, c10::kBFloat16);
  EXPECT_EQ(s.layers[0].sliding_window, 0);
}

TEST(Config, AcceptsNumExpertsSpellingAndLegacyRopeKeys) {
  auto j = base_config();
  j.erase("num_local_experts");
  j["num_experts"] = 7;
  j.erase("rope_parameters");
  j["rope_theta"] = 5e5;
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  j.erase("dtype");
  j["torch_dtype"] = "float32";
  const ModelSpec s = parse(j);
  EXPECT_EQ(s.moe.num_experts, 7);
  EXPECT_DOUBLE_EQ(s.rope.theta, 5e5);
  EXPECT_EQ(s.rope.type, RopeType::kLinear);
  EXPECT_DOUBLE_EQ(s.rope.factor, 4.0);
  EXPECT_EQ(s.dtype, c10::kFloat);
}

TEST(Config, PlacesMoeLayersBySparseStepAndMlpOnlyLayers) {
  auto j = base_config();
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  EXPECT_EQ(moe_layers(parse(j)), (std::vector<bool>{false, true, false, false}));
  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = {0, 2};
  EXPECT_EQ(moe_layers(parse(j)), (std::vector<bool>{false, true, false, true}));
}

TEST(Config, HeadDimDefaultsToHiddenOverHeads) {
  auto j = base_config();
  j.erase("head_dim");
  EXPECT_EQ(parse(j).attn.head_dim, 6);
}

TEST(Config, SlidingWindowOnlyWhenEnabled) {
  auto j = base_config();
  j["sliding_window"] = 16;
  EXPECT_EQ(parse(j).layers[1].sliding_window, 0);
  j["use_sliding_window"] = true;
  EXPECT_EQ(parse(j).layers[1].sliding_window, 16);
}

TEST(Config, RejectsUnsupportedArchitectureNamingSupportedOnes) {
  auto j = base_config();
  j["model_type"] = "granitemoe";
  expect_error(j, {"cfg.json", "granitemoe", "qwen3_moe", "deepseek_v3", "glm4_moe", "kimi_k2",
                   "mixtral", "qwen2_moe", "olmoe", "gpt_oss"});
}

TEST(Config, GptOssReadsMxfp4RefusesOtherQuantizationAndDefaultsToYarn) {
  auto j = base_config();
  j["model_type"] = "gpt_oss";
  j.erase("rope_parameters");
  const ModelSpec s = parse(j);  // GptOssConfig's RoPE: YaRN x32 over 4096, untruncated
  EXPECT_EQ(s.rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(s.rope.factor, 32.0);
  EXPECT_FALSE(s.rope.truncate);
  EXPECT_DOUBLE_EQ(s.rope.theta, 150000.0);
  EXPECT_TRUE(s.attn.sinks);
  EXPECT_EQ(s.layers[0].sliding_window, 128);  // GptOssConfig's default, on even layers
  EXPECT_EQ(s.layers[1].sliding_window, 0);
  EXPECT_FALSE(s.mxfp4_experts);
  j["quantization_config"] = {{"quant_method", "mxfp4"}};
  EXPECT_TRUE(parse(j).mxfp4_experts);  // the released checkpoints: dequantised on load
  j["quantization_config"] = {{"quant_method", "fp8"}};
  expect_error(j, {"quantization_config", "bfloat16"});
  j.erase("quantization_config");
  j["sliding_window"] = nullptr;  // no window, yet layer_types says sliding
  expect_error(j, {"sliding_window", "sliding_attention"});
}

TEST(Config, NullAndAbsentKeysFollowEachConfigClass) {
  auto j = base_config();
  j["model_type"] = "mixtral";
  j["num_key_value_heads"] = nullptr;  // MixtralConfig.__post_init__: = num_attention_heads
  EXPECT_EQ(parse(j).attn.num_kv_heads, 4);
  j.erase("num_key_value_heads");  // absent: the class default, 8 (does not divide 4 heads)
  expect_error(j, {"num_key_value_heads", "divisor"});
  auto o = base_config();
  o["model_type"] = "olmoe";
  o["num_experts"] = 5;
  o["intermediate_size"] = 12;
  o.erase("head_dim");
  EXPECT_EQ(parse(o).pad_token_id, 1);  // OlmoeConfig's pad_token_id
  o["pad_token_id"] = nullptr;
  EXPECT_EQ(parse(o).pad_token_id, -1);
}

TEST(Config, MixtralReadsRouterJitterNoiseInRange) {
  auto j = base_config();
  j["model_type"] = "mixtral";
  j["router_jitter_noise"] = 0.1;
  EXPECT_DOUBLE_EQ(parse(j).moe.router_jitter_noise, 0.1);
  j["router_jitter_noise"] = 1.5;
  expect_error(j, {"router_jitter_noise", "[0, 1)"});
}

TEST(Config, RejectsValuesTheEngineDoesNotImplement) {
  auto j = base_config();
  j["hidden_act"] = "gelu";
  expect_error(j, {"cfg.json", "hidden_act", "gelu"});
  j = base_config();
  j["rope_parameters"]["rope_type"] = "longrope";
  expect_error(j, {"rope_parameters.rope_type", "longrope"});
  j = base_config();
  j["quantization_config"] = {{"quant_method", "fp8"}};
  expect_error(j, {"quantization_config"});
  j = base_config();
  j["attention_dropout"] = 0.1;
  expect_error(j, {"attention_dropout"});
  j = base_config();
  j["dtype"] = "int8";
  expect_error(j, {"dtype", "int8"});
}

TEST(Config, RejectsInconsistentValues) {
  auto j = base_config();
  j["num_experts_per_tok"] = 6;
  expect_error(j, {"num_experts_per_tok", "6"});
  j = base_config();
  j["num_key_value_heads"] = 3;
  expect_error(j, {"num_key_value_heads", "divisor"});
  j = base_config();
  j["mlp_only_layers"] = {9};
  expect_error(j, {"mlp_only_layers", "[0, 4)"});
  j = base_config();
  j["decoder_sparse_step"] = 0;
  expect_error(j, {"decoder_sparse_step"});
  j = base_config();
  j["hidden_size"] = "24";
  expect_error(j, {"hidden_size", "an integer", "\"24\""});
  j = base_config();
  j.erase("vocab_size");
  expect_error(j, {"vocab_size", "missing"});
  j = base_config();
  j.erase("num_local_experts");
  expect_error(j, {"num_experts", "num_local_experts"});
}

nlohmann::json deepseek_config() {
  return {{"model_type", "deepseek_v3"}, {"vocab_size", 89},         {"hidden_size", 20},
          {"intermediate_size", 36},     {"moe_intermediate_size", 12}, {"num_hidden_layers", 3},
          {"num_attention_heads", 3},    {"q_lora_rank", 12},         {"kv_lora_rank", 10},
          {"qk_nope_head_dim", 6},       {"qk_rope_head_dim", 4},     {"v_head_dim", 5},
          {"n_routed_experts", 8},       {"num_experts_per_tok", 2},  {"n_group", 2},
          {"topk_group", 1},             {"n_shared_experts", 2},     {"first_k_dense_replace", 1},
          {"routed_scaling_factor", 2.5},
          {"rope_parameters",
           {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 16},
            {"mscale", 1.0}, {"mscale_all_dim", 0.5}, {"rope_theta", 10000.0}}}};
}

TEST(Config, DeepSeekV3ReadsLatentAttentionYarnAndGroupRouting) {
  const ModelSpec s = parse(deepseek_config());
  EXPECT_EQ(s.attn.kind, AttentionKind::kMLA);
  EXPECT_EQ(s.attn.head_dim, 10);
  EXPECT_EQ(s.attn.num_kv_heads, 3);
  EXPECT_EQ(s.rope.type, RopeType::kYarn);
  EXPECT_EQ(s.rope.dim, 4);
  EXPECT_TRUE(s.rope.interleaved);  // rope_interleave defaults to true, as in Transformers
  // yarn_apply_mscale: (0.1 * 0.5 * ln 4 + 1)^2 / sqrt(10); cos/sin scaled by mscale(1) / mscale(0.5)
  const double m = 0.1 * 0.5 * std::log(4.0) + 1.0;
  EXPECT_NEAR(s.attn.softmax_scale, m * m / std::sqrt(10.0), 1e-12);
  EXPECT_NEAR(s.rope.attention_factor, (0.1 * std::log(4.0) + 1.0) / m, 1e-12);
  EXPECT_EQ(s.moe.score, RouterScore::kSigmoid);
  EXPECT_TRUE(s.moe.correction_bias);
  EXPECT_FALSE(s.moe.aux_loss);
  EXPECT_EQ(s.moe.shared_intermediate_size, 24);
  EXPECT_EQ(moe_layers(s), (std::vector<bool>{false, true, true}));
}

TEST(Config, MissingAndNullKeysMeanWhatTheyMeanToTransformers) {
  // Absent keys take DeepseekV3Config's defaults, not another type's.
  auto j = deepseek_config();
  for (const char* k : {"n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace",
                        "q_lora_rank"})
    j.erase(k);
  j["n_routed_experts"] = 16;
  j["num_hidden_layers"] = 4;
  ModelSpec s = parse(j);
  EXPECT_EQ(s.moe.n_group, 8);
  EXPECT_EQ(s.moe.topk_group, 4);
  EXPECT_DOUBLE_EQ(s.moe.routed_scaling_factor, 2.5);
  EXPECT_EQ(moe_layers(s), (std::vector<bool>{false, false, false, true}));
  EXPECT_EQ(s.attn.q_lora_rank, 1536);
  EXPECT_EQ(s.num_mtp_layers, 1);
  // null: a plain q_proj; `rope_interleave: null` and `norm_topk_prob: null` are false.
  j = deepseek_config();
  j["q_lora_rank"] = nullptr;
  j["rope_interleave"] = nullptr;
  j["norm_topk_prob"] = nullptr;
  s = parse(j);
  EXPECT_EQ(s.attn.q_lora_rank, 0);
  EXPECT_FALSE(s.rope.interleaved);
  EXPECT_FALSE(s.moe.norm_topk_prob);
  // YaRN without original_max_position_embeddings: max_position_embeddings (4096 by default);
  // a top-level value wins over the rope dict's; a missing factor is their ratio.
  j = deepseek_config();
  j["rope_parameters"].erase("original_max_position_embeddings");
  EXPECT_EQ(parse(j).rope.original_max_position_embeddings, 4096);
  j["rope_parameters"]["original_max_position_embeddings"] = 16;
  j["original_max_position_embeddings"] = 32;
  j["max_position_embeddings"] = 128;
  j["rope_parameters"].erase("factor");
  s = parse(j);
  EXPECT_EQ(s.rope.original_max_position_embeddings, 32);
  EXPECT_DOUBLE_EQ(s.rope.factor, 4.0);
  // v4's rope_scaling replaces rope_parameters when both are there, as in Transformers.
  j = deepseek_config();
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  EXPECT_EQ(parse(j).rope.type, RopeType::kLinear);
  // GLM-4.5: rms_norm_eps defaults to Glm4MoeConfig's 1e-5.
  auto g = base_config();
  g["model_type"] = "glm4_moe";
  g["n_routed_experts"] = 8;
  EXPECT_DOUBLE_EQ(parse(g).rms_norm_eps, 1e-5);
}

TEST(Config, DeepSeekV3AndGlmRefuseWhatTheyCannotHonour) {
  auto j = deepseek_config();
  j["num_key_value_heads"] = 1;
  expect_error(j, {"num_key_value_heads", "one kv head per query head"});
  j = deepseek_config();
  j["n_group"] = 3;
  expect_error(j, {"n_group", "divisor of n_routed_experts"});
  j = deepseek_config();
  j["topk_group"] = 3;
  expect_error(j, {"topk_group", "at most n_group"});
  j = deepseek_config();
  j["n_group"] = 8;
  j["topk_group"] = 1;
  expect_error(j, {"n_group", "groups of at least two experts"});
  j = deepseek_config();
  j["rope_parameters"]["partial_rotary_factor"] = 0.5;
  expect_error(j, {"rope_parameters.partial_rotary_factor", "whole heads"});
  j = deepseek_config();
  j["qk_rope_head_dim"] = 5;
  expect_error(j, {"qk_rope_head_dim", "even"});
  j = deepseek_config();
  j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 128}}};
  expect_error(j, {"quantization_config", "FP8", "bfloat16"});

  auto g = base_config();
  g["model_type"] = "glm4_moe";
  g["n_routed_experts"] = 8;
  g["num_experts_per_tok"] = 2;
  g["partial_rotary_factor"] = 0.3;  // 8 * 0.3 = 2.4 -> 2 rotated dims: fine
  EXPECT_EQ(parse(g).rope.dim, 2);
  g["partial_rotary_factor"] = 0.1;  // no pair left to rotate
  expect_error(g, {"partial_rotary_factor", "even and positive"});
  g.erase("partial_rotary_factor");  // GLM's default is 0.5, as Glm4MoeConfig
  EXPECT_EQ(parse(g).rope.dim, 4);
}

TEST(Components, DeclareTransformersNamesForLatentAttentionAndSharedExperts) {
  const ModelSpec s = parse(deepseek_config());
  std::vector<std::string> layer1;
  for (const auto& d : parameter_layout(s)) {
    if (d.name.rfind("model.layers.1.", 0) == 0) layer1.push_back(d.name.substr(15));
    if (d.name.find("e_score_correction_bias") != std::string::npos) {
      EXPECT_FALSE(d.trainable);
      EXPECT_TRUE(d.keep_float32);
    }
  }
  EXPECT_EQ(layer1, (std::vector<std::string>{
                        "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                        "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                        "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
                        "self_attn.o_proj.weight", "mlp.experts.gate_up_proj",
                        "mlp.experts.down_proj", "mlp.gate.weight",
                        "mlp.gate.e_score_correction_bias", "mlp.shared_experts.gate_proj.weight",
                        "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight",
                        "input_layernorm.weight", "post_attention_layernorm.weight"}));
}

TEST(Config, RejectsMalformedJson) {
  try {
    parse_config("{\"model_type\": ", "broken.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("broken.json: not valid JSON"), std::string::npos);
  }
}

}  // namespace
}  // namespace automoe
