// 8-bit AdamW (vec.h adamw8): the block-wise dynamic map, the quantizers (a table, and AVX2 /
// AVX-512 from the map's structure), AVX-512 dequantization, and the step over 8-bit moments.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <vector>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/cpu/vec_adamw_step.h"
#include "automoe/ops/cpu/vec_levels.h"

namespace automoe::ops::cpu::vec {
namespace {

struct QMap8 {
  float value[256];
  float mid[256];  // between value[j] and value[j + 1]; mid[255] = +inf
  // By a float's sign, exponent (clamped to [2^-24, 2^0]: every smaller magnitude has the code of
  // 0, every larger one that of 2^0's slot) and 7 upper mantissa bits, a slot of floats: the code
  // of its lowest float, and where the slot holds a midpoint (never more than one: checked when
  // the table is built, and against a search of the midpoints by a test), that midpoint's key.
  // A float's key, its lower 16 bits (inverted for negatives), grows with it inside its slot, so
  // its code is code[slot] plus one where its key is above the slot's threshold (0xFFFF: none) —
  // one table load per value and no dependent second one. 19 KB.
  static constexpr uint32_t kExpLo = 127 - 24, kExps = 25, kSlots = 2 * kExps * 128;
  uint8_t code[kSlots];
  uint16_t threshold[kSlots];
  // (branch-free: the exponent clamped by min / max; a clamped tiny value keeps its mantissa
  // bits, and every slot of the lowest exponent has the code of 0 and no threshold)
  static uint32_t slot(uint32_t bits) {
    const uint32_t e = std::min(std::max((bits >> 23) & 0xFFu, kExpLo), 127u) - kExpLo;
    return ((bits >> 31) * kExps + e) * 128 + ((bits >> 16) & 0x7Fu);
  }
  static uint32_t key(uint32_t bits) { return (bits & 0xFFFFu) ^ (0u - (bits >> 31) & 0xFFFFu); }
  // The map's structure, for the vector path: |x| lies in decade i = the number of bound[1..6]
  // below it (bound[i]: the midpoint below the decade's first value; bound[0], below the first
  // nonzero value: at or under it, the zero code); inside it the nearest value is bin
  // k = floor(|x| F[i] - G[i]) clamped to [0, kmax[i]] (the midpoints between neighbours of a
  // decade are its bins' edges), code zero_code +- (base[i] + k); above `top`, 255.
  float bound[8] = {}, F[8] = {}, G[8] = {}, kmax[8] = {};
  int32_t base[8] = {};
  float top = 0.f;
  int32_t zero_code = 0;
};

// How many midpoints lie below x: the nearest value's index (ties to the lower; NaN: 0).
AUTOMOE_BODY uint8_t nearest8(const float* mid, float x) {
  int lo = 0;
  for (int step = 128; step > 0; step >>= 1) {
    if (lo + step <= 255 && mid[lo + step - 1] < x) lo += step;
  }
  return static_cast<uint8_t>(lo);
}

const QMap8* make_qmap8(bool is_signed) {
  // Decade i (1e-6 .. 1) holds 2^i values (signed: and their negatives) or 2^(i+1) (unsigned): the
  // middles of [0.1, 1] cut into that many equal bins, times the decade; then 0 and 1. 127 * 2 + 2
  // or 254 + 2 = 256 values.
  std::vector<double> v{0.0, 1.0};
  for (int i = 0; i < 7; ++i) {
    const int bins = is_signed ? 1 << i : 1 << (i + 1);
    const double decade = std::pow(10.0, i - 6);
    for (int k = 0; k < bins; ++k) {
      const double middle = 0.1 + 0.9 * (k + 0.5) / bins;
      v.push_back(decade * middle);
      if (is_signed) v.push_back(-decade * middle);
    }
  }
  std::sort(v.begin(), v.end());
  auto* qp = new QMap8();
  QMap8& q = *qp;
  for (int j = 0; j < 256; ++j) q.value[j] = static_cast<float>(v[j]);
  for (int j = 0; j < 255; ++j) {
    q.mid[j] = static_cast<float>((static_cast<double>(q.value[j]) + q.value[j + 1]) / 2);
  }
  q.mid[255] = std::numeric_limits<float>::infinity();
  q.zero_code = is_signed ? 127 : 0;
  for (int i = 0; i < 7; ++i) {
    const int bins = is_signed ? 1 << i : 1 << (i + 1);
    q.base[i] = is_signed ? bins : bins - 1;
    q.bound[i] = q.mid[q.zero_code + q.base[i] - 1];
    q.F[i] = static_cast<float>(bins / (0.9 * std::pow(10.0, i - 6)));
    q.G[i] = static_cast<float>(0.1 * bins / 0.9);
    q.kmax[i] = static_cast<float>(bins - 1);
  }
  q.top = q.mid[254];
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t e = QMap8::kExpLo; e < QMap8::kExpLo + QMap8::kExps; ++e) {
      for (uint32_t m = 0; m < 128; ++m) {
        const uint32_t bits = (sign << 31) | (e << 23) | (m << 16);
        const float first = bits_to_float(bits), last = bits_to_float(bits | 0xFFFFu);
        const float lowest = sign ? last : first, highest = sign ? first : last;
        const uint8_t c = nearest8(q.mid, lowest), h = nearest8(q.mid, highest);
        const bool edge = e == QMap8::kExpLo || e == QMap8::kExpLo + QMap8::kExps - 1;
        if (h > c + 1 || (edge && h != c)) {  // (the map is fixed: this cannot happen)
          std::fprintf(stderr, "automoe: the 8-bit map does not fit its code table\n");
          std::abort();
        }
        q.code[QMap8::slot(bits)] = c;
        q.threshold[QMap8::slot(bits)] =
            h == c ? 0xFFFFu : static_cast<uint16_t>(QMap8::key(float_to_bits(q.mid[c])));
      }
    }
  }
  return qp;
}

