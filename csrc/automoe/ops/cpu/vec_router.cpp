// The router's rows (vec.h softmax, sigmoid_row, topk; float32): AVX2 and AVX-512 kernels for rows
// of a multiple of 8 / 16, and the bodies compiled once per level for the others.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/cpu/vec_levels.h"

namespace automoe::ops::cpu::vec {
namespace {

#if defined(AUTOMOE_VEC_X86)
// The router's rows (float32, a multiple of 8 long): maximum, softmax, top-k.
//
// Maximum of x[0, n), n a multiple of 8, in four independent chains (max's latency would bound
// one chain).
__attribute__((target("avx2,fma"))) inline float max8(const float* x, int64_t n) {
  const __m256 lo = _mm256_set1_ps(-INFINITY);
  __m256 m0 = lo, m1 = lo, m2 = lo, m3 = lo;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
    m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
    m2 = _mm256_max_ps(m2, _mm256_loadu_ps(x + i + 16));
    m3 = _mm256_max_ps(m3, _mm256_loadu_ps(x + i + 24));
  }
  for (; i < n; i += 8) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
  return hmax8(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
}

// Whether x[0, n) (n a multiple of 8) holds a NaN; its minimum into *lo.
__attribute__((target("avx2,fma"))) inline bool has_nan8(const float* x, int64_t n, float* lo) {
  __m256 nan = _mm256_setzero_ps(), mn = _mm256_set1_ps(INFINITY);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mn = _mm256_min_ps(mn, v);
  }
  mn = _mm256_min_ps(mn, _mm256_permute2f128_ps(mn, mn, 1));
  mn = _mm256_min_ps(mn, _mm256_permute_ps(mn, 0x4E));
  mn = _mm256_min_ps(mn, _mm256_permute_ps(mn, 0xB1));
  *lo = _mm256_cvtss_f32(mn);
  return _mm256_movemask_ps(nan) != 0;
}

// Softmax of a row of a multiple of 8 (as softmax_rows_body); false, nothing written, when the row
// needs std::exp (see there).
__attribute__((target("avx2,fma"))) bool softmax_avx2(const float* x, float* y, int64_t n) {
  float lo;
  if (has_nan8(x, n, &lo)) return false;
  const float m = max8(x, n);
  if (!std::isfinite(m) || lo - m < kExpExact) return false;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv));
    _mm256_storeu_ps(y + i, e0);
    _mm256_storeu_ps(y + i + 8, e1);
    s0 = _mm256_add_ps(s0, e0);
    s1 = _mm256_add_ps(s1, e1);
  }
  for (; i < n; i += 8) {
    const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    _mm256_storeu_ps(y + i, e0);
    s0 = _mm256_add_ps(s0, e0);
  }
  __m256 sv = _mm256_add_ps(s0, s1);
  sv = _mm256_add_ps(sv, _mm256_permute2f128_ps(sv, sv, 1));
  sv = _mm256_add_ps(sv, _mm256_permute_ps(sv, 0x4E));
  sv = _mm256_add_ps(sv, _mm256_permute_ps(sv, 0xB1));
  const __m256 inv = _mm256_set1_ps(1.f / _mm256_cvtss_f32(sv));
  for (i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), inv));
  return true;
}

