// CPU grouped GEMM: one gemm_batch over all groups, so that (group, tile) work units share the
// threads whatever the group sizes.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

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

}  // namespace

at::Tensor grouped_gemm_fwd(const at::Tensor& x_NK, const at::Tensor& w_GOK,
                            const at::Tensor& offsets_G1) {
  const int64_t G = w_GOK.size(0), O = w_GOK.size(1), K = w_GOK.size(2);
  const int64_t* off = offsets_G1.const_data_ptr<int64_t>();
  at::Tensor y = new_output({x_NK.size(0), O}, x_NK.options());
  std::vector<GemmProblem> problems;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = off[g + 1] - off[g];
    if (m == 0) continue;
    problems.push_back({m, O, K, operand(x_NK, off[g] * K, K, 1), operand(w_GOK, g * O * K, 1, K),
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
  std::vector<GemmProblem> problems;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t m = off[g + 1] - off[g];
    if (m == 0) continue;
    problems.push_back({m, K, O, operand(dy_NO, off[g] * O, O, 1), operand(w_GOK, g * O * K, K, 1),
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
