// `automoe export ADAPTER OUT --merge [--base DIR]`: a PEFT LoRA adapter directory (ours, or one
// PEFT wrote for Transformers' model) merged into its base model, written as a full Hugging Face
// checkpoint that Transformers, vLLM and SGLang load without PEFT.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "automoe/cli/commands.h"
#include "automoe/core/dtype.h"
#include "automoe/core/error.h"
#include "automoe/model/checkpoint.h"
#include "automoe/model/lora.h"

namespace automoe::cli {

int export_adapter(const Args& args) {
  constexpr const char* kUsage =
      "usage: automoe export ADAPTER_DIR OUT_DIR --merge [--base MODEL_DIR] [--dtype NAME] "
      "[--layout source|per-expert|fused]";
  namespace fs = std::filesystem;
  std::vector<std::string> positional;
  std::optional<std::string> base;
  std::optional<c10::ScalarType> dtype;
  std::optional<ExpertsLayout> layout;
  bool merge = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      AUTOMOE_CHECK(i + 1 < args.size(), a, " needs a value; ", kUsage);
      return args[++i];
    };
    if (a == "--merge") {
      merge = true;
    } else if (a == "--base") {
      base = value();
    } else if (a == "--dtype") {
      dtype = dtype_from_name(value(), "--dtype");
    } else if (a == "--layout") {
      const std::string& v = value();
      if (v != "source") layout = layout_from_string(v, "--layout");
    } else if (a == "-h" || a == "--help") {
      std::cout << kUsage << "\n";
      return 0;
    } else if (a.rfind("--", 0) == 0) {
      fail("unknown option ", a, "; ", kUsage);
    } else {
      positional.push_back(a);
    }
  }
  AUTOMOE_CHECK(positional.size() == 2, kUsage);
  AUTOMOE_CHECK(merge, "automoe export: --merge is required (the adapter is merged into its base "
                "model); ", kUsage);
  const std::string& adapter = positional[0];
  const fs::path cfg_path = fs::path(adapter) / "adapter_config.json";
  AUTOMOE_CHECK(fs::exists(cfg_path), adapter, ": no adapter_config.json (not a PEFT adapter directory)");
  if (!base) {
    std::ifstream f(cfg_path);
    std::stringstream ss;
    ss << f.rdbuf();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(ss.str());
    } catch (const nlohmann::json::exception& e) {
      fail(cfg_path.string(), ": not valid JSON (", e.what(), ")");
    }
    const auto named = j.value("base_model_name_or_path", nlohmann::json(nullptr));
    AUTOMOE_CHECK(named.is_string() && fs::is_directory(named.get<std::string>()), cfg_path.string(),
                  ": base_model_name_or_path ", named.dump(),
                  " is not a local model directory; pass the base model with --base DIR");
    base = named.get<std::string>();
  }
  const PretrainedModel model = load_pretrained(*base, dtype);
  LoraConfig config;
  const std::vector<LoraSite> sites = read_peft_adapter(adapter, model.decoder->spec(), &config);
  // (a base whose experts bitsandbytes quantised merges dequantised: bitsandbytes' values + ΔW)
  NamedTensors merged;
  const NamedTensors& params = model.decoder->named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    merged.emplace_back(params[i].first, model.decoder->dense(static_cast<int64_t>(i)));
  }
  if (model.decoder->has_quantized()) {
    std::cerr << "automoe export: the base's experts are stored " << model.config.spec.bnb_quantized
              << ": the merged experts are their dequantised values plus the adapters' product\n";
  }
  for (const auto& site : sites) merged[site.slot].second = merge_lora(site, merged[site.slot].second);
  SaveOptions o;
  o.layout = layout;
  o.tensors = std::move(merged);
  save_pretrained(model, positional[1], o);
  int64_t experts = 0;
  for (const auto& s : sites) experts += s.experts;
  std::cout << "wrote " << positional[1] << ": " << *base << " with " << sites.size()
            << " LoRA adapters merged (" << experts << " on routed experts) from " << adapter << "\n";
  return 0;
}

}  // namespace automoe::cli
