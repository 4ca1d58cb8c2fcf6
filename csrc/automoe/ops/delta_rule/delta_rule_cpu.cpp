// The gated delta rule on the CPU (delta_rule_cpu.h). Per (row, head) unit and chunk of n
// positions, with cum the within-chunk cumulative log-decay, Γ_ij = exp(cum_i − cum_j) (j ≤ i),
// kb = β∘k, A = (kb kᵀ)∘Γ strictly lower, M = I + A:
//   X = [U | −W] = M⁻¹ [β∘v | −e^cum∘kb]   (one blocked forward substitution, both at once)
//   P = (q kᵀ)∘Γ,  q̃ = e^cum∘q,  k̃ = e^(cum_last − cum)∘k,  λ = e^cum_last
//   V' = U − W S,  O = q̃ S + P V',  S ← λ S + k̃ᵀ V'.
// Carrying −W instead of W turns every subtraction into an accumulating GEMM, and the backward's
// dA = −(dvb Uᵀ + dx Wᵀ) into one product, −dR Xᵀ, with dR = M⁻ᵀ dX.
#include "automoe/ops/delta_rule/delta_rule_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "automoe/ops/cpu/denormals.h"
#include "automoe/ops/cpu/vec.h"
#include "automoe/ops/delta_rule/delta_rule.h"
#include "automoe/ops/grouped_gemm/gemm_cpu.h"
#include "automoe/ops/kernels.h"

