"""The op-test harness: every fused op on every available device against its ATen reference.

In the spirit of ggml's test-backend-ops: each case builds random inputs of an awkward shape
(odd sizes, T = 1, an expert with no tokens, all tokens on one expert, K = 1, several GEMM tiles),
runs the fused op in float32 and bfloat16 with its outputs NaN-poisoned (an element a kernel
forgets to write fails), and compares
  - the forward with the reference evaluated in float64 on the same inputs, and
  - the gradients of every differentiable input, for the same random upstream gradient, with the
    reference's float64 gradients;
as max |fused - reference| / max |reference| <= 1e-5 (float32) or 1e-2 (bfloat16). Small float64
cases are also checked against finite differences (torch.autograd.gradcheck).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import pytest

import torch

import automoe  # noqa: F401  (registers torch.ops.automoe)

OPS = torch.ops.automoe
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ISA_LEVELS = ["baseline", "avx2", "avx512", "avx512_bf16", "amx"]


def cpu_variants() -> list[str]:
    """Every other CPU kernel path this CPU can run, as "cpu:<isa>[+<gemm>]": each lower
    instruction-set level, and each GEMM path the CPU's own level does not choose by default
    (brgemm below AMX), deduplicated by the kernels they select."""
    seen, out = set(), []

    def add(isa: str, gemm: str = ""):
        OPS._set_cpu_paths(isa, gemm)
        paths = dict(OPS._cpu_kernel_paths())
        key = tuple(sorted((k, v) for k, v in paths.items()
                           if k not in ("isa", "cpu_isa", "gemm_measured", "gemm_decisions")))
        if key not in seen:
            seen.add(key)
            out.append(f"cpu:{isa}" + (f"+{gemm}" if gemm else ""))

    try:
        cpu_isa = OPS._cpu_kernel_paths()["cpu_isa"]
        add(cpu_isa)  # the default path ("cpu")
        for gemm in OPS._cpu_gemm_paths():
            add(cpu_isa, gemm)
        for isa in ISA_LEVELS[: ISA_LEVELS.index(cpu_isa)]:
            add(isa)
    finally:
        OPS._set_cpu_paths("", "")
    return out[1:]


CPU_VARIANTS = cpu_variants()


@pytest.fixture(autouse=True)
def poison_outputs():
    OPS._set_poison_outputs(True)
    yield
    OPS._set_poison_outputs(False)


@dataclasses.dataclass
class Case:
    """fused(*inputs) and reference(*inputs) return a tuple of tensors; `grad` names the indices of
    the differentiable float inputs; `float_outputs` the indices of the outputs compared as floats
    (the others must be equal exactly); `cast` the indices of the inputs cast to the test dtype."""

    name: str
    make: Callable[[torch.Generator], list]
    fused: Callable
    reference: Callable
    grad: tuple[int, ...] = ()
    cast: tuple[int, ...] = ()
    float_outputs: tuple[int, ...] = (0,)
    tol_scale: float = 1.0


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double().cpu(), ref.double().cpu()
    assert not torch.isnan(a).any(), "NaN in the fused result (an unwritten element?)"
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item() if ref.numel() else 0.0


def as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def randn(g, *shape, scale=1.0):
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64) * scale


# ---- permute plans -------------------------------------------------------------------------


def plan_reference(idx: torch.Tensor, E: int):
    """The plan as the contract states it, by a stable sort: rows grouped by expert, slot order."""
    flat = idx.reshape(-1)
    valid = flat >= 0
    order = torch.sort(torch.where(valid, flat, E), stable=True).indices
    counts = torch.bincount(flat[valid], minlength=E)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    n_valid = int(valid.sum())
    slot_pos = torch.full_like(flat, -1)
    slot_pos[order[:n_valid]] = torch.arange(n_valid)
    src = torch.full_like(flat, -1)
    src[:n_valid] = order[:n_valid] // idx.shape[1]
    return offsets, slot_pos.view_as(idx), src


def routing(g, T, K, E, pattern):
    if pattern == "random":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    elif pattern == "one_expert":  # every slot on expert E-1 (K = 1), the others empty
        idx = torch.full((T, K), E - 1, dtype=torch.long)
    elif pattern == "empty_and_dropped":  # expert 0 never chosen, some slots dropped (-1)
        idx = torch.stack([1 + torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
        idx[::3, -1] = -1
    return idx


ROUTINGS = [(1, 1, 3, "random"), (7, 2, 5, "empty_and_dropped"), (13, 1, 4, "one_expert"),
            (33, 4, 9, "random")]


def test_permute_plan_matches_a_stable_sort():
    g = torch.Generator().manual_seed(0)
    for T, K, E, pattern in ROUTINGS:
        idx = routing(g, T, K, E, pattern)
        for device in DEVICES:
            for op in (OPS.moe_permute_plan, OPS.moe_permute_plan_reference):
                got = op(idx.to(device), E)
                for a, b in zip(got, plan_reference(idx, E)):
                    assert torch.equal(a.cpu(), b), (op, T, K, E, pattern, device)


def test_permute_plan_rejects_out_of_range_experts_naming_the_first_one():
    with pytest.raises(Exception, match=r"indices must be in \[-1, 4\), got 4 at \[0, 1\]"):
        OPS.moe_permute_plan(torch.tensor([[0, 4]]), 4)
    idx = torch.zeros(5000, 8, dtype=torch.long)  # several chunks: the first bad one is named
    idx[4000, 3] = -2
    idx[4999, 0] = 9
    with pytest.raises(Exception, match=r"got -2 at \[4000, 3\]"):
        OPS.moe_permute_plan(idx, 4)


# ---- cases ------------------------------------------------------------------------------------


def rmsnorm_cases():
    for shape in [(1, 5), (7, 33), (3, 5, 64), (2, 1000)]:
        yield Case(
            f"rmsnorm{shape}",
            lambda g, s=shape: [randn(g, *s, scale=3), 1 + randn(g, s[-1], scale=0.3)],
            lambda x, w: OPS.rmsnorm(x, w, 1e-6),
            lambda x, w: OPS.rmsnorm_reference(x, w, 1e-6),
            grad=(0, 1), cast=(0, 1))


def rope_cases():
    for B, S, N, D in [(1, 1, 1, 2), (2, 5, 3, 8), (1, 7, 4, 66)]:
        for inter in (False, True):
            def make(g, B=B, S=S, N=N, D=D):
                ang = randn(g, B, S, D // 2, scale=4)
                return [randn(g, B, S, N, D), ang.cos(), ang.sin()]
            yield Case(
                f"rope{(B, S, N, D)}{'-interleaved' if inter else ''}", make,
                lambda x, c, s, i=inter: OPS.rope(x, c, s, i),
                lambda x, c, s, i=inter: OPS.rope_reference(x, c, s, i),
                grad=(0,), cast=(0, 1, 2))


def swiglu_cases():
    for shape in [(1, 2), (5, 14), (2, 50), (3, 4, 66)]:  # I = 25: the 16-, 8- and 1-wide loops
        for variant in ("silu", "gpt_oss"):
            yield Case(
                f"swiglu{shape}-{variant}",
                # scale 5: the GPT-OSS clamps at +-7 are exercised
                lambda g, s=shape: [randn(g, *s, scale=5)],
                lambda x, v=variant: OPS.swiglu(x, v),
                lambda x, v=variant: OPS.swiglu_reference(x, v),
                grad=(0,), cast=(0,))


ROUTER_CONFIGS = [  # T, E, K, score_func, n_group, topk_group, bias, norm, scaling
    (1, 4, 1, "softmax", 1, 1, False, True, 1.0),
    (33, 64, 8, "softmax", 1, 1, False, True, 1.0),
    (7, 6, 2, "softmax", 1, 1, False, False, 1.0),
    (5, 8, 8, "softmax", 1, 1, False, True, 1.0),
    (9, 16, 3, "sigmoid", 4, 2, True, True, 2.5),
    (11, 32, 4, "sigmoid", 8, 3, True, True, 1.0),
]


def router_cases():
    for T, E, K, sf, ng, tg, bias, norm, scale in ROUTER_CONFIGS:
        def make(g, T=T, E=E, bias=bias):
            return [randn(g, T, E, scale=2), randn(g, E, scale=0.1) if bias else None]
        args = (K, sf, ng, tg, norm, scale)
        yield Case(
            f"router-T{T}-E{E}-K{K}-{sf}-g{ng}/{tg}", make,
            lambda l, b, a=args: OPS.router(l, a[0], a[1], b, *a[2:]),
            lambda l, b, a=args: OPS.router_reference(l, a[0], a[1], b, *a[2:]),
            grad=(0,), cast=(0,), float_outputs=(0, 2))


def permute_cases():
    for T, K, E, pattern in ROUTINGS:
        for H in (1, 37):
            def make(g, T=T, K=K, E=E, H=H, pattern=pattern):
                plan = plan_reference(routing(g, T, K, E, pattern), E)
                return [randn(g, T, H), *plan]
            yield Case(f"permute-T{T}-K{K}-E{E}-H{H}-{pattern}", make, OPS.permute,
                       OPS.permute_reference, grad=(0,), cast=(0,))

            def make_u(g, T=T, K=K, E=E, H=H, pattern=pattern):
                plan = plan_reference(routing(g, T, K, E, pattern), E)
                return [randn(g, T * K, H), *plan, randn(g, T, K).abs()]
            yield Case(f"unpermute-T{T}-K{K}-E{E}-H{H}-{pattern}", make_u, OPS.unpermute,
                       OPS.unpermute_reference, grad=(0, 4), cast=(0, 4))
            # the engine's combination: the router's float32 weights with bf16 / fp32 rows
            yield Case(f"unpermute-fp32-weights-T{T}-K{K}-E{E}-H{H}-{pattern}", make_u,
                       lambda y, o, sp, st, w: OPS.unpermute(y, o, sp, st, w.float()),
                       OPS.unpermute_reference, grad=(0, 4), cast=(0,))


def grouped_gemm_cases():
    # (rows N, K, O, group sizes); rows past the groups' end must come out as zeros. bf16 groups
    # of 17-128 rows with an even K run transposed on the brgemm path below AMX (W read in place;
    # 16 and 129 rows beside them do not), O = 272 a 16-column tail past a 256-column tile.
    for N, K, O, sizes in [(1, 1, 1, [1]), (37, 33, 19, [5, 0, 12, 11, 0]),
                           (300, 300, 260, [0, 290, 10]), (9, 16, 8, [0, 0, 4]),
                           (130, 64, 40, [97, 1, 30, 2]), (290, 96, 272, [17, 128, 16, 129])]:
        def make(g, N=N, K=K, O=O, sizes=sizes):
            offsets = torch.tensor([0] + sizes).cumsum(0)
            return [randn(g, N, K), randn(g, len(sizes), O, K, scale=0.2), offsets]
        yield Case(f"grouped_gemm-N{N}-K{K}-O{O}-{sizes}", make, OPS.grouped_gemm,
                   OPS.grouped_gemm_reference, grad=(0, 1), cast=(0, 1))

        # Weights stored transposed ([G, K, O], GPT-OSS's experts) and passed as the [G, O, K]
        # view: the CPU kernels read them in place; the gradient reaches the stored tensor.
        def make_t(g, N=N, K=K, O=O, sizes=sizes):
            offsets = torch.tensor([0] + sizes).cumsum(0)
            return [randn(g, N, K), randn(g, len(sizes), K, O, scale=0.2), offsets]
        yield Case(f"grouped_gemm-transposed-w-N{N}-K{K}-O{O}-{sizes}", make_t,
                   lambda x, w, off: OPS.grouped_gemm(x, w.transpose(1, 2), off),
                   lambda x, w, off: OPS.grouped_gemm_reference(x, w.transpose(1, 2), off),
                   grad=(0, 1), cast=(0, 1))


def linear_cases():
    # The dense linear: batched rows (3-D input), odd sizes, one row, a bias. Where ATen's bf16
    # GEMM is not native it runs on the CPU GEMM engine (forward, dX, dW); the reference is
    # torch's linear in float64.
    for shape, K, O, bias in [((2, 5), 33, 19, False), ((1,), 7, 3, True), ((3, 41), 64, 96, True),
                              ((130,), 300, 260, False)]:
        def make(g, shape=shape, K=K, O=O, bias=bias):
            return [randn(g, *shape, K), randn(g, O, K, scale=0.2),
                    randn(g, O, scale=0.5) if bias else None]
        yield Case(f"linear-{'x'.join(map(str, shape))}-K{K}-O{O}{'-bias' if bias else ''}", make,
                   OPS.linear, torch.nn.functional.linear, grad=(0, 1, 2) if bias else (0, 1),
                   cast=(0, 1, 2))


def grouped_gemm_lora_cases():
    # LoRA inside the grouped GEMM: an empty expert, r = 1, a single row (T = 1), rows past the
    # groups; scaling as PEFT's alpha / r. The frozen base weight (w) gets no gradient.
    for N, K, O, r, sizes in [(1, 5, 3, 1, [1]), (37, 33, 19, 4, [5, 0, 12, 11, 0]),
                              (9, 16, 8, 2, [0, 0, 4]), (130, 64, 40, 8, [97, 1, 30, 2])]:
        def make(g, N=N, K=K, O=O, r=r, sizes=sizes):
            offsets = torch.tensor([0] + sizes).cumsum(0)
            G = len(sizes)
            return [randn(g, N, K), randn(g, G, O, K, scale=0.2), randn(g, G, r, K, scale=0.3),
                    randn(g, G, O, r, scale=0.3), offsets]
        yield Case(f"grouped_gemm_lora-N{N}-K{K}-O{O}-r{r}-{sizes}", make,
                   lambda x, w, a, b, o, r=r: OPS.grouped_gemm_lora(x, w, a, b, o, 16.0 / r),
                   lambda x, w, a, b, o, r=r: OPS.grouped_gemm_lora_reference(x, w, a, b, o, 16.0 / r),
                   grad=(0, 2, 3), cast=(0, 1, 2, 3))
        # every input differentiable, the base weight too (a full fine-tune with adapters)
        yield Case(f"grouped_gemm_lora-all-grads-N{N}-r{r}", make,
                   lambda x, w, a, b, o: OPS.grouped_gemm_lora(x, w, a, b, o, 0.5),
                   lambda x, w, a, b, o: OPS.grouped_gemm_lora_reference(x, w, a, b, o, 0.5),
                   grad=(0, 1, 2, 3), cast=(0, 1, 2, 3))


def cross_entropy_cases():
    # rows_per_chunk 0: the default 64 MiB chunk, one chunk both ways; the forward's logits are
    # kept where [N, V] is at most 8 chunks (all but the last case)
    for N, H, V, rows_per_chunk in [(1, 3, 5, 0), (40, 24, 257, 0), (17, 33, 101, 3), (64, 16, 300, 7)]:
        def make(g, N=N, H=H, V=V):
            labels = torch.randint(0, V, (N,), generator=g)
            labels[::4] = -100
            return [randn(g, N, H), randn(g, V, H, scale=0.3), labels]
        # small chunks: the forward and the backward each walk several chunks
        chunk = 4 * max(V, N) * rows_per_chunk
        yield Case(
            f"linear_cross_entropy-N{N}-H{H}-V{V}",
            make,
            lambda x, w, y, c=chunk: OPS.linear_cross_entropy(x, w, y, -100, c),
            lambda x, w, y: OPS.linear_cross_entropy_reference(x, w, y, -100),
            grad=(0, 1), cast=(0, 1), float_outputs=(0,))


def documents(g, B, S):
    """[B, S] int64 document ids, contiguous runs of random lengths (a run of 1 among them)."""
    rows = []
    for _ in range(B):
        cuts = sorted(torch.randperm(S - 1, generator=g)[: max(1, S // 4)].add(1).tolist())
        ids = torch.zeros(S, dtype=torch.long)
        for c in cuts:
            ids[c:] += 1
        rows.append(ids)
    return torch.stack(rows)


def mamba_cases():
    # The depthwise causal conv (channels last): one position, C not a multiple of 8 or 16, K = 2
    # and 4, no bias, packed documents (a tap of another document counts as zero), SiLU on / off.
    for B, S, C, K, bias, docs, silu in [(1, 1, 3, 4, True, False, True), (2, 9, 37, 4, True, True, True),
                                         (1, 70, 16, 4, False, True, True), (3, 5, 33, 2, True, False, False),
                                         (2, 200, 24, 4, True, True, False)]:
        def make(g, B=B, S=S, C=C, K=K, bias=bias, docs=docs):
            return [randn(g, B, S, C), randn(g, C, K, scale=0.5), randn(g, C) if bias else None,
                    documents(g, B, S) if docs else None]
        yield Case(f"causal_conv1d-B{B}-S{S}-C{C}-K{K}{'-bias' if bias else ''}"
                   f"{'-docs' if docs else ''}{'-silu' if silu else ''}", make,
                   lambda x, w, b, d, s=silu: OPS.causal_conv1d(x, w, b, d, s),
                   lambda x, w, b, d, s=silu: OPS.causal_conv1d_reference(x, w, b, d, s),
                   grad=(0, 1, 2) if bias else (0, 1), cast=(0, 1, 2))
    # The gated grouped RMSNorm: one group, several groups, odd widths; and the model's mixed case
    # (the scan's float32 y, the gate and weight in the test dtype; the result float32).
    for shape, group in [((1, 8), 8), ((2, 5, 96), 32), ((7, 50), 25), ((3, 130), 65)]:
        def make(g, shape=shape):
            return [randn(g, *shape, scale=2), randn(g, *shape, scale=2), 1 + randn(g, shape[-1], scale=0.3)]
        yield Case(f"gated_rms_norm{shape}-group{group}", make,
                   lambda y, z, w, n=group: OPS.gated_rms_norm(y, z, w, n, 1e-5),
                   lambda y, z, w, n=group: OPS.gated_rms_norm_reference(y, z, w, n, 1e-5),
                   grad=(0, 1, 2), cast=(0, 1, 2))
    def make_mixed(g):
        return [randn(g, 4, 3, 64).float(), randn(g, 4, 3, 64, scale=2), 1 + randn(g, 64, scale=0.3)]
    yield Case("gated_rms_norm-float32-y", make_mixed,
               lambda y, z, w: OPS.gated_rms_norm(y, z, w, 16, 1e-5),
               lambda y, z, w: OPS.gated_rms_norm_reference(y, z, w, 16, 1e-5),
               grad=(0, 1, 2), cast=(1, 2))


def ssd_cases():
    # The SSD scan (the model's fused CPU kernels; ATen's grouped form elsewhere): one position,
    # a chunk not dividing the sequence, several groups, packed documents, an initial state
    # (its gradient too), the final state compared as an output; and strong decays (A·dt to -19
    # per position, as Transformers' A_log initialisation draws: products below float32's normal
    # range, which the kernel flushes to zero; summing the decay terms as row-minus-column terms
    # before the cumulative sum would leave dA 4-7e-5 off here).
    for Bn, S, H, P, G, N, Q, docs, init, strong in [(1, 1, 2, 3, 1, 4, 4, False, False, False),
                                                     (2, 13, 4, 5, 2, 6, 4, False, False, False),
                                                     (1, 40, 6, 8, 3, 16, 16, True, False, False),
                                                     (2, 33, 8, 16, 2, 32, 8, True, True, False),
                                                     (1, 64, 4, 64, 1, 128, 32, False, True, False),
                                                     (2, 70, 4, 8, 2, 16, 32, False, True, True)]:
        def make(g, Bn=Bn, S=S, H=H, P=P, G=G, N=N, docs=docs, init=init, strong=strong):
            dt = torch.rand(Bn, S, H, generator=g, dtype=torch.float64) * (1.2 if strong else 0.5) + 0.01
            A = -(torch.rand(H, generator=g) * (15 if strong else 2) + (1 if strong else 0.1))
            return [randn(g, Bn, S, H, P), dt, A, randn(g, Bn, S, G, N), randn(g, Bn, S, G, N),
                    randn(g, H), randn(g, Bn, H, P, N).float() if init else None,
                    documents(g, Bn, S) if docs else None]
        yield Case(f"ssd_scan-B{Bn}-S{S}-H{H}-P{P}-G{G}-N{N}-Q{Q}{'-docs' if docs else ''}{'-initial' if init else ''}"
                   f"{'-strong' if strong else ''}",
                   make, lambda x, dt, A, B, C, D, h0, d, Q=Q: OPS.ssd_scan(x, dt, A, B, C, D, Q, h0, d),
                   lambda x, dt, A, B, C, D, h0, d, Q=Q: OPS.ssd_scan_reference(x, dt, A, B, C, D, Q, h0, d),
                   grad=(0, 1, 2, 3, 4, 5, 6) if init else (0, 1, 2, 3, 4, 5), cast=(0, 1, 3, 4, 5),
                   float_outputs=(0, 1))


def delta_rule_cases():
    # The chunked gated delta rule (Qwen3-Next's gated DeltaNet; the fused op's hand-derived
    # backward): one position, a chunk not dividing the sequence, several chunks, value heads ≠ key
    # dims, packed documents, an initial state (its gradient too), the final state as an output;
    # strong decays (to -20 per position: products below float32's normal range, flushed).
    for B, S, N, Dk, Dv, Q, docs, init, strong in [
            (1, 1, 2, 4, 3, 4, False, False, False), (2, 13, 3, 8, 5, 4, False, True, False),
            (1, 70, 2, 16, 8, 64, False, True, False), (2, 33, 2, 8, 8, 8, True, False, False),
            (1, 150, 4, 32, 16, 64, False, False, False), (2, 20, 2, 8, 4, 6, True, False, False),
            (1, 23, 3, 8, 4, 5, False, True, False), (2, 90, 2, 16, 8, 64, False, True, True)]:
        def make(g, B=B, S=S, N=N, Dk=Dk, Dv=Dv, docs=docs, init=init, strong=strong):
            return [randn(g, B, S, N, Dk), randn(g, B, S, N, Dk), randn(g, B, S, N, Dv),
                    -torch.rand(B, S, N, generator=g, dtype=torch.float64) * (20 if strong else 0.5),
                    torch.rand(B, S, N, generator=g, dtype=torch.float64),
                    randn(g, B, N, Dk, Dv).float() if init else None, documents(g, B, S) if docs else None]
        outputs = (0,) if docs else (0, 1)
        yield Case(f"chunk_gated_delta_rule-B{B}-S{S}-N{N}-Dk{Dk}-Dv{Dv}-Q{Q}{'-docs' if docs else ''}"
                   f"{'-initial' if init else ''}{'-strong' if strong else ''}", make,
                   lambda q, k, v, a, b, h, d, Q=Q, o=outputs: tuple(OPS.chunk_gated_delta_rule(q, k, v, a, b, Q, h, d)[i] for i in o),
                   lambda q, k, v, a, b, h, d, Q=Q, o=outputs: tuple(OPS.chunk_gated_delta_rule_reference(q, k, v, a, b, Q, h, d)[i] for i in o),
                   grad=(0, 1, 2, 3, 4, 5) if init else (0, 1, 2, 3, 4), cast=(0, 1, 2, 3, 4),
                   float_outputs=outputs)


CASES = [*rmsnorm_cases(), *rope_cases(), *swiglu_cases(), *router_cases(), *permute_cases(),
         *grouped_gemm_cases(), *linear_cases(), *grouped_gemm_lora_cases(),
         *cross_entropy_cases(), *mamba_cases(),
         *ssd_cases(), *delta_rule_cases()]


def run_case(case: Case, dtype, device):
    if device.startswith("cpu:"):  # another CPU kernel path, forced for this case
        isa, _, gemm = device[4:].partition("+")
        OPS._set_cpu_paths(isa, gemm)
        try:
            return run_case(case, dtype, "cpu")
        finally:
            OPS._set_cpu_paths("", "")
    g = torch.Generator().manual_seed(1234)
    base = case.make(g)
    # Inputs as the fused op sees them (the test dtype), and the same values in float64.
    ins = [t.to(dtype) if i in case.cast and t is not None else t for i, t in enumerate(base)]
    ref_ins = [t.double() if i in case.cast and t is not None else t for i, t in enumerate(ins)]
    ins = [t.to(device) if t is not None else None for t in ins]
    for i in case.grad:
        ins[i] = ins[i].detach().requires_grad_(True)
        ref_ins[i] = ref_ins[i].detach().requires_grad_(True)
    out = as_tuple(case.fused(*ins))
    ref = as_tuple(case.reference(*ref_ins))
    tol = TOL[dtype] * case.tol_scale
    for j, (a, b) in enumerate(zip(out, ref)):
        if j in case.float_outputs:
            err = rel_err(a, b)
            assert err <= tol, f"{case.name} output {j}: relative error {err:.2e} > {tol:.0e}"
        else:
            assert torch.equal(a.cpu(), b.cpu()), f"{case.name} output {j} differs"
    if not case.grad:
        return
    ups = [randn(g, *b.shape).to(a.dtype) for j, (a, b) in enumerate(zip(out, ref))
           if j in case.float_outputs]
    fused_sum = sum((a.float() * u.to(device).float()).sum() if a.dtype != torch.float64
                    else (a * u.to(device)).sum()
                    for a, u in zip([out[j] for j in case.float_outputs], ups))
    ref_sum = sum((b * u.double()).sum() for b, u in zip([ref[j] for j in case.float_outputs], ups))
    grads = torch.autograd.grad(fused_sum, [ins[i] for i in case.grad])
    ref_grads = torch.autograd.grad(ref_sum, [ref_ins[i] for i in case.grad])
    for i, a, b in zip(case.grad, grads, ref_grads):
        err = rel_err(a, b)
        assert err <= tol, f"{case.name} grad of input {i}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("device", DEVICES + CPU_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fused_op_matches_float64_reference(case, dtype, device):
    run_case(case, dtype, device)


# ---- finite differences (float64, CPU) ------------------------------------------------------


def gradcheck_case(fn, inputs, **kw):
    assert torch.autograd.gradcheck(fn, inputs, **kw)


def test_finite_differences_rmsnorm_rope_swiglu():
    g = torch.Generator().manual_seed(3)
    x, w = randn(g, 3, 7).requires_grad_(), (1 + randn(g, 7)).requires_grad_()
    gradcheck_case(lambda a, b: OPS.rmsnorm(a, b, 1e-6), (x, w))
    ang = randn(g, 2, 3, 3)
    q = randn(g, 2, 3, 2, 6).requires_grad_()
    for inter in (False, True):
        gradcheck_case(lambda a: OPS.rope(a, ang.cos(), ang.sin(), inter), (q,))
    gu = randn(g, 4, 10, scale=4).requires_grad_()
    gradcheck_case(lambda a: OPS.swiglu(a, "silu"), (gu,))
    gradcheck_case(lambda a: OPS.swiglu(a, "gpt_oss"), (gu,))


def test_finite_differences_permute_grouped_gemm_unpermute():
    g = torch.Generator().manual_seed(4)
    idx = routing(g, 5, 2, 4, "empty_and_dropped")
    plan = OPS.moe_permute_plan(idx, 4)
    x = randn(g, 5, 3).requires_grad_()
    gradcheck_case(lambda a: OPS.permute(a, *plan), (x,))
    xp = randn(g, 10, 3).requires_grad_()
    w = randn(g, 4, 5, 3).requires_grad_()
    gradcheck_case(lambda a, b: OPS.grouped_gemm(a, b, plan[0]), (xp, w))
    y = randn(g, 10, 3).requires_grad_()
    wt = randn(g, 5, 2).abs().requires_grad_()
    gradcheck_case(lambda a, b: OPS.unpermute(a, *plan, b), (y, wt))


def test_bf16_linear_rounds_product_plus_bias_once_as_aten_does():
    """ops::linear in bf16 adds the bias to the float32 accumulator and rounds once, as ATen's
    addmm does (at::linear); rounding the product first and then the sum differs by an ulp for a
    large share of the outputs when bias and product are of a size (checked on these data)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=g).bfloat16()
    w = (torch.randn(40, 48, generator=g) * 0.2).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    exact = x.double() @ w.double().t() + b.double()
    want = exact.bfloat16()
    got = OPS.linear(x, w, b)
    assert got.dtype == torch.bfloat16
    assert (got != want).float().mean() <= 0.002  # ties within float32 accumulation error only
    twice = ((x.double() @ w.double().t()).bfloat16() + b).bfloat16()
    assert (twice != want).float().mean() >= 0.05  # the data tell the two roundings apart
    # the gradients: dx, dw as for no bias, the bias's the column sums of dy (in bf16, as autograd)
    xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
    dy = torch.randn(64, 40, generator=g).bfloat16()
    OPS.linear(xr, wr, br).backward(dy)
    assert torch.equal(br.grad, dy.sum(0))
    assert rel_err(xr.grad.double(), dy.double() @ w.double()) <= 1e-2
    assert rel_err(wr.grad.double(), dy.double().t() @ x.double()) <= 1e-2


