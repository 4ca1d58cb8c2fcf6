// grouped_gemm: autograd layer and ATen reference.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <utility>

#include "automoe/ops/common.h"
#include "automoe/ops/cuda_status.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/ops/ops.h"

namespace automoe::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// dX and dW of y[rows of g] = x[rows of g]·w[g]ᵀ (inputs 0 and 1 of the Function), each only
// when autograd wants it.
std::pair<at::Tensor, at::Tensor> grouped_gemm_grads(AutogradContext* ctx, const at::Tensor& dy,
                                                     const at::Tensor& x, const at::Tensor& w_GOK,
                                                     const at::Tensor& offsets) {
  at::Tensor dx, dw;
  if (ctx->needs_input_grad(0)) dx = AUTOMOE_KERNEL(grouped_gemm_dx, dy, dy, w_GOK, offsets);
  if (ctx->needs_input_grad(1)) {
    dw = AUTOMOE_KERNEL(grouped_gemm_dw, dy, dy, x, offsets, w_GOK.size(0), w_GOK.scalar_type());
  }
  return {dx, dw};
}

// The weights as the kernel reads them: the CPU engine takes each group's [O, K] in either
// layout — rows of K (contiguous) or stored transposed, [G, K, O] viewed as [G, O, K] (GPT-OSS's
// experts): that view is read in place, not copied per call (GPT-OSS's experts' GEMMs on an AVX2
// EPYC: 1.10x). float32 groups that run on MKL (aten_faster_fp32) get the copy:
// MKL's dX GEMM on the transposed view measured slower than the copy saves. Anything else, and
// CUDA, contiguous.
at::Tensor kernel_weights(const at::Tensor& w) {
  if (w.is_cpu() && w.dim() == 3 && !w.is_contiguous() && w.transpose(1, 2).is_contiguous() &&
      !(w.scalar_type() == at::kFloat && cpu::aten_faster_fp32())) {
    return w;
  }
  return w.contiguous();
}

struct GroupedGemmFn : torch::autograd::Function<GroupedGemmFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& offsets) {
    const at::Tensor xc = x.contiguous(), wc = kernel_weights(w);
    ctx->save_for_backward({xc, wc, offsets});
    return AUTOMOE_KERNEL(grouped_gemm_fwd, xc, xc, wc, offsets);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("grouped_gemm (and linear)");
    const auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w = s[1], &offsets = s[2];
    auto [dx, dw] = grouped_gemm_grads(ctx, grads[0].contiguous(), x, w, offsets);
    return {dx, dw, at::Tensor()};
  }
};

// ops::linear with a bias on the CPU engine (bf16 x, w, bias): the bias joins the float32
// accumulator and the sum is rounded once, as ATen's addmm does; adding it to the rounded
// product (a second rounding) differed from at::linear by an ulp here and there.
struct LinearBiasFn : torch::autograd::Function<LinearBiasFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_NK, const at::Tensor& w_OK,
                            const at::Tensor& bias) {
    const at::Tensor xc = x_NK.contiguous(), wc = w_OK.contiguous();
    ctx->save_for_backward({xc, wc});
    const int64_t N = xc.size(0), O = wc.size(0), K = wc.size(1);
    at::Tensor acc = at::empty({N, O}, xc.options().dtype(at::kFloat));
    acc.copy_(bias.expand({N, O}));  // C = bias, then C += x·wᵀ in float32
    cpu::gemm_batch({{N, O, K, {xc.const_data_ptr(), xc.scalar_type(), K, 1},
                      {wc.const_data_ptr(), wc.scalar_type(), 1, K}, acc.data_ptr(), at::kFloat, O,
                      /*accumulate=*/true}});
    return acc.to(xc.scalar_type());
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("linear");
    const auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w = s[1];
    const at::Tensor dy = grads[0].contiguous();
    const at::Tensor offsets = at::tensor({int64_t{0}, x.size(0)}, at::kLong);
    auto [dx, dw] = grouped_gemm_grads(ctx, dy, x, w.unsqueeze(0), offsets);
    at::Tensor db;
    if (ctx->needs_input_grad(2)) db = dy.sum(0);  // as autograd reduces addmm's bias gradient
    return {dx, dw.defined() ? dw.squeeze(0) : dw, db};
  }
};

