// Qwen3-MoE (model_type "qwen3_moe"): GQA attention with per-head q/k RMSNorm, softmax top-k
// router with optional renormalisation, SwiGLU experts, dense MLP on `mlp_only_layers` and off the
// `decoder_sparse_step` grid.
#include <algorithm>

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

  const std::string experts_key = cfg.first_present({"num_experts", "num_local_experts"});
  MoESpec& m = s.moe;
  m.num_experts = cfg.get_int(experts_key);
  if (m.num_experts < 0) cfg.fail_key(experts_key, "a non-negative integer");
  const int64_t sparse_step = cfg.get_int("decoder_sparse_step", 1);
  if (sparse_step < 1) cfg.fail_key("decoder_sparse_step", "an integer >= 1");
  const std::vector<int64_t> mlp_only = cfg.get_int_list("mlp_only_layers");
  for (int64_t l : mlp_only) {
    if (l < 0 || l >= s.num_layers) {
      cfg.fail_key("mlp_only_layers", "layer indices in [0, " + std::to_string(s.num_layers) + ")");
    }
  }
  std::vector<bool> is_moe(s.num_layers);
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const bool dense_listed = std::find(mlp_only.begin(), mlp_only.end(), l) != mlp_only.end();
    is_moe[l] = !dense_listed && m.num_experts > 0 && (l + 1) % sparse_step == 0;
  }
  s.set_moe_layers(is_moe);
  for (LayerSpec& l : s.layers) l.sliding_window = window;
  if (s.num_moe_layers() > 0) {
    m.top_k = cfg.get_int("num_experts_per_tok");
    if (m.top_k < 1 || m.top_k > m.num_experts) {
      cfg.fail_key("num_experts_per_tok",
                   "an integer in [1, " + std::to_string(m.num_experts) + "] (the expert count)");
    }
    m.intermediate_size = arch::positive(cfg, "moe_intermediate_size");
  }
  m.norm_topk_prob = cfg.get_bool("norm_topk_prob", false);
  m.router_aux_loss_coef = cfg.get_double("router_aux_loss_coef", 0.001);
  m.output_router_logits = cfg.get_bool("output_router_logits", false);
  m.score = RouterScore::kSoftmax;
  return s;
}

}  // namespace

Architecture qwen3_moe_architecture() {
  return Architecture{"qwen3_moe", "Qwen3MoeForCausalLM", &parse_qwen3_moe,
                      qwen2_moe_expert_rules(), /*renames=*/{}};
}

}  // namespace automoe
