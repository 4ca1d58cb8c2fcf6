// Device helpers shared by the CUDA kernels (ops/<op>/<op>_cuda.cu): float32/bfloat16 loads and
// stores through fp32, 16-byte vector packs, warp/block reductions, a block-wide exclusive scan
// and the float dtype dispatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

namespace automoe::ops::cuda::detail {

using bf16 = __nv_bfloat16;

inline constexpr unsigned kFullMask = 0xffffffffu;

template <class T>
inline constexpr bool kIsFloatType = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

// ---- scalar conversion through fp32 -------------------------------------------------------

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }

// Round-to-nearest-even, as torch's CPU casts do.
template <class T>
__device__ __forceinline__ T from_f(float v) {
  static_assert(kIsFloatType<T>);
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return __float2bfloat16_rn(v);
  }
}

template <class T>
__device__ __forceinline__ float load_f(const T* p) {
  return to_f(*p);
}

template <class T>
__device__ __forceinline__ void store_f(T* p, float v) {
  *p = from_f<T>(v);
}

// ---- 16-byte packs --------------------------------------------------------------------------

// Elements of T in one 16-byte vector.
template <class T>
inline constexpr int kVec16 = static_cast<int>(16 / sizeof(T));

template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// V consecutive elements at p (aligned to V elements when V > 1) as fp32.
template <class T, int V>
__device__ __forceinline__ void load_pack(const T* p, float (&out)[V]) {
  const Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = to_f(pk.v[j]);
}

template <class T, int V>
__device__ __forceinline__ void store_pack(T* p, const float (&in)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int j = 0; j < V; ++j) pk.v[j] = from_f<T>(in[j]);
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// kVec16<T> when every row of `cols` elements starting at each pointer is 16-byte aligned, else 1.
template <class T, class... Ptrs>
int pack_width(int64_t cols, const Ptrs*... ptrs) {
  const bool ok = cols % kVec16<T> == 0 && (aligned16(ptrs) && ...);
  return ok ? kVec16<T> : 1;
}

// Calls f(std::integral_constant<int, V>{}) with V = width, which pack_width<T> returned.
template <class T, class F>
void dispatch_pack(int width, F&& f) {
  if (width == kVec16<T>) {
    f(std::integral_constant<int, kVec16<T>>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// ---- reductions (fixed order: deterministic for a given block size) ------------------------

// Every lane returns the same bits: xor-butterfly partners add the same two values.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets the total. `scratch` holds
// 32 floats; all threads must call it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? scratch[lane] : 0.f;
  t = warp_sum(t);
  __syncthreads();  // scratch may be reused right after
  return t;
}

// Exclusive prefix sum over i in [0, n) of load(i), by the whole block (blockDim.x a multiple of
// 32, at most 1024): store(i, sum of load(j) for j < i). Returns the total to every thread.
template <class Load, class Store>
__device__ int64_t block_exclusive_scan(int64_t n, Load load, Store store) {
  __shared__ int64_t warp_total[32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  int64_t carry = 0;
  for (int64_t base = 0; base < n; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const int64_t v = i < n ? static_cast<int64_t>(load(i)) : 0;
    int64_t incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t up = __shfl_up_sync(kFullMask, incl, o);
      if (lane >= o) incl += up;
    }
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int64_t t = lane < nwarps ? warp_total[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int64_t up = __shfl_up_sync(kFullMask, t, o);
        if (lane >= o) t += up;
      }
      warp_total[lane] = t;  // inclusive over warps
    }
    __syncthreads();
    const int64_t before = warp > 0 ? warp_total[warp - 1] : 0;
    if (i < n) store(i, carry + before + incl - v);
    carry += warp_total[nwarps - 1];
    __syncthreads();
  }
  return carry;
}

// ---- host side -------------------------------------------------------------------------------

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A grid's x extent (at most 2^31 - 1 blocks).
inline unsigned grid_dim(int64_t blocks) {
  TORCH_CHECK(blocks > 0 && blocks <= 0x7fffffff, "automoe::ops::cuda: grid of ", blocks,
              " blocks is out of range");
  return static_cast<unsigned>(blocks);
}

template <class T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

template <class T>
struct Tag {
  using type = T;
};

// Calls f(Tag<float>{}) or f(Tag<bf16>{}) for the tensor dtype; any other dtype is an error
// naming the kernel.
template <class F>
void dispatch_float(c10::ScalarType st, const char* kernel, F&& f) {
  switch (st) {
    case c10::ScalarType::Float:
      f(Tag<float>{});
      return;
    case c10::ScalarType::BFloat16:
      f(Tag<bf16>{});
      return;
    default:
      TORCH_CHECK(false, "automoe::ops::cuda::", kernel, ": unsupported dtype ", st,
                  " (the CUDA kernels take float32 or bfloat16)");
  }
}

// Threads of a block that strides over one row of `packs` packs: enough warps to cover the row
// once, between 1 and 8 warps.
inline int row_threads(int64_t packs) {
  const int64_t warps = ceil_div(packs, 32);
  return static_cast<int>(warps < 1 ? 32 : (warps > 8 ? 256 : warps * 32));
}

inline cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

}  // namespace automoe::ops::cuda::detail
