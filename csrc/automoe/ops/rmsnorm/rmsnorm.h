// RMSNorm: y = weight * (x * rsqrt(mean(x^2, -1) + eps)), statistics in float32, the normalised
// value cast back to x's dtype before the weight multiplies it (Transformers' order of rounding).
#pragma once

#include <ATen/core/Tensor.h>

namespace automoe::ops {

// The plain-ATen reference (backend "torch"); autograd through ATen.
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace automoe::ops
