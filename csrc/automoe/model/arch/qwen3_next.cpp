// Qwen3-Next (model_type "qwen3_next"): three of every four layers gated DeltaNet linear attention
// ("linear_attention"), the fourth gated full attention ("full_attention": a doubled q_proj whose
// second half gates the output through a sigmoid, per-head q/k RMSNorm, partial rotary), every
// layer's MLP a MoE (softmax top-k router, SwiGLU experts, a shared expert scaled by
// sigmoid(shared_expert_gate(x))) or, on `mlp_only_layers` and off the `decoder_sparse_step` grid,
// a dense SwiGLU MLP. Its RMSNorms are zero-centred (1 + weight). Transformers' Qwen3NextConfig is
// the oracle for every default; multi-token-prediction weights (`mtp.*`) are skipped on load, as
// Transformers ignores them. Qwen3.5-MoE's language model ("qwen3_5_moe_text") is the same stack
// with DeltaNet's in-projections split (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), every layer
// a MoE and its multimodal RoPE, which for text (three equal position streams) is plain RoPE; its
// released vision-language checkpoints ("qwen3_5_moe") load their language model (text_config,
// tensors under model.language_model.) and skip the vision tower, as Transformers'
// AutoModelForCausalLM does.
#include <nlohmann/json.hpp>

#include "automoe/model/arch/common.h"
#include "automoe/model/arch/registry.h"

