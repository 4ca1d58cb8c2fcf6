// Row primitives of the CPU kernels: float32 math on contiguous rows. Each is compiled three times
// (x86-64 with AVX-512, with AVX2+FMA, and the baseline) and picked at each call from the active
// instruction-set level (ops/cpu/isa.h), so the loops use what the CPU has without requiring it.
// exp is a Cephes-style polynomial (relative error ~2e-7), which keeps the loops free of library
// calls. bf16 rows are read and written in their own dtype by the one-pass primitives below (or
// widened into float buffers with load() and rounded back once with store()); rounding is to
// nearest even, as c10::BFloat16.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace automoe::ops::cpu::vec {

// The copy the row primitives run at the active level: "avx512", "avx2" or "baseline".
const char* path_name();

void load(const void* src, c10::ScalarType dtype, float* dst, int64_t n);
void store(const float* src, void* dst, c10::ScalarType dtype, int64_t n);

float sum_sq(const float* x, int64_t n);
// acc += a * x
void axpy(float* acc, float a, const float* x, int64_t n);
float dot(const float* a, const float* b, int64_t n);
// The same with x as raw bf16 (no widened copy of the row).
void axpy_bf16(float* acc, float a, const uint16_t* x, int64_t n);
float dot_bf16(const float* a, const uint16_t* b, int64_t n);
// y = a * x
void scale(const float* x, float a, float* y, int64_t n);
// y = exp(a - x), exp as the rows below (exact to ~2e-7; below -87 it gives ~1e-38, not less)
void exp_from(float a, const float* x, float* y, int64_t n);

// One pass over rows held in their own dtype (float32 or bf16), no float32 buffers: each element
// is read once, computed in float32 and, for bf16, rounded once to nearest even.
//
// SwiGLU of one row: y = silu(g) * u.
void swiglu_row(const void* g, const void* u, void* y, c10::ScalarType dtype, int64_t n);
// Its backward: dg = dy * u * s * (1 + g (1 - s)), du = dy * g * s, s = sigmoid(g).
void swiglu_row_bwd(const void* g, const void* u, const void* dy, void* dg, void* du,
                    c10::ScalarType dtype, int64_t n);
// RMSNorm of one row: returns k = 1 / sqrt(mean(x^2) + eps) and writes y = x * k * w.
float rmsnorm_row(const void* x, const float* w, float eps, void* y, c10::ScalarType dtype,
                  int64_t n);
// Its backward for a row with inverse RMS k: dw_acc += g * x * k, and
// dx = k * (g * w - x * k * m), m = k * sum(g * w * x) / n.
void rmsnorm_row_bwd(const void* g, const void* x, const float* w, float k, float* dw_acc, void* dx,
                     c10::ScalarType dtype, int64_t n);
// Mamba-2's rows (vec_mamba.cpp). acc += w * x elementwise (x float32 or bf16 by dtype): one tap
// of the depthwise conv over a row of channels.
void mul_add_row(float* acc, const float* w, const void* x, c10::ScalarType dtype, int64_t n);
// y = silu(a) (a when !silu), written in y's dtype.
void silu_store_row(const float* a, bool silu, void* y, c10::ScalarType dtype, int64_t n);
// g = dy * silu'(a) = dy * s * (1 + a (1 - s)), s = sigmoid(a) (g = dy when !silu); g float32.
void silu_grad_row(const float* a, bool silu, const void* dy, c10::ScalarType dtype, float* g,
                   int64_t n);
// One group of the gated RMSNorm: h = y * z * s (y and out in `dtype`; z and s = sigmoid(z) float32),
// returns k = 1 / sqrt(mean(h^2) + eps) and writes out = round(round(h * k) * w) in y's dtype.
float gated_norm_group(const void* y, const float* z, const float* s, const float* w, float eps,
                       void* out, c10::ScalarType dtype, int64_t n);
// Its backward for upstream g and the group's k: with nhat = h * k and dn = g * w,
// dh = k * (dn - nhat * mean(dn * nhat)); dy = dh * z * s, dz = dh * y * s * (1 + z (1 - s)),
// dw_acc += g * round(nhat); g, y and dy in `dtype`, dz float32.
void gated_norm_group_bwd(const void* g, const void* y, const float* z, const float* s,
                          const float* w, float k, float* dw_acc, void* dy, float* dz,
                          c10::ScalarType dtype, int64_t n);
