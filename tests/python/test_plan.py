"""`automoe plan` and the pre-flight memory checks: the command and `automoe.plan()` on a checkpoint
and on a bare config.json, a run that cannot fit stopped before anything is loaded (and started
anyway with --force), the drop-in refusing weights that cannot fit, and the plan against the
memory real runs use (bench/plan_accuracy.py's harness: 1 and 2 Gloo ranks, full and LoRA,
activation checkpointing, a hybrid model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

GiB = float(1 << 30)


def run_cli(*args, env=None, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), **(env or {}))
    return subprocess.run([sys.executable, "-m", "automoe.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600, cwd=cwd)


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    """A Qwen3-MoE of ~120 M parameters (the cpu-medium preset) written by Transformers: large
    enough that what the plan models dominates the process's fixed costs."""
    import plan_accuracy

    work = tmp_path_factory.mktemp("plan")
    return plan_accuracy.build_model(plan_accuracy.preset_config("cpu-medium"), work), work


def recipe_file(tmp: Path, model: Path, **train) -> Path:
    import yaml

    words = (REPO / "examples" / "data" / "corpus.txt").read_text().split()
    data = tmp / "text.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(words[i:i + 40])}) + "\n"
                            for i in range(0, 4000, 40)))
    r = {"model": {"path": str(model), "dtype": "bfloat16"},
         "data": {"train": str(data), "format": "text", "seq_len": 128, "cache_dir": str(tmp / "cache")},
         "train": {"micro_batch_size": 2, "max_steps": 1, **train},
         "checkpoint": {"dir": str(tmp / "run")},
         "log": {"progress": "off", "peak_tflops": 1.0}}
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(r))
    return path


def test_plan_prints_the_breakdown_and_json_for_a_checkpoint_and_a_bare_config(medium, tmp_path):
    model, _ = medium
    proc = run_cli("plan", str(recipe_file(tmp_path, model)), "--memory", "64", "--peak-tflops", "1")
    assert proc.returncode == 0, proc.stderr
    for line in ("weights", "master weights", "optimizer moments", "activations (one micro-batch)",
                 "runtime", "allocator overhead", "peak", "fits", "tokens/s"):
        assert line in proc.stdout, (line, proc.stdout)
    # A bare config.json (planning needs no weights), 8 GPUs, as JSON.
    (tmp_path / "bare").mkdir()
    cfg = tmp_path / "bare" / "config.json"
    cfg.write_text((model / "config.json").read_text())
    proc = run_cli("plan", str(recipe_file(tmp_path, model)), f"model.path={cfg}",
                   "train.grad_accumulation_steps=8", "--device", "cuda",
                   "--nproc-per-node", "8", "--gpu-memory", "80", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["plan"]["world"] == 8 and out["plan"]["fits"]
    names = [m["name"] for m in out["plan"]["memory"]]
    assert "weights" in names and "activations (one micro-batch)" in names
    total = sum(m["bytes"] for m in out["plan"]["memory"])
    # The peak is the static items, the step's largest transient and the overhead.
    assert out["plan"]["peak_bytes"] <= total
    assert out["peak_source"].startswith("H100") and out["plan"]["tokens_per_s"] > 0


def test_a_plan_that_does_not_fit_says_so_and_lists_what_would(medium, tmp_path):
    import automoe

    model, _ = medium
    path = recipe_file(tmp_path, model)
    proc = run_cli("plan", str(path), "--memory", "1.2", "--nproc-per-node", "2", "--peak-tflops", "1")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "DOES NOT FIT" in proc.stdout and "configurations that fit" in proc.stdout
    out = automoe.plan(path, memory=1.2, nproc_per_node=2, peak_tflops=1.0)
    assert not out["plan"]["fits"] and out["suggestions"]
    for s in out["suggestions"]:
        assert s["fits"] and s["peak_bytes"] <= 1.2 * GiB
    bad = run_cli("plan", str(path), "--nnodes", "zero")
    assert bad.returncode == 1 and "--nnodes: expected a number" in bad.stderr
    # The engine's own refusals are named: a batch that does not split over the processes.
    split = run_cli("plan", str(path), "--nproc-per-node", "3")
    assert split.returncode == 3 and "cannot run: the step's 1 micro-batches do not split evenly" in split.stdout


def test_train_stops_before_loading_when_the_plan_does_not_fit_and_force_starts_it(medium, tmp_path):
    model, _ = medium
    path = recipe_file(tmp_path, model)
    small = {"AUTOMOE_AVAILABLE_MEMORY": str(int(0.5 * GiB))}
    proc = run_cli("train", str(path), env=small)
    assert proc.returncode == 1, proc.stderr
    assert "not enough memory" in proc.stderr and "--force" in proc.stderr
    assert "configurations that fit" in proc.stderr  # and what would
    run = tmp_path / "run"
    assert (run / "plan.json").exists() and not list(run.glob("step-*"))
    proc = run_cli("train", str(path), "--force", env=small)
    assert proc.returncode == 0, proc.stderr
    assert "starting anyway" in proc.stderr and (run / "export").is_dir()


def test_the_drop_in_refuses_weights_that_cannot_fit(medium, monkeypatch):
    import automoe

    model, _ = medium
    monkeypatch.setenv("AUTOMOE_AVAILABLE_MEMORY", str(int(0.1 * GiB)))
    with pytest.raises(MemoryError, match=r"the weights need 0\.\d+ GiB per rank in bfloat16"):
        automoe.AutoModelForCausalLM.from_pretrained(str(model))


@pytest.mark.parametrize("case", ["fp32", "bf16-ckpt", "bf16-lora", "bf16-qlora-nf4", "fp32-ep2-zero1"])
def test_the_plan_is_within_ten_percent_of_the_measured_peak(medium, case):
    import plan_accuracy

    model, work = medium
    r = plan_accuracy.run_case(model, work, case, plan_accuracy.CASES[case], seq=256, micro=2, steps=2,
                               threads=0)
    assert 0.9 <= r["ratio"] <= 1.1, r


def test_the_plan_of_a_hybrid_model_is_within_ten_percent(tmp_path):
    import plan_accuracy

    config = json.loads((REPO / "bench" / "configs" / "nemotron_h-cpu-small.json").read_text())
    model = plan_accuracy.build_model(config, tmp_path)
    r = plan_accuracy.run_case(model, tmp_path, "bf16", plan_accuracy.CASES["bf16"], seq=256, micro=2,
                               steps=2, threads=0)
    assert 0.9 <= r["ratio"] <= 1.1, r
