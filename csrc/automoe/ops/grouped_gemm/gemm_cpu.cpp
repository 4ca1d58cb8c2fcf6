#include "automoe/ops/grouped_gemm/gemm_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

#include "automoe/core/error.h"
#include "automoe/ops/cpu/isa.h"
#include "automoe/ops/cpu/vec.h"

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _undefined_ placeholders.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace automoe::ops::cpu {
namespace {
constexpr int64_t kMR = 6;    // micro-tile rows
constexpr int64_t kMC = 96;   // rows per packed A block (16 micro-panels)
constexpr int64_t kMU = 384;  // rows per work unit: each packed B panel serves kMU / kMC A blocks
constexpr int64_t kNC = 256;  // columns per work unit
constexpr int64_t kKC = 512;  // depth per packed panel
// Micro-tile columns: NR = 16 (two 8-float AVX2 registers, or the generic loop) or 32 (two
// 16-float AVX-512 registers). Per micro-tile the kernel streams an A micro-panel (kKC x kMR
// floats, 12 KB) and a B micro-panel (kKC x NR, 32 or 64 KB) from L1/L2; the whole packed B panel
// (kKC x kNC, 512 KB) sits in L2. kKC = 512 measured best of 256/512 for the AVX-512 kernel
// (fewer accumulator round-trips); see docs/ops.md.

// ---- micro-kernels: acc[kMR][NR] (+)= a_panel[kc][kMR] x b_panel[kc][NR] --------------------

template <int NR>
void micro_kernel_generic(int64_t kc, const float* a, const float* b, float* acc, int64_t ldc,
                          bool add) {
  float c[kMR][NR] = {};
  for (int64_t p = 0; p < kc; ++p, a += kMR, b += NR) {
    for (int64_t r = 0; r < kMR; ++r) {
      for (int64_t j = 0; j < NR; ++j) c[r][j] += a[r] * b[j];
    }
  }
  for (int64_t r = 0; r < kMR; ++r) {
    for (int64_t j = 0; j < NR; ++j) acc[r * ldc + j] = (add ? acc[r * ldc + j] : 0.f) + c[r][j];
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void micro_kernel_avx2(int64_t kc, const float* a,
                                                           const float* b, float* acc, int64_t ldc,
                                                           bool add) {
  constexpr int64_t kNR = 16;
  __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(),
         c11 = _mm256_setzero_ps(), c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps(),
         c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps(), c40 = _mm256_setzero_ps(),
         c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
  for (int64_t p = 0; p < kc; ++p, a += kMR, b += kNR) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    __m256 ar = _mm256_broadcast_ss(a + 0);
    c00 = _mm256_fmadd_ps(ar, b0, c00);
    c01 = _mm256_fmadd_ps(ar, b1, c01);
    ar = _mm256_broadcast_ss(a + 1);
    c10 = _mm256_fmadd_ps(ar, b0, c10);
    c11 = _mm256_fmadd_ps(ar, b1, c11);
    ar = _mm256_broadcast_ss(a + 2);
    c20 = _mm256_fmadd_ps(ar, b0, c20);
    c21 = _mm256_fmadd_ps(ar, b1, c21);
    ar = _mm256_broadcast_ss(a + 3);
    c30 = _mm256_fmadd_ps(ar, b0, c30);
    c31 = _mm256_fmadd_ps(ar, b1, c31);
    ar = _mm256_broadcast_ss(a + 4);
    c40 = _mm256_fmadd_ps(ar, b0, c40);
    c41 = _mm256_fmadd_ps(ar, b1, c41);
    ar = _mm256_broadcast_ss(a + 5);
    c50 = _mm256_fmadd_ps(ar, b0, c50);
    c51 = _mm256_fmadd_ps(ar, b1, c51);
  }
  const __m256 rows[kMR][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                               {c30, c31}, {c40, c41}, {c50, c51}};
  for (int64_t r = 0; r < kMR; ++r) {
    float* out = acc + r * ldc;
    __m256 lo = rows[r][0], hi = rows[r][1];
    if (add) {
      lo = _mm256_add_ps(lo, _mm256_load_ps(out));
      hi = _mm256_add_ps(hi, _mm256_load_ps(out + 8));
    }
    _mm256_store_ps(out, lo);
    _mm256_store_ps(out + 8, hi);
  }
}

// The same tile in AVX-512: kMR rows x 32 columns, 12 accumulators. bf16 operands are widened to
// float32 while packing, as on AVX2: on CPUs whose bf16 dot-product instruction issues once per
// cycle (measured on an AVX-512-BF16 Xeon: 86 GFLOP/s per core with vdpbf16ps, ours or oneDNN's,
// against 160 with two float32 FMA ports) this is the faster bf16 path short of AMX.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void micro_kernel_avx512(
    int64_t kc, const float* a, const float* b, float* acc, int64_t ldc, bool add) {
  constexpr int64_t kNR = 32;
  __m512 c[kMR][2];
  for (int64_t r = 0; r < kMR; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kc; ++p, a += kMR, b += kNR) {
    const __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
#pragma GCC unroll 6
    for (int64_t r = 0; r < kMR; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r]);
      c[r][0] = _mm512_fmadd_ps(ar, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(ar, b1, c[r][1]);
    }
  }
  for (int64_t r = 0; r < kMR; ++r) {
    float* out = acc + r * ldc;
    if (add) {
      c[r][0] = _mm512_add_ps(c[r][0], _mm512_load_ps(out));
      c[r][1] = _mm512_add_ps(c[r][1], _mm512_load_ps(out + 16));
    }
    _mm512_store_ps(out, c[r][0]);
    _mm512_store_ps(out + 16, c[r][1]);
  }
}
#endif

using MicroKernel = void (*)(int64_t, const float*, const float*, float*, int64_t, bool);

// ---- packing: strided (float | bf16) -> float32 micro-panels, zero-padded at the edges -------

template <typename T>
inline float load_f32(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// A[m0 : m0+mc, k0 : k0+kc] -> panels of kMR rows: dst[panel][p][r].
template <typename T>
void pack_a(const GemmOperand& A, int64_t m0, int64_t mc, int64_t k0, int64_t kc, float* dst) {
  const T* src = static_cast<const T*>(A.data);
  for (int64_t i0 = 0; i0 < mc; i0 += kMR, dst += kMR * kc) {
    const int64_t rows = std::min(kMR, mc - i0);
    for (int64_t r = 0; r < kMR; ++r) {
      if (r >= rows) {
        for (int64_t p = 0; p < kc; ++p) dst[p * kMR + r] = 0.f;
        continue;
      }
      const T* row = src + (m0 + i0 + r) * A.row_stride + k0 * A.col_stride;
      if (A.col_stride == 1) {
        for (int64_t p = 0; p < kc; ++p) dst[p * kMR + r] = load_f32(row, p);
      } else {
        for (int64_t p = 0; p < kc; ++p) dst[p * kMR + r] = load_f32(row, p * A.col_stride);
      }
    }
  }
}

#if defined(__x86_64__)
// Eight floats from eight bf16 or float32 values.
__attribute__((target("avx2,fma"))) inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) {
  return _mm256_loadu_ps(p);
}

// A full NR-column panel of B = Wᵀ (W row-major, B(k, n) = W[n * ld + k]) for kc a multiple of
// 8: 8x8 register transposes instead of NR strided scalar streams.
template <int NR, typename T>
__attribute__((target("avx2,fma"))) void pack_b_panel_transposed_avx2(const T* w, int64_t ld,
                                                                      int64_t kc, float* dst) {
  for (int64_t j0 = 0; j0 < NR; j0 += 8) {
    for (int64_t p0 = 0; p0 < kc; p0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = load8(w + (j0 + i) * ld + p0);
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      const __m256 out[8] = {
          _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
          _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
          _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
          _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      for (int i = 0; i < 8; ++i) _mm256_store_ps(dst + (p0 + i) * NR + j0, out[i]);
    }
  }
}
#endif

// B[k0 : k0+kc, n0 : n0+nc] -> panels of NR columns: dst[panel][p][j]. `simd`: the AVX2
// transposes may be used.
template <int NR, typename T>
void pack_b(const GemmOperand& B, int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst,
            bool simd) {
  const T* src = static_cast<const T*>(B.data);
  for (int64_t j0 = 0; j0 < nc; j0 += NR, dst += NR * kc) {
    const int64_t cols = std::min<int64_t>(NR, nc - j0);
    if (B.col_stride == 1) {  // rows of B are contiguous: copy NR-wide strips
      for (int64_t p = 0; p < kc; ++p) {
        const T* row = src + (k0 + p) * B.row_stride + (n0 + j0);
        float* d = dst + p * NR;
        for (int64_t j = 0; j < cols; ++j) d[j] = load_f32(row, j);
        for (int64_t j = cols; j < NR; ++j) d[j] = 0.f;
      }
    } else {  // columns of B are contiguous (B = Wᵀ): read each column along k
#if defined(__x86_64__)
      if (simd && B.row_stride == 1 && cols == NR && kc % 8 == 0) {
        pack_b_panel_transposed_avx2<NR>(src + k0 + (n0 + j0) * B.col_stride, B.col_stride, kc,
                                         dst);
        continue;
      }
#endif
      for (int64_t j = 0; j < NR; ++j) {
        if (j >= cols) {
          for (int64_t p = 0; p < kc; ++p) dst[p * NR + j] = 0.f;
          continue;
        }
        const T* col = src + k0 * B.row_stride + (n0 + j0 + j) * B.col_stride;
        for (int64_t p = 0; p < kc; ++p) dst[p * NR + j] = load_f32(col, p * B.row_stride);
      }
    }
  }
}

using PackA = void (*)(const GemmOperand&, int64_t, int64_t, int64_t, int64_t, float*);
using PackB = void (*)(const GemmOperand&, int64_t, int64_t, int64_t, int64_t, float*, bool);

PackA pack_a_for(c10::ScalarType t) {
  return t == c10::ScalarType::BFloat16 ? pack_a<c10::BFloat16> : pack_a<float>;
}
template <int NR>
PackB pack_b_for(c10::ScalarType t) {
  return t == c10::ScalarType::BFloat16 ? pack_b<NR, c10::BFloat16> : pack_b<NR, float>;
}

// Writes (or adds) the float32 tile acc [mc, nc] (row stride kNC) into C.
void store_tile(const GemmProblem& P, int64_t m0, int64_t mc, int64_t n0, int64_t nc,
                const float* acc) {
  for (int64_t i = 0; i < mc; ++i) {
    const float* a = acc + i * kNC;
    const int64_t off = (m0 + i) * P.ldc + n0;
    if (P.c_dtype == c10::ScalarType::BFloat16) {
      vec::store(a, static_cast<c10::BFloat16*>(P.C) + off, P.c_dtype, nc);
    } else {
      auto* c = static_cast<float*>(P.C) + off;
      if (P.accumulate) {
        for (int64_t j = 0; j < nc; ++j) c[j] += a[j];
      } else {
        std::memcpy(c, a, nc * sizeof(float));
      }
    }
  }
}

struct Unit {
  int64_t problem, m0, n0;
};

template <typename T>
struct AlignedDelete {
  void operator()(T* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
template <typename T>
using Aligned = std::unique_ptr<T[], AlignedDelete<T>>;

template <typename T>
Aligned<T> aligned(size_t n) {
  return Aligned<T>(static_cast<T*>(::operator new[](n * sizeof(T), std::align_val_t(64))));
}

// Per thread. brgemm's operands are bf16: A [kMU, kKC] and B in VNNI pairs [kKC/2, kNC, 2].
struct Workspace {
  Aligned<float> a = aligned<float>(kMC * kKC), b = aligned<float>(kKC * kNC),
                 acc = aligned<float>(kMU * kNC);
  Aligned<c10::BFloat16> a16, b16;
  // What a16 holds (brgemm): the A panel of (problem, first row, depth); consecutive units of one
  // thread that share it (the same rows, the next column tile) skip re-packing it.
  const GemmProblem* a16_problem = nullptr;
  int64_t a16_m0 = -1, a16_k0 = -1;
  // run_unit_brgemm_transposed: Aᵀ in VNNI pairs for (problem, first row), and the Cᵀ tile
  std::vector<uint16_t> nt_b;
  std::vector<float> nt_c;
  const GemmProblem* nt_problem = nullptr;
  int64_t nt_m0 = -1;
};

// One (row range, column tile) of one problem: for each depth panel, B is packed once and serves
// every A block of the unit's rows; micro-kernels accumulate into acc [kMU, kNC].
template <int NR>
void run_unit(const GemmProblem& P, const Unit& u, Workspace& ws, MicroKernel kernel, bool simd) {
  const int64_t mu = std::min(kMU, P.M - u.m0), nc = std::min(kNC, P.N - u.n0);
  const PackA pa = pack_a_for(P.A.dtype);
  const PackB pb = pack_b_for<NR>(P.B.dtype);
  float tile[kMR * NR] __attribute__((aligned(64)));
  for (int64_t k0 = 0; k0 < P.K; k0 += kKC) {
    const int64_t kc = std::min(kKC, P.K - k0);
    const bool add = k0 > 0;
    pb(P.B, k0, kc, u.n0, nc, ws.b.get(), simd);
    for (int64_t mb = 0; mb < mu; mb += kMC) {
      const int64_t mc = std::min(kMC, mu - mb);
      pa(P.A, u.m0 + mb, mc, k0, kc, ws.a.get());
      for (int64_t j0 = 0; j0 < nc; j0 += NR) {
        const float* bp = ws.b.get() + (j0 / NR) * NR * kc;
        const int64_t cols = std::min<int64_t>(NR, nc - j0);
        for (int64_t i0 = 0; i0 < mc; i0 += kMR) {
          const float* ap = ws.a.get() + (i0 / kMR) * kMR * kc;
          const int64_t rows = std::min(kMR, mc - i0);
          float* out = ws.acc.get() + (mb + i0) * kNC + j0;
          if (rows == kMR && cols == NR) {  // a full tile: straight into acc
            kernel(kc, ap, bp, out, kNC, add);
            continue;
          }
          if (add) {  // an edge tile: through a full-size staging tile
            for (int64_t r = 0; r < kMR; ++r) {
              for (int64_t j = 0; j < NR; ++j) {
                tile[r * NR + j] = (r < rows && j < cols) ? out[r * kNC + j] : 0.f;
              }
            }
          }
          kernel(kc, ap, bp, tile, NR, add);
          for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * kNC, tile + r * NR, cols * 4);
        }
      }
    }
  }
  if (P.K == 0) {
    for (int64_t i = 0; i < mu; ++i) std::fill_n(ws.acc.get() + i * kNC, nc, 0.f);
  }
  store_tile(P, u.m0, mu, u.n0, nc, ws.acc.get());
}

// ---- brgemm: ATen's batch-reduce GEMM (oneDNN's ukernel; AMX tiles where the CPU has them) ----

constexpr int64_t kBrN = 64;  // columns per brgemm call (a multiple of 16, as AMX tiles need)

// Element (i, j) of an operand as raw bf16 bits.
inline uint16_t bits_at(const GemmOperand& X, int64_t i, int64_t j) {
  return static_cast<const uint16_t*>(X.data)[i * X.row_stride + j * X.col_stride];
}

// A[m0 : m0+mc, k0 : k0+kc] -> bf16 rows dst[i][p] of kcp columns (kcp = kc rounded up to even,
// zero-padded), for rows i >= i_done or columns p >= p_done (what the SIMD pass left).
void pack_a_bf16_rest(const GemmOperand& A, int64_t m0, int64_t mc, int64_t k0, int64_t kc,
                      int64_t kcp, uint16_t* dst, int64_t i_done, int64_t p_done) {
  for (int64_t i = 0; i < mc; ++i) {
    for (int64_t p = i < i_done ? p_done : 0; p < kcp; ++p) {
      dst[i * kcp + p] = p < kc ? bits_at(A, m0 + i, k0 + p) : 0;
    }
  }
}

// B[k0 : k0+kc, n0 : n0+nw] -> VNNI pairs dst[p / 2][j][p % 2] over nwp columns (zero padding),
// for pairs p / 2 >= q_done or columns j >= j_done.
void pack_b_vnni_rest(const GemmOperand& B, int64_t k0, int64_t kc, int64_t n0, int64_t nw,
                      int64_t nwp, uint16_t* dst, int64_t q_done, int64_t j_done) {
  for (int64_t q = 0; 2 * q < kc; ++q) {
    for (int64_t j = q < q_done ? j_done : 0; j < nwp; ++j) {
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t p = 2 * q + h;
        dst[(q * nwp + j) * 2 + h] = p < kc && j < nw ? bits_at(B, k0 + p, n0 + j) : 0;
      }
    }
  }
}

#if defined(__x86_64__)
#define AUTOMOE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

// Transposes a 16 x 16 block of 32-bit words held in r[0..15] (row i in r[i]), in place.
AUTOMOE_AVX512 inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // b[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c.
  for (int i = 0; i < 4; ++i) {
    b[4 * i + 0] = _mm512_unpacklo_epi64(a[4 * i + 0], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i + 0], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i c0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88);
    const __m512i c1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
    const __m512i d0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i d1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(c0, d0, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(c0, d0, 0xDD);
    r[4 + c] = _mm512_shuffle_i32x4(c1, d1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(c1, d1, 0xDD);
  }
}

// 16 bf16 of row p (low halves) and of row p + 1 (high halves) as 16 VNNI pairs.
AUTOMOE_AVX512 inline __m512i pair_rows(const uint16_t* r0, const uint16_t* r1) {
  const __m512i lo =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0)));
  const __m512i hi =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1)));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