// The SSD scan's within-chunk rows: ldec[i] = exp(al - acum[i]) (the decay from position i to the
// row's position, al its cumulative sum; not written when ldec is null), m[i] = cb[i] * ldec[i] *
// dt[i] written in `dtype` (float32, or bf16 rounded to nearest even).
void ssd_decay_row(float al, const float* acum, const float* cb, const float* dt, float* ldec,
                   void* m, c10::ScalarType dtype, int64_t n);
// Its backward for dm: t = dm * ldec; dcb += t * dt, ddt += t * cb, r = t * cb * dt, dacum -= r;
// returns the sum of r (the row position's own cumulative-sum gradient).
float ssd_decay_row_bwd(const float* dm, const float* ldec, const float* cb, const float* dt,
                        float* dcb, float* ddt, float* dacum, int64_t n);
// The SSD scan's per-unit blocks: q positions of a chunk x a B/C group's hg heads of p channels.
// Row l of a block is hg * p values at its row stride (x in `dtype`, the others float32 unless
// said); per-(head, position) scalars are [hg][q] arrays, per-head ones [hg].
// y[l, j, :] += e[j][l] * z[l, j, :] + d[j] * x[l, j, :]   (the read-out of the carried state and
// the D skip).
void ssd_out_block(float* y, int64_t ldy, const float* z, int64_t ldz, const void* x, int64_t ldx,
                   c10::ScalarType dtype, const float* e, const float* d, int64_t q, int64_t hg,
                   int64_t p);
// out[l, j, :] = x[l, j, :] * w[j][l], out contiguous [q, hg * p] in `dtype` (a GEMM operand).
void ssd_scale_block(const void* x, int64_t ldx, c10::ScalarType dtype, const float* w, void* out,
                     int64_t q, int64_t hg, int64_t p);
// The backward of ssd_out_block for upstream g [q rows at ldg]: dz = e * g and gh = g written in
// `dtype` (dz contiguous [q, hg * p], gh head-major [hg][q][p]: GEMM operands), dx = d * g
// (written: dx's first term),
// re[j][l] = e * dot(g, z) (written), dd[j] += dot(g, x) (in position order).
void ssd_out_block_bwd(const float* g, int64_t ldg, const float* z, int64_t ldz, const void* x,
                       int64_t ldx, c10::ScalarType dtype, const float* e, const float* d, float* dx,
                       int64_t lddx, void* dz, void* gh, float* re, float* dd, int64_t q, int64_t hg,
                       int64_t p);
// The backward of ssd_scale_block for the float32 gradient g of out [q, hg * p]: dx += w * g,
// u[j][l] = dot(g, x) (written).
void ssd_scale_block_bwd(const float* g, const void* x, int64_t ldx, c10::ScalarType dtype,
                         const float* w, float* dx, int64_t lddx, float* u, int64_t q, int64_t hg,
                         int64_t p);
// One step of the chunk-state recurrence over rows [rows, hg * p]: next[r, j, :] += f[j] *
// prev[r, j, :]; and its backward: cur[r, j, :] += f[j] * next[r, j, :], fd[j] += sum over r of
// dot(next[r, j, :], h[r, j, :]) (rows in order).
void ssd_state_step(float* next, const float* prev, const float* f, int64_t rows, int64_t hg,
                    int64_t p);
void ssd_state_step_bwd(float* cur, const float* next, const float* h, const float* f, float* fd,
                        int64_t rows, int64_t hg, int64_t p);
// Rotation of `heads` half-split rows (x and y [heads, 2h]): the pairs (x[i], x[i + h]) of each
// row by the angles (c[i], sign * s[i]).
void rotate_heads(const void* x, const float* c, const float* s, float sign, void* y,
                  c10::ScalarType dtype, int64_t heads, int64_t h);

