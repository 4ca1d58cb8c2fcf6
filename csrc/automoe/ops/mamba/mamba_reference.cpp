#include <ATen/ATen.h>

#include "automoe/core/error.h"
#include "automoe/ops/mamba/mamba.h"

namespace automoe::ops {
namespace {

// segsum(a)[..., i, j] = a[j+1] + ... + a[i] for i >= j, -inf above the diagonal (Transformers'
// segment_sum: masked cumulative sums, not differences of one cumsum, for stability).
at::Tensor segment_sum(const at::Tensor& a) {
  const int64_t Q = a.size(-1);
  std::vector<int64_t> expanded(a.sizes().begin(), a.sizes().end());
  expanded.push_back(Q);
  const auto bool_opts = at::TensorOptions().dtype(at::kBool).device(a.device());
  const at::Tensor below = at::ones({Q, Q}, bool_opts).tril(-1);
  const at::Tensor sums = a.unsqueeze(-1).expand(expanded).masked_fill(below.logical_not(), 0).cumsum(-2);
  return sums.masked_fill(at::ones({Q, Q}, bool_opts).tril(0).logical_not(),
                          -std::numeric_limits<double>::infinity());
}

// Pads dim 1 of x with `pad` zeros at the end.
at::Tensor pad_seq(const at::Tensor& x, int64_t pad) {
  if (pad == 0) return x;
  std::vector<int64_t> p(2 * (x.dim() - 2), 0);  // (last dims first: nothing until dim 1)
  p.push_back(0);
  p.push_back(pad);
  return at::constant_pad_nd(x, p, 0);
}

// The dtype the scan and the norm compute in: float32 (Transformers' upcast), float64 kept (tests).
c10::ScalarType acc(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace

at::Tensor causal_conv1d_reference(const at::Tensor& x_BSC, const at::Tensor& w_CK,
                                   const std::optional<at::Tensor>& bias_C,
                                   const std::optional<at::Tensor>& doc_BS, bool silu) {
  AUTOMOE_CHECK(x_BSC.dim() == 3 && w_CK.dim() == 2 && w_CK.size(0) == x_BSC.size(2),
                "causal_conv1d: expected x [B, S, C] and w [C, K], got ", x_BSC.sizes(), " and ",
                w_CK.sizes());
  const int64_t C = x_BSC.size(2), S = x_BSC.size(1), K = w_CK.size(1);
  const at::Tensor x = x_BSC.transpose(1, 2).to(w_CK.scalar_type());  // [B, C, S]
  at::Tensor out;
  if (!doc_BS) {  // Transformers' causal_conv1d_fn
    out = at::conv1d(x, w_CK.unsqueeze(1), bias_C ? *bias_C : at::Tensor(), 1, K - 1, 1, C).narrow(2, 0, S);
  } else {
    // Each output's K taps, those of another document zeroed.
    const at::Tensor taps_BCSK = at::constant_pad_nd(x, {K - 1, 0}, 0).unfold(2, K, 1);
    const at::Tensor doc = doc_BS->to(at::kLong);
    const at::Tensor doc_taps_BSK =
        at::constant_pad_nd(doc, {K - 1, 0}, std::numeric_limits<int64_t>::min()).unfold(1, K, 1);
    const at::Tensor same_B1SK = doc_taps_BSK.eq(doc.unsqueeze(-1)).unsqueeze(1).to(x.scalar_type());
    out = (taps_BCSK * same_B1SK * w_CK.view({1, C, 1, K})).sum(-1);
    if (bias_C) out = out + bias_C->view({1, C, 1});
  }
  out = out.to(x_BSC.scalar_type()).transpose(1, 2);
  return silu ? at::silu(out) : out;
}

SsdScan ssd_scan_reference(const at::Tensor& x_BSHP, const at::Tensor& dt_BSH,
                           const at::Tensor& A_H, const at::Tensor& B_BSGN,
                           const at::Tensor& C_BSGN, const at::Tensor& D_H, int64_t chunk,
                           const std::optional<at::Tensor>& initial_BHPN,
                           const std::optional<at::Tensor>& doc_BS, bool final_state) {
  AUTOMOE_CHECK(x_BSHP.dim() == 4 && B_BSGN.dim() == 4 && C_BSGN.sizes() == B_BSGN.sizes() &&
                    dt_BSH.dim() == 3 && x_BSHP.size(2) % B_BSGN.size(2) == 0 && chunk > 0,
                "ssd_scan: expected x [B, S, H, P], dt [B, S, H], B and C [B, S, G, N] with G dividing "
                "H; got x ", x_BSHP.sizes(), ", dt ", dt_BSH.sizes(), ", B ", B_BSGN.sizes(), ", C ",
                C_BSGN.sizes());
  const int64_t Bn = x_BSHP.size(0), S = x_BSHP.size(1), H = x_BSHP.size(2), P = x_BSHP.size(3);
  const int64_t G = B_BSGN.size(2), N = B_BSGN.size(3), Q = chunk;
  const c10::ScalarType A_t = acc(x_BSHP);
  const int64_t pad = (Q - S % Q) % Q, T = S + pad, nc = T / Q;
  const at::Tensor xf = x_BSHP.to(A_t);
  const at::Tensor dt = dt_BSH.to(A_t);
  const at::Tensor Bm = B_BSGN.to(A_t).repeat_interleave(H / G, 2);
  const at::Tensor Cm = C_BSGN.to(A_t).repeat_interleave(H / G, 2);
  const at::Tensor D_residual = D_H.view({H, 1}) * xf;
  const at::Tensor xdt = xf * dt.unsqueeze(-1);
  const at::Tensor Adt = A_H.to(A_t) * dt;  // [B, S, H]

  const at::Tensor xc = pad_seq(xdt, pad).view({Bn, nc, Q, H, P});
  const at::Tensor Bc = pad_seq(Bm, pad).view({Bn, nc, Q, H, N});
  const at::Tensor Cc = pad_seq(Cm, pad).view({Bn, nc, Q, H, N});
  const at::Tensor Ac = pad_seq(Adt, pad).view({Bn, nc, Q, H}).permute({0, 3, 1, 2});  // [B,H,c,Q]
  const at::Tensor Acum = Ac.cumsum(-1);

  // Packed documents: which pairs of positions (within a chunk, and across chunk boundaries) share
  // a document; every cross-document term of the recurrence is dropped.
  std::optional<at::Tensor> same_cls, local_cl, ends_zc, read_cl;
  if (doc_BS) {
    at::Tensor doc = doc_BS->to(at::kLong);
    if (pad) doc = at::cat({doc, doc.narrow(1, S - 1, 1).expand({Bn, pad})}, 1);
    const at::Tensor dc = doc.view({Bn, nc, Q});
    same_cls = dc.unsqueeze(-1).eq(dc.unsqueeze(-2)).to(A_t);               // [B,c,l,s]
    const at::Tensor end = dc.select(2, Q - 1);                                    // [B,c]
    local_cl = dc.eq(end.unsqueeze(-1)).to(A_t);                            // [B,c,s]
    const at::Tensor ends = at::cat({dc.select(2, 0).narrow(1, 0, 1), end}, 1);   // [B,c+1]
    ends_zc = ends.unsqueeze(-1).eq(ends.unsqueeze(-2)).to(A_t);            // [B,z,c]
    read_cl = dc.eq(ends.narrow(1, 0, nc).unsqueeze(-1)).to(A_t);           // [B,c,l]
  }

  // Within each chunk: y_l = sum_{s <= l} (C_l · B_s) exp(A_s+1 + ... + A_l) x_s dt_s.
  const at::Tensor L = at::exp(segment_sum(Ac));                                   // [B,H,c,l,s]
  at::Tensor M = at::einsum("bclhn,bcshn->bclsh", {Cc, Bc}) * L.permute({0, 2, 3, 4, 1});
  if (same_cls) M = M * same_cls->unsqueeze(-1);
  const at::Tensor y_diag = at::einsum("bclsh,bcshp->bclhp", {M, xc});

  // Each chunk's own contribution to the state at its end.
  const at::Tensor decay_states = at::exp(Acum.narrow(3, Q - 1, 1) - Acum);       // [B,H,c,Q]
  at::Tensor B_decay = Bc * decay_states.permute({0, 2, 3, 1}).unsqueeze(-1);
  if (local_cl) B_decay = B_decay * local_cl->view({Bn, nc, Q, 1, 1});
  at::Tensor states = at::einsum("bclhn,bclhp->bchpn", {B_decay, xc});
  const at::Tensor previous = initial_BHPN ? initial_BHPN->to(A_t).unsqueeze(1)
                                           : at::zeros_like(states.narrow(1, 0, 1));
  states = at::cat({previous, states}, 1);                                        // [B,c+1,H,P,N]

  // The states at every chunk boundary, carried across chunks.
  at::Tensor decay_chunk =
      at::exp(segment_sum(at::constant_pad_nd(Acum.select(3, Q - 1), {1, 0}, 0)));  // [B,H,z,c]
  if (ends_zc) decay_chunk = decay_chunk * ends_zc->unsqueeze(1);
  const at::Tensor new_states = at::einsum("bhzc,bchpn->bzhpn", {decay_chunk, states});

  // What each position reads of the state its chunk started from.
  at::Tensor y_off = at::einsum("bclhn,bchpn->bclhp", {Cc, new_states.narrow(1, 0, nc)}) *
                     at::exp(Acum).permute({0, 2, 3, 1}).unsqueeze(-1);
  if (read_cl) y_off = y_off * read_cl->view({Bn, nc, Q, 1, 1});

  SsdScan out;
  out.y_BSHP = (y_diag + y_off).reshape({Bn, T, H, P}).narrow(1, 0, S) + D_residual;
  if (final_state) out.final_BHPN = new_states.select(1, nc);
  return out;
}

SsdScan ssd_scan_aten(const at::Tensor& x_BSHP, const at::Tensor& dt_BSH, const at::Tensor& A_H,
                 const at::Tensor& B_BSGN, const at::Tensor& C_BSGN, const at::Tensor& D_H, int64_t chunk,
                 const std::optional<at::Tensor>& initial_BHPN, const std::optional<at::Tensor>& doc_BS,
                 bool final_state) {
  AUTOMOE_CHECK(x_BSHP.dim() == 4 && B_BSGN.dim() == 4 && C_BSGN.sizes() == B_BSGN.sizes() &&
                    dt_BSH.dim() == 3 && x_BSHP.size(2) % B_BSGN.size(2) == 0 && chunk > 0,
                "ssd_scan: expected x [B, S, H, P], dt [B, S, H], B and C [B, S, G, N] with G dividing "
                "H; got x ", x_BSHP.sizes(), ", dt ", dt_BSH.sizes(), ", B ", B_BSGN.sizes(), ", C ",
                C_BSGN.sizes());
  const int64_t Bn = x_BSHP.size(0), S = x_BSHP.size(1), H = x_BSHP.size(2), P = x_BSHP.size(3);
  const int64_t G = B_BSGN.size(2), N = B_BSGN.size(3), Q = chunk, Hg = H / G;
  const int64_t pad = (Q - S % Q) % Q, T = S + pad, nc = T / Q;
  const c10::ScalarType A_t = acc(x_BSHP);
  const at::Tensor xf = x_BSHP.to(A_t);
  const at::Tensor dt = dt_BSH.to(A_t);
  // x·dt as [B, G, Hg, c, Q, P]; B and C as [B, G, c, Q, N] (one per group, not per head).
  const at::Tensor X = pad_seq(xf * dt.unsqueeze(-1), pad)
                           .view({Bn, nc, Q, G, Hg, P})
                           .permute({0, 3, 4, 1, 2, 5})
                           .contiguous();
  auto groups = [&](const at::Tensor& t_BSGN) {
    return pad_seq(t_BSGN.to(A_t), pad).view({Bn, nc, Q, G, N}).permute({0, 3, 1, 2, 4}).contiguous();
  };
  const at::Tensor Bg = groups(B_BSGN), Cg = groups(C_BSGN);
  const at::Tensor Ac = pad_seq(A_H.to(A_t) * dt, pad).view({Bn, nc, Q, H}).permute({0, 3, 1, 2});
  const at::Tensor Acum = Ac.cumsum(-1);                                        // [B,H,c,Q]
  auto per_group = [&](const at::Tensor& t_BHX) {  // [B, H, ...] -> [B, G, Hg, ...]
    std::vector<int64_t> shape{Bn, G, Hg};
    shape.insert(shape.end(), t_BHX.sizes().begin() + 2, t_BHX.sizes().end());
    return t_BHX.reshape(shape);
  };
  // [B, G, Hg, c, R, P] <-> [B, G, c, R, Hg * P]: a group's heads side by side as one wide matrix.
  auto wide = [&](const at::Tensor& t) {
    return t.permute({0, 1, 3, 4, 2, 5}).reshape({Bn, G, t.size(3), t.size(4), Hg * P});
  };
  auto unwide = [&](const at::Tensor& t) {
    return t.view({Bn, G, t.size(2), t.size(3), Hg, P}).permute({0, 1, 4, 2, 3, 5});
  };

  std::optional<at::Tensor> same_cls, local_cl, ends_zc, read_cl;  // as in the reference
  if (doc_BS) {
    at::Tensor doc = doc_BS->to(at::kLong);
    if (pad) doc = at::cat({doc, doc.narrow(1, S - 1, 1).expand({Bn, pad})}, 1);
    const at::Tensor dc = doc.view({Bn, 1, 1, nc, Q});
    same_cls = dc.unsqueeze(-1).eq(dc.unsqueeze(-2)).to(A_t);                     // [B,1,1,c,l,s]
    const at::Tensor end = dc.select(4, Q - 1);                                   // [B,1,1,c]
    local_cl = dc.eq(end.unsqueeze(-1)).to(A_t).unsqueeze(-1);                    // [B,1,1,c,s,1]
    const at::Tensor ends = at::cat({dc.select(4, 0).narrow(3, 0, 1), end}, 3);  // [B,1,1,c+1]
    ends_zc = ends.squeeze(2).unsqueeze(-1).eq(ends.squeeze(2).unsqueeze(-2)).to(A_t);  // [B,1,z,c]
    read_cl = dc.eq(ends.narrow(3, 0, nc).unsqueeze(-1)).to(A_t).unsqueeze(-1);  // [B,1,1,c,l,1]
  }

  // Within each chunk: (C·Bᵀ, once per group, ∘ each head's decays) · x. The decay from s to l is
  // exp(Acum_l - Acum_s) (l >= s), differences of the chunk's cumulative sum as the Mamba-2 kernels
  // take them (the reference's masked cumulative sums cost five passes and a flipped cumsum in the
  // backward over [B, H, c, Q, Q]).
  const auto bool_opts = at::TensorOptions().dtype(at::kBool).device(Acum.device());
  const at::Tensor above = at::ones({Q, Q}, bool_opts).triu(1);
  const at::Tensor decay_ls =
      at::exp((Acum.unsqueeze(-1) - Acum.unsqueeze(-2)).masked_fill(above, -std::numeric_limits<double>::infinity()));
  at::Tensor M = at::matmul(Cg, Bg.transpose(-1, -2)).unsqueeze(2) * per_group(decay_ls);
  if (same_cls) M = M * *same_cls;
  const at::Tensor y_diag = at::matmul(M, X);                                   // [B,G,Hg,c,Q,P]
  // Each chunk's own state at its end: Bᵀ · (x ∘ decay to the end), all heads of a group at once.
  at::Tensor Xd = X * per_group(at::exp(Acum.narrow(3, Q - 1, 1) - Acum)).unsqueeze(-1);
  if (local_cl) Xd = Xd * *local_cl;
  const at::Tensor local = unwide(at::matmul(Bg.transpose(-1, -2), wide(Xd)));  // [B,G,Hg,c,N,P]
  const at::Tensor previous = initial_BHPN
                                  ? initial_BHPN->to(A_t).transpose(-1, -2).unsqueeze(2)
                                  : at::zeros({Bn, H, 1, N, P}, X.options());
  const at::Tensor states = at::cat({previous, local.reshape({Bn, H, nc, N, P})}, 2);  // [B,H,c+1,N,P]
  // Carried across chunks: [B,H,z,c] · [B,H,c,N*P].
  at::Tensor decay_chunk = at::exp(segment_sum(at::constant_pad_nd(Acum.select(3, Q - 1), {1, 0}, 0)));
  if (ends_zc) decay_chunk = decay_chunk * *ends_zc;
  const at::Tensor carried = at::matmul(decay_chunk, states.flatten(3)).view({Bn, H, nc + 1, N, P});
  // What each position reads of its chunk's starting state: C · state, a group's heads at once.
  at::Tensor y_off = unwide(at::matmul(Cg, wide(per_group(carried.narrow(2, 0, nc))))) *
                     per_group(at::exp(Acum)).unsqueeze(-1);
  if (read_cl) y_off = y_off * *read_cl;
  SsdScan out;
  out.y_BSHP = (y_diag + y_off).permute({0, 3, 4, 1, 2, 5}).reshape({Bn, T, H, P}).narrow(1, 0, S) +
               D_H.view({H, 1}) * xf;
  if (final_state) out.final_BHPN = carried.select(2, nc).transpose(-1, -2);
  return out;
}

at::Tensor ssd_step_reference(at::Tensor& state_BHPN, const at::Tensor& x_BHP, const at::Tensor& dt_BH,
                              const at::Tensor& dt_bias_H, const at::Tensor& A_H,
                              const at::Tensor& B_BGN, const at::Tensor& C_BGN, const at::Tensor& D_H) {
  const int64_t H = x_BHP.size(1), G = B_BGN.size(1);
  const c10::ScalarType A_t = acc(x_BHP);
  const at::Tensor dt = at::softplus(dt_BH + dt_bias_H.to(dt_BH.scalar_type())).unsqueeze(-1);  // [B,H,1]
  const at::Tensor dA = at::exp(dt.to(A_t).unsqueeze(-1) * A_H.to(A_t).view({1, H, 1, 1}));
  const at::Tensor Bh = B_BGN.repeat_interleave(H / G, 1).unsqueeze(2);   // [B,H,1,N]
  const at::Tensor Ch = C_BGN.repeat_interleave(H / G, 1);                // [B,H,N]
  const at::Tensor dBx = dt.unsqueeze(-1) * Bh * x_BHP.unsqueeze(-1);     // [B,H,P,N]
  const at::Tensor next = state_BHPN * dA + dBx;
  state_BHPN.copy_(next.to(state_BHPN.scalar_type()));
  at::Tensor y = at::matmul(next.to(Ch.scalar_type()), Ch.unsqueeze(-1)).squeeze(-1);  // [B,H,P]
  y = y + x_BHP * D_H.view({H, 1});
  return y.to(x_BHP.scalar_type());
}

at::Tensor gated_rms_norm_reference(const at::Tensor& y, const at::Tensor& z, const at::Tensor& weight,
                                    int64_t group_size, double eps) {
  const int64_t width = y.size(-1);
  const c10::ScalarType A_t = acc(y);
  AUTOMOE_CHECK(group_size > 0 && width % group_size == 0 && z.sizes() == y.sizes() &&
                    weight.dim() == 1 && weight.size(0) == width,
                "gated_rms_norm: expected y and z of one shape, weight [", width,
                "] and a group size dividing it; got y ", y.sizes(), ", z ", z.sizes(), ", weight ",
                weight.sizes(), ", group ", group_size);
  const at::Tensor h = y.to(A_t) * at::silu(z.to(A_t));
  std::vector<int64_t> grouped(y.sizes().begin(), y.sizes().end() - 1);
  grouped.push_back(width / group_size);
  grouped.push_back(group_size);
  const at::Tensor hg = h.view(grouped);
  const at::Tensor normed = (hg * at::rsqrt(hg.pow(2).mean(-1, true) + eps)).view(y.sizes());
  return weight * normed.to(y.scalar_type());
}

}  // namespace automoe::ops
