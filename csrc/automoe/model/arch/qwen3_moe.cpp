// Qwen3-MoE (model_type "qwen3_moe"): GQA attention with per-head q/k RMSNorm, softmax top-k
// router with optional renormalisation, SwiGLU experts, dense MLP on `mlp_only_layers` and off the
// `decoder_sparse_step` grid.
#include <nlohmann/json.hpp>

#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/io/hf_config.h"
#include "automoe/model/arch/registry.h"

namespace automoe {
namespace {

int64_t positive(const ConfigReader& cfg, const std::string& key, int64_t v) {
  if (v <= 0) cfg.fail_key(key, "a positive integer");
  return v;
}

// Keys whose presence means math this engine does not implement.
void reject_unsupported(const ConfigReader& cfg) {
  if (cfg.has("quantization_config")) {
    cfg.fail_key("quantization_config",
                 "no quantization (quantized checkpoints are not supported)");
  }
  if (cfg.get_double("attention_dropout", 0.0) != 0.0) {
    cfg.fail_key("attention_dropout", "0.0 (attention dropout is not implemented)");
  }
  const std::string act = cfg.get_string("hidden_act", "silu");
  if (act != "silu") cfg.fail_key("hidden_act", "\"silu\" (the only activation implemented)");
}

// Reads the scaling part ("rope_type"/"type", "factor") of a rope_parameters / rope_scaling object.
void parse_rope_scaling(const ConfigReader& r, RopeSpec* rope) {
  const std::string type = r.get_string("rope_type", r.get_string("type", "default"));
  if (type == "linear") {
    rope->type = RopeType::kLinear;
    rope->factor = r.get_double("factor");
    if (rope->factor <= 0) r.fail_key("factor", "a positive number");
  } else if (type != "default") {
    r.fail_key("rope_type", "\"default\" or \"linear\" (other RoPE scalings are not implemented)");
  }
}

RopeSpec parse_rope(const ConfigReader& cfg) {
  RopeSpec rope;
  rope.theta = cfg.get_double("rope_theta", 10000.0);
  // Transformers v5 writes "rope_parameters"; v4 checkpoints have "rope_theta" + "rope_scaling".
  if (cfg.has("rope_parameters")) {
    const ConfigReader rp = cfg.child("rope_parameters");
    rope.theta = rp.get_double("rope_theta", rope.theta);
    parse_rope_scaling(rp, &rope);
  } else if (cfg.has("rope_scaling")) {
    parse_rope_scaling(cfg.child("rope_scaling"), &rope);
  }
  if (rope.theta <= 0) cfg.fail_key("rope_theta", "a positive number");
  return rope;
}

ModelSpec parse_qwen3_moe(const ConfigReader& cfg) {
  reject_unsupported(cfg);
  ModelSpec s;
  s.model_type = "qwen3_moe";
  s.vocab_size = positive(cfg, "vocab_size", cfg.get_int("vocab_size"));
  s.hidden_size = positive(cfg, "hidden_size", cfg.get_int("hidden_size"));
  s.num_layers = positive(cfg, "num_hidden_layers", cfg.get_int("num_hidden_layers"));
  s.num_heads = positive(cfg, "num_attention_heads", cfg.get_int("num_attention_heads"));
  s.num_kv_heads =
      positive(cfg, "num_key_value_heads", cfg.get_int("num_key_value_heads", 4));
  if (s.num_heads % s.num_kv_heads != 0) {
    cfg.fail_key("num_key_value_heads",
                 "a divisor of num_attention_heads (" + std::to_string(s.num_heads) + ")");
  }
  s.head_dim = cfg.has("head_dim") ? positive(cfg, "head_dim", cfg.get_int("head_dim"))
                                   : s.hidden_size / s.num_heads;
  if (!cfg.has("head_dim") && s.hidden_size % s.num_heads != 0) {
    cfg.fail_key("head_dim", "an integer (hidden_size is not a multiple of num_attention_heads)");
  }
  if (s.head_dim % 2 != 0) cfg.fail_key("head_dim", "an even number (RoPE rotates pairs)");
  s.max_position_embeddings = cfg.get_int("max_position_embeddings", 32768);
  s.rms_norm_eps = cfg.get_double("rms_norm_eps", 1e-6);
  if (s.rms_norm_eps < 0) cfg.fail_key("rms_norm_eps", "a non-negative number");
  s.attention_bias = cfg.get_bool("attention_bias", false);
  s.qk_norm = true;
  s.rope = parse_rope(cfg);
  if (cfg.get_bool("use_sliding_window", false)) {
    s.sliding_window = positive(cfg, "sliding_window", cfg.get_int("sliding_window"));
  }
  s.intermediate_size = positive(cfg, "intermediate_size", cfg.get_int("intermediate_size"));
  s.tie_word_embeddings = cfg.get_bool("tie_word_embeddings", false);
  s.pad_token_id = cfg.get_int("pad_token_id", -1);

  const std::string dtype_key = cfg.has("dtype") ? "dtype" : "torch_dtype";
  s.dtype = cfg.has(dtype_key) ? dtype_from_name(cfg.get_string(dtype_key),
                                                 cfg.path() + ": key \"" + dtype_key + "\"")
                               : c10::kFloat;

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
  s.layer_is_moe.resize(s.num_layers);
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const bool dense_listed = std::find(mlp_only.begin(), mlp_only.end(), l) != mlp_only.end();
    s.layer_is_moe[l] = !dense_listed && m.num_experts > 0 && (l + 1) % sparse_step == 0;
  }
  if (s.num_moe_layers() > 0) {
    m.top_k = cfg.get_int("num_experts_per_tok");
    if (m.top_k < 1 || m.top_k > m.num_experts) {
      cfg.fail_key("num_experts_per_tok",
                   "an integer in [1, " + std::to_string(m.num_experts) + "] (the expert count)");
    }
    m.intermediate_size =
        positive(cfg, "moe_intermediate_size", cfg.get_int("moe_intermediate_size"));
  }
  m.norm_topk_prob = cfg.get_bool("norm_topk_prob", false);
  m.router_aux_loss_coef = cfg.get_double("router_aux_loss_coef", 0.001);
  m.output_router_logits = cfg.get_bool("output_router_logits", false);
  m.score = RouterScore::kSoftmax;
  return s;
}

}  // namespace

Architecture qwen3_moe_architecture() {
  return Architecture{
      "qwen3_moe",
      "Qwen3MoeForCausalLM",
      &parse_qwen3_moe,
      {
          {"mlp.experts.gate_up_proj",
           {"mlp.experts.{E}.gate_proj.weight", "mlp.experts.{E}.up_proj.weight"},
           /*concat_dim=*/1,
           std::nullopt},
          {"mlp.experts.down_proj", {"mlp.experts.{E}.down_proj.weight"}, 0, std::nullopt},
      },
  };
}

}  // namespace automoe
