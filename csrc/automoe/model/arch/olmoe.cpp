// OLMoE (model_type "olmoe"): GQA attention with q/k RMSNorm over each projection's full width (not
// per head), optional clip_qkv, biases on q/k/v/o where attention_bias says; MoE on every layer with
// a softmax top-k router (norm_topk_prob), experts as wide as `intermediate_size`.
#include "automoe/model/arch/common.h"
#include "automoe/model/arch/registry.h"

namespace automoe {
namespace {

ModelSpec parse_olmoe(const ConfigReader& cfg) {
  arch::reject_unsupported(cfg);
  arch::Defaults d;  // OlmoeConfig's
  d.max_position_embeddings = 4096;
  d.rms_norm_eps = 1e-5;
  d.pad_token_id = 1;
  ModelSpec s;
  s.model_type = "olmoe";
  arch::parse_decoder_basics(cfg, d, &s);
  arch::parse_gqa(cfg, /*kv_default=*/0, &s);
  if (s.attn.head_dim * s.attn.num_heads != s.hidden_size) {
    // Transformers sizes q_norm by hidden_size: the heads must tile it.
    cfg.fail_key("head_dim", "hidden_size / num_attention_heads (" +
                                 std::to_string(s.hidden_size / s.attn.num_heads) +
                                 "; OLMoE's q norm spans hidden_size)");
  }
  s.attn.qkv_bias = s.attn.o_bias = cfg.get_bool("attention_bias", false);
  s.attn.qk_norm = true;
  s.attn.qk_norm_full_width = true;
  if (cfg.has("clip_qkv")) {
    s.attn.clip_qkv = cfg.get_double("clip_qkv");
    if (s.attn.clip_qkv <= 0) cfg.fail_key("clip_qkv", "a positive number or null");
  }
  s.rope = arch::parse_rope(cfg, s.attn.head_dim, "head_dim", /*partial_default=*/0,
                            s.max_position_embeddings);
  s.intermediate_size = arch::positive(cfg, "intermediate_size");
  arch::parse_softmax_moe(cfg, "num_experts", "intermediate_size", /*norm_default=*/false,
                          /*aux_default=*/0.01, &s);
  if (s.num_moe_layers() != s.num_layers) {
    cfg.fail_key("num_experts", "a positive expert count (every OLMoE layer is MoE)");
  }
  return s;
}

}  // namespace

Architecture olmoe_architecture() {
  return Architecture{"olmoe", "OlmoeForCausalLM", &parse_olmoe, qwen2_moe_expert_rules(),
                      /*renames=*/{}};
}

}  // namespace automoe
