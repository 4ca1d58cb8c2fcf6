// The chunked gated delta rule with a hand-derived backward: on the CPU (float32 and bf16 models)
// the kernels of delta_rule_cpu.h; elsewhere (CUDA, float16) the ATen form below, whose forward
// runs the chunked (UT transform) form in ATen ops with no autograd graph and whose backward
// recomputes each chunk's quantities from the inputs (nothing of the forward is saved but them)
// and walks the state recurrence in reverse. The references are delta_rule_reference.cpp.
//
// Per (row, head) and chunk, with Γ_ij = exp(cum_i − cum_j) below the diagonal (cum the within-
// chunk cumulative log-decay), kb = β∘k, vb = β∘v, M = I + strictly_lower((kb kᵀ)∘Γ) (inverted
// explicitly, by doubling blocks):
//   U = M⁻¹ vb,  W = M⁻¹ (e^cum ∘ kb),  P = (q kᵀ)∘Γ (diagonal included),
//   q̃ = e^cum ∘ q,  k̃ = e^(cum_Q − cum) ∘ k,  λ = e^cum_Q;
//   V' = U − W S,  O = q̃ S + P V',  S ← λ S + k̃ᵀ V'.
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <limits>
#include <vector>

#include "automoe/core/error.h"
#include "automoe/ops/common.h"
#include "automoe/ops/delta_rule/delta_rule.h"
#include "automoe/ops/delta_rule/delta_rule_cpu.h"

namespace automoe::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Each chunk's quantities, batched over [B, N, c]: q, k, v, beta, g heads-first [B, N, S, ·], the
// sequence padded to c·Q with zeros.
struct Chunks {
  at::Tensor q, k, v, beta, cum;     // [B, N, c, Q, ·], cum [B, N, c, Q]
  at::Tensor gamma;                  // [B, N, c, Q, Q] lower incl. diagonal, 0 above
  at::Tensor kb, vb, x, KK, QK;      // x = e^cum ∘ kb; KK = kb·kᵀ, QK = q·kᵀ
  at::Tensor Minv, U, W, P;          // M⁻¹, U = M⁻¹ vb, W = M⁻¹ x, P = QK ∘ Γ
  at::Tensor q_dec, k_dec, lam;      // q̃, k̃, λ [B, N, c]
  int64_t c = 0, Q = 0;
};

// (I + strictly_lower(a))⁻¹ for [..., Q, Q]: the inverse of a unit-lower-triangular matrix by
// doubling diagonal blocks — [[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0], [−D⁻¹ C A⁻¹, D⁻¹]] — log2(Q) rounds
// of batched products instead of one small triangular solve per (row, head, chunk) (LAPACK's
// per-matrix calls dominated the op at small head sizes). Q is padded to a power of two with
// identity rows.
at::Tensor unit_lower_inverse(const at::Tensor& a) {
  const int64_t Q = a.size(-1);
  int64_t P = 1;
  while (P < Q) P *= 2;
  at::Tensor L = a.tril(-1);
  if (P != Q) L = at::constant_pad_nd(L, {0, P - Q, 0, P - Q}, 0);
  const int64_t Bt = L.numel() / (P * P);
  const at::Tensor Lf = L.reshape({Bt, P, P});
  at::Tensor T = at::eye(P, L.options()).expand({Bt, P, P}).contiguous();
  for (int64_t s = 1; s < P; s *= 2) {
    const int64_t n = P / (2 * s);
    auto blocks = [&](const at::Tensor& X) {  // the n diagonal blocks of size 2s: [Bt, n, 2s, 2s]
      return at::diagonal(X.view({Bt, n, 2 * s, n, 2 * s}), 0, 1, 3).permute({0, 3, 1, 2});
    };
    const at::Tensor Tb = blocks(T), Lb = blocks(Lf);
    const at::Tensor a_inv = Tb.narrow(2, 0, s).narrow(3, 0, s), d_inv = Tb.narrow(2, s, s).narrow(3, s, s);
    const at::Tensor c = Lb.narrow(2, s, s).narrow(3, 0, s);
    Tb.narrow(2, s, s).narrow(3, 0, s).copy_(-at::matmul(at::matmul(d_inv, c), a_inv));
  }
  std::vector<int64_t> shape(a.sizes().begin(), a.sizes().end());
  shape[shape.size() - 2] = shape[shape.size() - 1] = P;
  T = T.view(shape);
  return P == Q ? T : T.narrow(-2, 0, Q).narrow(-1, 0, Q);
}

