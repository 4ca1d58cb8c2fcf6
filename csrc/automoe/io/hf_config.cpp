#include "automoe/io/hf_config.h"

#include <nlohmann/json.hpp>
#include <sstream>

#include "automoe/core/error.h"

namespace automoe {

using nlohmann::json;

ConfigReader::ConfigReader(std::shared_ptr<const json> j, std::string path)
    : json_(std::move(j)), node_(json_.get()), path_(std::move(path)) {
  AUTOMOE_CHECK(node_->is_object(), path_, ": expected a JSON object, found ", node_->type_name());
}

const json* ConfigReader::find(const std::string& key) const {
  auto it = node_->find(key);
  if (it == node_->end() || it->is_null()) return nullptr;
  return &*it;
}

void ConfigReader::fail_key(const std::string& key, const std::string& expected) const {
  const json* v = find(key);
  fail(path_, ": key \"", prefix_, key, "\": expected ", expected, ", found ",
       v ? v->dump() : std::string("nothing (key missing)"));
}

bool ConfigReader::has(const std::string& key) const { return find(key) != nullptr; }

bool ConfigReader::is_null(const std::string& key) const {
  auto it = node_->find(key);
  return it != node_->end() && it->is_null();
}

bool ConfigReader::get_flag(const std::string& key, bool fallback) const {
  return is_null(key) ? false : get_bool(key, fallback);
}

int64_t ConfigReader::get_int(const std::string& key) const {
  const json* v = find(key);
  if (!v || !v->is_number_integer()) fail_key(key, "an integer");
  // Every integer a model config holds (sizes, counts, token ids) is far below 2^31; bounding them
  // here keeps every product of two of them inside int64.
  const bool fits = v->is_number_unsigned() ? v->get<uint64_t>() <= uint64_t{INT32_MAX}
                                            : v->get<int64_t>() >= INT32_MIN && v->get<int64_t>() <= INT32_MAX;
  if (!fits) fail_key(key, "an integer of magnitude below 2^31");
  return v->get<int64_t>();
}

int64_t ConfigReader::get_int(const std::string& key, int64_t fallback) const {
  return has(key) ? get_int(key) : fallback;
}

double ConfigReader::get_double(const std::string& key) const {
  const json* v = find(key);
  if (!v || !v->is_number()) fail_key(key, "a number");
  return v->get<double>();
}

double ConfigReader::get_double(const std::string& key, double fallback) const {
  return has(key) ? get_double(key) : fallback;
}

bool ConfigReader::get_bool(const std::string& key, bool fallback) const {
  const json* v = find(key);
  if (!v) return fallback;
  if (!v->is_boolean()) fail_key(key, "true or false");
  return v->get<bool>();
}

std::string ConfigReader::get_string(const std::string& key) const {
  const json* v = find(key);
  if (!v || !v->is_string()) fail_key(key, "a string");
  return v->get<std::string>();
}

std::string ConfigReader::get_string(const std::string& key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}

std::vector<int64_t> ConfigReader::get_int_list(const std::string& key) const {
  const json* v = find(key);
  if (!v) return {};
  if (!v->is_array()) fail_key(key, "a list of integers");
  std::vector<int64_t> out;
  for (const auto& x : *v) {
    if (!x.is_number_integer()) fail_key(key, "a list of integers");
    out.push_back(x.get<int64_t>());
  }
  return out;
}

std::string ConfigReader::first_present(const std::vector<std::string>& keys) const {
  for (const auto& k : keys) {
    if (has(k)) return k;
  }
  std::ostringstream names;
  for (size_t i = 0; i < keys.size(); ++i)
    names << (i ? " or \"" : "\"") << prefix_ << keys[i] << "\"";
  fail(path_, ": missing key ", names.str());
}

ConfigReader ConfigReader::child(const std::string& key) const {
  const json* v = find(key);
  if (!v || !v->is_object()) fail_key(key, "an object");
  ConfigReader r = *this;
  r.node_ = v;
  r.prefix_ = prefix_ + key + ".";
  return r;
}

}  // namespace automoe
