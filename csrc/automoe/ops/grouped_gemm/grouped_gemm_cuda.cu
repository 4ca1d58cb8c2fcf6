// Grouped GEMM kernels (CUDA) over the expert-major row ranges [offsets[g], offsets[g+1]):
//   fwd  y_g  = x_g · w_gᵀ     (reduction over K)
//   dx   dx_g = dy_g · w_g     (reduction over O)
//   dw   dw_g = dy_gᵀ · x_g    (reduction over the group's rows, in order)
// One kernel template for the three: a 128x128 output tile per block of 256 threads, operand
// tiles staged global -> registers -> shared (two shared buffers, one barrier per step, ragged
// edges zero-filled). bfloat16 runs on tensor cores (WMMA 16x16x16, fp32 accumulators; each
// warp a 64x32 sub-tile); float32 runs an exact FFMA micro-kernel (8x8 outputs per thread).
// fwd/dx never read offsets on the host: a one-block kernel turns offsets into the first M-tile
// of every group, and each block binary-searches its group there.
#include <ATen/ops/empty.h>
#include <mma.h>

#include <type_traits>

#include "automoe/ops/cuda_common.cuh"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cuda {
namespace {

using namespace detail;
namespace wmma = nvcuda::wmma;

constexpr int BM = 128;  // output tile rows (N rows for fwd/dx, O for dw)
constexpr int BN = 128;  // output tile columns (O for fwd, K for dx/dw)
constexpr int kThreads = 256;
constexpr int kScanThreads = 1024;

enum class Mode { Fwd, Dx, Dw };

// Reduction step and shared-row padding: bf16 rows stay 16-byte multiples for WMMA and vector
// stores (and conflict-free ldmatrix); fp32 rows are odd word counts (conflict-free FFMA reads).
template <class T>
struct Cfg;
template <>
struct Cfg<bf16> {
  static constexpr int BK = 32;
  static constexpr int PAD = 8;
};
template <>
struct Cfg<float> {
  static constexpr int BK = 16;
  static constexpr int PAD = 1;
};

// Shared tile of one operand: [OUTER][BK] when the reduction runs along the global rows'
// contiguous dimension (RED_COLS), else [BK][OUTER]; Rows/Cols/LD describe it row-major.
template <class T, bool RED_COLS, int OUTER>
struct TileShape {
  static constexpr int Rows = RED_COLS ? OUTER : Cfg<T>::BK;
  static constexpr int Cols = RED_COLS ? Cfg<T>::BK : OUTER;
  static constexpr int LD = Cols + Cfg<T>::PAD;
  static constexpr int Elems = Rows * LD;
};

// One operand of a block's job: its tile origin at reduction step 0, the global leading
// dimension, and the valid extent of its non-reduction dimension.
template <class T>
struct Operand {
  const T* ptr;
  int64_t ld;
  int fixed;
};

template <class T, class TOut>
struct Job {
  Operand<T> a, b;
  int64_t red;  // reduction length (0: the tile is zeros)
  TOut* c;      // output tile origin
  int64_t ldc;
  int nr, nc;   // valid output rows / columns of the tile
};

template <class T, class TOut>
struct GemmArgs {
  const T* a;  // x (fwd), dy (dx, dw)
  const T* b;  // w (fwd, dx), x (dw)
  TOut* c;     // y, dx, dw
  const int64_t* offsets;
  const int64_t* tile_start;  // [G + 2]: first M-tile of each group, the tail, and the total
  int64_t G, N, K, O;
};

// Loads one tile (Shape::Rows x Shape::Cols of a row-major global matrix) into registers and
// stores it to shared memory, in packs of V elements, zero outside [0, nr) x [0, nc).
template <class T, class Shape, bool VEC>
struct TileLoader {
  static constexpr int V = VEC ? kVec16<T> : 1;
  static constexpr int kPerRow = Shape::Cols / V;
  static constexpr int kCount = Shape::Rows * kPerRow / kThreads;
  static constexpr bool kVecStore = V > 1 && (Shape::LD * sizeof(T)) % 16 == 0;
  static_assert(Shape::Rows * kPerRow % kThreads == 0);
  Pack<T, V> reg[kCount];