AUTOMOE_AVX512 void pack_a_bf16_simd(const GemmOperand& A, int64_t m0, int64_t mc, int64_t k0,
                                     int64_t kc, int64_t kcp, uint16_t* dst) {
  const auto* src = static_cast<const uint16_t*>(A.data);
  if (A.row_stride != 1) {  // rows: contiguous (a copy) or strided (gathered)
    for (int64_t i = 0; i < mc; ++i) {
      const uint16_t* row = src + (m0 + i) * A.row_stride + k0 * A.col_stride;
      if (A.col_stride == 1) {
        std::memcpy(dst + i * kcp, row, kc * sizeof(uint16_t));
      } else {
        for (int64_t p = 0; p < kc; ++p) dst[i * kcp + p] = row[p * A.col_stride];
      }
      if (kcp > kc) dst[i * kcp + kc] = 0;
    }
    return;
  }
  // A transposed in memory (A(i, p) at src[p * cs + i], e.g. dYᵀ in the weight gradient): pairs
  // of source rows p, p + 1 give 16 VNNI words per 16 i; a 16 x 16 word transpose turns them into
  // 32 bf16 of 16 destination rows.
  const int64_t cs = A.col_stride, mf = mc / 16 * 16, qf = kc / 32 * 16;
  auto* dst32 = reinterpret_cast<uint32_t*>(dst);
  __m512i r[16];
  for (int64_t i = 0; i < mf; i += 16) {
    for (int64_t q = 0; q < qf; q += 16) {
      for (int64_t t = 0; t < 16; ++t) {
        const uint16_t* r0 = src + (k0 + 2 * (q + t)) * cs + m0 + i;
        r[t] = pair_rows(r0, r0 + cs);
      }
      transpose16x16_epi32(r);
      for (int64_t t = 0; t < 16; ++t) {
        _mm512_storeu_si512(dst32 + (i + t) * (kcp / 2) + q, r[t]);
      }
    }
  }
  pack_a_bf16_rest(A, m0, mc, k0, kc, kcp, dst, mf, 2 * qf);
}

