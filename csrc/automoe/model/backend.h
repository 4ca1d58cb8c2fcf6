// BackendConfig: which implementation runs each component (names follow NeMo AutoModel; see
// DESIGN.md). Values that this build does not implement are refused with the ones it does.
#pragma once

#include <map>
#include <string>

namespace automoe {

enum class AttnBackend { kSdpa, kEager };
enum class ExpertsBackend { kEager };

struct BackendConfig {
  AttnBackend attn = AttnBackend::kSdpa;
  ExpertsBackend experts = ExpertsBackend::kEager;

  // From {"attn": "sdpa", ...}; an unknown field or value is an automoe::Error naming it and the
  // accepted values; `origin` says where the map came from (a recipe key, a Python argument).
  static BackendConfig from_map(const std::map<std::string, std::string>& fields,
                                const std::string& origin);
  std::map<std::string, std::string> to_map() const;
};

}  // namespace automoe
