#include "automoe/moe/experts.h"

#include <ATen/ATen.h>

#include "automoe/core/error.h"
#include "automoe/ops/ops.h"

namespace automoe::moe {

namespace {

// Transformers' experts loop: for each expert that received tokens, in ascending order, its
// (slot, token) pairs slot-major (the same summation order in the expert's weight gradient);
// `expert_out(e, x_eH)` is the expert's output for its tokens, weighted here and index_added
// into a zeroed output of `out_dtype` (the layer input's, under autocast too, as Transformers).
template <class ExpertOut>
at::Tensor loop_over_experts(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                             const at::Tensor& weights_TK, int64_t E, c10::ScalarType out_dtype,
                             ExpertOut&& expert_out) {
  at::Tensor out_TH = at::zeros(x_TH.sizes(), x_TH.options().dtype(out_dtype));
  // counts_E on the host once: the loop visits only experts with tokens.
  const at::Tensor counts_E = at::bincount(idx_TK.reshape({-1}), {}, E).cpu();
  const int64_t* counts = counts_E.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] == 0) continue;
    const auto where = at::where(idx_TK.t().eq(e));
    const at::Tensor& slot_idx = where[0];
    const at::Tensor& token_idx = where[1];
    at::Tensor y_eH = expert_out(e, x_TH.index_select(0, token_idx));
    y_eH = y_eH * weights_TK.index({token_idx, slot_idx}).unsqueeze(-1);
    out_TH.index_add_(0, token_idx, y_eH.to(out_TH.scalar_type()));
  }
  return out_TH;
}

}  // namespace

at::Tensor experts_eager(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                         const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                         const at::Tensor& w_down_EHI) {
  return loop_over_experts(x_TH, idx_TK, weights_TK, w_gate_up_EIH.size(0), x_TH.scalar_type(),
                           [&](int64_t e, const at::Tensor& x_eH) {
                             const auto gate_up = at::linear(x_eH, w_gate_up_EIH[e]).chunk(2, -1);
                             return at::linear(at::silu(gate_up[0]) * gate_up[1], w_down_EHI[e]);
                           });
}

at::Tensor experts_grouped(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                           const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                           const at::Tensor& w_down_EHI) {
  const ops::PermutePlan plan = ops::permute_plan(idx_TK, w_gate_up_EIH.size(0));
  const at::Tensor x_NH = ops::permute(x_TH, plan);
  const at::Tensor h_NI = ops::swiglu(ops::grouped_gemm(x_NH, w_gate_up_EIH, plan.offsets));
  return ops::unpermute(ops::grouped_gemm(h_NI, w_down_EHI, plan.offsets), plan, weights_TK);
}

at::Tensor experts_grouped_reference_swiglu(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                                            const at::Tensor& weights_TK,
                                            const at::Tensor& w_gate_up_EIH,
                                            const at::Tensor& w_down_EHI) {
  const ops::PermutePlan plan = ops::permute_plan(idx_TK, w_gate_up_EIH.size(0));
  const at::Tensor gu = ops::grouped_gemm(ops::permute(x_TH, plan), w_gate_up_EIH, plan.offsets);
  return ops::unpermute(ops::grouped_gemm(ops::swiglu_reference(gu), w_down_EHI, plan.offsets),
                        plan, weights_TK);
}

at::Tensor experts_torch_mm(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                            const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                            const at::Tensor& w_down_EHI) {
  const ops::PermutePlan plan = ops::permute_plan(idx_TK, w_gate_up_EIH.size(0));
  // _grouped_mm takes the cumulative row ends of each group as int32.
  const at::Tensor ends = plan.offsets.narrow(0, 1, w_gate_up_EIH.size(0)).to(at::kInt);
  const at::Tensor x_NH = ops::permute_reference(x_TH, plan);
  const at::Tensor gu = at::_grouped_mm(x_NH, w_gate_up_EIH.transpose(1, 2), ends);
  const at::Tensor y = at::_grouped_mm(ops::swiglu_reference(gu), w_down_EHI.transpose(1, 2), ends);
  return ops::unpermute_reference(y, plan, weights_TK);
}