// Router rows (float32). y = softmax(x) (max-subtracted, exp as above); a row that holds a NaN,
// whose maximum is not finite, or that spans more than 87 below its maximum (exp's clamp) is
// computed with std::exp instead, so NaN, infinities and -inf (masked) experts come out as ATen's
// softmax gives them.
void softmax(const float* x, float* y, int64_t n);
// y = 1 / (1 + exp(-x)); a row reaching below -87 with std::exp, as softmax.
void sigmoid_row(const float* x, float* y, int64_t n);
// The fused linear cross-entropy's rows (float32 or bf16 logits, float32 math): log(sum(exp(x)))
// of a row, NaN for a row holding a NaN and the exact value for infinite maxima; and the row's
// gradient in place, x[i] = (exp(x[i] - lse) - [i == label]) * scale (label outside [0, n): no
// one-hot term), written in the row's dtype (bf16 rounded to nearest even).
float logsumexp_row(const void* x, c10::ScalarType dtype, int64_t n);
void ce_grad_row(void* x, c10::ScalarType dtype, float lse, int64_t label, float scale, int64_t n);
// The k largest of x[0, n), largest first, equal values by lower index first, into idx (scratch:
// n floats). Returns false, with idx unspecified, when x holds a NaN or one of the k is -inf (the
// caller sorts such a row itself).
bool topk(const float* x, int64_t n, int64_t k, float* scratch, int64_t* idx);

// One AdamW step (decoupled weight decay; ATen's fused AdamW formula in float32 math) over
// elements [begin, begin + n) of one tensor. The weight is float32, or bf16 — with `rem` the lower
// 16 bits of its float32 master (split so that the bf16 part is the master rounded half away from
// zero: join(bf16, rem) is the master exactly), without it the master itself (rounded to nearest
// even after the update). Gradient and moments are float32 or bf16; the gradient is multiplied by
// g_scale (clipping) in float32 before use.
struct AdamwRow {
  void* p = nullptr;
  c10::ScalarType p_dtype = c10::ScalarType::Float;
  int16_t* rem = nullptr;
  const void* g = nullptr;
  c10::ScalarType g_dtype = c10::ScalarType::Float;
  void* m = nullptr;
  void* v = nullptr;
  c10::ScalarType s_dtype = c10::ScalarType::Float;
  float decay = 1.f;  // 1 - lr * weight_decay
  // (1 - beta1 and 1 - beta2 computed in double, then rounded, as ATen's fused AdamW does)
  float one_minus_beta1 = 0.1f, beta2 = 0.999f, one_minus_beta2 = 0.001f, eps = 1e-8f;
  float step_size = 0.f;  // lr / (1 - beta1^step)
  float bc2_sqrt = 1.f;   // sqrt(1 - beta2^step)
  float g_scale = 1.f;
  // Block-wise 8-bit moments (adamw8 only): m and v are uint8 codes into qmap8(true) / qmap8(false),
  // each block of up to kQuantBlock consecutive elements of a row of `cols` scaled by its own
  // float32 absmax (m_scale / v_scale: [rows, ceil(cols / kQuantBlock)]).
  float* m_scale = nullptr;
  float* v_scale = nullptr;
  int64_t cols = 0;
};
void adamw(const AdamwRow& r, int64_t begin, int64_t n);

// 8-bit moments (optimizer.state_dtype: 8bit), the block-wise dynamic quantization of Dettmers et
// al., "8-bit Optimizers via Block-wise Quantization" (2022), as bitsandbytes' and torchao's
// AdamW8bit keep their state: each block's values divided by the block's largest magnitude, then
// rounded to the nearest of 256 values of a dynamic map — decades 1e-6 .. 1, each split linearly,
// the larger decades finer (signed for the first moment, unsigned for the second).
constexpr int64_t kQuantBlock = 256;
// The map's 256 values, ascending (exact 0 and 1 among them), and the 255 midpoints between
// neighbours (each computed in double from the two values, then rounded).
const float* qmap8(bool is_signed);
const float* qmid8(bool is_signed);
// The code of x (already divided by its block's absmax): the nearest map value's index, ties to
// the lower; NaN to some code (never read out of range).
uint8_t quantize8(float x, bool is_signed);
// The codes of x[0, n) * inv as adamw8 makes them: on AVX2 8 at a time from the map's structure
// (within float rounding of a midpoint one code either side of quantize8's), else quantize8.
void quantize8_row(const float* x, float inv, bool is_signed, uint8_t* codes, int64_t n);
// One AdamW step as adamw() over rows [row_begin, row_begin + rows) of a tensor viewed as
// [rows, r.cols], the moments dequantized per block, updated in float32 and quantized again with
// the block's new absmax (the weight update uses the unrounded moments).
void adamw8(const AdamwRow& r, int64_t row_begin, int64_t rows);

}  // namespace automoe::ops::cpu::vec
