// permute / unpermute: autograd layer and ATen references.
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

struct PermuteFn : torch::autograd::Function<PermuteFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& src,
                            const at::Tensor& slot_pos) {
    ctx->save_for_backward({slot_pos});
    const at::Tensor xc = x.contiguous();
    return AUTOMOE_KERNEL(permute_fwd, xc, xc, src);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("permute");
    const at::Tensor slot_pos = ctx->get_saved_variables()[0];
    const at::Tensor g = grads[0].contiguous();
    return {AUTOMOE_KERNEL(permute_bwd, g, g, slot_pos), at::Tensor(), at::Tensor()};
  }
};

struct UnpermuteFn : torch::autograd::Function<UnpermuteFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& slot_pos,
                            const at::Tensor& weights) {
    const at::Tensor yc = y.contiguous(), wc = weights.contiguous();
    ctx->save_for_backward({yc, slot_pos, wc});
    return AUTOMOE_KERNEL(unpermute_fwd, yc, yc, slot_pos, wc);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("unpermute");
    const auto s = ctx->get_saved_variables();
    const at::Tensor g = grads[0].contiguous();
    auto [gy, gw] = AUTOMOE_KERNEL(unpermute_bwd, g, g, s[0], s[1], s[2]);
    return {gy, at::Tensor(), gw};
  }
};

// `rows` of x must equal `expected` (T for a token tensor, T*K for a permuted one).
void check_plan(const char* op, const at::Tensor& x, const PermutePlan& plan, int64_t rows,
                int64_t expected, const char* rows_name) {
  AUTOMOE_CHECK(plan.slot_pos.defined() && plan.src_token.defined() && plan.offsets.defined(), op,
                ": the permute plan is incomplete (use automoe.moe_permute_plan)");
  detail::check_same_device(op, {{"x", &x}, {"slot_pos", &plan.slot_pos},
                                 {"src_token", &plan.src_token}});
  AUTOMOE_CHECK(plan.slot_pos.dim() == 2 && plan.src_token.numel() == plan.slot_pos.numel(), op,
                ": slot_pos [T, K] and src_token [T*K] disagree: ", plan.slot_pos.sizes(), " vs ",
                plan.src_token.sizes());
  AUTOMOE_CHECK(rows == expected, op, ": ", rows_name, " (", rows, ") do not match the permute plan (T = ",
                plan.slot_pos.size(0), ", T*K = ", plan.src_token.size(0), ")");
  AUTOMOE_CHECK(plan.slot_pos.scalar_type() == at::kLong && plan.src_token.scalar_type() == at::kLong,
                op, ": slot_pos and src_token must be int64 (from automoe.moe_permute_plan), got ",
                plan.slot_pos.scalar_type(), " and ", plan.src_token.scalar_type());
  if (plan.slot_pos.is_cpu() && plan.slot_pos.numel() > 0) {  // CUDA kernels bounds-check rows
    const int64_t T = plan.slot_pos.size(0), N = plan.src_token.numel();
    const auto [plo, phi] = at::aminmax(plan.slot_pos);
    const auto [slo, shi] = at::aminmax(plan.src_token);
    AUTOMOE_CHECK(plo.item<int64_t>() >= -1 && phi.item<int64_t>() < N, op,
                  ": slot_pos values must be in [-1, ", N, "), got [", plo.item<int64_t>(), ", ",
                  phi.item<int64_t>(), "]");
    AUTOMOE_CHECK(slo.item<int64_t>() >= -1 && shi.item<int64_t>() < T, op,
                  ": src_token values must be in [-1, ", T, "), got [", slo.item<int64_t>(), ", ",
                  shi.item<int64_t>(), "]");
  }
}

// The plan's index tensors as the kernels read them (raw, contiguous memory).
PermutePlan contiguous(const PermutePlan& p) {
  return {p.offsets.contiguous(), p.slot_pos.contiguous(), p.src_token.contiguous()};
}

}  // namespace

PermutePlan permute_plan(const at::Tensor& idx_TK, int64_t num_experts) {
  RECORD_FUNCTION("automoe::moe_permute_plan", c10::ArrayRef<const c10::IValue>{});
  const char* op = "automoe.moe_permute_plan";
  AUTOMOE_CHECK(idx_TK.dim() == 2, op, ": indices must be [T, K], got ", idx_TK.sizes());
  AUTOMOE_CHECK(num_experts >= 1, op, ": num_experts must be >= 1, got ", num_experts);
  const at::Tensor idx = idx_TK.to(at::kLong).contiguous();  // (the CPU kernel checks the range)
  if (idx.is_cuda() && !use_cuda_kernel("permute")) return permute_plan_reference(idx, num_experts);
  auto [offsets, slot_pos, src] = AUTOMOE_KERNEL(permute_plan, idx, idx, num_experts);
  return {offsets, slot_pos, src};
}

