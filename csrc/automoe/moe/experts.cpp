#include "automoe/moe/experts.h"

#include <ATen/ATen.h>

#include "automoe/core/error.h"
#include "automoe/ops/cuda_status.h"
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

const LoraFactors* gate_up_of(const ExpertLora* l) {
  return l && l->gate_up.defined() ? &l->gate_up : nullptr;
}
const LoraFactors* down_of(const ExpertLora* l) {
  return l && l->down.defined() ? &l->down : nullptr;
}

// One expert's projection x·w[e]ᵀ (+ its adapter), Transformers' and PEFT's order of operations.
at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& w_EOK, int64_t e,
                         const LoraFactors* f) {
  at::Tensor y = at::linear(x, w_EOK[e]);
  if (!f) return y;
  const auto dt = x.scalar_type();
  return y + at::linear(at::linear(x, f->a[e].to(dt)), f->b[e].to(dt)) * f->scaling;
}

// Our grouped GEMM, with the adapter inside it when there is one.
at::Tensor grouped(const at::Tensor& x_NK, const at::Tensor& w, const at::Tensor& offsets,
                   const LoraFactors* f) {
  if (!f) return ops::grouped_gemm(x_NK, w, offsets);
  const auto dt = x_NK.scalar_type();
  return ops::grouped_gemm_lora(x_NK, w, f->a.to(dt), f->b.to(dt), offsets, f->scaling);
}

// ATen's _grouped_mm (cumulative row ends `ends`), with the adapter as two more grouped products.
at::Tensor grouped_mm(const at::Tensor& x_NK, const at::Tensor& w, const at::Tensor& ends,
                      const LoraFactors* f) {
  at::Tensor y = at::_grouped_mm(x_NK, w.transpose(1, 2), ends);
  if (!f) return y;
  const auto dt = x_NK.scalar_type();
  at::Tensor a = f->a.to(dt), b = f->b.to(dt);
  // _grouped_mm wants 16-byte strides: pad the rank with zero rows of A / columns of B (the same
  // product).
  const int64_t per = 16 / static_cast<int64_t>(c10::elementSize(dt)), r = a.size(1);
  if (r % per != 0) {
    const int64_t pad = per - r % per;
    a = at::constant_pad_nd(a, {0, 0, 0, pad});
    b = at::constant_pad_nd(b, {0, pad});
  }
  const at::Tensor u = at::_grouped_mm(x_NK, a.transpose(1, 2), ends);
  return y + at::_grouped_mm(u, b.transpose(1, 2), ends) * f->scaling;
}

// Between the two projections: SwiGLU on the fused gate/up output (`fused`: our op, else ATen's),
// or relu² on a plain up output.
at::Tensor activate(const at::Tensor& h, ExpertMlp mlp, bool fused) {
  if (mlp == ExpertMlp::kRelu2) return at::square(at::relu(h));
  return fused ? ops::swiglu(h) : ops::swiglu_reference(h);
}

}  // namespace

at::Tensor experts_eager(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                         const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                         const at::Tensor& w_down_EHI, const ExpertLora* lora, ExpertMlp mlp) {
  return loop_over_experts(
      x_TH, idx_TK, weights_TK, w_gate_up_EIH.size(0), x_TH.scalar_type(),
      [&](int64_t e, const at::Tensor& x_eH) {
        const at::Tensor h = expert_linear(x_eH, w_gate_up_EIH, e, gate_up_of(lora));
        if (mlp == ExpertMlp::kRelu2) {
          return expert_linear(at::square(at::relu(h)), w_down_EHI, e, down_of(lora));
        }
        const auto gate_up = h.chunk(2, -1);
        return expert_linear(at::silu(gate_up[0]) * gate_up[1], w_down_EHI, e, down_of(lora));
      });
}

at::Tensor experts_grouped(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                           const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                           const at::Tensor& w_down_EHI, const ExpertLora* lora, ExpertMlp mlp) {
  if (x_TH.is_cuda() && !ops::use_cuda_kernel("grouped_gemm")) {  // ops/cuda_status.h
    return experts_torch_mm(x_TH, idx_TK, weights_TK, w_gate_up_EIH, w_down_EHI, lora, mlp);
  }
  const ops::PermutePlan plan = ops::permute_plan(idx_TK, w_gate_up_EIH.size(0));
  const at::Tensor x_NH = ops::permute(x_TH, plan);
  const at::Tensor h_NI =
      activate(grouped(x_NH, w_gate_up_EIH, plan.offsets, gate_up_of(lora)), mlp, true);
  return ops::unpermute(grouped(h_NI, w_down_EHI, plan.offsets, down_of(lora)), plan, weights_TK);
}

