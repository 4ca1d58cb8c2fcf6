// GPT-OSS (model_type "gpt_oss"): GQA attention with biases and a learned sink logit per head,
// sliding and full attention alternating by layer_types, YaRN RoPE (half-split); MoE on every layer:
// a router with a bias whose top-k logits are softmaxed (= softmax, top-k, renormalise), experts
// stored transposed with gate/up interleaved and biases, and the clamped SwiGLU. One on-disk layout
// (Transformers keeps the in-memory names). The released MXFP4 experts (`*_blocks` + `*_scales`,
// quantization_config quant_method "mxfp4") are dequantised on load, as Transformers does on CPUs.
#include <nlohmann/json.hpp>

#include "automoe/model/arch/common.h"
#include "automoe/model/arch/registry.h"

namespace automoe {
namespace {

ModelSpec parse_gpt_oss(const ConfigReader& given) {
  auto json = std::make_shared<nlohmann::json>(given.raw());
  // The released checkpoints' MXFP4 experts are dequantised on load; any other quantization is
  // refused (by reject_unsupported, naming the key).
  bool mxfp4 = false;
  if (given.has("quantization_config")) {
    const ConfigReader q = given.child("quantization_config");
    if (q.get_string("quant_method", "") == "mxfp4") {
      mxfp4 = true;
      json->erase("quantization_config");
    }
  }
  arch::reject_unsupported(ConfigReader(json, given.path()));
  // GptOssConfig's RoPE when a config has none: YaRN, factor 32 over 4096 positions, no truncation.
  if (!given.has("rope_parameters") && !given.has("rope_scaling")) {
    (*json)["rope_parameters"] = {{"rope_type", "yarn"},   {"factor", 32.0},
                                  {"beta_fast", 32.0},     {"beta_slow", 1.0},
                                  {"truncate", false},     {"original_max_position_embeddings", 4096}};
  }
  const ConfigReader cfg(json, given.path());
  arch::Defaults d;  // GptOssConfig's
  d.max_position_embeddings = 131072;
  d.rms_norm_eps = 1e-5;
  ModelSpec s;
  s.model_type = "gpt_oss";
  arch::parse_decoder_basics(cfg, d, &s);
  AttentionSpec& a = s.attn;
  a.num_heads = arch::positive(cfg, "num_attention_heads");
  // Absent: GptOssConfig's defaults; null: what its __post_init__ / attention make of it.
  a.num_kv_heads = cfg.is_null("num_key_value_heads")
                       ? a.num_heads
                       : arch::positive(cfg, "num_key_value_heads", 8);
  if (a.num_heads % a.num_kv_heads != 0) {
    cfg.fail_key("num_key_value_heads",
                 "a divisor of num_attention_heads (" + std::to_string(a.num_heads) + ")");
  }
  a.head_dim = cfg.is_null("head_dim") ? s.hidden_size / a.num_heads
                                       : arch::positive(cfg, "head_dim", 64);
  a.qkv_bias = a.o_bias = cfg.get_bool("attention_bias", true);
  a.sinks = true;
  s.rope = arch::parse_rope(cfg, a.head_dim, "head_dim", /*partial_default=*/0,
                            s.max_position_embeddings, /*theta_default=*/150000.0);
  s.intermediate_size = arch::positive(cfg, "intermediate_size");
  arch::parse_softmax_moe(cfg, "num_local_experts", "intermediate_size", /*norm_default=*/true,
                          /*aux_default=*/0.001, &s);
  if (s.num_moe_layers() != s.num_layers) {
    cfg.fail_key("num_local_experts", "a positive expert count (every GPT-OSS layer is MoE)");
  }
  s.moe.norm_topk_prob = true;  // softmax over the top-k logits
  s.moe.gpt_oss = true;
  s.mxfp4_experts = mxfp4;

  // layer_types, or GptOssConfig's default: sliding on even layers, 128 wide.
  const bool no_window = cfg.is_null("sliding_window");
  const int64_t window = no_window ? 0 : arch::positive(cfg, "sliding_window", 128);
  arch::parse_layer_types(cfg, [](int64_t l) { return (l + 1) % 2 == 1; }, window,
                          "sliding_window", &s);
  return s;
}

}  // namespace

Architecture gpt_oss_architecture() {
  return Architecture{"gpt_oss", "GptOssForCausalLM", &parse_gpt_oss, /*per_expert_rules=*/{},
                      /*renames=*/{}};
}

}  // namespace automoe