AUTOMOE_AVX512 void pack_b_vnni_simd(const GemmOperand& B, int64_t k0, int64_t kc, int64_t n0,
                                     int64_t nw, int64_t nwp, uint16_t* dst) {
  const auto* src = static_cast<const uint16_t*>(B.data);
  auto* dst32 = reinterpret_cast<uint32_t*>(dst);
  const int64_t jf = nw / 16 * 16;
  if (B.col_stride == 1) {  // rows of B contiguous: interleave rows p and p + 1
    const int64_t qf = kc / 2;
    for (int64_t q = 0; q < qf; ++q) {
      const uint16_t* r0 = src + (k0 + 2 * q) * B.row_stride + n0;
      for (int64_t j = 0; j < jf; j += 16) {
        _mm512_storeu_si512(dst32 + q * nwp + j, pair_rows(r0 + j, r0 + j + B.row_stride));
      }
    }
    pack_b_vnni_rest(B, k0, kc, n0, nw, nwp, dst, qf, jf);
    return;
  }
  if (B.row_stride == 1) {  // Bᵀ contiguous (the forward's weights): each pair is one 32-bit word
    const int64_t cs = B.col_stride, qf = kc / 32 * 16;
    __m512i r[16];
    for (int64_t j = 0; j < jf; j += 16) {
      for (int64_t q = 0; q < qf; q += 16) {
        for (int64_t t = 0; t < 16; ++t) {
          r[t] = _mm512_loadu_si512(src + (n0 + j + t) * cs + k0 + 2 * q);
        }
        transpose16x16_epi32(r);
        for (int64_t t = 0; t < 16; ++t) _mm512_storeu_si512(dst32 + (q + t) * nwp + j, r[t]);
      }
    }
    pack_b_vnni_rest(B, k0, kc, n0, nw, nwp, dst, qf, jf);
    return;
  }
  pack_b_vnni_rest(B, k0, kc, n0, nw, nwp, dst, 0, 0);
}
#undef AUTOMOE_AVX512
#else
void pack_a_bf16_simd(const GemmOperand& A, int64_t m0, int64_t mc, int64_t k0, int64_t kc,
                      int64_t kcp, uint16_t* dst) {
  pack_a_bf16_rest(A, m0, mc, k0, kc, kcp, dst, 0, 0);
}
void pack_b_vnni_simd(const GemmOperand& B, int64_t k0, int64_t kc, int64_t n0, int64_t nw,
                      int64_t nwp, uint16_t* dst) {
  pack_b_vnni_rest(B, k0, kc, n0, nw, nwp, dst, 0, 0);
}
#endif