void check_grouped(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets) {
  const char* op = "automoe.grouped_gemm";
  detail::check_float(op, "x", x);
  detail::check_float(op, "w", w);
  detail::check_dim(op, "x", x, 2);
  detail::check_dim(op, "w", w, 3);
  detail::check_same_dtype(op, "x", x, "w", w);
  detail::check_same_device(op, {{"x", &x}, {"w", &w}, {"offsets", &offsets}});
  AUTOMOE_CHECK(x.size(1) == w.size(2), op, ": x [N, K] and w [G, O, K] disagree on K: ",
                x.sizes(), " vs ", w.sizes());
  AUTOMOE_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                    offsets.size(0) == w.size(0) + 1,
                op, ": offsets must be int64 [G+1] = [", w.size(0) + 1, "], got ",
                offsets.scalar_type(), " ", offsets.sizes());
  if (offsets.is_cpu()) {  // on CUDA the offsets stay on the device (no host sync)
    const int64_t* o = offsets.const_data_ptr<int64_t>();
    AUTOMOE_CHECK(o[0] == 0, op, ": offsets[0] must be 0, got ", o[0]);
    for (int64_t g = 0; g < w.size(0); ++g) {
      AUTOMOE_CHECK(o[g + 1] >= o[g], op, ": offsets must be non-decreasing (offsets[", g + 1,
                    "] = ", o[g + 1], " < offsets[", g, "] = ", o[g], ")");
    }
    AUTOMOE_CHECK(o[w.size(0)] <= x.size(0), op, ": offsets[G] = ", o[w.size(0)],
                  " exceeds the rows of x (", x.size(0), ")");
  }
}

// y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ per group: LoRA on the grouped GEMM, computed on the rows as they are
// (the [N, r] product x·Aᵀ is the only extra activation; W + s·B·A is never formed). W takes a
// gradient only when it requires one (a frozen base does not).
struct GroupedGemmLoraFn : torch::autograd::Function<GroupedGemmLoraFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets,
                            double scaling) {
    const at::Tensor xc = x.contiguous(), wc = w.contiguous(), ac = a.contiguous(),
                     bc = b.contiguous();
    const at::Tensor u = AUTOMOE_KERNEL(grouped_gemm_fwd, xc, xc, ac, offsets);  // [N, r]
    at::Tensor y = AUTOMOE_KERNEL(grouped_gemm_fwd, xc, xc, wc, offsets);
    y.add_(AUTOMOE_KERNEL(grouped_gemm_fwd, u, u, bc, offsets), scaling);
    ctx->save_for_backward({xc, wc, ac, bc, offsets, u});
    ctx->saved_data["scaling"] = scaling;
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("grouped_gemm_lora");
    const auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w = s[1], &a = s[2], &b = s[3], &offsets = s[4], &u = s[5];
    const double scaling = ctx->saved_data["scaling"].toDouble();
    const at::Tensor dy = grads[0].contiguous();
    const int64_t G = w.size(0);
    // du = s·dy·B (per group), the gradient reaching the [N, r] product.
    const at::Tensor du = AUTOMOE_KERNEL(grouped_gemm_dx, dy, dy, b, offsets).mul_(scaling);
    at::Tensor dx, dw, da, db;
    if (ctx->needs_input_grad(0)) {
      dx = AUTOMOE_KERNEL(grouped_gemm_dx, dy, dy, w, offsets);
      dx.add_(AUTOMOE_KERNEL(grouped_gemm_dx, du, du, a, offsets));
    }
    if (ctx->needs_input_grad(1)) {
      dw = AUTOMOE_KERNEL(grouped_gemm_dw, dy, dy, x, offsets, G, w.scalar_type());
    }
    if (ctx->needs_input_grad(2)) {
      da = AUTOMOE_KERNEL(grouped_gemm_dw, du, du, x, offsets, G, a.scalar_type());
    }
    if (ctx->needs_input_grad(3)) {
      db = AUTOMOE_KERNEL(grouped_gemm_dw, dy, dy, u, offsets, G, b.scalar_type()).mul_(scaling);
    }
    return {dx, dw, da, db, at::Tensor(), at::Tensor()};
  }
};

void check_lora(const at::Tensor& x, const at::Tensor& w, const at::Tensor& a,
                const at::Tensor& b) {
  const char* op = "automoe.grouped_gemm_lora";
  detail::check_float(op, "a", a);
  detail::check_float(op, "b", b);
  detail::check_dim(op, "a", a, 3);
  detail::check_dim(op, "b", b, 3);
  detail::check_same_dtype(op, "x", x, "a", a);
  detail::check_same_dtype(op, "x", x, "b", b);
  detail::check_same_device(op, {{"x", &x}, {"a", &a}, {"b", &b}});
  const int64_t G = w.size(0), O = w.size(1), K = w.size(2), r = a.size(1);
  AUTOMOE_CHECK(a.size(0) == G && a.size(2) == K && r > 0, op, ": a must be [G, r, K] = [", G,
                ", r, ", K, "] like w [G, O, K] = ", w.sizes(), ", got ", a.sizes());
  AUTOMOE_CHECK(b.size(0) == G && b.size(1) == O && b.size(2) == r, op, ": b must be [G, O, r] = [",
                G, ", ", O, ", ", r, "], got ", b.sizes());
}

}  // namespace

