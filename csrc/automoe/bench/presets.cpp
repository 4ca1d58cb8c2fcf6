#include "automoe/bench/presets.h"

#include <nlohmann/json.hpp>
#include <regex>

#include "automoe/core/error.h"

namespace automoe::bench {
namespace {

nlohmann::json qwen3_moe(int64_t layers, int64_t hidden, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, int64_t experts, int64_t top_k, int64_t moe_inter,
                         int64_t vocab) {
  return {{"model_type", "qwen3_moe"},
          {"architectures", {"Qwen3MoeForCausalLM"}},
          {"vocab_size", vocab},
          {"hidden_size", hidden},
          {"intermediate_size", 3 * hidden},
          {"moe_intermediate_size", moe_inter},
          {"num_hidden_layers", layers},
          {"num_attention_heads", heads},
          {"num_key_value_heads", kv_heads},
          {"head_dim", head_dim},
          {"num_experts", experts},
          {"num_experts_per_tok", top_k},
          {"norm_topk_prob", true},
          {"decoder_sparse_step", 1},
          {"mlp_only_layers", nlohmann::json::array()},
          {"max_position_embeddings", 40960},
          {"rms_norm_eps", 1e-6},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000000.0}}},
          {"router_aux_loss_coef", 0.001},
          {"tie_word_embeddings", false},
          {"dtype", "bfloat16"}};
}

}  // namespace

std::vector<std::string> preset_names() {
  return {"cpu-small", "cpu-medium", "qwen3-30b-a3b-L{n}"};
}

std::string preset_config_json(const std::string& name) {
  nlohmann::json cfg;
  std::smatch m;
  static const std::regex kQwen30b("qwen3-30b-a3b-L([0-9]+)");
  if (name == "cpu-small") {
    cfg = qwen3_moe(/*layers=*/4, /*hidden=*/256, 8, 2, 32, /*experts=*/16, /*top_k=*/4,
                    /*moe_inter=*/128, /*vocab=*/8192);
  } else if (name == "cpu-medium") {
    cfg = qwen3_moe(8, 512, 8, 2, 64, 32, 4, 256, 16384);
  } else if (std::regex_match(name, m, kQwen30b)) {
    const int64_t layers = std::stoll(m[1].str());
    AUTOMOE_CHECK(layers >= 1 && layers <= 48, "preset ", name,
                  ": Qwen3-30B-A3B has 48 layers; expected L1..L48");
    cfg = qwen3_moe(layers, 2048, 32, 4, 128, 128, 8, 768, 151936);
    cfg["intermediate_size"] = 6144;
  } else {
    std::string known;
    for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
    fail("unknown bench preset \"", name, "\" (known: ", known, ")");
  }
  return cfg.dump(2);
}

}  // namespace automoe::bench