constexpr int64_t kBrM = 32;  // rows per brgemm call

void run_unit_brgemm(const GemmProblem& P, const Unit& u, Workspace& ws) {
  const int64_t mu = std::min(kMU, P.M - u.m0), nc = std::min(kNC, P.N - u.n0);
  if (!ws.a16) {
    ws.a16 = aligned<c10::BFloat16>(kMU * kKC);
    ws.b16 = aligned<c10::BFloat16>(kKC * kNC);
  }
  float* acc = ws.acc.get();
  auto* a16 = reinterpret_cast<uint16_t*>(ws.a16.get());
  auto* b16 = reinterpret_cast<uint16_t*>(ws.b16.get());
  for (int64_t k0 = 0; k0 < P.K; k0 += kKC) {
    const int64_t kc = std::min(kKC, P.K - k0), kcp = (kc + 1) / 2 * 2;
    if (ws.a16_problem != &P || ws.a16_m0 != u.m0 || ws.a16_k0 != k0) {
      pack_a_bf16_simd(P.A, u.m0, mu, k0, kc, kcp, a16);
      ws.a16_problem = &P, ws.a16_m0 = u.m0, ws.a16_k0 = k0;
    }
    // Column block j0 of B in VNNI pairs at b16 + j0 * kcp.
    for (int64_t j0 = 0; j0 < nc; j0 += kBrN) {
      const int64_t nw = std::min(kBrN, nc - j0), nwp = (nw + 15) / 16 * 16;
      pack_b_vnni_simd(P.B, k0, kc, u.n0 + j0, nw, nwp, b16 + j0 * kcp);
    }
    for (int64_t mb = 0; mb < mu; mb += kBrM) {
      const int64_t m = std::min(kBrM, mu - mb);
      for (int64_t j0 = 0; j0 < nc; j0 += kBrN) {
        const int64_t nwp = (std::min(kBrN, nc - j0) + 15) / 16 * 16;
        at::native::cpublas::brgemm(m, nwp, kcp, kcp, nwp, kNC, /*add_C=*/k0 > 0,
                                    ws.a16.get() + mb * kcp, ws.b16.get() + j0 * kcp,
                                    acc + mb * kNC + j0, /*is_vnni=*/true);
      }
    }
  }
  if (P.K == 0) {
    for (int64_t i = 0; i < mu; ++i) std::fill_n(acc + i * kNC, nc, 0.f);
  }
  store_tile(P, u.m0, mu, u.n0, nc, acc);
}

// ---- brgemm with few rows: Cᵀ = Bᵀ · Aᵀ, the weights read in place -----------------------------
//
// The experts' forward at fine-tuning sizes has few rows per expert (Qwen3-30B-A3B at 1 x 512:
// 32) against large weights (B = Wᵀ, W [N, K] with rows contiguous). run_unit_brgemm packs a
// kKC x kNC panel of W into VNNI pairs (a 16 x 16 word transpose) for every unit of rows: with
// few rows, packing W costs about what the product does. Computed transposed, W is brgemm's A
// operand, read where it lies (rows of K bf16, as brgemm's row-major A wants them), and Aᵀ, the
// small operand, is the VNNI-packed B: packed once per thread and problem, it serves every
// column tile. The float32 Cᵀ tile is transposed back into the row-major staging tile that
// store_tile rounds from. Measured on a Zen 5 (AVX512_BF16, docs/ops.md): 1.55x at 32 rows,
// 1.13x at 128, even at 256, slower at 512 (Aᵀ as a wide B) and at 16 rows or fewer for short
// rows of W (K = 768: the rows padded to one 16-column block, memory-bound). Not on AMX CPUs: never
// measured there, so their brgemm keeps the packing path.
constexpr int64_t kNtMinRows = 17, kNtMaxRows = 128;
static_assert(kNtMaxRows <= kMU, "a transposed problem is one unit of rows");

