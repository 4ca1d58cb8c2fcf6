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

namespace {

// The grouped form's tensors (ssd_scan_aten's forward, kept for its hand-derived backward), all in
// the compute dtype: x·dt as X [B, G, Hg, c, Q, P]; B and C as [B, G, c, Q, N] (one per group);
// the chunks' cumulative sums of A·dt, Acum [B, H, c, Q].
struct Grouped {
  int64_t Bn, S, H, P, G, N, Q, Hg, pad, T, nc;
  c10::ScalarType A_t;
  at::Tensor xf, dt, A, X, Bg, Cg, Acum;
  std::optional<at::Tensor> same_cls, local_cl, ends_zc, read_cl;  // document masks
  at::Tensor CB, L, M;           // C·Bᵀ [B,G,c,Q,Q]; each head's decays [B,H,c,Q,Q]; CB ∘ L
  at::Tensor ew, Xd;             // decays to the chunk's end [B,G,Hg,c,Q,1] (∘ local), X ∘ ew
  at::Tensor states, decay_chunk, carried;  // [B,H,c+1,N,P]; [B,H,c+1,c+1]; [B,H,c+1,N,P]
  at::Tensor Z, E;               // C · carried state (unwide) [B,G,Hg,c,Q,P]; exp(Acum) (∘ read)
  at::Tensor y, final_state;     // [B, S, H, P]; [B, H, P, N]

