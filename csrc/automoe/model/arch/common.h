// Config helpers every architecture file shares: the fields most decoders spell alike, the RoPE
// block (default, linear, YaRN, partial rotary), DeepSeek-style routing, refusals of math we do not
// implement. An architecture file calls these and fills in what is its own.
#pragma once

#include <cstdint>
#include <string>

#include "automoe/io/hf_config.h"
#include "automoe/model/spec.h"

namespace automoe::arch {

// cfg[key] as an integer > 0 (an error naming the key otherwise); `fallback` when absent, if given.
int64_t positive(const ConfigReader& cfg, const std::string& key);
int64_t positive(const ConfigReader& cfg, const std::string& key, int64_t fallback);

// quantization_config (FP8 block-quantised checkpoints and the like), attention dropout and
// activations other than SiLU are refused by name.
void reject_unsupported(const ConfigReader& cfg);

// vocab_size, hidden_size, num_hidden_layers, max_position_embeddings, rms_norm_eps,
// tie_word_embeddings, pad_token_id, dtype / torch_dtype.
void parse_decoder_basics(const ConfigReader& cfg, ModelSpec* s);

// num_attention_heads, num_key_value_heads (default `kv_default`, 0: = heads), head_dim (default
// hidden_size / heads) for grouped-query attention.
void parse_gqa(const ConfigReader& cfg, int64_t kv_default, ModelSpec* s);

// rope_parameters (v5) or rope_theta + rope_scaling (v4): default, linear or YaRN, over a head's
// rotary part of `rope_head_dim`, of which partial_rotary_factor (rope_parameters or top level)
// rotates the first share. `partial_default`: the factor when the config has none; 0: this type
// rotates whole heads (a factor other than 1 is refused).
RopeSpec parse_rope(const ConfigReader& cfg, int64_t rope_head_dim, double partial_default);

// YaRN's mscale(factor, m) = 0.1 * m * ln(factor) + 1 (1 for factor <= 1).
double yarn_mscale(double factor, double m);

// DeepSeek-V3-style MoE (also GLM-4.5): n_routed_experts, num_experts_per_tok,
// moe_intermediate_size, sigmoid scores with e_score_correction_bias, n_group / topk_group,
// norm_topk_prob, routed_scaling_factor, n_shared_experts; first_k_dense_replace dense layers.
void parse_deepseek_moe(const ConfigReader& cfg, ModelSpec* s);

}  // namespace automoe::arch