  __device__ void load(const T* g, int64_t ld, int nr, int nc) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const int id = static_cast<int>(threadIdx.x) + i * kThreads;
      const int r = id / kPerRow;
      const int c = (id % kPerRow) * V;
      if (r < nr && c + V <= nc) {
        reg[i] = *reinterpret_cast<const Pack<T, V>*>(g + r * ld + c);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j)
          reg[i].v[j] = (r < nr && c + j < nc) ? g[r * ld + c + j] : from_f<T>(0.f);
      }
    }
  }

  __device__ void store(T* s) const {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      const int id = static_cast<int>(threadIdx.x) + i * kThreads;
      const int r = id / kPerRow;
      const int c = (id % kPerRow) * V;
      if constexpr (kVecStore) {
        *reinterpret_cast<Pack<T, V>*>(s + r * Shape::LD + c) = reg[i];
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) s[r * Shape::LD + c + j] = reg[i].v[j];
      }
    }
  }
};

// Loads reduction step kt of an operand into the loader's registers.
template <bool RED_COLS, class Loader, class T>
__device__ void load_step(Loader& l, const Operand<T>& op, int64_t red, int64_t kt) {
  constexpr int BK = Cfg<T>::BK;
  const int64_t r0 = kt * BK;
  const int n = static_cast<int>(red - r0 < BK ? red - r0 : BK);
  if constexpr (RED_COLS) {
    l.load(op.ptr + r0, op.ld, op.fixed, n);
  } else {
    l.load(op.ptr + r0 * op.ld, op.ld, n, op.fixed);
  }
}

// bf16 tensor-core tile: warp w computes rows [64*(w/4), +64) x cols [32*(w%4), +32) of the
// block tile as 4x2 WMMA accumulators.
template <bool A_RC, bool B_RC>
struct MmaTile {
  using SA = TileShape<bf16, A_RC, BM>;
  using SB = TileShape<bf16, B_RC, BN>;
  using ALayout = std::conditional_t<A_RC, wmma::row_major, wmma::col_major>;
  using BLayout = std::conditional_t<B_RC, wmma::col_major, wmma::row_major>;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[4][2];

  __device__ MmaTile() {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  }

  __device__ void compute(const bf16* sA, const bf16* sB) {
    const int warp = threadIdx.x >> 5;
    const int wm = (warp >> 2) * 64;
    const int wn = (warp & 3) * 32;
#pragma unroll
    for (int kk = 0; kk < Cfg<bf16>::BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, ALayout> a[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, BLayout> b[2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = wm + i * 16;
        wmma::load_matrix_sync(a[i], A_RC ? sA + m * SA::LD + kk : sA + kk * SA::LD + m, SA::LD);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int n = wn + j * 16;
        wmma::load_matrix_sync(b[j], B_RC ? sB + n * SB::LD + kk : sB + kk * SB::LD + n, SB::LD);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
    }
  }

  // Each warp stages one 16x16 accumulator at a time in its 256-float slice of `scratch`,
  // then lane l writes row l/2, columns 8*(l%2) .. +8 (bounds-checked).
  template <class TOut>
  __device__ void store(TOut* C, int64_t ldc, int nr, int nc, float* scratch) const {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int wm = (warp >> 2) * 64;
    const int wn = (warp & 3) * 32;
    float* own = scratch + warp * 256;
    const int row = lane >> 1;
    const int col = (lane & 1) * 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        wmma::store_matrix_sync(own, acc[i][j], 16, wmma::mem_row_major);
        __syncwarp();
        const int r = wm + i * 16 + row;
        const int c = wn + j * 16 + col;
        if (r < nr) {
#pragma unroll
          for (int q = 0; q < 8; ++q)
            if (c + q < nc) C[r * ldc + c + q] = from_f<TOut>(own[row * 16 + col + q]);
        }
        __syncwarp();
      }
    }
  }
};

// fp32 FFMA tile: thread (ty, tx) = (tid / 16, tid % 16) computes rows ty + 16i and columns
// tx + 16j (i, j < 8) of the block tile, reduction in order.
template <bool A_RC, bool B_RC>
struct SimtTile {
  using SA = TileShape<float, A_RC, BM>;
  using SB = TileShape<float, B_RC, BN>;
  float acc[8][8];

  __device__ SimtTile() {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
  }

