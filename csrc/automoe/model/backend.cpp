#include "automoe/model/backend.h"

#include <vector>

#include "automoe/core/error.h"

namespace automoe {
namespace {

// field -> the values this build implements (the first is the default).
const std::map<std::string, std::vector<std::string>>& implemented() {
  static const std::map<std::string, std::vector<std::string>> fields = {
      {"attn", {"sdpa", "eager"}},      {"experts", {"grouped", "torch_mm", "eager"}},
      {"rms_norm", {"fused", "torch"}}, {"rope", {"fused", "torch"}},
      {"swiglu", {"fused", "torch"}},   {"loss", {"torch", "fused_linear_ce"}},
      {"dispatcher", {"local"}},        {"fake_balanced_gate", {"false", "true"}},
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
      cfg.experts = value == "eager"      ? ExpertsBackend::kEager
                    : value == "torch_mm" ? ExpertsBackend::kTorchMM
                                          : ExpertsBackend::kGrouped;
    }
    if (key == "rms_norm") cfg.fused_rms_norm = value == "fused";
    if (key == "rope") cfg.fused_rope = value == "fused";
    if (key == "swiglu") cfg.fused_swiglu = value == "fused";
    if (key == "loss") {
      cfg.loss = value == "fused_linear_ce" ? LossBackend::kFusedLinearCE : LossBackend::kTorch;
    }
  }
  return cfg;
}

std::map<std::string, std::string> BackendConfig::to_map() const {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : implemented()) out[k] = v.front();
  out["attn"] = attn == AttnBackend::kEager ? "eager" : "sdpa";
  out["experts"] = experts == ExpertsBackend::kEager     ? "eager"
                   : experts == ExpertsBackend::kTorchMM ? "torch_mm"
                                                         : "grouped";
  out["rms_norm"] = fused_rms_norm ? "fused" : "torch";
  out["rope"] = fused_rope ? "fused" : "torch";
  out["swiglu"] = fused_swiglu ? "fused" : "torch";
  out["loss"] = loss == LossBackend::kFusedLinearCE ? "fused_linear_ce" : "torch";
  out["fake_balanced_gate"] = fake_balanced_gate ? "true" : "false";
  return out;
}

}  // namespace automoe