at::Tensor pad_to(const at::Tensor& x, int64_t pad) {
  if (pad == 0) return x;
  return x.dim() == 4 ? at::constant_pad_nd(x, {0, 0, 0, pad}, 0) : at::constant_pad_nd(x, {0, pad}, 0);
}

Chunks prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, int64_t Q) {
  const int64_t B = q.size(0), N = q.size(1), S = q.size(2), Dk = q.size(3), Dv = v.size(3);
  const int64_t pad = (Q - S % Q) % Q, c = (S + pad) / Q;
  Chunks h;
  h.c = c;
  h.Q = Q;
  h.q = pad_to(q, pad).reshape({B, N, c, Q, Dk});
  h.k = pad_to(k, pad).reshape({B, N, c, Q, Dk});
  h.v = pad_to(v, pad).reshape({B, N, c, Q, Dv});
  h.beta = pad_to(beta, pad).reshape({B, N, c, Q});
  h.cum = pad_to(g, pad).reshape({B, N, c, Q}).cumsum(3);
  const at::Tensor upper = at::ones({Q, Q}, at::TensorOptions().dtype(at::kBool).device(q.device())).triu(1);
  h.gamma = (h.cum.unsqueeze(4) - h.cum.unsqueeze(3))
                .masked_fill(upper, -std::numeric_limits<double>::infinity())
                .exp();
  h.kb = h.k * h.beta.unsqueeze(-1);
  h.vb = h.v * h.beta.unsqueeze(-1);
  const at::Tensor e = h.cum.exp().unsqueeze(-1);
  h.x = h.kb * e;
  h.KK = at::matmul(h.kb, h.k.transpose(-1, -2));
  h.QK = at::matmul(h.q, h.k.transpose(-1, -2));
  h.Minv = unit_lower_inverse(h.KK * h.gamma);
  h.U = at::matmul(h.Minv, h.vb);
  h.W = at::matmul(h.Minv, h.x);
  h.P = h.QK * h.gamma;
  h.q_dec = h.q * e;
  h.k_dec = h.k * (h.cum.narrow(3, Q - 1, 1) - h.cum).exp().unsqueeze(-1);
  h.lam = h.cum.select(3, Q - 1).exp();
  return h;
}

// The forward's state recurrence: the state entering each chunk [B, N, c, Dk, Dv], each chunk's
// V' [B, N, c, Q, Dv], the outputs [B, N, c, Q, Dv] when asked, and the final state.
struct Walk {
  at::Tensor states, vprime, out, final;
};
Walk walk(const Chunks& h, const at::Tensor& initial, bool outputs) {
  std::vector<at::Tensor> states, vprime, outs;
  at::Tensor s = initial;
  for (int64_t i = 0; i < h.c; ++i) {
    states.push_back(s);
    const at::Tensor vp = h.U.select(2, i) - at::matmul(h.W.select(2, i), s);
    vprime.push_back(vp);
    if (outputs) outs.push_back(at::matmul(h.q_dec.select(2, i), s) + at::matmul(h.P.select(2, i), vp));
    s = s * h.lam.select(2, i).unsqueeze(-1).unsqueeze(-1) + at::matmul(h.k_dec.select(2, i).transpose(-1, -2), vp);
  }
  Walk w;
  w.states = at::stack(states, 2);
  w.vprime = at::stack(vprime, 2);
  if (outputs) w.out = at::stack(outs, 2);
  w.final = s;
  return w;
}

