#include <ATen/ATen.h>

#include <limits>
#include <vector>

#include "automoe/core/error.h"
#include "automoe/ops/delta_rule/delta_rule.h"

namespace automoe::ops {
namespace {

c10::ScalarType acc(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Transformers' torch_chunk_gated_delta_rule on [B, N, S, ·] tensors in the compute dtype.
DeltaRule chunk_rule(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                     int64_t Q, const std::optional<at::Tensor>& initial, bool final_state) {
  const int64_t B = q.size(0), N = q.size(1), S = q.size(2), Dk = q.size(3), Dv = v.size(3);
  q = detail::l2norm(q);
  k = detail::l2norm(k);
  q = q * std::pow(static_cast<double>(Dk), -0.5);
  const int64_t pad = (Q - S % Q) % Q;
  if (pad > 0) {
    q = at::constant_pad_nd(q, {0, 0, 0, pad}, 0);
    k = at::constant_pad_nd(k, {0, 0, 0, pad}, 0);
    v = at::constant_pad_nd(v, {0, 0, 0, pad}, 0);
    beta = at::constant_pad_nd(beta, {0, pad}, 0);
    g = at::constant_pad_nd(g, {0, pad}, 0);
  }
  const int64_t c = (S + pad) / Q;
  const at::Tensor v_beta = (v * beta.unsqueeze(-1)).reshape({B, N, c, Q, Dv});
  const at::Tensor k_beta = (k * beta.unsqueeze(-1)).reshape({B, N, c, Q, Dk});
  q = q.reshape({B, N, c, Q, Dk});
  k = k.reshape({B, N, c, Q, Dk});
  const at::Tensor cum = g.reshape({B, N, c, Q}).cumsum(3);
  const at::Tensor upper =
      at::ones({Q, Q}, at::TensorOptions().dtype(at::kBool).device(q.device())).triu(1);
  const at::Tensor decay = (cum.unsqueeze(4) - cum.unsqueeze(3))
                               .masked_fill(upper, -std::numeric_limits<double>::infinity())
                               .exp();
  const at::Tensor ut = at::matmul(k_beta, k.transpose(-1, -2)) * decay;
  const at::Tensor intra = at::matmul(q, k.transpose(-1, -2)) * decay;
  const at::Tensor decayed_k_beta = k_beta * cum.exp().unsqueeze(-1);
  const at::Tensor new_values = at::linalg_solve_triangular(ut, v_beta, false, true, true);
  const at::Tensor k_cumdecay = at::linalg_solve_triangular(ut, decayed_k_beta, false, true, true);
  at::Tensor state = initial ? initial->to(q.scalar_type()) : at::zeros({B, N, Dk, Dv}, q.options());
  const at::Tensor q_dec = q * cum.exp().unsqueeze(-1);
  const at::Tensor k_dec = k * (cum.narrow(3, Q - 1, 1) - cum).exp().unsqueeze(-1);
  const at::Tensor chunk_decay = cum.select(3, Q - 1).exp().unsqueeze(-1).unsqueeze(-1);
  std::vector<at::Tensor> outs;
  outs.reserve(c);
  for (int64_t i = 0; i < c; ++i) {
    const at::Tensor v_new = new_values.select(2, i) - at::matmul(k_cumdecay.select(2, i), state);
    outs.push_back(at::matmul(q_dec.select(2, i), state) + at::matmul(intra.select(2, i), v_new));
    state = state * chunk_decay.select(2, i) + at::matmul(k_dec.select(2, i).transpose(-1, -2), v_new);
  }
  DeltaRule r;
  r.o_BSNV = at::stack(outs, 2).reshape({B, N, c * Q, Dv}).narrow(2, 0, S);
  if (final_state) r.final_BNKV = state;
  return r;
}

}  // namespace

namespace detail {
at::Tensor l2norm(const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, true) + kL2normEps); }

at::Tensor over_documents(const at::Tensor& doc_BS,
                          const std::function<at::Tensor(int64_t b, int64_t s0, int64_t len)>& segment) {
  const at::Tensor doc = doc_BS.to(at::kCPU, at::kLong).contiguous();
  const auto d = doc.accessor<int64_t, 2>();
  const int64_t B = doc.size(0), S = doc.size(1);
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<at::Tensor> parts;
    for (int64_t s0 = 0; s0 < S;) {
      int64_t s1 = s0 + 1;
      while (s1 < S && d[b][s1] == d[b][s0]) ++s1;
      parts.push_back(segment(b, s0, s1 - s0));
      s0 = s1;
    }
    rows.push_back(at::cat(parts, 2));
  }
  return at::cat(rows, 0);
}

