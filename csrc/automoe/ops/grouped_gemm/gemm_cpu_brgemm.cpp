// The CPU GEMM engine's brgemm path (gemm_cpu.h): A packed to bf16 rows, B to VNNI pairs, ATen's
// batch-reduce GEMM accumulating in float32; below AMX, problems of 17-128 rows run transposed.
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

#include "automoe/ops/cpu/isa.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/ops/grouped_gemm/gemm_cpu_units.h"

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _undefined_ placeholders.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace automoe::ops::cpu::gemm_engine {
namespace {

// ---- brgemm: ATen's batch-reduce GEMM (oneDNN's ukernel; AMX tiles where the CPU has them) ----

// Rows x columns per brgemm call (columns a multiple of 16, as AMX tiles need). Each call costs
// ATen a kernel lookup (a hash of the shape): on AMX, 128 x 256 calls (a unit's whole column tile)
// measured 1.10x on the SSD scan's 128-sized products and 1.09x on Nano's experts against 32 x 64
// (Xeon, same run; docs/ops.md). Below AMX (vdpbf16ps) 32 x 64 stays: the larger calls were not
// measured there.
struct BrBlock {
  int64_t m, n;
};
BrBlock br_block() { return active_isa() >= Isa::kAmx ? BrBlock{128, kNC} : BrBlock{32, 64}; }

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

}  // namespace

void run_unit_brgemm(const GemmProblem& P, const Unit& u, Workspace& ws) {
  const int64_t mu = std::min(kMU, P.M - u.m0), nc = std::min(kNC, P.N - u.n0);
  if (!ws.a16) {
    ws.a16 = aligned<c10::BFloat16>(kMU * kKC);
    ws.b16 = aligned<c10::BFloat16>(kKC * kNC);
  }
  // A float32 C whose tile is whole 16-column blocks is brgemm's own output (written, or added to
  // when accumulating): no staging tile and no copy out. Otherwise the float32 staging tile acc,
  // rounded or added into C by store_tile.
  const bool direct = P.c_dtype == c10::ScalarType::Float && nc % 16 == 0 && P.K > 0;
  float* acc = direct ? static_cast<float*>(P.C) + u.m0 * P.ldc + u.n0 : ws.acc.get();
  const int64_t ldacc = direct ? P.ldc : kNC;
  auto* a16 = reinterpret_cast<uint16_t*>(ws.a16.get());
  auto* b16 = reinterpret_cast<uint16_t*>(ws.b16.get());
  // bf16 rows of A with an even depth are brgemm's A where they lie (row stride lda): no copy.
  const BrBlock br = br_block();
  const bool a_in_place = P.A.dtype == c10::ScalarType::BFloat16 && P.A.col_stride == 1 && P.K % 2 == 0;
  for (int64_t k0 = 0; k0 < P.K; k0 += kKC) {
    const int64_t kc = std::min(kKC, P.K - k0), kcp = (kc + 1) / 2 * 2;
    const c10::BFloat16* a_rows = ws.a16.get();
    int64_t lda = kcp;
    if (a_in_place) {
      a_rows = static_cast<const c10::BFloat16*>(P.A.data) + u.m0 * P.A.row_stride + k0;
      lda = P.A.row_stride;
    } else if (ws.a16_problem != &P || ws.a16_m0 != u.m0 || ws.a16_k0 != k0) {
      pack_a_bf16_simd(P.A, u.m0, mu, k0, kc, kcp, a16);
      ws.a16_problem = &P, ws.a16_m0 = u.m0, ws.a16_k0 = k0;
    }
    // Column block j0 of B in VNNI pairs at b16 + j0 * kcp.
    for (int64_t j0 = 0; j0 < nc; j0 += br.n) {
      const int64_t nw = std::min(br.n, nc - j0), nwp = (nw + 15) / 16 * 16;
      pack_b_vnni_simd(P.B, k0, kc, u.n0 + j0, nw, nwp, b16 + j0 * kcp);
    }
    for (int64_t mb = 0; mb < mu; mb += br.m) {
      const int64_t m = std::min(br.m, mu - mb);
      for (int64_t j0 = 0; j0 < nc; j0 += br.n) {
        const int64_t nwp = (std::min(br.n, nc - j0) + 15) / 16 * 16;
        at::native::cpublas::brgemm(m, nwp, kcp, lda, nwp, ldacc,
                                    /*add_C=*/k0 > 0 || (direct && P.accumulate),
                                    a_rows + mb * lda, ws.b16.get() + j0 * kcp,
                                    acc + mb * ldacc + j0, /*is_vnni=*/true);
      }
    }
  }
  if (direct) return;
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

namespace {

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

}  // namespace

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

}  // namespace automoe::ops::cpu::gemm_engine
