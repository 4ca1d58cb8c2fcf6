// CPU SwiGLU: elementwise over rows, float32 math (float64 for float64), nothing stored between
// forward and backward but the input. float32 / bf16 rows run in one pass (vec::swiglu_row).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cpu {
namespace {

// Column of gate and up for output column i of a row with I outputs.
inline int64_t gate_col(int64_t i, int64_t I, bool gpt_oss) { return gpt_oss ? 2 * i : i; }
inline int64_t up_col(int64_t i, int64_t I, bool gpt_oss) { return gpt_oss ? 2 * i + 1 : I + i; }

template <typename acc_t>
inline acc_t sigmoid(acc_t x) {
  return acc_t(1) / (acc_t(1) + std::exp(-x));
}

}  // namespace

at::Tensor swiglu_fwd(const at::Tensor& gate_up, bool gpt_oss, double alpha, double limit) {
  const int64_t I = gate_up.size(-1) / 2, R = gate_up.numel() / (2 * I);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  at::Tensor out = new_output(sizes, gate_up.options());
  const auto dtype = gate_up.scalar_type();
  if (!gpt_oss && dtype != at::kDouble) {  // vectorised rows (float32 / bfloat16)
    const char* in = static_cast<const char*>(gate_up.const_data_ptr());
    char* o = static_cast<char*>(out.data_ptr());
    const int64_t es = gate_up.element_size();
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const char* row = in + r * 2 * I * es;
        vec::swiglu_row(row, row + I * es, o + r * I * es, dtype, I);
      }
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "swiglu_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* in = gate_up.const_data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const acc_t a = static_cast<acc_t>(alpha), lim = static_cast<acc_t>(limit);
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = in + r * 2 * I;
        scalar_t* orow = o + r * I;
        if (gpt_oss) {
          for (int64_t i = 0; i < I; ++i) {
            const acc_t g = std::min(static_cast<acc_t>(row[2 * i]), lim);
            const acc_t u = std::clamp(static_cast<acc_t>(row[2 * i + 1]), -lim, lim);
            orow[i] = static_cast<scalar_t>((u + 1) * g * sigmoid(a * g));
          }
        } else {
          for (int64_t i = 0; i < I; ++i) {
            const acc_t g = static_cast<acc_t>(row[i]), u = static_cast<acc_t>(row[I + i]);
            orow[i] = static_cast<scalar_t>(g * sigmoid(g) * u);
          }
        }
      }
    });
  });
  return out;
}

at::Tensor swiglu_bwd(const at::Tensor& grad_RI, const at::Tensor& gate_up, bool gpt_oss,
                      double alpha, double limit) {
  const int64_t I = gate_up.size(-1) / 2, R = gate_up.numel() / (2 * I);
  at::Tensor grad_in = new_output(gate_up.sizes(), gate_up.options());
  const auto dtype = gate_up.scalar_type();
  if (!gpt_oss && dtype != at::kDouble) {  // vectorised rows (float32 / bfloat16)
    const char* in = static_cast<const char*>(gate_up.const_data_ptr());
    const char* gr = static_cast<const char*>(grad_RI.const_data_ptr());
    char* gi = static_cast<char*>(grad_in.data_ptr());
    const int64_t es = gate_up.element_size();
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const char* row = in + r * 2 * I * es;
        char* out = gi + r * 2 * I * es;
        vec::swiglu_row_bwd(row, row + I * es, gr + r * I * es, out, out + I * es, dtype, I);
      }
    });
    return grad_in;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "swiglu_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* in = gate_up.const_data_ptr<scalar_t>();
    const scalar_t* gr = grad_RI.const_data_ptr<scalar_t>();
    scalar_t* gi = grad_in.data_ptr<scalar_t>();
    const acc_t a = static_cast<acc_t>(alpha), lim = static_cast<acc_t>(limit);
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = in + r * 2 * I;
        const scalar_t* grow = gr + r * I;
        scalar_t* out = gi + r * 2 * I;
        for (int64_t i = 0; i < I; ++i) {
          const int64_t gc = gate_col(i, I, gpt_oss), uc = up_col(i, I, gpt_oss);
          const acc_t dy = static_cast<acc_t>(grow[i]);
          const acc_t graw = static_cast<acc_t>(row[gc]), uraw = static_cast<acc_t>(row[uc]);
          if (gpt_oss) {
            // clamp passes the gradient where the input is inside [min, max] (torch's rule).
            const acc_t g = std::min(graw, lim), u = std::clamp(uraw, -lim, lim);
            const acc_t s = sigmoid(a * g), glu = g * s;
            const acc_t dglu = s + a * g * s * (1 - s);
            out[gc] = static_cast<scalar_t>(graw <= lim ? dy * (u + 1) * dglu : acc_t(0));
            out[uc] = static_cast<scalar_t>(uraw >= -lim && uraw <= lim ? dy * glu : acc_t(0));
          } else {
            const acc_t s = sigmoid(graw);
            out[gc] = static_cast<scalar_t>(dy * uraw * s * (1 + graw * (1 - s)));
            out[uc] = static_cast<scalar_t>(dy * graw * s);
          }
        }
      }
    });
  });
  return grad_in;
}

}  // namespace automoe::ops::cpu
