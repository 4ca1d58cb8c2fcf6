// Mamba-2's fused ops: the autograd layer of the conv1d and gated-RMSNorm kernels (the references
// are mamba_reference.cpp).
#include "automoe/ops/mamba/mamba.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include "automoe/ops/common.h"
#include "automoe/ops/cuda_status.h"
#include "automoe/ops/mamba/ssd_cpu.h"

namespace automoe::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::optional<at::Tensor> maybe(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

struct CausalConv1dFn : torch::autograd::Function<CausalConv1dFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& doc, bool silu) {
    const at::Tensor xc = x.contiguous(), wc = w.contiguous();
    const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();  // (saved undefined if absent)
    const at::Tensor dc = doc ? doc->contiguous() : at::Tensor();
    ctx->save_for_backward({xc, wc, bc, dc});
    ctx->saved_data["silu"] = silu;
    return AUTOMOE_KERNEL(causal_conv1d_fwd, xc, xc, wc, maybe(bc), maybe(dc), silu);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("causal_conv1d");
    const auto s = ctx->get_saved_variables();
    const at::Tensor g = grads[0].contiguous();
    auto [dx, dw, db] = AUTOMOE_KERNEL(causal_conv1d_bwd, g, g, s[0], s[1], maybe(s[2]), maybe(s[3]),
                                       ctx->saved_data["silu"].toBool());
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

struct GatedRmsNormFn : torch::autograd::Function<GatedRmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& z,
                            const at::Tensor& w, int64_t group, double eps) {
    const at::Tensor yc = y.contiguous(), zc = z.contiguous(), wc = w.contiguous();
    auto [out, inv] = AUTOMOE_KERNEL(gated_rmsnorm_fwd, yc, yc, zc, wc, group, eps);
    ctx->save_for_backward({yc, zc, wc, inv});  // the per-group inverse RMS: no normalised copy
    ctx->saved_data["group"] = group;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("gated_rms_norm");
    const auto s = ctx->get_saved_variables();
    const at::Tensor g = grads[0].contiguous();
    auto [dy, dz, dw] = AUTOMOE_KERNEL(gated_rmsnorm_bwd, g, g, s[0], s[1], s[2], s[3],
                                       ctx->saved_data["group"].toInt());
    return {dy, dz, dw, at::Tensor(), at::Tensor()};
  }
};

struct SsdScanFn : torch::autograd::Function<SsdScanFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& dt,
                               const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                               const at::Tensor& D, const std::optional<at::Tensor>& initial,
                               const std::optional<at::Tensor>& doc, int64_t chunk) {
    cpu::SsdArgs a{x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(), C.contiguous(),
                   D.contiguous(), std::nullopt, std::nullopt, chunk};
    if (initial) a.initial = initial->to(at::kFloat).contiguous();
    if (doc) a.doc = doc->to(at::kLong).contiguous();
    auto [y, fin] = cpu::ssd_scan_fwd(a, true);
    ctx->save_for_backward({a.x, a.dt, a.A, a.B, a.C, a.D, a.initial ? *a.initial : at::Tensor(),
                            a.doc ? *a.doc : at::Tensor()});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["initial_dtype"] = initial ? static_cast<int64_t>(initial->scalar_type()) : -1;
    return {y, fin};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("ssd_scan");
    const auto s = ctx->get_saved_variables();
    cpu::SsdArgs a{s[0], s[1], s[2], s[3], s[4], s[5], maybe(s[6]), maybe(s[7]),
                   ctx->saved_data["chunk"].toInt()};
    const at::Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(s[0], s[0].options().dtype(at::kFloat));
    const at::Tensor dfin = grads[1].defined() ? grads[1].to(at::kFloat).contiguous() : at::Tensor();
    cpu::SsdGrads g = cpu::ssd_scan_bwd(a, dy, dfin);
    const int64_t init_dtype = ctx->saved_data["initial_dtype"].toInt();
    at::Tensor dinit = g.dinitial.defined() && init_dtype >= 0
                           ? g.dinitial.to(static_cast<c10::ScalarType>(init_dtype)) : at::Tensor();
    return {g.dx, g.ddt, g.dA, g.dB, g.dC, g.dD, dinit, at::Tensor(), at::Tensor()};
  }
};

