// SwiGLU kernels (CUDA): one thread per output element (r, i), math in fp32 in the CPU
// kernel's order of operations.
#include <ATen/ops/empty.h>

#include <vector>

#include "automoe/ops/cuda_common.cuh"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

struct GluParams {
  bool gpt_oss;
  float alpha;
  float limit;
};

__device__ __forceinline__ float sigmoid_f(float v) { return 1.f / (1.f + expf(-v)); }

// Offsets of the gate and up elements of output (r, i) within gate_up [R, 2I].
__device__ __forceinline__ void gate_up_index(int64_t e, int64_t I, bool gpt_oss, int64_t& ig,
                                              int64_t& iu) {
  const int64_t r = e / I;
  const int64_t i = e - r * I;
  ig = r * 2 * I + (gpt_oss ? 2 * i : i);
  iu = gpt_oss ? ig + 1 : ig + I;
}

// Clamps with torch.clamp's semantics (NaN passes through).
__device__ __forceinline__ float clamp_max(float v, float hi) { return v > hi ? hi : v; }
__device__ __forceinline__ float clamp_both(float v, float lo, float hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// Grid: ceil(R*I / kThreads) blocks. Thread: output element e = r*I + i.
template <class T>
__global__ void swiglu_fwd_kernel(const T* __restrict__ gu, T* __restrict__ out, int64_t total,
                                  int64_t I, GluParams p) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= total) return;
  int64_t ig, iu;
  gate_up_index(e, I, p.gpt_oss, ig, iu);
  const float g = load_f(gu + ig);
  const float u = load_f(gu + iu);
  float v;
  if (p.gpt_oss) {
    const float gc = clamp_max(g, p.limit);
    const float uc = clamp_both(u, -p.limit, p.limit);
    v = (uc + 1.f) * gc * sigmoid_f(p.alpha * gc);
  } else {
    v = g * sigmoid_f(g) * u;
  }
  store_f(out + e, v);
}

// Grid: ceil(R*I / kThreads) blocks. Thread: output element e = r*I + i, writing both the
// gate and the up gradient of that element (every column of d gate_up once).
template <class T>
__global__ void swiglu_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ gu,
                                  T* __restrict__ dgu, int64_t total, int64_t I, GluParams p) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (e >= total) return;
  int64_t ig, iu;
  gate_up_index(e, I, p.gpt_oss, ig, iu);
  const float d = load_f(grad + e);
  const float g = load_f(gu + ig);
  const float u = load_f(gu + iu);
  float dg, du;
  if (p.gpt_oss) {
    const float gc = clamp_max(g, p.limit);
    const float uc = clamp_both(u, -p.limit, p.limit);
    const float s = sigmoid_f(p.alpha * gc);
    const float glu = gc * s;
    dg = g <= p.limit ? d * (uc + 1.f) * (s + p.alpha * gc * s * (1.f - s)) : 0.f;
    du = (u >= -p.limit && u <= p.limit) ? d * glu : 0.f;
  } else {
    const float s = sigmoid_f(g);
    dg = d * u * s * (1.f + g * (1.f - s));
    du = d * g * s;
  }
  store_f(dgu + ig, dg);
  store_f(dgu + iu, du);
}

GluParams glu_params(bool gpt_oss, double alpha, double limit) {
  return {gpt_oss, static_cast<float>(alpha), static_cast<float>(limit)};
}

}  // namespace

at::Tensor swiglu_fwd(const at::Tensor& gate_up, bool gpt_oss, double alpha, double limit) {
  const c10::cuda::CUDAGuard guard(gate_up.device());
  const int64_t I = gate_up.size(-1) / 2;
  std::vector<int64_t> shape = gate_up.sizes().vec();
  shape.back() = I;
  at::Tensor out = new_output(shape, gate_up.options());
  const int64_t total = out.numel();
  if (total == 0) return out;
  dispatch_float(gate_up.scalar_type(), "swiglu_fwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    swiglu_fwd_kernel<T><<<grid_dim(ceil_div(total, kThreads)), kThreads, 0, stream()>>>(
        ptr<T>(gate_up), ptr<T>(out), total, I, glu_params(gpt_oss, alpha, limit));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor swiglu_bwd(const at::Tensor& grad_RI, const at::Tensor& gate_up, bool gpt_oss,
                      double alpha, double limit) {
  const c10::cuda::CUDAGuard guard(gate_up.device());
  TORCH_CHECK(grad_RI.scalar_type() == gate_up.scalar_type(),
              "automoe::ops::cuda::swiglu_bwd: grad dtype ", grad_RI.scalar_type(),
              " differs from gate_up dtype ", gate_up.scalar_type());
  const int64_t I = gate_up.size(-1) / 2;
  at::Tensor dgu = new_output(gate_up.sizes(), gate_up.options());
  const int64_t total = grad_RI.numel();
  if (total == 0) return dgu;
  dispatch_float(gate_up.scalar_type(), "swiglu_bwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    swiglu_bwd_kernel<T><<<grid_dim(ceil_div(total, kThreads)), kThreads, 0, stream()>>>(
        ptr<T>(grad_RI), ptr<T>(gate_up), ptr<T>(dgu), total, I,
        glu_params(gpt_oss, alpha, limit));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dgu;
}

}  // namespace automoe::ops::cuda
