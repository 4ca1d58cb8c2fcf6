// CPU rotary embedding: parallel over (batch, position); the angle row is read once per position
// and applied to every head.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cpu {

at::Tensor rope_apply(const at::Tensor& x_BSND, const at::Tensor& cos_BSh,
                      const at::Tensor& sin_BSh, bool interleaved, bool inverse) {
  const int64_t B = x_BSND.size(0), S = x_BSND.size(1), N = x_BSND.size(2), D = x_BSND.size(3);
  const int64_t h = D / 2;
  at::Tensor y = new_output(x_BSND.sizes(), x_BSND.options());
  // The tables in the compute precision (they are small: [B, S, D/2]).
  const auto acc_dtype = x_BSND.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor cs = cos_BSh.to(acc_dtype).contiguous();
  const at::Tensor sn = sin_BSh.to(acc_dtype).contiguous();
  const auto dtype = x_BSND.scalar_type();
  if (!interleaved && dtype != at::kDouble) {  // vectorised half-split rows (float32 / bfloat16)
    const char* x = static_cast<const char*>(x_BSND.const_data_ptr());
    char* o = static_cast<char*>(y.data_ptr());
    const float* c = cs.const_data_ptr<float>();
    const float* s = sn.const_data_ptr<float>();
    const int64_t es = x_BSND.element_size();
    const float sign = inverse ? -1.f : 1.f;
    at::parallel_for(0, B * S, 16, [&](int64_t begin, int64_t end) {
      // All N heads of a position in one call, read and written in their own dtype.
      for (int64_t bs = begin; bs < end; ++bs) {
        const int64_t off = bs * N * D * es;
        vec::rotate_heads(x + off, c + bs * h, s + bs * h, sign, o + off, dtype, N, h);
      }
    });
    return y;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x_BSND.scalar_type(), "rope_apply", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x = x_BSND.const_data_ptr<scalar_t>();
    scalar_t* o = y.data_ptr<scalar_t>();
    const acc_t* c = cs.const_data_ptr<acc_t>();
    const acc_t* s = sn.const_data_ptr<acc_t>();
    const acc_t sign = inverse ? acc_t(-1) : acc_t(1);
    at::parallel_for(0, B * S, 16, [&](int64_t begin, int64_t end) {
      for (int64_t bs = begin; bs < end; ++bs) {
        const acc_t* cr = c + bs * h;
        const acc_t* sr = s + bs * h;
        for (int64_t n = 0; n < N; ++n) {
          const scalar_t* xr = x + (bs * N + n) * D;
          scalar_t* yr = o + (bs * N + n) * D;
          for (int64_t i = 0; i < h; ++i) {
            const int64_t ia = interleaved ? 2 * i : i, ib = interleaved ? 2 * i + 1 : i + h;
            const acc_t xa = static_cast<acc_t>(xr[ia]), xb = static_cast<acc_t>(xr[ib]);
            const acc_t sv = sign * sr[i];
            yr[ia] = static_cast<scalar_t>(xa * cr[i] - xb * sv);
            yr[ib] = static_cast<scalar_t>(xb * cr[i] + xa * sv);
          }
        }
      }
    });
  });
  return y;
}

}  // namespace automoe::ops::cpu
