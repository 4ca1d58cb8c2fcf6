// Nemotron-H / Nemotron 3 (model_type "nemotron_h"): a hybrid stack of blocks, each a pre-norm, one
// component and a residual: Mamba-2 ("linear_attention", "M"), attention without positions
// ("full_attention", "*": GQA, no RoPE, no biases), a plain relu2 MLP ("mlp", "-") or a MoE
// ("moe", "E": sigmoid router with a correction bias and group-limited top-k, relu2 experts without a
// gate projection, a relu2 shared expert, optional latent projections around the routed experts).
// Transformers' NemotronHConfig is the oracle for every default and legacy key; multi-token-
// prediction layers (`mtp.*`) are skipped on load, as Transformers ignores them.
#include <nlohmann/json.hpp>

#include "automoe/model/arch/common.h"
#include "automoe/model/arch/registry.h"

namespace automoe {
namespace {

// layers_block_type (or its alias layer_types), else the legacy hybrid_override_pattern string,
// else NemotronHConfig's default; legacy names ("mamba", "attention") as Transformers remaps them.
std::vector<LayerSpec> parse_blocks(const ConfigReader& cfg) {
  const nlohmann::json& raw = cfg.raw();
  std::vector<std::string> kinds;
  const std::string list_key = cfg.has("layers_block_type") ? "layers_block_type"
                               : cfg.has("layer_types")     ? "layer_types"
                                                            : "";
  if (!list_key.empty()) {
    const nlohmann::json& list = raw.at(list_key);
    if (!list.is_array() || list.empty()) cfg.fail_key(list_key, "a non-empty list of block types");
    for (const auto& t : list) {
      if (!t.is_string()) cfg.fail_key(list_key, "a list of strings");
      kinds.push_back(t.get<std::string>());
    }
  } else if (cfg.has("hybrid_override_pattern")) {
    const std::string pattern = cfg.get_string("hybrid_override_pattern");
    if (pattern.empty()) cfg.fail_key("hybrid_override_pattern", "a non-empty pattern of M, E, * and -");
    for (char c : pattern) {
      kinds.push_back(c == 'M' ? "linear_attention" : c == 'E' ? "moe" : c == '*' ? "full_attention"
                      : c == '-' ? "mlp" : std::string(1, c));
    }
  } else {
    kinds = {"linear_attention", "moe", "full_attention", "mlp"};
  }
  if (static_cast<int64_t>(kinds.size()) > arch::kMaxLayers) {
    cfg.fail_key(list_key.empty() ? "hybrid_override_pattern" : list_key,
                 "at most " + std::to_string(arch::kMaxLayers) + " layers");
  }
  std::vector<LayerSpec> layers;
  for (const std::string& k : kinds) {
    LayerSpec l;
    l.mixer = MixerKind::kNone;
    l.mlp = MlpKind::kNone;
    if (k == "linear_attention" || k == "mamba") {
      l.mixer = MixerKind::kMamba2;
    } else if (k == "full_attention" || k == "attention") {
      l.mixer = MixerKind::kAttention;
    } else if (k == "moe") {
      l.mlp = MlpKind::kMoE;
    } else if (k == "mlp") {
      l.mlp = MlpKind::kDense;
    } else {
      cfg.fail_key(list_key.empty() ? "hybrid_override_pattern" : list_key,
                   "block types among linear_attention (M), full_attention (*), moe (E), mlp (-); "
                   "found \"" + k + "\"");
    }
    layers.push_back(l);
  }
  return layers;
}

// The first present of a current key and its legacy spelling (NemotronHConfig.__post_init__).
std::string key_or_legacy(const ConfigReader& cfg, const std::string& key, const std::string& legacy) {
  return !cfg.has(key) && cfg.has(legacy) ? legacy : key;
}

ModelSpec parse_nemotron_h(const ConfigReader& cfg) {
  arch::reject_unsupported(cfg);
  for (const auto& [key, expected] :
       {std::pair<std::string, std::string>{"mlp_hidden_act", "relu2"}, {"mamba_hidden_act", "silu"}}) {
    if (cfg.get_string(key, expected) != expected) {
      cfg.fail_key(key, "\"" + expected + "\" (the only activation implemented for Nemotron-H)");
    }
  }
  ModelSpec s;
  s.model_type = "nemotron_h";
  s.naming = Naming::kHybridBlocks;
  s.layers = parse_blocks(cfg);
  s.num_layers = static_cast<int64_t>(s.layers.size());
  // parse_decoder_basics reads num_hidden_layers, which NemotronHConfig derives from the blocks.
  auto json = std::make_shared<nlohmann::json>(cfg.raw());
  (*json)["num_hidden_layers"] = s.num_layers;
  const ConfigReader c(json, cfg.path());
  arch::Defaults d;  // NemotronHConfig's
  d.max_position_embeddings = 4096;
  d.pad_token_id = 0;
  arch::parse_decoder_basics(c, d, &s);
  // NemotronHForCausalLM ties nothing (_tied_weights_keys is empty) whatever tie_word_embeddings
  // says: its lm_head is always a weight of its own.
  s.tie_word_embeddings = false;
  s.embedding_padding_idx = false;  // NemotronHModel's nn.Embedding has no padding_idx
  s.rms_norm_eps = c.get_double("layer_norm_epsilon", 1e-5);
  if (s.rms_norm_eps < 0) c.fail_key("layer_norm_epsilon", "a non-negative number");

  AttentionSpec& a = s.attn;
  a.num_heads = arch::positive(c, "num_attention_heads", 32);
  a.num_kv_heads = c.is_null("num_key_value_heads") ? a.num_heads
                                                    : arch::positive(c, "num_key_value_heads", 8);
  if (a.num_heads % a.num_kv_heads != 0) {
    c.fail_key("num_key_value_heads", "a divisor of num_attention_heads (" + std::to_string(a.num_heads) + ")");
  }
  a.head_dim = c.is_null("head_dim") ? s.hidden_size / a.num_heads : arch::positive(c, "head_dim", 128);
  s.rope.type = RopeType::kNone;  // NemotronHAttention applies no rotary embedding

  s.hidden_act = Activation::kRelu2;
  s.intermediate_size = arch::positive(c, "intermediate_size", 21504);
  s.mlp_bias = c.get_bool("mlp_bias", false);

  Mamba2Spec& m = s.mamba;
  m.num_heads = arch::positive(c, "mamba_num_heads", 128);
  m.head_dim = arch::positive(c, "mamba_head_dim", 64);
  m.state_size = arch::positive(c, "ssm_state_size", 128);
  const std::string groups_key = key_or_legacy(c, "n_groups", "mamba_n_groups");
  m.n_groups = arch::positive(c, groups_key, 8);
  if (m.num_heads % m.n_groups != 0) {
    c.fail_key(groups_key, "a divisor of mamba_num_heads (" + std::to_string(m.num_heads) + ")");
  }
  m.conv_kernel = arch::positive(c, key_or_legacy(c, "conv_kernel", "mamba_d_conv"), 4);
  m.chunk_size = arch::positive(c, key_or_legacy(c, "chunk_size", "mamba_chunk_size"), 128);
  m.conv_bias = c.get_bool(key_or_legacy(c, "use_conv_bias", "mamba_conv_bias"), true);
  // Transformers' mixer: in_proj and out_proj take `use_bias` (mamba_proj_bias is not read), and dt
  // is clamped to (time_step_min, inf) (time_step_limit is not read).
  m.proj_bias = c.get_bool("use_bias", false);
  m.dt_min = c.get_double(key_or_legacy(c, "time_step_min", "mamba_dt_min"), 0.001);
  m.norm_eps = s.rms_norm_eps;

  MoESpec& e = s.moe;
  e.gated = false;
  e.num_experts = arch::positive(c, c.has("n_routed_experts") ? "n_routed_experts" : "num_local_experts", 8);
  e.top_k = c.get_int("num_experts_per_tok", 2);
  if (e.top_k < 1 || e.top_k > e.num_experts) {
    c.fail_key("num_experts_per_tok", "an integer in [1, " + std::to_string(e.num_experts) + "] (the expert count)");
  }
  e.intermediate_size = arch::positive(c, "moe_intermediate_size", 7688);
  e.shared_intermediate_size = arch::positive(c, "moe_shared_expert_intermediate_size", 7688);
  e.latent_size = c.is_null("moe_latent_size") ? 0 : arch::positive(c, "moe_latent_size", 0);
  e.score = RouterScore::kSigmoid;
  e.correction_bias = true;
  e.norm_topk_prob = c.get_flag("norm_topk_prob", true);
  e.routed_scaling_factor = c.get_double("routed_scaling_factor", 1.0);
  e.n_group = arch::positive(c, "n_group", 1);
  e.topk_group = arch::positive(c, "topk_group", 1);
  if (e.num_experts % e.n_group != 0) {
    c.fail_key("n_group", "a divisor of n_routed_experts (" + std::to_string(e.num_experts) + ")");
  }
  if (e.topk_group > e.n_group) c.fail_key("topk_group", "at most n_group (" + std::to_string(e.n_group) + ")");
  if (e.num_experts / e.n_group < 2) {
    c.fail_key("n_group", "at most n_routed_experts / 2 (Transformers scores a group by its two best experts)");
  }
  if (e.topk_group * (e.num_experts / e.n_group) < e.top_k) {
    c.fail_key("topk_group", "enough groups to hold num_experts_per_tok experts");
  }
  e.aux_loss = false;  // NemotronHForCausalLM computes no load-balancing loss
  e.router_aux_loss_coef = 0.0;
  e.output_router_logits = false;
  s.mtp_module = true;
  s.num_mtp_layers = c.get_int("num_nextn_predict_layers", 0);
  if (s.num_mtp_layers < 0) c.fail_key("num_nextn_predict_layers", "a non-negative integer");
  return s;
}

}  // namespace

Architecture nemotron_h_architecture() {
  return Architecture{
      "nemotron_h",
      "NemotronHForCausalLM",
      &parse_nemotron_h,
      {
          {"mixer.experts.up_proj", {"mixer.experts.{E}.up_proj.weight"}, 0, std::nullopt},
          {"mixer.experts.down_proj", {"mixer.experts.{E}.down_proj.weight"}, 0, std::nullopt},
      },
      // The released checkpoints name the backbone `backbone.` (Transformers' conversion mapping).
      {{"model.", "backbone."}},
  };
}

}  // namespace automoe