@pytest.mark.parametrize("kind", ["causal", "right-padded", "left-padded", "gqa-causal"])
def test_bf16_sdpa_forward_is_atens_and_its_backward_is_at_least_as_accurate(kind):
    """The engine's SDPA in bf16 with gradients: where ATen's bf16 GEMM is not native (no
    AVX512_BF16 / AMX) its backward runs ATen's float32 flash-attention backward on the forward's
    saved tensors (the bf16 one ran on ATen's slow GEMM fallback); the forward is ATen's bf16
    kernel on every CPU. So the output equals torch's sdpa bit for bit, and the gradients are
    within bf16 rounding of float64's and no further from them than torch's bf16 backward; a
    query that sees no key (left padding) gets finite gradients, as in torch."""
    from automoe import _C

    g = torch.Generator().manual_seed(0)
    B, N, S, D = 2, 4, 37, 16
    Nkv = 2 if kind == "gqa-causal" else N
    q, k, v = (torch.randn(B, n, S, D, generator=g).bfloat16() for n in (N, Nkv, Nkv))
    dy = torch.randn(B, N, S, D, generator=g).bfloat16()
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    keep = torch.ones(B, S, dtype=torch.bool)
    if kind == "right-padded":
        keep[1, 30:] = False
    if kind == "left-padded":
        keep[1, :5] = False  # queries 0..4 of row 1 see no key
    mask = None if "causal" in kind else (causal & keep.view(B, 1, 1, S)).expand(B, 1, S, S)
    is_causal = mask is None
    scale = D ** -0.5

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, dy.to(dtype))
        return out.detach(), grads

    def torch_sdpa(qq, kk, vv):
        rep = N // Nkv
        return torch.nn.functional.scaled_dot_product_attention(
            qq, kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1), attn_mask=mask,
            is_causal=is_causal, scale=scale)

    ours, our_grads = run(lambda a, b, c: _C._attention(a, b, c, mask, is_causal, scale), torch.bfloat16)
    ref, ref_grads = run(torch_sdpa, torch.bfloat16)
    assert torch.equal(ours, ref)
    if kind == "left-padded":  # (float64's softmax over no key is NaN: compare with torch only)
        for mine, theirs in zip(our_grads, ref_grads):
            assert torch.isfinite(mine).all()
            assert rel_err(mine.double(), theirs.double()) <= 2e-2
        return
    _, truth = run(torch_sdpa, torch.float64)
    for name, mine, theirs, exact in zip("qkv", our_grads, ref_grads, truth):
        err, ref_err = rel_err(mine.double(), exact), rel_err(theirs.double(), exact)
        assert err <= 8e-3 and err <= ref_err * 1.25 + 1e-3, (name, err, ref_err)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_eager_attention_matches_transformers_eager_forward_and_backward(family):
    """Eager attention (attn=eager; GPT-OSS's with its sinks) in bf16 against Transformers' own
    eager_attention_forward: where ATen's bf16 GEMM is not native (no AVX512_BF16 / AMX) its two
    products run as float32 GEMMs rounded once (ops::matmul; ATen's bf16 fallback GEMM made
    eager 2.8x SDPA's step), so outputs and q/k/v gradients must stay within bf16 rounding of
    float64's and no further from them than Transformers' bf16 eager is."""
    import importlib

    from automoe import _C

    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    g = torch.Generator().manual_seed(1)
    B, N, Nkv, S, D = 2, 4, 2, 41, 16
    q, k, v = (torch.randn(B, n, S, D, generator=g).bfloat16() for n in (N, Nkv, Nkv))
    dy = torch.randn(B, S, N, D, generator=g).bfloat16()
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, 33:] = False  # right padding in row 1
    allowed = torch.ones(S, S, dtype=torch.bool).tril() & keep.view(B, 1, 1, S)
    mask = torch.zeros(B, 1, S, S).masked_fill(~allowed, float("-inf"))
    sinks = torch.randn(N, generator=g) if family == "gpt_oss" else None
    scale = D ** -0.5

    class Module(torch.nn.Module):  # what eager_attention_forward reads from the attention layer
        def __init__(self, dtype):
            super().__init__()
            self.num_key_value_groups = N // Nkv
            self.sinks = None if sinks is None else sinks.to(dtype)

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = fn(dtype, *leaves)
        return out.detach(), torch.autograd.grad(out, leaves, dy.to(dtype))

    def transformers_eager(dtype, a, b, c):
        return hf.eager_attention_forward(Module(dtype), a, b, c, mask.to(dtype), scale)[0]

    def ours(dtype, a, b, c):
        s = None if sinks is None else sinks.to(dtype)
        return _C._attention(a, b, c, mask.to(dtype), False, scale, attn="eager",
                             sinks=s).transpose(1, 2)

    mine, my_grads = run(ours, torch.bfloat16)
    theirs, their_grads = run(transformers_eager, torch.bfloat16)
    exact, exact_grads = run(transformers_eager, torch.float64)
    for name, a, b, truth in zip(["out", "q", "k", "v"], [mine, *my_grads], [theirs, *their_grads],
                                 [exact, *exact_grads]):
        err, ref_err = rel_err(a, truth), rel_err(b, truth)
        assert err <= 1e-2 and err <= ref_err * 1.25 + 1e-3, (name, err, ref_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_cross_entropy_keeps_the_logits_for_the_backward_within_its_budget(dtype):
    """When [N, V] is at most 8 chunks, the backward takes the forward's logits instead of
    recomputing them (one GEMM of four): with one chunk both ways the gradients equal the
    recomputing path's bit for bit — a second backward through the same graph recomputes (the
    kept logits were consumed); a forward in several token chunks writes them into one tensor;
    past the budget both sides walk their chunks and recompute."""
    g = torch.Generator().manual_seed(3)
    N, H, V = 48, 32, 389
    x0, w0 = randn(g, N, H).to(dtype), randn(g, V, H, scale=0.3).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::5] = -100

    def grads(chunk_bytes, twice=False):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        loss, _ = OPS.linear_cross_entropy(x, w, labels, -100, chunk_bytes)
        first = torch.autograd.grad(loss, [x, w], retain_graph=twice)
        return (first, torch.autograd.grad(loss, [x, w])) if twice else first

    kept, recomputed = grads(0, twice=True)
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    # kept from 3 token chunks of 20 rows (N * V = 18672 <= 8 * V * 20)
    several = grads(4 * V * 20)
    # past the budget (18672 > 8 * V * 4): 4 token rows forward, 4 * V * 4 / (4 * N) = 32
    # vocabulary rows backward
    split = grads(4 * V * 4)
    for a, b, c in zip(kept, several, split):
        assert rel_err(a, b) <= TOL[dtype] and rel_err(a, c) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_cross_entropy_runs_the_lm_head_on_labelled_rows_only(dtype):
    """Rows whose label is ignore_index never enter the LM head: the loss and the gradients equal
    bit for bit those of the labelled rows alone (the same GEMMs on the same rows), the ignored
    rows' gradient is exactly zero — even where their hidden states are not finite, whose logits
    would otherwise poison the weight gradient through 0 x inf."""
    g = torch.Generator().manual_seed(4)
    N, H, V = 40, 24, 257
    x0, w0 = randn(g, N, H).to(dtype), randn(g, V, H, scale=0.3).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[:13] = -100  # a masked prompt
    labels[29::3] = -100  # and scattered ignored rows
    x0[3, 5] = float("inf")
    valid = labels != -100

    def run(x_in, lab):
        x, w = x_in.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        loss, count = OPS.linear_cross_entropy(x, w, lab, -100, 0)
        return (loss, count, *torch.autograd.grad(loss, [x, w]))

    loss, count, dx, dw = run(x0, labels)
    loss_v, count_v, dx_v, dw_v = run(x0[valid], labels[valid])
    assert count.item() == count_v.item() == int(valid.sum())
    assert torch.equal(loss, loss_v) and torch.equal(dw, dw_v) and torch.isfinite(dw).all()
    assert torch.equal(dx[valid], dx_v)
    assert torch.equal(dx[~valid], torch.zeros_like(dx[~valid]))
    # all rows ignored (a micro-batch that is all prompt): no LM head at all, a zero loss, zero
    # gradients
    loss0, count0, dx0, dw0 = run(x0, torch.full((N,), -100))
    assert loss0.item() == 0 and count0.item() == 0 and not dx0.any() and not dw0.any()


