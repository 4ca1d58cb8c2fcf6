// Rotary position embedding, half-split layout (Llama/Qwen): the head dim D is two halves
// [x1 | x2] and y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2 | x1].
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace automoe::ops {

// inv_freq_{D/2}[i] = 1 / (theta ^ (2i / D)) / factor, in float32.
at::Tensor rope_inv_freq(int64_t head_dim, double theta, double factor);

// cos and sin [B, S, D] for integer positions [B, S]: angles in float32, then cast to `dtype`.
std::pair<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& position_ids_BS,
                                               const at::Tensor& inv_freq, c10::ScalarType dtype);

// x [B, N, S, D] rotated by cos/sin [B, S, D] (broadcast over heads); reference composition.
at::Tensor apply_rope_reference(const at::Tensor& x_BNSD, const at::Tensor& cos_BSD,
                                const at::Tensor& sin_BSD);

}  // namespace automoe::ops