struct DeltaRuleFn : torch::autograd::Function<DeltaRuleFn> {
  // q (L2-normalised and scaled), k (L2-normalised) [B, N, S, Dk], v [B, N, S, Dv], g and beta
  // [B, N, S], initial [B, N, Dk, Dv]: all in the compute dtype, heads first.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                               const at::Tensor& initial, int64_t chunk) {
    const int64_t B = q.size(0), N = q.size(1), S = q.size(2), Dv = v.size(3);
    const Chunks h = prepare(q, k, v, g, beta, chunk);
    const Walk w = walk(h, initial, true);
    ctx->save_for_backward({q, k, v, g, beta, initial});
    ctx->saved_data["chunk"] = chunk;
    return {w.out.reshape({B, N, h.c * h.Q, Dv}).narrow(2, 0, S), w.final};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("chunk_gated_delta_rule");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &g = saved[3], &beta = saved[4];
    const at::Tensor& initial = saved[5];
    const int64_t B = q.size(0), N = q.size(1), S = q.size(2), Dk = q.size(3), Dv = v.size(3);
    const Chunks h = prepare(q, k, v, g, beta, ctx->saved_data["chunk"].toInt());
    const int64_t c = h.c, Q = h.Q, pad = c * Q - S;
    const Walk w = walk(h, initial, false);
    const at::Tensor dO = grads[0].defined() ? pad_to(grads[0], pad).reshape({B, N, c, Q, Dv})
                                             : at::zeros({B, N, c, Q, Dv}, v.options());
    // The state recurrence in reverse: dS' (the gradient of the state leaving each chunk) and dV'.
    at::Tensor ds = grads[1].defined() ? grads[1] : at::zeros({B, N, Dk, Dv}, v.options());
    std::vector<at::Tensor> dvp(c), ds_next(c);
    for (int64_t i = c - 1; i >= 0; --i) {
      ds_next[i] = ds;
      const at::Tensor dvi = at::matmul(h.P.select(2, i).transpose(-1, -2), dO.select(2, i)) +
                             at::matmul(h.k_dec.select(2, i), ds);
      dvp[i] = dvi;
      ds = at::matmul(h.q_dec.select(2, i).transpose(-1, -2), dO.select(2, i)) -
           at::matmul(h.W.select(2, i).transpose(-1, -2), dvi) +
           h.lam.select(2, i).unsqueeze(-1).unsqueeze(-1) * ds;
    }
    const at::Tensor dV = at::stack(dvp, 2), dSn = at::stack(ds_next, 2);
    const at::Tensor& St = w.states;  // [B, N, c, Dk, Dv]
    // O = q̃ S + P V'; S' = λ S + k̃ᵀ V'; V' = U − W S.
    const at::Tensor dq_dec = at::matmul(dO, St.transpose(-1, -2));
    const at::Tensor dk_dec = at::matmul(w.vprime, dSn.transpose(-1, -2));
    const at::Tensor dlam = (St * dSn).sum({-1, -2});
    const at::Tensor dP = at::matmul(dO, w.vprime.transpose(-1, -2));
    const at::Tensor dW = -at::matmul(dV, St.transpose(-1, -2));
    // U = M⁻¹ vb, W = M⁻¹ x (only M's strictly lower part is free).
    const at::Tensor Mit = h.Minv.transpose(-1, -2);
    const at::Tensor dvb = at::matmul(Mit, dV);
    const at::Tensor dx = at::matmul(Mit, dW);
    const at::Tensor dA = -(at::matmul(dvb, h.U.transpose(-1, -2)) + at::matmul(dx, h.W.transpose(-1, -2)))
                              .tril(-1);
    // A = (kb kᵀ)∘Γ, P = (q kᵀ)∘Γ.
    const at::Tensor dAG = dA * h.gamma, dPG = dP * h.gamma;
    at::Tensor dkb = at::matmul(dAG, h.k);
    at::Tensor dk = at::matmul(dAG.transpose(-1, -2), h.kb) + at::matmul(dPG.transpose(-1, -2), h.q);
    at::Tensor dq = at::matmul(dPG, h.k);
    const at::Tensor dGG = (dA * h.KK + dP * h.QK) * h.gamma;  // dΓ ∘ Γ
    at::Tensor dcum = dGG.sum(-1) - dGG.sum(-2);
    // x = e^cum ∘ kb, q̃ = e^cum ∘ q, k̃ = e^(cum_Q − cum) ∘ k, λ = e^cum_Q.
    const at::Tensor e = h.cum.exp().unsqueeze(-1);
    const at::Tensor ek = (h.cum.narrow(3, Q - 1, 1) - h.cum).exp().unsqueeze(-1);
    dkb = dkb + dx * e;
    dq = dq + dq_dec * e;
    dk = dk + dk_dec * ek;
    const at::Tensor rk = (dk_dec * h.k_dec).sum(-1);
    dcum = dcum + (dx * h.x).sum(-1) + (dq_dec * h.q_dec).sum(-1) - rk;
    const at::Tensor dlast = rk.sum(-1) + dlam * h.lam;
    dcum.select(3, Q - 1).add_(dlast);
    // kb = β∘k, vb = β∘v.
    dk = dk + dkb * h.beta.unsqueeze(-1);
    const at::Tensor dv = dvb * h.beta.unsqueeze(-1);
    const at::Tensor dbeta = (dkb * h.k).sum(-1) + (dvb * h.v).sum(-1);
    // cum = cumsum(g) within the chunk.
    const at::Tensor dg = dcum.flip(3).cumsum(3).flip(3);
    auto unchunk = [&](const at::Tensor& t) {
      return t.dim() == 5 ? t.reshape({B, N, c * Q, t.size(4)}).narrow(2, 0, S)
                          : t.reshape({B, N, c * Q}).narrow(2, 0, S);
    };
    return {unchunk(dq), unchunk(dk), unchunk(dv), unchunk(dg), unchunk(dbeta), ds, at::Tensor()};
  }
};