def test_finite_differences_linear_cross_entropy():
    g = torch.Generator().manual_seed(5)
    x, w = randn(g, 6, 4).requires_grad_(), randn(g, 11, 4).requires_grad_()
    labels = torch.tensor([3, -100, 0, 10, 7, -100])
    gradcheck_case(lambda a, b: OPS.linear_cross_entropy(a, b, labels, -100, 4 * 11 * 2)[0], (x, w))


def test_finite_differences_router():
    # The router computes in float32 whatever the input (its contract), so the finite-difference
    # check runs with float32-sized steps and tolerances.
    g = torch.Generator().manual_seed(6)
    logits = randn(g, 4, 8).requires_grad_()
    for sf, ng, tg in [("softmax", 1, 1), ("sigmoid", 4, 2)]:
        gradcheck_case(lambda l: OPS.router(l, 3, sf, None, ng, tg, True, 1.5)[0].double(),
                       (logits,), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_router_backward_through_the_weights_alone_or_the_scores_alone_matches_the_reference():
    # Without an aux loss only the weights carry a gradient; the scores' is then absent (not a
    # tensor of zeros), as the weights' is when only the scores are used.
    g = torch.Generator().manual_seed(7)
    logits = randn(g, 37, 16, scale=2)
    up_w, up_s = randn(g, 37, 4), randn(g, 37, 16)
    for sf, ng, tg in [("softmax", 1, 1), ("sigmoid", 4, 2)]:
        for use in ("weights", "scores", "both"):
            grads = []
            for fn, x in ((OPS.router, logits.clone()), (OPS.router_reference, logits.double())):
                x.requires_grad_(True)
                w, _, scores = fn(x, 4, sf, None, ng, tg, True, 1.5)
                loss = 0
                if use != "scores":
                    loss = loss + (w * up_w.to(w.dtype)).sum()
                if use != "weights":
                    loss = loss + (scores * up_s.to(scores.dtype)).sum()
                grads.append(torch.autograd.grad(loss, x)[0])
            assert rel_err(grads[0], grads[1]) <= 1e-5, (sf, use)


# ---- semantics the references do not pin down ------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_router_ties_go_to_the_lower_expert_index(device):
    logits = torch.zeros(3, 8, device=device)
    w, idx, _ = OPS.router(logits, 3)
    assert idx.cpu().tolist() == [[0, 1, 2]] * 3
    assert torch.allclose(w.cpu(), torch.full((3, 3), 1 / 3))


CPU_PATHS = ["cpu"] + [v for v in CPU_VARIANTS if "+" not in v]


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("E,K,pattern", [
    (128, 8, "random"), (128, 1, "random"), (40, 8, "random"), (64, 16, "random"),
    (1024, 8, "random"), (128, 8, "few_values"), (256, 8, "all_equal"), (128, 8, "some_inf"),
])
def test_router_top_k_is_a_stable_descending_sort_of_its_scores(path, E, K, pattern):
    # Every selection path of the CPU router (the vectorised candidates-and-ranks one for k <= 8,
    # the rounds for larger k or many equal values, the sort for rows with -inf) picks the k best
    # of its own scores, equal scores by lower expert index: a stable descending sort.
    g = torch.Generator().manual_seed(E + K)
    logits = torch.randn(67, E, generator=g) * 3
    if pattern == "few_values":  # many exact ties around the k-th score
        logits = torch.randint(0, 3, (67, E), generator=g).float()
    elif pattern == "all_equal":
        logits = torch.full((67, E), 0.5)
    elif pattern == "some_inf":  # rows where most experts are impossible (-inf logits)
        logits[::3, 5:] = float("-inf")
        logits[1::3, : E - 3] = float("-inf")
    isa = path.partition(":")[2]
    OPS._set_cpu_paths(isa, "")
    try:
        for func in ("softmax", "sigmoid"):
            w, idx, scores = OPS.router(logits, K, func)
            order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :K]
            assert torch.equal(idx, order), f"{func}: selection differs from a stable sort"
            picked = scores.gather(1, idx)
            assert torch.allclose(w, picked / picked.sum(-1, keepdim=True))
    finally:
        OPS._set_cpu_paths("", "")