// Sigmoid of a row of a multiple of 8 (as sigmoid_row_body, NaN kept); false, nothing written,
// when the row reaches below exp's clamp (see there).
__attribute__((target("avx2,fma"))) bool sigmoid_avx2(const float* x, float* y, int64_t n) {
  __m256 mn = _mm256_set1_ps(INFINITY);
  for (int64_t i = 0; i < n; i += 8) {
    mn = _mm256_min_ps(_mm256_loadu_ps(x + i), mn);  // a NaN is skipped (the second operand)
  }
  mn = _mm256_min_ps(mn, _mm256_permute2f128_ps(mn, mn, 1));
  mn = _mm256_min_ps(mn, _mm256_permute_ps(mn, 0x4E));
  mn = _mm256_min_ps(mn, _mm256_permute_ps(mn, 0xB1));
  if (_mm256_cvtss_f32(mn) < kExpExact) return false;
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(y + i, _mm256_blendv_ps(sigmoid8(v), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  return true;
}

// The positions of the set bits of each 8-bit mask, in order (padded with 0): a compaction
// table for AVX2, which has no compress instruction.
struct CompressTable {
  uint8_t pos[256][8];
  constexpr CompressTable() : pos() {
    for (int m = 0; m < 256; ++m) {
      int c = 0;
      for (int b = 0; b < 8; ++b) {
        if (m & (1 << b)) pos[m][c++] = static_cast<uint8_t>(b);
      }
    }
  }
};
constexpr CompressTable kCompress;

// For k <= 8 and rows up to 512: the smallest of the 8 lane-wise maxima is a lower bound of the
// k-th largest (those maxima are 8 distinct elements), so only the elements at or above it can be
// among the k. They are few; they are compacted (in index order) without branches, and each
// one's rank — how many candidates are larger, or equal with a lower index — computed with
// vector compares: the candidate of rank r is the r-th of the top k. Otherwise (or when more than
// 64 candidates pass, with many equal values): k rounds of (maximum, its first index).
__attribute__((target("avx2,fma"))) bool topk_avx2(const float* x, int64_t n, int64_t k, float* w,
                                                   int64_t* idx) {
  float lowest;
  if (has_nan8(x, n, &lowest)) return false;
  if (k <= 8 && n <= 512) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
      m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
    }
    if (i < n) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
    __m256 lo = _mm256_max_ps(m0, m1);  // lane maxima; their minimum in every lane:
    lo = _mm256_min_ps(lo, _mm256_permute2f128_ps(lo, lo, 1));
    lo = _mm256_min_ps(lo, _mm256_permute_ps(lo, 0x4E));
    lo = _mm256_min_ps(lo, _mm256_permute_ps(lo, 0xB1));
    alignas(32) int32_t ci[512];
    float* cv = w;  // candidates' values (scratch: n floats)
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t c = 0;  // c <= i, so each 8-wide store stays inside the n entries
    for (i = 0; i < n; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, lo, _CMP_GE_OQ));
      const __m256i perm = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(kCompress.pos[mask])));
      _mm256_storeu_ps(cv + c, _mm256_permutevar8x32_ps(v, perm));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(ci + c),
                          _mm256_add_epi32(_mm256_permutevar8x32_epi32(iota, perm),
                                           _mm256_set1_epi32(static_cast<int32_t>(i))));
      c += __builtin_popcount(static_cast<unsigned>(mask));
    }
    if (c <= 64) {
      const int64_t padded = (c + 7) / 8 * 8;  // <= n
      for (int64_t p = c; p < padded; ++p) {   // padding: never larger, never an earlier index
        cv[p] = -INFINITY;
        ci[p] = INT32_MAX;
      }
      float rv[64];
      int32_t ri[64];
      for (int64_t a = 0; a < c; ++a) {
        const __m256 va = _mm256_set1_ps(cv[a]);
        const __m256i ia = _mm256_set1_epi32(ci[a]);
        int rank = 0;
        for (int64_t b = 0; b < padded; b += 8) {
          const __m256 vb = _mm256_loadu_ps(cv + b);
          const __m256i ib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ci + b));
          const __m256 before =
              _mm256_or_ps(_mm256_cmp_ps(vb, va, _CMP_GT_OQ),
                           _mm256_and_ps(_mm256_cmp_ps(vb, va, _CMP_EQ_OQ),
                                         _mm256_castsi256_ps(_mm256_cmpgt_epi32(ia, ib))));
          rank += __builtin_popcount(static_cast<unsigned>(_mm256_movemask_ps(before)));
        }
        rv[rank] = cv[a];  // ranks are distinct: 0 .. c-1
        ri[rank] = ci[a];
      }
      for (int64_t r = 0; r < k; ++r) {
        if (rv[r] == -INFINITY) return false;
        idx[r] = ri[r];
      }
      return true;
    }
  }
  std::memcpy(w, x, n * sizeof(float));
  for (int64_t r = 0; r < k; ++r) {
    const float m = max8(w, n);
    if (m == -INFINITY) return false;
    const __m256 mv = _mm256_set1_ps(m);
    int64_t at = 0;
    for (;; at += 8) {  // the maximum is in w: the scan stops at its first occurrence
      const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(w + at), mv, _CMP_EQ_OQ));
      if (mask) {
        at += __builtin_ctz(static_cast<unsigned>(mask));
        break;
      }
    }
    idx[r] = at;
    w[at] = -INFINITY;
  }
  return true;
}