PermutePlan permute_plan_reference(const at::Tensor& idx_TK, int64_t num_experts) {
  // A stable sort by expert (dropped slots, index -1, sorted past every expert) keeps each
  // expert's slots in order t*K + k, as the kernel's single pass does.
  const at::Tensor idx = idx_TK.to(at::kLong).reshape({-1});
  const int64_t N = idx.numel(), K = std::max<int64_t>(idx_TK.size(1), 1);
  const at::Tensor valid = idx.ge(0);
  const at::Tensor key = at::where(valid, idx, num_experts);
  const at::Tensor order =
      std::get<1>(at::sort(key, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor counts = at::bincount(key, {}, num_experts + 1).narrow(0, 0, num_experts);
  const at::Tensor offsets = at::cat({at::zeros({1}, counts.options()), counts.cumsum(0)});
  const at::Tensor rows = at::arange(N, idx.options());
  const at::Tensor kept = rows.lt(offsets.narrow(0, num_experts, 1));  // rows before offsets[E]
  at::Tensor slot_pos =
      at::empty({N}, idx.options()).index_put_({order}, at::where(kept, rows, -1));
  at::Tensor src = at::where(kept, at::div(order, K, "floor"), -1);
  return {offsets, slot_pos.view(idx_TK.sizes()), src};
}

at::Tensor permute(const at::Tensor& x_TH, const PermutePlan& plan_in) {
  RECORD_FUNCTION("automoe::permute", c10::ArrayRef<const c10::IValue>{});
  const PermutePlan plan = contiguous(plan_in);
  const char* op = "automoe.permute";
  detail::check_float(op, "x", x_TH);
  detail::check_dim(op, "x", x_TH, 2);
  check_plan(op, x_TH, plan, x_TH.size(0), plan.slot_pos.size(0), "x rows");
  if (x_TH.is_cuda() && !use_cuda_kernel("permute")) return permute_reference(x_TH, plan);
  return PermuteFn::apply(x_TH, plan.src_token, plan.slot_pos);
}

at::Tensor permute_reference(const at::Tensor& x_TH, const PermutePlan& plan) {
  const at::Tensor valid = plan.src_token.ge(0);
  return x_TH.index_select(0, plan.src_token.clamp_min(0)) * valid.unsqueeze(1).to(x_TH.dtype());
}

at::Tensor unpermute(const at::Tensor& y_NH, const PermutePlan& plan_in,
                     const at::Tensor& weights_TK) {
  RECORD_FUNCTION("automoe::unpermute", c10::ArrayRef<const c10::IValue>{});
  const PermutePlan plan = contiguous(plan_in);
  const char* op = "automoe.unpermute";
  detail::check_float(op, "y", y_NH);
  detail::check_float(op, "weights", weights_TK);
  detail::check_dim(op, "y", y_NH, 2);
  check_plan(op, y_NH, plan, y_NH.size(0), plan.src_token.size(0), "y rows");
  AUTOMOE_CHECK(weights_TK.sizes() == plan.slot_pos.sizes(), op, ": weights ", weights_TK.sizes(),
                " must match the slots ", plan.slot_pos.sizes());
  AUTOMOE_CHECK(weights_TK.scalar_type() == at::kFloat ||
                    weights_TK.scalar_type() == y_NH.scalar_type(),
                op, ": weights must be float32 or y's dtype (", y_NH.scalar_type(), "), got ",
                weights_TK.scalar_type());
  if (y_NH.is_cuda() && !use_cuda_kernel("permute"))
    return unpermute_reference(y_NH, plan, weights_TK);
  return UnpermuteFn::apply(y_NH, plan.slot_pos, weights_TK);
}

at::Tensor unpermute_reference(const at::Tensor& y_NH, const PermutePlan& plan,
                               const at::Tensor& weights_TK) {
  const int64_t T = plan.slot_pos.size(0), K = plan.slot_pos.size(1), H = y_NH.size(1);
  const auto acc = y_NH.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor rows =
      y_NH.index_select(0, plan.slot_pos.clamp_min(0).reshape({-1})).view({T, K, H}).to(acc);
  const at::Tensor w = weights_TK.to(acc) * plan.slot_pos.ge(0).to(acc);
  return (rows * w.unsqueeze(-1)).sum(1).to(y_NH.scalar_type());
}

}  // namespace automoe::ops
