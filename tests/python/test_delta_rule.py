"""The gated delta rule (Qwen3-Next / Qwen3.5's gated DeltaNet): the chunked reference equals
Transformers' torch_chunk_gated_delta_rule (outputs and final state, from zero and from an initial
state), equals the token-by-token recurrence its one-token step runs (float64: the chunked UT
transform is the recurrence, for chunks that do and do not divide the sequence), restarts at packed
document boundaries exactly as documents run alone, and its gradients pass gradcheck."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from test_ops import documents

OPS = torch.ops.automoe


def inputs(g, B, S, N, Dk, Dv, dtype=torch.float64):
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    q, k, v = r(B, S, N, Dk), r(B, S, N, Dk), r(B, S, N, Dv)
    decay = (-torch.rand(B, S, N, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    beta = torch.rand(B, S, N, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, decay, beta


def recurrence(q, k, v, decay, beta, state):
    outs = []
    for t in range(q.shape[1]):
        o, state = OPS.gated_delta_rule_step_reference(state, q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t])
        outs.append(o)
    return torch.stack(outs, 1), state


@pytest.mark.parametrize("B,S,N,Dk,Dv,chunk,initial", [(1, 1, 2, 3, 4, 4, False), (2, 13, 3, 5, 4, 4, True),
                                                       (1, 150, 2, 8, 6, 64, True), (2, 16, 1, 4, 4, 8, False)])
def test_chunked_rule_is_the_recurrence(B, S, N, Dk, Dv, chunk, initial):
    g = torch.Generator().manual_seed(S)
    q, k, v, decay, beta = inputs(g, B, S, N, Dk, Dv)
    h0 = torch.randn(B, N, Dk, Dv, generator=g, dtype=torch.float64) if initial else None
    o, final = OPS.chunk_gated_delta_rule_reference(q, k, v, decay, beta, chunk, h0)
    want, want_final = recurrence(q, k, v, decay, beta, h0 if initial else torch.zeros(B, N, Dk, Dv, dtype=torch.float64))
    assert rel_err(o, want) <= 1e-10 and rel_err(final, want_final) <= 1e-10


@pytest.mark.parametrize("S,initial", [(40, False), (130, True)])
def test_chunked_rule_matches_transformers(S, initial):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    g = torch.Generator().manual_seed(7)
    q, k, v, decay, beta = inputs(g, 2, S, 4, 16, 8, torch.float32)
    h0 = torch.randn(2, 4, 16, 8, generator=g) if initial else None
    want, want_final = torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta, initial_state=h0,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, final = OPS.chunk_gated_delta_rule_reference(q, k, v, decay, beta, 64, h0)
    assert rel_err(o, want) <= 1e-6 and rel_err(final, want_final) <= 1e-6


def test_packed_documents_run_as_if_alone():
    g = torch.Generator().manual_seed(3)
    B, S, N, Dk, Dv = 2, 37, 2, 4, 3
    q, k, v, decay, beta = inputs(g, B, S, N, Dk, Dv)
    doc = documents(g, B, S)
    o, _ = OPS.chunk_gated_delta_rule_reference(q, k, v, decay, beta, 8, None, doc)
    for b in range(B):
        for d in doc[b].unique():
            at = (doc[b] == d).nonzero().squeeze(1)
            s = slice(int(at[0]), int(at[-1]) + 1)
            alone, _ = OPS.chunk_gated_delta_rule_reference(*(x[b:b + 1, s] for x in (q, k, v, decay, beta)), 8)
            assert torch.equal(o[b:b + 1, s], alone), (b, int(d))


def test_gradients_pass_gradcheck():
    g = torch.Generator().manual_seed(5)
    ins = [x.requires_grad_() for x in inputs(g, 1, 7, 2, 3, 2)]
    h0 = torch.randn(1, 2, 3, 2, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, a, b, h: OPS.chunk_gated_delta_rule_reference(q, k, v, a, b, 4, h), (*ins, h0))


def test_the_aten_form_cuda_runs_matches_the_reference():
    """On the CPU float32 and bf16 run the CPU kernels; float16 runs the ATen form (what CUDA runs):
    outputs and gradients against the float64 reference on the same float16-rounded inputs."""
    g = torch.Generator().manual_seed(11)
    base = [x.half() for x in inputs(g, 2, 70, 3, 8, 4)]
    h0 = torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64)
    ours = [x.clone().requires_grad_() for x in base]
    ref = [x.double().requires_grad_() for x in base]
    o, final = OPS.chunk_gated_delta_rule(*ours, 16, h0.float())
    o_ref, final_ref = OPS.chunk_gated_delta_rule_reference(*ref, 16, h0)
    assert o.dtype == torch.float16
    assert rel_err(o.double(), o_ref) <= 2e-3 and rel_err(final.double(), final_ref) <= 1e-5
    u = torch.randn(o.shape, generator=g, dtype=torch.float64)
    (o.float() * u.float()).sum().backward()
    (o_ref * u).sum().backward()
    for a, b in zip(ours, ref):
        assert rel_err(a.grad.double(), b.grad) <= 2e-3


def test_strong_decays_keep_float32_accuracy_and_the_callers_denormals():
    """Decays of up to -20 per position (Transformers' A_log initialisation reaches them): the
    chunk's decay products fall below float32's normal range, which the CPU kernel flushes to zero
    while it runs; outputs and gradients stay at float32 accuracy against float64, and the calling
    thread computes denormals as before afterwards."""
    g = torch.Generator().manual_seed(13)
    q, k, v, _, beta = inputs(g, 2, 150, 3, 16, 8)
    decay = -torch.rand(2, 150, 3, generator=g, dtype=torch.float64) * 20
    base = [q, k, v, decay, beta]
    ours = [x.float().requires_grad_() for x in base]
    ref = [x.clone().requires_grad_() for x in base]
    o, final = OPS.chunk_gated_delta_rule(*ours, 64)
    o_ref, final_ref = OPS.chunk_gated_delta_rule_reference(*ref, 64)
    assert rel_err(o.double(), o_ref) <= 1e-5 and rel_err(final.double(), final_ref) <= 1e-5
    u = torch.randn(o.shape, generator=g, dtype=torch.float64)
    (o * u.float()).sum().backward()
    (o_ref * u).sum().backward()
    for name, a, b in zip("q k v g beta".split(), ours, ref):
        assert rel_err(a.grad.double(), b.grad) <= 1e-5, name
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert (tiny * 0.5).item() > 0  # this thread still has denormals