@pytest.mark.parametrize("path", CPU_PATHS)
def test_router_never_picks_a_masked_expert_and_keeps_far_scores_apart(path):
    # exp's fast polynomial clamps its input at -87.3: rows reaching that far below their
    # maximum (masked -inf experts, a logit 90-100 below the best) must not turn -inf into a
    # positive score, nor make the far ones tie; the choice then matches the float64 reference.
    logits = torch.full((4, 16), -1000.0)
    logits[:, 0] = 0.0
    logits[:, 3] = -95.0
    logits[:, 5] = -90.0
    logits[0, 1] = logits[1, 2] = float("-inf")
    logits[2, :] = torch.linspace(0, -150, 16)
    logits[3, 8:] = float("-inf")
    isa = path.partition(":")[2]
    OPS._set_cpu_paths(isa, "")
    try:
        for func in ("softmax", "sigmoid"):
            w, idx, scores = OPS.router(logits, 3, func)
            _, ref_idx, ref_scores = OPS.router_reference(logits.double(), 3, func)
            assert torch.equal(idx, ref_idx), func
            assert (scores[logits == float("-inf")] == 0).all(), func
            assert torch.allclose(scores.double(), ref_scores, rtol=1e-5, atol=1e-37), func
    finally:
        OPS._set_cpu_paths("", "")


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("func", ["softmax", "sigmoid"])
def test_router_row_with_nan_does_not_disturb_the_others(path, func):
    # (40 rows: the CPU router scores blocks of 16 rows before selecting; a NaN row in the middle
    # of a block.)
    logits = torch.randn(40, 128)
    logits[19, 7] = float("nan")
    OPS._set_cpu_paths(path.partition(":")[2], "")
    try:
        w, idx, scores = OPS.router(logits, 8, func)
        w_ref, idx_ref, _ = OPS.router(torch.cat([logits[:19], logits[20:]]), 8, func)
    finally:
        OPS._set_cpu_paths("", "")
    assert torch.equal(torch.cat([idx[:19], idx[20:]]), idx_ref)
    assert torch.equal(torch.cat([w[:19], w[20:]]), w_ref)
    assert ((idx[19] >= 0) & (idx[19] < 128)).all()
    if func == "sigmoid":  # sigmoid is per element: the NaN stays where it was, as ATen's
        assert scores[19, 7].isnan() and not scores[19].isnan().sum() > 1


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_cross_entropy_row_kernels_keep_nan_and_match_the_reference(path, dtype):
    """The fused softmax rows (vec::logsumexp_row / ce_grad_row, every ISA path): a row of x
    holding a NaN gives a NaN loss and NaN gradients exactly where the float64 reference has
    them (never a finite value hiding it); the other rows match the reference; a vocabulary not a
    multiple of the vector width takes the scalar tail."""
    g = torch.Generator().manual_seed(11)
    N, H, V = 9, 16, 45
    x0, w0 = randn(g, N, H).to(dtype), randn(g, V, H, scale=0.3).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[4] = -100
    OPS._set_cpu_paths(path.partition(":")[2], "")
    try:
        for poisoned in (False, True):
            x, w = x0.clone(), w0.clone()
            if poisoned:
                x[2, 5] = float("nan")
            outs = []
            for fn, dt in ((OPS.linear_cross_entropy, dtype), (OPS.linear_cross_entropy_reference,
                                                               torch.float64)):
                xa, wa = x.to(dt).requires_grad_(True), w.to(dt).requires_grad_(True)
                loss = fn(xa, wa, labels, -100)[0]
                outs.append((loss, *torch.autograd.grad(loss, [xa, wa])))
            for a, b in zip(*outs):
                assert torch.equal(a.isnan(), b.isnan())
                if not poisoned:
                    assert rel_err(a, b) <= TOL[dtype]
    finally:
        OPS._set_cpu_paths("", "")


@pytest.mark.parametrize("device", DEVICES)
def test_group_limited_routing_picks_from_the_best_groups_only(device):
    # 4 groups of 2; group scores (top-2 sums) rank groups 2 and 0 first.
    logits = torch.tensor([[0.9, 0.8, 0.1, 0.0, 1.0, 0.95, 0.2, 0.1]]).logit().to(device)
    _, idx, _ = OPS.router(logits, 3, "sigmoid", None, 4, 2)
    assert sorted(idx[0].cpu().tolist()) == [0, 4, 5]


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs_give_the_contiguous_result(device):
    g = torch.Generator().manual_seed(8)
    idx = routing(g, 9, 2, 4, "empty_and_dropped")
    offsets, slot_pos, src = (t.to(device) for t in plan_reference(idx, 4))
    y = randn(g, 18, 6).float().to(device)
    w = randn(g, 9, 2).abs().float().to(device)
    want = OPS.unpermute(y, offsets, slot_pos, src, w)
    got = OPS.unpermute(y.t().contiguous().t(), offsets, slot_pos.t().contiguous().t(), src,
                        w.t().contiguous().t())
    assert torch.equal(got, want)
    x = randn(g, 7, 5).float().to(device)
    wg = randn(g, 2, 3, 5).float().to(device)
    strided = torch.tensor([0, 0, 3, 0, 7]).to(device)[::2]  # [0, 3, 7], not contiguous
    assert torch.equal(OPS.grouped_gemm(x, wg, strided),
                       OPS.grouped_gemm(x, wg, strided.contiguous()))


@pytest.mark.skipif("brgemm" not in OPS._cpu_gemm_paths(), reason="no AVX-512 brgemm here")
def test_brgemm_packing_matches_the_float32_engine_element_by_element():
    """The brgemm path packs bf16 operands itself (rows, transposed rows, VNNI pairs; SIMD blocks of
    16 x 32 plus scalar tails). Every product of two bf16 is exact in float32, so the forward, dX
    and dW must agree with the float32 micro-kernel path to accumulation-order rounding at every
    element — a norm-based tolerance could hide a few misplaced elements."""
    g = torch.Generator().manual_seed(11)
    for N, K, O, sizes in [(300, 300, 260, [0, 290, 10]), (97, 67, 83, [64, 33]),
                           (48, 32, 16, [48])]:
        offsets = torch.tensor([0] + sizes).cumsum(0)
        x0 = randn(g, N, K).bfloat16()
        w0 = randn(g, len(sizes), O, K, scale=0.2).bfloat16()
        up = randn(g, N, O).bfloat16()
        outs = {}
        for path in ("generic", "brgemm"):
            OPS._set_cpu_paths("", path)
            try:
                x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                y = OPS.grouped_gemm(x, w, offsets)
                y.backward(up)
                outs[path] = [y.float(), x.grad.float(), w.grad.float()]
            finally:
                OPS._set_cpu_paths("", "")
        for name, a, b in zip(("y", "dx", "dw"), outs["generic"], outs["brgemm"]):
            # both round one float32 sum to bf16: at most one bf16 ulp apart
            close = (a - b).abs() <= a.abs().clamp_min(1e-3) * 2 ** -7
            assert close.all(), f"N{N} K{K} O{O} {name}: {int((~close).sum())} elements differ"


