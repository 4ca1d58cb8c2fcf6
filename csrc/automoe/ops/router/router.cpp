// router: autograd layer and ATen reference.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include "automoe/ops/common.h"
#include "automoe/ops/cuda_status.h"
#include "automoe/ops/ops.h"

namespace automoe::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void check_router(const at::Tensor& logits, const std::optional<at::Tensor>& bias,
                  const RouterParams& p) {
  const char* op = "automoe.router";
  detail::check_float(op, "logits", logits);
  detail::check_dim(op, "logits", logits, 2);
  const int64_t E = logits.size(1);
  AUTOMOE_CHECK(p.top_k >= 1 && p.top_k <= E, op, ": top_k must be in [1, ", E, "], got ", p.top_k);
  AUTOMOE_CHECK(p.n_group >= 1 && E % p.n_group == 0, op, ": n_group (", p.n_group,
                ") must divide the number of experts (", E, ")");
  AUTOMOE_CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group, op, ": topk_group (", p.topk_group,
                ") must be in [1, n_group = ", p.n_group, "]");
  AUTOMOE_CHECK(p.topk_group * (E / p.n_group) >= p.top_k, op, ": topk_group (", p.topk_group,
                ") groups of ", E / p.n_group, " experts cannot hold top_k = ", p.top_k);
  if (logits.is_cuda()) {  // the CUDA kernel keeps a token's experts in one warp's registers
    AUTOMOE_CHECK(E <= 1024 && p.top_k <= 32, op, ": the CUDA kernel supports up to 1024 experts "
                  "and top_k <= 32, got E = ", E, ", top_k = ", p.top_k);
  }
  if (bias) {
    AUTOMOE_CHECK(bias->dim() == 1 && bias->size(0) == E, op, ": correction_bias must be [", E,
                  "], got ", bias->sizes());
    detail::check_same_device(op, {{"logits", &logits}, {"correction_bias", &*bias}});
  }
}

struct RouterFn : torch::autograd::Function<RouterFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits,
                               const std::optional<at::Tensor>& bias, RouterParams p) {
    const at::Tensor l32 = logits.to(at::kFloat).contiguous();
    std::optional<at::Tensor> b32;
    if (bias) b32 = bias->to(at::kFloat).contiguous();
    auto [w, idx, scores] = AUTOMOE_KERNEL(router_fwd, l32, l32, b32, p);
    ctx->save_for_backward({scores, idx});
    ctx->mark_non_differentiable({idx});
    // An output nothing used (the scores, without an aux loss) gets no gradient: not a [T, E]
    // tensor of zeros, written and read again by the backward.
    ctx->set_materialize_grads(false);
    ctx->saved_data["top_k"] = p.top_k;
    ctx->saved_data["sigmoid"] = p.sigmoid;
    ctx->saved_data["norm"] = p.norm_topk_prob;
    ctx->saved_data["scaling"] = p.scaling;
    ctx->saved_data["dtype"] = logits.scalar_type();
    return {w, idx, scores};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("router");
    const auto saved = ctx->get_saved_variables();
    RouterParams p;
    p.top_k = ctx->saved_data["top_k"].toInt();
    p.sigmoid = ctx->saved_data["sigmoid"].toBool();
    p.norm_topk_prob = ctx->saved_data["norm"].toBool();
    p.scaling = ctx->saved_data["scaling"].toDouble();
    const at::Tensor& scores = saved[0];
    const at::Tensor& idx = saved[1];
    at::Tensor gw = grads[0].defined() ? grads[0].to(at::kFloat).contiguous()
                                       : at::zeros(idx.sizes(), scores.options());
    std::optional<at::Tensor> gs;
    if (grads[2].defined()) gs = grads[2].to(at::kFloat).contiguous();
    const auto dtype = ctx->saved_data["dtype"].toScalarType();
    at::Tensor gl = AUTOMOE_KERNEL(router_bwd, scores, gw, gs, scores, idx, p, dtype);
    return {gl.to(dtype), at::Tensor(), at::Tensor()};
  }
};

at::Tensor select_scores(const at::Tensor& scores, const at::Tensor& idx, const RouterParams& p) {
  at::Tensor w = scores.gather(1, idx);
  if (p.norm_topk_prob) w = w / (w.sum(-1, /*keepdim=*/true) + (p.sigmoid ? 1e-20 : 0.0));
  return p.scaling == 1.0 ? w : w * p.scaling;
}

at::Tensor scores_of(const at::Tensor& logits, const RouterParams& p) {
  // float32 (float64 for float64 logits: the op tests' ground truth).
  const at::Tensor l32 = logits.scalar_type() == at::kDouble ? logits : logits.to(at::kFloat);
  return p.sigmoid ? at::sigmoid(l32) : at::softmax(l32, -1);
}

// Indices of the k largest values per row, ties to the lower index (a stable descending sort),
// the fused kernels' documented order.
at::Tensor topk_lower_index_first(const at::Tensor& v, int64_t k) {
  return std::get<1>(at::sort(v, /*stable=*/true, /*dim=*/-1, /*descending=*/true)).narrow(-1, 0, k);
}

}  // namespace

RouterResult router(const at::Tensor& logits_TE, const std::optional<at::Tensor>& bias_E,
                    const RouterParams& p) {
  RECORD_FUNCTION("automoe::router", c10::ArrayRef<const c10::IValue>{});
  check_router(logits_TE, bias_E, p);
  if (logits_TE.is_cuda() && !use_cuda_kernel("router"))
    return router_reference(logits_TE, bias_E, p);
  const auto out = RouterFn::apply(logits_TE, bias_E, p);
  return {out[0], out[1], out[2]};
}

RouterResult router_reference(const at::Tensor& logits_TE, const std::optional<at::Tensor>& bias_E,
                              const RouterParams& p) {
  check_router(logits_TE, bias_E, p);
  const at::Tensor scores = scores_of(logits_TE, p);
  at::Tensor sel = scores.detach();
  if (bias_E) sel = sel + bias_E->to(sel.scalar_type());
  if (p.n_group > 1) {
    const int64_t T = sel.size(0), E = sel.size(1);
    const at::Tensor grouped = sel.view({T, p.n_group, E / p.n_group});
    const at::Tensor group_scores =
        std::get<0>(grouped.topk(std::min<int64_t>(2, E / p.n_group), -1)).sum(-1);
    const at::Tensor keep = topk_lower_index_first(group_scores, p.topk_group);
    const at::Tensor mask = at::zeros_like(group_scores, at::kBool).scatter(1, keep, true);
    sel = grouped.masked_fill(mask.logical_not().unsqueeze(-1), -INFINITY).view({T, E});
  }
  const at::Tensor idx = topk_lower_index_first(sel, p.top_k);
  return {select_scores(scores, idx, p), idx, scores};
}

RouterResult router_given(const at::Tensor& logits_TE, const at::Tensor& idx_TK,
                          const RouterParams& p) {
  const at::Tensor scores = scores_of(logits_TE, p);
  return {select_scores(scores, idx_TK, p), idx_TK, scores};
}

}  // namespace automoe::ops
