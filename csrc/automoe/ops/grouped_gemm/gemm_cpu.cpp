#include "automoe/ops/grouped_gemm/gemm_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "automoe/core/error.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace automoe::ops::cpu {
namespace {

constexpr int64_t kMR = 6;    // micro-tile rows
constexpr int64_t kNR = 16;   // micro-tile columns (two 8-float AVX registers)
constexpr int64_t kMC = 96;   // rows per work unit (16 micro-panels)
constexpr int64_t kNC = 256;  // columns per work unit (16 micro-panels)
constexpr int64_t kKC = 256;  // depth per packed panel (B micro-panel: 16 KB, L1-resident)

// ---- micro-kernels: acc[kMR][kNR] (+)= a_panel[kc][kMR] x b_panel[kc][kNR] ------------------

void micro_kernel_generic(int64_t kc, const float* a, const float* b, float* acc, bool add) {
  float c[kMR][kNR] = {};
  for (int64_t p = 0; p < kc; ++p, a += kMR, b += kNR) {
    for (int64_t r = 0; r < kMR; ++r) {
      for (int64_t j = 0; j < kNR; ++j) c[r][j] += a[r] * b[j];
    }
  }
  for (int64_t r = 0; r < kMR; ++r) {
    for (int64_t j = 0; j < kNR; ++j) acc[r * kNR + j] = (add ? acc[r * kNR + j] : 0.f) + c[r][j];
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void micro_kernel_avx2(int64_t kc, const float* a,
                                                            const float* b, float* acc, bool add) {
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
    float* out = acc + r * kNR;
    __m256 lo = rows[r][0], hi = rows[r][1];
    if (add) {
      lo = _mm256_add_ps(lo, _mm256_load_ps(out));
      hi = _mm256_add_ps(hi, _mm256_load_ps(out + 8));
    }
    _mm256_store_ps(out, lo);
    _mm256_store_ps(out + 8, hi);
  }
}
#endif

using MicroKernel = void (*)(int64_t, const float*, const float*, float*, bool);

MicroKernel pick_micro_kernel() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return micro_kernel_avx2;
#endif
  return micro_kernel_generic;
}

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

// A full kNR-column panel of B = Wᵀ (W row-major, B(k, n) = W[n * ld + k]) for kc a multiple of
// 8: 8x8 register transposes instead of kNR strided scalar streams.
template <typename T>
__attribute__((target("avx2,fma"))) void pack_b_panel_transposed_avx2(const T* w, int64_t ld,
                                                                     int64_t kc, float* dst) {
  for (int64_t j0 = 0; j0 < kNR; j0 += 8) {
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
      for (int i = 0; i < 8; ++i) _mm256_store_ps(dst + (p0 + i) * kNR + j0, out[i]);
    }
  }
}

bool cpu_has_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}
#endif

// B[k0 : k0+kc, n0 : n0+nc] -> panels of kNR columns: dst[panel][p][j].
template <typename T>
void pack_b(const GemmOperand& B, int64_t k0, int64_t kc, int64_t n0, int64_t nc, float* dst) {
  const T* src = static_cast<const T*>(B.data);
  for (int64_t j0 = 0; j0 < nc; j0 += kNR, dst += kNR * kc) {
    const int64_t cols = std::min(kNR, nc - j0);
    if (B.col_stride == 1) {  // rows of B are contiguous: copy kNR-wide strips
      for (int64_t p = 0; p < kc; ++p) {
        const T* row = src + (k0 + p) * B.row_stride + (n0 + j0);
        float* d = dst + p * kNR;
        for (int64_t j = 0; j < cols; ++j) d[j] = load_f32(row, j);
        for (int64_t j = cols; j < kNR; ++j) d[j] = 0.f;
      }
    } else {  // columns of B are contiguous (B = Wᵀ): read each column along k
#if defined(__x86_64__)
      if (B.row_stride == 1 && cols == kNR && kc % 8 == 0 && cpu_has_avx2()) {
        pack_b_panel_transposed_avx2(src + k0 + (n0 + j0) * B.col_stride, B.col_stride, kc, dst);
        continue;
      }
#endif
      for (int64_t j = 0; j < kNR; ++j) {
        if (j >= cols) {
          for (int64_t p = 0; p < kc; ++p) dst[p * kNR + j] = 0.f;
          continue;
        }
        const T* col = src + k0 * B.row_stride + (n0 + j0 + j) * B.col_stride;
        for (int64_t p = 0; p < kc; ++p) dst[p * kNR + j] = load_f32(col, p * B.row_stride);
      }
    }
  }
}