at::Tensor grouped_gemm_lora(const at::Tensor& x_NK, const at::Tensor& w_GOK,
                             const at::Tensor& a_GRK, const at::Tensor& b_GOR,
                             const at::Tensor& offsets_in, double scaling) {
  const at::Tensor offsets = offsets_in.contiguous();
  check_grouped(x_NK, w_GOK, offsets);
  check_lora(x_NK, w_GOK, a_GRK, b_GOR);
  if (x_NK.is_cuda() && !use_cuda_kernel("grouped_gemm")) {
    return grouped_gemm_lora_reference(x_NK, w_GOK, a_GRK, b_GOR, offsets, scaling);
  }
  return GroupedGemmLoraFn::apply(x_NK, w_GOK, a_GRK, b_GOR, offsets, scaling);
}

at::Tensor grouped_gemm_lora_reference(const at::Tensor& x_NK, const at::Tensor& w_GOK,
                                       const at::Tensor& a_GRK, const at::Tensor& b_GOR,
                                       const at::Tensor& offsets, double scaling) {
  check_lora(x_NK, w_GOK, a_GRK, b_GOR);
  const at::Tensor u = grouped_gemm_reference(x_NK, a_GRK, offsets);
  return grouped_gemm_reference(x_NK, w_GOK, offsets) +
         grouped_gemm_reference(u, b_GOR, offsets) * scaling;
}

at::Tensor grouped_gemm(const at::Tensor& x_NK, const at::Tensor& w_GOK, const at::Tensor& offsets_in) {
  RECORD_FUNCTION("automoe::grouped_gemm", c10::ArrayRef<const c10::IValue>{});
  const at::Tensor offsets = offsets_in.contiguous();  // checked and used: the same tensor
  check_grouped(x_NK, w_GOK, offsets);
  if (x_NK.is_cuda() && !use_cuda_kernel("grouped_gemm"))
    return grouped_gemm_reference(x_NK, w_GOK, offsets);
  return GroupedGemmFn::apply(x_NK, w_GOK, offsets);
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  RECORD_FUNCTION("automoe::linear", c10::ArrayRef<const c10::IValue>{});
  // (a bias of another dtype, or empty operands: at::linear's promotion rules and messages)
  const bool engine = x.is_cpu() && w.is_cpu() && x.scalar_type() == at::kBFloat16 &&
                      w.scalar_type() == at::kBFloat16 && w.dim() == 2 && x.dim() >= 1 &&
                      x.size(-1) == w.size(1) && w.numel() > 0 && x.numel() > 0 &&
                      (!bias || !bias->defined() || bias->scalar_type() == at::kBFloat16) &&
                      cpu::engine_preferred(at::kBFloat16);
  if (!engine) return at::linear(x, w, bias);  // (which also names any mismatch)
  const at::Tensor x_NK = x.reshape({-1, w.size(1)});
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = w.size(0);
  if (bias && bias->defined()) {
    AUTOMOE_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "linear: bias must be [",
                  w.size(0), "] for weight ", w.sizes(), ", got ", bias->sizes());
    return LinearBiasFn::apply(x_NK, w, *bias).view(shape);
  }
  const at::Tensor offsets = at::tensor({int64_t{0}, x_NK.size(0)}, at::kLong);
  return GroupedGemmFn::apply(x_NK, w.unsqueeze(0), offsets).view(shape);
}

at::Tensor grouped_gemm_reference(const at::Tensor& x_NK, const at::Tensor& w_GOK,
                                  const at::Tensor& offsets) {
  const at::Tensor off = offsets.cpu().contiguous();
  check_grouped(x_NK, w_GOK, off.to(offsets.device()));
  const int64_t* o = off.const_data_ptr<int64_t>();
  const int64_t G = w_GOK.size(0);
  std::vector<at::Tensor> parts;
  for (int64_t g = 0; g < G; ++g) {
    parts.push_back(at::matmul(x_NK.narrow(0, o[g], o[g + 1] - o[g]), w_GOK[g].t()));
  }
  const int64_t tail = x_NK.size(0) - o[G];
  parts.push_back(at::zeros({tail, w_GOK.size(1)}, x_NK.options()));
  return at::cat(parts, 0);
}

}  // namespace automoe::ops
