"""The evidence for docs/ops.md's "CUDA kernels" table, from one bench/gpu.sh run.

Reads the op harness's JUnit report (tests/python/test_ops.py run with AUTOMOE_CUDA_KERNELS=all,
so that CUDA cases run our kernels) and the op benchmark's JSON on the same GPU, and prints one
row per CUDA kernel family: how many of its CUDA cases passed, and its forward + backward time
against the ATen reference composition. A family becomes a CUDA default only when every case
passed (csrc/automoe/ops/cuda_status.cpp lists those; a session copies the rows into docs/ops.md).

    python bench/cuda_kernels.py --junit OUT/test_ops.xml --ops OUT/ops-qwen3-30b-a3b.json \
        --gpu "NVIDIA H200" [--json OUT/cuda_kernels.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import xml.etree.ElementTree as ET

# kernel family -> (prefixes of the harness's case names, prefixes of the op benchmark's rows)
FAMILIES = {
    "router": (("router",), ("router",)),
    "permute": (("permute", "unpermute"), ("permute", "unpermute")),
    "grouped_gemm": (("grouped_gemm",), ("grouped_gemm",)),
    "swiglu": (("swiglu",), ("swiglu",)),
    "rmsnorm": (("rmsnorm",), ("rmsnorm",)),
    "rope": (("rope",), ("rope",)),
    "causal_conv1d": (("causal_conv1d",), ("causal_conv1d",)),
    "gated_rmsnorm": (("gated_rms_norm",), ("gated_rms_norm",)),
    "ssd_scan": (("ssd_scan",), ("ssd_scan",)),
}


def harness_results(path: str) -> dict[str, dict[str, int]]:
    """family -> {"passed": n, "failed": n} over the CUDA cases of the op harness."""
    out = {f: {"passed": 0, "failed": 0} for f in FAMILIES}
    for case in ET.parse(path).getroot().iter("testcase"):
        m = re.match(r"test_fused_op_matches_float64_reference\[(.*)-(fp32|bf16)-cuda\]$",
                     case.get("name", ""))
        if not m:
            continue
        name = m.group(1)
        if any(child.tag == "skipped" for child in case):
            continue
        bad = any(child.tag in ("failure", "error") for child in case)
        for family, (prefixes, _) in FAMILIES.items():
            if any(name.startswith(p) for p in prefixes):
                out[family]["failed" if bad else "passed"] += 1
                break
    return out


def speedups(path: str) -> dict[str, list[tuple[str, float]]]:
    """family -> [(op row, ATen reference time / ours)] from ops_bench's JSON."""
    doc = json.load(open(path))
    rows = doc.get("ops", doc.get("rows", [])) if isinstance(doc, dict) else doc
    out: dict[str, list[tuple[str, float]]] = {f: [] for f in FAMILIES}
    for row in rows:
        if not isinstance(row, dict) or row.get("speedup") is None:
            continue
        for family, (_, prefixes) in FAMILIES.items():
            if any(row["op"].startswith(p) for p in prefixes):
                out[family].append((row["op"], row["speedup"]))
                break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junit", required=True)
    ap.add_argument("--ops", help="bench/ops_bench.py --json output on the same GPU")
    ap.add_argument("--gpu", required=True, help="the GPU's name (nvidia-smi)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    tests = harness_results(a.junit)
    speed = speedups(a.ops) if a.ops else {f: [] for f in FAMILIES}
    day = datetime.date.today().isoformat()
    rows = []
    print("| CUDA kernel | GPU | date | op harness (CUDA cases) | fwd+bwd vs ATen | default |")
    print("|---|---|---|---|---|---|")
    for family in FAMILIES:
        t = tests[family]
        ran = t["passed"] + t["failed"]
        ok = ran > 0 and t["failed"] == 0
        sp = ", ".join(f"{op} {s:.2f}x" for op, s in speed[family]) or "not measured"
        verdict = f"{t['passed']}/{ran} passed" if ran else "did not run"
        print(f"| {family} | {a.gpu} | {day} | {verdict} | {sp} | "
              f"{'may become ours' if ok else 'ATen'} |")
        rows.append({"kernel": family, "gpu": a.gpu, "date": day, **t, "passed_all": ok,
                     "speedups": speed[family]})
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
