#include "automoe/model/mamba_mixer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "automoe/core/error.h"
#include "automoe/ops/mamba/mamba.h"

namespace automoe {

at::Tensor mamba2_mixer(const Mamba2Spec& m, const MambaSlots& P, const NamedTensors& params,
                        const at::Tensor& x_in, const RecurrentInputs& in, const SlotLinear& linear,
                        const ComponentOps& ops) {
  auto p = [&](int64_t slot) -> const at::Tensor& { return params[slot].second; };
  const int64_t B = x_in.size(0), S = x_in.size(1);
  const int64_t I = m.inner(), C = m.conv_dim(), H = m.num_heads, G = m.n_groups, N = m.state_size;
  const at::Tensor x_BSH = zero_padding(x_in, in.keep_BS);
  const at::Tensor proj = linear(x_BSH, P.in_proj, P.in_proj_bias);
  const at::Tensor gate = proj.narrow(2, 0, I);
  const at::Tensor xBC_BSC = proj.narrow(2, I, C);
  const at::Tensor dt = proj.narrow(2, I + C, H);
  const at::Tensor A = -at::exp(p(P.a_log).to(at::kFloat));
  const at::Tensor w_CK = p(P.conv).squeeze(1);
  const std::optional<at::Tensor> conv_bias =
      P.conv_bias >= 0 ? std::optional<at::Tensor>(p(P.conv_bias)) : std::nullopt;

  KVCache::Recurrent* state = in.cache ? &in.cache->recurrent(in.layer) : nullptr;
  const bool continues = state && state->ssm.defined();
  const at::Tensor conv_BSC = causal_conv_cached(xBC_BSC, w_CK, conv_bias, state, in, ops);
  const at::Tensor xBC = zero_padding(conv_BSC, in.keep_BS);
  const at::Tensor xs = xBC.narrow(2, 0, I);
  const at::Tensor Bm = xBC.narrow(2, I, G * N);
  const at::Tensor Cm = xBC.narrow(2, I + G * N, G * N);

  at::Tensor y;
  if (continues && S == 1) {  // one token after a cached state: the recurrent step
    at::NoGradGuard no_grad;
    y = ops::ssd_step_reference(state->ssm, xs.reshape({B, H, m.head_dim}), dt.reshape({B, H}),
                                p(P.dt_bias), A, Bm.reshape({B, G, N}), Cm.reshape({B, G, N}), p(P.d))
            .reshape({B, 1, I});
  } else {
    const at::Tensor dt_BSH =
        at::softplus(dt + p(P.dt_bias).to(dt.scalar_type())).clamp_min(m.dt_min);
    const ops::SsdScan r = ops::ssd_scan(
        xs.reshape({B, S, H, m.head_dim}), dt_BSH, A, Bm.reshape({B, S, G, N}),
        Cm.reshape({B, S, G, N}), p(P.d), m.chunk_size,
        continues ? std::optional<at::Tensor>(state->ssm) : std::nullopt, in.doc_BS, state != nullptr);
    if (state) state->ssm = r.final_BHPN.detach();
    y = r.y_BSHP.reshape({B, S, I});
  }
  if (in.cache) in.cache->advance(in.layer, S);
  y = ops.gated_rms_norm(y, gate, p(P.norm), I / G, m.norm_eps);
  return linear(y.to(x_in.scalar_type()), P.out_proj, P.out_proj_bias);
}

}  // namespace automoe
