#include "automoe/model/deltanet_mixer.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "automoe/ops/delta_rule/delta_rule.h"

namespace automoe {

at::Tensor gated_deltanet_mixer(const GatedDeltaNetSpec& g, const DeltaNetSlots& P,
                                const NamedTensors& params, const at::Tensor& x_in,
                                const RecurrentInputs& in, const SlotLinear& linear,
                                const ComponentOps& ops) {
  auto p = [&](int64_t slot) -> const at::Tensor& { return params[slot].second; };
  const int64_t B = x_in.size(0), S = x_in.size(1);
  const int64_t Nk = g.num_k_heads, Nv = g.num_v_heads, Dk = g.head_k_dim, Dv = g.head_v_dim;
  const int64_t r = Nv / Nk, K = g.key_dim(), V = g.value_dim();
  const at::Tensor x_BSH = zero_padding(x_in, in.keep_BS);

  at::Tensor qkv_BSC, z_BSNV, b_BSN, a_BSN;
  if (g.split_projections) {  // Qwen3.5: [q | k | v], z, b, a each its own projection
    qkv_BSC = linear(x_BSH, P.in_proj_qkv, -1);
    z_BSNV = linear(x_BSH, P.in_proj_z, -1).view({B, S, Nv, Dv});
    b_BSN = linear(x_BSH, P.in_proj_b, -1);
    a_BSN = linear(x_BSH, P.in_proj_a, -1);
  } else {  // Qwen3-Next: per key head [q, k, its r value heads' v, their z]; [its r b, its r a]
    const at::Tensor qkvz = linear(x_BSH, P.in_proj_qkvz, -1).view({B, S, Nk, 2 * Dk + 2 * r * Dv});
    const at::Tensor ba = linear(x_BSH, P.in_proj_ba, -1).view({B, S, Nk, 2 * r});
    qkv_BSC = at::cat({qkvz.narrow(3, 0, Dk).reshape({B, S, K}), qkvz.narrow(3, Dk, Dk).reshape({B, S, K}),
                       qkvz.narrow(3, 2 * Dk, r * Dv).reshape({B, S, V})},
                      2);
    z_BSNV = qkvz.narrow(3, 2 * Dk + r * Dv, r * Dv).reshape({B, S, Nv, Dv});
    b_BSN = ba.narrow(3, 0, r).reshape({B, S, Nv});
    a_BSN = ba.narrow(3, r, r).reshape({B, S, Nv});
  }

  KVCache::Recurrent* state = in.cache ? &in.cache->recurrent(in.layer) : nullptr;
  const bool continues = state && state->ssm.defined();
  const at::Tensor conv = causal_conv_cached(qkv_BSC, p(P.conv).squeeze(1), std::nullopt, state, in, ops);
  at::Tensor q = conv.narrow(2, 0, K).reshape({B, S, Nk, Dk});
  at::Tensor k = conv.narrow(2, K, K).reshape({B, S, Nk, Dk});
  const at::Tensor v = conv.narrow(2, 2 * K, V).reshape({B, S, Nv, Dv});
  const at::Tensor beta = at::sigmoid(b_BSN);
  const at::Tensor decay =
      -at::exp(p(P.a_log).to(at::kFloat)) * at::softplus(a_BSN.to(at::kFloat) + p(P.dt_bias));
  if (r > 1) {  // each key head serves its r value heads
    q = q.repeat_interleave(r, 2);
    k = k.repeat_interleave(r, 2);
  }

  at::Tensor o_BSNV;
  if (continues && S == 1) {  // one token after a cached state: the recurrent step
    at::NoGradGuard no_grad;
    o_BSNV = ops::gated_delta_rule_step_reference(state->ssm, q.select(1, 0), k.select(1, 0),
                                                  v.select(1, 0), decay.select(1, 0), beta.select(1, 0))
                 .unsqueeze(1);
  } else {
    const ops::DeltaRule d = ops.delta_rule(
        q, k, v, decay, beta, g.chunk_size,
        continues ? std::optional<at::Tensor>(state->ssm) : std::nullopt, state ? std::nullopt : in.doc_BS,
        state != nullptr);
    if (state) state->ssm = d.final_BNKV.detach();
    o_BSNV = d.o_BSNV;
  }
  if (in.cache) in.cache->advance(in.layer, S);
  // Qwen3NextRMSNormGated: weight * rmsnorm(o) in o's dtype, times silu(z) in float32, back to o's dtype.
  const at::Tensor normed = ops.rms_norm(o_BSNV, p(P.norm), g.norm_eps);
  const at::Tensor y = (normed * at::silu(z_BSNV.to(at::kFloat))).to(o_BSNV.scalar_type());
  return linear(y.reshape({B, S, V}).to(x_in.scalar_type()), P.out_proj, -1);
}

}  // namespace automoe
