// DeepSeek-V3 (model_type "deepseek_v3"; also what Kimi-K2's weights are, once its config says
// deepseek_v3 and the weights are not FP8): multi-head latent
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
  // DeepseekV3Config's defaults for keys a config.json may omit.
  arch::Defaults d;
  d.max_position_embeddings = 4096;
  d.rms_norm_eps = 1e-6;
  d.n_group = 8;
  d.topk_group = 4;
  d.first_k_dense_replace = 3;
  d.routed_scaling_factor = 2.5;
  ModelSpec s;
  s.model_type = "deepseek_v3";
  arch::parse_decoder_basics(cfg, d, &s);
  AttentionSpec& a = s.attn;
  a.kind = AttentionKind::kMLA;
  a.num_heads = arch::positive(cfg, "num_attention_heads");
  a.num_kv_heads = arch::positive(cfg, "num_key_value_heads", a.num_heads);
  if (a.num_kv_heads != a.num_heads) {
    // kv_b_proj makes one key/value head per query head. Transformers 5.17 loads such a config
    // but its attention still repeats the heads num_attention_heads / num_key_value_heads times
    // and its forward fails (a shape mismatch, sdpa and eager alike): refused here, at load.
    cfg.fail_key("num_key_value_heads",
                 "num_attention_heads (" + std::to_string(a.num_heads) +
                     "; latent attention has one kv head per query head, and Transformers' "
                     "DeepseekV3Attention fails in its forward with any other value)");
  }
  // q_lora_rank: null means a plain q_proj; absent means DeepseekV3Config's 1536.
  a.q_lora_rank = cfg.is_null("q_lora_rank") ? 0 : arch::positive(cfg, "q_lora_rank", 1536);
  a.kv_lora_rank = arch::positive(cfg, "kv_lora_rank", 512);
  a.qk_nope_head_dim = arch::positive(cfg, "qk_nope_head_dim", 128);
  a.qk_rope_head_dim = arch::positive(cfg, "qk_rope_head_dim", 64);
  a.v_head_dim = arch::positive(cfg, "v_head_dim", 128);
  a.head_dim = a.qk_nope_head_dim + a.qk_rope_head_dim;
  a.qkv_bias = a.o_bias = cfg.get_bool("attention_bias", false);
  a.latent_norm_eps = 1e-6;  // DeepseekV3RMSNorm's default: Transformers does not pass rms_norm_eps
  s.rope = arch::parse_rope(cfg, a.qk_rope_head_dim, "qk_rope_head_dim", /*partial_default=*/0,
                            s.max_position_embeddings);
  s.rope.interleaved = cfg.get_flag("rope_interleave", true);
  // Transformers' yarn_apply_mscale: any scaled RoPE with mscale_all_dim scales the softmax.
  a.softmax_scale = 1.0 / std::sqrt(static_cast<double>(a.head_dim));
  if (s.rope.type != RopeType::kDefault && s.rope.mscale_all_dim != 0) {
    const double m = arch::yarn_mscale(s.rope.factor, s.rope.mscale_all_dim);
    a.softmax_scale *= m * m;
  }
  arch::parse_deepseek_moe(cfg, d, &s);
  s.num_mtp_layers = arch::parse_mtp_layers(cfg);
  return s;
}

}  // namespace

Architecture deepseek_v3_architecture() {
  return Architecture{"deepseek_v3", "DeepseekV3ForCausalLM", &parse_deepseek_v3,
                      qwen2_moe_expert_rules(), /*renames=*/{}};
}

}  // namespace automoe
