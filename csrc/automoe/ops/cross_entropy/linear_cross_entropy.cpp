// Fused linear cross-entropy: the LM head and the loss in chunks, never the [N, V] logits.
//   forward:  token chunks; logits_c = x_c · Wᵀ (float32), lse_c = logsumexp, loss = lse - target;
//             saves x, W, labels and lse [N] (float32)
//   backward: vocabulary chunks; p = exp(x · W_vᵀ - lse) - onehot(label), scaled by the incoming
//             gradient on rows that carry loss; dW_v = pᵀ · x (complete, written once in W's
//             dtype), dx += p · W_v (float32 [N, H] accumulator: N·H is small next to V·H)
//   kept:     when all of [N, V] (float32) is at most kKeepChunks chunks (512 MiB by default),
//             the forward writes its chunks into one [N, V] tensor and the first backward takes
//             it, as one vocabulary chunk, instead of recomputing the logits: one GEMM of four
//             saved (the same GEMM on the same operands: the same values). A short sequence on a
//             large vocabulary (Qwen3's 151,936 at 1 x 512: 311 MB, the LM head 73 % of the
//             FLOPs) gains most; a batch past the budget walks its chunks as before.
//   rows:     only the rows with a label enter (linear_cross_entropy selects them; the others'
//             gradient is zero): masked prompts and padding cost no LM-head FLOPs.
// The chunk GEMMs run on our CPU gemm engine or at::mm, whichever is faster on the CPU (below).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "automoe/ops/common.h"
#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/cross_entropy/cross_entropy.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/ops/ops.h"

namespace automoe::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kDefaultChunkBytes = int64_t{64} << 20;
// The forward's logits are kept for the backward when they are at most this many chunks.
constexpr int64_t kKeepChunks = 8;

cpu::GemmOperand operand(const at::Tensor& t, int64_t row_stride, int64_t col_stride) {
  return {t.const_data_ptr(), t.scalar_type(), row_stride, col_stride};
}

// On CPU, chosen by what the CPU has (ops/cpu/isa.h): bf16 on at::mm where ATen's bf16 GEMM is
// native (oneDNN with AVX-512-BF16 or AMX: as fast as our engine's best path or faster), on our
// engine below that (without native bf16 ATen's bf16 GEMM crawls); float32 on whichever of ATen's
// BLAS and our engine measured faster here (gemm_cpu.h). float64 and CUDA: at::mm.
bool use_cpu_engine(const at::Tensor& t) { return t.is_cpu() && cpu::engine_preferred(t.scalar_type()); }

// c = a [M, K] · bᵀ where b [N, K], c float32 (float64 for float64) [M, N] with rows of any
// stride (the rows of a larger tensor). Off the CPU engine the GEMM runs in the inputs' dtype
// (cuBLAS bf16 tensor cores) and the result is widened, the same rounding as Transformers' bf16
// LM head followed by .float().
void mm_nt_into(const at::Tensor& a, const at::Tensor& b, at::Tensor& c) {
  if (!use_cpu_engine(a)) {
    if (c.scalar_type() == a.scalar_type() && c.is_contiguous()) {
      at::mm_out(c, a, b.t());  // the logits in the GEMM's own dtype (fused_rows below)
    } else {
      c.copy_(at::mm(a, b.t()));
    }
    return;
  }
  cpu::gemm_batch({{a.size(0), b.size(0), a.size(1), operand(a, a.size(1), 1),
                    operand(b, 1, b.size(1)), c.data_ptr(), c.scalar_type(), c.stride(0), false}});
}

at::Tensor mm_nt(const at::Tensor& a, const at::Tensor& b, c10::ScalarType out) {
  if (!use_cpu_engine(a)) return at::mm(a, b.t()).to(out);  // (no copy when out is a's dtype)
  at::Tensor c = at::empty({a.size(0), b.size(0)}, a.options().dtype(out));
  mm_nt_into(a, b, c);
  return c;
}

// c (+)= a · b, a [M, K], b [K, N], c float32 (or float64) [M, N].
void mm_nn_acc(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, bool accumulate) {
  if (!use_cpu_engine(b)) {  // a (float32 probabilities) rounded to b's dtype, as autograd would
    const at::Tensor prod = at::mm(a.to(b.scalar_type()), b);
    if (accumulate) {
      c.add_(prod);
    } else {
      c.copy_(prod);
    }
    return;
  }
  cpu::gemm_batch({{a.size(0), b.size(1), a.size(1), operand(a, a.size(1), 1),
                    operand(b, b.size(1), 1), c.data_ptr(), c.scalar_type(), c.size(1),
                    accumulate}});
}