const QMap8& qmap8_table(bool is_signed) {
  static const QMap8* const s = make_qmap8(true);
  static const QMap8* const u = make_qmap8(false);
  return is_signed ? *s : *u;
}

// nearest8 through the table: one slot's code and threshold.
AUTOMOE_BODY uint8_t code8(const QMap8& q, float x) {
  if (x != x) return static_cast<uint8_t>(q.zero_code);  // NaN: the code of 0
  const uint32_t bits = float_to_bits(x), s = QMap8::slot(bits);
  return static_cast<uint8_t>(q.code[s] + (QMap8::key(bits) > q.threshold[s] ? 1 : 0));
}

#if defined(AUTOMOE_VEC_X86)
// 8 values at a time: the code of x * inv from the map's structure (QMap8::bound ..), no table
// loads; the nearest value as code8 finds it but where x lies within float rounding of a
// midpoint (there one code either side). How many were done.
__attribute__((target("avx2,fma"))) int64_t quant8_avx2(const float* x, float inv, const QMap8& q,
                                                        uint8_t* c, int64_t n) {
  const __m256 iv = _mm256_set1_ps(inv), zero = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 F = _mm256_loadu_ps(q.F), G = _mm256_loadu_ps(q.G), kmax = _mm256_loadu_ps(q.kmax);
  const __m256i base = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.base));
  __m256 bound[7];
  for (int j = 0; j < 7; ++j) bound[j] = _mm256_set1_ps(q.bound[j]);
  const __m256 top = _mm256_set1_ps(q.top);
  const __m256i zero_code = _mm256_set1_epi32(q.zero_code), top_code = _mm256_set1_epi32(255);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), iv);
    const __m256 a = _mm256_and_ps(v, abs_mask);
    __m256i decade = _mm256_setzero_si256();
    for (int j = 1; j < 7; ++j) {  // (a true compare is -1)
      decade =
          _mm256_sub_epi32(decade, _mm256_castps_si256(_mm256_cmp_ps(bound[j], a, _CMP_LT_OQ)));
    }
    __m256 t = _mm256_fmsub_ps(a, _mm256_permutevar8x32_ps(F, decade),
                               _mm256_permutevar8x32_ps(G, decade));
    // (max first: a NaN becomes 0)
    t = _mm256_min_ps(_mm256_max_ps(t, zero), _mm256_permutevar8x32_ps(kmax, decade));
    const __m256i off =
        _mm256_add_epi32(_mm256_permutevar8x32_epi32(base, decade), _mm256_cvttps_epi32(t));
    const __m256i neg = _mm256_srai_epi32(_mm256_castps_si256(v), 31);  // -1 where negative
    __m256i code = _mm256_add_epi32(zero_code, _mm256_sub_epi32(_mm256_xor_si256(off, neg), neg));
    code = _mm256_blendv_epi8(code, zero_code,  // (not above the first bound, or NaN)
                              _mm256_castps_si256(_mm256_cmp_ps(a, bound[0], _CMP_NGT_UQ)));
    code =
        _mm256_blendv_epi8(code, top_code, _mm256_castps_si256(_mm256_cmp_ps(v, top, _CMP_GT_OQ)));
    const __m128i w =
        _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(c + i), _mm_packus_epi16(w, w));
  }
  return i;
}

