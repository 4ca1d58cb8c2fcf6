// Mixtral (model_type "mixtral"): GQA attention (no biases, no q/k norms), an optional sliding
// window on every layer, MoE on every layer with a softmax router renormalised over its top-k (and
// router_jitter_noise in training), and experts as wide as `intermediate_size`. Original checkpoints name the block `block_sparse_moe`
// and the experts `w1` (gate), `w3` (up), `w2` (down).
#include "automoe/model/arch/common.h"
#include "automoe/model/arch/registry.h"

namespace automoe {
namespace {

ModelSpec parse_mixtral(const ConfigReader& cfg) {
  arch::reject_unsupported(cfg);
  arch::Defaults d;  // MixtralConfig's
  d.max_position_embeddings = 4096 * 32;
  d.rms_norm_eps = 1e-5;
  ModelSpec s;
  s.model_type = "mixtral";
  arch::parse_decoder_basics(cfg, d, &s);
  arch::parse_gqa(cfg, /*kv_default=*/8, &s);
  s.rope = arch::parse_rope(cfg, s.attn.head_dim, "head_dim", /*partial_default=*/0,
                            s.max_position_embeddings, /*theta_default=*/1e6);
  s.intermediate_size = arch::positive(cfg, "intermediate_size");
  arch::parse_softmax_moe(cfg, "num_local_experts", "intermediate_size", /*norm_default=*/true,
                          /*aux_default=*/0.001, &s);
  if (s.num_moe_layers() != s.num_layers) {
    cfg.fail_key("num_local_experts", "a positive expert count (every Mixtral layer is MoE)");
  }
  s.moe.norm_topk_prob = true;  // Mixtral always renormalises its top-k
  s.moe.router_jitter_noise = cfg.get_double("router_jitter_noise", 0.0);
  if (s.moe.router_jitter_noise < 0 || s.moe.router_jitter_noise >= 1) {
    cfg.fail_key("router_jitter_noise", "a number in [0, 1)");
  }
  const int64_t window = cfg.has("sliding_window") ? arch::positive(cfg, "sliding_window") : 0;
  for (LayerSpec& l : s.layers) l.sliding_window = window;
  return s;
}

}  // namespace

Architecture mixtral_architecture() {
  return Architecture{
      "mixtral",
      "MixtralForCausalLM",
      &parse_mixtral,
      {
          {"mlp.experts.gate_up_proj",
           {"mlp.experts.{E}.w1.weight", "mlp.experts.{E}.w3.weight"},
           /*concat_dim=*/1,
           std::nullopt},
          {"mlp.experts.down_proj", {"mlp.experts.{E}.w2.weight"}, 0, std::nullopt},
      },
      {{".mlp.", ".block_sparse_moe."}},
  };
}

}  // namespace automoe
