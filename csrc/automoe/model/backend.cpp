#include "automoe/model/backend.h"

#include <vector>

#include "automoe/core/error.h"

namespace automoe {
namespace {

// field -> the values this build implements (the first is the default).
const std::map<std::string, std::vector<std::string>>& implemented() {
  static const std::map<std::string, std::vector<std::string>> fields = {
      {"attn", {"sdpa", "eager"}}, {"experts", {"grouped", "eager"}},
      {"rms_norm", {"torch"}},     {"rope", {"torch"}},
      {"swiglu", {"torch"}},       {"loss", {"torch"}},
      {"dispatcher", {"local"}},   {"fake_balanced_gate", {"false", "true"}},
  };
  return fields;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

BackendConfig BackendConfig::from_map(const std::map<std::string, std::string>& fields,
                                      const std::string& origin) {
  BackendConfig cfg;
  for (const auto& [key, value] : fields) {
    auto it = implemented().find(key);
    if (it == implemented().end()) {
      std::vector<std::string> names;
      for (const auto& [k, _] : implemented()) names.push_back(k);
      fail(origin, ": unknown backend field \"", key, "\" (known: ", join(names), ")");
    }
    const auto& values = it->second;
    if (std::find(values.begin(), values.end(), value) == values.end()) {
      fail(origin, ": backend ", key, "=\"", value,
           "\" is not implemented in this build (available: ", join(values), ")");
    }
    if (key == "attn") cfg.attn = value == "eager" ? AttnBackend::kEager : AttnBackend::kSdpa;
    if (key == "fake_balanced_gate") cfg.fake_balanced_gate = value == "true";
    if (key == "experts") {
      cfg.experts = value == "eager" ? ExpertsBackend::kEager : ExpertsBackend::kGrouped;
    }
  }
  return cfg;
}

std::map<std::string, std::string> BackendConfig::to_map() const {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : implemented()) out[k] = v.front();
  out["attn"] = attn == AttnBackend::kEager ? "eager" : "sdpa";
  out["experts"] = experts == ExpertsBackend::kEager ? "eager" : "grouped";
  out["fake_balanced_gate"] = fake_balanced_gate ? "true" : "false";
  return out;
}

}  // namespace automoe