// The router's rows at AVX-512 (float32, a multiple of 16 long): 16 lanes halve the passes of the
// AVX2 versions, and the top-k's candidate bound is tighter (see topk_avx512).
AUTOMOE_TARGET_AVX512 bool softmax_avx512(const float* x, float* y, int64_t n) {
  const __m512 inf = _mm512_set1_ps(INFINITY);
  __m512 mx = _mm512_set1_ps(-INFINITY), mn = inf;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {  // NaN, minimum and maximum in one pass
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
    mn = _mm512_min_ps(mn, v);
  }
  if (nan) return false;
  const float m = _mm512_reduce_max_ps(mx), lo = _mm512_reduce_min_ps(mn);
  if (!std::isfinite(m) || lo - m < kExpExact) return false;
  const __m512 mv = _mm512_set1_ps(m);
  __m512 s0 = _mm512_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    const __m512 e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i + 16), mv));
    _mm512_storeu_ps(y + i, e0);
    _mm512_storeu_ps(y + i + 16, e1);
    s0 = _mm512_add_ps(s0, e0);
    s1 = _mm512_add_ps(s1, e1);
  }
  for (; i < n; i += 16) {
    const __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    _mm512_storeu_ps(y + i, e0);
    s0 = _mm512_add_ps(s0, e0);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)));
  for (i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(y + i), inv));
  return true;
}

AUTOMOE_TARGET_AVX512 bool sigmoid_avx512(const float* x, float* y, int64_t n) {
  __m512 mn = _mm512_set1_ps(INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    mn = _mm512_min_ps(_mm512_loadu_ps(x + i), mn);  // a NaN is skipped (the second operand)
  }
  if (_mm512_reduce_min_ps(mn) < kExpExact) return false;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    _mm512_storeu_ps(y + i,
                     _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), sigmoid16(v), v));
  }
  return true;
}

