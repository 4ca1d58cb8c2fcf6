#include <ATen/ATen.h>

#include "automoe/ops/rmsnorm/rmsnorm.h"

namespace automoe::ops {

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor inv_rms = at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * (x32 * inv_rms).to(x.scalar_type());
}

}  // namespace automoe::ops