// The grouped form in ATen ops with its hand-derived backward (mamba_reference.cpp): only the
// inputs are saved, the forward's [B, H, c, Q, Q] tensors are recomputed in the backward.
struct SsdGroupedFn : torch::autograd::Function<SsdGroupedFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& dt,
                               const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
                               const at::Tensor& D, const std::optional<at::Tensor>& initial,
                               const std::optional<at::Tensor>& doc, int64_t chunk) {
    SsdScan r;
    {
      at::NoGradGuard no_grad;
      r = ssd_scan_aten(x, dt, A, B, C, D, chunk, initial, doc, true);
    }
    ctx->save_for_backward({x, dt, A, B, C, D, initial ? *initial : at::Tensor(), doc ? *doc : at::Tensor()});
    ctx->saved_data["chunk"] = chunk;
    return {r.y_BSHP, r.final_BHPN};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("ssd_scan");
    const auto s = ctx->get_saved_variables();
    const SsdGroupedGrads g = ssd_scan_aten_backward(s[0], s[1], s[2], s[3], s[4], s[5], ctx->saved_data["chunk"].toInt(),
                                                     maybe(s[6]), maybe(s[7]), grads[0], grads[1]);
    const at::Tensor dinit = s[6].defined() ? g.dinitial.to(s[6].scalar_type()) : at::Tensor();
    return {g.dx.to(s[0].scalar_type()), g.ddt.to(s[1].scalar_type()), g.dA.to(s[2].scalar_type()),
            g.dB.to(s[3].scalar_type()),  g.dC.to(s[4].scalar_type()),  g.dD.to(s[5].scalar_type()),
            dinit, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

SsdScan ssd_scan_grouped(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                         const at::Tensor& C, const at::Tensor& D, int64_t chunk,
                         const std::optional<at::Tensor>& initial, const std::optional<at::Tensor>& doc,
                         bool final_state) {
  RECORD_FUNCTION("automoe::ssd_scan_grouped", c10::ArrayRef<const c10::IValue>{});
  const variable_list out = SsdGroupedFn::apply(x, dt, A, B, C, D, initial, doc, chunk);
  SsdScan r;
  r.y_BSHP = out[0];
  if (final_state) r.final_BHPN = out[1];
  return r;
}

SsdScan ssd_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                 const at::Tensor& C, const at::Tensor& D, int64_t chunk,
                 const std::optional<at::Tensor>& initial, const std::optional<at::Tensor>& doc,
                 bool final_state) {
  RECORD_FUNCTION("automoe::ssd_scan", c10::ArrayRef<const c10::IValue>{});
  const char* op = "automoe.ssd_scan";
  AUTOMOE_CHECK(x.dim() == 4 && B.dim() == 4 && C.sizes() == B.sizes() && dt.dim() == 3 &&
                    dt.sizes() == x.sizes().slice(0, 3) && B.size(0) == x.size(0) &&
                    B.size(1) == x.size(1) && B.size(2) > 0 && x.size(2) % B.size(2) == 0 && chunk > 0,
                op, ": expected x [B, S, H, P], dt [B, S, H], B and C [B, S, G, N] with G dividing H and "
                "chunk > 0; got x ", x.sizes(), ", dt ", dt.sizes(), ", B ", B.sizes(), ", C ", C.sizes(),
                ", chunk ", chunk);
  AUTOMOE_CHECK(A.dim() == 1 && A.size(0) == x.size(2) && D.dim() == 1 && D.size(0) == x.size(2), op,
                ": A and D must be [", x.size(2), "] (x's heads), got ", A.sizes(), " and ", D.sizes());
  if (initial) {
    AUTOMOE_CHECK(initial->dim() == 4 && initial->size(0) == x.size(0) && initial->size(1) == x.size(2) &&
                      initial->size(2) == x.size(3) && initial->size(3) == B.size(3),
                  op, ": initial_state must be [B, H, P, N] = [", x.size(0), ", ", x.size(2), ", ",
                  x.size(3), ", ", B.size(3), "], got ", initial->sizes());
  }
  if (doc) {
    AUTOMOE_CHECK(doc->sizes() == x.sizes().slice(0, 2) && !doc->is_floating_point(), op,
                  ": document_ids must be integer [B, S] = [", x.size(0), ", ", x.size(1), "], got ",
                  doc->scalar_type(), " ", doc->sizes());
  }
  const auto t = x.scalar_type();
  const bool kernel = x.is_cpu() && (t == at::kFloat || t == at::kBFloat16) && B.scalar_type() == t &&
                      C.scalar_type() == t && dt.is_floating_point() && dt.scalar_type() != at::kDouble &&
                      A.scalar_type() == at::kFloat && D.scalar_type() != at::kDouble;
  if (!kernel && x.is_cuda() && use_cuda_kernel("ssd_scan")) {
    return ssd_scan_grouped(x, dt, A, B, C, D, chunk, initial, doc, final_state);
  }
  if (!kernel) return ssd_scan_aten(x, dt, A, B, C, D, chunk, initial, doc, final_state);
  const variable_list out = SsdScanFn::apply(x, dt, A, B, C, D, initial, doc, chunk);
  SsdScan r;
  r.y_BSHP = out[0];
  if (final_state) r.final_BHPN = out[1];
  return r;
}

at::Tensor causal_conv1d(const at::Tensor& x_BSC, const at::Tensor& w_CK,
                         const std::optional<at::Tensor>& bias_C,
                         const std::optional<at::Tensor>& doc_BS, bool silu) {
  RECORD_FUNCTION("automoe::causal_conv1d", c10::ArrayRef<const c10::IValue>{});
  const char* op = "automoe.causal_conv1d";
  detail::check_float(op, "x", x_BSC);
  detail::check_float(op, "w", w_CK);
  detail::check_same_dtype(op, "x", x_BSC, "w", w_CK);
  detail::check_dim(op, "x", x_BSC, 3);
  detail::check_dim(op, "w", w_CK, 2);
  AUTOMOE_CHECK(w_CK.size(0) == x_BSC.size(2) && w_CK.size(1) > 0, op,
                ": w must be [C, K] with C = x's channels (x is [B, S, C] = ", x_BSC.sizes(),
                "), got ", w_CK.sizes());
  if (bias_C) {
    detail::check_same_dtype(op, "x", x_BSC, "bias", *bias_C);
    AUTOMOE_CHECK(bias_C->dim() == 1 && bias_C->size(0) == x_BSC.size(2), op, ": bias must be [",
                  x_BSC.size(2), "], got ", bias_C->sizes());
  }
  if (doc_BS) {
    AUTOMOE_CHECK(doc_BS->scalar_type() == at::kLong &&
                      doc_BS->sizes() == x_BSC.sizes().slice(0, 2),
                  op, ": document_ids must be int64 [B, S] = [", x_BSC.size(0), ", ",
                  x_BSC.size(1), "], got ", doc_BS->scalar_type(), " ", doc_BS->sizes());
  }
  detail::check_same_device(op, {{"x", &x_BSC}, {"w", &w_CK}});
  if (x_BSC.scalar_type() == at::kDouble || (x_BSC.is_cuda() && !use_cuda_kernel("causal_conv1d"))) {
    return causal_conv1d_reference(x_BSC, w_CK, bias_C, doc_BS, silu);
  }
  return CausalConv1dFn::apply(x_BSC, w_CK, bias_C,
                               doc_BS ? std::optional<at::Tensor>(doc_BS->to(x_BSC.device())) : std::nullopt,
                               silu);
}

at::Tensor gated_rms_norm(const at::Tensor& y, const at::Tensor& z, const at::Tensor& weight,
                          int64_t group_size, double eps) {
  RECORD_FUNCTION("automoe::gated_rms_norm", c10::ArrayRef<const c10::IValue>{});
  const char* op = "automoe.gated_rms_norm";
  detail::check_float(op, "y", y);
  detail::check_float(op, "z", z);
  detail::check_float(op, "weight", weight);
  const int64_t width = y.dim() ? y.size(-1) : 0;
  AUTOMOE_CHECK(z.sizes() == y.sizes(), op, ": z must have y's shape ", y.sizes(), ", got ",
                z.sizes());
  AUTOMOE_CHECK(weight.dim() == 1 && weight.size(0) == width && width > 0, op,
                ": weight must be [", width, "] (y's last dimension), got ", weight.sizes());
  AUTOMOE_CHECK(group_size > 0 && width % group_size == 0, op, ": group_size ", group_size,
                " must divide y's last dimension ", width);
  detail::check_same_device(op, {{"y", &y}, {"z", &z}, {"weight", &weight}});
  // The kernels write y's dtype: the result's whenever the weight is no wider (Transformers' bf16
  // model: float32 y from the scan, bf16 gate and weight, a float32 result).
  const bool kernel_dtypes = at::promote_types(y.scalar_type(), weight.scalar_type()) == y.scalar_type() &&
                             z.scalar_type() != at::kDouble;
  if (!kernel_dtypes || y.scalar_type() == at::kDouble ||
      (y.is_cuda() && !use_cuda_kernel("gated_rmsnorm"))) {
    return gated_rms_norm_reference(y, z, weight, group_size, eps);
  }
  return GatedRmsNormFn::apply(y, z, weight, group_size, eps);
}

}  // namespace automoe::ops
