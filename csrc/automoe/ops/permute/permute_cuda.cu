// Token permute kernels (CUDA): the expert-major permute plan (a stable counting sort by
// expert, without host synchronisation) and the permute/unpermute row gathers and scatters.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "automoe/ops/cuda_common.cuh"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cuda {
namespace {

using namespace detail;

// ---- permute plan -----------------------------------------------------------------------------

constexpr int kChunk = 256;        // slots per chunk of the plan (= threads of its blocks)
constexpr int kScanThreads = 1024; // threads of the single-block expert scan
constexpr int64_t kMaxPlanSmem = 48 * 1024;

__device__ __forceinline__ bool valid_expert(int64_t e, int64_t E) { return e >= 0 && e < E; }

// Grid: one block per chunk of kChunk slots. Thread: slot i = chunk*kChunk + tid. Writes
// slot_pos[i] = rank of slot i among the chunk's earlier slots of its expert (-1 if dropped)
// and counts[chunk, e] = slots of expert e in the chunk. Dynamic smem: (E + kChunk) ints.
__global__ void plan_count_kernel(const int64_t* __restrict__ idx, int64_t N, int64_t E,
                                  int64_t* __restrict__ slot_pos, int* __restrict__ counts) {
  extern __shared__ int smem[];
  int* s_count = smem;
  int* s_expert = smem + E;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x;
  const int64_t e = i < N ? idx[i] : -1;
  const bool valid = valid_expert(e, E);
  s_expert[threadIdx.x] = valid ? static_cast<int>(e) : -1;
  for (int64_t j = threadIdx.x; j < E; j += kChunk) s_count[j] = 0;
  __syncthreads();
  if (valid) {
    int rank = 0;
    for (unsigned j = 0; j < threadIdx.x; ++j) rank += s_expert[j] == e;
    slot_pos[i] = rank;
    atomicAdd(&s_count[e], 1);  // integer: the count is exact whatever the order
  } else if (i < N) {
    slot_pos[i] = -1;
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < E; j += kChunk) counts[blockIdx.x * E + j] = s_count[j];
}

// Grid: one block per expert e. Block: exclusive scan of column e of counts over the chunks
// (in place: counts[c, e] becomes the rows of e in chunks before c); totals[e] = the column sum.
__global__ void plan_chunk_scan_kernel(int* __restrict__ counts, int64_t chunks, int64_t E,
                                       int64_t* __restrict__ totals) {
  const int64_t e = blockIdx.x;
  const int64_t total = block_exclusive_scan(
      chunks, [&](int64_t c) { return counts[c * E + e]; },
      [&](int64_t c, int64_t v) { counts[c * E + e] = static_cast<int>(v); });
  if (threadIdx.x == 0) totals[e] = total;
}

// Grid: one block of kScanThreads. offsets[e] = sum of totals before e, offsets[E] = all.
__global__ void plan_offsets_kernel(const int64_t* __restrict__ totals, int64_t E,
                                    int64_t* __restrict__ offsets) {
  const int64_t total = block_exclusive_scan(
      E, [&](int64_t e) { return totals[e]; }, [&](int64_t e, int64_t v) { offsets[e] = v; });
  if (threadIdx.x == 0) offsets[E] = total;
}

// Grid: ceil(N / kChunk) blocks. Thread: slot i gets its row offsets[e] + chunk base + rank
// and writes src_token[row] = i / K; also src_token[i] = -1 when i >= offsets[E] (rows that no
// slot fills; disjoint from the scattered rows, which are all < offsets[E]).
__global__ void plan_finalize_kernel(const int64_t* __restrict__ idx, int64_t N, int64_t K,
                                     int64_t E, const int* __restrict__ chunk_base,
                                     const int64_t* __restrict__ offsets,
                                     int64_t* __restrict__ slot_pos,
                                     int64_t* __restrict__ src_token) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x;
  if (i >= N) return;
  const int64_t e = idx[i];
  if (valid_expert(e, E)) {
    const int64_t row = offsets[e] + chunk_base[blockIdx.x * E + e] + slot_pos[i];
    slot_pos[i] = row;
    src_token[row] = i / K;
  }
  if (i >= offsets[E]) src_token[i] = -1;
}

// ---- row gathers / scatters --------------------------------------------------------------------

__device__ __forceinline__ bool valid_row(int64_t r, int64_t rows) { return r >= 0 && r < rows; }

// Grid: one block per permuted row n. Block: threads stride over H in packs of V.
template <class T, int V>
__global__ void permute_fwd_kernel(const T* __restrict__ x, const int64_t* __restrict__ src_token,
                                   T* __restrict__ out, int64_t T_rows, int64_t H) {
  const int64_t n = blockIdx.x;
  const int64_t t = src_token[n];
  const bool valid = valid_row(t, T_rows);
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < H; c += blockDim.x * V) {
    float v[V];
    if (valid) {
      load_pack<T, V>(x + t * H + c, v);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = 0.f;
    }
    store_pack<T, V>(out + n * H + c, v);
  }
}

