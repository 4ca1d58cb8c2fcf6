// Qwen3-MoE (model_type "qwen3_moe"): GQA attention with per-head q/k RMSNorm, softmax top-k
// router with optional renormalisation, SwiGLU experts, dense MLP on `mlp_only_layers` and off the
// `decoder_sparse_step` grid.
#include "automoe/model/arch/common.h"
#include "automoe/model/arch/registry.h"

namespace automoe {
namespace {

ModelSpec parse_qwen3_moe(const ConfigReader& cfg) {
  arch::reject_unsupported(cfg);
  ModelSpec s;
  s.model_type = "qwen3_moe";
  arch::parse_decoder_basics(cfg, arch::Defaults{}, &s);
  arch::parse_gqa(cfg, /*kv_default=*/4, &s);
  s.attn.qkv_bias = s.attn.o_bias = cfg.get_bool("attention_bias", false);
  s.attn.qk_norm = true;
  s.rope = arch::parse_rope(cfg, s.attn.head_dim, "head_dim", /*partial_default=*/0,
                           s.max_position_embeddings);
  int64_t window = 0;
  if (cfg.get_bool("use_sliding_window", false)) window = arch::positive(cfg, "sliding_window");
  s.intermediate_size = arch::positive(cfg, "intermediate_size");

  arch::parse_softmax_moe(cfg, cfg.first_present({"num_experts", "num_local_experts"}),
                          "moe_intermediate_size", /*norm_default=*/false, /*aux_default=*/0.001, &s);
  for (LayerSpec& l : s.layers) l.sliding_window = window;
  return s;
}

}  // namespace

Architecture qwen3_moe_architecture() {
  return Architecture{"qwen3_moe", "Qwen3MoeForCausalLM", &parse_qwen3_moe,
                      qwen2_moe_expert_rules(), /*renames=*/{}};
}

}  // namespace automoe
