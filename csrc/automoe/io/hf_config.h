// Reading a Hugging Face config.json: typed, key-checked access. (model/config.h turns a config
// into a ModelSpec through the architecture registry.)
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>


namespace automoe {

// Typed getters over one config.json; every error names the file and the key, what was expected
// and what was found.
class ConfigReader {
 public:
  ConfigReader(std::shared_ptr<const nlohmann::json> json, std::string path);

  const std::string& path() const { return path_; }
  bool has(const std::string& key) const;  // present and not null
  bool is_null(const std::string& key) const;  // present with the value null
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_double(const std::string& key) const;
  double get_double(const std::string& key, double fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
  // A `bool | None` setting Transformers tests for truthiness: absent -> fallback, null -> false.
  bool get_flag(const std::string& key, bool fallback) const;
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  std::vector<int64_t> get_int_list(const std::string& key) const;  // missing/null -> {}
  // The first of `keys` that is present; throws naming all of them when none is.
  std::string first_present(const std::vector<std::string>& keys) const;
  const nlohmann::json& raw() const { return *json_; }
  std::shared_ptr<const nlohmann::json> shared() const { return json_; }
  // A reader over a nested object (e.g. "rope_parameters"), errors still naming this file.
  ConfigReader child(const std::string& key) const;

  [[noreturn]] void fail_key(const std::string& key, const std::string& expected) const;

 private:
  const nlohmann::json* find(const std::string& key) const;
  std::shared_ptr<const nlohmann::json> json_;
  const nlohmann::json* node_;  // the object this reader looks at (root or a child)
  std::string path_;
  std::string prefix_;  // "rope_parameters." for a child reader
};

}  // namespace automoe
