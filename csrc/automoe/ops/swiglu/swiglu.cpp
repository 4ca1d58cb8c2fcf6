// swiglu: autograd layer and ATen reference.
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

struct SwigluFn : torch::autograd::Function<SwigluFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up, SwigluParams p) {
    const at::Tensor x = gate_up.contiguous();
    ctx->save_for_backward({x});  // the product is recomputed, never stored
    ctx->saved_data["gpt_oss"] = p.gpt_oss;
    ctx->saved_data["alpha"] = p.alpha;
    ctx->saved_data["limit"] = p.limit;
    return AUTOMOE_KERNEL(swiglu_fwd, x, x, p.gpt_oss, p.alpha, p.limit);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("swiglu");
    const at::Tensor x = ctx->get_saved_variables()[0];
    const at::Tensor g = grads[0].contiguous();
    return {AUTOMOE_KERNEL(swiglu_bwd, g, g, x, ctx->saved_data["gpt_oss"].toBool(),
                           ctx->saved_data["alpha"].toDouble(), ctx->saved_data["limit"].toDouble()),
            at::Tensor()};
  }
};

void check_swiglu(const at::Tensor& gate_up) {
  detail::check_float("automoe.swiglu", "gate_up", gate_up);
  AUTOMOE_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 && gate_up.size(-1) > 0,
                "automoe.swiglu: the last dimension of gate_up must be even and > 0 (gate and up), "
                "got ", gate_up.sizes());
}

}  // namespace

at::Tensor swiglu(const at::Tensor& gate_up, const SwigluParams& p) {
  RECORD_FUNCTION("automoe::swiglu", c10::ArrayRef<const c10::IValue>{});
  check_swiglu(gate_up);
  if (gate_up.is_cuda() && !use_cuda_kernel("swiglu")) return swiglu_reference(gate_up, p);
  return SwigluFn::apply(gate_up, p);
}

at::Tensor swiglu_reference(const at::Tensor& gate_up, const SwigluParams& p) {
  check_swiglu(gate_up);
  const int64_t I = gate_up.size(-1) / 2;
  if (!p.gpt_oss) {
    return at::silu(gate_up.narrow(-1, 0, I)) * gate_up.narrow(-1, I, I);
  }
  // Transformers' GptOssExperts: gate = x[..., ::2], up = x[..., 1::2].
  const at::Tensor gate = gate_up.slice(-1, 0, 2 * I, 2).clamp_max(p.limit);
  const at::Tensor up = gate_up.slice(-1, 1, 2 * I, 2).clamp(-p.limit, p.limit);
  return (up + 1) * (gate * at::sigmoid(gate * p.alpha));
}

}  // namespace automoe::ops
