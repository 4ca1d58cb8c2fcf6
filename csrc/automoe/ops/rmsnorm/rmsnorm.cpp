// rmsnorm: autograd layer (the reference is rmsnorm_reference.cpp).
#include "automoe/ops/rmsnorm/rmsnorm.h"

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

struct RmsNormFn : torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    const at::Tensor xc = x.contiguous(), wc = w.contiguous();
    auto [y, inv_rms] = AUTOMOE_KERNEL(rmsnorm_fwd, xc, xc, wc, eps);
    ctx->save_for_backward({xc, wc, inv_rms});  // inverse RMS only: no normalised copy of x
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("rms_norm");
    const auto s = ctx->get_saved_variables();
    const at::Tensor g = grads[0].contiguous();
    auto [dx, dw] = AUTOMOE_KERNEL(rmsnorm_bwd, g, g, s[0], s[1], s[2]);
    return {dx, dw, at::Tensor()};
  }
};

}  // namespace

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  RECORD_FUNCTION("automoe::rmsnorm", c10::ArrayRef<const c10::IValue>{});
  const char* op = "automoe.rmsnorm";
  detail::check_float(op, "x", x);
  detail::check_float(op, "weight", weight);
  detail::check_same_dtype(op, "x", x, "weight", weight);
  detail::check_same_device(op, {{"x", &x}, {"weight", &weight}});
  AUTOMOE_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must have a last dimension > 0, got ",
                x.sizes());
  AUTOMOE_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op,
                ": weight must be [", x.dim() ? x.size(-1) : 0, "] (x's last dimension), got ",
                weight.sizes());
  if (x.is_cuda() && !use_cuda_kernel("rmsnorm")) return rms_norm_reference(x, weight, eps);
  return RmsNormFn::apply(x, weight, eps);
}

}  // namespace automoe::ops
