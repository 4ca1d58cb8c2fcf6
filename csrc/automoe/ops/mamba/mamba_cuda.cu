// Mamba-2's conv1d and gated-RMSNorm kernels (CUDA), the CPU kernels' math in fp32 with one
// rounding per output (two for the gated norm's output, as the reference). The conv: one thread
// per (position, channel), the SiLU's input recomputed in the backward; weight and bias gradients
// as fixed-order two-pass column reductions (deterministic). Not the default until bench/gpu.sh
// has run them on a GPU (ops/cuda_status.h).
#include <ATen/ops/empty.h>

#include <algorithm>

#include "automoe/ops/cuda_common.cuh"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kMaxTaps = 8;             // the conv's K (Mamba-2 uses 4)
constexpr int64_t kMaxRowChunks = 256;  // row chunks of the column reductions
constexpr int64_t kMinChunkRows = 32;

__device__ __forceinline__ float sigmoidf(float v) { return 1.f / (1.f + __expf(-v)); }

struct Conv {
  int64_t B, S, C, K;
  const int64_t* doc;  // [B, S] or null
  __device__ bool tap(int64_t b, int64_t t, int64_t s) const {
    return s >= 0 && s < S && (doc == nullptr || doc[b * S + s] == doc[b * S + t]);
  }
  // bias + the valid taps of output (b, t) in channel c.
  template <class T>
  __device__ float pre(const T* x, const T* w, const T* bias, int64_t b, int64_t t, int64_t c) const {
    float acc = bias != nullptr ? load_f(bias + c) : 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t s = t - K + 1 + k;
      if (tap(b, t, s)) acc = fmaf(load_f(w + c * K + k), load_f(x + (b * S + s) * C + c), acc);
    }
    return acc;
  }
  // dy * silu'(pre) at (b, t, c) (dy when no SiLU).
  template <class T>
  __device__ float gy(const T* dy, const T* x, const T* w, const T* bias, bool silu, int64_t b,
                      int64_t t, int64_t c) const {
    const float d = load_f(dy + (b * S + t) * C + c);
    if (!silu) return d;
    const float a = pre(x, w, bias, b, t, c), s = sigmoidf(a);
    return d * s * (1.f + a * (1.f - s));
  }
};

// Grid: (channel blocks, B * S). Thread: one output element.
template <class T>
__global__ void conv_fwd_kernel(Conv v, const T* __restrict__ x, const T* __restrict__ w,
                                const T* __restrict__ bias, T* __restrict__ y, bool silu) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t r = blockIdx.y;
  if (c >= v.C) return;
  const float a = v.pre(x, w, bias, r / v.S, r % v.S, c);
  store_f(y + r * v.C + c, silu ? a * sigmoidf(a) : a);
}

// Grid: (channel blocks, B * S). Thread: dx at (b, s, c) from the outputs that read it.
template <class T>
__global__ void conv_dx_kernel(Conv v, const T* __restrict__ dy, const T* __restrict__ x,
                               const T* __restrict__ w, const T* __restrict__ bias,
                               T* __restrict__ dx, bool silu) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t r = blockIdx.y, b = r / v.S, s = r % v.S;
  if (c >= v.C) return;
  float acc = 0.f;
  for (int64_t k = 0; k < v.K; ++k) {
    const int64_t t = s + v.K - 1 - k;
    if (t < v.S && v.tap(b, t, s)) {
      acc = fmaf(load_f(w + c * v.K + k), v.gy(dy, x, w, bias, silu, b, t, c), acc);
    }
  }
  store_f(dx + r * v.C + c, acc);
}

// Grid: (channel blocks, row chunks). Thread: channel c's dw taps and dbias over the chunk's
// positions, in order, into partial[chunk, 0..K] (K + 1 rows of C).
template <class T>
__global__ void conv_dw_partial_kernel(Conv v, const T* __restrict__ dy, const T* __restrict__ x,
                                       const T* __restrict__ w, const T* __restrict__ bias,
                                       float* __restrict__ partial, int64_t chunk_rows, bool silu) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= v.C) return;
  const int64_t rows = v.B * v.S, r0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  float acc[kMaxTaps + 1] = {};
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t b = r / v.S, t = r % v.S;
    const float g = v.gy(dy, x, w, bias, silu, b, t, c);
    for (int64_t k = 0; k < v.K; ++k) {
      const int64_t s = t - v.K + 1 + k;
      if (v.tap(b, t, s)) acc[k] = fmaf(g, load_f(x + (b * v.S + s) * v.C + c), acc[k]);
    }
    acc[kMaxTaps] += g;
  }
  float* out = partial + static_cast<int64_t>(blockIdx.y) * (v.K + 1) * v.C;
  for (int64_t k = 0; k < v.K; ++k) out[k * v.C + c] = acc[k];
  out[v.K * v.C + c] = acc[kMaxTaps];
}

