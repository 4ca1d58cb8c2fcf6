// A frozen weight stored quantised as bitsandbytes stores it (Transformers' BitsAndBytesConfig):
// NF4 / FP4 (4-bit codes, blocks of `blocksize` consecutive elements of the row-major weight, one
// float32 absmax per block) or int8 (LLM.int8: per-row absmax, `round(w · 127 / absmax)`), one
// quantised tensor per expert as bitsandbytes quantises each nn.Linear. The grouped GEMM
// dequantises a few experts at a time into a scratch buffer (never the whole tensor) and runs the
// engine's GEMM on them; the weights are frozen (LoRA's base), only x gets a gradient.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace automoe::ops {

enum class QuantType { kNF4, kFP4, kInt8 };
// "nf4" | "fp4" | "int8"; anything else an error naming `what`.
QuantType quant_type_from_name(const std::string& name, const std::string& what);
const char* to_string(QuantType type);
// A 4-bit format's 16 code values (bitsandbytes' get_4bit_type), float32.
const float* code_book(QuantType type);

struct QuantizedWeight {
  QuantType type = QuantType::kNF4;
  int64_t blocksize = 64;  // 4-bit only
  // 4-bit: uint8 [E, ceil(O*K/2)], element 2j in the high nibble of byte j (bitsandbytes' packing);
  // int8: int8 [E, O, K].
  at::Tensor codes;
  // float32: 4-bit [E, ceil(O*K/blocksize)], int8 [E, O] (bitsandbytes' SCB).
  at::Tensor absmax;
  int64_t experts = 0, out_features = 0, in_features = 0;  // the dequantised [E, O, K]
  c10::ScalarType dtype = c10::ScalarType::BFloat16;       // what it dequantises to
  bool defined() const { return codes.defined(); }
  int64_t bytes() const;
  // The same weight with codes and absmax on `device`, dequantising to `dtype`.
  QuantizedWeight to(const c10::Device& device, c10::ScalarType dtype) const;
};

// Quantises w [E, O, K] (any float dtype; computed in float32 as bitsandbytes does: the absmax,
// w · (1 / absmax) clamped to [-1, 1], the nearest code with ties to the lower one) to dequantise
// to `dtype`. Non-finite values are an error naming `what`.
QuantizedWeight quantize(const at::Tensor& w_EOK, QuantType type, int64_t blocksize,
                         c10::ScalarType dtype, const std::string& what);
// Experts [begin, begin + count) dequantised, [count, O, K] in `dtype`: float32(code · absmax)
// rounded once (4-bit, as bitsandbytes' dequantize_4bit), int8 · absmax / 127 likewise.
at::Tensor dequantize(const QuantizedWeight& q, int64_t begin, int64_t count, c10::ScalarType dtype);
// The same from ATen ops: the reference (tests) and what non-CPU devices run.
at::Tensor dequantize_reference(const QuantizedWeight& q, int64_t begin, int64_t count,
                                c10::ScalarType dtype);

// y[rows of e] = x[rows of e] · dequantize(q, e)ᵀ over row ranges [offsets[e], offsets[e+1]) of
// x [N, K] (rows past offsets[E] give 0), in x's dtype; differentiable in x (the weight is
// frozen). Experts without rows are not dequantised.
at::Tensor grouped_gemm_quantized(const at::Tensor& x_NK, const QuantizedWeight& q,
                                  const at::Tensor& offsets_E1);

}  // namespace automoe::ops
