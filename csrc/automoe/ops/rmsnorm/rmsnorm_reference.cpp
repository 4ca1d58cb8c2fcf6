#include <ATen/ATen.h>

#include "automoe/ops/rmsnorm/rmsnorm.h"

namespace automoe::ops {

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // float32 statistics (float64 for float64 inputs: the op tests' ground truth).
  const at::Tensor x32 = x.to(x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  const at::Tensor inv_rms = at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * (x32 * inv_rms).to(x.scalar_type());
}

}  // namespace automoe::ops
