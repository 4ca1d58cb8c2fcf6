// config.json -> ModelSpec: the architecture its model_type names parses it (model/arch/).
#pragma once

#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "automoe/io/hf_config.h"
#include "automoe/model/spec.h"

namespace automoe {

// Parses `<dir>/config.json` (or a config.json path) and the architecture its model_type names.
struct LoadedConfig {
  ModelSpec spec;
  std::shared_ptr<const nlohmann::json> json;  // the config as read, kept to write it back on save
  std::string path;
};
LoadedConfig load_config(const std::string& dir_or_file);
// The same from JSON text (what tests and the Python front use); `origin` names it in errors.
LoadedConfig parse_config(const std::string& json_text, const std::string& origin);

}  // namespace automoe