void check_delta_rule_args(const at::Tensor& q_BSNK, const at::Tensor& k_BSNK, const at::Tensor& v_BSNV,
                           const at::Tensor& g_BSN, const at::Tensor& beta_BSN, int64_t chunk,
                           const std::optional<at::Tensor>& initial_BNKV,
                           const std::optional<at::Tensor>& doc_BS) {
  AUTOMOE_CHECK(q_BSNK.dim() == 4 && k_BSNK.sizes() == q_BSNK.sizes() && v_BSNV.dim() == 4 &&
                    v_BSNV.sizes().slice(0, 3) == q_BSNK.sizes().slice(0, 3) &&
                    g_BSN.sizes() == q_BSNK.sizes().slice(0, 3) && beta_BSN.sizes() == g_BSN.sizes(),
                "gated delta rule: expected q, k [B, S, N, Dk], v [B, S, N, Dv], g and beta [B, S, N]; "
                "got q ", q_BSNK.sizes(), ", k ", k_BSNK.sizes(), ", v ", v_BSNV.sizes(), ", g ",
                g_BSN.sizes(), ", beta ", beta_BSN.sizes());
  AUTOMOE_CHECK(chunk > 0, "gated delta rule: chunk must be positive, got ", chunk);
  AUTOMOE_CHECK(!(doc_BS && initial_BNKV), "gated delta rule: packed documents start from zero "
                "states; an initial state cannot be combined with doc_BS");
  if (initial_BNKV) {
    AUTOMOE_CHECK(initial_BNKV->dim() == 4 && initial_BNKV->size(0) == q_BSNK.size(0) &&
                      initial_BNKV->size(1) == q_BSNK.size(2) && initial_BNKV->size(2) == q_BSNK.size(3) &&
                      initial_BNKV->size(3) == v_BSNV.size(3),
                  "gated delta rule: initial_state must be [B, N, Dk, Dv] = [", q_BSNK.size(0), ", ",
                  q_BSNK.size(2), ", ", q_BSNK.size(3), ", ", v_BSNV.size(3), "], got ", initial_BNKV->sizes());
  }
  if (doc_BS) {
    AUTOMOE_CHECK(doc_BS->dim() == 2 && doc_BS->size(0) == q_BSNK.size(0) && doc_BS->size(1) == q_BSNK.size(1) &&
                      !doc_BS->is_floating_point(),
                  "gated delta rule: document_ids must be integer [B, S] = [", q_BSNK.size(0), ", ",
                  q_BSNK.size(1), "], got ", doc_BS->scalar_type(), " ", doc_BS->sizes());
  }
}
}  // namespace detail

DeltaRule chunk_gated_delta_rule_reference(const at::Tensor& q_BSNK, const at::Tensor& k_BSNK,
                                           const at::Tensor& v_BSNV, const at::Tensor& g_BSN,
                                           const at::Tensor& beta_BSN, int64_t chunk,
                                           const std::optional<at::Tensor>& initial_BNKV,
                                           const std::optional<at::Tensor>& doc_BS, bool final_state) {
  detail::check_delta_rule_args(q_BSNK, k_BSNK, v_BSNV, g_BSN, beta_BSN, chunk, initial_BNKV, doc_BS);
  const c10::ScalarType t = acc(q_BSNK);
  auto heads_first = [&](const at::Tensor& x) { return x.transpose(1, 2).to(t).contiguous(); };
  const at::Tensor q = heads_first(q_BSNK), k = heads_first(k_BSNK), v = heads_first(v_BSNV);
  const at::Tensor g = heads_first(g_BSN), beta = heads_first(beta_BSN);
  DeltaRule r;
  if (!doc_BS) {
    r = chunk_rule(q, k, v, g, beta, chunk, initial_BNKV, final_state);
  } else {
    // Each (row, document) run alone from a zero state.
    r.o_BSNV = detail::over_documents(*doc_BS, [&](int64_t b, int64_t s0, int64_t len) {
      auto seg = [&](const at::Tensor& x) { return x.narrow(0, b, 1).narrow(2, s0, len); };
      return chunk_rule(seg(q), seg(k), seg(v), seg(g), seg(beta), chunk, std::nullopt, false).o_BSNV;
    });
  }
  r.o_BSNV = r.o_BSNV.transpose(1, 2).contiguous().to(q_BSNK.scalar_type());
  return r;
}

at::Tensor gated_delta_rule_step_reference(at::Tensor& state_BNKV, const at::Tensor& q_BNK,
                                           const at::Tensor& k_BNK, const at::Tensor& v_BNV,
                                           const at::Tensor& g_BN, const at::Tensor& beta_BN) {
  const c10::ScalarType t = acc(q_BNK);
  const at::Tensor q = detail::l2norm(q_BNK.to(t)) * std::pow(static_cast<double>(q_BNK.size(-1)), -0.5);
  const at::Tensor k = detail::l2norm(k_BNK.to(t));
  at::Tensor s = state_BNKV.to(t) * g_BN.to(t).exp().unsqueeze(-1).unsqueeze(-1);
  const at::Tensor kv_mem = (s * k.unsqueeze(-1)).sum(-2);
  const at::Tensor delta = (v_BNV.to(t) - kv_mem) * beta_BN.to(t).unsqueeze(-1);
  s = s + k.unsqueeze(-1) * delta.unsqueeze(-2);
  state_BNKV = s;
  return (s * q.unsqueeze(-1)).sum(-2).to(q_BNK.scalar_type());
}

}  // namespace automoe::ops
