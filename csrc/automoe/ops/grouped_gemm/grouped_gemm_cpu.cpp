// CPU grouped GEMM: one gemm_batch over all groups, so that (group, tile) work units share the
// threads whatever the group sizes. float32 groups go to ATen's (MKL) GEMM instead, one group per
// task in a parallel loop (MKL runs single-threaded inside it), on CPUs where that measured faster
// (gemm_cpu.h: aten_faster_fp32; MKL wins on Intel, our AVX-512 kernel on AMD Zen 5). bfloat16
// always runs on our engine: its brgemm path is oneDNN's bf16 kernel without ATen's per-call
// overheads, and below native bf16 ATen has no fast path.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cpu {
namespace {

GemmOperand operand(const at::Tensor& t, int64_t offset_elems, int64_t row_stride,
                    int64_t col_stride) {
  return {static_cast<const char*>(t.const_data_ptr()) + offset_elems * t.element_size(),
          t.scalar_type(), row_stride, col_stride};
}

void* at_row(const at::Tensor& t, int64_t offset_elems) {
  return static_cast<char*>(t.data_ptr()) + offset_elems * t.element_size();
}

// Rows past the last group are outside every problem: zero them.
void zero_tail(at::Tensor& out, int64_t rows_used) {
  if (rows_used < out.size(0)) out.narrow(0, rows_used, out.size(0) - rows_used).zero_();
}

// float32 groups: ATen's BLAS where it measured faster than our engine on this CPU.
bool use_aten(const at::Tensor& t) { return t.scalar_type() == at::kFloat && aten_faster_fp32(); }

// fn(g) for every non-empty group, largest groups first (balances the parallel loop).
template <typename Fn>
void for_groups(const int64_t* off, int64_t G, Fn fn) {
  std::vector<int64_t> order;
  for (int64_t g = 0; g < G; ++g) {
    if (off[g + 1] > off[g]) order.push_back(g);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return off[a + 1] - off[a] > off[b + 1] - off[b];
  });
  // The workers call ATen ops: they run under the caller's thread-local state (grad mode,
  // dispatch keys), as the caller's own calls would.
  const at::ThreadLocalState state;
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    const at::ThreadLocalStateGuard guard(state);
    for (int64_t i = begin; i < end; ++i) fn(order[i]);
  });
}

}  // namespace

at::Tensor grouped_gemm_fwd(const at::Tensor& x_NK, const at::Tensor& w_GOK,
                            const at::Tensor& offsets_G1) {
  const int64_t G = w_GOK.size(0), O = w_GOK.size(1), K = w_GOK.size(2);
  const int64_t* off = offsets_G1.const_data_ptr<int64_t>();
  at::Tensor y = new_output({x_NK.size(0), O}, x_NK.options());
  if (use_aten(x_NK)) {
    for_groups(off, G, [&](int64_t g) {
      const int64_t m = off[g + 1] - off[g];
      at::Tensor out = y.narrow(0, off[g], m);
      at::mm_out(out, x_NK.narrow(0, off[g], m), w_GOK[g].t());
    });
    zero_tail(y, off[G]);
    return y;
  }
  std::vector<GemmProblem> problems;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = off[g + 1] - off[g];
    if (m == 0) continue;
    // B[k, o] = w[g, o, k], at w's strides (each group's [O, K] rows of K, or stored transposed)
    problems.push_back({m, O, K, operand(x_NK, off[g] * K, K, 1),
                        operand(w_GOK, g * w_GOK.stride(0), w_GOK.stride(2), w_GOK.stride(1)),
                        at_row(y, off[g] * O), y.scalar_type(), O, false});
  }
  gemm_batch(problems);
  zero_tail(y, off[G]);
  return y;
}

at::Tensor grouped_gemm_dx(const at::Tensor& dy_NO, const at::Tensor& w_GOK,
                           const at::Tensor& offsets_G1) {
  const int64_t G = w_GOK.size(0), O = w_GOK.size(1), K = w_GOK.size(2);
  const int64_t* off = offsets_G1.const_data_ptr<int64_t>();
  at::Tensor dx = new_output({dy_NO.size(0), K}, dy_NO.options());
  if (use_aten(dy_NO)) {
    for_groups(off, G, [&](int64_t g) {
      const int64_t m = off[g + 1] - off[g];
      at::Tensor out = dx.narrow(0, off[g], m);
      at::mm_out(out, dy_NO.narrow(0, off[g], m), w_GOK[g]);
    });
    zero_tail(dx, off[G]);
    return dx;
  }
  std::vector<GemmProblem> problems;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = off[g + 1] - off[g];
    if (m == 0) continue;
    problems.push_back({m, K, O, operand(dy_NO, off[g] * O, O, 1),
                        operand(w_GOK, g * w_GOK.stride(0), w_GOK.stride(1), w_GOK.stride(2)),
                        at_row(dx, off[g] * K), dx.scalar_type(), K, false});
  }
  gemm_batch(problems);
  zero_tail(dx, off[G]);
  return dx;
}

at::Tensor grouped_gemm_dw(const at::Tensor& dy_NO, const at::Tensor& x_NK,
                           const at::Tensor& offsets_G1, int64_t groups, c10::ScalarType w_dtype) {
  const int64_t O = dy_NO.size(1), K = x_NK.size(1);
  const int64_t* off = offsets_G1.const_data_ptr<int64_t>();
  // The GEMM writes in x's dtype; another w dtype is converted afterwards.
  at::Tensor dw = new_output({groups, O, K}, x_NK.options());
  if (use_aten(x_NK)) {
    for (int64_t g = 0; g < groups; ++g) {
      if (off[g + 1] == off[g]) dw[g].zero_();
    }
    for_groups(off, groups, [&](int64_t g) {
      const int64_t m = off[g + 1] - off[g];
      at::Tensor out = dw[g];
      at::mm_out(out, dy_NO.narrow(0, off[g], m).t(), x_NK.narrow(0, off[g], m));
    });
    return dw.scalar_type() == w_dtype ? dw : dw.to(w_dtype);
  }
  std::vector<GemmProblem> problems;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m = off[g + 1] - off[g];
    if (m == 0) {
      dw[g].zero_();
      continue;
    }
    // dw_g[o, k] = sum_m dy[m, o] x[m, k]: A = dy_gᵀ (column-major view), B = x_g.
    problems.push_back({O, K, m, operand(dy_NO, off[g] * O, 1, O), operand(x_NK, off[g] * K, K, 1),
                        at_row(dw, g * O * K), dw.scalar_type(), K, false});
  }
  gemm_batch(problems);
  return dw.scalar_type() == w_dtype ? dw : dw.to(w_dtype);
}

}  // namespace automoe::ops::cpu