namespace automoe::ops::cpu {
namespace {

using c10::ScalarType;

struct Geo {
  int64_t B, N, S, Dk, Dv, Q, nc, Wd;  // Wd = Dv + Dk: X's and R's width
  int64_t rows(int64_t c) const { return std::min(Q, S - c * Q); }
};

Geo geometry(const at::Tensor& q, const at::Tensor& v, int64_t chunk) {  // q [B, S, N, Dk]
  Geo g{};
  g.B = q.size(0), g.S = q.size(1), g.N = q.size(2), g.Dk = q.size(3), g.Dv = v.size(3), g.Q = chunk;
  g.nc = (g.S + chunk - 1) / chunk;
  g.Wd = g.Dv + g.Dk;
  return g;
}

// C (+)= A·B, float32 operands with arbitrary strides.
GemmProblem mm(int64_t M, int64_t N, int64_t K, const float* a, int64_t ars, int64_t acs, const float* b,
               int64_t brs, int64_t bcs, float* c, int64_t ldc, bool accumulate) {
  GemmProblem p;
  p.M = M, p.N = N, p.K = K;
  p.A = {a, ScalarType::Float, ars, acs};
  p.B = {b, ScalarType::Float, brs, bcs};
  p.C = c, p.c_dtype = ScalarType::Float, p.ldc = ldc, p.accumulate = accumulate;
  return p;
}

// One unit's inputs in float32: rows of [S, D] (and [S] for g, beta), q and k normalised.
struct Unit {
  const float *q, *k, *v, *g, *beta;
};

// The model-layout tensors [B, S, N, ·] a unit reads its rows from.
struct Inputs {
  at::Tensor q, k, v, g, beta;
  double scale = 1.0;
};

const char* row_ptr(const at::Tensor& t, int64_t row, int64_t width) {
  return static_cast<const char*>(t.const_data_ptr()) + row * width * t.element_size();
}

// Unit (b, h)'s rows gathered into float32 (q, k [S, Dk], v [S, Dv], g, beta, and q's and k's
// inverse norms [S]), q and k L2-normalised as detail::l2norm, q scaled.
struct UnitRows {
  std::vector<float> q, k, v, g, beta, rq, rk;
};

Unit gather(const Geo& G, const Inputs& in, int64_t b, int64_t h, UnitRows& u) {
  u.q.resize(G.S * G.Dk), u.k.resize(G.S * G.Dk), u.v.resize(G.S * G.Dv);
  u.g.resize(G.S), u.beta.resize(G.S), u.rq.resize(G.S), u.rk.resize(G.S);
  const float scale = static_cast<float>(in.scale), eps = static_cast<float>(detail::kL2normEps);
  for (int64_t s = 0; s < G.S; ++s) {
    const int64_t row = (b * G.S + s) * G.N + h;
    float* q = u.q.data() + s * G.Dk;
    float* k = u.k.data() + s * G.Dk;
    vec::load(row_ptr(in.q, row, G.Dk), in.q.scalar_type(), q, G.Dk);
    vec::load(row_ptr(in.k, row, G.Dk), in.k.scalar_type(), k, G.Dk);
    vec::load(row_ptr(in.v, row, G.Dv), in.v.scalar_type(), u.v.data() + s * G.Dv, G.Dv);
    vec::load(row_ptr(in.g, row, 1), in.g.scalar_type(), &u.g[s], 1);
    vec::load(row_ptr(in.beta, row, 1), in.beta.scalar_type(), &u.beta[s], 1);
    u.rq[s] = 1.f / std::sqrt(vec::sum_sq(q, G.Dk) + eps);
    u.rk[s] = 1.f / std::sqrt(vec::sum_sq(k, G.Dk) + eps);
    vec::scale(q, u.rq[s] * scale, q, G.Dk);
    vec::scale(k, u.rk[s], k, G.Dk);
  }
  return {u.q.data(), u.k.data(), u.v.data(), u.g.data(), u.beta.data()};
}

constexpr int64_t kBlock = 16;  // the triangular solves' diagonal blocks

// (I − L) X = R in place (X holds R on entry), L = An strictly lower [n, n], X [n, w].
void solve_lower(const float* An, float* X, int64_t n, int64_t w) {
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    if (b0 > 0) gemm_batch({mm(b1 - b0, w, b0, An + b0 * n, n, 1, X, w, 1, X + b0 * w, w, true)});
    for (int64_t i = b0; i < b1; ++i) {
      for (int64_t j = b0; j < i; ++j) vec::axpy(X + i * w, An[i * n + j], X + j * w, w);
    }
  }
}

// (I − L)ᵀ Y = R in place, from the last block up.
void solve_upper(const float* An, float* Y, int64_t n, int64_t w) {
  for (int64_t b0 = (n - 1) / kBlock * kBlock; b0 >= 0; b0 -= kBlock) {
    const int64_t b1 = std::min(n, b0 + kBlock);
    if (b1 < n) gemm_batch({mm(b1 - b0, w, n - b1, An + b1 * n + b0, 1, n, Y + b1 * w, w, 1, Y + b0 * w, w, true)});
    for (int64_t i = b1 - 1; i >= b0; --i) {
      for (int64_t j = i + 1; j < b1; ++j) vec::axpy(Y + i * w, An[j * n + i], Y + j * w, w);
    }
  }
}

// One chunk's quantities (thread-local, reused).
struct Chunk {
  int64_t n = 0;
  float lam = 0.f;
  std::vector<float> cum, e, ek;        // [n]: cum, e^cum, e^(cum_last − cum)
  std::vector<float> kb, qd, kd;        // [n, Dk]: β∘k, q̃, k̃
  std::vector<float> R, X;              // [n, Wd]: [β∘v | −e^cum∘kb] and M⁻¹ R = [U | −W]
  std::vector<float> KK, QK, gam, An, P;  // [n, n]: kb kᵀ, q kᵀ, Γ (0 above the diagonal), −A, P
};

void prepare(const Geo& G, const Unit& u, int64_t c, Chunk& h) {
  const int64_t n = G.rows(c), s0 = c * G.Q, Dk = G.Dk, Dv = G.Dv, Wd = G.Wd;
  const float *q = u.q + s0 * Dk, *k = u.k + s0 * Dk, *v = u.v + s0 * Dv, *g = u.g + s0, *beta = u.beta + s0;
  h.n = n;
  h.cum.resize(n), h.e.resize(n), h.ek.resize(n);
  h.kb.resize(n * Dk), h.qd.resize(n * Dk), h.kd.resize(n * Dk);
  h.R.resize(n * Wd), h.X.resize(n * Wd);
  for (auto* m : {&h.KK, &h.QK, &h.gam, &h.An, &h.P}) m->resize(n * n);
  float run = 0.f;
  for (int64_t i = 0; i < n; ++i) h.cum[i] = run += g[i];
  const float last = h.cum[n - 1];
  h.lam = std::exp(last);
  vec::exp_from(last, h.cum.data(), h.ek.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(h.cum[i]), ek = h.ek[i], b = beta[i];
    h.e[i] = e;
    float* kb = h.kb.data() + i * Dk;
    float* rx = h.R.data() + i * Wd + Dv;
    vec::scale(k + i * Dk, b, kb, Dk);
    vec::scale(kb, -e, rx, Dk);
    vec::scale(q + i * Dk, e, h.qd.data() + i * Dk, Dk);
    vec::scale(k + i * Dk, ek, h.kd.data() + i * Dk, Dk);
    vec::scale(v + i * Dv, b, h.R.data() + i * Wd, Dv);
  }
  gemm_batch({mm(n, n, Dk, h.kb.data(), Dk, 1, k, 1, Dk, h.KK.data(), n, false),
              mm(n, n, Dk, q, Dk, 1, k, 1, Dk, h.QK.data(), n, false)});
  for (int64_t i = 0; i < n; ++i) {
    float* gm = h.gam.data() + i * n;
    vec::exp_from(h.cum[i], h.cum.data(), gm, i + 1);
    std::fill(gm + i + 1, gm + n, 0.f);
    const float *kk = h.KK.data() + i * n, *qk = h.QK.data() + i * n;
    float *an = h.An.data() + i * n, *p = h.P.data() + i * n;
    for (int64_t j = 0; j < n; ++j) {
      an[j] = j < i ? -kk[j] * gm[j] : 0.f;
      p[j] = qk[j] * gm[j];
    }
  }
  std::copy(h.R.begin(), h.R.end(), h.X.begin());
  solve_lower(h.An.data(), h.X.data(), n, Wd);
}

// V' = U − W S [n, Dv] from X and the state entering the chunk.
void vprime(const Geo& G, const Chunk& h, const float* S, float* vp) {
  for (int64_t i = 0; i < h.n; ++i) std::copy_n(h.X.data() + i * G.Wd, G.Dv, vp + i * G.Dv);
  gemm_batch({mm(h.n, G.Dv, G.Dk, h.X.data() + G.Dv, G.Wd, 1, S, G.Dv, 1, vp, G.Dv, true)});
}

// O into out (rows of stride ldo), the chunk-entry states and the final state.
void forward_unit(const Geo& G, const Unit& u, const float* init, float* out, int64_t ldo, float* states,
                  float* fin) {
  thread_local Chunk h;
  thread_local std::vector<float> S, vp;
  const int64_t DD = G.Dk * G.Dv;
  S.assign(init, init + DD);
  vp.resize(G.Q * G.Dv);
  for (int64_t c = 0; c < G.nc; ++c) {
    std::copy(S.begin(), S.end(), states + c * DD);
    prepare(G, u, c, h);
    const int64_t n = h.n;
    float* o = out + c * G.Q * ldo;
    vprime(G, h, S.data(), vp.data());
    gemm_batch({mm(n, G.Dv, G.Dk, h.qd.data(), G.Dk, 1, S.data(), G.Dv, 1, o, ldo, false)});
    gemm_batch({mm(n, G.Dv, n, h.P.data(), n, 1, vp.data(), G.Dv, 1, o, ldo, true)});
    vec::scale(S.data(), h.lam, S.data(), DD);
    gemm_batch({mm(G.Dk, G.Dv, n, h.kd.data(), 1, G.Dk, vp.data(), G.Dv, 1, S.data(), G.Dv, true)});
  }
  std::copy(S.begin(), S.end(), fin);
}

struct UnitGrads {
  float *dq, *dk, *dv, *dg, *dbeta, *dinit;
};

void backward_unit(const Geo& G, const Unit& u, const float* states, const float* dout, const float* dfinal,
                   const UnitGrads& gr) {
  thread_local Chunk h;
  thread_local std::vector<float> dS, dSn, vp, zeros, dX, dqd, dkd, dP, dA, dkb, dcum, dgl;
  const int64_t DD = G.Dk * G.Dv, Dk = G.Dk, Dv = G.Dv, Wd = G.Wd;
  if (dfinal) dS.assign(dfinal, dfinal + DD);
  else dS.assign(DD, 0.f);
  dSn.resize(DD);
  vp.resize(G.Q * Dv), dX.resize(G.Q * Wd), dqd.resize(G.Q * Dk), dkd.resize(G.Q * Dk), dkb.resize(G.Q * Dk);
  dP.resize(G.Q * G.Q), dA.resize(G.Q * G.Q), dcum.resize(G.Q), dgl.resize(G.Q);
  if (!dout) zeros.assign(G.Q * Dv, 0.f);
  for (int64_t c = G.nc - 1; c >= 0; --c) {
    const int64_t s0 = c * G.Q;
    prepare(G, u, c, h);
    const int64_t n = h.n;
    const float* Sc = states + c * DD;
    const float* dO = dout ? dout + s0 * Dv : zeros.data();
    const float *q = u.q + s0 * Dk, *k = u.k + s0 * Dk, *v = u.v + s0 * Dv, *beta = u.beta + s0;
    float *dq = gr.dq + s0 * Dk, *dk = gr.dk + s0 * Dk, *dv = gr.dv + s0 * Dv;
    vprime(G, h, Sc, vp.data());
    // dV' = Pᵀ dO + k̃ dS' into dX's first Dv columns (dU = dV').
    gemm_batch({mm(n, Dv, n, h.P.data(), 1, n, dO, Dv, 1, dX.data(), Wd, false)});
    gemm_batch({mm(n, Dv, Dk, h.kd.data(), Dk, 1, dS.data(), Dv, 1, dX.data(), Wd, true)});
    // d(−W) = dV' Sᵀ, dq̃ = dO Sᵀ, dk̃ = V' dS'ᵀ, dP = dO V'ᵀ.
    gemm_batch({mm(n, Dk, Dv, dX.data(), Wd, 1, Sc, 1, Dv, dX.data() + Dv, Wd, false),
                mm(n, Dk, Dv, dO, Dv, 1, Sc, 1, Dv, dqd.data(), Dk, false),
                mm(n, Dk, Dv, vp.data(), Dv, 1, dS.data(), 1, Dv, dkd.data(), Dk, false),
                mm(n, n, Dv, dO, Dv, 1, vp.data(), 1, Dv, dP.data(), n, false)});
    const float dlam = vec::dot(Sc, dS.data(), DD);
    // The gradient of the state entering the chunk: λ dS' + q̃ᵀ dO − Wᵀ dV'.
    vec::scale(dS.data(), h.lam, dSn.data(), DD);
    gemm_batch({mm(Dk, Dv, n, h.qd.data(), 1, Dk, dO, Dv, 1, dSn.data(), Dv, true)});
    gemm_batch({mm(Dk, Dv, n, h.X.data() + Dv, 1, Wd, dX.data(), Wd, 1, dSn.data(), Dv, true)});
    // dR = M⁻ᵀ dX (in place), dA = −dR Xᵀ below the diagonal.
    solve_upper(h.An.data(), dX.data(), n, Wd);
    const float* dR = dX.data();
    gemm_batch({mm(n, n, Wd, dR, Wd, 1, h.X.data(), 1, Wd, dA.data(), n, false)});
    // A = (kb kᵀ)∘Γ, P = (q kᵀ)∘Γ: dA∘Γ into dA, dP∘Γ into dP. With Γ_ij = exp(cum_i − cum_j) and
    // cum_i = Σ_{t ≤ i} g_t, dΓ∘Γ reaches g_s through the entries that straddle s (i ≥ s > j):
    // summed as such, not as row sums minus column sums (whose within-block parts cancel, leaving
    // float32 rounding larger than the true gradient under strong decays).
    std::fill_n(dgl.begin(), n, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      float straddle = 0.f;  // Σ_{j < s} dΓ∘Γ_ij for s = j + 1
      for (int64_t j = 0; j < n; ++j) {
        const int64_t ij = i * n + j;
        const float gm = h.gam[ij];
        const float da = j < i ? -dA[ij] * gm : 0.f, dp = dP[ij] * gm;
        dA[ij] = da, dP[ij] = dp;
        if (j < i) dgl[j + 1] += straddle += da * h.KK[ij] + dp * h.QK[ij];
      }
    }
    // dkb = dAG k, dq = dPG k, dk = dAGᵀ kb + dPGᵀ q.
    gemm_batch({mm(n, Dk, n, dA.data(), n, 1, k, Dk, 1, dkb.data(), Dk, false),
                mm(n, Dk, n, dP.data(), n, 1, k, Dk, 1, dq, Dk, false),
                mm(n, Dk, n, dA.data(), 1, n, h.kb.data(), Dk, 1, dk, Dk, false)});
    gemm_batch({mm(n, Dk, n, dP.data(), 1, n, q, Dk, 1, dk, Dk, true)});
    // Rows: x = −R_x = e^cum∘kb, q̃ = e^cum∘q, k̃ = e^(cum_last − cum)∘k, kb = β∘k, vb = β∘v. The
    // e^cum terms reach g_s from the positions i ≥ s; k̃_i's from those before s (its exponent
    // holds g_{i+1} .. g_last), λ = e^cum_last's from all.
    float rk_before = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      const float* dRv = dR + i * Wd;
      const float* dRx = dRv + Dv;
      const float* Rx = h.R.data() + i * Wd + Dv;
      float* dkbi = dkb.data() + i * Dk;
      vec::axpy(dkbi, -h.e[i], dRx, Dk);
      vec::axpy(dq + i * Dk, h.e[i], dqd.data() + i * Dk, Dk);
      vec::axpy(dk + i * Dk, h.ek[i], dkd.data() + i * Dk, Dk);
      dcum[i] = vec::dot(dRx, Rx, Dk) + vec::dot(dqd.data() + i * Dk, h.qd.data() + i * Dk, Dk);
      dgl[i] += rk_before;
      rk_before += vec::dot(dkd.data() + i * Dk, h.kd.data() + i * Dk, Dk);
      vec::axpy(dk + i * Dk, beta[i], dkbi, Dk);
      vec::scale(dRv, beta[i], dv + i * Dv, Dv);
      gr.dbeta[s0 + i] = vec::dot(dkbi, k + i * Dk, Dk) + vec::dot(dRv, v + i * Dv, Dv);
    }
    float run = dlam * h.lam;
    for (int64_t i = n - 1; i >= 0; --i) gr.dg[s0 + i] = dgl[i] + (run += dcum[i]);
    std::swap(dS, dSn);
  }
  std::copy(dS.begin(), dS.end(), gr.dinit);
}

