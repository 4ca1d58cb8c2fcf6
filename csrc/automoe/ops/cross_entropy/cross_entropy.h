// Causal-LM cross-entropy: position s predicts labels[s + 1]; labels equal to ignore_index (and
// the last position, which has no next token) carry no loss. Returns the sum of the per-token
// losses in float32 and the number of tokens that carry loss, so that callers can normalise by a
// token count that spans micro-batches (gradient accumulation) or ranks.
#pragma once

#include <ATen/core/Tensor.h>

namespace automoe::ops {

struct LossSum {
  at::Tensor sum;    // float32 scalar, differentiable
  at::Tensor count;  // int64 scalar
};

// logits [B, S, V] (any float dtype; upcast to float32), labels [B, S] int64.
LossSum causal_lm_cross_entropy_reference(const at::Tensor& logits_BSV, const at::Tensor& labels_BS,
                                          int64_t ignore_index = -100);

}  // namespace automoe::ops