at::Tensor experts_gpt_oss(const std::string& backend, const at::Tensor& x_TH,
                           const at::Tensor& idx_TK, const at::Tensor& weights_TK,
                           const at::Tensor& w_gate_up_EHI2, const at::Tensor& b_gate_up_EI2,
                           const at::Tensor& w_down_EIH, const at::Tensor& b_down_EH,
                           bool fused_swiglu, std::optional<c10::ScalarType> compute_dtype) {
  const int64_t E = w_gate_up_EHI2.size(0);
  const c10::ScalarType mm = compute_dtype.value_or(x_TH.scalar_type());
  const at::Tensor x = x_TH.to(mm), w_gu = w_gate_up_EHI2.to(mm), w_d = w_down_EIH.to(mm);
  ops::SwigluParams gpt_oss;
  gpt_oss.gpt_oss = true;
  auto swiglu = [&](const at::Tensor& gu) {
    // The fused op takes one dtype; promoted inputs (autocast) take the reference.
    return fused_swiglu && gu.scalar_type() == mm ? ops::swiglu(gu, gpt_oss)
                                                  : ops::swiglu_reference(gu, gpt_oss);
  };
  if (backend == "eager") {  // Transformers' GptOssExperts loop, in its order
    return loop_over_experts(x, idx_TK, weights_TK, E, x_TH.scalar_type(),
                             [&](int64_t e, const at::Tensor& x_eH) {
                               const at::Tensor gate_up = at::matmul(x_eH, w_gu[e]) + b_gate_up_EI2[e];
                               return at::matmul(ops::swiglu_reference(gate_up, gpt_oss).to(mm),
                                                 w_d[e]) +
                                      b_down_EH[e];
                             });
  }
  const ops::PermutePlan plan = ops::permute_plan(idx_TK, E);
  // The expert of each permuted row, for the per-expert biases.
  const at::Tensor counts_E = plan.offsets.narrow(0, 1, E) - plan.offsets.narrow(0, 0, E);
  const at::Tensor expert_N = at::repeat_interleave(at::arange(E, plan.offsets.options()), counts_E);
  at::Tensor y;
  if (backend == "torch_mm") {  // ATen's grouped GEMM reads the stored layout directly
    const at::Tensor ends = plan.offsets.narrow(0, 1, E).to(at::kInt);
    const at::Tensor gu = at::_grouped_mm(ops::permute_reference(x, plan), w_gu, ends) +
                          b_gate_up_EI2.index_select(0, expert_N);
    y = at::_grouped_mm(ops::swiglu_reference(gu, gpt_oss).to(mm), w_d, ends) +
        b_down_EH.index_select(0, expert_N);
    return ops::unpermute_reference(y, plan, weights_TK).to(x_TH.scalar_type());
  }
  AUTOMOE_CHECK(backend == "grouped", "GPT-OSS experts: unknown backend \"", backend, "\"");
  // Our grouped GEMM takes [E, O, K] weights: the transposed views (copied per call).
  const at::Tensor gu = ops::grouped_gemm(ops::permute(x, plan), w_gu.transpose(1, 2), plan.offsets) +
                        b_gate_up_EI2.index_select(0, expert_N);
  y = ops::grouped_gemm(swiglu(gu).to(mm), w_d.transpose(1, 2), plan.offsets) +
      b_down_EH.index_select(0, expert_N);
  return ops::unpermute(y, plan, weights_TK).to(x_TH.scalar_type());
}

at::Tensor experts_on_rows(const std::string& backend, const at::Tensor& x_NH,
                           const at::Tensor& offsets_G1, const at::Tensor& w_gate_up_GIH,
                           const at::Tensor& w_down_GHI, bool fused_swiglu) {
  const int64_t G = w_gate_up_GIH.size(0);
  if (backend == "eager") {  // one expert at a time, on its rows
    const at::Tensor off = offsets_G1.cpu();
    std::vector<at::Tensor> ys;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t lo = off[g].item<int64_t>(), n = off[g + 1].item<int64_t>() - lo;
      // An empty expert is skipped, unless all are: then the last one runs on no rows, so that the
      // (empty) output stays in the autograd graph like the other backends' (an expert-parallel
      // exchange's backward must run on every rank).
      if (n == 0 && !(g == G - 1 && ys.empty())) continue;
      const auto gate_up = at::linear(x_NH.narrow(0, lo, n), w_gate_up_GIH[g]).chunk(2, -1);
      ys.push_back(at::linear(at::silu(gate_up[0]) * gate_up[1], w_down_GHI[g]));
    }
    return ys.size() == 1 ? ys.front() : at::cat(ys, 0);
  }
  auto swiglu = [&](const at::Tensor& gu) {
    return fused_swiglu ? ops::swiglu(gu) : ops::swiglu_reference(gu);
  };
  if (backend == "torch_mm") {
    const at::Tensor ends = offsets_G1.narrow(0, 1, G).to(at::kInt);
    const at::Tensor gu = at::_grouped_mm(x_NH, w_gate_up_GIH.transpose(1, 2), ends);
    return at::_grouped_mm(ops::swiglu_reference(gu), w_down_GHI.transpose(1, 2), ends);
  }
  AUTOMOE_CHECK(backend == "grouped", "experts backend \"", backend, "\" is unknown (grouped, torch_mm, eager)");
  return ops::grouped_gemm(swiglu(ops::grouped_gemm(x_NH, w_gate_up_GIH, offsets_G1)), w_down_GHI,
                           offsets_G1);
}

at::Tensor experts_by_name(const std::string& backend, const at::Tensor& x_TH,
                           const at::Tensor& idx_TK, const at::Tensor& weights_TK,
                           const at::Tensor& w_gate_up_EIH, const at::Tensor& w_down_EHI) {
  if (backend == "grouped") return experts_grouped(x_TH, idx_TK, weights_TK, w_gate_up_EIH, w_down_EHI);
  if (backend == "torch_mm") return experts_torch_mm(x_TH, idx_TK, weights_TK, w_gate_up_EIH, w_down_EHI);
  if (backend == "eager") return experts_eager(x_TH, idx_TK, weights_TK, w_gate_up_EIH, w_down_EHI);
  fail("experts backend \"", backend, "\" is unknown (grouped, torch_mm, eager)");
}

}  // namespace automoe::moe
