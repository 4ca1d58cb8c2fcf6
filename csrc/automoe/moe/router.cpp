#include "automoe/moe/router.h"

#include <ATen/ATen.h>

#include "automoe/core/autocast.h"

namespace automoe::moe {
namespace {

// Router logits in float32 whatever the model dtype, torch.autocast included.
at::Tensor router_logits(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
                         const std::optional<at::Tensor>& logit_bias_E = std::nullopt) {
  const AutocastGuard no_autocast(x_TH.device().type(), std::nullopt);
  std::optional<at::Tensor> b;
  if (logit_bias_E) b = logit_bias_E->to(at::kFloat);
  return at::linear(x_TH.to(at::kFloat), w_router_EH.to(at::kFloat), b);
}

}  // namespace

Routing route(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
              const std::optional<at::Tensor>& bias_E, const ops::RouterParams& p,
              const RouterOp& op, const std::optional<at::Tensor>& logit_bias_E) {
  at::Tensor logits_TE = router_logits(x_TH, w_router_EH, logit_bias_E);
  const ops::RouterResult r = op(logits_TE, bias_E, p);
  return {logits_TE, r.weights_TK.to(x_TH.scalar_type()), r.idx_TK};
}

Routing route_given(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
                    const std::optional<at::Tensor>& bias_E, const ops::RouterParams& p,
                    const at::Tensor& idx_TK, const RouterOp& op, bool deterministic,
                    const std::optional<at::Tensor>& logit_bias_E) {
  if (deterministic) {
    // On the forward's inputs a deterministic router makes the forward's choice, and then its
    // weights (and backward) are the forward's bit for bit. Should the recomputed logits ever
    // differ in a last bit and flip a near-tie, fall back to the given experts.
    Routing r = route(x_TH, w_router_EH, bias_E, p, op, logit_bias_E);
    if (at::equal(r.idx_TK, idx_TK)) return r;
  }
  at::Tensor logits_TE = router_logits(x_TH, w_router_EH, logit_bias_E);
  const ops::RouterResult r = ops::router_given(logits_TE, idx_TK, p);
  return {logits_TE, r.weights_TK.to(x_TH.scalar_type()), idx_TK};
}

Routing route_round_robin(const at::Tensor& x_TH, const at::Tensor& w_router_EH, int64_t K) {
  const int64_t T = x_TH.size(0), E = w_router_EH.size(0);
  at::Tensor logits_TE = router_logits(x_TH, w_router_EH);
  const at::Tensor idx_TK =
      at::arange(T * K, at::TensorOptions().dtype(at::kLong).device(x_TH.device()))
          .remainder(E)
          .view({T, K});
  // 1/K, tied to the logits so that the router still receives a (zero) gradient.
  const at::Tensor weights_TK = (logits_TE.narrow(1, 0, 1) * 0 + 1.0 / K).expand({T, K});
  return {logits_TE, weights_TK.to(x_TH.scalar_type()).contiguous(), idx_TK};
}

}  // namespace automoe::moe
