// CPU kernels of Mamba-2's conv1d and gated RMSNorm (kernel_decls.inc): rows of channels, float32
// accumulation, the row primitives of ops/cpu/vec.h (one copy per instruction-set level). The
// weight and bias gradients are reduced per fixed block of positions / rows and the blocks summed
// in order (deterministic, independent of the thread count).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cpu {
namespace {

// w [C, K] in its dtype -> float32 [K, C] (one row of weights per tap).
std::vector<float> taps_KC(const at::Tensor& w_CK) {
  const int64_t C = w_CK.size(0), K = w_CK.size(1);
  std::vector<float> wf(C * K), out(K * C);
  vec::load(w_CK.const_data_ptr(), w_CK.scalar_type(), wf.data(), C * K);
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t k = 0; k < K; ++k) out[k * C + c] = wf[c * K + k];
  }
  return out;
}

std::vector<float> floats(const std::optional<at::Tensor>& t, int64_t n) {
  std::vector<float> out(n, 0.f);
  if (t) vec::load(t->const_data_ptr(), t->scalar_type(), out.data(), n);
  return out;
}

struct ConvView {
  int64_t S, C, K;
  const char* x;
  int64_t es;  // bytes per element of x (and of y, dy, dx)
  const int64_t* doc;
  // Whether position s of batch row b is a tap of position t's output.
  bool tap(int64_t b, int64_t t, int64_t s) const {
    return s >= 0 && s < S && (doc == nullptr || doc[b * S + s] == doc[b * S + t]);
  }
  const char* row(int64_t b, int64_t s) const { return x + (b * S + s) * C * es; }
  // acc = bias + sum of the valid taps of position t.
  void pre(int64_t b, int64_t t, const float* bias, const float* w_KC, c10::ScalarType dtype,
           float* acc) const {
    std::copy(bias, bias + C, acc);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t s = t - K + 1 + k;
      if (tap(b, t, s)) vec::mul_add_row(acc, w_KC + k * C, row(b, s), dtype, C);
    }
  }
};

}  // namespace

at::Tensor causal_conv1d_fwd(const at::Tensor& x_BSC, const at::Tensor& w_CK,
                             const std::optional<at::Tensor>& bias_C,
                             const std::optional<at::Tensor>& doc_BS, bool silu) {
  const int64_t B = x_BSC.size(0), S = x_BSC.size(1), C = x_BSC.size(2), K = w_CK.size(1);
  at::Tensor y = new_output(x_BSC.sizes(), x_BSC.options());
  const auto dtype = x_BSC.scalar_type();
  const std::vector<float> w = taps_KC(w_CK), bias = floats(bias_C, C);
  const ConvView v{S, C, K, static_cast<const char*>(x_BSC.const_data_ptr()),
                   static_cast<int64_t>(x_BSC.element_size()),
                   doc_BS ? doc_BS->const_data_ptr<int64_t>() : nullptr};
  char* out = static_cast<char*>(y.data_ptr());
  at::parallel_for(0, B * S, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(C);
    for (int64_t r = begin; r < end; ++r) {
      v.pre(r / S, r % S, bias.data(), w.data(), dtype, acc.data());
      vec::silu_store_row(acc.data(), silu, out + r * C * v.es, dtype, C);
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_conv1d_bwd(
    const at::Tensor& grad_BSC, const at::Tensor& x_BSC, const at::Tensor& w_CK,
    const std::optional<at::Tensor>& bias_C, const std::optional<at::Tensor>& doc_BS, bool silu) {
  const int64_t B = x_BSC.size(0), S = x_BSC.size(1), C = x_BSC.size(2), K = w_CK.size(1);
  const auto dtype = x_BSC.scalar_type();
  at::Tensor dx = new_output(x_BSC.sizes(), x_BSC.options());
  const std::vector<float> w = taps_KC(w_CK), bias = floats(bias_C, C);
  const ConvView v{S, C, K, static_cast<const char*>(x_BSC.const_data_ptr()),
                   static_cast<int64_t>(x_BSC.element_size()),
                   doc_BS ? doc_BS->const_data_ptr<int64_t>() : nullptr};
  const char* dy = static_cast<const char*>(grad_BSC.const_data_ptr());
  char* dxp = static_cast<char*>(dx.data_ptr());
  // Blocks of L positions of one batch row (at most ~128 blocks in all plus one per row), each
  // with its own [K + 1, C] partial of dw (taps) and dbias.
  const int64_t L = std::max<int64_t>(64, (B * S + 127) / 128), per_row = (S + L - 1) / L;
  const int64_t blocks = B * per_row;
  std::vector<float> partial(blocks * (K + 1) * C, 0.f);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    // gy = dy * silu'(pre) of positions s .. s + K - 1, position t in slot t % K.
    std::vector<float> ring(K * C), pre(C), acc(C);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t b = blk / per_row, t0 = (blk % per_row) * L, t1 = std::min(S, t0 + L);
      float* pw = partial.data() + blk * (K + 1) * C;
      auto gy = [&](int64_t t) { return ring.data() + (t % K) * C; };
      auto compute = [&](int64_t t) {
        v.pre(b, t, bias.data(), w.data(), dtype, pre.data());
        vec::silu_grad_row(pre.data(), silu, dy + (b * S + t) * C * v.es, dtype, gy(t), C);
      };
      for (int64_t t = t0; t < std::min(S, t0 + K - 1); ++t) compute(t);
      for (int64_t s = t0; s < t1; ++s) {
        if (s + K - 1 < S) compute(s + K - 1);
        const float* g = gy(s);  // this block's own position: its weight and bias gradients
        for (int64_t k = 0; k < K; ++k) {
          const int64_t src = s - K + 1 + k;
          if (v.tap(b, s, src)) vec::mul_add_row(pw + k * C, g, v.row(b, src), dtype, C);
        }
        if (bias_C) vec::axpy(pw + K * C, 1.f, g, C);
        // dx[s] = sum over the outputs t = s + K - 1 - k that read s as tap k.
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t k = 0; k < K; ++k) {
          const int64_t t = s + K - 1 - k;
          if (t < S && v.tap(b, t, s)) {
            vec::mul_add_row(acc.data(), w.data() + k * C, gy(t), at::kFloat, C);
          }
        }
        vec::store(acc.data(), dxp + (b * S + s) * C * v.es, dtype, C);
      }
    }
  });
  std::vector<float> sum((K + 1) * C, 0.f);
  for (int64_t blk = 0; blk < blocks; ++blk) {
    vec::axpy(sum.data(), 1.f, partial.data() + blk * (K + 1) * C, (K + 1) * C);
  }
  at::Tensor dw_CK = at::empty({C, K}, w_CK.options().dtype(at::kFloat));
  float* dwp = dw_CK.data_ptr<float>();
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t k = 0; k < K; ++k) dwp[c * K + k] = sum[k * C + c];
  }
  at::Tensor db;
  if (bias_C) {
    at::Tensor db_f = at::empty({C}, w_CK.options().dtype(at::kFloat));
    std::copy(sum.data() + K * C, sum.data() + (K + 1) * C, db_f.data_ptr<float>());
    db = db_f.to(bias_C->scalar_type());
  }
  return {dx, dw_CK.to(w_CK.scalar_type()), db};
}

