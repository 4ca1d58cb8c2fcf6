#include "automoe/model/arch/common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

#include "automoe/core/dtype.h"

namespace automoe::arch {

int64_t positive(const ConfigReader& cfg, const std::string& key) {
  // (at most 2^31 - 1: any product of two sizes then fits in int64)
  const int64_t v = cfg.get_int(key);
  if (v <= 0 || v > INT32_MAX) cfg.fail_key(key, "a positive integer below 2^31");
  return v;
}

int64_t positive(const ConfigReader& cfg, const std::string& key, int64_t fallback) {
  return cfg.has(key) ? positive(cfg, key) : fallback;
}

namespace {

// A size no real model comes near: beyond it a value is damage, refused before it sizes anything.
int64_t bounded(const ConfigReader& cfg, const std::string& key, int64_t max) {
  const int64_t v = positive(cfg, key);
  if (v > max) cfg.fail_key(key, "a positive integer up to " + std::to_string(max));
  return v;
}

}  // namespace

void reject_unsupported(const ConfigReader& cfg) {
  if (cfg.has("quantization_config")) {
    cfg.fail_key("quantization_config",
                 "no quantization (quantized checkpoints, FP8 block-quantised ones included, are "
                 "not supported: convert the weights to bfloat16 first)");
  }
  if (cfg.get_double("attention_dropout", 0.0) != 0.0) {
    cfg.fail_key("attention_dropout", "0.0 (attention dropout is not implemented)");
  }
  const std::string act = cfg.get_string("hidden_act", "silu");
  if (act != "silu") cfg.fail_key("hidden_act", "\"silu\" (the only activation implemented)");
}

void parse_decoder_basics(const ConfigReader& cfg, const Defaults& d, ModelSpec* s) {
  s->vocab_size = bounded(cfg, "vocab_size", int64_t{1} << 24);
  s->hidden_size = bounded(cfg, "hidden_size", int64_t{1} << 18);
  s->num_layers = bounded(cfg, "num_hidden_layers", kMaxLayers);
  s->max_position_embeddings = positive(cfg, "max_position_embeddings", d.max_position_embeddings);
  s->rms_norm_eps = cfg.get_double("rms_norm_eps", d.rms_norm_eps);
  if (s->rms_norm_eps < 0) cfg.fail_key("rms_norm_eps", "a non-negative number");
  s->tie_word_embeddings = cfg.get_bool("tie_word_embeddings", false);
  s->pad_token_id = cfg.is_null("pad_token_id") ? -1 : cfg.get_int("pad_token_id", d.pad_token_id);
  const std::string dtype_key = cfg.has("dtype") ? "dtype" : "torch_dtype";
  s->dtype = cfg.has(dtype_key) ? dtype_from_name(cfg.get_string(dtype_key),
                                                  cfg.path() + ": key \"" + dtype_key + "\"")
                                : c10::kFloat;
}

void parse_gqa(const ConfigReader& cfg, int64_t kv_default, ModelSpec* s) {
  AttentionSpec& a = s->attn;
  a.kind = AttentionKind::kGQA;
  a.num_heads = positive(cfg, "num_attention_heads");
  // Absent: the config class's default; null: num_attention_heads (the classes' __post_init__).
  a.num_kv_heads = cfg.is_null("num_key_value_heads")
                       ? a.num_heads
                       : positive(cfg, "num_key_value_heads", kv_default > 0 ? kv_default : a.num_heads);
  if (a.num_heads % a.num_kv_heads != 0) {
    cfg.fail_key("num_key_value_heads",
                 "a divisor of num_attention_heads (" + std::to_string(a.num_heads) + ")");
  }
  if (!cfg.has("head_dim") && s->hidden_size % a.num_heads != 0) {
    cfg.fail_key("head_dim", "an integer (hidden_size is not a multiple of num_attention_heads)");
  }
  a.head_dim = positive(cfg, "head_dim", s->hidden_size / a.num_heads);
}

double yarn_mscale(double factor, double m) {
  return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0;
}

namespace {

// The scaling part of a rope_parameters / rope_scaling object `r`.
void parse_rope_scaling(const ConfigReader& r, const ConfigReader& cfg,
                        int64_t max_position_embeddings, RopeSpec* rope) {
  const std::string type = r.get_string("rope_type", r.get_string("type", "default"));
  if (type == "default") return;
  if (type != "linear" && type != "yarn") {
    r.fail_key("rope_type",
               "\"default\", \"linear\" or \"yarn\" (other RoPE scalings are not implemented)");
  }
  rope->mscale_all_dim = r.get_double("mscale_all_dim", 0.0);
  if (type == "linear") {
    rope->type = RopeType::kLinear;
    rope->factor = r.get_double("factor");
    if (rope->factor <= 0) r.fail_key("factor", "a positive number");
    return;
  }
  rope->type = RopeType::kYarn;
  // standardize_rope_params: a top-level original_max_position_embeddings wins, then the rope
  // dict's, then max_position_embeddings.
  rope->original_max_position_embeddings =
      cfg.has("original_max_position_embeddings")
          ? positive(cfg, "original_max_position_embeddings")
          : positive(r, "original_max_position_embeddings", max_position_embeddings);
  // A missing factor is the context extension itself.
  rope->factor = r.has("factor") ? r.get_double("factor")
                                 : static_cast<double>(max_position_embeddings) /
                                       static_cast<double>(rope->original_max_position_embeddings);
  if (rope->factor <= 0) r.fail_key("factor", "a positive number");
  // `beta_fast or 32`, `beta_slow or 1`: 0 and null take the default.
  const double fast = r.get_double("beta_fast", 0.0), slow = r.get_double("beta_slow", 0.0);
  rope->beta_fast = fast != 0 ? fast : 32.0;
  rope->beta_slow = slow != 0 ? slow : 1.0;
  rope->truncate = r.get_bool("truncate", true);
  if (r.has("attention_factor")) {
    rope->attention_factor = r.get_double("attention_factor");
  } else {
    const double mscale = r.get_double("mscale", 0.0);
    const double all = rope->mscale_all_dim;
    rope->attention_factor = mscale != 0 && all != 0
                                 ? yarn_mscale(rope->factor, mscale) / yarn_mscale(rope->factor, all)
                                 : yarn_mscale(rope->factor, 1.0);
  }
}

}  // namespace

RopeSpec parse_rope(const ConfigReader& cfg, int64_t rope_head_dim, const std::string& rope_dim_key,
                    double partial_default, int64_t max_position_embeddings,
                    double theta_default) {
  RopeSpec rope;
  rope.theta = cfg.get_double("rope_theta", theta_default);
  const bool partial_rotary = partial_default > 0;
  // Where partial_rotary_factor came from (errors name that key).
  std::optional<ConfigReader> partial_from;
  if (cfg.has("partial_rotary_factor")) partial_from = cfg;
  // Transformers v5 writes "rope_parameters"; v4 checkpoints have "rope_theta" + "rope_scaling",
  // and a non-empty rope_scaling replaces rope_parameters (PreTrainedConfig's rope handling).
  const bool v4 = cfg.has("rope_scaling") && !cfg.raw().at("rope_scaling").empty();
  if (v4 || cfg.has("rope_parameters")) {
    const ConfigReader rp = cfg.child(v4 ? "rope_scaling" : "rope_parameters");
    rope.theta = rp.get_double("rope_theta", rope.theta);
    if (rp.has("partial_rotary_factor")) partial_from = rp;
    parse_rope_scaling(rp, cfg, max_position_embeddings, &rope);
  }
  if (rope.theta <= 0) cfg.fail_key("rope_theta", "a positive number");
  const double partial = partial_from ? partial_from->get_double("partial_rotary_factor")
                                      : (partial_rotary ? partial_default : 1.0);
  if (partial_from && !partial_rotary && partial != 1.0) {
    partial_from->fail_key("partial_rotary_factor", "1.0 (this model type rotates whole heads)");
  }
  if (partial_from && (partial <= 0 || partial > 1)) {
    partial_from->fail_key("partial_rotary_factor", "a number in (0, 1]");
  }
  rope.dim = static_cast<int64_t>(static_cast<double>(rope_head_dim) * partial);
  if (rope.dim <= 0 || rope.dim % 2 != 0) {
    const std::string why = "a rotary dimension that is even and positive (RoPE rotates pairs; got " +
                            std::to_string(rope.dim) + ")";
    if (partial_from && partial != 1.0) partial_from->fail_key("partial_rotary_factor", why);
    cfg.fail_key(rope_dim_key, why);
  }
  return rope;
}

void parse_deepseek_moe(const ConfigReader& cfg, const Defaults& d, ModelSpec* s) {
  MoESpec& m = s->moe;
  const std::string experts_key = cfg.first_present({"n_routed_experts", "num_local_experts"});
  m.num_experts = bounded(cfg, experts_key, int64_t{1} << 16);
  m.top_k = cfg.get_int("num_experts_per_tok");
  if (m.top_k < 1 || m.top_k > m.num_experts) {
    cfg.fail_key("num_experts_per_tok",
                 "an integer in [1, " + std::to_string(m.num_experts) + "] (the expert count)");
  }
  m.intermediate_size = positive(cfg, "moe_intermediate_size");
  m.score = RouterScore::kSigmoid;
  m.correction_bias = true;
  m.norm_topk_prob = cfg.get_flag("norm_topk_prob", true);
  m.routed_scaling_factor = cfg.get_double("routed_scaling_factor", d.routed_scaling_factor);
  m.n_group = positive(cfg, "n_group", d.n_group);
  m.topk_group = positive(cfg, "topk_group", d.topk_group);
  if (m.num_experts % m.n_group != 0) {
    cfg.fail_key("n_group", "a divisor of n_routed_experts (" + std::to_string(m.num_experts) + ")");
  }
  if (m.topk_group > m.n_group) {
    cfg.fail_key("topk_group", "at most n_group (" + std::to_string(m.n_group) + ")");
  }
  if (m.num_experts / m.n_group < 2) {
    // Transformers scores a group by its two best experts.
    cfg.fail_key("n_group", "at most n_routed_experts / 2 (groups of at least two experts)");
  }
  if (m.topk_group * (m.num_experts / m.n_group) < m.top_k) {
    cfg.fail_key("topk_group", "enough groups to hold num_experts_per_tok experts");
  }
  const int64_t shared = cfg.get_int("n_shared_experts", 1);
  if (shared < 0) cfg.fail_key("n_shared_experts", "a non-negative integer");
  m.shared_intermediate_size = m.intermediate_size * shared;
  m.aux_loss = false;  // Transformers trains these without a load-balancing loss
  m.router_aux_loss_coef = 0.0;
  m.output_router_logits = false;
  const int64_t dense = cfg.get_int("first_k_dense_replace", d.first_k_dense_replace);
  if (dense < 0) cfg.fail_key("first_k_dense_replace", "a non-negative integer");
  std::vector<bool> is_moe(s->num_layers);
  for (int64_t l = 0; l < s->num_layers; ++l) is_moe[l] = l >= dense;
  s->set_moe_layers(is_moe);
  s->intermediate_size = positive(cfg, "intermediate_size");
}

int64_t parse_mtp_layers(const ConfigReader& cfg) {
  const std::string key = cfg.has("num_mtp_layers") && !cfg.has("num_nextn_predict_layers")
                              ? "num_mtp_layers"
                              : "num_nextn_predict_layers";
  const int64_t n = cfg.get_int(key, 1);
  if (n < 0) cfg.fail_key(key, "a non-negative integer");
  return n;
}

void parse_softmax_moe(const ConfigReader& cfg, const std::string& experts_key,
                       const std::string& intermediate_key, bool norm_default, double aux_default,
                       ModelSpec* s) {
  MoESpec& m = s->moe;
  m.num_experts = cfg.get_int(experts_key);
  if (m.num_experts > (int64_t{1} << 16)) cfg.fail_key(experts_key, "at most 65536 experts");
  if (m.num_experts < 0) cfg.fail_key(experts_key, "a non-negative integer");
  const int64_t sparse_step = cfg.get_int("decoder_sparse_step", 1);
  if (sparse_step < 1) cfg.fail_key("decoder_sparse_step", "an integer >= 1");
  const std::vector<int64_t> mlp_only = cfg.get_int_list("mlp_only_layers");
  for (int64_t l : mlp_only) {
    if (l < 0 || l >= s->num_layers) {
      cfg.fail_key("mlp_only_layers", "layer indices in [0, " + std::to_string(s->num_layers) + ")");
    }
  }
  std::vector<bool> is_moe(s->num_layers);
  for (int64_t l = 0; l < s->num_layers; ++l) {
    const bool dense_listed = std::find(mlp_only.begin(), mlp_only.end(), l) != mlp_only.end();
    is_moe[l] = !dense_listed && m.num_experts > 0 && (l + 1) % sparse_step == 0;
  }
  s->set_moe_layers(is_moe);
  if (s->num_moe_layers() > 0) {
    m.top_k = cfg.get_int("num_experts_per_tok");
    if (m.top_k < 1 || m.top_k > m.num_experts) {
      cfg.fail_key("num_experts_per_tok",
                   "an integer in [1, " + std::to_string(m.num_experts) + "] (the expert count)");
    }
    m.intermediate_size = positive(cfg, intermediate_key);
  }
  m.norm_topk_prob = cfg.get_flag("norm_topk_prob", norm_default);
  m.router_aux_loss_coef = cfg.get_double("router_aux_loss_coef", aux_default);
  m.output_router_logits = cfg.get_flag("output_router_logits", false);
  m.score = RouterScore::kSoftmax;
}

void parse_layer_types(const ConfigReader& cfg, const std::function<bool(int64_t)>& default_sliding,
                       int64_t window, const std::string& window_key, ModelSpec* s) {
  const nlohmann::json& raw = cfg.raw();
  const bool listed = raw.contains("layer_types") && !raw.at("layer_types").is_null();
  if (listed && (!raw.at("layer_types").is_array() ||
                 static_cast<int64_t>(raw.at("layer_types").size()) != s->num_layers)) {
    cfg.fail_key("layer_types", "a list of " + std::to_string(s->num_layers) + " layer types");
  }
  for (int64_t l = 0; l < s->num_layers; ++l) {
    bool sliding = default_sliding(l);
    if (listed) {
      const nlohmann::json& t = raw.at("layer_types").at(l);
      if (t != "sliding_attention" && t != "full_attention") {
        cfg.fail_key("layer_types", "\"sliding_attention\" or \"full_attention\" per layer");
      }
      sliding = t == "sliding_attention";
    }
    if (sliding && window <= 0) {
      cfg.fail_key(window_key, "a sliding window (layer_types has sliding_attention layers)");
    }
    s->layers[l].sliding_window = sliding ? window : 0;
  }
}

}  // namespace automoe::arch