def test_experts_backends_agree_with_an_empty_expert_and_dropped_slots():
    g = torch.Generator().manual_seed(7)
    T, K, E, H, I = 11, 2, 5, 16, 12
    idx = routing(g, T, K, E, "empty_and_dropped")
    idx[idx < 0] = 1  # eager / torch_mm route every slot; keep expert 0 empty
    x = randn(g, T, H).float()
    wts = randn(g, T, K).abs().float()
    gu, down = randn(g, E, 2 * I, H, scale=0.3).float(), randn(g, E, H, I, scale=0.3).float()
    eager = OPS.moe_experts(x, idx, wts, gu, down, "eager")
    for backend in ("grouped", "torch_mm"):
        got = OPS.moe_experts(x, idx, wts, gu, down, backend)
        assert rel_err(got, eager.double()) <= 1e-5, backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["grouped", "torch_mm", "eager"])
def test_expert_lora_equals_the_merged_weight_in_every_backend(backend, dtype):
    """Each backend runs the adapters on the expert's rows (never forming W + s·B·A); the result
    and the adapters' gradients must be those of the merged weight, in float64; float32 adapters
    on a bf16 model are cast inside, as the engine's trainer and PEFT's float32 adapters need."""
    g = torch.Generator().manual_seed(11)
    T, K, E, H, I, r = 13, 2, 5, 16, 8, 3  # (torch_mm: 16-byte rows in bf16)
    idx = routing(g, T, K, E, "empty_and_dropped")
    idx[idx < 0] = 1
    x = randn(g, T, H)
    wts = randn(g, T, K).abs()
    gu, down = randn(g, E, 2 * I, H, scale=0.3), randn(g, E, H, I, scale=0.3)
    a_gu, b_gu = randn(g, E, r, H, scale=0.3), randn(g, E, 2 * I, r, scale=0.3)
    a_d, b_d = randn(g, E, r, I, scale=0.3), randn(g, E, H, r, scale=0.3)
    s_gu, s_d = 2.0, 0.5
    leaves = [t.float().requires_grad_(True) for t in (a_gu, b_gu, a_d, b_d)]
    got = OPS.moe_experts(x.to(dtype), idx, wts.to(dtype), gu.to(dtype), down.to(dtype), backend,
                          leaves[0], leaves[1], s_gu, leaves[2], leaves[3], s_d)
    ref_leaves = [t.double().requires_grad_(True) for t in (a_gu, b_gu, a_d, b_d)]
    merged_gu = gu.to(dtype).double() + s_gu * torch.bmm(ref_leaves[1], ref_leaves[0])
    merged_d = down.to(dtype).double() + s_d * torch.bmm(ref_leaves[3], ref_leaves[2])
    ref = OPS.moe_experts(x.to(dtype).double(), idx, wts.to(dtype).double(), merged_gu, merged_d, "eager")
    tol = TOL[dtype] * 2
    assert rel_err(got, ref) <= tol
    up = randn(g, T, H)
    grads = torch.autograd.grad((got.double() * up).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * up).sum(), ref_leaves)
    for name, a, b in zip(("gate_up A", "gate_up B", "down A", "down B"), grads, ref_grads):
        assert a.dtype == torch.float32
        assert rel_err(a, b) <= tol, name


def test_bad_inputs_name_the_op_and_tensor():
    with pytest.raises(Exception, match=r"automoe.grouped_gemm: offsets must be non-decreasing"):
        OPS.grouped_gemm(torch.randn(4, 3), torch.randn(2, 5, 3), torch.tensor([0, 3, 2]))
    with pytest.raises(Exception, match=r"automoe.rmsnorm: x is Float but weight is BFloat16"):
        OPS.rmsnorm(torch.randn(2, 4), torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(Exception, match=r"automoe.linear_cross_entropy: labels must be in \[0, 5\)"):
        OPS.linear_cross_entropy(torch.randn(2, 3), torch.randn(5, 3), torch.tensor([1, 5]))
    with pytest.raises(Exception, match=r"automoe.router: n_group \(3\) must divide"):
        OPS.router(torch.randn(2, 8), 2, "sigmoid", None, 3, 1)
    with pytest.raises(Exception, match=r"automoe.grouped_gemm_lora: b must be \[G, O, r\] = \[2, 5, 3\]"):
        OPS.grouped_gemm_lora(torch.randn(4, 3), torch.randn(2, 5, 3), torch.randn(2, 3, 3),
                              torch.randn(2, 5, 2), torch.tensor([0, 1, 4]), 1.0)
    with pytest.raises(Exception, match=r"automoe.swiglu: the last dimension of gate_up must be even"):
        OPS.swiglu(torch.randn(2, 5))
    with pytest.raises(Exception, match=r"automoe.swiglu: the last dimension of gate_up must be even and > 0"):
        OPS.swiglu(torch.randn(3, 0))
    with pytest.raises(Exception, match=r"automoe.rmsnorm: x must have a last dimension > 0"):
        OPS.rmsnorm(torch.randn(3, 0), torch.randn(0))
    # A hand-made plan that points outside the tensors is refused, not followed.
    x = torch.randn(2, 4)
    with pytest.raises(Exception, match=r"automoe.permute: src_token values must be in \[-1, 2\)"):
        OPS.permute(x, torch.tensor([0, 2]), torch.tensor([[0], [1]]), torch.tensor([0, 10**9]))
    with pytest.raises(Exception, match=r"automoe.unpermute: slot_pos values must be in \[-1, 2\)"):
        OPS.unpermute(x, torch.tensor([0, 2]), torch.tensor([[0], [10**9]]), torch.tensor([0, 1]),
                      torch.ones(2, 1))
    with pytest.raises(Exception, match=r"automoe.permute: slot_pos and src_token must be int64"):
        OPS.permute(x, torch.tensor([0, 2]), torch.tensor([[0], [1]], dtype=torch.int32),
                    torch.tensor([0, 1], dtype=torch.int32))
    ang = torch.zeros(1, 2, 2, requires_grad=True)
    with pytest.raises(Exception, match=r"automoe.rope: cos and sin must not require gradients"):
        OPS.rope(torch.randn(1, 2, 1, 4), ang.cos(), ang.sin())


# ---- kernel paths -------------------------------------------------------------------------------


def test_cpu_paths_refuse_a_level_above_the_cpu_and_unknown_names():
    cpu_isa = OPS._cpu_kernel_paths()["cpu_isa"]
    try:
        with pytest.raises(automoe.AutoMoEError, match="unknown CPU instruction-set level \"avx9\""):
            OPS._set_cpu_paths("avx9", "")
        with pytest.raises(automoe.AutoMoEError, match="unknown GEMM path \"fast\""):
            OPS._set_cpu_paths("", "fast")
        if cpu_isa != "amx":
            with pytest.raises(automoe.AutoMoEError, match=f"this CPU only has {cpu_isa}"):
                OPS._set_cpu_paths("amx", "")
        OPS._set_cpu_paths("baseline", "")
        assert dict(OPS._cpu_kernel_paths()) == {
            "isa": "baseline", "cpu_isa": cpu_isa, "gemm_bf16": "generic", "gemm_fp32": "aten",
            "lm_head_bf16": "generic", "elementwise": "baseline",
            "gemm_measured": "not measured (no choice needed at this level)",
            "gemm_decisions": "baseline:-:-"}
        with pytest.raises(automoe.AutoMoEError, match="\"avx2\" GEMM path does not run on this CPU at "
                                               "the baseline level"):
            OPS._set_cpu_paths("baseline", "avx2")
    finally:
        OPS._set_cpu_paths("", "")


def test_AUTOMOE_CPU_ISA_caps_the_level_and_rejects_what_the_cpu_lacks():
    import subprocess
    import sys
    code = "import torch, automoe; print(dict(torch.ops.automoe._cpu_kernel_paths())['isa'])"
    import os
    from pathlib import Path
    pkg = str(Path(automoe.__file__).resolve().parents[1])
    env = {**os.environ, "AUTOMOE_CPU_ISA": "avx2",
           "PYTHONPATH": os.pathsep.join(filter(None, [pkg, os.environ.get("PYTHONPATH")]))}
    cpu_isa = OPS._cpu_kernel_paths()["cpu_isa"]
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if cpu_isa == "baseline":
        assert out.returncode != 0 and "AUTOMOE_CPU_ISA=avx2: this CPU only has baseline" in out.stderr
    else:
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["avx2"]


def test_AUTOMOE_CPU_GEMM_DECISIONS_pins_the_measured_choices_and_rejects_what_cannot_apply():
    """A fresh process adopts the pinned choices instead of measuring them (cpu_kernels says so),
    for both flips of the bf16 choice; a value for another level or a malformed one is an error
    naming the variable."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cpu_isa = OPS._cpu_kernel_paths()["cpu_isa"]
    if cpu_isa in ("baseline", "amx"):
        pytest.skip(f"no measured GEMM choice at {cpu_isa}")
    pkg = str(Path(automoe.__file__).resolve().parents[1])
    code = "import torch, automoe; print(dict(torch.ops.automoe._cpu_kernel_paths()))"

    def paths(value):
        env = {**os.environ, "AUTOMOE_CPU_GEMM_DECISIONS": value,
               "PYTHONPATH": os.pathsep.join(filter(None, [pkg, os.environ.get("PYTHONPATH")]))}
        env.pop("AUTOMOE_CPU_ISA", None)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)

    native = cpu_isa == "avx512_bf16"
    for brgemm, aten in (("1", "0"), ("0", "1")):
        b = brgemm if native else "-"
        out = paths(f"{cpu_isa}:{b}:{aten}")
        assert out.returncode == 0, out.stderr
        got = eval(out.stdout)  # noqa: S307 (our own subprocess's dict)
        assert got["gemm_decisions"] == f"{cpu_isa}:{b}:{aten}"
        assert "adopted from AUTOMOE_CPU_GEMM_DECISIONS" in got["gemm_measured"]
        assert (got["gemm_fp32"] == "aten") == (aten == "1")
        if native:
            assert (got["gemm_bf16"] == "brgemm") == (brgemm == "1")
    other = "avx2" if cpu_isa != "avx2" else "avx512"
    out = paths(f"{other}:-:1")
    assert out.returncode != 0
    assert f"AUTOMOE_CPU_GEMM_DECISIONS={other}:-:1: the kernels run at {cpu_isa} here" in out.stderr
    out = paths(f"{cpu_isa}:yes")
    assert out.returncode != 0 and f"AUTOMOE_CPU_GEMM_DECISIONS={cpu_isa}:yes: expected" in out.stderr


def test_float32_grouped_gemm_on_the_engine_reads_transposed_weights_in_place():
    """The harness's float32 cases run on MKL where it measured faster (then transposed weights
    are copied first); here the engine is pinned for float32, and every GEMM path it has reads
    [G, K, O] weights through their [G, O, K] view: output and both gradients against float64."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cpu_isa = OPS._cpu_kernel_paths()["cpu_isa"]
    if cpu_isa == "baseline":
        pytest.skip("float32 always runs on ATen at baseline")
    code = (
        "import torch, automoe\n"
        "OPS = torch.ops.automoe\n"
        "g = torch.Generator().manual_seed(3)\n"
        "x = torch.randn(61, 33, generator=g)\n"
        "w = torch.randn(4, 33, 19, generator=g) * 0.2\n"
        "off = torch.tensor([0, 20, 20, 50, 58])\n"
        "dy = torch.randn(61, 19, generator=g)\n"
        "xr, wr = x.double().requires_grad_(), w.double().requires_grad_()\n"
        "OPS.grouped_gemm_reference(xr, wr.transpose(1, 2), off).backward(dy.double())\n"
        "ref = OPS.grouped_gemm_reference(xr, wr.transpose(1, 2), off)\n"
        "for path in OPS._cpu_gemm_paths():\n"
        "    OPS._set_cpu_paths('', path)\n"
        "    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()\n"
        "    y = OPS.grouped_gemm(xf, wf.transpose(1, 2), off)\n"
        "    y.backward(dy)\n"
        "    errs = [((a.double() - b).abs().max() / b.abs().max()).item()\n"
        "            for a, b in ((y, ref), (xf.grad, xr.grad), (wf.grad, wr.grad))]\n"
        "    print(path, dict(OPS._cpu_kernel_paths())['gemm_fp32'], max(errs))\n")
    pkg = str(Path(automoe.__file__).resolve().parents[1])
    env = {**os.environ, "AUTOMOE_CPU_GEMM_DECISIONS": f"{cpu_isa}:-:0",
           "PYTHONPATH": os.pathsep.join(filter(None, [pkg, os.environ.get("PYTHONPATH")]))}
    env.pop("AUTOMOE_CPU_ISA", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert [r[0] for r in rows] == list(OPS._cpu_gemm_paths())
    for path, fp32, err in rows:
        assert fp32 != "aten" and float(err) < 1e-5, (path, fp32, err)


def test_measured_gemm_choices_are_remembered_per_machine_and_adopted_by_the_next_process(tmp_path):
    """The first process measures and writes $AUTOMOE_CACHE/cpu_gemm; the next adopts that line
    instead of measuring (so two runs compute alike) — even a choice the probe would not make; an
    unreadable line is measured over; AUTOMOE_CPU_GEMM_DECISIONS wins and is not written down;
    AUTOMOE_CPU_GEMM_CACHE=off measures every time and writes nothing; another value is refused."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cpu_isa = OPS._cpu_kernel_paths()["cpu_isa"]
    if cpu_isa == "baseline":
        pytest.skip("no measured GEMM choice at baseline")
    pkg = str(Path(automoe.__file__).resolve().parents[1])
    code = ("import torch, automoe\n"
            "p = dict(torch.ops.automoe._cpu_kernel_paths())\n"
            "print(p['gemm_decisions']); print(p['gemm_fp32']); print(p['gemm_measured'])\n")
    cache = tmp_path / "cache"

    def run(cache_dir=str(cache), **extra):
        env = {**os.environ, "AUTOMOE_CACHE": cache_dir, **extra,
               "PYTHONPATH": os.pathsep.join(filter(None, [pkg, os.environ.get("PYTHONPATH")]))}
        env.pop("AUTOMOE_CPU_ISA", None)
        if "AUTOMOE_CPU_GEMM_DECISIONS" not in extra:
            env.pop("AUTOMOE_CPU_GEMM_DECISIONS", None)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)

    def paths(cache_dir=str(cache), **extra):
        out = run(cache_dir, **extra)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()[-3:]

    decisions, _, measured = paths()
    assert "GFLOP/s" in measured, measured
    lines = (cache / "cpu_gemm").read_text().splitlines()
    assert len(lines) == 1
    key, value = lines[0].split("\t")
    assert value == decisions and f"| {cpu_isa} |" in key and "threads | torch" in key, lines
    again = paths()
    # One note per measured choice (two where bf16 and float32 are both chosen), each adopted.
    assert again[0] == decisions, again
    assert set(again[2].split("; ")) == {f"adopted from the cache {cache / 'cpu_gemm'}"}, again
    # The line is what the next process computes with, whichever choice it names.
    aten = decisions.split(":")[2]
    flipped = decisions[:-1] + ("0" if aten == "1" else "1")
    (cache / "cpu_gemm").write_text(f"{key}\t{flipped}\n")
    got = paths()
    assert got[0] == flipped and (got[1] == "aten") == (flipped[-1] == "1"), got
    # A line that does not parse is measured over and rewritten.
    (cache / "cpu_gemm").write_text(f"{key}\tgarbage\nno tab here\n")
    got = paths()
    assert "GFLOP/s" in got[2], got
    assert (cache / "cpu_gemm").read_text().splitlines()[0] == f"{key}\t{got[0]}"
    # A pin beats the cache and is not written down; off measures and writes nothing.
    pinned = paths(AUTOMOE_CPU_GEMM_DECISIONS=flipped)
    assert pinned[0] == flipped and "adopted from AUTOMOE_CPU_GEMM_DECISIONS" in pinned[2]
    assert (cache / "cpu_gemm").read_text().splitlines()[0] == f"{key}\t{got[0]}"
    off = tmp_path / "off"
    assert "GFLOP/s" in paths(cache_dir=str(off), AUTOMOE_CPU_GEMM_CACHE="off")[2]
    assert not off.exists()
    bad = run(AUTOMOE_CPU_GEMM_CACHE="no")
    assert bad.returncode != 0 and "AUTOMOE_CPU_GEMM_CACHE=no: expected on or off" in bad.stderr


def test_the_gemm_engine_choice_does_not_move_the_global_generator():
    """The once-per-process timings that pick the float32 and bf16 GEMM paths must not draw from
    torch's generator (a seeded run would otherwise depend on which op ran first), and a path
    forced when they run (a test's) must not stand in for the engine in the cached choice."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = ("import torch, automoe\n"
            "torch.manual_seed(0)\n"
            "x, w = torch.ones(4, 8), torch.ones(2, 3, 8)\n"
            "torch.ops.automoe._set_cpu_paths('', 'generic')\n"
            "torch.ops.automoe.grouped_gemm(x, w, torch.tensor([0, 2, 4]))\n"
            "torch.ops.automoe._set_cpu_paths('', '')\n"
            "torch.ops.automoe.grouped_gemm(x.bfloat16(), w.bfloat16(), torch.tensor([0, 2, 4]))\n"
            "print(dict(torch.ops.automoe._cpu_kernel_paths())['gemm_measured'])\n"
            "print(torch.randn(4).tolist())\n")
    pkg = str(Path(automoe.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pkg, os.environ.get("PYTHONPATH")])),
           "AUTOMOE_CPU_GEMM_CACHE": "off"}  # measured here, not remembered from another process
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    torch.manual_seed(0)
    measured, drawn = out.stdout.splitlines()[-2:]
    assert drawn == str(torch.randn(4).tolist())
    if OPS._cpu_kernel_paths()["cpu_isa"] != "baseline":
        assert "aten" in measured and "generic" not in measured, measured