// Whether P runs transposed: bf16, 17-128 rows, A's rows and W's rows (B's columns) contiguous, an
// even depth (W's VNNI pairs are read in place), no accumulation, below AMX.
bool runs_transposed(const GemmProblem& P) {
  return P.M >= kNtMinRows && P.M <= kNtMaxRows && P.K % 2 == 0 &&
         P.A.dtype == c10::ScalarType::BFloat16 && P.B.dtype == c10::ScalarType::BFloat16 &&
         P.A.col_stride == 1 && P.B.row_stride == 1 && !P.accumulate && active_isa() < Isa::kAmx;
}

#if defined(__x86_64__)
// dst [mu, nc] (row stride kNC) = srcᵀ, src [nc, mp] float32 (row stride mp): 16 x 16 blocks.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void transpose_tile(
    const float* src, int64_t mp, int64_t mu, int64_t nc, float* dst) {
  const int64_t nf = nc / 16 * 16;
  __m512i r[16];
  for (int64_t i0 = 0; i0 < mu; i0 += 16) {
    for (int64_t j0 = 0; j0 < nf; j0 += 16) {
      for (int t = 0; t < 16; ++t) {
        r[t] = _mm512_loadu_si512(src + (j0 + t) * mp + i0);
      }
      transpose16x16_epi32(r);
      for (int64_t t = 0; t < 16 && i0 + t < mu; ++t) {
        _mm512_storeu_si512(dst + (i0 + t) * kNC + j0, r[t]);
      }
    }
  }
  for (int64_t i = 0; i < mu; ++i) {
    for (int64_t j = nf; j < nc; ++j) dst[i * kNC + j] = src[j * mp + i];
  }
}
#else
void transpose_tile(const float* src, int64_t mp, int64_t mu, int64_t nc, float* dst) {
  for (int64_t i = 0; i < mu; ++i) {
    for (int64_t j = 0; j < nc; ++j) dst[i * kNC + j] = src[j * mp + i];
  }
}
#endif

void run_unit_brgemm_transposed(const GemmProblem& P, const Unit& u, Workspace& ws) {
  const int64_t mu = P.M - u.m0, mp = (mu + 15) / 16 * 16, nc = std::min(kNC, P.N - u.n0);
  const int64_t K = P.K;
  if (ws.nt_problem != &P || ws.nt_m0 != u.m0) {
    // Aᵀ (K x mu, element (k, i) = A[m0 + i, k]) in VNNI pairs [K / 2][mp][2]
    if (static_cast<int64_t>(ws.nt_b.size()) < K * mp) ws.nt_b.resize(K * mp);
    const GemmOperand At{static_cast<const uint16_t*>(P.A.data) + u.m0 * P.A.row_stride, P.A.dtype,
                         1, P.A.row_stride};
    pack_b_vnni_simd(At, 0, K, 0, mu, mp, ws.nt_b.data());
    ws.nt_problem = &P, ws.nt_m0 = u.m0;
  }
  if (static_cast<int64_t>(ws.nt_c.size()) < kNC * mp) ws.nt_c.resize(kNC * mp);
  // Cᵀ[j, i] = sum_k W[n0 + j, k] A[m0 + i, k]: W's rows n0.. as A (row stride B.col_stride)
  const auto* w = static_cast<const c10::BFloat16*>(P.B.data) + u.n0 * P.B.col_stride;
  at::native::cpublas::brgemm(nc, mp, K, P.B.col_stride, mp, mp, /*add_C=*/false, w,
                              reinterpret_cast<const c10::BFloat16*>(ws.nt_b.data()),
                              ws.nt_c.data(), /*is_vnni=*/true);
  transpose_tile(ws.nt_c.data(), mp, mu, nc, ws.acc.get());
  store_tile(P, u.m0, mu, u.n0, nc, ws.acc.get());
}

// Whether ATen's bf16 brgemm runs here (oneDNN's ukernel compiled in, an AVX-512 CPU, oneDNN
// enabled): one tiny product, checked.
bool brgemm_runs() {
  static const bool ok = [] {
    if (detected_isa() < Isa::kAvx512) return false;
    try {
      c10::BFloat16 a[2 * 2], b[1 * 16 * 2];
      for (auto& v : a) v = c10::BFloat16(1.f);
      for (auto& v : b) v = c10::BFloat16(2.f);
      float c[2 * 16] = {};
      at::native::cpublas::brgemm(2, 16, 2, 2, 16, 16, false, a, b, c, true);
      at::native::cpublas::brgemm_release(true);
      return std::all_of(c, c + 32, [](float v) { return v == 4.f; });  // 2 x (1 x 2)
    } catch (const std::exception&) {
      return false;
    }
  }();
  return ok;
}

// float64: a plain triple loop (tests only).
void run_problem_f64(const GemmProblem& P) {
  const auto* A = static_cast<const double*>(P.A.data);
  const auto* B = static_cast<const double*>(P.B.data);
  auto* C = static_cast<double*>(P.C);
  at::parallel_for(0, P.M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (int64_t j = 0; j < P.N; ++j) {
        double s = 0;
        for (int64_t p = 0; p < P.K; ++p) {
          s += A[i * P.A.row_stride + p * P.A.col_stride] * B[p * P.B.row_stride + j * P.B.col_stride];
        }
        double& c = C[i * P.ldc + j];
        c = P.accumulate ? c + s : s;
      }
    }
  });
}

bool is_f32_or_bf16(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::BFloat16;
}

std::atomic<int> g_forced{-1};  // a GemmPath forced by force_gemm_path, or -1

const char* const kPathNames[] = {"generic", "avx2", "avx512", "brgemm"};

bool available(GemmPath p) {
  switch (p) {
    case GemmPath::kGeneric:
      return true;
    case GemmPath::kAvx2:
      return active_isa() >= Isa::kAvx2;
    case GemmPath::kAvx512:
      return active_isa() >= Isa::kAvx512;
    case GemmPath::kBrgemm:
      return active_isa() >= Isa::kAvx512 && brgemm_runs();
  }
  return false;
}

// The micro-kernel path the instruction set gives float32 problems (no forcing, no measurement).
GemmPath best_float_path() {
  if (available(GemmPath::kAvx512)) return GemmPath::kAvx512;
  if (available(GemmPath::kAvx2)) return GemmPath::kAvx2;
  return GemmPath::kGeneric;
}

// gemm_batch on a given path (gemm_batch itself takes gemm_path's).
void run_batch(const std::vector<GemmProblem>& problems, std::optional<GemmPath> path);

