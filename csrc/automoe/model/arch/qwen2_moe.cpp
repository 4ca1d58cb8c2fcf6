// Qwen2-MoE (model_type "qwen2_moe"): GQA attention with q/k/v biases (qkv_bias) and no o bias,
// sliding windows per layer (layer_types), softmax top-k router (norm_topk_prob), a shared expert
// scaled by sigmoid(shared_expert_gate(x)), dense MLP on `mlp_only_layers` and off the
// `decoder_sparse_step` grid.
#include "automoe/model/arch/common.h"
#include "automoe/model/arch/registry.h"

namespace automoe {
namespace {

ModelSpec parse_qwen2_moe(const ConfigReader& cfg) {
  arch::reject_unsupported(cfg);
  ModelSpec s;
  s.model_type = "qwen2_moe";
  arch::parse_decoder_basics(cfg, arch::Defaults{}, &s);  // Qwen2MoeConfig's: 32768, 1e-6
  arch::parse_gqa(cfg, /*kv_default=*/16, &s);
  s.attn.qkv_bias = cfg.get_bool("qkv_bias", true);
  s.attn.o_bias = false;
  s.rope = arch::parse_rope(cfg, s.attn.head_dim, "head_dim", /*partial_default=*/0,
                            s.max_position_embeddings);
  s.intermediate_size = arch::positive(cfg, "intermediate_size");
  arch::parse_softmax_moe(cfg, "num_experts", "moe_intermediate_size", /*norm_default=*/false,
                          /*aux_default=*/0.001, &s);
  s.moe.shared_intermediate_size = cfg.get_int("shared_expert_intermediate_size", 5632);
  if (s.moe.shared_intermediate_size < 0) {
    cfg.fail_key("shared_expert_intermediate_size", "a non-negative integer");
  }
  s.moe.shared_name = "shared_expert";
  s.moe.shared_gate = true;

  // Sliding windows as Qwen2MoeConfig sets them: layer_types when given, else the layers below
  // max_window_layers with an even index when use_sliding_window.
  const bool use_sliding = cfg.get_flag("use_sliding_window", false);
  const int64_t window = use_sliding ? arch::positive(cfg, "sliding_window", 4096) : 0;
  const int64_t max_window_layers = cfg.get_int("max_window_layers", 28);
  arch::parse_layer_types(
      cfg, [&](int64_t l) { return use_sliding && (l + 1) % 2 == 1 && l < max_window_layers; },
      window, "use_sliding_window", &s);
  return s;
}

}  // namespace

Architecture qwen2_moe_architecture() {
  return Architecture{"qwen2_moe", "Qwen2MoeForCausalLM", &parse_qwen2_moe,
                      qwen2_moe_expert_rules(), /*renames=*/{}};
}

}  // namespace automoe