// Grid: one block per token t. Block: threads stride over H in packs of V; each pack sums
// w_k * rows[slot_pos[t, k]] over k in order (w_k = 1 without weights), unfused as on the CPU.
template <class T, class W, int V>
__global__ void gather_sum_kernel(const T* __restrict__ rows, const int64_t* __restrict__ slot_pos,
                                  const W* __restrict__ weights, T* __restrict__ out, int64_t N,
                                  int64_t K, int64_t H) {
  const int64_t t = blockIdx.x;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < H; c += blockDim.x * V) {
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = slot_pos[t * K + k];
      if (!valid_row(r, N)) continue;
      float v[V];
      load_pack<T, V>(rows + r * H + c, v);
      if (weights != nullptr) {
        const float w = load_f(weights + t * K + k);
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, v[j]));
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += v[j];
      }
    }
    store_pack<T, V>(out + t * H + c, acc);
  }
}

// Grid: one block per token t. Block: for each k in order, threads stride over H in packs of V
// writing dy[slot_pos[t, k]] = w_k * grad[t] and summing grad[t] . y[slot_pos[t, k]] (block
// reduction) into dweights[t, k]; 0 for a dropped slot.
template <class T, class W, int V>
__global__ void unpermute_bwd_kernel(const T* __restrict__ grad, const T* __restrict__ y,
                                     const int64_t* __restrict__ slot_pos,
                                     const W* __restrict__ weights, T* __restrict__ dy,
                                     W* __restrict__ dweights, int64_t N, int64_t K, int64_t H) {
  __shared__ float scratch[32];
  const int64_t t = blockIdx.x;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t r = slot_pos[t * K + k];
    if (!valid_row(r, N)) {  // uniform over the block
      if (threadIdx.x == 0) store_f(dweights + t * K + k, 0.f);
      continue;
    }
    const float w = load_f(weights + t * K + k);
    float dot = 0.f;
    for (int64_t c = static_cast<int64_t>(threadIdx.x) * V; c < H; c += blockDim.x * V) {
      float g[V], v[V];
      load_pack<T, V>(grad + t * H + c, g);
      load_pack<T, V>(y + r * H + c, v);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        dot = fmaf(g[j], v[j], dot);
        g[j] *= w;
      }
      store_pack<T, V>(dy + r * H + c, g);
    }
    dot = block_sum(dot, scratch);
    if (threadIdx.x == 0) store_f(dweights + t * K + k, dot);
  }
}

