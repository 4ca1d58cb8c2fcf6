// BackendConfig: which implementation runs each component (names follow NeMo AutoModel; see
// DESIGN.md). Values that this build does not implement are refused with the ones it does.
#pragma once

#include <map>
#include <string>

namespace automoe {

enum class AttnBackend { kSdpa, kEager };
enum class ExpertsBackend { kGrouped, kTorchMM, kEager };
enum class LossBackend { kTorch, kFusedLinearCE };

struct BackendConfig {
  AttnBackend attn = AttnBackend::kSdpa;
  ExpertsBackend experts = ExpertsBackend::kGrouped;  // fused ops (ops/ops.h)
  bool fused_rms_norm = true;                         // rms_norm: "fused" | "torch"
  bool fused_rope = true;                             // rope: "fused" | "torch"
  bool fused_swiglu = true;                           // swiglu: "fused" | "torch"
  // "torch": full logits, then cross-entropy; "fused_linear_ce": chunked LM head + loss, and
  // no logits are returned when labels are given (what keeps [T, V] out of memory).
  LossBackend loss = LossBackend::kTorch;
  // Round-robin routing (token t -> experts (t*K + k) mod E, weights 1/K) for performance
  // measurements with perfectly balanced experts, as NeMo AutoModel's benchmarks do.
  bool fake_balanced_gate = false;

  // From {"attn": "sdpa", ...}; an unknown field or value is an automoe::Error naming it and the
  // accepted values; `origin` says where the map came from (a recipe key, a Python argument).
  static BackendConfig from_map(const std::map<std::string, std::string>& fields,
                                const std::string& origin);
  std::map<std::string, std::string> to_map() const;
};

}  // namespace automoe