  // [B, H, ...] -> [B, G, Hg, ...]
  at::Tensor per_group(const at::Tensor& t) const {
    std::vector<int64_t> shape{Bn, G, Hg};
    shape.insert(shape.end(), t.sizes().begin() + 2, t.sizes().end());
    return t.reshape(shape);
  }
  // [B, G, Hg, c, R, P] <-> [B, G, c, R, Hg * P]: a group's heads side by side as one wide matrix.
  at::Tensor wide(const at::Tensor& t) const {
    return t.permute({0, 1, 3, 4, 2, 5}).reshape({Bn, G, t.size(3), t.size(4), Hg * P});
  }
  at::Tensor unwide(const at::Tensor& t) const {
    return t.view({Bn, G, t.size(2), t.size(3), Hg, P}).permute({0, 1, 4, 2, 3, 5});
  }
  // [B, G, Hg, c, Q, P] -> [B, S, H, P] (the padding dropped), and back (padded).
  at::Tensor to_seq(const at::Tensor& t) const {
    return t.permute({0, 3, 4, 1, 2, 5}).reshape({Bn, T, H, P}).narrow(1, 0, S);
  }
  at::Tensor from_seq(const at::Tensor& t_BSHP) const {
    return pad_seq(t_BSHP, pad).view({Bn, nc, Q, G, Hg, P}).permute({0, 3, 4, 1, 2, 5});
  }
  // [B, S, G, N] <-> [B, G, c, Q, N]
  at::Tensor groups(const at::Tensor& t_BSGN) const {
    return pad_seq(t_BSGN.to(A_t), pad).view({Bn, nc, Q, G, N}).permute({0, 3, 1, 2, 4}).contiguous();
  }
  at::Tensor ungroup(const at::Tensor& t) const {
    return t.permute({0, 2, 3, 1, 4}).reshape({Bn, T, G, N}).narrow(1, 0, S);
  }
};

Grouped grouped_forward(const at::Tensor& x_BSHP, const at::Tensor& dt_BSH, const at::Tensor& A_H,
                        const at::Tensor& B_BSGN, const at::Tensor& C_BSGN, const at::Tensor& D_H, int64_t chunk,
                        const std::optional<at::Tensor>& initial_BHPN, const std::optional<at::Tensor>& doc_BS,
                        bool final_state) {
  AUTOMOE_CHECK(x_BSHP.dim() == 4 && B_BSGN.dim() == 4 && C_BSGN.sizes() == B_BSGN.sizes() &&
                    dt_BSH.dim() == 3 && x_BSHP.size(2) % B_BSGN.size(2) == 0 && chunk > 0,
                "ssd_scan: expected x [B, S, H, P], dt [B, S, H], B and C [B, S, G, N] with G dividing "
                "H; got x ", x_BSHP.sizes(), ", dt ", dt_BSH.sizes(), ", B ", B_BSGN.sizes(), ", C ",
                C_BSGN.sizes());
  Grouped g;
  g.Bn = x_BSHP.size(0), g.S = x_BSHP.size(1), g.H = x_BSHP.size(2), g.P = x_BSHP.size(3);
  g.G = B_BSGN.size(2), g.N = B_BSGN.size(3), g.Q = chunk, g.Hg = g.H / g.G;
  g.pad = (g.Q - g.S % g.Q) % g.Q, g.T = g.S + g.pad, g.nc = g.T / g.Q;
  const int64_t Bn = g.Bn, H = g.H, N = g.N, P = g.P, Q = g.Q, nc = g.nc;
  g.A_t = acc(x_BSHP);
  const c10::ScalarType A_t = g.A_t;
  g.xf = x_BSHP.to(A_t);
  g.dt = dt_BSH.to(A_t);
  g.A = A_H.to(A_t);
  g.X = g.from_seq(g.xf * g.dt.unsqueeze(-1)).contiguous();
  g.Bg = g.groups(B_BSGN), g.Cg = g.groups(C_BSGN);
  const at::Tensor Ac = pad_seq(g.A * g.dt, g.pad).view({Bn, nc, Q, H}).permute({0, 3, 1, 2});
  g.Acum = Ac.cumsum(-1);  // [B,H,c,Q]
  if (doc_BS) {
    at::Tensor doc = doc_BS->to(at::kLong);
    if (g.pad) doc = at::cat({doc, doc.narrow(1, g.S - 1, 1).expand({Bn, g.pad})}, 1);
    const at::Tensor dc = doc.view({Bn, 1, 1, nc, Q});
    g.same_cls = dc.unsqueeze(-1).eq(dc.unsqueeze(-2)).to(A_t);                     // [B,1,1,c,l,s]
    const at::Tensor end = dc.select(4, Q - 1);                                     // [B,1,1,c]
    g.local_cl = dc.eq(end.unsqueeze(-1)).to(A_t).unsqueeze(-1);                    // [B,1,1,c,s,1]
    const at::Tensor ends = at::cat({dc.select(4, 0).narrow(3, 0, 1), end}, 3);    // [B,1,1,c+1]
    g.ends_zc = ends.squeeze(2).unsqueeze(-1).eq(ends.squeeze(2).unsqueeze(-2)).to(A_t);  // [B,1,z,c]
    g.read_cl = dc.eq(ends.narrow(3, 0, nc).unsqueeze(-1)).to(A_t).unsqueeze(-1);  // [B,1,1,c,l,1]
  }
  // Within each chunk: (C·Bᵀ, once per group, ∘ each head's decays) · x. The decay from s to l is
  // exp(Acum_l - Acum_s) (l >= s), differences of the chunk's cumulative sum as the Mamba-2 kernels
  // take them (the reference's masked cumulative sums cost five passes and a flipped cumsum in the
  // backward over [B, H, c, Q, Q]).
  const auto bool_opts = at::TensorOptions().dtype(at::kBool).device(g.Acum.device());
  const at::Tensor above = at::ones({Q, Q}, bool_opts).triu(1);
  g.L = at::exp((g.Acum.unsqueeze(-1) - g.Acum.unsqueeze(-2)).masked_fill(above, -std::numeric_limits<double>::infinity()));
  g.CB = at::matmul(g.Cg, g.Bg.transpose(-1, -2));
  g.M = g.CB.unsqueeze(2) * g.per_group(g.L);
  if (g.same_cls) g.M = g.M * *g.same_cls;
  const at::Tensor y_diag = at::matmul(g.M, g.X);  // [B,G,Hg,c,Q,P]
  // Each chunk's own state at its end: Bᵀ · (x ∘ decay to the end), all heads of a group at once.
  g.ew = g.per_group(at::exp(g.Acum.narrow(3, Q - 1, 1) - g.Acum)).unsqueeze(-1);
  if (g.local_cl) g.ew = g.ew * *g.local_cl;
  g.Xd = g.X * g.ew;
  const at::Tensor local = g.unwide(at::matmul(g.Bg.transpose(-1, -2), g.wide(g.Xd)));  // [B,G,Hg,c,N,P]
  const at::Tensor previous = initial_BHPN
                                  ? initial_BHPN->to(A_t).transpose(-1, -2).unsqueeze(2)
                                  : at::zeros({Bn, H, 1, N, P}, g.X.options());
  g.states = at::cat({previous, local.reshape({Bn, H, nc, N, P})}, 2);  // [B,H,c+1,N,P]
  // Carried across chunks: [B,H,z,c] · [B,H,c,N*P].
  g.decay_chunk = at::exp(segment_sum(at::constant_pad_nd(g.Acum.select(3, Q - 1), {1, 0}, 0)));
  if (g.ends_zc) g.decay_chunk = g.decay_chunk * *g.ends_zc;
  g.carried = at::matmul(g.decay_chunk, g.states.flatten(3)).view({Bn, H, nc + 1, N, P});
  // What each position reads of its chunk's starting state: C · state, a group's heads at once.
  g.Z = g.unwide(at::matmul(g.Cg, g.wide(g.per_group(g.carried.narrow(2, 0, nc)))));
  g.E = g.per_group(at::exp(g.Acum)).unsqueeze(-1);
  if (g.read_cl) g.E = g.E * *g.read_cl;
  g.y = g.to_seq(y_diag + g.Z * g.E) + D_H.view({H, 1}) * g.xf;
  if (final_state) g.final_state = g.carried.select(2, nc).transpose(-1, -2);
  return g;
}

}  // namespace

