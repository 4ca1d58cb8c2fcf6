#include "automoe/model/config.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "automoe/core/error.h"
#include "automoe/model/arch/registry.h"

namespace automoe {

using nlohmann::json;

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
  LoadedConfig out{arch.parse(cfg), j, origin};
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
  return parse_config(ss.str(), p.string());
}

}  // namespace automoe
