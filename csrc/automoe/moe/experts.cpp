#include "automoe/moe/experts.h"

#include <ATen/ATen.h>

namespace automoe::moe {

at::Tensor experts_eager(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                         const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                         const at::Tensor& w_down_EHI) {
  const int64_t E = w_gate_up_EIH.size(0);
  at::Tensor out_TH = at::zeros_like(x_TH);
  // counts_E on the host once: the loop below visits only experts with tokens.
  const at::Tensor counts_E = at::bincount(idx_TK.reshape({-1}), {}, E).cpu();
  const int64_t* counts = counts_E.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] == 0) continue;
    // (slot, token) pairs routed to e, slot-major as in Transformers (same summation order in the
    // expert's weight gradient).
    const auto where = at::where(idx_TK.t().eq(e));
    const at::Tensor& slot_idx = where[0];
    const at::Tensor& token_idx = where[1];
    const at::Tensor x_eH = x_TH.index_select(0, token_idx);
    const auto gate_up = at::linear(x_eH, w_gate_up_EIH[e]).chunk(2, -1);
    const at::Tensor h_eI = at::silu(gate_up[0]) * gate_up[1];
    at::Tensor y_eH = at::linear(h_eI, w_down_EHI[e]);
    y_eH = y_eH * weights_TK.index({token_idx, slot_idx}).unsqueeze(-1);
    out_TH.index_add_(0, token_idx, y_eH.to(out_TH.scalar_type()));
  }
  return out_TH;
}

at::Tensor experts_grouped(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                           const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                           const at::Tensor& w_down_EHI) {
  const int64_t E = w_gate_up_EIH.size(0);
  // Slot-major flattening ([K, T]) so that, after a stable sort by expert, each expert's rows come
  // in Transformers' (slot, token) order.
  const at::Tensor flat_e = idx_TK.t().reshape({-1});
  const at::Tensor order =
      std::get<1>(at::sort(flat_e, std::optional<bool>(true), /*dim=*/0, /*descending=*/false));
  const int64_t T = x_TH.size(0);
  const at::Tensor token_of = order.remainder(T);  // flat index = slot * T + token
  const at::Tensor weight_of = weights_TK.t().reshape({-1}).index_select(0, order);
  const at::Tensor counts_E = at::bincount(flat_e, {}, E).cpu();
  std::vector<int64_t> counts(counts_E.data_ptr<int64_t>(), counts_E.data_ptr<int64_t>() + E);

  const at::Tensor x_perm = x_TH.index_select(0, token_of);
  const std::vector<at::Tensor> x_e = x_perm.split_with_sizes(counts);
  const std::vector<at::Tensor> w_gu = w_gate_up_EIH.unbind(0), w_d = w_down_EHI.unbind(0);
  std::vector<at::Tensor> y_e;
  y_e.reserve(E);
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] == 0) continue;
    const auto gate_up = at::linear(x_e[e], w_gu[e]).chunk(2, -1);
    y_e.push_back(at::linear(at::silu(gate_up[0]) * gate_up[1], w_d[e]));
  }
  const at::Tensor y_perm = at::cat(y_e, 0) * weight_of.unsqueeze(-1);
  return at::zeros_like(x_TH).index_add(0, token_of, y_perm.to(x_TH.scalar_type()));
}

}  // namespace automoe::moe
