"""One rank of tests/python/test_parallel.py's dispatcher checks, started by torchrun (Gloo).

Every rank builds the same inputs from a fixed seed: each rank's tokens, routing and combine
weights, and every expert's weights. It runs its own tokens through an expert-parallel dispatcher
holding only its own experts, and compares the output, the gradients of its tokens, combine
weights and experts, and the bytes the dispatcher counted, with a float64 reference computed from
all ranks' inputs and all experts in this process. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from automoe import _C

E, H, I, K = 8, 12, 12, 2  # sizes ATen's _grouped_mm accepts (16-byte strides in float32)


def inputs(P: int, routing: str, tokens: list[int]):
    g = torch.Generator().manual_seed(7)
    xs, idxs, ws, gs = [], [], [], []
    for r in range(P):
        T = tokens[r]
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        if routing == "random":
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
        else:  # every token to experts of rank 0 only (the other ranks receive nothing)
            idx = torch.stack([torch.randperm(E // P, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
        xs.append(x)
        idxs.append(idx)
        ws.append(torch.rand(T, K, generator=g, dtype=torch.float64))
        gs.append(torch.randn(T, H, generator=g, dtype=torch.float64))
    w_gu = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) * 0.3
    w_d = torch.randn(E, H, I, generator=g, dtype=torch.float64) * 0.3
    return xs, idxs, ws, gs, w_gu, w_d


def reference(x, idx, w, w_gu, w_d):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[t, k]
            gate, up = (w_gu[e] @ x[t]).chunk(2)
            out[t] = out[t] + w[t, k] * (w_d[e] @ (F.silu(gate) * up))
    return out


def check(kind: str, backend: str, routing: str, tokens: list[int], group, failures: list):
    P, r = dist.get_world_size(group), dist.get_rank(group)
    L = E // P
    xs, idxs, ws, gs, w_gu, w_d = inputs(P, routing, tokens)
    # Reference over every rank's tokens with all experts.
    rx = [x.clone().requires_grad_() for x in xs]
    rw = [w.clone().requires_grad_() for w in ws]
    rgu, rd = w_gu.clone().requires_grad_(), w_d.clone().requires_grad_()
    outs = [reference(rx[i], idxs[i], rw[i], rgu, rd) for i in range(P)]
    sum((o * g).sum() for o, g in zip(outs, gs)).backward()
    # This rank, its experts only (ATen's _grouped_mm takes no float64: float32 there).
    dt = torch.float32 if backend == "torch_mm" else torch.float64
    rtol, atol = (2e-5, 1e-6) if dt == torch.float32 else (1e-9, 1e-11)
    x, w = xs[r].to(dt).requires_grad_(), ws[r].to(dt).requires_grad_()
    gu = w_gu[r * L:(r + 1) * L].to(dt).requires_grad_()
    d = w_d[r * L:(r + 1) * L].to(dt).requires_grad_()
    out, stats = _C.dispatch_experts(kind, group.group_name, E, x, idxs[r], w, gu, d, backend, 3)
    (out * gs[r].to(dt)).sum().backward()
    name = f"{kind}/{backend}/{routing}/tokens={tokens} rank {r}"

    def close(a, b, what):
        a = torch.zeros(()) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        a, b = a.double(), b.double()
        if a.shape != b.shape or not torch.allclose(a, b, rtol=rtol, atol=atol):
            diff = (a - b).abs().max().item() if a.shape == b.shape else f"shape {a.shape} vs {b.shape}"
            failures.append(f"{name}: {what} differs ({diff})")

    close(out, outs[r].detach(), "output")
    close(x.grad if x.grad is not None else torch.zeros_like(x), rx[r].grad, "d tokens")
    close(w.grad if w.grad is not None else torch.zeros_like(w), rw[r].grad, "d combine weights")
    close(gu.grad, rgu.grad[r * L:(r + 1) * L], "d gate_up")
    close(d.grad, rd.grad[r * L:(r + 1) * L], "d down")
    # Bytes this rank counted (forward), against docs/parallelism.md's formulas.
    el = torch.finfo(dt).bits // 8
    row = H * el  # one token row
    to_peer = [int((idxs[r] // L == j).sum()) for j in range(P)]  # my slots routed to rank j
    from_peer = [int((idxs[i] // L == r).sum()) for i in range(P)]  # rank i's slots routed to me
    T = tokens
    if kind == "allgather":
        # token counts; tokens, expert ids (int64) and combine weights out to every peer; partial
        # sums back (reduce-scatter)
        sent = (P - 1) * 8 + (P - 1) * T[r] * (row + K * 8 + K * el) + (sum(T) - T[r]) * row
        received = (P - 1) * 8 + (sum(T) - T[r]) * (row + K * 8 + K * el) + (P - 1) * T[r] * row
    else:
        chunks = 3 if kind == "alltoall_overlap" else 1
        counts = (P - 1) * chunks * L * 8  # per-expert counts, once per chunk
        out_rows = sum(to_peer) - to_peer[r]  # dispatched to peers
        back_rows = sum(from_peer) - from_peer[r]  # results returned to peers
        sent = counts + (out_rows + back_rows) * row
        received = counts + (back_rows + out_rows) * row
    rows = sum(from_peer)
    got = (stats["bytes_sent"], stats["bytes_received"], stats["rows_computed"])
    if got != (sent, received, rows):
        failures.append(f"{name}: counted (sent, received, rows) {got}, formula {(sent, received, rows)}")


def main():
    dist.init_process_group("gloo")
    P = dist.get_world_size()
    group = dist.new_group(list(range(P)))
    failures: list[str] = []
    cases = json.loads(sys.argv[1])
    for kind, backend, routing, tokens in cases:
        check(kind, backend, routing, tokens, group, failures)
    dist.destroy_process_group()
    for f in failures:
        print(f, file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