// ---- engine choices the instruction set does not settle: measured once per process ----------
//
// Two choices depend on more than cpuid: on an AVX-512-BF16 CPU without AMX, whether the native
// bf16 dot products (brgemm) beat the float32 FMA micro-kernel (AMD Zen 4/5 run vdpbf16ps at the
// FMA rate or better, so brgemm doubles the throughput; some Xeons issue it at half the FMA rate,
// so it loses), and for float32 whether ATen's BLAS (MKL, which runs slower code paths on
// non-Intel CPUs) beats our engine. Each is timed once per process and instruction-set level on
// a small problem per thread (best of 3, the two sides alternating); the new choice needs a 1.15x
// margin over the old default, so a noisy machine keeps the default unless the gap is large.

using Clock = std::chrono::steady_clock;

template <typename Fn>
double seconds(Fn&& fn) {
  const auto t0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Best-of-3 seconds of a and of b, run in turn (after one warm-up each), so that a busy moment
// hits both alike.
template <typename A, typename B>
std::pair<double, double> best_alternating(A&& a, B&& b) {
  a();
  b();
  double ta = 1e30, tb = 1e30;
  for (int r = 0; r < 3; ++r) {
    ta = std::min(ta, seconds(a));
    tb = std::min(tb, seconds(b));
  }
  return {ta, tb};
}

struct Probe {
  std::mutex mu;
  int decided[5] = {-1, -1, -1, -1, -1};  // per Isa level: -1 not measured, 0 / 1
  std::string summary[5];
};

Probe& brgemm_probe() {
  static Probe p;
  return p;
}
Probe& aten_fp32_probe() {
  static Probe p;
  return p;
}

// Decisions as gemm_decisions() writes them, for the active level: whether they applied.
bool adopt(const std::string& decisions, const std::string& source) {
  const int level = static_cast<int>(active_isa());
  const std::string isa = isa_name(active_isa());
  if (decisions.size() != isa.size() + 4 || decisions.compare(0, isa.size(), isa) != 0) return false;
  Probe* probes[] = {&brgemm_probe(), &aten_fp32_probe()};
  for (int i = 0; i < 2; ++i) {
    const char c = decisions[isa.size() + 1 + 2 * i];
    if (decisions[isa.size() + 2 * i] != ':' || (c != '0' && c != '1' && c != '-')) return false;
  }
  for (int i = 0; i < 2; ++i) {
    const char c = decisions[isa.size() + 1 + 2 * i];
    if (c == '-') continue;
    std::lock_guard<std::mutex> lock(probes[i]->mu);
    probes[i]->decided[level] = c == '1';
    probes[i]->summary[level] = "adopted from " + source;
  }
  return true;
}

// ---- the machine's measured choices, remembered between processes ---------------------------
//
// Measured in each process, a choice whose two sides time within noise of the margin comes out
// either way (on an AVX2 EPYC, ATen and our float32 kernel tie and the probe picked ours in ~2
// of 12 processes): two runs of the same recipe would then sum in different orders. So the first
// measurement on a machine is remembered in a small file, one line per (CPU, level, threads,
// torch) — $AUTOMOE_CACHE/cpu_gemm, else ~/.cache/automoe/cpu_gemm (the directory the tokenised
// datasets use too) — and later processes adopt it instead of measuring.
// AUTOMOE_CPU_GEMM_CACHE=off turns it off; deleting the file measures again. Beyond a bad value of
// that variable nothing here is an error: an unreadable or unwritable cache is no cache.

bool g_cache_writes = true;  // false while AUTOMOE_CPU_GEMM_DECISIONS pins the choices

std::string cache_file() {
  if (const char* sw = std::getenv("AUTOMOE_CPU_GEMM_CACHE"); sw != nullptr && *sw != '\0') {
    const std::string v = sw;
    AUTOMOE_CHECK(v == "on" || v == "off", "AUTOMOE_CPU_GEMM_CACHE=", v, ": expected on or off");
    if (v == "off") return "";
  }
  std::string d;
  if (const char* dir = std::getenv("AUTOMOE_CACHE"); dir != nullptr && *dir != '\0') {
    d = dir;
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    d = std::string(home) + "/.cache/automoe";
  } else {
    return "";
  }
  return d + "/cpu_gemm";
}

// What the choices depend on: the CPU (vendor, name, family, model), the level the kernels run
// at, the thread count (the float32 probe runs one problem per thread) and ATen's version.
std::string machine_key() {
  static const std::string cpu = [] {
    std::ifstream in("/proc/cpuinfo");
    std::string line, out;
    for (const char* field : {"vendor_id", "model name", "cpu family", "model"}) {
      in.clear();
      in.seekg(0);
      while (std::getline(in, line)) {
        const auto colon = line.find(':');
        if (colon == std::string::npos) continue;
        std::string k = line.substr(0, colon);
        k.erase(k.find_last_not_of(" \t") + 1);
        if (k != field) continue;
        std::string v = line.substr(colon + 1);
        v.erase(0, v.find_first_not_of(' '));
        out += (out.empty() ? "" : " ") + v;
        break;
      }
    }
    return out.empty() ? std::string("unknown CPU") : out;
  }();
  static const std::string torch = [] {
    const std::string cfg = at::show_config();
    const auto at = cfg.find("TORCH_VERSION=");
    return at == std::string::npos ? std::string("?")
                                   : cfg.substr(at + 14, cfg.find_first_of(", \n", at + 14) - at - 14);
  }();
  std::string key = cpu + " | " + isa_name(active_isa()) + " | " +
                    std::to_string(std::max(1, at::get_num_threads())) + " threads | torch " + torch;
  for (char& c : key) {
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  }
  return key;
}

// The file's lines as (key, decisions).
std::vector<std::pair<std::string, std::string>> read_cache(const std::string& path) {
  std::vector<std::pair<std::string, std::string>> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto tab = line.find('\t');
    if (tab != std::string::npos) out.emplace_back(line.substr(0, tab), line.substr(tab + 1));
  }
  return out;
}

std::mutex g_cache_mu;