SsdScan ssd_scan_aten(const at::Tensor& x_BSHP, const at::Tensor& dt_BSH, const at::Tensor& A_H,
                      const at::Tensor& B_BSGN, const at::Tensor& C_BSGN, const at::Tensor& D_H, int64_t chunk,
                      const std::optional<at::Tensor>& initial_BHPN, const std::optional<at::Tensor>& doc_BS,
                      bool final_state) {
  const Grouped g = grouped_forward(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, D_H, chunk, initial_BHPN, doc_BS,
                                    final_state);
  SsdScan out;
  out.y_BSHP = g.y;
  if (final_state) out.final_BHPN = g.final_state;
  return out;
}

SsdGroupedGrads ssd_scan_aten_backward(const at::Tensor& x_BSHP, const at::Tensor& dt_BSH, const at::Tensor& A_H,
                                       const at::Tensor& B_BSGN, const at::Tensor& C_BSGN, const at::Tensor& D_H,
                                       int64_t chunk, const std::optional<at::Tensor>& initial_BHPN,
                                       const std::optional<at::Tensor>& doc_BS, const at::Tensor& dy_BSHP,
                                       const at::Tensor& dfinal_BHPN) {
  const Grouped g = grouped_forward(x_BSHP, dt_BSH, A_H, B_BSGN, C_BSGN, D_H, chunk, initial_BHPN, doc_BS, false);
  const int64_t Bn = g.Bn, H = g.H, N = g.N, P = g.P, Q = g.Q, nc = g.nc;
  const at::Tensor dy = dy_BSHP.defined() ? dy_BSHP.to(g.A_t) : at::zeros_like(g.xf);
  SsdGroupedGrads out;
  // y = to_seq(M·X + Z∘E) + D·x
  out.dD = (dy * g.xf).sum(at::IntArrayRef{0, 1, 3});
  at::Tensor dxf = dy * D_H.to(g.A_t).view({H, 1});
  const at::Tensor dYg = g.from_seq(dy);  // [B,G,Hg,c,Q,P]
  // y_off = Z ∘ E: Z = unwide(C · wide(carried_c)), E = exp(Acum) (∘ read)
  const at::Tensor dZ = dYg * g.E;
  at::Tensor dAcum = g.Acum.new_zeros(g.Acum.sizes());  // [B,H,c,Q]
  dAcum += ((dYg * g.Z).sum(-1) * g.E.squeeze(-1)).reshape({Bn, H, nc, Q});
  const at::Tensor carried_c = g.wide(g.per_group(g.carried.narrow(2, 0, nc)));  // [B,G,c,N,W]
  at::Tensor dCg = at::matmul(g.wide(dZ), carried_c.transpose(-1, -2));
  at::Tensor dcarried = at::zeros_like(g.carried);  // [B,H,c+1,N,P]
  dcarried.narrow(2, 0, nc).copy_(g.unwide(at::matmul(g.Cg.transpose(-1, -2), g.wide(dZ))).reshape({Bn, H, nc, N, P}));
  if (dfinal_BHPN.defined()) dcarried.select(2, nc).copy_(dfinal_BHPN.to(g.A_t).transpose(-1, -2));
  // carried = decay_chunk · states
  const at::Tensor dc_flat = dcarried.flatten(3);
  const at::Tensor dstates = at::matmul(g.decay_chunk.transpose(-1, -2), dc_flat).view(g.states.sizes());
  // decay_chunk = exp(segsum(v)) (∘ ends), v = [0, Acum_end]: segsum(v)[z, c] = v[c+1] + .. + v[z]
  const at::Tensor dseg = at::matmul(dc_flat, g.states.flatten(3).transpose(-1, -2)) * g.decay_chunk;
  {
    // dv[k] = sum over z >= k, c < k of dseg[z, c]
    const auto bool_opts = at::TensorOptions().dtype(at::kBool).device(dseg.device());
    const at::Tensor excl = at::constant_pad_nd(dseg.cumsum(-1), {1, 0}, 0).narrow(-1, 0, nc + 1);  // [.., z, k]
    const at::Tensor z_ge_k = at::ones({nc + 1, nc + 1}, bool_opts).tril(0);
    const at::Tensor dv = excl.masked_fill(z_ge_k.logical_not(), 0).sum(-2);  // [B,H,c+1]
    dAcum.select(3, Q - 1).add_(dv.narrow(2, 1, nc));
  }
  at::Tensor dinit;
  if (initial_BHPN) dinit = dstates.select(2, 0).transpose(-1, -2);
  // local = unwide(Bᵀ · wide(Xd)), Xd = X ∘ ew
  const at::Tensor dS = g.wide(g.per_group(dstates.narrow(2, 1, nc)));  // [B,G,c,N,W]
  at::Tensor dBg = at::matmul(g.wide(g.Xd), dS.transpose(-1, -2));      // [B,G,c,Q,N]
  const at::Tensor dXd = g.unwide(at::matmul(g.Bg, dS));                // [B,G,Hg,c,Q,P]
  at::Tensor dX = dXd * g.ew;
  const at::Tensor dew = ((dXd * g.X).sum(-1, true) * g.ew).squeeze(-1).reshape({Bn, H, nc, Q});
  dAcum.select(3, Q - 1).add_(dew.sum(-1));
  dAcum -= dew;
  // y_diag = M · X, M = CB ∘ L (∘ same)
  at::Tensor dM = at::matmul(dYg, g.X.transpose(-1, -2));  // [B,G,Hg,c,Q,Q]
  dX += at::matmul(g.M.transpose(-1, -2), dYg);
  if (g.same_cls) dM = dM * *g.same_cls;
  const at::Tensor dCB = (dM * g.per_group(g.L)).sum(2);                        // [B,G,c,Q,Q]
  const at::Tensor dLL = (dM * g.CB.unsqueeze(2)).reshape(g.L.sizes()) * g.L;   // [B,H,c,l,s]
  dAcum += dLL.sum(-1) - dLL.sum(-2);
  dCg += at::matmul(dCB, g.Bg);
  dBg += at::matmul(dCB.transpose(-1, -2), g.Cg);
  // Acum = cumsum(A · dt) within each chunk; X = x · dt
  const at::Tensor dAc = dAcum.flip(-1).cumsum(-1).flip(-1).permute({0, 2, 3, 1}).reshape({Bn, g.T, H})
                             .narrow(1, 0, g.S);  // [B,S,H]
  const at::Tensor dXs = g.to_seq(dX);           // [B,S,H,P]
  out.dA = (dAc * g.dt).sum(at::IntArrayRef{0, 1});
  out.ddt = dAc * g.A + (dXs * g.xf).sum(-1);
  out.dx = dxf + dXs * g.dt.unsqueeze(-1);
  out.dB = g.ungroup(dBg);
  out.dC = g.ungroup(dCg);
  out.dinitial = dinit;
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
