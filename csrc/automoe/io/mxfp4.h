// MXFP4 (OCP microscaling FP4), as GPT-OSS's released checkpoints store their experts: blocks of 32
// e2m1 values packed two per byte (low nibble first) with one e8m0 scale per block. Dequantised
// once, on load, exactly as Transformers' convert_moe_packed_tensors does.
#pragma once

#include <ATen/core/Tensor.h>

namespace automoe {

// blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype`:
// value = FP4[nibble] * 2^(scale - 127). Errors name `what` for malformed inputs.
at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales,
                            c10::ScalarType dtype, const std::string& what);

}  // namespace automoe
