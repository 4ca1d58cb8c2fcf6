// Rotary embedding kernel (CUDA): one thread per rotated pair, angles read as fp32.
#include <ATen/ops/empty.h>

#include "automoe/ops/cuda_common.cuh"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

// Grid: ceil(pairs / kThreads) blocks. Thread: pair p = ((b*S + s)*N + n)*half + i, i.e. the
// pair (i, i + half) (or (2i, 2i + 1) when INTERLEAVED) of row (b, s, n), rotated by the angle
// (cos, sign * sin)[b, s, i].
template <class T, class A, bool INTERLEAVED>
__global__ void rope_kernel(const T* __restrict__ x, const A* __restrict__ cos_t,
                            const A* __restrict__ sin_t, T* __restrict__ y, int64_t pairs,
                            int64_t heads, int64_t half, float sign) {
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (p >= pairs) return;
  const int64_t i = p % half;
  const int64_t row = p / half;
  const int64_t angle = (row / heads) * half + i;
  const float c = load_f(cos_t + angle);
  const float s = sign * load_f(sin_t + angle);
  const int64_t ia = row * 2 * half + (INTERLEAVED ? 2 * i : i);
  const int64_t ib = ia + (INTERLEAVED ? 1 : half);
  const float a = load_f(x + ia);
  const float b = load_f(x + ib);
  // Unfused products, as the CPU kernel: float32 results match it bit for bit.
  store_f(y + ia, __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
  store_f(y + ib, __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
}

}  // namespace

at::Tensor rope_apply(const at::Tensor& x_BSND, const at::Tensor& cos_BSh,
                      const at::Tensor& sin_BSh, bool interleaved, bool inverse) {
  const c10::cuda::CUDAGuard guard(x_BSND.device());
  TORCH_CHECK(cos_BSh.scalar_type() == sin_BSh.scalar_type(),
              "automoe::ops::cuda::rope_apply: cos and sin dtypes differ");
  TORCH_CHECK(x_BSND.size(3) % 2 == 0, "automoe::ops::cuda::rope_apply: odd head dim ",
              x_BSND.size(3));
  at::Tensor y = new_output(x_BSND.sizes(), x_BSND.options());
  const int64_t half = x_BSND.size(3) / 2;
  const int64_t pairs = x_BSND.numel() / 2;
  if (pairs == 0) return y;
  const unsigned blocks = grid_dim(ceil_div(pairs, kThreads));
  const float sign = inverse ? -1.f : 1.f;
  dispatch_float(x_BSND.scalar_type(), "rope_apply", [&](auto xt) {
    dispatch_float(cos_BSh.scalar_type(), "rope_apply", [&](auto at_) {
      using T = typename decltype(xt)::type;
      using A = typename decltype(at_)::type;
      const auto kernel = interleaved ? rope_kernel<T, A, true> : rope_kernel<T, A, false>;
      kernel<<<blocks, kThreads, 0, stream()>>>(ptr<T>(x_BSND), ptr<A>(cos_BSh),
                                                ptr<A>(sin_BSh), ptr<T>(y), pairs,
                                                x_BSND.size(2), half, sign);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return y;
}

}  // namespace automoe::ops::cuda
