// BackendConfig: which implementation runs each component (names follow NeMo AutoModel; see
// DESIGN.md). Values that this build does not implement are refused with the ones it does.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <optional>
#include <string>

#include "automoe/moe/experts.h"
#include "automoe/ops/delta_rule/delta_rule.h"
#include "automoe/ops/ops.h"

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
  bool fused_mamba = true;  // mamba: "fused" (conv1d + gated norm kernels) | "torch" (references)
  // The dense linear layers (attention projections, dense MLPs, shared experts): "auto"
  // (ops::linear: the CPU GEMM engine for bf16 where ATen's bf16 GEMM is not native, at::linear
  // elsewhere) | "torch" (at::linear always).
  bool engine_linear = true;
  // "torch": full logits, then cross-entropy; "fused_linear_ce": chunked LM head + loss, and
  // no logits are returned when labels are given (what keeps [T, V] out of memory).
  LossBackend loss = LossBackend::kTorch;
  // Round-robin routing (token t -> experts (t*K + k) mod E, weights 1/K) for performance
  // measurements with perfectly balanced experts, as NeMo AutoModel's benchmarks do.
  bool fake_balanced_gate = false;
  // How tokens reach the experts of other ranks under expert parallelism (moe/dispatcher.h):
  // "allgather", "alltoall", "alltoall_overlap"; "local" (no exchange) needs ep = 1; "auto":
  // local at ep = 1, alltoall otherwise.
  std::string dispatcher = "auto";

  // From {"attn": "sdpa", ...}; an unknown field or value is an automoe::Error naming it and the
  // accepted values; `origin` says where the map came from (a recipe key, a Python argument).
  static BackendConfig from_map(const std::map<std::string, std::string>& fields,
                                const std::string& origin);
  std::map<std::string, std::string> to_map() const;
};

// The functions the components call, resolved once from a BackendConfig (Decoder holds one; the
// forward has no backend branches). Each is an op of ops/ops.h or its reference.
struct ComponentOps {
  // y = RMSNorm(x) * weight; mixed dtypes (autocast) take the reference, which promotes as
  // Transformers' RMSNorm does.
  std::function<at::Tensor(const at::Tensor& x, const at::Tensor& weight, double eps)> rms_norm;
  // x [B, S, N, D] rotated by half-angle tables [B, S, D/2] (ops::rope / ops::rope_reference).
  std::function<at::Tensor(const at::Tensor& x_BSND, const at::Tensor& cos_BSh,
                           const at::Tensor& sin_BSh, bool interleaved)>
      rope;
  // y = x·wᵀ (+ bias): every dense linear layer (ops::linear or at::linear).
  std::function<at::Tensor(const at::Tensor& x, const at::Tensor& w,
                           const std::optional<at::Tensor>& bias)>
      linear;
  // down(silu(gate(x)) * up(x)): the dense MLP and the shared experts.
  std::function<at::Tensor(const at::Tensor& x, const at::Tensor& w_gate, const at::Tensor& w_up,
                           const at::Tensor& w_down)>
      mlp;
  // The routed experts (moe/experts.h), fused weights [E, 2I, H] and [E, H, I], and their LoRA
  // adapters (null: none).
  std::function<at::Tensor(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                           const at::Tensor& weights_TK, const at::Tensor& w_gate_up,
                           const at::Tensor& w_down, const moe::ExpertLora* lora,
                           moe::ExpertMlp mlp)>
      experts;
  // GPT-OSS's experts (moe/experts.h experts_gpt_oss): transposed, interleaved, with biases; the
  // last argument is autocast's dtype (nullopt: the inputs').
  std::function<at::Tensor(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                           const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EHI2,
                           const at::Tensor& b_gate_up, const at::Tensor& w_down_EIH,
                           const at::Tensor& b_down, std::optional<c10::ScalarType> compute_dtype)>
      gpt_oss_experts;
  // Scores, top-k and combine weights from float32 router logits (ops::router / _reference).
  std::function<ops::RouterResult(const at::Tensor& logits_TE, const std::optional<at::Tensor>& bias_E,
                                  const ops::RouterParams& p)>
      router;
  bool router_fused = false;  // whether `router` is the fused op (deterministic: re-run to recompute)
  // Attention core over [B, N, S, D] queries and [B, N_kv, S_kv, D] keys / values (N_kv divides N):
  // sdpa (a bool mask or is_causal) or eager (an additive mask), as Transformers' interfaces.
  // `sinks` [N] (GPT-OSS): a per-head logit joining each query's softmax, then dropped (eager only).
  std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const std::optional<at::Tensor>& mask, bool is_causal, double scale,
                           const std::optional<at::Tensor>& sinks)>
      attention;
  bool eager_attention = false;  // masks are additive (eager) rather than bool (sdpa)
  // Mamba-2's depthwise causal conv1d (+ SiLU) over channels-last [B, S, C] and its gated grouped
  // RMSNorm (ops/mamba/mamba.h): the fused ops or their references.
  std::function<at::Tensor(const at::Tensor& x_BSC, const at::Tensor& w_CK,
                           const std::optional<at::Tensor>& bias_C,
                           const std::optional<at::Tensor>& doc_BS, bool silu)>
      causal_conv1d;
  std::function<at::Tensor(const at::Tensor& y, const at::Tensor& z, const at::Tensor& weight,
                           int64_t group_size, double eps)>
      gated_rms_norm;
  // Gated DeltaNet's chunked gated delta rule (ops/delta_rule/delta_rule.h): the fused op (hand-
  // derived backward) or the reference, with the mamba choice.
  std::function<ops::DeltaRule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& g, const at::Tensor& beta, int64_t chunk,
                               const std::optional<at::Tensor>& initial,
                               const std::optional<at::Tensor>& doc, bool final_state)>
      delta_rule;
  // true: the LM head and the loss run fused (ops::linear_cross_entropy) and no logits are formed.
  bool fused_loss = false;
};

ComponentOps resolve(const BackendConfig& backend);

}  // namespace automoe