// c = aᵀ · b, a [K, M], b [K, N], c [M, N] contiguous (a slice of the weight gradient): written
// in place, no temporary.
void mm_tn_into(const at::Tensor& a, const at::Tensor& b, at::Tensor c) {
  if (!use_cpu_engine(b)) {
    at::mm_out(c, a.t().to(b.scalar_type()), b);
    return;
  }
  cpu::gemm_batch({{a.size(1), b.size(1), a.size(0), operand(a, 1, a.size(1)),
                    operand(b, b.size(1), 1), c.data_ptr(), c.scalar_type(), c.size(1), false}});
}

// CPU float32/bf16: the softmax parts run as fused row kernels (vec::logsumexp_row, ce_grad_row:
// one pass each) on the logits in the dtype their GEMM wrote — bf16 where at::mm runs the LM
// head in bf16 (its output is what autograd's LM head gives), float32 on our engine — instead of
// ATen's logsumexp / sub / exp / scatter / mul passes over float32 logits and two bf16 copies of
// p for the backward's GEMMs. float64 and CUDA keep the ATen ops.
bool fused_rows(const at::Tensor& x) { return x.is_cpu() && x.scalar_type() != at::kDouble; }

c10::ScalarType logits_dtype(const at::Tensor& x, c10::ScalarType acc) {
  return fused_rows(x) && !use_cpu_engine(x) ? x.scalar_type() : acc;
}

// lse and the per-row loss (0 on ignored rows) of the logits rows [r0, r0 + n).
void lse_rows(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& valid,
              int64_t r0, at::Tensor& lse, at::Tensor& loss_rows) {
  const int64_t n = logits.size(0), V = logits.size(1);
  const auto dtype = logits.scalar_type();
  const char* base = static_cast<const char*>(logits.const_data_ptr());
  const int64_t row_bytes = logits.stride(0) * logits.element_size();
  const int64_t* lab = labels.const_data_ptr<int64_t>() + r0;
  const bool* ok = valid.const_data_ptr<bool>() + r0;
  float* l = lse.data_ptr<float>() + r0;
  float* out = loss_rows.data_ptr<float>() + r0;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const void* row = base + r * row_bytes;
      l[r] = cpu::vec::logsumexp_row(row, dtype, V);
      float target = 0.f;
      if (ok[r]) {
        const int64_t c = lab[r];
        target = dtype == at::kFloat
                     ? static_cast<const float*>(row)[c]
                     : static_cast<float>(static_cast<const c10::BFloat16*>(row)[c]);
      }
      out[r] = ok[r] ? l[r] - target : 0.f;
    }
  });
}

// p = (softmax - onehot) * scale in place, p [N, nv] the logits of vocabulary columns
// [v0, v0 + nv) in their own dtype (fused_rows).
void grad_rows(at::Tensor& p, const at::Tensor& labels, const at::Tensor& valid,
               const at::Tensor& lse, const at::Tensor& scale, int64_t v0) {
  const int64_t N = p.size(0), nv = p.size(1);
  const auto dtype = p.scalar_type();
  char* base = static_cast<char*>(p.data_ptr());
  const int64_t row_bytes = p.stride(0) * p.element_size();
  const int64_t* lab = labels.const_data_ptr<int64_t>();
  const bool* ok = valid.const_data_ptr<bool>();
  const float* l = lse.const_data_ptr<float>();
  const float* sc = scale.const_data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t c = ok[r] && lab[r] >= v0 && lab[r] < v0 + nv ? lab[r] - v0 : -1;
      cpu::vec::ce_grad_row(base + r * row_bytes, dtype, l[r], c, sc[r], nv);
    }
  });
}

// The logits of x's rows [r0, r0 + n) against all of w, into those rows of `all` [N, V]: the
// forward's token chunk when it keeps its logits, and the second backward's recomputation of
// them in the same chunks (so that it sums in the same order).
at::Tensor logits_chunk_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& all,
                             int64_t r0, int64_t n) {
  at::Tensor out = all.narrow(0, r0, n);
  mm_nt_into(x.narrow(0, r0, n), w, out);
  return out;
}

int64_t rows_per_chunk(int64_t cols, int64_t chunk_bytes) {
  return std::max<int64_t>(1, chunk_bytes / (std::max<int64_t>(cols, 1) * 4));
}

