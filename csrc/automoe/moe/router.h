// Top-k softmax router. Logits, softmax and top-k run in float32 whatever the model dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include "automoe/model/spec.h"

namespace automoe::moe {

struct Routing {
  at::Tensor logits_TE;   // float32 router logits (what the aux loss and users read)
  at::Tensor weights_TK;  // combine weights, in the dtype of x
  at::Tensor idx_TK;      // int64 expert indices, per token in descending score order
};

// x [T, H], w_router [E, H]. `fused`: scores, top-k and weights by the fused router op
// (ops::router, one pass per token); otherwise the ATen reference (softmax, topk, gather).
Routing route_topk_softmax(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
                           const MoESpec& moe, bool fused = false);

// The same scores and combine weights for experts already chosen (idx_TK from an earlier call):
// what a checkpointed layer's recompute uses, so that the backward never re-routes.
// `fused` must be what the forward used: the fused router is deterministic, so re-running it on the
// same inputs reproduces idx_TK and its weights bit for bit.
Routing route_softmax_given(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
                            const MoESpec& moe, const at::Tensor& idx_TK, bool fused = false);

// Round-robin routing for benchmarks: idx[t, k] = (t*K + k) mod E, weights 1/K; the router logits
// are still computed (and differentiable) so that the router's cost and gradient stay in the step.
Routing route_round_robin(const at::Tensor& x_TH, const at::Tensor& w_router_EH, const MoESpec& moe);

}  // namespace automoe::moe
