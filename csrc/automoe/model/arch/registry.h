// The architectures AutoMoE implements. Each one is a file under model/arch/ that maps its
// config.json to a ModelSpec and declares its checkpoint weight rules; nothing else is per-model.
#pragma once

#include <string>
#include <vector>

#include "automoe/io/weight_rules.h"
#include "automoe/model/spec.h"

namespace automoe {

class ConfigReader;

struct Architecture {
  std::string model_type;                       // config.json "model_type"
  std::string hf_class;                         // e.g. "Qwen3MoeForCausalLM"
  ModelSpec (*parse)(const ConfigReader& cfg);  // throws automoe::Error on unsupported values
  // Rules between the fused in-memory experts and the per-expert on-disk layout.
  std::vector<WeightRule> per_expert_rules;
  // Tensors stored under another name than Transformers' in-memory one, in the original
  // (per-expert) format only: the fused one keeps the in-memory names, as Transformers v5.
  std::vector<RenameRule> renames;
  // A vision-language checkpoint keeps the language model under another prefix (Qwen3.5's
  // "model.language_model." for the in-memory "model."): used, in either layout, when the
  // checkpoint's tensors are stored that way (as Transformers' PrefixChange reads them); saves
  // write the in-memory names (the language model alone).
  std::string container_prefix;
  // Tensors of such a checkpoint that the causal LM does not use (the vision tower), skipped on
  // load with one message, as Transformers' causal-LM class skips them.
  std::vector<std::string> skipped_prefixes;
};

// Qwen2-MoE's per-expert layout (`mlp.experts.{E}.gate_proj.weight`, ...), which Transformers
// also reads for Qwen3-MoE, DeepSeek-V3, GLM-4.5 and others.
std::vector<WeightRule> qwen2_moe_expert_rules();

// Throws automoe::Error naming the supported model types when `model_type` is not one of them.
const Architecture& find_architecture(const std::string& model_type, const std::string& origin);
std::vector<std::string> supported_model_types();

// Per-architecture registration functions (one per file under arch/).
Architecture qwen3_moe_architecture();
Architecture deepseek_v3_architecture();
Architecture glm4_moe_architecture();
Architecture mixtral_architecture();
Architecture olmoe_architecture();
Architecture qwen2_moe_architecture();
Architecture gpt_oss_architecture();
Architecture nemotron_h_architecture();
Architecture qwen3_next_architecture();
Architecture qwen3_5_moe_text_architecture();
Architecture qwen3_5_moe_architecture();

}  // namespace automoe
