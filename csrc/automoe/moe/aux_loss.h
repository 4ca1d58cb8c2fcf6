// Switch-Transformer load-balancing loss over all MoE layers, as Transformers computes it:
//   f_e = (tokens routed to e, summed over layers) / (rows counted, summed over layers)
//   P_e = (router probability of e, summed over layers) / (same rows)
//   loss = E * sum_k sum_e f_{k,e} * P_e   (f counted per top-k slot)
// Padding rows (attention_mask == 0) are excluded from both counts.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace automoe::moe {

// router_logits: one [T, E] tensor per MoE layer, T = B * S; attention_mask [B, S] or nullopt.
at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts,
                               int64_t top_k, const std::optional<at::Tensor>& attention_mask_BS);

}  // namespace automoe::moe