using PackFn = void (*)(const GemmOperand&, int64_t, int64_t, int64_t, int64_t, float*);

PackFn pack_a_for(c10::ScalarType t) {
  return t == c10::ScalarType::BFloat16 ? pack_a<c10::BFloat16> : pack_a<float>;
}
PackFn pack_b_for(c10::ScalarType t) {
  return t == c10::ScalarType::BFloat16 ? pack_b<c10::BFloat16> : pack_b<float>;
}

// Writes (or adds) the float32 tile acc [mc, nc] (row stride kNC) into C.
void store_tile(const GemmProblem& P, int64_t m0, int64_t mc, int64_t n0, int64_t nc,
                const float* acc) {
  for (int64_t i = 0; i < mc; ++i) {
    const float* a = acc + i * kNC;
    const int64_t off = (m0 + i) * P.ldc + n0;
    if (P.c_dtype == c10::ScalarType::BFloat16) {
      auto* c = static_cast<c10::BFloat16*>(P.C) + off;
      for (int64_t j = 0; j < nc; ++j) c[j] = c10::BFloat16(a[j]);
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

struct AlignedDelete {
  void operator()(float* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
using AlignedFloats = std::unique_ptr<float[], AlignedDelete>;

AlignedFloats aligned_floats(size_t n) {
  return AlignedFloats(static_cast<float*>(::operator new[](n * sizeof(float), std::align_val_t(64))));
}

struct Workspace {
  AlignedFloats a = aligned_floats(kMC * kKC), b = aligned_floats(kKC * kNC),
                acc = aligned_floats(kMC * kNC);
};

// One (row tile, column tile) of one problem: loop over depth panels, micro-kernels into acc.
void run_unit(const GemmProblem& P, const Unit& u, Workspace& ws, MicroKernel kernel) {
  const int64_t mc = std::min(kMC, P.M - u.m0), nc = std::min(kNC, P.N - u.n0);
  const PackFn pa = pack_a_for(P.A.dtype), pb = pack_b_for(P.B.dtype);
  float tile[kMR * kNR] __attribute__((aligned(64)));
  for (int64_t k0 = 0; k0 < P.K; k0 += kKC) {
    const int64_t kc = std::min(kKC, P.K - k0);
    pa(P.A, u.m0, mc, k0, kc, ws.a.get());
    pb(P.B, k0, kc, u.n0, nc, ws.b.get());
    for (int64_t j0 = 0; j0 < nc; j0 += kNR) {
      const float* bp = ws.b.get() + (j0 / kNR) * kNR * kc;
      const int64_t cols = std::min(kNR, nc - j0);
      for (int64_t i0 = 0; i0 < mc; i0 += kMR) {
        const float* ap = ws.a.get() + (i0 / kMR) * kMR * kc;
        const int64_t rows = std::min(kMR, mc - i0);
        float* out = ws.acc.get() + i0 * kNC + j0;
        const bool add = k0 > 0;
        if (add) {
          for (int64_t r = 0; r < kMR; ++r) {
            for (int64_t j = 0; j < kNR; ++j) {
              tile[r * kNR + j] = (r < rows && j < cols) ? out[r * kNC + j] : 0.f;
            }
          }
        }
        kernel(kc, ap, bp, tile, add);
        for (int64_t r = 0; r < rows; ++r) std::memcpy(out + r * kNC, tile + r * kNR, cols * 4);
      }
    }
  }
  if (P.K == 0) {
    for (int64_t i = 0; i < mc; ++i) std::fill_n(ws.acc.get() + i * kNC, nc, 0.f);
  }
  store_tile(P, u.m0, mc, u.n0, nc, ws.acc.get());
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

}  // namespace

void gemm_batch(const std::vector<GemmProblem>& problems) {
  static const MicroKernel kernel = pick_micro_kernel();
  std::vector<Unit> units;
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
    for (int64_t m0 = 0; m0 < P.M; m0 += kMC) {
      for (int64_t n0 = 0; n0 < P.N; n0 += kNC) units.push_back({p, m0, n0});
    }
  }
  if (units.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    thread_local Workspace ws;
    for (int64_t u = begin; u < end; ++u) run_unit(problems[units[u].problem], units[u], ws, kernel);
  });
}

}  // namespace automoe::ops::cpu