// Grid: channel blocks. Thread: dw[c, :] and dbias[c] = sums over chunks (in order).
template <class T>
__global__ void conv_dw_final_kernel(const float* __restrict__ partial, T* __restrict__ dw,
                                     T* __restrict__ dbias, int64_t chunks, int64_t C, int64_t K) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= C) return;
  for (int64_t k = 0; k <= K; ++k) {
    float acc = 0.f;
    for (int64_t ch = 0; ch < chunks; ++ch) acc += partial[(ch * (K + 1) + k) * C + c];
    if (k < K) {
      store_f(dw + c * K + k, acc);
    } else if (dbias != nullptr) {
      store_f(dbias + c, acc);
    }
  }
}

// Grid: one block per row. Per group: sum of h^2 over the block, then the outputs.
template <class T, class Z, class Wt>
__global__ void gated_fwd_kernel(const T* __restrict__ y, const Z* __restrict__ z,
                                 const Wt* __restrict__ w, T* __restrict__ out,
                                 float* __restrict__ inv, int64_t W, int64_t group, float eps) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x, G = W / group;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t base = r * W + g * group;
    float ss = 0.f;
    for (int64_t i = threadIdx.x; i < group; i += blockDim.x) {
      const float zv = load_f(z + base + i), h = load_f(y + base + i) * zv * sigmoidf(zv);
      ss = fmaf(h, h, ss);
    }
    const float k = rsqrtf(block_sum(ss, scratch) / static_cast<float>(group) + eps);
    if (threadIdx.x == 0) inv[r * G + g] = k;
    for (int64_t i = threadIdx.x; i < group; i += blockDim.x) {
      const float zv = load_f(z + base + i), h = load_f(y + base + i) * zv * sigmoidf(zv);
      store_f(out + base + i, to_f(from_f<T>(h * k)) * load_f(w + g * group + i));
    }
  }
}

// Grid: one block per row. Per group: mean of dn * nhat over the block, then dy and dz.
template <class T, class Z, class Wt>
__global__ void gated_dyz_kernel(const T* __restrict__ grad, const T* __restrict__ y,
                                 const Z* __restrict__ z, const Wt* __restrict__ w,
                                 const float* __restrict__ inv, T* __restrict__ dy,
                                 Z* __restrict__ dz, int64_t W, int64_t group) {
  __shared__ float scratch[32];
  const int64_t r = blockIdx.x, G = W / group;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t base = r * W + g * group;
    const float k = inv[r * G + g];
    float dot = 0.f;
    for (int64_t i = threadIdx.x; i < group; i += blockDim.x) {
      const float zv = load_f(z + base + i), nh = load_f(y + base + i) * zv * sigmoidf(zv) * k;
      dot = fmaf(load_f(grad + base + i) * load_f(w + g * group + i), nh, dot);
    }
    const float m = block_sum(dot, scratch) / static_cast<float>(group);
    for (int64_t i = threadIdx.x; i < group; i += blockDim.x) {
      const float zv = load_f(z + base + i), yv = load_f(y + base + i), s = sigmoidf(zv);
      const float dh = k * (load_f(grad + base + i) * load_f(w + g * group + i) - yv * zv * s * k * m);
      store_f(dy + base + i, dh * zv * s);
      store_f(dz + base + i, dh * yv * s * (1.f + zv * (1.f - s)));
    }
  }
}