// For k <= 16 and rows up to 1024 (a multiple of 16): the 16 lane-wise maxima are 16 distinct
// elements, so the k-th largest of them bounds the k-th largest of the row from below; only the
// elements at or above it can be among the k (about 10 of 128 random scores for k = 8, against
// 20 with AVX2's bound, the least of 8 lane maxima). They are compacted in index order
// (vcompressps), and each one's rank — how many candidates are larger, or equal with a lower
// index — counted with mask compares: the candidate of rank r is the r-th of the top k. More
// than 64 candidates (many equal values): false with *handled = false, for the AVX2 version.
AUTOMOE_TARGET_AVX512 bool topk_avx512(const float* x, int64_t n, int64_t k, float* w, int64_t* idx,
                                       bool* handled) {
  *handled = true;
  __m512 lm = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    lm = _mm512_max_ps(lm, v);
  }
  if (nan) return false;
  // Rank of each lane maximum among the 16 (how many are strictly larger); the k-th largest
  // value is the least of those ranked below k.
  __m512i rank = _mm512_setzero_si512();
  const __m512i one = _mm512_set1_epi32(1);
  for (int j = 0; j < 16; ++j) {
    const __m512 bj = _mm512_permutexvar_ps(_mm512_set1_epi32(j), lm);
    rank = _mm512_mask_add_epi32(rank, _mm512_cmp_ps_mask(bj, lm, _CMP_GT_OQ), rank, one);
  }
  const __mmask16 top = _mm512_cmplt_epi32_mask(rank, _mm512_set1_epi32(static_cast<int>(k)));
  const __m512 lo = _mm512_set1_ps(_mm512_mask_reduce_min_ps(top, lm));
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Up to 16 candidates (all but ~0.3 % of random rows of 128) stay in two registers: each chunk's
  // are compressed and moved to lanes [nc, nc + p); the ranks are then counted lane against lane,
  // so nothing goes through memory (stores read back at once stall the store-to-load forwarding).
  __m512 cand = _mm512_set1_ps(-INFINITY);
  __m512i cand_i = _mm512_set1_epi32(INT32_MAX);
  int nc = 0;
  bool fits = true;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 mask = _mm512_cmp_ps_mask(v, lo, _CMP_GE_OQ);
    const int p = __builtin_popcount(static_cast<unsigned>(mask));
    if (p == 0) continue;
    if (nc + p > 16) {
      fits = false;
      break;
    }
    const __m512i to = _mm512_sub_epi32(iota, _mm512_set1_epi32(nc));  // lane nc + j <- j
    const __mmask16 dst = static_cast<__mmask16>(((1u << p) - 1u) << nc);
    cand = _mm512_mask_permutexvar_ps(cand, dst, to, _mm512_maskz_compress_ps(mask, v));
    cand_i = _mm512_mask_permutexvar_epi32(
        cand_i, dst, to,
        _mm512_maskz_compress_epi32(
            mask, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i)))));
    nc += p;
  }
  if (fits) {
    __m512i pos = _mm512_setzero_si512();
    for (int j = 0; j < nc; ++j) {
      const __m512i at = _mm512_set1_epi32(j);
      const __m512 vj = _mm512_permutexvar_ps(at, cand);
      const __m512i ij = _mm512_permutexvar_epi32(at, cand_i);
      const __mmask16 before =
          _mm512_cmp_ps_mask(vj, cand, _CMP_GT_OQ) |
          (_mm512_cmp_ps_mask(vj, cand, _CMP_EQ_OQ) & _mm512_cmplt_epi32_mask(ij, cand_i));
      pos = _mm512_mask_add_epi32(pos, before, pos, one);
    }
    // The padding lanes rank after every candidate (nc >= k of them are at or above the bound).
    alignas(64) float vals[16];
    alignas(64) int32_t ids[16];
    _mm512_store_ps(vals, cand);
    _mm512_store_si512(ids, cand_i);
    for (int64_t r = 0; r < k; ++r) {
      const unsigned m = _mm512_cmpeq_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(r)));
      const int lane = __builtin_ctz(m);  // ranks are distinct: 0 .. nc-1
      if (vals[lane] == -INFINITY) return false;
      idx[r] = ids[lane];
    }
    return true;
  }
  alignas(64) int32_t ci[1024];
  float* cv = w;  // candidates' values (scratch: n floats)
  int64_t c = 0;  // c <= i, so each 16-wide store stays inside the n entries
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 mask = _mm512_cmp_ps_mask(v, lo, _CMP_GE_OQ);
    _mm512_storeu_ps(cv + c, _mm512_maskz_compress_ps(mask, v));
    _mm512_storeu_si512(
        ci + c, _mm512_maskz_compress_epi32(
                    mask, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i)))));
    c += __builtin_popcount(static_cast<unsigned>(mask));
  }
  if (c > 64) {
    *handled = false;
    return false;
  }
  const int64_t padded = (c + 15) / 16 * 16;  // <= n
  for (int64_t p = c; p < padded; ++p) {      // padding: never larger, never an earlier index
    cv[p] = -INFINITY;
    ci[p] = INT32_MAX;
  }
  float rv[64];
  int32_t ri[64];
  for (int64_t a = 0; a < c; ++a) {
    const __m512 va = _mm512_set1_ps(cv[a]);
    const __m512i ia = _mm512_set1_epi32(ci[a]);
    int r = 0;
    for (int64_t b = 0; b < padded; b += 16) {
      const __m512 vb = _mm512_loadu_ps(cv + b);
      const __m512i ib = _mm512_loadu_si512(ci + b);
      const __mmask16 before =
          _mm512_cmp_ps_mask(vb, va, _CMP_GT_OQ) |
          (_mm512_cmp_ps_mask(vb, va, _CMP_EQ_OQ) & _mm512_cmpgt_epi32_mask(ia, ib));
      r += __builtin_popcount(static_cast<unsigned>(before));
    }
    rv[r] = cv[a];  // ranks are distinct: 0 .. c-1
    ri[r] = ci[a];
  }
  for (int64_t r = 0; r < k; ++r) {
    if (rv[r] == -INFINITY) return false;
    idx[r] = ri[r];
  }
  return true;
}

#endif

// Largest of the lanes-wise maxima; `bad` collects NaNs.
AUTOMOE_BODY float max_of(const float* x, int64_t n, bool* bad) {
  float mx[kLanes];
  int nan[kLanes] = {};
  for (int j = 0; j < kLanes; ++j) mx[j] = -INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = x[i + j];
      mx[j] = v > mx[j] ? v : mx[j];
      nan[j] |= v != v;
    }
  }
  float m = -INFINITY;
  int any = 0;
  for (; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    any |= x[i] != x[i];
  }
  for (int j = 0; j < kLanes; ++j) {
    m = mx[j] > m ? mx[j] : m;
    any |= nan[j];
  }
  *bad = any != 0;
  return m;
}