std::pair<at::Tensor, at::Tensor> gated_rmsnorm_fwd(const at::Tensor& y_RW, const at::Tensor& z_RW,
                                                    const at::Tensor& w_W, int64_t group,
                                                    double eps) {
  const int64_t W = y_RW.size(-1), R = y_RW.numel() / W, G = W / group;
  const auto dtype = y_RW.scalar_type();
  at::Tensor out = new_output(y_RW.sizes(), y_RW.options());
  at::Tensor inv = new_output({R, G}, y_RW.options().dtype(at::kFloat));
  const std::vector<float> w = floats(w_W, W);
  const char* y = static_cast<const char*>(y_RW.const_data_ptr());
  const char* z = static_cast<const char*>(z_RW.const_data_ptr());
  char* o = static_cast<char*>(out.data_ptr());
  float* k = inv.data_ptr<float>();
  const int64_t es = y_RW.element_size(), zs = z_RW.element_size();
  at::parallel_for(0, R, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> zf(W), s(W);
    for (int64_t r = begin; r < end; ++r) {
      vec::load(z + r * W * zs, z_RW.scalar_type(), zf.data(), W);
      vec::sigmoid_row(zf.data(), s.data(), W);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = r * W + g * group;
        k[r * G + g] = vec::gated_norm_group(y + at * es, zf.data() + g * group, s.data() + g * group,
                                             w.data() + g * group, static_cast<float>(eps),
                                             o + at * es, dtype, group);
      }
    }
  });
  return {out, inv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_rmsnorm_bwd(
    const at::Tensor& grad_RW, const at::Tensor& y_RW, const at::Tensor& z_RW,
    const at::Tensor& w_W, const at::Tensor& inv_RG, int64_t group) {
  const int64_t W = y_RW.size(-1), R = y_RW.numel() / W, G = W / group;
  const auto dtype = y_RW.scalar_type();
  at::Tensor dy = new_output(y_RW.sizes(), y_RW.options());
  at::Tensor dz = new_output(z_RW.sizes(), z_RW.options());
  const std::vector<float> w = floats(w_W, W);
  const char* gp = static_cast<const char*>(grad_RW.const_data_ptr());
  const char* y = static_cast<const char*>(y_RW.const_data_ptr());
  const char* z = static_cast<const char*>(z_RW.const_data_ptr());
  char* dyp = static_cast<char*>(dy.data_ptr());
  char* dzp = static_cast<char*>(dz.data_ptr());
  const float* k = inv_RG.const_data_ptr<float>();
  const int64_t es = y_RW.element_size(), zs = z_RW.element_size();
  const int64_t chunk = 64, chunks = (R + chunk - 1) / chunk;
  std::vector<float> partial(std::max<int64_t>(chunks, 1) * W, 0.f);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> zf(W), s(W), dzf(W);
    for (int64_t ch = begin; ch < end; ++ch) {
      float* pw = partial.data() + ch * W;
      for (int64_t r = ch * chunk; r < std::min(R, (ch + 1) * chunk); ++r) {
        vec::load(z + r * W * zs, z_RW.scalar_type(), zf.data(), W);
        vec::sigmoid_row(zf.data(), s.data(), W);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t at = r * W + g * group, c = g * group;
          vec::gated_norm_group_bwd(gp + at * es, y + at * es, zf.data() + c, s.data() + c,
                                    w.data() + c, k[r * G + g], pw + c, dyp + at * es, dzf.data() + c,
                                    dtype, group);
        }
        vec::store(dzf.data(), dzp + r * W * zs, z_RW.scalar_type(), W);
      }
    }
  });
  at::Tensor dw = at::zeros({W}, y_RW.options().dtype(at::kFloat));
  float* s = dw.data_ptr<float>();
  for (int64_t ch = 0; ch < chunks; ++ch) vec::axpy(s, 1.f, partial.data() + ch * W, W);
  return {dy, dz, dw.to(w_W.scalar_type())};
}

}  // namespace automoe::ops::cpu