// Grid: (column blocks, row chunks). Thread: column c's dw over the chunk's rows, in order.
template <class T, class Z>
__global__ void gated_dw_partial_kernel(const T* __restrict__ grad, const T* __restrict__ y,
                                        const Z* __restrict__ z, const float* __restrict__ inv,
                                        float* __restrict__ partial, int64_t R, int64_t W,
                                        int64_t group, int64_t chunk_rows) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= W) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t r1 = r0 + chunk_rows < R ? r0 + chunk_rows : R;
  const int64_t G = W / group;
  float acc = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float zv = load_f(z + r * W + c);
    const float nh = load_f(y + r * W + c) * zv * sigmoidf(zv) * inv[r * G + c / group];
    acc = fmaf(load_f(grad + r * W + c), to_f(from_f<T>(nh)), acc);
  }
  partial[blockIdx.y * W + c] = acc;
}

template <class T>
__global__ void column_sum_kernel(const float* __restrict__ partial, T* __restrict__ out,
                                  int64_t chunks, int64_t W) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= W) return;
  float acc = 0.f;
  for (int64_t ch = 0; ch < chunks; ++ch) acc += partial[ch * W + c];
  store_f(out + c, acc);
}

Conv conv_view(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& doc) {
  TORCH_CHECK(w.size(1) <= kMaxTaps, "automoe::ops::cuda::causal_conv1d: at most ", kMaxTaps,
              " taps, got ", w.size(1));
  return {x.size(0), x.size(1), x.size(2), w.size(1), doc ? ptr<int64_t>(*doc) : nullptr};
}

// Calls f(Tag<Y>, Tag<Z>, Tag<W>) for the gated norm's three dtypes.
template <class F>
void dispatch_yzw(const at::Tensor& y, const at::Tensor& z, const at::Tensor& w, const char* kernel,
                  F&& f) {
  dispatch_float(y.scalar_type(), kernel, [&](auto yt) {
    dispatch_float(z.scalar_type(), kernel, [&](auto zt) {
      dispatch_float(w.scalar_type(), kernel, [&](auto wt) { f(yt, zt, wt); });
    });
  });
}

template <class T>
const T* bias_ptr(const std::optional<at::Tensor>& bias) {
  return bias ? ptr<T>(*bias) : nullptr;
}

}  // namespace