// Whether the forward keeps all [N, V] float32 logits for the backward.
bool keep_logits(int64_t N, int64_t V, int64_t chunk_bytes) {
  return N * V <= kKeepChunks * (chunk_bytes / 4);
}

struct LinearCrossEntropyFn : torch::autograd::Function<LinearCrossEntropyFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& w_in,
                               const at::Tensor& labels_in, int64_t ignore_index,
                               int64_t chunk_bytes, bool grad_follows) {
    const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), labels = labels_in.contiguous();
    const int64_t N = x.size(0);
    const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const at::Tensor valid = labels.ne(ignore_index);
    const at::Tensor safe_labels = labels.masked_fill(valid.logical_not(), 0);
    at::Tensor lse = at::empty({N}, x.options().dtype(acc));
    at::Tensor loss_rows = at::empty({N}, x.options().dtype(acc));
    const int64_t V = w.size(0), step = rows_per_chunk(V, chunk_bytes);
    const bool keep = grad_follows && keep_logits(N, V, chunk_bytes);
    const auto ldt = logits_dtype(x, acc);
    const at::Tensor kept = keep ? at::empty({N, V}, x.options().dtype(ldt)) : at::Tensor();
    for (int64_t r0 = 0; r0 < N; r0 += step) {
      const int64_t n = std::min(step, N - r0);
      const at::Tensor logits =
          keep ? logits_chunk_into(x, w, kept, r0, n) : mm_nt(x.narrow(0, r0, n), w, ldt);
      if (fused_rows(x)) {
        lse_rows(logits, safe_labels, valid, r0, lse, loss_rows);
        continue;
      }
      const at::Tensor l = at::logsumexp(logits, 1);
      lse.narrow(0, r0, n).copy_(l);
      const at::Tensor target = logits.gather(1, safe_labels.narrow(0, r0, n).unsqueeze(1)).squeeze(1);
      loss_rows.narrow(0, r0, n).copy_((l - target) * valid.narrow(0, r0, n).to(acc));
    }
    ctx->saved_data["logits"] = keep ? c10::IValue(kept) : c10::IValue();
    ctx->saved_data["kept"] = keep;
    ctx->save_for_backward({x, w, labels, lse});
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["chunk_bytes"] = chunk_bytes;
    at::Tensor count = valid.sum();
    ctx->mark_non_differentiable({count});
    return {loss_rows.sum(), count};  // float32 (float64 for float64 inputs)
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("linear_cross_entropy");
    const auto s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w = s[1], &labels = s[2], &lse = s[3];
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const int64_t chunk_bytes = ctx->saved_data["chunk_bytes"].toInt();
    const int64_t N = x.size(0), V = w.size(0), H = w.size(1);
    const auto acc = lse.scalar_type();
    // Per-row scale: the incoming gradient on rows that carry loss, 0 elsewhere.
    const at::Tensor valid = labels.ne(ignore_index);
    const at::Tensor scale = valid.to(acc) * grads[0].to(acc);
    at::Tensor dx_acc = at::zeros({N, H}, x.options().dtype(acc));
    const bool want_dw = ctx->needs_input_grad(1);
    at::Tensor dw = want_dw ? at::empty({V, H}, w.options()) : at::Tensor();
    // The forward's logits when kept, as one vocabulary chunk (taken: a second backward through
    // the same graph recomputes them, in one chunk too, so that it sums in the same order).
    at::Tensor kept;
    if (ctx->saved_data["logits"].isTensor()) {
      kept = ctx->saved_data["logits"].toTensor();
      ctx->saved_data["logits"] = c10::IValue();
    }
    const int64_t step = ctx->saved_data["kept"].toBool() ? V : rows_per_chunk(N, chunk_bytes);
    const auto ldt = logits_dtype(x, acc);
    const at::Tensor scale_c = scale.contiguous();
    for (int64_t v0 = 0; v0 < V; v0 += step) {
      const int64_t nv = std::min(step, V - v0);
      const at::Tensor w_v = w.narrow(0, v0, nv);
      at::Tensor p;  // [N, nv] logits
      if (kept.defined()) {
        p = std::move(kept);
      } else if (step == V) {  // kept and consumed: recomputed as the forward computed them
        p = at::empty({N, V}, x.options().dtype(ldt));
        const int64_t rows = rows_per_chunk(V, chunk_bytes);
        for (int64_t r0 = 0; r0 < N; r0 += rows) {
          logits_chunk_into(x, w, p, r0, std::min(rows, N - r0));
        }
      } else {
        p = mm_nt(x, w_v, ldt);
      }
      if (fused_rows(x)) {  // p = (softmax - onehot) * scale in place, in the logits' dtype
        grad_rows(p, labels, valid, lse, scale_c, v0);
      } else {
        p.sub_(lse.unsqueeze(1)).exp_();
        // -1 at each row's label when it falls in this vocabulary chunk (no host sync: rows
        // whose label is elsewhere add 0 at a clamped column).
        const at::Tensor in_chunk = valid & labels.ge(v0) & labels.lt(v0 + nv);
        const at::Tensor cols = (labels - v0).clamp(0, nv - 1).unsqueeze(1);
        p.scatter_add_(1, cols, in_chunk.to(acc).neg().unsqueeze(1));
        p.mul_(scale.unsqueeze(1));
      }
      if (want_dw) mm_tn_into(p, x, dw.narrow(0, v0, nv));
      mm_nn_acc(p, w_v, dx_acc, /*accumulate=*/true);
    }
    return {dx_acc.to(x.scalar_type()), dw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_lce(const at::Tensor& x, const at::Tensor& w, const at::Tensor& labels) {
  const char* op = "automoe.linear_cross_entropy";
  detail::check_float(op, "x", x);
  detail::check_float(op, "weight", w);
  detail::check_dim(op, "x", x, 2);
  detail::check_dim(op, "weight", w, 2);
  detail::check_same_dtype(op, "x", x, "weight", w);
  detail::check_same_device(op, {{"x", &x}, {"weight", &w}, {"labels", &labels}});
  AUTOMOE_CHECK(x.size(1) == w.size(1), op, ": x [N, H] and weight [V, H] disagree on H: ",
                x.sizes(), " vs ", w.sizes());
  AUTOMOE_CHECK(labels.scalar_type() == at::kLong && labels.dim() == 1 &&
                    labels.size(0) == x.size(0),
                op, ": labels must be int64 [", x.size(0), "], got ", labels.scalar_type(), " ",
                labels.sizes());
}

}  // namespace

