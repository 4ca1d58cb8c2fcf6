// torch.ops.automoe: every fused op and its `_reference` twin as a PyTorch custom op, so that
// Python callers (tests, benchmarks, users' own modules) run exactly the code the engine runs.
// Each is registered as CompositeImplicitAutograd: the op body is our C++ function, whose custom
// autograd Function (or, for references, ATen's own autograd) provides the backward, and whose
// kernel is chosen by the inputs' device.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "automoe/core/error.h"
#include "automoe/ops/cpu/isa.h"
#include "automoe/ops/cuda_status.h"
#include "automoe/ops/delta_rule/delta_rule.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/ops/mamba/mamba.h"
#include "automoe/ops/ops.h"
#include "automoe/ops/quant/quant.h"
#include "automoe/ops/rmsnorm/rmsnorm.h"

namespace automoe::ops {
namespace {

using Tensor = at::Tensor;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;

RouterParams router_params(int64_t top_k, const std::string& score_func, int64_t n_group,
                           int64_t topk_group, bool norm_topk_prob, double scaling) {
  AUTOMOE_CHECK(score_func == "softmax" || score_func == "sigmoid",
                "automoe.router: score_func must be \"softmax\" or \"sigmoid\", got \"",
                score_func, "\"");
  return {top_k, score_func == "sigmoid", n_group, topk_group, norm_topk_prob, scaling};
}

template <RouterResult (*Fn)(const Tensor&, const std::optional<Tensor>&, const RouterParams&)>
Tensor3 router_op(const Tensor& logits, int64_t top_k, std::string score_func,
                  const std::optional<Tensor>& bias, int64_t n_group, int64_t topk_group,
                  bool norm_topk_prob, double scaling) {
  const auto r = Fn(logits, bias,
                    router_params(top_k, score_func, n_group, topk_group, norm_topk_prob, scaling));
  return {r.weights_TK, r.idx_TK, r.scores_TE};
}

template <PermutePlan (*Fn)(const Tensor&, int64_t)>
Tensor3 permute_plan_op(const Tensor& indices, int64_t num_experts) {
  const PermutePlan p = Fn(indices, num_experts);
  return {p.offsets, p.slot_pos, p.src_token};
}

template <Tensor (*Fn)(const Tensor&, const PermutePlan&)>
Tensor permute_op(const Tensor& x, const Tensor& offsets, const Tensor& slot_pos,
                  const Tensor& src_token) {
  return Fn(x, PermutePlan{offsets, slot_pos, src_token});
}

template <Tensor (*Fn)(const Tensor&, const PermutePlan&, const Tensor&)>
Tensor unpermute_op(const Tensor& y, const Tensor& offsets, const Tensor& slot_pos,
                    const Tensor& src_token, const Tensor& weights) {
  return Fn(y, PermutePlan{offsets, slot_pos, src_token}, weights);
}

SwigluParams swiglu_params(const std::string& variant, double alpha, double limit) {
  AUTOMOE_CHECK(variant == "silu" || variant == "gpt_oss",
                "automoe.swiglu: variant must be \"silu\" or \"gpt_oss\", got \"", variant, "\"");
  return {variant == "gpt_oss", alpha, limit};
}

template <Tensor (*Fn)(const Tensor&, const SwigluParams&)>
Tensor swiglu_op(const Tensor& gate_up, std::string variant, double alpha, double limit) {
  return Fn(gate_up, swiglu_params(variant, alpha, limit));
}

std::tuple<Tensor, Tensor> lce_op(const Tensor& x, const Tensor& w, const Tensor& labels,
                                  int64_t ignore_index, int64_t chunk_bytes) {
  const auto r = linear_cross_entropy(x, w, labels, ignore_index, chunk_bytes);
  return {r.sum, r.count};
}

std::tuple<Tensor, Tensor> lce_reference_op(const Tensor& x, const Tensor& w, const Tensor& labels,
                                            int64_t ignore_index, int64_t /*chunk_bytes*/) {
  const auto r = linear_cross_entropy_reference(x, w, labels, ignore_index);
  return {r.sum, r.count};
}

c10::Dict<std::string, std::string> cpu_kernel_paths_op() {
  c10::Dict<std::string, std::string> d;
  for (const auto& [k, v] : cpu::kernel_paths()) d.insert(k, v);
  return d;
}

// Caps the CPU instruction-set level ("" = what the CPU has) and forces a GEMM path ("" = the
// level's choice): the op tests run every path this CPU has.
void set_cpu_paths_op(std::string isa, std::string gemm) {
  cpu::force_gemm_path("");
  cpu::set_isa(isa.empty() ? cpu::detected_isa() : cpu::parse_isa(isa));
  cpu::force_gemm_path(gemm);
}

std::vector<std::string> cpu_gemm_paths_op() {
  std::vector<std::string> out;
  for (const cpu::GemmPath p : cpu::gemm_paths_available()) out.push_back(cpu::gemm_path_name(p));
  return out;
}

// (all CUDA kernel families, those validated on a GPU, those CUDA tensors run now)
std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>>
cuda_kernels_op() {
  std::vector<std::string> on;
  for (const auto& n : cuda_kernel_names()) {
    if (use_cuda_kernel(n.c_str())) on.push_back(n);
  }
  return {cuda_kernel_names(), validated_cuda_kernels(), on};
}

template <SsdScan (*Fn)(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, int64_t, const std::optional<Tensor>&,
                        const std::optional<Tensor>&, bool)>
std::tuple<Tensor, Tensor> ssd_scan_op(const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B,
                                       const Tensor& C, const Tensor& D, int64_t chunk,
                                       const std::optional<Tensor>& initial_state,
                                       const std::optional<Tensor>& document_ids) {
  const SsdScan r = Fn(x, dt, A, B, C, D, chunk, initial_state, document_ids, true);
  return {r.y_BSHP, r.final_BHPN};
}

// With packed documents no final state is formed (an empty tensor comes back).
template <DeltaRule (*Fn)(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t,
                          const std::optional<Tensor>&, const std::optional<Tensor>&, bool)>
std::tuple<Tensor, Tensor> delta_rule_op(const Tensor& q, const Tensor& k, const Tensor& v,
                                                   const Tensor& g, const Tensor& beta, int64_t chunk,
                                                   const std::optional<Tensor>& initial_state,
                                                   const std::optional<Tensor>& document_ids) {
  const DeltaRule r = Fn(q, k, v, g, beta, chunk, initial_state, document_ids, !document_ids);
  return {r.o_BSNV, r.final_BNKV.defined() ? r.final_BNKV : at::empty({0}, q.options())};
}

// Quantised weights as two tensors (codes, absmax) and their description: [O, K] weights are one
// expert.
QuantizedWeight quantized_of(const Tensor& codes, const Tensor& absmax, const std::string& type,
                             int64_t blocksize, at::IntArrayRef shape, c10::ScalarType dtype) {
  AUTOMOE_CHECK(shape.size() == 2 || shape.size() == 3,
                "automoe quantised weight: shape must be [O, K] or [E, O, K], got ", shape);
  QuantizedWeight q;
  q.type = quant_type_from_name(type, "automoe quantised weight");
  q.blocksize = blocksize;
  q.experts = shape.size() == 3 ? shape[0] : 1;
  q.out_features = shape[shape.size() - 2];
  q.in_features = shape.back();
  q.dtype = dtype;
  const bool int8 = q.type == QuantType::kInt8;
  AUTOMOE_CHECK(int8 || (blocksize >= 2 && blocksize % 2 == 0),
                "automoe quantised weight: a 4-bit block size must be even and at least 2, got ", blocksize);
  const int64_t n = q.out_features * q.in_features;
  const int64_t code_cols = int8 ? n : (n + 1) / 2;
  const int64_t abs_cols = int8 ? q.out_features : (n + blocksize - 1) / std::max<int64_t>(blocksize, 1);
  AUTOMOE_CHECK(codes.numel() == q.experts * code_cols &&
                    codes.scalar_type() == (int8 ? at::kChar : at::kByte),
                "automoe quantised weight: codes must be ", int8 ? "int8" : "uint8", " with ",
                q.experts * code_cols, " elements, got ", codes.scalar_type(), " ", codes.sizes());
  AUTOMOE_CHECK(absmax.numel() == q.experts * abs_cols && absmax.scalar_type() == at::kFloat,
                "automoe quantised weight: absmax must be float32 with ", q.experts * abs_cols,
                " elements, got ", absmax.scalar_type(), " ", absmax.sizes());
  q.codes = int8 ? codes.reshape({q.experts, q.out_features, q.in_features}).contiguous()
                 : codes.reshape({q.experts, code_cols}).contiguous();
  q.absmax = absmax.reshape({q.experts, abs_cols}).contiguous();
  return q;
}

std::tuple<Tensor, Tensor> quantize_op(const Tensor& w, const std::string& type, int64_t blocksize) {
  AUTOMOE_CHECK(w.dim() == 2 || w.dim() == 3, "automoe.quantize: w must be [O, K] or [E, O, K], got ",
                w.sizes());
  const QuantizedWeight q = quantize(w.dim() == 2 ? w.unsqueeze(0) : w,
                                     quant_type_from_name(type, "automoe.quantize"), blocksize,
                                     w.scalar_type(), "automoe.quantize: w");
  return {q.codes, q.absmax};
}

template <at::Tensor (*Fn)(const QuantizedWeight&, int64_t, int64_t, c10::ScalarType)>
Tensor dequantize_op(const Tensor& codes, const Tensor& absmax, const std::string& type,
                     int64_t blocksize, at::IntArrayRef shape, c10::ScalarType dtype) {
  const QuantizedWeight q = quantized_of(codes, absmax, type, blocksize, shape, dtype);
  return Fn(q, 0, q.experts, dtype).reshape(shape);
}

Tensor grouped_gemm_quantized_op(const Tensor& x, const Tensor& codes, const Tensor& absmax,
                                 const std::string& type, int64_t blocksize, at::IntArrayRef shape,
                                 const Tensor& offsets) {
  return grouped_gemm_quantized(
      x, quantized_of(codes, absmax, type, blocksize, shape, x.scalar_type()), offsets);
}

std::tuple<Tensor, Tensor> delta_rule_step_reference_op(const Tensor& state, const Tensor& q,
                                                        const Tensor& k, const Tensor& v,
                                                        const Tensor& g, const Tensor& beta) {
  Tensor s = state;
  Tensor o = gated_delta_rule_step_reference(s, q, k, v, g, beta);
  return {o, s};
}

}  // namespace

TORCH_LIBRARY(automoe, m) {
  const char* router_args =
      "(Tensor logits, int top_k, str score_func=\"softmax\", Tensor? correction_bias=None, "
      "int n_group=1, int topk_group=1, bool norm_topk_prob=True, "
      "float routed_scaling_factor=1.0) -> (Tensor weights, Tensor indices, Tensor scores)";
  m.def((std::string("router") + router_args).c_str(), TORCH_FN(router_op<router>));
  m.def((std::string("router_reference") + router_args).c_str(), TORCH_FN(router_op<router_reference>));
  const char* plan_args =
      "(Tensor indices, int num_experts) -> (Tensor offsets, Tensor slot_pos, Tensor src_token)";
  m.def((std::string("moe_permute_plan") + plan_args).c_str(),
        TORCH_FN(permute_plan_op<permute_plan>));
  m.def((std::string("moe_permute_plan_reference") + plan_args).c_str(),
        TORCH_FN(permute_plan_op<permute_plan_reference>));
  const char* permute_args = "(Tensor x, Tensor offsets, Tensor slot_pos, Tensor src_token) -> Tensor";
  m.def((std::string("permute") + permute_args).c_str(), TORCH_FN(permute_op<permute>));
  m.def((std::string("permute_reference") + permute_args).c_str(), TORCH_FN(permute_op<permute_reference>));
  const char* unpermute_args =
      "(Tensor y, Tensor offsets, Tensor slot_pos, Tensor src_token, Tensor weights) -> Tensor";
  m.def((std::string("unpermute") + unpermute_args).c_str(), TORCH_FN(unpermute_op<unpermute>));
  m.def((std::string("unpermute_reference") + unpermute_args).c_str(),
        TORCH_FN(unpermute_op<unpermute_reference>));
  m.def("grouped_gemm(Tensor x, Tensor w, Tensor offsets) -> Tensor", TORCH_FN(grouped_gemm));
  m.def("grouped_gemm_reference(Tensor x, Tensor w, Tensor offsets) -> Tensor",
        TORCH_FN(grouped_gemm_reference));
  // (its reference is at::linear itself: torch.nn.functional.linear)
  m.def("linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor", TORCH_FN(linear));
  const char* lora_args = "(Tensor x, Tensor w, Tensor a, Tensor b, Tensor offsets, float scaling) -> Tensor";
  m.def((std::string("grouped_gemm_lora") + lora_args).c_str(), TORCH_FN(grouped_gemm_lora));
  m.def((std::string("grouped_gemm_lora_reference") + lora_args).c_str(),
        TORCH_FN(grouped_gemm_lora_reference));
  const char* swiglu_args =
      "(Tensor gate_up, str variant=\"silu\", float alpha=1.702, float limit=7.0) -> Tensor";
  m.def((std::string("swiglu") + swiglu_args).c_str(), TORCH_FN(swiglu_op<swiglu>));
  m.def((std::string("swiglu_reference") + swiglu_args).c_str(), TORCH_FN(swiglu_op<swiglu_reference>));
  m.def("rmsnorm(Tensor x, Tensor weight, float eps=1e-6) -> Tensor", TORCH_FN(rmsnorm));
  m.def("rmsnorm_reference(Tensor x, Tensor weight, float eps=1e-6) -> Tensor",
        TORCH_FN(rms_norm_reference));
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor", TORCH_FN(rope));
  m.def("rope_reference(Tensor x, Tensor cos, Tensor sin, bool interleaved=False) -> Tensor",
        TORCH_FN(rope_reference));
  const char* lce_args =
      "(Tensor x, Tensor weight, Tensor labels, int ignore_index=-100, int chunk_bytes=0) -> "
      "(Tensor loss_sum, Tensor count)";
  m.def((std::string("linear_cross_entropy") + lce_args).c_str(), TORCH_FN(lce_op));
  m.def((std::string("linear_cross_entropy_reference") + lce_args).c_str(), TORCH_FN(lce_reference_op));
  // Mamba-2 (ops/mamba/mamba.h): the SSD scan the model runs, the conv1d and the gated norm, and
  // their references.
  const std::string ssd_args =
      "(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, int chunk, Tensor? initial_state=None, "
      "Tensor? document_ids=None) -> (Tensor y, Tensor final_state)";
  m.def((std::string("ssd_scan") + ssd_args).c_str(), TORCH_FN(ssd_scan_op<ssd_scan>));
  m.def((std::string("ssd_scan_reference") + ssd_args).c_str(), TORCH_FN(ssd_scan_op<ssd_scan_reference>));
  // Gated DeltaNet (ops/delta_rule/delta_rule.h): the chunked gated delta rule, its reference,
  // and the one-token step.
  const char* delta_args =
      "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, int chunk, Tensor? initial_state=None, "
      "Tensor? document_ids=None) -> (Tensor o, Tensor final_state)";
  m.def((std::string("chunk_gated_delta_rule") + delta_args).c_str(),
        TORCH_FN(delta_rule_op<chunk_gated_delta_rule>));
  m.def((std::string("chunk_gated_delta_rule_reference") + delta_args).c_str(),
        TORCH_FN(delta_rule_op<chunk_gated_delta_rule_reference>));
  m.def("gated_delta_rule_step_reference(Tensor state, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta) "
        "-> (Tensor o, Tensor new_state)",
        TORCH_FN(delta_rule_step_reference_op));
  const char* conv_args =
      "(Tensor x, Tensor w, Tensor? bias=None, Tensor? document_ids=None, bool silu=False) -> Tensor";
  m.def((std::string("causal_conv1d") + conv_args).c_str(), TORCH_FN(causal_conv1d));
  m.def((std::string("causal_conv1d_reference") + conv_args).c_str(), TORCH_FN(causal_conv1d_reference));
  const char* gated_args = "(Tensor y, Tensor z, Tensor weight, int group_size, float eps=1e-5) -> Tensor";
  m.def((std::string("gated_rms_norm") + gated_args).c_str(), TORCH_FN(gated_rms_norm));
  m.def((std::string("gated_rms_norm_reference") + gated_args).c_str(), TORCH_FN(gated_rms_norm_reference));
  // Quantised frozen weights (ops/quant/quant.h), bitsandbytes' formats.
  m.def("quantize(Tensor w, str quant_type, int blocksize=64) -> (Tensor codes, Tensor absmax)",
        TORCH_FN(quantize_op));
  const char* dq_args =
      "(Tensor codes, Tensor absmax, str quant_type, int blocksize, int[] shape, ScalarType dtype) -> Tensor";
  m.def((std::string("dequantize") + dq_args).c_str(), TORCH_FN(dequantize_op<dequantize>));
  m.def((std::string("dequantize_reference") + dq_args).c_str(),
        TORCH_FN(dequantize_op<dequantize_reference>));
  m.def("grouped_gemm_quantized(Tensor x, Tensor codes, Tensor absmax, str quant_type, int blocksize, "
        "int[] shape, Tensor offsets) -> Tensor",
        TORCH_FN(grouped_gemm_quantized_op));
  m.def("_set_poison_outputs(bool on) -> ()", TORCH_FN(set_poison_outputs));
  m.def("_cpu_kernel_paths() -> Dict(str, str)", TORCH_FN(cpu_kernel_paths_op));
  m.def("_set_cpu_paths(str isa=\"\", str gemm=\"\") -> ()", TORCH_FN(set_cpu_paths_op));
  m.def("_cpu_gemm_paths() -> str[]", TORCH_FN(cpu_gemm_paths_op));
  m.def("_cuda_kernels() -> (str[] names, str[] validated, str[] enabled)",
        TORCH_FN(cuda_kernels_op));
}

}  // namespace automoe::ops