namespace automoe {
namespace {

// layer_types (legacy names as Transformers remaps them), else full attention every
// full_attention_interval-th layer (Qwen3NextConfig.__post_init__).
void parse_mixers(const ConfigReader& cfg, ModelSpec* s) {
  const nlohmann::json& raw = cfg.raw();
  const bool listed = raw.contains("layer_types") && !raw.at("layer_types").is_null();
  if (listed && (!raw.at("layer_types").is_array() ||
                 static_cast<int64_t>(raw.at("layer_types").size()) != s->num_layers)) {
    cfg.fail_key("layer_types", "a list of " + std::to_string(s->num_layers) + " layer types");
  }
  const int64_t interval = arch::positive(cfg, "full_attention_interval", 4);
  for (int64_t l = 0; l < s->num_layers; ++l) {
    bool linear = (l + 1) % interval != 0;
    if (listed) {
      const nlohmann::json& t = raw.at("layer_types").at(l);
      const std::string name = t.is_string() ? t.get<std::string>() : "";
      if (name == "linear_attention" || name == "mamba") {
        linear = true;
      } else if (name == "full_attention" || name == "attention") {
        linear = false;
      } else {
        cfg.fail_key("layer_types", "\"linear_attention\" or \"full_attention\" per layer; found " + t.dump());
      }
    }
    s->layers[l].mixer = linear ? MixerKind::kGatedDeltaNet : MixerKind::kAttention;
  }
}

// Qwen3-Next, or (qwen35) Qwen3.5-MoE's language model: the same stack with split DeltaNet
// in-projections, a MoE on every layer and top-k weights always renormalised.
ModelSpec parse_gated_deltanet_moe(const ConfigReader& cfg, bool qwen35) {
  arch::reject_unsupported(cfg);
  ModelSpec s;
  s.model_type = qwen35 ? "qwen3_5_moe_text" : "qwen3_next";
  arch::Defaults d;  // Qwen3NextConfig's: 32768 positions, eps 1e-6
  arch::parse_decoder_basics(cfg, d, &s);
  s.zero_centered_norms = true;
  arch::parse_gqa(cfg, /*kv_default=*/2, &s);
  if (!cfg.has("head_dim")) s.attn.head_dim = 256;  // Qwen3NextConfig's default, not hidden / heads
  s.attn.qkv_bias = s.attn.o_bias = cfg.get_bool("attention_bias", false);
  s.attn.qk_norm = true;
  s.attn.output_gate = true;
  s.rope = arch::parse_rope(cfg, s.attn.head_dim, "head_dim", /*partial_default=*/0.25,
                            s.max_position_embeddings);
  s.intermediate_size = arch::positive(cfg, "intermediate_size", 5632);

  arch::parse_softmax_moe(cfg, "num_experts", "moe_intermediate_size", /*norm_default=*/true,
                          /*aux_default=*/0.001, &s);
  if (qwen35) {  // Qwen3_5MoeDecoderLayer: always the sparse block; its router always renormalises
    s.set_moe_layers(std::vector<bool>(s.num_layers, true));
    if (s.moe.num_experts < 1) cfg.fail_key("num_experts", "a positive integer (every layer is a MoE)");
    s.moe.norm_topk_prob = true;
  }
  s.moe.shared_intermediate_size = cfg.get_int("shared_expert_intermediate_size", 512);
  if (s.moe.shared_intermediate_size < 0) {
    cfg.fail_key("shared_expert_intermediate_size", "a non-negative integer");
  }
  s.moe.shared_name = "shared_expert";
  s.moe.shared_gate = true;

  parse_mixers(cfg, &s);
  GatedDeltaNetSpec& g = s.deltanet;
  g.num_k_heads = arch::positive(cfg, "linear_num_key_heads", 16);
  g.num_v_heads = arch::positive(cfg, "linear_num_value_heads", 32);
  if (g.num_v_heads % g.num_k_heads != 0) {
    cfg.fail_key("linear_num_value_heads",
                 "a multiple of linear_num_key_heads (" + std::to_string(g.num_k_heads) + ")");
  }
  g.head_k_dim = arch::positive(cfg, "linear_key_head_dim", 128);
  g.head_v_dim = arch::positive(cfg, "linear_value_head_dim", 128);
  g.conv_kernel = arch::positive(cfg, "linear_conv_kernel_dim", 4);
  g.norm_eps = s.rms_norm_eps;
  g.split_projections = qwen35;
  s.mtp_module = true;
  return s;
}

ModelSpec parse_qwen3_next(const ConfigReader& cfg) { return parse_gated_deltanet_moe(cfg, false); }
ModelSpec parse_qwen3_5_moe_text(const ConfigReader& cfg) { return parse_gated_deltanet_moe(cfg, true); }

// Qwen3.5-MoE's released (vision-language) config: the language model is its text_config, as
// Transformers' AutoModelForCausalLM reads it (Qwen3_5MoeConfig.get_text_config()).
ModelSpec parse_qwen3_5_moe(const ConfigReader& cfg) {
  const nlohmann::json& raw = cfg.raw();
  if (!raw.contains("text_config") || !raw.at("text_config").is_object()) {
    cfg.fail_key("text_config", "the language model's config (an object), as Qwen3_5MoeConfig writes it");
  }
  nlohmann::json text = raw.at("text_config");
  for (const char* key : {"tie_word_embeddings", "dtype", "torch_dtype"}) {  // top-level keys it inherits
    if (!text.contains(key) && raw.contains(key)) text[key] = raw.at(key);
  }
  const ConfigReader c(std::make_shared<nlohmann::json>(std::move(text)), cfg.path() + " (text_config)");
  ModelSpec s = parse_gated_deltanet_moe(c, true);
  s.model_type = "qwen3_5_moe";
  return s;
}

}  // namespace

Architecture qwen3_next_architecture() {
  return Architecture{"qwen3_next", "Qwen3NextForCausalLM", &parse_qwen3_next,
                      qwen2_moe_expert_rules(), /*renames=*/{}};
}

Architecture qwen3_5_moe_text_architecture() {
  return Architecture{"qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", &parse_qwen3_5_moe_text,
                      qwen2_moe_expert_rules(), /*renames=*/{}, "model.language_model.",
                      {"model.visual."}};
}

Architecture qwen3_5_moe_architecture() {
  Architecture a = qwen3_5_moe_text_architecture();
  a.model_type = "qwen3_5_moe";
  a.parse = &parse_qwen3_5_moe;
  return a;
}

}  // namespace automoe
