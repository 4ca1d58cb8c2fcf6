#include "automoe/model/rope.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

namespace automoe {
namespace {

// 1 / theta^(2i / dim), i < dim/2, in float32 (Transformers' `base ** (arange(0, dim, 2) / dim)`).
at::Tensor pos_freqs(int64_t dim, double theta) {
  const at::Tensor exponent =
      at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  return at::pow(theta, exponent);
}

// Transformers' _compute_yarn_parameters: frequencies between the interpolated (divided by
// `factor`) and the extrapolated ones, blended over the correction range of dimensions.
at::Tensor yarn_inv_freq(const RopeSpec& r) {
  const int64_t dim = r.dim;
  const double base = r.theta;
  const at::Tensor freqs = pos_freqs(dim, base);
  const at::Tensor extrapolation = 1.0 / freqs;
  const at::Tensor interpolation = 1.0 / (r.factor * freqs);
  auto correction_dim = [&](double rotations) {
    return (static_cast<double>(dim) *
            std::log(static_cast<double>(r.original_max_position_embeddings) /
                     (rotations * 2 * M_PI))) /
           (2 * std::log(base));
  };
  double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // prevent a singularity, as Transformers does
  const at::Tensor ramp =
      at::clamp((at::arange(dim / 2, at::kFloat) - low) / (high - low), 0, 1);
  const at::Tensor extrapolation_factor = 1 - ramp;
  return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
}

}  // namespace

at::Tensor rope_inv_freq(const RopeSpec& r) {
  switch (r.type) {
    case RopeType::kNone:
      return at::empty({0}, at::kFloat);
    case RopeType::kYarn:
      return yarn_inv_freq(r);
    case RopeType::kLinear:
      return 1.0 / pos_freqs(r.dim, r.theta) / r.factor;
    case RopeType::kDefault:
      break;
  }
  return 1.0 / pos_freqs(r.dim, r.theta);
}

std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& position_ids_BS,
                                              const at::Tensor& inv_freq, double attention_factor,
                                              c10::ScalarType dtype) {
  const at::Tensor angles_BSh = position_ids_BS.to(at::kFloat).unsqueeze(-1) *
                                inv_freq.to(position_ids_BS.device()).view({1, 1, -1});
  at::Tensor cos = angles_BSh.cos(), sin = angles_BSh.sin();
  if (attention_factor != 1.0) {
    cos = cos * attention_factor;
    sin = sin * attention_factor;
  }
  return {cos.to(dtype), sin.to(dtype)};
}

}  // namespace automoe