at::Tensor f32(const at::Tensor& t) { return t.to(at::kFloat).contiguous(); }

// The gradient of q̂ = s·x·r, r = (|x|² + eps)^-½, back to x: s·r·dq̂ − s·r³·(x·dq̂)·x, written in
// the input's dtype. x is the raw row (reloaded), dq̂ is overwritten.
void normalised_grad(const at::Tensor& raw, int64_t row, int64_t D, float r, float s, float* dn, float* x,
                     void* out) {
  vec::load(row_ptr(raw, row, D), raw.scalar_type(), x, D);
  const float xd = vec::dot(x, dn, D);
  vec::scale(dn, s * r, dn, D);
  vec::axpy(dn, -s * r * r * r * xd, x, D);
  vec::store(dn, out, raw.scalar_type(), D);
}

}  // namespace

DeltaRuleFwd delta_rule_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& init_in, int64_t chunk, double scale) {
  const Inputs in{q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), scale};
  const at::Tensor init = f32(init_in);
  const Geo G = geometry(q, v, chunk);
  const auto opt = q.options().dtype(at::kFloat);
  DeltaRuleFwd r;
  r.out = new_output({G.B, G.S, G.N, G.Dv}, opt);
  r.final = new_output({G.B, G.N, G.Dk, G.Dv}, opt);
  r.states = new_output({G.B, G.N, G.nc, G.Dk, G.Dv}, opt);
  if (G.S == 0) {
    r.final.copy_(init);
    return r;
  }
  const int64_t DD = G.Dk * G.Dv;
  at::parallel_for(0, G.B * G.N, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    thread_local UnitRows rows;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / G.N, h = i % G.N;
      const Unit u = gather(G, in, b, h, rows);
      forward_unit(G, u, init.const_data_ptr<float>() + i * DD,
                   r.out.data_ptr<float>() + (b * G.S * G.N + h) * G.Dv, G.N * G.Dv,
                   r.states.data_ptr<float>() + i * G.nc * DD, r.final.data_ptr<float>() + i * DD);
    }
  });
  return r;
}

