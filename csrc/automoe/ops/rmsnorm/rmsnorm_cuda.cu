// RMSNorm kernels (CUDA): one block per row for y/dx, a two-pass fixed-order column reduction
// for dw. All math in fp32 with one rounding per output, in the CPU kernel's order:
// y = (x * inv) * w; dx = inv * (g * w - xhat * mean(g * w * xhat)); dw = sum_r g * xhat.
#include <ATen/ops/empty.h>

#include <algorithm>

#include "automoe/ops/cuda_common.cuh"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cuda {
namespace {

using namespace detail;

constexpr int kColThreads = 256;       // threads per block of the dw kernels (one column each)
constexpr int64_t kMaxRowChunks = 256; // row chunks of the dw partial sums
constexpr int64_t kMinChunkRows = 32;

// Product of all but the last dimension.
int64_t rows(const at::Tensor& x) {
  int64_t r = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) r *= x.size(d);
  return r;
}

// Grid: one block per row r. Block: threads stride over the row in packs of V elements.
template <class T, class W, int V>
__global__ void rmsnorm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ w,
                                   T* __restrict__ y, float* __restrict__ inv_rms, int64_t C,
                                   float eps) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * C;
  T* yr = y + row * C;
  float ss = 0.f;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < C; c += blockDim.x * V) {
    float v[V];
    load_pack<T, V>(xr + c, v);
#pragma unroll
    for (int j = 0; j < V; ++j) ss = fmaf(v[j], v[j], ss);
  }
  const float inv = 1.f / sqrtf(block_sum(ss, scratch) / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) inv_rms[row] = inv;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < C; c += blockDim.x * V) {
    float v[V];
    load_pack<T, V>(xr + c, v);
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = v[j] * inv * load_f(w + c + j);
    store_pack<T, V>(yr + c, v);
  }
}

// Grid: one block per row r. Block: threads stride over the row in packs of V elements.
template <class T, class W, int V>
__global__ void rmsnorm_dx_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                  const W* __restrict__ w, const float* __restrict__ inv_rms,
                                  T* __restrict__ dx, int64_t C) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* gr = g + row * C;
  const T* xr = x + row * C;
  const float inv = inv_rms[row];
  float dot = 0.f;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < C; c += blockDim.x * V) {
    float gv[V], xv[V];
    load_pack<T, V>(gr + c, gv);
    load_pack<T, V>(xr + c, xv);
#pragma unroll
    for (int j = 0; j < V; ++j) dot = fmaf(gv[j] * load_f(w + c + j), xv[j] * inv, dot);
  }
  const float mean = block_sum(dot, scratch) / static_cast<float>(C);
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < C; c += blockDim.x * V) {
    float gv[V], xv[V];
    load_pack<T, V>(gr + c, gv);
    load_pack<T, V>(xr + c, xv);
#pragma unroll
    for (int j = 0; j < V; ++j) gv[j] = inv * (gv[j] * load_f(w + c + j) - xv[j] * inv * mean);
    store_pack<T, V>(dx + row * C + c, gv);
  }
}

// Grid: (column blocks of kColThreads, row chunks). Thread: one column c, summing
// g * x * inv over the chunk's rows in order into partial[chunk, c].
template <class T>
__global__ void rmsnorm_dw_partial_kernel(const T* __restrict__ g, const T* __restrict__ x,
                                          const float* __restrict__ inv_rms,
                                          float* __restrict__ partial, int64_t R, int64_t C,
                                          int64_t chunk_rows) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColThreads + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t r1 = std::min(R, r0 + chunk_rows);
  float acc = 0.f;
  for (int64_t r = r0; r < r1; ++r)
    acc = fmaf(load_f(g + r * C + c), load_f(x + r * C + c) * inv_rms[r], acc);
  partial[blockIdx.y * C + c] = acc;
}

// Grid: column blocks of kColThreads. Thread: dw[c] = sum over chunks (in order) of partial.
template <class W>
__global__ void rmsnorm_dw_final_kernel(const float* __restrict__ partial, W* __restrict__ dw,
                                        int64_t chunks, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColThreads + threadIdx.x;
  if (c >= C) return;
  float acc = 0.f;
  for (int64_t k = 0; k < chunks; ++k) acc += partial[k * C + c];
  store_f(dw + c, acc);
}