// quant8_avx2 with 16 lanes (the same operations lane for lane: the same codes).
AUTOMOE_TARGET_AVX512 int64_t quant8_avx512(const float* x, float inv, const QMap8& q, uint8_t* c,
                                            int64_t n) {
  const __m512 iv = _mm512_set1_ps(inv), zero = _mm512_setzero_ps();
  const __m512 F = _mm512_castps256_ps512(_mm256_loadu_ps(q.F));  // decades index lanes 0..6
  const __m512 G = _mm512_castps256_ps512(_mm256_loadu_ps(q.G));
  const __m512 kmax = _mm512_castps256_ps512(_mm256_loadu_ps(q.kmax));
  const __m512i base =
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q.base)));
  __m512 bound[7];
  for (int j = 0; j < 7; ++j) bound[j] = _mm512_set1_ps(q.bound[j]);
  const __m512 top = _mm512_set1_ps(q.top);
  const __m512i zero_code = _mm512_set1_epi32(q.zero_code), top_code = _mm512_set1_epi32(255);
  const __m512i one = _mm512_set1_epi32(1);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), iv);
    const __m512 a = _mm512_abs_ps(v);
    __m512i decade = _mm512_setzero_si512();
    for (int j = 1; j < 7; ++j) {
      decade =
          _mm512_mask_add_epi32(decade, _mm512_cmp_ps_mask(bound[j], a, _CMP_LT_OQ), decade, one);
    }
    __m512 t =
        _mm512_fmsub_ps(a, _mm512_permutexvar_ps(decade, F), _mm512_permutexvar_ps(decade, G));
    // (max first: a NaN becomes 0)
    t = _mm512_min_ps(_mm512_max_ps(t, zero), _mm512_permutexvar_ps(decade, kmax));
    const __m512i off =
        _mm512_add_epi32(_mm512_permutexvar_epi32(decade, base), _mm512_cvttps_epi32(t));
    const __m512i neg = _mm512_srai_epi32(_mm512_castps_si512(v), 31);  // -1 where negative
    __m512i code = _mm512_add_epi32(zero_code, _mm512_sub_epi32(_mm512_xor_si512(off, neg), neg));
    code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, bound[0], _CMP_NGT_UQ), code, zero_code);
    code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, top, _CMP_GT_OQ), code, top_code);
    // (clamped to [0, 255] as AVX2's signed-to-unsigned saturating packs do: a negative value
    // in the unsigned map gives code 0)
    code = _mm512_min_epi32(_mm512_max_epi32(code, _mm512_setzero_si512()), top_code);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + i), _mm512_cvtepi32_epi8(code));
  }
  return i;
}