def test_cuda_kernels_table_in_docs_matches_the_engine():
    """docs/ops.md's "CUDA kernels" table names every CUDA kernel family, and the ones it marks as
    the default are exactly those the engine runs by default (ops/cuda_status.cpp)."""
    from pathlib import Path
    names, validated, _ = OPS._cuda_kernels()
    text = (Path(__file__).resolve().parents[2] / "docs" / "ops.md").read_text()
    table = text.split("## CUDA kernels: which run by default", 1)[1]
    rows = [line.split("|")[1:-1] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| CUDA kernel")]
    doc_names = [r[0].strip().split()[0] for r in rows]
    assert doc_names == list(names)
    doc_default = [r[0].strip().split()[0] for r in rows if not r[-1].strip().startswith("ATen")]
    assert sorted(doc_default) == sorted(validated)


# ---- no double backward -----------------------------------------------------------------------

DOUBLE_BACKWARD_CASES = {}
for _c in CASES:  # the first case of each op
    DOUBLE_BACKWARD_CASES.setdefault(_c.name.split("-")[0].split("(")[0], _c)


@pytest.mark.parametrize("case", list(DOUBLE_BACKWARD_CASES.values()), ids=list(DOUBLE_BACKWARD_CASES))
def test_fused_ops_refuse_a_double_backward_by_name(case):
    """The fused ops compute their gradients outside autograd: a backward that builds a graph
    (create_graph=True) is refused by name rather than silently missing their second-order part;
    the plain backward of the same graph still runs."""
    g = torch.Generator().manual_seed(0)
    # (linear in bf16: where ATen's bf16 GEMM is not native that is the engine's path)
    dtype = torch.bfloat16 if case.name.startswith("linear-") else torch.float32
    inputs = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
              for t in case.make(g)]
    for i in case.grad:
        inputs[i].requires_grad_(True)
    leaves = [inputs[i] for i in case.grad]

    def loss():
        out = as_tuple(case.fused(*inputs))
        return sum((out[i].float() * (1 + torch.arange(out[i].numel()).view_as(out[i]) % 3)).sum()
                   for i in case.float_outputs if out[i].requires_grad)

    try:
        second = torch.autograd.grad(loss(), leaves, create_graph=True)
    except Exception as e:  # noqa: BLE001 (the op's error, through autograd)
        assert re.search(r"automoe\.\w.*: no double backward", str(e)), str(e)
    else:  # only ops::linear hands some calls to at::linear, whose backward builds the graph:
        # those where ATen's bf16 GEMM is native (never on a CPU without AVX512_BF16 / AMX)
        assert case.name.startswith("linear-") and all(gr.requires_grad for gr in second)
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        assert "avx512_bf16" in flags or "amx_bf16" in flags
    grads = torch.autograd.grad(loss(), leaves, allow_unused=True)
    assert any(gr is not None for gr in grads)


# ---- the trainer's AdamW for bf16 weights (optimizer.master_weights / state_dtype) --------------

ADAMW = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
ADAMW_SHAPES = [(37, 19), (5, 3, 11), (1, 1), (4099,)]  # odd lengths: every vector tail


def adamw_run(params, grads_per_step, *, state_dtype, remainders=None, grad_scale=1.0):
    """Our AdamW (automoe._C._adamw_step: the trainer's update) for len(grads_per_step) steps."""
    from automoe import _C

    m = [torch.zeros(p.shape, dtype=state_dtype) for p in params]
    v = [torch.zeros(p.shape, dtype=state_dtype) for p in params]
    for step, grads in enumerate(grads_per_step, start=1):
        _C._adamw_step(params, grads, m, v, remainders or [], step, ADAMW["lr"], *ADAMW["betas"],
                       ADAMW["eps"], ADAMW["weight_decay"], grad_scale)
    return m, v


def torch_adamw_run(params, grads_per_step):
    """torch.optim.AdamW(fused=True) — one group, every tensor decayed — on the same gradients."""
    params = [p.clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(params, fused=True, **ADAMW)
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.to(p.dtype).clone()
        opt.step()
    return [p.detach() for p in params]


def adamw_case(seed=7, steps=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) * 0.05 for s in ADAMW_SHAPES]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in ADAMW_SHAPES] for _ in range(steps)]
    return params, grads


@pytest.fixture(params=["cpu"] + CPU_VARIANTS)
def cpu_path(request):
    if request.param.startswith("cpu:"):
        isa, _, gemm = request.param[4:].partition("+")
        OPS._set_cpu_paths(isa, gemm)
    yield request.param
    OPS._set_cpu_paths("", "")


def test_adamw_float32_weights_step_as_torch_fused_adamw(cpu_path):
    """The kernel with float32 weights, moments and bf16 or float32 gradients (a bf16 run's
    float32 masters) against torch.optim.AdamW(fused=True) over six steps."""
    for grad_dtype in (torch.float32, torch.bfloat16):
        params, grads = adamw_case(dtype=grad_dtype)
        ref = torch_adamw_run(params, grads)
        ours = [p.clone() for p in params]
        adamw_run(ours, grads, state_dtype=torch.float32)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_adamw_bf16_weights_and_moments_step_as_torch_fused_adamw_on_a_bf16_model(cpu_path):
    """master_weights none + state_dtype bfloat16 is what torch.optim.AdamW(fused=True) does to a
    bf16 model (float32 math, every state rounded to bf16): the same bits after six steps. (The
    baseline path has no FMA for the first moment's lerp, which ATen fuses: there a rare weight
    may round to a neighbouring bf16 value.)"""
    params, grads = adamw_case(dtype=torch.bfloat16)
    params = [p.to(torch.bfloat16) for p in params]
    ref = torch_adamw_run(params, grads)
    ours = [p.clone() for p in params]
    adamw_run(ours, grads, state_dtype=torch.bfloat16)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.bfloat16
        if "baseline" in cpu_path:
            assert int((a != b).sum()) <= max(1, a.numel() // 1000)
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -6, atol=ADAMW["lr"] / 32)
        else:
            assert torch.equal(a, b), f"{int((a != b).sum())} of {a.numel()} weights differ"