// After a measurement: the file's line for this machine gets the new decision (probe 0: brgemm,
// 1: ATen for float32), written to a temporary file and renamed over the old one.
void remember_decision(int probe, bool decision) {
  if (!g_cache_writes) return;
  const std::string path = cache_file();
  if (path.empty()) return;
  std::lock_guard<std::mutex> lock(g_cache_mu);
  try {
    auto lines = read_cache(path);
    const std::string key = machine_key(), isa = isa_name(active_isa());
    std::string* value = nullptr;
    for (auto& [k, v] : lines) {
      if (k == key) value = &v;
    }
    if (value == nullptr) value = &lines.emplace_back(key, "").second;
    if (value->size() != isa.size() + 4 || value->compare(0, isa.size(), isa) != 0) {
      *value = isa + ":-:-";
    }
    (*value)[isa.size() + 1 + 2 * probe] = decision ? '1' : '0';
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
    const std::string tmp = path + "." + std::to_string(::getpid()) + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      for (const auto& [k, v] : lines) out << k << '\t' << v << '\n';
      if (!out.good()) {
        std::filesystem::remove(tmp, ec);
        return;
      }
    }
    std::filesystem::rename(tmp, path, ec);
    if (ec) std::filesystem::remove(tmp, ec);
  } catch (const std::exception&) {
  }
}

// AUTOMOE_CPU_GEMM_DECISIONS (what gemm_decisions() printed in an earlier run): adopted instead
// of measuring, once, before the first probe. A value that cannot apply is an error naming it.
// Without it, the choices remembered for this machine (above), if any.
void adopt_pinned_decisions() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("AUTOMOE_CPU_GEMM_DECISIONS");
    if (env == nullptr || *env == '\0') {
      const std::string path = cache_file();
      if (path.empty()) return;
      const std::string key = machine_key();
      for (const auto& [k, v] : read_cache(path)) {
        if (k == key) adopt(v, "the cache " + path);
      }
      return;
    }
    g_cache_writes = false;
    const std::string v = env, isa = isa_name(active_isa());
    AUTOMOE_CHECK(v.rfind(isa + ":", 0) == 0, "AUTOMOE_CPU_GEMM_DECISIONS=", v,
                  ": the kernels run at ", isa, " here, so choices recorded at another level "
                  "cannot apply (pin the level too with AUTOMOE_CPU_ISA, or take this machine's "
                  "cpu_kernels.gemm_decisions from `automoe bench`)");
    AUTOMOE_CHECK(adopt(v, "AUTOMOE_CPU_GEMM_DECISIONS"),
                  "AUTOMOE_CPU_GEMM_DECISIONS=", v, ": expected ", isa,
                  ":B:F (B: brgemm for bf16, F: ATen for float32; each 1, 0 or -), as "
                  "`automoe bench` prints it in cpu_kernels.gemm_decisions");
  });
}

// One thread: a [192 x 512] x [512 x 256] bf16 problem shaped as the experts' forward (B
// transposed), brgemm against the AVX-512 micro-kernel.
bool brgemm_measured_faster() {
#if !defined(__x86_64__)
  return false;
#else
  adopt_pinned_decisions();
  Probe& pr = brgemm_probe();
  const int level = static_cast<int>(active_isa());
  std::lock_guard<std::mutex> lock(pr.mu);
  if (pr.decided[level] >= 0) return pr.decided[level] == 1;
  constexpr int64_t M = 192, N = 256, K = 512;
  std::vector<c10::BFloat16> a(M * K), b(N * K), c(M * N);
  for (size_t i = 0; i < a.size(); ++i) a[i] = c10::BFloat16(static_cast<float>(i % 7) - 3.f);
  for (size_t i = 0; i < b.size(); ++i) b[i] = c10::BFloat16(static_cast<float>(i % 5) - 2.f);
  const GemmProblem P{M,
                      N,
                      K,
                      {a.data(), c10::ScalarType::BFloat16, K, 1},
                      {b.data(), c10::ScalarType::BFloat16, 1, K},
                      c.data(),
                      c10::ScalarType::BFloat16,
                      N,
                      false};
  Workspace ws;
  auto run_brgemm = [&] {
    ws.a16_problem = nullptr;
    run_unit_brgemm(P, Unit{0, 0, 0}, ws);
  };
  auto run_avx512 = [&] { run_unit<32>(P, Unit{0, 0, 0}, ws, micro_kernel_avx512, true); };
  const auto [t_br, t_512] = best_alternating(run_brgemm, run_avx512);
  at::native::cpublas::brgemm_release(true);
  const double gf = 2.0 * M * N * K * 1e-9;
  pr.decided[level] = t_512 > 1.15 * t_br ? 1 : 0;
  pr.summary[level] = "brgemm " + std::to_string(static_cast<int>(gf / t_br)) + " vs avx512 " +
                      std::to_string(static_cast<int>(gf / t_512)) + " GFLOP/s (one thread)";
  remember_decision(0, pr.decided[level] == 1);
  return pr.decided[level] == 1;
#endif
}

}  // namespace

bool engine_preferred(c10::ScalarType dtype) {
  if (dtype == at::kBFloat16) {  // ATen's native bf16 GEMM is oneDNN's
    // (below AVX2 the engine is a plain loop: ATen's, whatever it runs, is the better bet —
    // and on other architectures ATen may have native bf16 the ISA table does not know)
    const Isa isa = active_isa();
    return isa >= Isa::kAvx2 && (isa < Isa::kAvx512Bf16 || !at::hasMKLDNN() ||
                                 !at::globalContext().userEnabledMkldnn());
  }
  return dtype == at::kFloat && !aten_faster_fp32();
}

bool aten_faster_fp32() {
  const Isa isa = active_isa();
  if (isa < Isa::kAvx2) return true;  // the generic loop never beats a BLAS
  adopt_pinned_decisions();
  Probe& pr = aten_fp32_probe();
  const int level = static_cast<int>(isa);
  std::lock_guard<std::mutex> lock(pr.mu);
  if (pr.decided[level] >= 0) return pr.decided[level] == 1;
  // Every thread one [192 x 512] x [512 x 256] problem, as the grouped GEMM runs its groups:
  // at::mm inside a parallel loop (single-threaded BLAS per task) against one gemm_batch.
  const int64_t T = std::max(1, at::get_num_threads()), M = 192, N = 256, K = 512;
  // Fixed small integers, not at::randn: the probe must not move the global generator (a run's
  // random stream would then depend on whether its first GEMM was float32).
  const at::Tensor a = at::arange(T * M * K, at::kFloat).remainder_(7).sub_(3).view({T, M, K});
  const at::Tensor b = at::arange(T * K * N, at::kFloat).remainder_(5).sub_(2).view({T, K, N});
  at::Tensor c = at::empty({T, M, N});
  std::vector<GemmProblem> problems;
  for (int64_t t = 0; t < T; ++t) {
    problems.push_back({M,
                        N,
                        K,
                        {a[t].const_data_ptr(), c10::ScalarType::Float, K, 1},
                        {b[t].const_data_ptr(), c10::ScalarType::Float, N, 1},
                        c[t].data_ptr(),
                        c10::ScalarType::Float,
                        N,
                        false});
  }
  auto run_aten = [&] {
    at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        at::Tensor ct = c[t];
        at::mm_out(ct, a[t], b[t]);
      }
    });
  };
  // Our engine on the path the instruction set gives it, whatever a test has forced meanwhile:
  // the choice is cached per level.
  const GemmPath engine = best_float_path();
  auto run_engine = [&] { run_batch(problems, engine); };
  const auto [t_aten, t_eng] = best_alternating(run_aten, run_engine);
  const double gf = 2.0 * M * N * K * T * 1e-9;
  pr.decided[level] = t_aten > 1.15 * t_eng ? 0 : 1;
  pr.summary[level] = "aten " + std::to_string(static_cast<int>(gf / t_aten)) + " vs " +
                      gemm_path_name(engine) + " " + std::to_string(static_cast<int>(gf / t_eng)) +
                      " GFLOP/s";
  remember_decision(1, pr.decided[level] == 1);
  return pr.decided[level] == 1;
}