AUTOMOE_BODY float min_of(const float* x, int64_t n) {
  float mn[kLanes];
  for (int j = 0; j < kLanes; ++j) mn[j] = INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) mn[j] = x[i + j] < mn[j] ? x[i + j] : mn[j];
  }
  float m = INFINITY;
  for (; i < n; ++i) m = x[i] < m ? x[i] : m;
  for (int j = 0; j < kLanes; ++j) m = mn[j] < m ? mn[j] : m;
  return m;
}

// exp_approx clamps below -87.3 (exp(-inf) would come out ~1e-38, not 0, and every score further
// down would tie), so a row reaching below kExpExact is computed with std::exp: NaN, infinities
// and masked (-inf) experts come out as ATen's softmax / sigmoid give them.
AUTOMOE_BODY void softmax_rows_body(const float* x, float* y, int64_t n) {
  bool bad = false;
  const float m = max_of(x, n, &bad);
  if (bad || !std::isfinite(m) || min_of(x, n) - m < kExpExact) {
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (y[i] = std::exp(x[i] - m));
    for (int64_t i = 0; i < n; ++i) y[i] *= 1.f / sum;
    return;
  }
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += (y[i + j] = exp_approx(x[i + j] - m));
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += (y[i] = exp_approx(x[i] - m));
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  const float inv = 1.f / sum;
  for (i = 0; i < n; ++i) y[i] *= inv;
}

AUTOMOE_BODY void sigmoid_rows_body(const float* x, float* y, int64_t n) {
  if (min_of(x, n) < kExpExact) {      // (a NaN alone does not need this: it stays NaN below)
    for (int64_t i = 0; i < n; ++i) {  // exp(x) / (1 + exp(x)) keeps x far below 0 apart
      const float e = std::exp(x[i] < 0.f ? x[i] : -x[i]);
      y[i] = x[i] < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] != x[i] ? x[i] : sigmoid(x[i]);
}

// k rounds of (maximum, its first index, taken out): for the small k and n of routers this beats
// a sort, and the maximum is a vector reduction.
AUTOMOE_BODY bool topk_body(const float* x, int64_t n, int64_t k, float* w, int64_t* idx) {
  std::memcpy(w, x, n * sizeof(float));
  for (int64_t r = 0; r < k; ++r) {
    bool bad = false;
    const float m = max_of(w, n, &bad);
    if (bad || m == -INFINITY) return false;
    int64_t at = 0;
    while (w[at] != m) ++at;
    idx[r] = at;
    w[at] = -INFINITY;
  }
  return true;
}

}  // namespace

namespace {
AUTOMOE_ROW_FN(void, softmax_rows, (const float* x, float* y, int64_t n), (x, y, n))
AUTOMOE_ROW_FN(void, sigmoid_rows, (const float* x, float* y, int64_t n), (x, y, n))
}  // namespace

// Router rows of a multiple of 16 take the AVX-512 kernels at AVX-512, of a multiple of 8 the AVX2
// ones at AVX2; others (and rows the fast exp cannot take) the bodies.
void softmax(const float* x, float* y, int64_t n) {
#if defined(AUTOMOE_VEC_X86)
  if (n % 16 == 0 && active_isa() >= Isa::kAvx512) {
    if (softmax_avx512(x, y, n)) return;
  } else if (n % 8 == 0 && active_isa() >= Isa::kAvx2 && softmax_avx2(x, y, n)) {
    return;
  }
#endif
  softmax_rows(x, y, n);
}

void sigmoid_row(const float* x, float* y, int64_t n) {
#if defined(AUTOMOE_VEC_X86)
  if (n % 16 == 0 && active_isa() >= Isa::kAvx512) {
    if (sigmoid_avx512(x, y, n)) return;
  } else if (n % 8 == 0 && active_isa() >= Isa::kAvx2 && sigmoid_avx2(x, y, n)) {
    return;
  }
#endif
  sigmoid_rows(x, y, n);
}

bool topk(const float* x, int64_t n, int64_t k, float* scratch, int64_t* idx) {
#if defined(AUTOMOE_VEC_X86)
  if (n % 16 == 0 && k <= 16 && n <= 1024 && active_isa() >= Isa::kAvx512) {
    bool handled;
    const bool ok = topk_avx512(x, n, k, scratch, idx, &handled);
    if (handled) return ok;
  }
  if (n % 8 == 0 && active_isa() >= Isa::kAvx2) return topk_avx2(x, n, k, scratch, idx);
#endif
  return topk_body(x, n, k, scratch, idx);
}

}  // namespace automoe::ops::cpu::vec