def test_adamw_remainders_keep_the_float32_masters_bit_for_bit(cpu_path):
    """master_weights remainders: the bf16 weight and its 16-bit remainder hold exactly the float32
    master that master_weights float32 keeps — the same bits after six steps — and the bf16
    weight is that master rounded half away from zero. Also with clipping's scale and bf16
    moments."""
    from automoe import _C

    for state_dtype, scale in ((torch.float32, 1.0), (torch.bfloat16, 0.37)):
        params, grads = adamw_case(dtype=torch.bfloat16)
        split = [_C._split_master(p) for p in params]
        weights, rems = [s[0] for s in split], [s[1] for s in split]
        masters = [p.clone() for p in params]
        m1, v1 = adamw_run(masters, grads, state_dtype=state_dtype, grad_scale=scale)
        m2, v2 = adamw_run(weights, grads, state_dtype=state_dtype, remainders=rems, grad_scale=scale)
        for w, r, master in zip(weights, rems, masters):
            assert w.dtype == torch.bfloat16 and r.dtype == torch.int16
            joined = _C._join_master(w, r)
            assert torch.equal(joined.view(torch.int32), master.view(torch.int32))
            assert torch.equal(w, _C._split_master(master)[0])
        for a, b in zip(m1 + v1, m2 + v2):
            assert torch.equal(a, b)


# ---- 8-bit moments (optimizer.state_dtype: 8bit) -------------------------------------------------


def dynamic_map_reference(signed):
    """The block-wise 8-bit optimizers' dynamic map (Dettmers et al. 2022) from its description:
    decade 10^(i-6), i = 0..6, holds the middles of [0.1, 1] cut into 2^i equal bins (unsigned:
    2^(i+1)), signed with their negatives; plus 0 and 1."""
    vals = [0.0, 1.0]
    for i in range(7):
        bins = 2 ** i if signed else 2 ** (i + 1)
        for k in range(bins):
            middle = 10.0 ** (i - 6) * (0.1 + 0.9 * (k + 0.5) / bins)
            vals += [middle, -middle] if signed else [middle]
    return torch.tensor(sorted(vals), dtype=torch.float64)


def test_8bit_map_is_the_dynamic_map_with_its_midpoints():
    from automoe import _C

    for signed in (True, False):
        values, mids = _C._qmap8(signed)
        ref = dynamic_map_reference(signed)
        assert values.shape == (256,) and mids.shape == (255,)
        assert torch.equal(values, ref.float())
        assert bool((values[1:] > values[:-1]).all())
        assert 0.0 in values.tolist() and 1.0 in values.tolist()
        v64 = values.double()
        assert torch.equal(mids, ((v64[1:] + v64[:-1]) / 2).float())
        if not signed:
            assert float(values.min()) == 0.0


def test_8bit_code_table_finds_the_nearest_map_value_for_every_kind_of_float():
    """The CPU kernel's code lookup (a table by the float's upper 16 bits, then one midpoint
    compare) gives the nearest map value's index, ties to the lower, as a search of the sorted
    midpoints does: at every midpoint and its float neighbours, map values, a sweep of 2^20 bit
    patterns, zeros, infinities, subnormals."""
    from automoe import _C

    g = torch.Generator().manual_seed(2)
    for signed in (True, False):
        values, mids = _C._qmap8(signed)
        inf = torch.tensor(float("inf"))
        near = torch.cat([mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf), values])
        bits = torch.randint(0, 2 ** 32, (1 << 20,), generator=g, dtype=torch.int64)
        sweep = (bits - (bits >= 2 ** 31).long() * 2 ** 32).to(torch.int32).view(torch.float32)
        special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-38, float("inf"),
                                -float("inf"), 3e38, -3e38])
        x = torch.cat([near, sweep[torch.isfinite(sweep) | torch.isinf(sweep)], special])
        want = torch.searchsorted(mids, x, right=False)
        got = _C._code8(x, signed)
        assert torch.equal(got.long(), want), x[got.long() != want][:8]
        # The kernel's row (on AVX2 computed from the map's decades and bins): the same codes but
        # within float rounding of a midpoint, where it may take the other neighbour.
        finite = x[torch.isfinite(x)]
        want = torch.searchsorted(mids, finite, right=False)
        got = _C._code8(finite, signed, row=True).long()
        off = got != want
        assert int((got - want).abs().max()) <= 1
        gap = (finite[off, None].double() - mids[None, :].double()).abs().min(dim=1).values
        assert bool((gap <= 1e-6 * finite[off].double().abs()).all()), finite[off][gap.argmax()]
        assert int(off.sum()) <= len(mids) * 3  # (only the midpoints and their neighbours)


def test_8bit_row_quantizer_gives_the_same_codes_on_every_vector_path():
    """The vectorised row quantizer (AVX-512: 16 lanes; AVX2: 8; the table elsewhere) runs the same
    operations lane for lane: AVX-512 and AVX2 give identical codes, NaN, infinities, subnormals
    and values at the midpoints included, over a length that leaves a scalar tail."""
    from automoe import _C

    levels = [p.partition(":")[2] for p in CPU_PATHS if "+" not in p]
    vector = [lv for lv in levels if lv in ("avx512", "avx2", "")]
    g = torch.Generator().manual_seed(4)
    for signed in (True, False):
        _, mids = _C._qmap8(signed)
        inf = torch.tensor(float("inf"))
        x = torch.cat([mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf),
                       torch.randn(4099, generator=g) * 0.3,
                       torch.tensor([0.0, -0.0, 1e-45, -1e-40, float("nan"), float("inf"),
                                     -float("inf"), 3e38])])
        codes = {}
        for lv in vector:
            OPS._set_cpu_paths(lv, "")
            try:
                codes[lv] = _C._code8(x, signed, row=True)
            finally:
                OPS._set_cpu_paths("", "")
        if "avx512" in codes and "avx2" in codes:
            assert torch.equal(codes["avx512"], codes["avx2"])
        for got in codes.values():  # the nearest value but within rounding of a midpoint
            finite = torch.isfinite(x)
            want = torch.searchsorted(mids, x[finite], right=False)
            assert int((got[finite].long() - want).abs().max()) <= 1