  __device__ void compute(const float* sA, const float* sB) {
    const int tx = threadIdx.x & 15;
    const int ty = threadIdx.x >> 4;
#pragma unroll
    for (int r = 0; r < Cfg<float>::BK; ++r) {
      float a[8], b[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int m = ty + 16 * i;
        a[i] = A_RC ? sA[m * SA::LD + r] : sA[r * SA::LD + m];
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int n = tx + 16 * j;
        b[j] = B_RC ? sB[n * SB::LD + r] : sB[r * SB::LD + n];
      }
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }

  template <class TOut>
  __device__ void store(TOut* C, int64_t ldc, int nr, int nc, float* /*scratch*/) const {
    const int tx = threadIdx.x & 15;
    const int ty = threadIdx.x >> 4;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = ty + 16 * i;
      if (r >= nr) continue;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = tx + 16 * j;
        if (c < nc) C[r * ldc + c] = from_f<TOut>(acc[i][j]);
      }
    }
  }
};

__device__ __forceinline__ int min_int(int64_t a, int b) { return a < b ? static_cast<int>(a) : b; }

// Group of M-tile t: the largest g in [0, G] with tile_start[g] <= t (g = G is the tail of rows
// past offsets[G]); t < tile_start[G + 1], so the group found is non-empty.
__device__ int64_t find_group(const int64_t* tile_start, int64_t G, int64_t t) {
  int64_t lo = 0;
  int64_t hi = G;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (tile_start[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// fwd/dx job of block (blockIdx.x = M-tile over all groups, blockIdx.y = column tile); false
// for the surplus blocks of the launch's upper bound.
template <Mode MODE, class T, class TOut>
__device__ bool row_tile_job(const GemmArgs<T, TOut>& p, Job<T, TOut>& job) {
  const int64_t t = blockIdx.x;
  if (t >= p.tile_start[p.G + 1]) return false;
  const int64_t g = find_group(p.tile_start, p.G, t);
  const bool tail = g == p.G;
  const int64_t start = p.offsets[g];
  const int64_t end = tail ? p.N : p.offsets[g + 1];
  const int64_t m0 = start + (t - p.tile_start[g]) * BM;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * BN;
  const T* w_g = tail ? p.b : p.b + g * p.O * p.K;
  job.nr = min_int(end - m0, BM);
  if constexpr (MODE == Mode::Fwd) {  // y[m, o] = sum_k x[m, k] w_g[o, k]
    job.nc = min_int(p.O - n0, BN);
    job.red = tail ? 0 : p.K;
    job.a = {p.a + m0 * p.K, p.K, job.nr};
    job.b = {w_g + n0 * p.K, p.K, job.nc};
    job.c = p.c + m0 * p.O + n0;
    job.ldc = p.O;
  } else {  // dx[m, k] = sum_o dy[m, o] w_g[o, k]
    job.nc = min_int(p.K - n0, BN);
    job.red = tail ? 0 : p.O;
    job.a = {p.a + m0 * p.O, p.O, job.nr};
    job.b = {w_g + n0, p.K, job.nc};
    job.c = p.c + m0 * p.K + n0;
    job.ldc = p.K;
  }
  return true;
}

// dw job of block (blockIdx.x = O-tile + tiles_o * K-tile, blockIdx.y = group g):
// dw_g[o, k] = sum over the group's rows m (in order) of dy[m, o] x[m, k].
template <class T, class TOut>
__device__ void dw_job(const GemmArgs<T, TOut>& p, Job<T, TOut>& job) {
  const int64_t g = blockIdx.y;
  const int64_t tiles_o = (p.O + BM - 1) / BM;
  const int64_t o0 = (blockIdx.x % tiles_o) * BM;
  const int64_t k0 = (blockIdx.x / tiles_o) * BN;
  const int64_t start = p.offsets[g];
  const int64_t end = p.offsets[g + 1];
  job.nr = min_int(p.O - o0, BM);
  job.nc = min_int(p.K - k0, BN);
  job.red = end > start ? end - start : 0;
  job.a = {p.a + start * p.O + o0, p.O, job.nr};
  job.b = {p.b + start * p.K + k0, p.K, job.nc};
  job.c = p.c + (g * p.O + o0) * p.K + k0;
  job.ldc = p.K;
}

// Grid: fwd/dx (upper bound of M-tiles, column tiles); dw (O-tiles * K-tiles, G). Block: 256
// threads on one 128x128 output tile (see MmaTile / SimtTile for the thread mapping).
template <class T, class TOut, Mode MODE, bool VEC>
__global__ void __launch_bounds__(kThreads) grouped_gemm_kernel(const GemmArgs<T, TOut> p) {
  constexpr bool A_RC = MODE != Mode::Dw;  // A's reduction runs along its contiguous dim
  constexpr bool B_RC = MODE == Mode::Fwd;
  using SA = TileShape<T, A_RC, BM>;
  using SB = TileShape<T, B_RC, BN>;
  using Tile = std::conditional_t<std::is_same_v<T, bf16>, MmaTile<A_RC, B_RC>,
                                  SimtTile<A_RC, B_RC>>;
  constexpr int kSmemBytes = 2 * (SA::Elems + SB::Elems) * static_cast<int>(sizeof(T));
  static_assert(SA::Elems * sizeof(T) % 32 == 0 && SB::Elems * sizeof(T) % 32 == 0);
  static_assert(kSmemBytes >= 8 * 256 * static_cast<int>(sizeof(float)));
  __shared__ __align__(128) unsigned char smem[kSmemBytes];
  T* sA = reinterpret_cast<T*>(smem);  // stage s at sA + s * SA::Elems
  T* sB = sA + 2 * SA::Elems;          // stage s at sB + s * SB::Elems

  Job<T, TOut> job;
  if constexpr (MODE == Mode::Dw) {
    dw_job(p, job);
  } else if (!row_tile_job<MODE>(p, job)) {
    return;  // uniform over the block
  }

  const int64_t steps = (job.red + Cfg<T>::BK - 1) / Cfg<T>::BK;
  Tile tile;
  TileLoader<T, SA, VEC> la;
  TileLoader<T, SB, VEC> lb;
  if (steps > 0) {
    load_step<A_RC>(la, job.a, job.red, 0);
    load_step<B_RC>(lb, job.b, job.red, 0);
    la.store(sA);
    lb.store(sB);
  }
  __syncthreads();
  for (int64_t kt = 0; kt < steps; ++kt) {
    const int cur = static_cast<int>(kt & 1);
    const bool more = kt + 1 < steps;
    if (more) {  // global loads of the next step overlap this step's math
      load_step<A_RC>(la, job.a, job.red, kt + 1);
      load_step<B_RC>(lb, job.b, job.red, kt + 1);
    }
    tile.compute(sA + cur * SA::Elems, sB + cur * SB::Elems);
    if (more) {  // the other buffer was last read before the previous barrier
      la.store(sA + (cur ^ 1) * SA::Elems);
      lb.store(sB + (cur ^ 1) * SB::Elems);
    }
    __syncthreads();
  }
  tile.store(job.c, job.ldc, job.nr, job.nc, reinterpret_cast<float*>(smem));
}

// Grid: one block of kScanThreads. tile_start[g] = M-tiles (of BM rows) of the groups before g,
// over the G groups and the tail [offsets[G], N) as group G; tile_start[G + 1] = all.
__global__ void tile_start_kernel(const int64_t* __restrict__ offsets, int64_t G, int64_t N,
                                  int64_t* __restrict__ tile_start) {
  const int64_t total = block_exclusive_scan(
      G + 1,
      [&](int64_t g) {
        const int64_t rows = (g < G ? offsets[g + 1] : N) - offsets[g];
        return rows > 0 ? (rows + BM - 1) / BM : int64_t{0};
      },
      [&](int64_t g, int64_t v) { tile_start[g] = v; });
  if (threadIdx.x == 0) tile_start[G + 1] = total;
}

// Whether every operand row is 16-byte aligned at every tile origin, for 16-byte packs.
template <class T>
bool vec_ok(int64_t K, int64_t O, const void* a, const void* b) {
  return K % kVec16<T> == 0 && O % kVec16<T> == 0 && aligned16(a) && aligned16(b);
}

template <Mode MODE, class T, class TOut>
void launch(const GemmArgs<T, TOut>& p, dim3 grid) {
  const bool vec = vec_ok<T>(p.K, p.O, p.a, p.b);
  if (vec) {
    grouped_gemm_kernel<T, TOut, MODE, true><<<grid, kThreads, 0, stream()>>>(p);
  } else {
    grouped_gemm_kernel<T, TOut, MODE, false><<<grid, kThreads, 0, stream()>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_offsets(const at::Tensor& offsets, int64_t G, const char* kernel) {
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.numel() == G + 1,
              "automoe::ops::cuda::", kernel, ": offsets must be int64 [G + 1]");
}

void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* kernel) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "automoe::ops::cuda::", kernel,
              ": operand dtypes differ (", a.scalar_type(), " vs ", b.scalar_type(), ")");
}

// fwd (reduction K) and dx (reduction O): N rows of `out_cols` columns, by M-tiles.
template <Mode MODE>
at::Tensor row_gemm(const at::Tensor& a, const at::Tensor& w_GOK, const at::Tensor& offsets,
                    const char* kernel) {
  const c10::cuda::CUDAGuard guard(a.device());
  check_same_dtype(a, w_GOK, kernel);
  const int64_t G = w_GOK.size(0);
  const int64_t O = w_GOK.size(1);
  const int64_t K = w_GOK.size(2);
  const int64_t N = a.size(0);
  check_offsets(offsets, G, kernel);
  const int64_t out_cols = MODE == Mode::Fwd ? O : K;
  at::Tensor out = new_output({N, out_cols}, a.options());
  if (N == 0 || out_cols == 0) return out;
  at::Tensor tile_start = at::empty({G + 2}, offsets.options());
  tile_start_kernel<<<1, kScanThreads, 0, stream()>>>(ptr<int64_t>(offsets), G, N,
                                                      ptr<int64_t>(tile_start));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t col_tiles = ceil_div(out_cols, BN);
  TORCH_CHECK(col_tiles <= 65535, "automoe::ops::cuda::", kernel, ": ", out_cols,
              " output columns exceed the grid");
  const dim3 grid(grid_dim(N / BM + G + 1), static_cast<unsigned>(col_tiles));
  dispatch_float(a.scalar_type(), kernel, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const GemmArgs<T, T> p{ptr<T>(a), ptr<T>(w_GOK), ptr<T>(out), ptr<int64_t>(offsets),
                           ptr<int64_t>(tile_start), G, N, K, O};
    launch<MODE>(p, grid);
  });
  return out;
}

}  // namespace

