// Config helpers every architecture file shares: the fields most decoders spell alike, the RoPE
// block (default, linear, YaRN, partial rotary), DeepSeek-style routing, refusals of math we do not
// implement. An architecture file calls these and fills in what is its own.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "automoe/io/hf_config.h"
#include "automoe/model/spec.h"

namespace automoe::arch {

// cfg[key] as an integer > 0 (an error naming the key otherwise); `fallback` when absent, if given.
// The most decoder layers a config.json may declare (the largest MoE models have ~100).
inline constexpr int64_t kMaxLayers = 4096;

int64_t positive(const ConfigReader& cfg, const std::string& key);
int64_t positive(const ConfigReader& cfg, const std::string& key, int64_t fallback);

// quantization_config (FP8 block-quantised checkpoints and the like), attention dropout and
// activations other than SiLU are refused by name.
void reject_unsupported(const ConfigReader& cfg);

// The defaults of a type's Transformers config class for keys a config.json may omit: a missing key
// must mean what it means to Transformers, or the two would run different models.
struct Defaults {
  int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  int64_t pad_token_id = -1;  // -1: none
  // DeepSeek-style MoE
  int64_t n_group = 1, topk_group = 1, first_k_dense_replace = 1;
  double routed_scaling_factor = 1.0;
};

// vocab_size, hidden_size, num_hidden_layers, max_position_embeddings, rms_norm_eps,
// tie_word_embeddings, pad_token_id, dtype / torch_dtype.
void parse_decoder_basics(const ConfigReader& cfg, const Defaults& d, ModelSpec* s);

// num_attention_heads, num_key_value_heads (default `kv_default`, 0: = heads), head_dim (default
// hidden_size / heads) for grouped-query attention.
void parse_gqa(const ConfigReader& cfg, int64_t kv_default, ModelSpec* s);

// rope_parameters (v5) or rope_theta + rope_scaling (v4, which wins when both are there, as in
// Transformers): default, linear or YaRN, over a head's rotary part of `rope_head_dim` (the config
// key `rope_dim_key` sets it), of which partial_rotary_factor (rope dict or top level) rotates the
// first share. `partial_default`: the factor when the config has none; 0: this type rotates whole
// heads (a factor other than 1 is refused). YaRN's original_max_position_embeddings, factor and
// betas default as Transformers' standardize_rope_params / _compute_yarn_parameters do.
RopeSpec parse_rope(const ConfigReader& cfg, int64_t rope_head_dim, const std::string& rope_dim_key,
                    double partial_default, int64_t max_position_embeddings,
                    double theta_default = 10000.0);

// Qwen-style layer placement: MoE on layers not in mlp_only_layers, on the decoder_sparse_step
// grid, when the expert count (read from `experts_key`) is positive; top-k, expert width (read from
// `intermediate_key`), softmax router with norm_topk_prob (`norm_default`), aux coefficient
// (`aux_default`).
void parse_softmax_moe(const ConfigReader& cfg, const std::string& experts_key,
                       const std::string& intermediate_key, bool norm_default, double aux_default,
                       ModelSpec* s);

// YaRN's mscale(factor, m) = 0.1 * m * ln(factor) + 1 (1 for factor <= 1).
double yarn_mscale(double factor, double m);

// DeepSeek-V3-style MoE (also GLM-4.5): n_routed_experts, num_experts_per_tok,
// moe_intermediate_size, sigmoid scores with e_score_correction_bias, n_group / topk_group,
// norm_topk_prob, routed_scaling_factor, n_shared_experts; first_k_dense_replace dense layers.
void parse_deepseek_moe(const ConfigReader& cfg, const Defaults& d, ModelSpec* s);

// Per-layer sliding windows from `layer_types` ("sliding_attention" | "full_attention", one per
// layer) when the config lists them, else from `default_sliding(layer)`; sliding layers get
// `window`, which must then be positive (else an error naming `window_key`).
void parse_layer_types(const ConfigReader& cfg, const std::function<bool(int64_t)>& default_sliding,
                       int64_t window, const std::string& window_key, ModelSpec* s);

// num_nextn_predict_layers (DeepSeek's multi-token prediction; default 1 as in Transformers).
int64_t parse_mtp_layers(const ConfigReader& cfg);

}  // namespace automoe::arch
