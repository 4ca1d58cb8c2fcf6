// GLM-4.5 / 4.6 (model_type "glm4_moe"): grouped-query attention with partial rotary
// (partial_rotary_factor, half-split), biases on q/k/v where attention_bias says, optional q/k
// norms (use_qk_norm); DeepSeek-V3's routing (sigmoid, correction bias, groups), shared experts and
// dense first layers. The multi-token-prediction layer is skipped on load, as Transformers does.
#include "automoe/model/arch/common.h"
#include "automoe/model/arch/registry.h"

namespace automoe {
namespace {

ModelSpec parse_glm4_moe(const ConfigReader& cfg) {
  arch::reject_unsupported(cfg);
  // Glm4MoeConfig's defaults for keys a config.json may omit.
  arch::Defaults d;
  d.max_position_embeddings = 131072;
  d.rms_norm_eps = 1e-5;
  ModelSpec s;
  s.model_type = "glm4_moe";
  arch::parse_decoder_basics(cfg, d, &s);
  arch::parse_gqa(cfg, /*kv_default=*/8, &s);
  s.attn.qkv_bias = cfg.get_bool("attention_bias", false);
  s.attn.o_bias = false;
  s.attn.qk_norm = cfg.get_bool("use_qk_norm", false);
  s.rope = arch::parse_rope(cfg, s.attn.head_dim, "head_dim", /*partial_default=*/0.5,
                            s.max_position_embeddings);
  arch::parse_deepseek_moe(cfg, d, &s);
  s.num_mtp_layers = arch::parse_mtp_layers(cfg);
  return s;
}

}  // namespace

Architecture glm4_moe_architecture() {
  return Architecture{"glm4_moe", "Glm4MoeForCausalLM", &parse_glm4_moe, qwen2_moe_expert_rules(),
                      /*renames=*/{}};
}

}  // namespace automoe