at::Tensor grouped_gemm_fwd(const at::Tensor& x_NK, const at::Tensor& w_GOK,
                            const at::Tensor& offsets_G1) {
  return row_gemm<Mode::Fwd>(x_NK, w_GOK, offsets_G1, "grouped_gemm_fwd");
}

at::Tensor grouped_gemm_dx(const at::Tensor& dy_NO, const at::Tensor& w_GOK,
                           const at::Tensor& offsets_G1) {
  return row_gemm<Mode::Dx>(dy_NO, w_GOK, offsets_G1, "grouped_gemm_dx");
}

at::Tensor grouped_gemm_dw(const at::Tensor& dy_NO, const at::Tensor& x_NK,
                           const at::Tensor& offsets_G1, int64_t groups,
                           c10::ScalarType w_dtype) {
  const c10::cuda::CUDAGuard guard(x_NK.device());
  check_same_dtype(dy_NO, x_NK, "grouped_gemm_dw");
  check_offsets(offsets_G1, groups, "grouped_gemm_dw");
  const int64_t G = groups;
  const int64_t N = x_NK.size(0);
  const int64_t K = x_NK.size(1);
  const int64_t O = dy_NO.size(1);
  at::Tensor dw = new_output({G, O, K}, x_NK.options().dtype(w_dtype));
  if (G == 0 || O == 0 || K == 0) return dw;
  TORCH_CHECK(G <= 65535, "automoe::ops::cuda::grouped_gemm_dw: ", G, " groups exceed the grid");
  const dim3 grid(grid_dim(ceil_div(O, BM) * ceil_div(K, BN)), static_cast<unsigned>(G));
  dispatch_float(x_NK.scalar_type(), "grouped_gemm_dw", [&](auto in_tag) {
    dispatch_float(w_dtype, "grouped_gemm_dw", [&](auto out_tag) {
      using T = typename decltype(in_tag)::type;
      using TOut = typename decltype(out_tag)::type;
      const GemmArgs<T, TOut> p{ptr<T>(dy_NO), ptr<T>(x_NK), ptr<TOut>(dw),
                                ptr<int64_t>(offsets_G1), nullptr, G, N, K, O};
      launch<Mode::Dw>(p, grid);
    });
  });
  return dw;
}

}  // namespace automoe::ops::cuda
