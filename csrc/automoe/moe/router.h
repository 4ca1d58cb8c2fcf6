// The MoE router: float32 logits from the hidden states, then scores, top-k and combine weights by
// the router op (ops::router, or its reference: whichever the backend resolved). Softmax (Qwen3,
// Mixtral) or sigmoid with a correction bias and group-limited top-k (DeepSeek-V3, GLM-4.5).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>

#include "automoe/ops/ops.h"

namespace automoe::moe {

struct Routing {
  at::Tensor logits_TE;   // float32 router logits (what the aux loss and users read)
  at::Tensor weights_TK;  // combine weights, in the dtype of x
  at::Tensor idx_TK;      // int64 expert indices, per token in descending selection score
};

using RouterOp = std::function<ops::RouterResult(
    const at::Tensor&, const std::optional<at::Tensor>&, const ops::RouterParams&)>;

// x [T, H], w_router [E, H], bias_E: the correction bias (selection only) or nullopt;
// logit_bias_E: a bias of the router's linear layer (GPT-OSS), part of the logits.
Routing route(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
              const std::optional<at::Tensor>& bias_E, const ops::RouterParams& p,
              const RouterOp& op, const std::optional<at::Tensor>& logit_bias_E = std::nullopt);

// The same scores and combine weights for experts already chosen (idx_TK from an earlier call):
// what a checkpointed layer's recompute uses, so that the backward never re-routes. A deterministic
// `op` (the fused router) is re-run and, when it makes the same choice, its result is taken bit for
// bit; otherwise the weights are gathered from the scores of the given experts.
Routing route_given(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
                    const std::optional<at::Tensor>& bias_E, const ops::RouterParams& p,
                    const at::Tensor& idx_TK, const RouterOp& op, bool deterministic,
                    const std::optional<at::Tensor>& logit_bias_E = std::nullopt);

// Round-robin routing for benchmarks: idx[t, k] = (t*K + k) mod E, weights 1/K; the router logits
// are still computed (and differentiable) so that the router's cost and gradient stay in the step.
Routing route_round_robin(const at::Tensor& x_TH, const at::Tensor& w_router_EH, int64_t top_k);

}  // namespace automoe::moe
