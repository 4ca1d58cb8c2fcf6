// Expert computation: out[t] = sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),
// e = idx[t, k], with experts held fused: w_gate_up [E, 2I, H] (gate rows first, then up rows),
// w_down [E, H, I].
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "automoe/ops/quant/quant.h"

namespace automoe::moe {

// LoRA on one fused expert weight w [E, O, K]: per-expert factors a [E, r, K] and b [E, O, r]
// (PEFT's target_parameters adapter), so that expert e computes x·w[e]ᵀ + scaling·(x·a[e]ᵀ)·b[e]ᵀ.
// The factors may be in another dtype than x (float32 adapters on a bf16 model): they are cast to
// the compute dtype, differentiably.
struct LoraFactors {
  at::Tensor a, b;
  double scaling = 0.0;
  bool defined() const { return a.defined(); }
};
// What runs between an expert's two projections. kSwiglu: the fused [E, 2I, H] gate/up weight,
// silu(gate) * up. kRelu2: a plain up weight [E, I, H] (Nemotron-H's experts have no gate), relu(up)².
// The `w_gate_up` arguments below hold whichever of the two the kind says.
enum class ExpertMlp { kSwiglu, kRelu2 };

// The routed experts' adapters: on gate_up_proj, down_proj, either or both (undefined = none).
struct ExpertLora {
  LoraFactors gate_up, down;
};

// The `eager` backend: a loop over the experts that received tokens, Transformers' semantics and
// order of accumulation (experts in ascending order, index_add into a zeroed output).
at::Tensor experts_eager(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                         const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                         const at::Tensor& w_down_EHI,
    const ExpertLora* lora = nullptr, ExpertMlp mlp = ExpertMlp::kSwiglu);

// The `grouped` backend: the fused ops router -> permute -> grouped_gemm -> swiglu -> grouped_gemm
// -> unpermute (ops/ops.h). Rows are grouped by expert in the deterministic order of
// ops::permute_plan; each token's K expert outputs are combined in slot order with float32
// accumulation. weights_TK may be float32 (the router's) or x's dtype.
at::Tensor experts_grouped(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                           const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                           const at::Tensor& w_down_EHI,
    const ExpertLora* lora = nullptr, ExpertMlp mlp = ExpertMlp::kSwiglu);

// The same dispatch and grouped GEMMs around ATen's SwiGLU (ops::swiglu_reference): the `grouped`
// experts with BackendConfig swiglu="torch".
at::Tensor experts_grouped_reference_swiglu(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                                            const at::Tensor& weights_TK,
                                            const at::Tensor& w_gate_up_EIH,
                                            const at::Tensor& w_down_EHI,
    const ExpertLora* lora = nullptr, ExpertMlp mlp = ExpertMlp::kSwiglu);

// The `torch_mm` backend: the same dispatch with ATen's `_grouped_mm` for both GEMMs and ATen
// gathers / SwiGLU around them (the composition NeMo AutoModel's `torch_mm` uses).
at::Tensor experts_torch_mm(const at::Tensor& x_TH, const at::Tensor& idx_TK,
                            const at::Tensor& weights_TK, const at::Tensor& w_gate_up_EIH,
                            const at::Tensor& w_down_EHI,
    const ExpertLora* lora = nullptr, ExpertMlp mlp = ExpertMlp::kSwiglu);

// GPT-OSS's experts (Transformers' GptOssExperts): weights stored transposed, w_gate_up [E, H, 2I]
// with gate and up interleaved along the last dim, w_down [E, I, H], biases [E, 2I] and [E, H],
// and the clamped SwiGLU (ops::SwigluParams::gpt_oss). The eager loop follows Transformers' order;
// the grouped one runs the fused permute -> grouped GEMM (+ per-row expert bias) -> SwiGLU ->
// grouped GEMM -> unpermute (`fused_swiglu` false: ATen's SwiGLU reference in between).
// `compute_dtype` (torch.autocast's): the two GEMMs run in it, as autocast runs Transformers'
// matmuls; the biases, SwiGLU and combine then promote as Transformers' do.
// `backend`: "eager" (the loop), "grouped" (our grouped GEMM on the weights' transposed view) or
// "torch_mm" (ATen's _grouped_mm, which reads the stored [E, H, 2I] / [E, I, H] as they are).
at::Tensor experts_gpt_oss(const std::string& backend, const at::Tensor& x_TH,
                           const at::Tensor& idx_TK, const at::Tensor& weights_TK,
                           const at::Tensor& w_gate_up_EHI2, const at::Tensor& b_gate_up_EI2,
                           const at::Tensor& w_down_EIH, const at::Tensor& b_down_EH,
                           bool fused_swiglu, std::optional<c10::ScalarType> compute_dtype);

// The experts on rows already grouped by expert (what an expert-parallel dispatcher delivers):
// rows [offsets[g], offsets[g+1]) run expert g of w_gate_up [G, 2I, H] / w_down [G, H, I]; the
// unweighted outputs [N, H] in x's dtype. `backend` as BackendConfig.experts; `fused_swiglu`
// false takes ATen's SwiGLU (ops::swiglu_reference).
at::Tensor experts_on_rows(const std::string& backend, const at::Tensor& x_NH,
                           const at::Tensor& offsets_G1, const at::Tensor& w_gate_up_GIH,
                           const at::Tensor& w_down_GHI, bool fused_swiglu,
                           const ExpertLora* lora = nullptr, ExpertMlp mlp = ExpertMlp::kSwiglu);

// By BackendConfig name: "grouped", "torch_mm" or "eager". Every backend (GPT-OSS's excepted)
// takes `lora`: the adapters run inside it on each expert's rows, never as w + scaling·b·a.
at::Tensor experts_by_name(const std::string& backend, const at::Tensor& x_TH,
                           const at::Tensor& idx_TK, const at::Tensor& weights_TK,
                           const at::Tensor& w_gate_up_EIH, const at::Tensor& w_down_EHI,
    const ExpertLora* lora = nullptr, ExpertMlp mlp = ExpertMlp::kSwiglu);

// Frozen quantised experts (a LoRA base, ops/quant/quant.h): w_gate_up [E, 2I, H] (or the plain
// up weight) and w_down [E, H, I] as stored quantised. The same computation as the backends above
// with each expert's weights dequantised to x's dtype where it runs (a few experts at a time,
// never the whole tensor): `backend` "eager" loops over the experts in Transformers' order, the
// others run the permute -> dequantising grouped GEMM -> activation -> ... path; `lora` adds the
// adapters' grouped products beside the base GEMMs.
struct QuantizedExperts {
  const ops::QuantizedWeight* gate_up = nullptr;
  const ops::QuantizedWeight* down = nullptr;
};
at::Tensor experts_quantized(const std::string& backend, const at::Tensor& x_TH,
                             const at::Tensor& idx_TK, const at::Tensor& weights_TK,
                             const QuantizedExperts& q, bool fused_swiglu,
                             const ExpertLora* lora = nullptr, ExpertMlp mlp = ExpertMlp::kSwiglu);
// experts_on_rows for quantised experts (expert parallelism's local experts).
at::Tensor experts_on_rows_quantized(const std::string& backend, const at::Tensor& x_NH,
                                     const at::Tensor& offsets_G1, const QuantizedExperts& q,
                                     bool fused_swiglu, const ExpertLora* lora = nullptr,
                                     ExpertMlp mlp = ExpertMlp::kSwiglu);

}  // namespace automoe::moe
