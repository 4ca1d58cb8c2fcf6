#include "automoe/moe/router.h"

#include <ATen/ATen.h>

namespace automoe::moe {

Routing route_topk_softmax(const at::Tensor& x_TH, const at::Tensor& w_router_EH,
                           const MoESpec& moe) {
  at::Tensor logits_TE = at::linear(x_TH.to(at::kFloat), w_router_EH.to(at::kFloat));
  const at::Tensor probs_TE = at::softmax(logits_TE, -1, at::kFloat);
  auto [top_TK, idx_TK] = at::topk(probs_TE, moe.top_k, -1);
  if (moe.norm_topk_prob) top_TK = top_TK / top_TK.sum(-1, /*keepdim=*/true);
  return {logits_TE, top_TK.to(x_TH.scalar_type()), idx_TK};
}

}  // namespace automoe::moe
