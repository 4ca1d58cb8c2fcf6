#include <ATen/ATen.h>

#include "automoe/ops/rope/rope.h"

namespace automoe::ops {

at::Tensor rope_inv_freq(int64_t head_dim, double theta, double factor) {
  const at::Tensor exponent =
      at::arange(0, head_dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(head_dim);
  at::Tensor inv_freq = 1.0 / at::pow(theta, exponent);
  return factor == 1.0 ? inv_freq : inv_freq / factor;
}

std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& position_ids_BS,
                                               const at::Tensor& inv_freq, c10::ScalarType dtype) {
  const at::Tensor angles_BSh = position_ids_BS.to(at::kFloat).unsqueeze(-1) *
                                inv_freq.to(position_ids_BS.device()).view({1, 1, -1});
  const at::Tensor emb_BSD = at::cat({angles_BSh, angles_BSh}, -1);
  return {emb_BSD.cos().to(dtype), emb_BSD.sin().to(dtype)};
}

at::Tensor apply_rope_reference(const at::Tensor& x_BNSD, const at::Tensor& cos_BSD,
                                const at::Tensor& sin_BSD) {
  const int64_t half = x_BNSD.size(-1) / 2;
  const at::Tensor x1 = x_BNSD.narrow(-1, 0, half);
  const at::Tensor x2 = x_BNSD.narrow(-1, half, half);
  const at::Tensor rotated = at::cat({-x2, x1}, -1);
  const at::Tensor cos = cos_BSD.unsqueeze(1);
  const at::Tensor sin = sin_BSD.unsqueeze(1);
  return x_BNSD * cos + rotated * sin;
}

}  // namespace automoe::ops
