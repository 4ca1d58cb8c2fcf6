#include "automoe/moe/aux_loss.h"

#include <ATen/ATen.h>

namespace automoe::moe {

at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts,
                               int64_t top_k, const std::optional<at::Tensor>& attention_mask_BS) {
  TORCH_INTERNAL_ASSERT(!router_logits.empty(), "load_balancing_loss needs at least one MoE layer");
  const auto opts = router_logits.front().options().dtype(at::kFloat);
  at::Tensor tokens_E = at::zeros({num_experts}, opts);
  at::Tensor probs_E = at::zeros({num_experts}, opts);
  at::Tensor rows = at::zeros({}, opts);
  std::optional<at::Tensor> mask_T;
  if (attention_mask_BS) mask_T = attention_mask_BS->reshape({-1}).to(opts);
  for (const at::Tensor& logits_TE : router_logits) {
    const at::Tensor probs_TE = at::softmax(logits_TE, -1).to(at::kFloat);
    const at::Tensor idx_TK = std::get<1>(at::topk(probs_TE, top_k, -1));
    if (!mask_T) {
      tokens_E = tokens_E + at::bincount(idx_TK.reshape({-1}), {}, num_experts).to(at::kFloat);
      probs_E = probs_E + probs_TE.sum(0);
      rows = rows + static_cast<double>(probs_TE.size(0));
    } else {
      tokens_E =
          tokens_E + at::zeros({num_experts}, opts)
                         .scatter_add(0, idx_TK.reshape({-1}), mask_T->repeat_interleave(top_k));
      probs_E = probs_E + (probs_TE * mask_T->unsqueeze(-1)).sum(0);
      rows = rows + mask_T->sum();
    }
  }
  return (tokens_E / rows * (probs_E / rows)).sum() * static_cast<double>(num_experts);
}

}  // namespace automoe::moe