// The rule on the CPU kernels (delta_rule_cpu.h), on the model's layout [B, S, N, ·] with q and k
// as projected (the kernels normalise them): the raw inputs and the chunk-entry states saved.
struct DeltaRuleCpuFn : torch::autograd::Function<DeltaRuleCpuFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                               const at::Tensor& initial, int64_t chunk) {
    const double scale = std::pow(static_cast<double>(q.size(3)), -0.5);
    cpu::DeltaRuleFwd r = cpu::delta_rule_fwd(q, k, v, g, beta, initial, chunk, scale);
    ctx->save_for_backward({q, k, v, g, beta, r.states});
    ctx->saved_data["chunk"] = chunk;
    return {r.out, r.final};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    detail::no_double_backward("chunk_gated_delta_rule");
    const auto s = ctx->get_saved_variables();
    const double scale = std::pow(static_cast<double>(s[0].size(3)), -0.5);
    cpu::DeltaRuleGrads d = cpu::delta_rule_bwd(s[0], s[1], s[2], s[3], s[4], s[5], grads[0], grads[1],
                                                ctx->saved_data["chunk"].toInt(), scale);
    return {d.dq, d.dk, d.dv, d.dg, d.dbeta, d.dinitial, at::Tensor()};
  }
};

}  // namespace