std::string gemm_choices() {
  std::string out;
  for (Probe* p : {&brgemm_probe(), &aten_fp32_probe()}) {
    std::lock_guard<std::mutex> lock(p->mu);
    const std::string& s = p->summary[static_cast<int>(active_isa())];
    if (!s.empty()) out += (out.empty() ? "" : "; ") + s;
  }
  return out.empty() ? "not measured (no choice needed at this level)" : out;
}

std::string gemm_decisions() {
  const int level = static_cast<int>(active_isa());
  std::string out = isa_name(active_isa());
  for (Probe* p : {&brgemm_probe(), &aten_fp32_probe()}) {
    std::lock_guard<std::mutex> lock(p->mu);
    out += p->decided[level] < 0 ? ":-" : p->decided[level] ? ":1" : ":0";
  }
  return out;
}

bool adopt_gemm_decisions(const std::string& decisions, const std::string& source) {
  // The pin and the cache are read first, so that they never override a later adoption (a
  // resumed run's: the choices of the run it continues).
  adopt_pinned_decisions();
  return adopt(decisions, source);
}

const char* gemm_path_name(GemmPath p) { return kPathNames[static_cast<int>(p)]; }

GemmPath gemm_path(bool bf16_operands) {
  const int forced = g_forced.load(std::memory_order_relaxed);
  if (forced >= 0) {
    const auto p = static_cast<GemmPath>(forced);
    // brgemm takes bf16 operands only; other problems run the best micro-kernel.
    if (p != GemmPath::kBrgemm || bf16_operands) return p;
  } else if (bf16_operands && active_isa() >= Isa::kAvx512Bf16 && available(GemmPath::kBrgemm) &&
             (active_isa() >= Isa::kAmx || brgemm_measured_faster())) {
    return GemmPath::kBrgemm;
  }
  return best_float_path();
}

std::vector<GemmPath> gemm_paths_available() {
  std::vector<GemmPath> out;
  for (int i = 0; i < 4; ++i) {
    if (available(static_cast<GemmPath>(i))) out.push_back(static_cast<GemmPath>(i));
  }
  return out;
}

void force_gemm_path(const std::string& name) {
  if (name.empty()) {
    g_forced.store(-1, std::memory_order_relaxed);
    return;
  }
  for (int i = 0; i < 4; ++i) {
    if (name != kPathNames[i]) continue;
    AUTOMOE_CHECK(available(static_cast<GemmPath>(i)), "the \"", name,
                  "\" GEMM path does not run on this CPU at the ", isa_name(active_isa()),
                  " level");
    g_forced.store(i, std::memory_order_relaxed);
    return;
  }
  fail("unknown GEMM path \"", name, "\" (expected generic, avx2, avx512 or brgemm)");
}

void gemm_batch(const std::vector<GemmProblem>& problems) { run_batch(problems, std::nullopt); }

namespace {

void run_batch(const std::vector<GemmProblem>& problems, std::optional<GemmPath> path_override) {
  std::vector<Unit> units;
  bool all_bf16 = true;
  for (int64_t p = 0; p < static_cast<int64_t>(problems.size()); ++p) {
    const GemmProblem& P = problems[p];
    if (P.M == 0 || P.N == 0) continue;
    if (P.A.dtype == c10::ScalarType::Double) {
      AUTOMOE_CHECK(P.B.dtype == c10::ScalarType::Double && P.c_dtype == c10::ScalarType::Double,
                    "gemm_batch: float64 problems need float64 A, B and C");
      run_problem_f64(P);
      continue;
    }
    AUTOMOE_CHECK(is_f32_or_bf16(P.A.dtype) && is_f32_or_bf16(P.B.dtype) &&
                      is_f32_or_bf16(P.c_dtype),
                  "gemm_batch: operands must be float32 or bfloat16");
    AUTOMOE_CHECK(!P.accumulate || P.c_dtype == c10::ScalarType::Float,
                  "gemm_batch: accumulation needs a float32 C");
    all_bf16 = all_bf16 && P.A.dtype == c10::ScalarType::BFloat16 &&
               P.B.dtype == c10::ScalarType::BFloat16;
    for (int64_t m0 = 0; m0 < P.M; m0 += kMU) {
      for (int64_t n0 = 0; n0 < P.N; n0 += kNC) units.push_back({p, m0, n0});
    }
  }
  if (units.empty()) return;
  const GemmPath path = path_override ? *path_override : gemm_path(all_bf16);
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local Workspace ws;
    ws.a16_problem = ws.nt_problem = nullptr;  // packed panels are only reused within a batch
    for (int64_t u = begin; u < end; ++u) {
      const GemmProblem& P = problems[units[u].problem];
      switch (path) {
        case GemmPath::kBrgemm:
          if (runs_transposed(P)) {
            run_unit_brgemm_transposed(P, units[u], ws);
          } else {
            run_unit_brgemm(P, units[u], ws);
          }
          break;
#if defined(__x86_64__)
        case GemmPath::kAvx512:
          run_unit<32>(P, units[u], ws, micro_kernel_avx512, true);
          break;
        case GemmPath::kAvx2:
          run_unit<16>(P, units[u], ws, micro_kernel_avx2, true);
          break;
#endif
        default:
          run_unit<16>(P, units[u], ws, micro_kernel_generic<16>, false);
          break;
      }
    }
    if (path == GemmPath::kBrgemm) at::native::cpublas::brgemm_release(true);
  });
}

}  // namespace
}  // namespace automoe::ops::cpu