at::Tensor experts_grouped_reference_swiglu(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                                            const at::Tensor& weights_TK,
                                            const at::Tensor& w_gate_up_EIH,
                                            const at::Tensor& w_down_EHI, const ExpertLora* lora,
                                            ExpertMlp mlp) {
  const ops::PermutePlan plan = ops::permute_plan(idx_TK, w_gate_up_EIH.size(0));
  const at::Tensor gu =
      grouped(ops::permute(x_TH, plan), w_gate_up_EIH, plan.offsets, gate_up_of(lora));
  return ops::unpermute(
      grouped(activate(gu, mlp, false), w_down_EHI, plan.offsets, down_of(lora)), plan,
      weights_TK);
}

at::Tensor experts_torch_mm(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                            const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                            const at::Tensor& w_down_EHI, const ExpertLora* lora, ExpertMlp mlp) {
  const ops::PermutePlan plan = ops::permute_plan(idx_TK, w_gate_up_EIH.size(0));
  // _grouped_mm takes the cumulative row ends of each group as int32.
  const at::Tensor ends = plan.offsets.narrow(0, 1, w_gate_up_EIH.size(0)).to(at::kInt);
  const at::Tensor x_NH = ops::permute_reference(x_TH, plan);
  const at::Tensor gu = grouped_mm(x_NH, w_gate_up_EIH, ends, gate_up_of(lora));
  const at::Tensor y = grouped_mm(activate(gu, mlp, false), w_down_EHI, ends, down_of(lora));
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
  // Our grouped GEMM takes [E, O, K] weights: the transposed views, which its CPU kernels read in
  // place (grouped_gemm.cpp: kernel_weights).
  const at::Tensor gu = ops::grouped_gemm(ops::permute(x, plan), w_gu.transpose(1, 2), plan.offsets) +
                        b_gate_up_EI2.index_select(0, expert_N);
  y = ops::grouped_gemm(swiglu(gu).to(mm), w_d.transpose(1, 2), plan.offsets) +
      b_down_EH.index_select(0, expert_N);
  return ops::unpermute(y, plan, weights_TK).to(x_TH.scalar_type());
}

at::Tensor experts_on_rows(const std::string& backend, const at::Tensor& x_NH,
                           const at::Tensor& offsets_G1, const at::Tensor& w_gate_up_GIH,
                           const at::Tensor& w_down_GHI, bool fused_swiglu,
                           const ExpertLora* lora, ExpertMlp mlp) {
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
      const at::Tensor h = expert_linear(x_NH.narrow(0, lo, n), w_gate_up_GIH, g, gate_up_of(lora));
      ys.push_back(expert_linear(activate(h, mlp, false), w_down_GHI, g, down_of(lora)));
    }
    return ys.size() == 1 ? ys.front() : at::cat(ys, 0);
  }
  if (backend == "torch_mm") {
    const at::Tensor ends = offsets_G1.narrow(0, 1, G).to(at::kInt);
    const at::Tensor gu = grouped_mm(x_NH, w_gate_up_GIH, ends, gate_up_of(lora));
    return grouped_mm(activate(gu, mlp, false), w_down_GHI, ends, down_of(lora));
  }
  AUTOMOE_CHECK(backend == "grouped", "experts backend \"", backend, "\" is unknown (grouped, torch_mm, eager)");
  if (x_NH.is_cuda() && !ops::use_cuda_kernel("grouped_gemm")) {  // ops/cuda_status.h
    return experts_on_rows("torch_mm", x_NH, offsets_G1, w_gate_up_GIH, w_down_GHI, fused_swiglu,
                           lora, mlp);
  }
  return grouped(activate(grouped(x_NH, w_gate_up_GIH, offsets_G1, gate_up_of(lora)), mlp, fused_swiglu),
                 w_down_GHI, offsets_G1, down_of(lora));
}

at::Tensor experts_by_name(const std::string& backend, const at::Tensor& x_TH,
                           const at::Tensor& idx_TK, const at::Tensor& weights_TK,
                           const at::Tensor& w_gate_up_EIH, const at::Tensor& w_down_EHI,
                           const ExpertLora* lora, ExpertMlp mlp) {
  if (backend == "grouped") {
    return experts_grouped(x_TH, idx_TK, weights_TK, w_gate_up_EIH, w_down_EHI, lora, mlp);
  }
  if (backend == "torch_mm") {
    return experts_torch_mm(x_TH, idx_TK, weights_TK, w_gate_up_EIH, w_down_EHI, lora, mlp);
  }
  if (backend == "eager") {
    return experts_eager(x_TH, idx_TK, weights_TK, w_gate_up_EIH, w_down_EHI, lora, mlp);
  }
  fail("experts backend \"", backend, "\" is unknown (grouped, torch_mm, eager)");
}

