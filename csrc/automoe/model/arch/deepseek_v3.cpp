// DeepSeek-V3 (model_type "deepseek_v3"; Kimi-K2's checkpoints load as it): multi-head latent
// attention (low-rank q, compressed kv, interleaved RoPE on the rotary part, YaRN with mscale in
// the softmax scale), sigmoid routing with a correction bias and group-limited top-k, shared
// experts, dense first layers. The multi-token-prediction layer of the released checkpoints is
// skipped on load, as Transformers does.
#include <cmath>

#include "automoe/model/arch/common.h"
#include "automoe/model/arch/registry.h"

namespace automoe {
namespace {

ModelSpec parse_deepseek_v3(const ConfigReader& cfg) {
  arch::reject_unsupported(cfg);
  ModelSpec s;
  s.model_type = "deepseek_v3";
  arch::parse_decoder_basics(cfg, &s);
  AttentionSpec& a = s.attn;
  a.kind = AttentionKind::kMLA;
  a.num_heads = arch::positive(cfg, "num_attention_heads");
  a.num_kv_heads = arch::positive(cfg, "num_key_value_heads", a.num_heads);
  if (a.num_kv_heads != a.num_heads) {
    // kv_b_proj makes one key/value head per query head; Transformers' attention cannot group them.
    cfg.fail_key("num_key_value_heads", "num_attention_heads (" + std::to_string(a.num_heads) +
                                            "; latent attention has one kv head per query head)");
  }
  a.q_lora_rank = cfg.has("q_lora_rank") ? arch::positive(cfg, "q_lora_rank") : 0;
  a.kv_lora_rank = arch::positive(cfg, "kv_lora_rank");
  a.qk_nope_head_dim = arch::positive(cfg, "qk_nope_head_dim");
  a.qk_rope_head_dim = arch::positive(cfg, "qk_rope_head_dim");
  a.v_head_dim = arch::positive(cfg, "v_head_dim");
  a.head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim;
  a.qkv_bias = a.o_bias = cfg.get_bool("attention_bias", false);
  s.rope = arch::parse_rope(cfg, a.qk_rope_head_dim, /*partial_default=*/0);
  s.rope.interleaved = cfg.get_bool("rope_interleave", true);
  // Transformers' yarn_apply_mscale: any scaled RoPE with mscale_all_dim scales the softmax.
  a.softmax_scale = 1.0 / std::sqrt(static_cast<double>(a.head_dim));
  if (s.rope.type != RopeType::kDefault) {
    const ConfigReader rp = cfg.has("rope_parameters") ? cfg.child("rope_parameters")
                                                       : cfg.child("rope_scaling");
    const double all = rp.get_double("mscale_all_dim", 0.0);
    if (all != 0) {
      const double m = arch::yarn_mscale(s.rope.factor, all);
      a.softmax_scale *= m * m;
    }
  }
  arch::parse_deepseek_moe(cfg, &s);
  return s;
}

}  // namespace

Architecture deepseek_v3_architecture() {
  return Architecture{"deepseek_v3", "DeepseekV3ForCausalLM", &parse_deepseek_v3,
                      qwen2_moe_expert_rules(), /*renames=*/{}, /*mtp_layers=*/true};
}

}  // namespace automoe
