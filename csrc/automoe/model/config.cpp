#include "automoe/model/config.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "automoe/core/error.h"
#include "automoe/io/safetensors.h"
#include "automoe/model/arch/registry.h"

namespace automoe {

using nlohmann::json;

namespace {

// quantization_config's bitsandbytes format ("nf4", "fp4", "int8"), or "" when the config has no
// bitsandbytes quantization (any other quant_method is left for the architecture to refuse).
std::string bnb_quantization(const ConfigReader& cfg) {
  if (!cfg.has("quantization_config")) return "";
  const ConfigReader q = cfg.child("quantization_config");
  if (q.get_string("quant_method", "") != "bitsandbytes") return "";
  const bool four = q.get_bool("load_in_4bit", false) || q.get_bool("_load_in_4bit", false);
  const bool eight = q.get_bool("load_in_8bit", false) || q.get_bool("_load_in_8bit", false);
  if (four == eight) {
    q.fail_key("load_in_4bit", "exactly one of load_in_4bit and load_in_8bit true (bitsandbytes)");
  }
  if (eight) return "int8";
  const std::string type = q.get_string("bnb_4bit_quant_type", "fp4");
  if (type != "nf4" && type != "fp4") q.fail_key("bnb_4bit_quant_type", "\"nf4\" or \"fp4\"");
  const std::string storage = q.get_string("bnb_4bit_quant_storage", "uint8");
  if (storage != "uint8") {
    q.fail_key("bnb_4bit_quant_storage", "\"uint8\" (codes packed in another dtype are not supported)");
  }
  return type;
}

}  // namespace

LoadedConfig parse_config(const std::string& text, const std::string& origin) {
  auto j = std::make_shared<json>();
  try {
    *j = json::parse(text);
  } catch (const json::exception& e) {
    fail(origin, ": not valid JSON: ", e.what());
  }
  ConfigReader cfg(j, origin);
  const std::string model_type = cfg.get_string("model_type");
  const Architecture& arch = find_architecture(model_type, origin);
  // bitsandbytes' quantization (io/bnb.h) is the checkpoint's storage, not the architecture's:
  // the architecture parses the config without it.
  const std::string bnb = bnb_quantization(cfg);
  if (bnb.empty()) return LoadedConfig{arch.parse(cfg), j, origin};
  auto plain = std::make_shared<json>(*j);
  plain->erase("quantization_config");
  LoadedConfig out{arch.parse(ConfigReader(plain, origin)), j, origin};
  out.spec.bnb_quantized = bnb;
  return out;
}

LoadedConfig load_config(const std::string& dir_or_file) {
  namespace fs = std::filesystem;
  fs::path p(dir_or_file);
  if (fs::is_directory(p)) p /= "config.json";
  std::ifstream in(p);
  AUTOMOE_CHECK(in.good(), p.string(), ": cannot open config (",
                fs::exists(p) ? "unreadable" : "no such file", ")");
  std::stringstream ss;
  ss << in.rdbuf();
  LoadedConfig out = parse_config(ss.str(), p.string());
  const fs::path dir = p.parent_path();
  if (!out.spec.bnb_quantized.empty() &&
      (fs::exists(dir / "model.safetensors.index.json") || fs::exists(dir / "model.safetensors"))) {
    const SafetensorsCheckpoint ckpt(dir.string());
    for (const std::string& name : ckpt.names()) {
      if (name.find(".experts.") == std::string::npos) continue;
      if (name.find(".quant_state.bitsandbytes__") != std::string::npos ||
          name.size() > 4 && name.compare(name.size() - 4, 4, ".SCB") == 0) {
        out.spec.bnb_quantized_experts = true;
        break;
      }
    }
  }
  return out;
}

}  // namespace automoe