// Launches gather_sum_kernel over T tokens for rows [N, H] (weights may be undefined).
template <class T, class W>
void launch_gather_sum(const at::Tensor& rows, const at::Tensor& slot_pos,
                       const at::Tensor& weights, const at::Tensor& out) {
  const int64_t T_rows = slot_pos.size(0);
  const int64_t K = slot_pos.size(1);
  const int64_t H = rows.size(1);
  const W* w = weights.defined() ? ptr<W>(weights) : nullptr;
  dispatch_pack<T>(pack_width<T>(H, ptr<T>(rows), ptr<T>(out)), [&](auto vec) {
    constexpr int V = decltype(vec)::value;
    gather_sum_kernel<T, W, V><<<grid_dim(T_rows), row_threads(ceil_div(H, V)), 0, stream()>>>(
        ptr<T>(rows), ptr<int64_t>(slot_pos), w, ptr<T>(out), rows.size(0), K, H);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> permute_plan(const at::Tensor& idx_TK,
                                                             int64_t num_experts) {
  const c10::cuda::CUDAGuard guard(idx_TK.device());
  TORCH_CHECK(idx_TK.scalar_type() == at::kLong,
              "automoe::ops::cuda::permute_plan: idx must be int64");
  const int64_t E = num_experts;
  const int64_t N = idx_TK.numel();
  const int64_t K = idx_TK.size(1);
  const int64_t smem = (E + kChunk) * static_cast<int64_t>(sizeof(int));
  TORCH_CHECK(E >= 0 && smem <= kMaxPlanSmem, "automoe::ops::cuda::permute_plan: ", E,
              " experts exceed the kernel's shared memory");
  TORCH_CHECK(N < (int64_t{1} << 31), "automoe::ops::cuda::permute_plan: ", N,
              " slots exceed int32 counts");
  const auto opts = idx_TK.options();
  at::Tensor offsets = new_output({E + 1}, opts);
  at::Tensor slot_pos = new_output(idx_TK.sizes(), opts);
  at::Tensor src_token = new_output({N}, opts);
  const int64_t chunks = ceil_div(N, kChunk);
  at::Tensor counts = at::empty({chunks, E}, opts.dtype(at::kInt));
  at::Tensor totals = at::empty({E}, opts);
  const int64_t* idx = ptr<int64_t>(idx_TK);
  if (N > 0) {
    plan_count_kernel<<<grid_dim(chunks), kChunk, smem, stream()>>>(
        idx, N, E, ptr<int64_t>(slot_pos), ptr<int>(counts));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (E > 0) {
    plan_chunk_scan_kernel<<<grid_dim(E), kChunk, 0, stream()>>>(ptr<int>(counts), chunks, E,
                                                                 ptr<int64_t>(totals));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  plan_offsets_kernel<<<1, kScanThreads, 0, stream()>>>(ptr<int64_t>(totals), E,
                                                       ptr<int64_t>(offsets));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (N > 0) {
    plan_finalize_kernel<<<grid_dim(chunks), kChunk, 0, stream()>>>(
        idx, N, K, E, ptr<int>(counts), ptr<int64_t>(offsets), ptr<int64_t>(slot_pos),
        ptr<int64_t>(src_token));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {offsets, slot_pos, src_token};
}

at::Tensor permute_fwd(const at::Tensor& x_TH, const at::Tensor& src_token_N) {
  const c10::cuda::CUDAGuard guard(x_TH.device());
  const int64_t N = src_token_N.size(0);
  const int64_t H = x_TH.size(1);
  at::Tensor out = new_output({N, H}, x_TH.options());
  if (N == 0 || H == 0) return out;
  dispatch_float(x_TH.scalar_type(), "permute_fwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_pack<T>(pack_width<T>(H, ptr<T>(x_TH), ptr<T>(out)), [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      permute_fwd_kernel<T, V><<<grid_dim(N), row_threads(ceil_div(H, V)), 0, stream()>>>(
          ptr<T>(x_TH), ptr<int64_t>(src_token_N), ptr<T>(out), x_TH.size(0), H);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

at::Tensor permute_bwd(const at::Tensor& grad_NH, const at::Tensor& slot_pos_TK) {
  const c10::cuda::CUDAGuard guard(grad_NH.device());
  const int64_t T_rows = slot_pos_TK.size(0);
  const int64_t H = grad_NH.size(1);
  at::Tensor dx = new_output({T_rows, H}, grad_NH.options());
  if (T_rows == 0 || H == 0) return dx;
  dispatch_float(grad_NH.scalar_type(), "permute_bwd", [&](auto tag) {
    using T = typename decltype(tag)::type;
    launch_gather_sum<T, float>(grad_NH, slot_pos_TK, at::Tensor(), dx);
  });
  return dx;
}

at::Tensor unpermute_fwd(const at::Tensor& y_NH, const at::Tensor& slot_pos_TK,
                         const at::Tensor& weights_TK) {
  const c10::cuda::CUDAGuard guard(y_NH.device());
  const int64_t T_rows = slot_pos_TK.size(0);
  const int64_t H = y_NH.size(1);
  at::Tensor out = new_output({T_rows, H}, y_NH.options());
  if (T_rows == 0 || H == 0) return out;
  dispatch_float(y_NH.scalar_type(), "unpermute_fwd", [&](auto yt) {
    dispatch_float(weights_TK.scalar_type(), "unpermute_fwd", [&](auto wt) {
      using T = typename decltype(yt)::type;
      using W = typename decltype(wt)::type;
      launch_gather_sum<T, W>(y_NH, slot_pos_TK, weights_TK, out);
    });
  });
  return out;
}

std::pair<at::Tensor, at::Tensor> unpermute_bwd(const at::Tensor& grad_TH,
                                                const at::Tensor& y_NH,
                                                const at::Tensor& slot_pos_TK,
                                                const at::Tensor& weights_TK) {
  const c10::cuda::CUDAGuard guard(y_NH.device());
  TORCH_CHECK(grad_TH.scalar_type() == y_NH.scalar_type(),
              "automoe::ops::cuda::unpermute_bwd: grad dtype ", grad_TH.scalar_type(),
              " differs from y dtype ", y_NH.scalar_type());
  const int64_t T_rows = slot_pos_TK.size(0);
  const int64_t K = slot_pos_TK.size(1);
  const int64_t N = y_NH.size(0);
  const int64_t H = y_NH.size(1);
  at::Tensor dy = at::zeros({N, H}, y_NH.options());
  at::Tensor dweights = new_output({T_rows, K}, weights_TK.options());
  if (T_rows == 0 || K == 0) return {dy, dweights};
  dispatch_float(y_NH.scalar_type(), "unpermute_bwd", [&](auto yt) {
    dispatch_float(weights_TK.scalar_type(), "unpermute_bwd", [&](auto wt) {
      using T = typename decltype(yt)::type;
      using W = typename decltype(wt)::type;
      const int width = pack_width<T>(H, ptr<T>(grad_TH), ptr<T>(y_NH), ptr<T>(dy));
      dispatch_pack<T>(width, [&](auto vec) {
        constexpr int V = decltype(vec)::value;
        unpermute_bwd_kernel<T, W, V>
            <<<grid_dim(T_rows), row_threads(ceil_div(H, V)), 0, stream()>>>(
                ptr<T>(grad_TH), ptr<T>(y_NH), ptr<int64_t>(slot_pos_TK), ptr<W>(weights_TK),
                ptr<T>(dy), ptr<W>(dweights), N, K, H);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {dy, dweights};
}

}  // namespace automoe::ops::cuda
