// CPU RMSNorm: one row per iteration, float32 statistics; the weight gradient is reduced per
// thread-chunk and the chunks summed in a fixed order (deterministic).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cpu {

// The autograd layer guarantees w_C has x_RC's dtype.
std::pair<at::Tensor, at::Tensor> rmsnorm_fwd(const at::Tensor& x_RC, const at::Tensor& w_C,
                                              double eps) {
  const int64_t C = x_RC.size(-1), R = x_RC.numel() / C;
  at::Tensor y = new_output(x_RC.sizes(), x_RC.options());
  const auto stat_dtype = x_RC.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor inv_rms = new_output({R}, x_RC.options().dtype(stat_dtype));
  const auto dtype = x_RC.scalar_type();
  if (dtype != at::kDouble) {  // vectorised rows (float32 / bfloat16)
    std::vector<float> wf(C);
    vec::load(w_C.const_data_ptr(), dtype, wf.data(), C);
    const char* x = static_cast<const char*>(x_RC.const_data_ptr());
    char* o = static_cast<char*>(y.data_ptr());
    float* inv = inv_rms.data_ptr<float>();
    const int64_t es = x_RC.element_size();
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        inv[r] = vec::rmsnorm_row(x + r * C * es, wf.data(), static_cast<float>(eps),
                                  o + r * C * es, dtype, C);
      }
    });
    return {y, inv_rms};
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x_RC.scalar_type(), "rmsnorm_fwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x = x_RC.const_data_ptr<scalar_t>();
    const scalar_t* w = w_C.const_data_ptr<scalar_t>();
    scalar_t* o = y.data_ptr<scalar_t>();
    acc_t* inv = inv_rms.data_ptr<acc_t>();
    at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = x + r * C;
        acc_t ss = 0;
        for (int64_t c = 0; c < C; ++c) ss += static_cast<acc_t>(xr[c]) * static_cast<acc_t>(xr[c]);
        const acc_t k = acc_t(1) / std::sqrt(ss / C + static_cast<acc_t>(eps));
        inv[r] = k;
        for (int64_t c = 0; c < C; ++c) {
          o[r * C + c] = static_cast<scalar_t>(static_cast<acc_t>(xr[c]) * k * static_cast<acc_t>(w[c]));
        }
      }
    });
  });
  return {y, inv_rms};
}

std::pair<at::Tensor, at::Tensor> rmsnorm_bwd(const at::Tensor& grad_RC, const at::Tensor& x_RC,
                                              const at::Tensor& w_C, const at::Tensor& inv_rms_R) {
  const int64_t C = x_RC.size(-1), R = x_RC.numel() / C;
  at::Tensor dx = new_output(x_RC.sizes(), x_RC.options());
  at::Tensor dw;
  // Fixed chunks of rows (independent of the thread count), each with its own dw partial.
  const int64_t chunk = 64, chunks = (R + chunk - 1) / chunk;
  const auto dtype = x_RC.scalar_type();
  if (dtype != at::kDouble) {  // vectorised rows (float32 / bfloat16)
    std::vector<float> wf(C), partial(std::max<int64_t>(chunks, 1) * C, 0.f);
    vec::load(w_C.const_data_ptr(), dtype, wf.data(), C);
    const char* x = static_cast<const char*>(x_RC.const_data_ptr());
    const char* g = static_cast<const char*>(grad_RC.const_data_ptr());
    char* d = static_cast<char*>(dx.data_ptr());
    const float* inv = inv_rms_R.const_data_ptr<float>();
    const int64_t es = x_RC.element_size();
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t ch = begin; ch < end; ++ch) {
        float* pw = partial.data() + ch * C;
        for (int64_t r = ch * chunk; r < std::min(R, (ch + 1) * chunk); ++r) {
          vec::rmsnorm_row_bwd(g + r * C * es, x + r * C * es, wf.data(), inv[r], pw,
                               d + r * C * es, dtype, C);
        }
      }
    });
    at::Tensor dw_acc = at::zeros({C}, inv_rms_R.options());
    float* s = dw_acc.data_ptr<float>();
    for (int64_t ch = 0; ch < chunks; ++ch) vec::axpy(s, 1.f, partial.data() + ch * C, C);
    return {dx, dw_acc.to(w_C.scalar_type())};
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x_RC.scalar_type(), "rmsnorm_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x = x_RC.const_data_ptr<scalar_t>();
    const scalar_t* g = grad_RC.const_data_ptr<scalar_t>();
    const scalar_t* w = w_C.const_data_ptr<scalar_t>();
    const acc_t* inv = inv_rms_R.const_data_ptr<acc_t>();
    scalar_t* d = dx.data_ptr<scalar_t>();
    std::vector<acc_t> partial(std::max<int64_t>(chunks, 1) * C, acc_t(0));
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t ch = begin; ch < end; ++ch) {
        acc_t* pw = partial.data() + ch * C;
        for (int64_t r = ch * chunk; r < std::min(R, (ch + 1) * chunk); ++r) {
          const scalar_t* xr = x + r * C;
          const scalar_t* gr = g + r * C;
          const acc_t k = inv[r];
          acc_t dot = 0;  // sum_c g_c w_c xhat_c
          for (int64_t c = 0; c < C; ++c) {
            const acc_t xh = static_cast<acc_t>(xr[c]) * k;
            const acc_t gc = static_cast<acc_t>(gr[c]);
            dot += gc * static_cast<acc_t>(w[c]) * xh;
            pw[c] += gc * xh;
          }
          const acc_t m = dot / C;
          for (int64_t c = 0; c < C; ++c) {
            const acc_t xh = static_cast<acc_t>(xr[c]) * k;
            d[r * C + c] = static_cast<scalar_t>(
                k * (static_cast<acc_t>(gr[c]) * static_cast<acc_t>(w[c]) - xh * m));
          }
        }
      }
    });
    at::Tensor dw_acc = at::zeros({C}, inv_rms_R.options());
    acc_t* s = dw_acc.data_ptr<acc_t>();
    for (int64_t ch = 0; ch < chunks; ++ch) {
      for (int64_t c = 0; c < C; ++c) s[c] += partial[ch * C + c];
    }
    dw = dw_acc.to(w_C.scalar_type());
  });
  return {dx, dw};
}

}  // namespace automoe::ops::cpu