at::Tensor causal_conv1d_fwd(const at::Tensor& x_BSC, const at::Tensor& w_CK,
                             const std::optional<at::Tensor>& bias_C,
                             const std::optional<at::Tensor>& doc_BS, bool silu) {
  const c10::cuda::CUDAGuard guard(x_BSC.device());
  const Conv v = conv_view(x_BSC, w_CK, doc_BS);
  at::Tensor y = new_output(x_BSC.sizes(), x_BSC.options());
  if (y.numel() == 0) return y;
  dispatch_float(x_BSC.scalar_type(), "causal_conv1d_fwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const dim3 grid(grid_dim(ceil_div(v.C, kThreads)), static_cast<unsigned>(v.B * v.S));
    conv_fwd_kernel<T><<<grid, kThreads, 0, stream()>>>(v, ptr<T>(x_BSC), ptr<T>(w_CK),
                                                        bias_ptr<T>(bias_C), ptr<T>(y), silu);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_conv1d_bwd(
    const at::Tensor& grad_BSC, const at::Tensor& x_BSC, const at::Tensor& w_CK,
    const std::optional<at::Tensor>& bias_C, const std::optional<at::Tensor>& doc_BS, bool silu) {
  const c10::cuda::CUDAGuard guard(x_BSC.device());
  const Conv v = conv_view(x_BSC, w_CK, doc_BS);
  at::Tensor dx = new_output(x_BSC.sizes(), x_BSC.options());
  at::Tensor dw = new_output(w_CK.sizes(), w_CK.options());
  at::Tensor db = bias_C ? new_output(bias_C->sizes(), bias_C->options()) : at::Tensor();
  const int64_t rows = v.B * v.S;
  const int64_t chunks = std::max<int64_t>(1, std::min(kMaxRowChunks, ceil_div(rows, kMinChunkRows)));
  const int64_t chunk_rows = ceil_div(std::max<int64_t>(rows, 1), chunks);
  at::Tensor partial = at::empty({chunks, v.K + 1, v.C}, x_BSC.options().dtype(at::kFloat));
  dispatch_float(x_BSC.scalar_type(), "causal_conv1d_bwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const unsigned col_blocks = grid_dim(ceil_div(v.C, kThreads));
    if (rows > 0) {
      conv_dx_kernel<T><<<dim3(col_blocks, static_cast<unsigned>(rows)), kThreads, 0, stream()>>>(
          v, ptr<T>(grad_BSC), ptr<T>(x_BSC), ptr<T>(w_CK), bias_ptr<T>(bias_C), ptr<T>(dx), silu);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    conv_dw_partial_kernel<T><<<dim3(col_blocks, static_cast<unsigned>(chunks)), kThreads, 0, stream()>>>(
        v, ptr<T>(grad_BSC), ptr<T>(x_BSC), ptr<T>(w_CK), bias_ptr<T>(bias_C), ptr<float>(partial),
        chunk_rows, silu);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    conv_dw_final_kernel<T><<<col_blocks, kThreads, 0, stream()>>>(
        ptr<float>(partial), ptr<T>(dw), bias_C ? ptr<T>(db) : nullptr, chunks, v.C, v.K);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {dx, dw, db};
}

std::pair<at::Tensor, at::Tensor> gated_rmsnorm_fwd(const at::Tensor& y_RW, const at::Tensor& z_RW,
                                                    const at::Tensor& w_W, int64_t group,
                                                    double eps) {
  const c10::cuda::CUDAGuard guard(y_RW.device());
  const int64_t W = y_RW.size(-1), R = y_RW.numel() / W, G = W / group;
  at::Tensor out = new_output(y_RW.sizes(), y_RW.options());
  at::Tensor inv = new_output({R, G}, y_RW.options().dtype(at::kFloat));
  if (R == 0) return {out, inv};
  dispatch_yzw(y_RW, z_RW, w_W, "gated_rmsnorm_fwd", [&](auto yt, auto zt, auto wt) {
    using T = typename decltype(yt)::type;
    using Z = typename decltype(zt)::type;
    using Wt = typename decltype(wt)::type;
    gated_fwd_kernel<T, Z, Wt><<<grid_dim(R), row_threads(group), 0, stream()>>>(
        ptr<T>(y_RW), ptr<Z>(z_RW), ptr<Wt>(w_W), ptr<T>(out), ptr<float>(inv), W, group,
        static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, inv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_rmsnorm_bwd(
    const at::Tensor& grad_RW, const at::Tensor& y_RW, const at::Tensor& z_RW,
    const at::Tensor& w_W, const at::Tensor& inv_RG, int64_t group) {
  const c10::cuda::CUDAGuard guard(y_RW.device());
  const int64_t W = y_RW.size(-1), R = y_RW.numel() / W;
  at::Tensor dy = new_output(y_RW.sizes(), y_RW.options());
  at::Tensor dz = new_output(z_RW.sizes(), z_RW.options());
  at::Tensor dw = new_output(w_W.sizes(), w_W.options());
  const int64_t chunks = std::max<int64_t>(1, std::min(kMaxRowChunks, ceil_div(R, kMinChunkRows)));
  const int64_t chunk_rows = ceil_div(std::max<int64_t>(R, 1), chunks);
  at::Tensor partial = at::empty({chunks, W}, y_RW.options().dtype(at::kFloat));
  dispatch_yzw(y_RW, z_RW, w_W, "gated_rmsnorm_bwd", [&](auto yt, auto zt, auto wt) {
    using T = typename decltype(yt)::type;
    using Z = typename decltype(zt)::type;
    using Wt = typename decltype(wt)::type;
    const unsigned col_blocks = grid_dim(ceil_div(W, kThreads));
    if (R > 0) {
      gated_dyz_kernel<T, Z, Wt><<<grid_dim(R), row_threads(group), 0, stream()>>>(
          ptr<T>(grad_RW), ptr<T>(y_RW), ptr<Z>(z_RW), ptr<Wt>(w_W), ptr<float>(inv_RG), ptr<T>(dy),
          ptr<Z>(dz), W, group);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    gated_dw_partial_kernel<T, Z><<<dim3(col_blocks, static_cast<unsigned>(chunks)), kThreads, 0, stream()>>>(
        ptr<T>(grad_RW), ptr<T>(y_RW), ptr<Z>(z_RW), ptr<float>(inv_RG), ptr<float>(partial), R, W,
        group, chunk_rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    column_sum_kernel<Wt><<<col_blocks, kThreads, 0, stream()>>>(ptr<float>(partial), ptr<Wt>(dw),
                                                                 chunks, W);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {dy, dz, dw};
}

}  // namespace automoe::ops::cuda
