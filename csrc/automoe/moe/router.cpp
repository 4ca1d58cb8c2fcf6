#include "automoe/moe/router.h"

#include <ATen/ATen.h>

#include "automoe/core/autocast.h"
#include "automoe/ops/ops.h"

namespace automoe::moe {
namespace {

// Router logits in float32 whatever the model dtype, torch.autocast included.
at::Tensor router_logits(const at::Tensor& x_TH, const at::Tensor& w_router_EH) {
  const AutocastGuard no_autocast(x_TH.device().type(), std::nullopt);
  return at::linear(x_TH.to(at::kFloat), w_router_EH.to(at::kFloat));
}

}  // namespace

Routing route_topk_softmax(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
                           const MoESpec& moe, bool fused) {
  at::Tensor logits_TE = router_logits(x_TH, w_router_EH);
  if (fused) {
    ops::RouterParams p;
    p.top_k = moe.top_k;
    p.norm_topk_prob = moe.norm_topk_prob;
    const ops::RouterResult r = ops::router(logits_TE, std::nullopt, p);
    return {logits_TE, r.weights_TK.to(x_TH.scalar_type()), r.idx_TK};
  }
  const at::Tensor probs_TE = at::softmax(logits_TE, -1, at::kFloat);
  auto [top_TK, idx_TK] = at::topk(probs_TE, moe.top_k, -1);
  if (moe.norm_topk_prob) top_TK = top_TK / top_TK.sum(-1, /*keepdim=*/true);
  return {logits_TE, top_TK.to(x_TH.scalar_type()), idx_TK};
}

Routing route_softmax_given(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
                            const MoESpec& moe, const at::Tensor& idx_TK, bool fused) {
  if (fused) {
    // The fused router is deterministic: on the forward's inputs it makes the forward's choice,
    // and then its weights (and backward) are the forward's bit for bit. Should the recomputed
    // logits ever differ in a last bit and flip a near-tie, fall back to the given experts.
    Routing r = route_topk_softmax(x_TH, w_router_EH, moe, /*fused=*/true);
    if (at::equal(r.idx_TK, idx_TK)) return r;
  }
  at::Tensor logits_TE = router_logits(x_TH, w_router_EH);
  const at::Tensor probs_TE = at::softmax(logits_TE, -1, at::kFloat);
  at::Tensor top_TK = probs_TE.gather(1, idx_TK);
  if (moe.norm_topk_prob) top_TK = top_TK / top_TK.sum(-1, /*keepdim=*/true);
  return {logits_TE, top_TK.to(x_TH.scalar_type()), idx_TK};
}

Routing route_round_robin(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
                          const MoESpec& moe) {
  const int64_t T = x_TH.size(0), K = moe.top_k, E = moe.num_experts;
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
