#include <ATen/ATen.h>

#include "automoe/ops/cross_entropy/cross_entropy.h"

namespace automoe::ops {

LossSum causal_lm_cross_entropy_reference(const at::Tensor& logits_BSV, const at::Tensor& labels_BS,
                                          int64_t ignore_index) {
  const int64_t V = logits_BSV.size(-1);
  // Shift: append one ignored label per row and drop the first, so position s sees label s+1.
  const at::Tensor shifted_BS =
      at::constant_pad_nd(labels_BS, {0, 1}, ignore_index).narrow(1, 1, labels_BS.size(1));
  const at::Tensor labels_T = shifted_BS.reshape({-1}).to(logits_BSV.device());
  const at::Tensor logits_TV = logits_BSV.to(at::kFloat).reshape({-1, V});
  at::Tensor sum =
      at::cross_entropy_loss(logits_TV, labels_T, /*weight=*/{}, at::Reduction::Sum, ignore_index);
  at::Tensor count = labels_T.ne(ignore_index).sum();
  return {sum, count};
}

}  // namespace automoe::ops