// out[e] = table[c[e]] * s (one rounding, as the scalar loop), how many were done. AVX-512: the
// 256-entry table in 16 registers, 16 codes at a time by 8 two-register permutes (the codes'
// low 5 bits) and a 3-level blend on their upper bits. The compiler's own vectorisation of the
// table loads extracts every index to a scalar load; on a Zen 5 the permutes take ~20 % fewer
// cycles of the whole 8-bit update than that, a 16-lane gather about half as many fewer, and at
// AVX2 an 8-lane gather was no faster than the scalar loads (so AVX2 keeps them).
AUTOMOE_TARGET_AVX512 int64_t dequant8_avx512(const float* table, const uint8_t* c, float s,
                                              float* out, int64_t n) {
  __m512 t[16];
  for (int j = 0; j < 16; ++j) t[j] = _mm512_loadu_ps(table + 16 * j);
  const __m512 sv = _mm512_set1_ps(s);
  const __m512i b5 = _mm512_set1_epi32(32), b6 = _mm512_set1_epi32(64), b7 = _mm512_set1_epi32(128);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i idx =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i)));
    __m512 r[8];
    for (int j = 0; j < 8; ++j) r[j] = _mm512_permutex2var_ps(t[2 * j], idx, t[2 * j + 1]);
    const __mmask16 k5 = _mm512_test_epi32_mask(idx, b5), k6 = _mm512_test_epi32_mask(idx, b6),
                    k7 = _mm512_test_epi32_mask(idx, b7);
    for (int j = 0; j < 4; ++j) r[j] = _mm512_mask_blend_ps(k5, r[2 * j], r[2 * j + 1]);
    for (int j = 0; j < 2; ++j) r[j] = _mm512_mask_blend_ps(k6, r[2 * j], r[2 * j + 1]);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mask_blend_ps(k7, r[0], r[1]), sv));
  }
  return i;
}
int64_t dequant8_vec(const float* table, const uint8_t* c, float s, float* out, int64_t n) {
  return active_isa() >= Isa::kAvx512 ? dequant8_avx512(table, c, s, out, n) : 0;
}

// The widest vector quantizer the CPU has; how many of the n it did.
int64_t quant8_vec(const float* x, float inv, const QMap8& q, uint8_t* c, int64_t n) {
  if (active_isa() >= Isa::kAvx512) return quant8_avx512(x, inv, q, c, n);
  if (active_isa() >= Isa::kAvx2) return quant8_avx2(x, inv, q, c, n);
  return 0;
}
#endif

