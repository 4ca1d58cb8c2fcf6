// Attention in bf16 on CPUs without native bf16 GEMMs (model/backend.cpp calls both): the engine's
// SDPA (ATen's bf16 flash-attention forward, its float32 backward) and eager attention's batched
// matmuls in float32 GEMMs. docs/ops.md#kernels.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>

#include "automoe/ops/common.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/ops/ops.h"

namespace automoe::ops {
namespace {

// SDPA on a CPU whose bf16 GEMMs ATen runs on its slow fallback (no AVX512_BF16 / AMX): the
// forward is ATen's bf16 flash attention, the kernel at::scaled_dot_product_attention runs there
// (the same outputs as Transformers'); its backward, whose bf16 GEMMs took ~19 % of a cpu-medium
// training step on an AVX2 EPYC, runs ATen's float32 flash-attention backward on the same saved
// tensors widened (exact), the gradients rounded once to bf16. q, k, v: [B, N, S, D], as many
// key/value heads as query heads.
struct SdpaBf16Fn : torch::autograd::Function<SdpaBf16Fn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                            const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& mask, bool is_causal, double scale) {
    // A bool mask becomes additive in q's dtype (0 / -inf), as at::scaled_dot_product_attention
    // hands it to this kernel.
    at::Tensor m;
    if (mask) {
      m = mask->scalar_type() != at::kBool
              ? *mask
              : at::zeros_like(*mask, q.scalar_type())
                    .masked_fill_(mask->logical_not(), -std::numeric_limits<double>::infinity());
    }
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, m.defined() ? std::optional<at::Tensor>(m) : std::nullopt, scale);
    ctx->save_for_backward({q, k, v, out, lse, m});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    detail::no_double_backward("sdpa (bf16, float32 backward)");
    const auto s = ctx->get_saved_variables();
    auto f = [](const at::Tensor& t) { return t.to(at::kFloat); };
    std::optional<at::Tensor> mask;
    if (s[5].defined()) mask = s[5].is_floating_point() ? f(s[5]) : s[5];
    auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        f(grads[0]), f(s[0]), f(s[1]), f(s[2]), f(s[3]), s[4], 0.0,
        ctx->saved_data["is_causal"].toBool(), mask, ctx->saved_data["scale"].toDouble());
    const auto t = s[0].scalar_type();
    return {dq.to(t), dk.to(t), dv.to(t), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// at::matmul(a, b) for bf16 [..., M, K] x [..., K, N] computed as ATen's bf16 GEMM computes it
// (float32 products and sums, each result rounded once to bf16) but in float32 GEMMs on the
// tensors widened: on CPUs without AVX512_BF16 / AMX ATen runs bf16 GEMMs on its scalar fallback
// (~1 GFLOP/s on an AVX2 EPYC against ~150 for float32), which made eager attention (GPT-OSS's,
// attn=eager) 2.8x the step of SDPA in bf16 at cpu-small. Saves a and b in bf16 (what ATen's bmm
// saves); the float32 copies live only inside one pass.
struct MatmulBf16Fn : torch::autograd::Function<MatmulBf16Fn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& a,
                            const at::Tensor& b) {
    ctx->save_for_backward({a, b});
    return at::matmul(a.to(at::kFloat), b.to(at::kFloat)).to(a.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    detail::no_double_backward("matmul (bf16 in float32 GEMMs)");
    const auto s = ctx->get_saved_variables();
    const at::Tensor g = grads[0].to(at::kFloat);
    const auto t = s[0].scalar_type();
    at::Tensor da, db;
    if (ctx->needs_input_grad(0)) da = at::matmul(g, s[1].to(at::kFloat).transpose(-2, -1)).to(t);
    if (ctx->needs_input_grad(1)) db = at::matmul(s[0].to(at::kFloat).transpose(-2, -1), g).to(t);
    return {da, db};
  }
};

}  // namespace

at::Tensor matmul(const at::Tensor& a, const at::Tensor& b) {
  RECORD_FUNCTION("automoe::matmul", c10::ArrayRef<const c10::IValue>{});
  const bool widen = a.is_cpu() && b.is_cpu() && a.scalar_type() == at::kBFloat16 &&
                     b.scalar_type() == at::kBFloat16 && a.dim() >= 2 && a.dim() == b.dim() &&
                     a.sizes().slice(0, a.dim() - 2) == b.sizes().slice(0, b.dim() - 2) &&
                     cpu::engine_preferred(at::kBFloat16);
  return widen ? MatmulBf16Fn::apply(a, b) : at::matmul(a, b);
}

bool sdpa_bf16_float_backward_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const std::optional<at::Tensor>& mask) {
  const bool grad = at::GradMode::is_enabled() &&
                    (q.requires_grad() || k.requires_grad() || v.requires_grad());
  return grad && q.is_cpu() && q.scalar_type() == at::kBFloat16 &&
         k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 && q.dim() == 4 &&
         k.dim() == 4 && v.dim() == 4 && q.size(3) == k.size(3) && k.size(3) == v.size(3) &&
         q.size(2) > 0 && k.size(2) > 0 && (!mask || !mask->requires_grad()) &&
         (!mask || mask->scalar_type() == at::kBool || mask->scalar_type() == q.scalar_type()) &&
         cpu::engine_preferred(at::kBFloat16);
}

at::Tensor sdpa_bf16_float_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const std::optional<at::Tensor>& mask, bool is_causal,
                                    double scale) {
  return SdpaBf16Fn::apply(q.contiguous(), k.contiguous(), v.contiguous(), mask, is_causal, scale);
}

}  // namespace automoe::ops