LinearCrossEntropy linear_cross_entropy(const at::Tensor& x_NH, const at::Tensor& weight_VH,
                                        const at::Tensor& labels_N, int64_t ignore_index,
                                        int64_t chunk_bytes) {
  RECORD_FUNCTION("automoe::linear_cross_entropy", c10::ArrayRef<const c10::IValue>{});
  check_lce(x_NH, weight_VH, labels_N);
  // Only the rows that carry a label enter the LM head: a row with ignore_index adds nothing to
  // the loss and gets a zero gradient, so its logits are never formed (fine-tuning data masks its
  // prompts, padding and each packed document's first position: often half the rows or more).
  // index_select's backward scatters the gradient of the kept rows back, zeros elsewhere.
  const at::Tensor idx = at::nonzero(labels_N.ne(ignore_index)).squeeze(1);
  const int64_t n_valid = idx.size(0);
  at::Tensor x = x_NH, labels = labels_N;
  if (n_valid < labels_N.size(0)) {  // (none at all: zero rows, a zero loss and zero gradients)
    x = x_NH.index_select(0, idx);
    labels = labels_N.index_select(0, idx);
  }
  if (labels.is_cpu() && n_valid > 0) {  // (labels: all valid now)
    const int64_t lo = labels.min().item<int64_t>(), hi = labels.max().item<int64_t>();
    AUTOMOE_CHECK(lo >= 0 && hi < weight_VH.size(0), "automoe.linear_cross_entropy: labels must be in [0, ",
                  weight_VH.size(0), ") or ignore_index (", ignore_index, "), got [", lo, ", ", hi, "]");
  }
  const bool grad_follows =
      at::GradMode::is_enabled() && (x_NH.requires_grad() || weight_VH.requires_grad());
  const auto out =
      LinearCrossEntropyFn::apply(x, weight_VH, labels, ignore_index,
                                  chunk_bytes > 0 ? chunk_bytes : kDefaultChunkBytes, grad_follows);
  return {out[0], out[1]};
}

LinearCrossEntropy linear_cross_entropy_reference(const at::Tensor& x_NH,
                                                  const at::Tensor& weight_VH,
                                                  const at::Tensor& labels_N, int64_t ignore_index) {
  check_lce(x_NH, weight_VH, labels_N);
  const auto acc = x_NH.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor logits = at::linear(x_NH, weight_VH).to(acc);
  at::Tensor sum = at::cross_entropy_loss(logits, labels_N, {}, at::Reduction::Sum, ignore_index);
  return {sum, labels_N.ne(ignore_index).sum()};
}

}  // namespace automoe::ops