template <int P, int G>
AUTOMOE_BODY void adamw8_typed(const AdamwRow& r, int64_t row0, int64_t rows) {
  const QMap8& qm = qmap8_table(true);
  const QMap8& qv = qmap8_table(false);
  const int64_t cols = r.cols, nb = (cols + kQuantBlock - 1) / kQuantBlock;
  float mb[kQuantBlock], vb[kQuantBlock];
  for (int64_t row = row0; row < row0 + rows; ++row) {
    for (int64_t k = 0; k < nb; ++k) {
      const int64_t c0 = k * kQuantBlock, n = std::min(kQuantBlock, cols - c0);
      const int64_t b = row * cols + c0;
      int16_t* rem = P == 2 ? r.rem + b : nullptr;
      void* pw = static_cast<char*>(r.p) + b * (P == 0 ? 4 : 2);
      const auto* gf = static_cast<const float*>(r.g) + b;
      const auto* gh = static_cast<const uint16_t*>(r.g) + b;
      uint8_t* mc = static_cast<uint8_t*>(r.m) + b;
      uint8_t* vc = static_cast<uint8_t*>(r.v) + b;
      float& sm = r.m_scale[row * nb + k];
      float& sv = r.v_scale[row * nb + k];
      // Dequantize (AVX-512: permutes; else table loads), update (vectorisable: kLanes running
      // maxima, no reassociation), then quantize with the new absmax.
      int64_t d = 0;
#if defined(AUTOMOE_VEC_X86)
      d = dequant8_vec(qm.value, mc, sm, mb, n);
      dequant8_vec(qv.value, vc, sv, vb, n);
#endif
      for (int64_t e = d; e < n; ++e) {
        mb[e] = qm.value[mc[e]] * sm;
        vb[e] = qv.value[vc[e]] * sv;
      }
      float aml[kLanes] = {}, avl[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= n; i += kLanes) {
        for (int j = 0; j < kLanes; ++j) {
          float p = load_weight<P>(pw, rem, i + j);
          const float g = (G == 0 ? gf[i + j] : bf16_bits_to_float(gh[i + j])) * r.g_scale;
          adamw_math(r, g, p, mb[i + j], vb[i + j]);
          store_weight<P>(pw, rem, i + j, p);
          const float a = std::fabs(mb[i + j]);
          aml[j] = aml[j] < a ? a : aml[j];
          avl[j] = avl[j] < vb[i + j] ? vb[i + j] : avl[j];
        }
      }
      float am = 0.f, av = 0.f;
      for (; i < n; ++i) {
        float p = load_weight<P>(pw, rem, i);
        const float g = (G == 0 ? gf[i] : bf16_bits_to_float(gh[i])) * r.g_scale;
        adamw_math(r, g, p, mb[i], vb[i]);
        store_weight<P>(pw, rem, i, p);
        am = std::max(am, std::fabs(mb[i]));
        av = std::max(av, vb[i]);
      }
      for (int j = 0; j < kLanes; ++j) {
        am = std::max(am, aml[j]);
        av = std::max(av, avl[j]);
      }
      // A block whose largest magnitude is below the smallest normal float is flushed to zero
      // (its reciprocal would overflow: 0 * inf); NaN never reaches the maxima.
      if (!(am >= std::numeric_limits<float>::min())) am = 0.f;
      if (!(av >= std::numeric_limits<float>::min())) av = 0.f;
      const float im = am > 0.f ? 1.f / am : 0.f, iv = av > 0.f ? 1.f / av : 0.f;
      int64_t e = 0;
#if defined(AUTOMOE_VEC_X86)
      e = quant8_vec(mb, im, qm, mc, n);
      quant8_vec(vb, iv, qv, vc, n);
#endif
      for (; e < n; ++e) {
        mc[e] = code8(qm, mb[e] * im);
        vc[e] = code8(qv, vb[e] * iv);
      }
      sm = am;
      sv = av;
    }
  }
}

template <int P>
AUTOMOE_BODY void adamw8_by_grad(const AdamwRow& r, int64_t row0, int64_t rows) {
  if (r.g_dtype == c10::ScalarType::Float) {
    adamw8_typed<P, 0>(r, row0, rows);
  } else {
    adamw8_typed<P, 1>(r, row0, rows);
  }
}

AUTOMOE_BODY void adamw8_body(const AdamwRow& r, int64_t row0, int64_t rows) {
  if (r.p_dtype == c10::ScalarType::Float) {
    adamw8_by_grad<0>(r, row0, rows);
  } else if (r.rem == nullptr) {
    adamw8_by_grad<1>(r, row0, rows);
  } else {
    adamw8_by_grad<2>(r, row0, rows);
  }
}

}  // namespace

const float* qmap8(bool is_signed) { return qmap8_table(is_signed).value; }
const float* qmid8(bool is_signed) { return qmap8_table(is_signed).mid; }
uint8_t quantize8(float x, bool is_signed) { return code8(qmap8_table(is_signed), x); }

void quantize8_row(const float* x, float inv, bool is_signed, uint8_t* codes, int64_t n) {
  const QMap8& q = qmap8_table(is_signed);
  int64_t e = 0;
#if defined(AUTOMOE_VEC_X86)
  e = quant8_vec(x, inv, q, codes, n);
#endif
  for (; e < n; ++e) codes[e] = code8(q, x[e] * inv);
}

AUTOMOE_ROW_FN(void, adamw8, (const AdamwRow& r, int64_t row_begin, int64_t rows),
               (r, row_begin, rows))

}  // namespace automoe::ops::cpu::vec