namespace {

// x·dequantize(w)ᵀ on grouped rows, plus the adapter's (x·Aᵀ)·Bᵀ·scaling (PEFT's order).
at::Tensor grouped_quantized(const at::Tensor& x_NK, const ops::QuantizedWeight& w,
                             const at::Tensor& offsets, const LoraFactors* f) {
  at::Tensor y = ops::grouped_gemm_quantized(x_NK, w, offsets);
  if (!f) return y;
  const auto dt = x_NK.scalar_type();
  const at::Tensor u = ops::grouped_gemm(x_NK, f->a.to(dt), offsets);
  return y + ops::grouped_gemm(u, f->b.to(dt), offsets) * f->scaling;
}

// Expert e's MLP on its rows x_eH with its weights dequantised: Transformers' order of
// operations, as experts_eager.
at::Tensor quantized_expert(const at::Tensor& x_eH, const QuantizedExperts& q, int64_t e,
                            const ExpertLora* lora, ExpertMlp mlp) {
  const auto dt = x_eH.scalar_type();
  // (the dequantising GEMM on this expert alone: autograd keeps no dense copy of its weight)
  auto proj = [&](const at::Tensor& x, const ops::QuantizedWeight& w, const LoraFactors* f) {
    ops::QuantizedWeight one = w;
    one.experts = 1;
    one.codes = w.codes.narrow(0, e, 1);
    one.absmax = w.absmax.narrow(0, e, 1);
    const at::Tensor rows = at::tensor({int64_t{0}, x.size(0)}, at::kLong);
    at::Tensor y = ops::grouped_gemm_quantized(x.contiguous(), one, rows.to(x.device()));
    if (!f) return y;
    return y + at::linear(at::linear(x, f->a[e].to(dt)), f->b[e].to(dt)) * f->scaling;
  };
  const at::Tensor h = proj(x_eH, *q.gate_up, gate_up_of(lora));
  return proj(activate(h, mlp, false), *q.down, down_of(lora));
}

void check_quantized(const QuantizedExperts& q, const std::string& backend) {
  AUTOMOE_CHECK(q.gate_up && q.down && q.gate_up->experts == q.down->experts,
                "quantised experts: both projections must be quantised, for the same experts");
  AUTOMOE_CHECK(backend == "grouped" || backend == "torch_mm" || backend == "eager",
                "experts backend \"", backend, "\" is unknown (grouped, torch_mm, eager)");
}

}  // namespace

at::Tensor experts_quantized(const std::string& backend, const at::Tensor& x_TH,
                             const at::Tensor& idx_TK, const at::Tensor& weights_TK,
                             const QuantizedExperts& q, bool fused_swiglu, const ExpertLora* lora,
                             ExpertMlp mlp) {
  check_quantized(q, backend);
  const int64_t E = q.gate_up->experts;
  if (backend == "eager") {
    return loop_over_experts(x_TH, idx_TK, weights_TK, E, x_TH.scalar_type(),
                             [&](int64_t e, const at::Tensor& x_eH) {
                               return quantized_expert(x_eH, q, e, lora, mlp);
                             });
  }
  const ops::PermutePlan plan = ops::permute_plan(idx_TK, E);
  const at::Tensor y = experts_on_rows_quantized(backend, ops::permute(x_TH, plan), plan.offsets, q,
                                                 fused_swiglu, lora, mlp);
  return ops::unpermute(y, plan, weights_TK);
}

at::Tensor experts_on_rows_quantized(const std::string& backend, const at::Tensor& x_NH,
                                     const at::Tensor& offsets_G1, const QuantizedExperts& q,
                                     bool fused_swiglu, const ExpertLora* lora, ExpertMlp mlp) {
  check_quantized(q, backend);
  if (backend == "eager") {  // one expert at a time, on its rows (as experts_on_rows)
    const at::Tensor off = offsets_G1.cpu();
    const int64_t G = q.gate_up->experts;
    std::vector<at::Tensor> ys;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t lo = off[g].item<int64_t>(), n = off[g + 1].item<int64_t>() - lo;
      if (n == 0 && !(g == G - 1 && ys.empty())) continue;
      ys.push_back(quantized_expert(x_NH.narrow(0, lo, n), q, g, lora, mlp));
    }
    return ys.size() == 1 ? ys.front() : at::cat(ys, 0);
  }
  const bool fused = fused_swiglu && backend == "grouped";
  return grouped_quantized(
      activate(grouped_quantized(x_NH, *q.gate_up, offsets_G1, gate_up_of(lora)), mlp, fused),
      *q.down, offsets_G1, down_of(lora));
}

}  // namespace automoe::moe