// Calls f(Tag<X>, Tag<W>) for x's and w's dtypes.
template <class F>
void dispatch_xw(const at::Tensor& x, const at::Tensor& w, const char* kernel, F&& f) {
  dispatch_float(x.scalar_type(), kernel, [&](auto xt) {
    dispatch_float(w.scalar_type(), kernel, [&](auto wt) { f(xt, wt); });
  });
}

}  // namespace

std::pair<at::Tensor, at::Tensor> rmsnorm_fwd(const at::Tensor& x_RC, const at::Tensor& w_C,
                                              double eps) {
  const c10::cuda::CUDAGuard guard(x_RC.device());
  const int64_t C = x_RC.size(-1);
  const int64_t R = rows(x_RC);
  at::Tensor y = new_output(x_RC.sizes(), x_RC.options());
  at::Tensor inv_rms = new_output({R}, x_RC.options().dtype(at::kFloat));
  if (R == 0) return {y, inv_rms};
  dispatch_xw(x_RC, w_C, "rmsnorm_fwd", [&](auto xt, auto wt) {
    using T = typename decltype(xt)::type;
    using W = typename decltype(wt)::type;
    dispatch_pack<T>(pack_width<T>(C, ptr<T>(x_RC), ptr<T>(y)), [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      rmsnorm_fwd_kernel<T, W, V><<<grid_dim(R), row_threads(ceil_div(C, V)), 0, stream()>>>(
          ptr<T>(x_RC), ptr<W>(w_C), ptr<T>(y), ptr<float>(inv_rms), C,
          static_cast<float>(eps));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {y, inv_rms};
}

std::pair<at::Tensor, at::Tensor> rmsnorm_bwd(const at::Tensor& grad_RC, const at::Tensor& x_RC,
                                              const at::Tensor& w_C,
                                              const at::Tensor& inv_rms_R) {
  const c10::cuda::CUDAGuard guard(x_RC.device());
  TORCH_CHECK(grad_RC.scalar_type() == x_RC.scalar_type(),
              "automoe::ops::cuda::rmsnorm_bwd: grad dtype ", grad_RC.scalar_type(),
              " differs from x dtype ", x_RC.scalar_type());
  TORCH_CHECK(inv_rms_R.scalar_type() == at::kFloat,
              "automoe::ops::cuda::rmsnorm_bwd: inv_rms must be float32");
  const int64_t C = x_RC.size(-1);
  const int64_t R = rows(x_RC);
  at::Tensor dx = new_output(x_RC.sizes(), x_RC.options());
  at::Tensor dw = new_output(w_C.sizes(), w_C.options());
  if (C == 0) return {dx, dw};
  const int64_t chunks = std::min(kMaxRowChunks, ceil_div(R, kMinChunkRows));
  const int64_t chunk_rows = chunks > 0 ? ceil_div(R, chunks) : 0;
  at::Tensor partial = at::empty({chunks, C}, x_RC.options().dtype(at::kFloat));
  const int col_blocks = static_cast<int>(ceil_div(C, kColThreads));
  dispatch_xw(x_RC, w_C, "rmsnorm_bwd", [&](auto xt, auto wt) {
    using T = typename decltype(xt)::type;
    using W = typename decltype(wt)::type;
    if (R > 0) {
      const int width = pack_width<T>(C, ptr<T>(grad_RC), ptr<T>(x_RC), ptr<T>(dx));
      dispatch_pack<T>(width, [&](auto vec) {
        constexpr int V = decltype(vec)::value;
        rmsnorm_dx_kernel<T, W, V><<<grid_dim(R), row_threads(ceil_div(C, V)), 0, stream()>>>(
            ptr<T>(grad_RC), ptr<T>(x_RC), ptr<W>(w_C), ptr<float>(inv_rms_R), ptr<T>(dx), C);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      rmsnorm_dw_partial_kernel<T>
          <<<dim3(col_blocks, static_cast<unsigned>(chunks)), kColThreads, 0, stream()>>>(
              ptr<T>(grad_RC), ptr<T>(x_RC), ptr<float>(inv_rms_R), ptr<float>(partial), R, C,
              chunk_rows);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    rmsnorm_dw_final_kernel<W><<<col_blocks, kColThreads, 0, stream()>>>(
        ptr<float>(partial), ptr<W>(dw), chunks, C);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {dx, dw};
}

}  // namespace automoe::ops::cuda
