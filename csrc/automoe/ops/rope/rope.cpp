// rope: autograd layer and ATen reference.
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

struct RopeFn : torch::autograd::Function<RopeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin, bool interleaved) {
    const at::Tensor xc = x.contiguous(), c = cos.contiguous(), s = sin.contiguous();
    ctx->save_for_backward({c, s});
    ctx->saved_data["interleaved"] = interleaved;
    return AUTOMOE_KERNEL(rope_apply, xc, xc, c, s, interleaved, /*inverse=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("rope");
    const auto s = ctx->get_saved_variables();
    const at::Tensor g = grads[0].contiguous();
    // A rotation's transpose is the rotation by the opposite angle.
    return {AUTOMOE_KERNEL(rope_apply, g, g, s[0], s[1], ctx->saved_data["interleaved"].toBool(),
                           /*inverse=*/true),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const char* op = "automoe.rope";
  detail::check_float(op, "x", x);
  detail::check_float(op, "cos", cos);
  detail::check_float(op, "sin", sin);
  detail::check_dim(op, "x", x, 4);
  detail::check_same_device(op, {{"x", &x}, {"cos", &cos}, {"sin", &sin}});
  AUTOMOE_CHECK(x.size(3) % 2 == 0, op, ": the head dimension of x [B, S, N, D] must be even, got ",
                x.sizes());
  const std::vector<int64_t> want = {x.size(0), x.size(1), x.size(3) / 2};
  AUTOMOE_CHECK(cos.sizes() == at::IntArrayRef(want) && sin.sizes() == at::IntArrayRef(want), op,
                ": cos and sin must be [B, S, D/2] = ", at::IntArrayRef(want), ", got ", cos.sizes(),
                " and ", sin.sizes());
}

}  // namespace

at::Tensor rope(const at::Tensor& x_BSND, const at::Tensor& cos_BSh, const at::Tensor& sin_BSh,
                bool interleaved) {
  RECORD_FUNCTION("automoe::rope", c10::ArrayRef<const c10::IValue>{});
  check_rope(x_BSND, cos_BSh, sin_BSh);
  AUTOMOE_CHECK(!(at::GradMode::is_enabled() && (cos_BSh.requires_grad() || sin_BSh.requires_grad())),
                "automoe.rope: cos and sin must not require gradients (the fused op differentiates "
                "x only; use automoe.rope_reference for learnable tables)");
  if (x_BSND.is_cuda() && !use_cuda_kernel("rope")) {
    return rope_reference(x_BSND, cos_BSh, sin_BSh, interleaved).to(x_BSND.scalar_type());
  }
  return RopeFn::apply(x_BSND, cos_BSh, sin_BSh, interleaved);
}

at::Tensor rope_reference(const at::Tensor& x_BSND, const at::Tensor& cos_BSh,
                          const at::Tensor& sin_BSh, bool interleaved) {
  check_rope(x_BSND, cos_BSh, sin_BSh);
  const auto acc = x_BSND.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor c = cos_BSh.to(acc).unsqueeze(2), s = sin_BSh.to(acc).unsqueeze(2);
  const at::Tensor x = x_BSND.to(acc);
  const int64_t D = x.size(3), h = D / 2;
  at::Tensor a, b;
  if (interleaved) {
    a = x.slice(3, 0, D, 2);
    b = x.slice(3, 1, D, 2);
  } else {
    a = x.narrow(3, 0, h);
    b = x.narrow(3, h, h);
  }
  const at::Tensor ya = a * c - b * s, yb = b * c + a * s;
  const at::Tensor y = interleaved ? at::stack({ya, yb}, -1).flatten(3) : at::cat({ya, yb}, 3);
  // In the promoted dtype of x and the tables, as Transformers' `q * cos + rotate_half(q) * sin`
  // (a bf16 projection under autocast with float32 tables comes out float32).
  return y.to(at::promote_types(x_BSND.scalar_type(), cos_BSh.scalar_type()));
}

}  // namespace automoe::ops