def quantize_reference(x, signed, block=256):
    """Codes and scales of x ([..., cols], float64) as AdamW's 8-bit state keeps them: blocks of
    `block` along the last dimension, each divided by its largest magnitude, nearest map value
    (the number of midpoints below)."""
    from automoe import _C

    _, mids = _C._qmap8(signed)
    cols = x.shape[-1]
    nb = -(-cols // block)
    rows = x.reshape(-1, cols)
    padded = torch.nn.functional.pad(rows, (0, nb * block - cols)).view(rows.shape[0], nb, block)
    scale = padded.abs().amax(-1)
    normalized = padded * torch.where(scale > 0, 1 / scale, torch.zeros_like(scale)).unsqueeze(-1)
    codes = torch.searchsorted(mids.double(), normalized.contiguous(), right=False)
    codes = codes.view(rows.shape[0], nb * block)[:, :cols].reshape(x.shape)
    return codes.to(torch.uint8), scale.view(*x.shape[:-1], nb) if x.dim() > 1 else scale.view(nb)


def dequantize_reference(codes, scale, signed, block=256):
    from automoe import _C

    values, _ = _C._qmap8(signed)
    cols = codes.shape[-1]
    s = scale.double().reshape(-1, scale.shape[-1]).repeat_interleave(block, 1)[:, :cols]
    return (values.double()[codes.long()].reshape(-1, cols) * s).reshape(codes.shape)


# partial blocks; (300, 600): rows split between threads; 1-D: float32
ADAMW8_SHAPES = [(17, 300), (3, 5, 600), (37, 19), (300, 600), (4099,)]


def test_adamw_8bit_moments_step_as_a_float64_reference(cpu_path):
    """state_dtype 8bit: each step dequantizes the moments block by block, updates weight and
    moments in float32 as AdamW does, and quantizes the moments again with the block's new absmax
    (the weight update uses the unrounded moments) — against float64 arithmetic on the same state,
    step after step, for float32 and bf16 weights, float32 and bf16 gradients, with clipping's
    scale; 1-D tensors keep float32 moments."""
    from automoe import _C

    lr, (b1, b2), eps, wd = ADAMW["lr"], ADAMW["betas"], ADAMW["eps"], ADAMW["weight_decay"]
    g = torch.Generator().manual_seed(11)
    for wdtype, gdtype, scale_g in ((torch.float32, torch.float32, 1.0),
                                    (torch.float32, torch.bfloat16, 0.37),
                                    (torch.bfloat16, torch.bfloat16, 1.0)):
        params = [(torch.randn(s, generator=g) * 0.05).to(wdtype) for s in ADAMW8_SHAPES]
        q8 = [p.dim() >= 2 for p in params]
        m = [torch.zeros(p.shape, dtype=torch.uint8 if q else torch.float32) for p, q in zip(params, q8)]
        v = [torch.zeros_like(t) for t in m]
        sc_shape = [(*p.shape[:-1], -(-p.shape[-1] // 256)) for p in params]
        ms = [torch.zeros(s) if q else torch.zeros(0) for s, q in zip(sc_shape, q8)]
        vs = [torch.zeros_like(t) for t in ms]
        codes_differ = codes_total = 0
        for step in range(1, 7):
            grads = [(torch.randn(p.shape, generator=g) * (1 + 3 * torch.rand(p.shape, generator=g))
                      ).to(gdtype) for p in params]
            before = [(p.double(), a.clone(), b.clone(), c.clone(), d.clone())
                      for p, a, b, c, d in zip(params, m, v, ms, vs)]
            _C._adamw_step(params, grads, m, v, [], step, lr, b1, b2, eps, wd, scale_g,
                           exp_avg_scales=ms, exp_avg_sq_scales=vs)
            for i, (p0, m0, v0, s0, t0) in enumerate(before):
                gr = grads[i].double() * float(torch.tensor(scale_g, dtype=torch.float32))
                if q8[i]:
                    mm, vv = dequantize_reference(m0, s0, True), dequantize_reference(v0, t0, False)
                else:
                    mm, vv = m0.double(), v0.double()
                mm = mm + (1 - b1) * (gr - mm)
                vv = vv * b2 + (1 - b2) * gr * gr
                denom = vv.sqrt() / math.sqrt(1 - b2 ** step) + eps
                p_ref = p0 * (1 - lr * wd) - lr / (1 - b1 ** step) * mm / denom
                tol = dict(rtol=1e-5, atol=1e-7) if wdtype == torch.float32 else \
                    dict(rtol=2 ** -7, atol=1e-6)  # one bf16 ulp: float32 vs float64 at a tie
                torch.testing.assert_close(params[i].double(), p_ref.to(wdtype).double(), **tol)
                if not q8[i]:
                    torch.testing.assert_close(m[i].double(), mm, rtol=1e-5, atol=1e-6)
                    continue
                for got, got_s, want, signed in ((m[i], ms[i], mm, True), (v[i], vs[i], vv, False)):
                    want_c, want_s = quantize_reference(want, signed)
                    torch.testing.assert_close(got_s.double(), want_s, rtol=1e-5, atol=0)
                    diff = (got.int() - want_c.int()).abs()
                    assert int(diff.max()) <= 1  # float32 vs float64 at a midpoint
                    codes_differ += int((diff > 0).sum())
                    codes_total += diff.numel()
        assert codes_differ <= codes_total // 1000, (codes_differ, codes_total)
        # ... and the moments were quantized: the codes span the map
        assert len(torch.unique(m[0])) > 100


def test_adamw_8bit_moments_dequantize_exactly_to_the_map(cpu_path):
    """The kernel's dequantization (AVX-512: the map in registers, two-register permutes) gives
    every code's map value times its block's scale exactly: with beta2 = 1 (v kept) and a
    gradient equal to the dequantized first moment (m kept), a step quantizes the moments back to
    the same codes and scales — every one of the 256 codes, in full blocks and a block's tail."""
    from automoe import _C

    g = torch.Generator().manual_seed(12)
    shape = (3, 600)  # blocks of 256, 256, 88 per row
    m = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    v = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    m[:, :256] = torch.arange(256, dtype=torch.uint8)  # every code, in a full block
    v[:, 256:512] = torch.arange(256, dtype=torch.uint8)
    m[:, ::256], m[:, 599] = 255, 255  # each block's absmax: the map's 1.0, so the scale holds
    v[:, ::256], v[:, 599] = 255, 255
    ms = torch.rand(3, 3, generator=g) * 0.01 + 1e-3
    vs = torch.rand(3, 3, generator=g) * 1e-4 + 1e-6
    grad = _C._dequantize8(m, ms, True)  # AdamW::dequantize8, the ATen composition
    assert torch.equal(grad, _C._qmap8(True)[0][m.long()] * ms.repeat_interleave(256, 1)[:, :600])
    m1, v1, ms1, vs1 = m.clone(), v.clone(), ms.clone(), vs.clone()
    p = torch.zeros(shape)
    _C._adamw_step([p], [grad], [m1], [v1], [], 1, 1e-3, 0.9, 1.0, 1e-8, 0.0,
                   exp_avg_scales=[ms1], exp_avg_sq_scales=[vs1])
    assert torch.equal(m1, m) and torch.equal(v1, v)
    assert torch.equal(ms1, ms) and torch.equal(vs1, vs)


def test_adamw_8bit_aten_update_quantizes_nan_and_inf_moments_as_the_cpu_kernel():
    """A NaN or an infinite gradient (which the trainer skips before the optimizer, but the op
    takes) reaches the 8-bit moments alike on both paths, two steps on: the NaN stays out of its
    block's absmax (the block's other moments keep their scale) and takes the code of 0; an
    infinity's block scales to NaN, then empties. Before, the ATen path (other devices) zeroed
    the NaN's whole block."""
    from automoe import _C

    g = torch.Generator().manual_seed(8)
    # blocks of 256: a NaN in row 0's first block (the CPU kernel's vector loop), another at
    # row 2's last column (its scalar tail: 601 = 2 * 256 + 11 * 8 + 1), +inf in row 1's second
    shape = (3, 601)
    p0 = torch.randn(shape, generator=g) * 0.05
    grad = torch.randn(shape, generator=g)
    grad[0, 7] = grad[2, 600] = float("nan")
    grad[1, 300] = float("inf")
    q = {}
    for aten in (True, False):
        p = p0.bfloat16()
        m, v = torch.zeros(shape, dtype=torch.uint8), torch.zeros(shape, dtype=torch.uint8)
        ms, vs = torch.zeros(3, 3), torch.zeros(3, 3)
        for step in (1, 2):
            _C._adamw_step([p], [grad], [m], [v], [], step, ADAMW["lr"], *ADAMW["betas"],
                           ADAMW["eps"], ADAMW["weight_decay"], 1.0, aten=aten,
                           exp_avg_scales=[ms], exp_avg_sq_scales=[vs])
        q[aten] = (m, v, ms, vs)
    (ma, va, msa, vsa), (mk, vk, msk, vsk) = q[True], q[False]
    torch.testing.assert_close(msa, msk, rtol=1e-6, atol=0)
    torch.testing.assert_close(vsa, vsk, rtol=1e-6, atol=0)
    assert torch.isfinite(msa[0, 0]) and msa[0, 0] > 0  # the NaN's block kept its scale
    values, _ = _C._qmap8(True)
    for at in ((0, 7), (2, 600)):
        assert values[int(ma[at])] == 0 and values[int(mk[at])] == 0
    for a, k in ((ma, mk), (va, vk)):
        diff = (a.int() - k.int()).abs()
        assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= 2


@pytest.mark.parametrize("masters,moments", [("float32", torch.float32), ("remainders", torch.bfloat16),
                                             ("none", torch.bfloat16), ("none", "8bit")])
def test_adamw_aten_update_matches_the_cpu_kernel(masters, moments):
    """The update other devices run (ATen ops, row chunks; here forced on CPU tensors) against the
    fused CPU kernel, six steps from the same state: float32 / remainder / bf16 masters, float32,
    bf16 and 8-bit moments."""
    from automoe import _C

    g = torch.Generator().manual_seed(4)
    shapes = [(17, 300), (3, 5, 600), (37, 19), (4099,)]
    params0 = [torch.randn(s, generator=g) * 0.05 for s in shapes]
    grads = [[torch.randn(s, generator=g).bfloat16() for s in shapes] for _ in range(6)]

    def run(aten, steps=6):
        if masters == "float32":
            params, rems = [p.clone() for p in params0], []
        elif masters == "remainders":
            split = [_C._split_master(p) for p in params0]
            params, rems = [s[0] for s in split], [s[1] for s in split]
        else:
            params, rems = [p.bfloat16() for p in params0], []
        q8 = moments == "8bit"
        sd = [torch.uint8 if q8 and p.dim() >= 2 else (torch.float32 if q8 else moments) for p in params]
        m = [torch.zeros(p.shape, dtype=d) for p, d in zip(params, sd)]
        v = [torch.zeros_like(t) for t in m]
        sc = [torch.zeros(*p.shape[:-1], -(-p.shape[-1] // 256)) if q8 and p.dim() >= 2 else torch.zeros(0)
              for p in params]
        sc2 = [torch.zeros_like(t) for t in sc]
        extra = dict(exp_avg_scales=sc, exp_avg_sq_scales=sc2) if q8 else {}
        for step, gs in enumerate(grads[:steps], start=1):
            _C._adamw_step(params, gs, m, v, rems, step, ADAMW["lr"], *ADAMW["betas"], ADAMW["eps"],
                           ADAMW["weight_decay"], 0.5, aten=aten, **extra)
        return params, m, v, sc

    if moments == "8bit":  # one step from zero moments: the same weights, codes and scales
        (pa, ma, va, sa), (pk, mk, vk, sk) = run(True, 1), run(False, 1)
        for a, k in zip(pa, pk):  # bf16: a rare weight one ulp apart (FMA or not)
            assert int((a != k).sum()) <= max(1, a.numel() // 1000)
            torch.testing.assert_close(a.float(), k.float(), rtol=2 ** -7, atol=0)
        for a, k in zip(sa, sk):
            torch.testing.assert_close(a, k, rtol=1e-6, atol=0)
        for a, k in zip(ma + va, mk + vk):
            diff = (a.int() - k.int()).abs()  # (at midpoints: float rounding on either path)
            assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= max(1, a.numel() // 500)
    (pa, ma, va, sa), (pk, mk, vk, sk) = run(True), run(False)
    for a, k in zip(pa, pk):
        assert a.dtype == k.dtype
        if moments == "8bit":
            # A code one apart at a midpoint (float rounding on either path) changes that weight's
            # later steps, by up to Adam's step size where exp_avg_sq's code is coarse.
            diff = (a.float() - k.float()).abs()
            assert float((diff > ADAMW["lr"] * 0.02).float().mean()) <= 0.01
            assert float(diff.max()) <= 2 * ADAMW["lr"]
        elif a.dtype == torch.bfloat16:  # (FMA or not: a rare weight a bf16 ulp or two apart)
            assert int((a != k).sum()) <= max(1, a.numel() // 500)
            torch.testing.assert_close(a.float(), k.float(), rtol=2 ** -6, atol=ADAMW["lr"] / 64)
        else:
            torch.testing.assert_close(a, k, rtol=1e-6, atol=1e-7)
    for a, k in zip(ma + va, mk + vk):
        if a.dtype == torch.uint8:  # (compounded as above: a few codes apart)
            assert int(((a.int() - k.int()).abs() > 0).sum()) <= max(1, a.numel() // 100)
        else:
            torch.testing.assert_close(a.float(), k.float(), rtol=2 ** -7, atol=1e-6)
    for a, k in zip(sa, sk):
        torch.testing.assert_close(a, k, rtol=2e-2, atol=0)


def test_8bit_blocks_below_the_smallest_normal_float_flush_to_zero_without_nan(cpu_path):
    """A block whose moments decay below the smallest normal float (rows no gradient reaches any
    more) is stored as zero — its reciprocal would overflow — on the kernel and the ATen path."""
    from automoe import _C

    for aten in (False, True):
        p = [torch.randn(4, 512) * 0.05]
        m = [torch.full((4, 512), 200, dtype=torch.uint8)]
        v = [torch.full((4, 512), 200, dtype=torch.uint8)]
        sm = [torch.tensor([[3e-39, 1.0]] * 4)]  # block 0: subnormal absmax, block 1 normal
        sv = [torch.tensor([[1e-45, 1.0]] * 4)]
        grads = torch.zeros(4, 512)
        grads[:, 256:] = 1.0
        _C._adamw_step(p, [grads], m, v, [], 3, ADAMW["lr"], *ADAMW["betas"], ADAMW["eps"],
                       0.0, 1.0, exp_avg_scales=sm, exp_avg_sq_scales=sv, aten=aten)
        assert torch.isfinite(p[0]).all()
        assert torch.equal(sm[0][:, 0], torch.zeros(4)) and torch.equal(sv[0][:, 0], torch.zeros(4))
        for codes, signed in ((m[0], True), (v[0], False)):
            assert bool((_C._dequantize8(codes, (sm if signed else sv)[0], signed)[:, :256] == 0).all())
        assert bool((sm[0][:, 1] > 0).all())


def test_8bit_aten_composition_quantizes_as_the_reference():
    """AdamW::quantize8 / dequantize8 (the ATen ops the step uses off the CPU, e.g. on CUDA)
    against the float64 reference: the same codes, scales and values, zero blocks included."""
    from automoe import _C

    g = torch.Generator().manual_seed(5)
    for shape in [(3, 7, 300), (4099,), (2, 256)]:
        for signed in (True, False):
            x = torch.randn(shape, generator=g) * torch.logspace(-6, 0, shape[-1])
            x = x if signed else x.abs()
            x.view(-1, shape[-1])[0, :256] = 0  # an all-zero block
            codes = torch.zeros(shape, dtype=torch.uint8)
            scale = torch.zeros(*shape[:-1], -(-shape[-1] // 256)) if len(shape) > 1 else \
                torch.zeros(-(-shape[-1] // 256))
            _C._quantize8(x, codes, scale, signed)
            want_c, want_s = quantize_reference(x.double(), signed)
            torch.testing.assert_close(scale.double(), want_s, rtol=0, atol=0)
            diff = (codes.int() - want_c.int()).abs()
            assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= max(1, x.numel() // 1000)
            back = _C._dequantize8(codes, scale, signed)
            torch.testing.assert_close(back.double(), dequantize_reference(codes, scale, signed),
                                       rtol=1e-6, atol=0)
            # the nearest map value: off by at most half the map's widest gap (0.9 / 64 near the
            # top, where a block's most negative value, -absmax, meets -0.993) times the absmax
            err = (back.double() - x.double()).abs()
            assert float(err.max()) <= 0.0071 * float(x.abs().max()) + 1e-12


def test_remainder_split_and_join_are_exact_for_every_float():
    """join(split(x)) == x bit for bit: normal, subnormal, signed zeros, ties (lower half 0x8000),
    infinities; the bf16 part is x rounded half away from zero."""
    from automoe import _C

    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 16,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, float("inf"), float("-inf"),
                            3.4e38, -3.4e38])
    ties = (torch.arange(-1000, 1000, dtype=torch.int32) * 0x10000 + 0x8000).view(torch.float32)
    x = torch.cat([x[torch.isfinite(x)], special, ties])
    hi, lo = _C._split_master(x)
    assert torch.equal(_C._join_master(hi, lo).view(torch.int32), x.view(torch.int32))
    finite = torch.isfinite(x) & (x.abs() < 3.38e38)
    want = torch.where(x >= 0, x.double(), -x.double())  # magnitude, rounded half up
    up = (x.view(torch.int32) & 0xFFFF) >= 0x8000
    mag = hi.float().abs().double()
    assert torch.all(torch.where(up, mag >= want, mag <= want)[finite])
