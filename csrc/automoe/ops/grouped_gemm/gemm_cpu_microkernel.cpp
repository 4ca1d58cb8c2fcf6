// The CPU GEMM engine's packed float32 paths (gemm_cpu.h: avx512, avx2, generic): operands packed
// into float32 micro-panels (bf16 widened while packing), a kMR x NR micro-kernel, the unit loop.
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/ops/grouped_gemm/gemm_cpu_units.h"

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _undefined_ placeholders.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace automoe::ops::cpu::gemm_engine {
namespace {

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
}  // namespace

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

namespace {

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

}  // namespace

void run_unit_generic(const GemmProblem& P, const Unit& u, Workspace& ws) {
  run_unit<16>(P, u, ws, micro_kernel_generic<16>, false);
}

#if defined(__x86_64__)
void run_unit_avx2(const GemmProblem& P, const Unit& u, Workspace& ws) {
  run_unit<16>(P, u, ws, micro_kernel_avx2, true);
}

void run_unit_avx512(const GemmProblem& P, const Unit& u, Workspace& ws) {
  run_unit<32>(P, u, ws, micro_kernel_avx512, true);
}
#endif

}  // namespace automoe::ops::cpu::gemm_engine
