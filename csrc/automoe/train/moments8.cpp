// AdamW's block-wise 8-bit moments through ATen ops (any device; the CPU step runs the fused
// adamw8 row kernel instead): codes and block scales to float32 values, and back.
#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include "automoe/ops/cpu/vec.h"
#include "automoe/train/optimizer.h"

namespace automoe::train {

namespace {

using ops::cpu::vec::kQuantBlock;

// The 8-bit map's values (or midpoints) on `dev`, copied there once per process: a copy from
// host memory per call would wait for the device on every tensor of every step. (Never freed: a
// device tensor must not outlive its runtime in a static destructor.)
at::Tensor qtable(const float* values, int64_t n, const at::Device& dev) {
  static std::mutex mu;
  static auto* cache = new std::map<std::tuple<const float*, int, int>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(mu);
  at::Tensor& t = (*cache)[{values, static_cast<int>(dev.type()), static_cast<int>(dev.index())}];
  if (!t.defined()) {
    t = at::from_blob(const_cast<float*>(values), {n}, at::kFloat)
            .to(dev, /*non_blocking=*/false, /*copy=*/true);
  }
  return t;
}

}  // namespace

int64_t AdamW::quant_cols(const at::Tensor& t) {
  return t.dim() == 0 ? 1 : std::max<int64_t>(1, t.size(-1));
}

at::Tensor AdamW::dequantize8(const at::Tensor& codes, const at::Tensor& scale, bool is_signed) {
  at::NoGradGuard no_grad;
  const int64_t cols = quant_cols(codes), rows = codes.numel() / cols, nb = scale.size(-1);
  const at::Tensor q = qtable(ops::cpu::vec::qmap8(is_signed), 256, codes.device());
  at::Tensor x = q.index_select(0, codes.reshape(-1).to(at::kInt)).view({rows, cols});
  if (nb * kQuantBlock != cols) x = at::constant_pad_nd(x, {0, nb * kQuantBlock - cols});
  x = x.view({rows, nb, kQuantBlock}) * scale.reshape({rows, nb, 1});
  // (contiguous: the fused AdamW reads its tensors as flat memory)
  return x.view({rows, nb * kQuantBlock}).narrow(1, 0, cols).contiguous().view(codes.sizes());
}

void AdamW::quantize8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      bool is_signed) {
  at::NoGradGuard no_grad;
  const int64_t cols = quant_cols(codes), rows = codes.numel() / cols, nb = scale.size(-1);
  // As the CPU kernel: a NaN stays out of its block's absmax (the block's other values keep their
  // scale) and takes the code of 0, as does anything scaled to NaN (an infinite absmax).
  constexpr double kInf = std::numeric_limits<double>::infinity();
  at::Tensor xr = x.to(at::kFloat).reshape({rows, cols}).nan_to_num(0.0, kInf, -kInf);
  if (nb * kQuantBlock != cols) xr = at::constant_pad_nd(xr, {0, nb * kQuantBlock - cols});
  const at::Tensor blocks = xr.view({rows, nb, kQuantBlock});
  // (a block whose largest magnitude is below the smallest normal float is flushed to zero, as
  // the CPU kernel does: its reciprocal would overflow)
  at::Tensor absmax = blocks.abs().amax(-1);
  absmax = at::where(absmax >= std::numeric_limits<float>::min(), absmax, at::zeros_like(absmax));
  const at::Tensor inv = at::where(absmax > 0, absmax.reciprocal(), at::zeros_like(absmax));
  const at::Tensor mids = qtable(ops::cpu::vec::qmid8(is_signed), 255, codes.device());
  // (the number of midpoints below each value: the nearest map value, ties to the lower)
  const at::Tensor c = at::bucketize((blocks * inv.unsqueeze(-1)).nan_to_num(0.0, kInf, -kInf),
                                     mids, /*out_int32=*/true);
  codes.copy_(c.view({rows, nb * kQuantBlock}).narrow(1, 0, cols).reshape(codes.sizes()));
  scale.copy_(absmax.view(scale.sizes()));
}

}  // namespace automoe::train