DeltaRule chunk_gated_delta_rule(const at::Tensor& q_BSNK, const at::Tensor& k_BSNK,
                                 const at::Tensor& v_BSNV, const at::Tensor& g_BSN,
                                 const at::Tensor& beta_BSN, int64_t chunk,
                                 const std::optional<at::Tensor>& initial_BNKV,
                                 const std::optional<at::Tensor>& doc_BS, bool final_state) {
  RECORD_FUNCTION("automoe::chunk_gated_delta_rule", c10::ArrayRef<const c10::IValue>{});
  if (q_BSNK.scalar_type() == at::kDouble) {  // float64 (the tests): the reference
    return chunk_gated_delta_rule_reference(q_BSNK, k_BSNK, v_BSNV, g_BSN, beta_BSN, chunk, initial_BNKV,
                                            doc_BS, final_state);
  }
  detail::check_delta_rule_args(q_BSNK, k_BSNK, v_BSNV, g_BSN, beta_BSN, chunk, initial_BNKV, doc_BS);
  const int64_t B = q_BSNK.size(0), N = q_BSNK.size(2);
  const int64_t Dk = q_BSNK.size(3), Dv = v_BSNV.size(3);
  const auto t = q_BSNK.scalar_type();
  const auto f32 = q_BSNK.options().dtype(at::kFloat);
  DeltaRule r;
  // The CPU kernels for float32 and bf16 models, on the model's layout; elsewhere the ATen form.
  if (q_BSNK.is_cpu() && (t == at::kFloat || t == at::kBFloat16)) {
    if (!doc_BS) {
      const at::Tensor h0 = initial_BNKV ? initial_BNKV->to(at::kFloat) : at::zeros({B, N, Dk, Dv}, f32);
      const variable_list out = DeltaRuleCpuFn::apply(q_BSNK, k_BSNK, v_BSNV, g_BSN, beta_BSN, h0, chunk);
      r.o_BSNV = out[0].to(t);
      if (final_state) r.final_BNKV = out[1];
    } else {  // each (row, document) alone from a zero state (stitched heads-first, then back)
      r.o_BSNV = detail::over_documents(*doc_BS, [&](int64_t b, int64_t s0, int64_t len) {
        auto seg = [&](const at::Tensor& x) { return x.narrow(0, b, 1).narrow(1, s0, len); };
        return DeltaRuleCpuFn::apply(seg(q_BSNK), seg(k_BSNK), seg(v_BSNV), seg(g_BSN), seg(beta_BSN),
                                     at::zeros({1, N, Dk, Dv}, f32), chunk)[0]
            .transpose(1, 2);
      });
      r.o_BSNV = r.o_BSNV.transpose(1, 2).contiguous().to(t);
    }
    return r;
  }
  auto heads_first = [](const at::Tensor& x) { return x.transpose(1, 2).to(at::kFloat).contiguous(); };
  // The normalisation and the scale under ATen's autograd; the rule under its own.
  const at::Tensor q = detail::l2norm(heads_first(q_BSNK)) * std::pow(static_cast<double>(Dk), -0.5);
  const at::Tensor k = detail::l2norm(heads_first(k_BSNK));
  const at::Tensor v = heads_first(v_BSNV), g = heads_first(g_BSN), beta = heads_first(beta_BSN);
  if (!doc_BS) {
    const at::Tensor h0 = initial_BNKV ? initial_BNKV->to(at::kFloat) : at::zeros({B, N, Dk, Dv}, f32);
    const variable_list out = DeltaRuleFn::apply(q, k, v, g, beta, h0, chunk);
    r.o_BSNV = out[0];
    if (final_state) r.final_BNKV = out[1];
  } else {
    // Each (row, document) run alone from a zero state.
    r.o_BSNV = detail::over_documents(*doc_BS, [&](int64_t b, int64_t s0, int64_t len) {
      auto seg = [&](const at::Tensor& x) { return x.narrow(0, b, 1).narrow(2, s0, len); };
      return DeltaRuleFn::apply(seg(q), seg(k), seg(v), seg(g), seg(beta), at::zeros({1, N, Dk, Dv}, f32),
                                chunk)[0];
    });
  }
  r.o_BSNV = r.o_BSNV.transpose(1, 2).contiguous().to(t);
  return r;
}

}  // namespace automoe::ops