DeltaRuleGrads delta_rule_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                              const at::Tensor& beta, const at::Tensor& states_in, const at::Tensor& dout_in,
                              const at::Tensor& dfinal_in, int64_t chunk, double scale) {
  const Inputs in{q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), scale};
  const at::Tensor states = f32(states_in);
  const at::Tensor dout = dout_in.defined() ? f32(dout_in) : at::Tensor();
  const at::Tensor dfinal = dfinal_in.defined() ? f32(dfinal_in) : at::Tensor();
  const Geo G = geometry(q, v, chunk);
  DeltaRuleGrads r;
  r.dq = new_output(q.sizes(), q.options());
  r.dk = new_output(k.sizes(), k.options());
  r.dv = new_output(v.sizes(), v.options());
  r.dg = new_output(g.sizes(), g.options());
  r.dbeta = new_output(beta.sizes(), beta.options());
  r.dinitial = new_output({G.B, G.N, G.Dk, G.Dv}, q.options().dtype(at::kFloat));
  if (G.S == 0) {
    dfinal.defined() ? r.dinitial.copy_(dfinal) : r.dinitial.zero_();
    return r;
  }
  const int64_t DD = G.Dk * G.Dv;
  at::parallel_for(0, G.B * G.N, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals ftz;
    thread_local UnitRows rows;
    thread_local std::vector<float> dO, dq, dk, dv, dg, dbeta, x;
    dq.resize(G.S * G.Dk), dk.resize(G.S * G.Dk), dv.resize(G.S * G.Dv), dg.resize(G.S), dbeta.resize(G.S);
    x.resize(std::max(G.Dk, G.Dv));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / G.N, h = i % G.N;
      const Unit u = gather(G, in, b, h, rows);
      if (dout.defined()) {
        dO.resize(G.S * G.Dv);
        for (int64_t s = 0; s < G.S; ++s) {
          std::copy_n(dout.const_data_ptr<float>() + ((b * G.S + s) * G.N + h) * G.Dv, G.Dv, dO.data() + s * G.Dv);
        }
      }
      const UnitGrads gr{dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), r.dinitial.data_ptr<float>() + i * DD};
      backward_unit(G, u, states.const_data_ptr<float>() + i * G.nc * DD, dout.defined() ? dO.data() : nullptr,
                    dfinal.defined() ? dfinal.const_data_ptr<float>() + i * DD : nullptr, gr);
      // Back to the model's layout and dtypes, through the normalisation for q and k.
      auto at_row = [](at::Tensor& t, int64_t row, int64_t width) {
        return static_cast<char*>(t.data_ptr()) + row * width * t.element_size();
      };
      for (int64_t s = 0; s < G.S; ++s) {
        const int64_t row = (b * G.S + s) * G.N + h;
        normalised_grad(in.q, row, G.Dk, rows.rq[s], static_cast<float>(scale), dq.data() + s * G.Dk, x.data(),
                        at_row(r.dq, row, G.Dk));
        normalised_grad(in.k, row, G.Dk, rows.rk[s], 1.f, dk.data() + s * G.Dk, x.data(), at_row(r.dk, row, G.Dk));
        vec::store(dv.data() + s * G.Dv, at_row(r.dv, row, G.Dv), v.scalar_type(), G.Dv);
        vec::store(&dg[s], at_row(r.dg, row, 1), g.scalar_type(), 1);
        vec::store(&dbeta[s], at_row(r.dbeta, row, 1), beta.scalar_type(), 1);
      }
    }
  });
  return r;
}

}  // namespace automoe::ops::cpu
