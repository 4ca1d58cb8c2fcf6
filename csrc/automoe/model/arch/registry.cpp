#include "automoe/model/arch/registry.h"

#include <sstream>

#include "automoe/core/error.h"

namespace automoe {
namespace {

const std::vector<Architecture>& all() {
  static const std::vector<Architecture> archs = [] {
    // Kimi-K2's config.json says "kimi_k2" (for its remote code); the model is DeepSeek-V3's.
    Architecture kimi_k2 = deepseek_v3_architecture();
    kimi_k2.model_type = "kimi_k2";
    return std::vector<Architecture>{qwen3_moe_architecture(), deepseek_v3_architecture(),
                                     glm4_moe_architecture(), kimi_k2, mixtral_architecture(),
                                     qwen2_moe_architecture(), olmoe_architecture(),
                                     gpt_oss_architecture(), nemotron_h_architecture(),
                                     qwen3_next_architecture(), qwen3_5_moe_text_architecture(),
                                     qwen3_5_moe_architecture()};
  }();
  return archs;
}

}  // namespace

std::vector<WeightRule> qwen2_moe_expert_rules() {
  return {
      {"mlp.experts.gate_up_proj",
       {"mlp.experts.{E}.gate_proj.weight", "mlp.experts.{E}.up_proj.weight"},
       /*concat_dim=*/1,
       std::nullopt},
      {"mlp.experts.down_proj", {"mlp.experts.{E}.down_proj.weight"}, 0, std::nullopt},
  };
}

std::vector<std::string> supported_model_types() {
  std::vector<std::string> out;
  for (const auto& a : all()) out.push_back(a.model_type);
  return out;
}

const Architecture& find_architecture(const std::string& model_type, const std::string& origin) {
  for (const auto& a : all()) {
    if (a.model_type == model_type) return a;
  }
  std::ostringstream names;
  for (const auto& t : supported_model_types()) names << (names.tellp() > 0 ? ", " : "") << t;
  fail(origin, ": model_type \"", model_type,
       "\" is not implemented by AutoMoE (supported: ", names.str(), ")");
}

}  // namespace automoe
