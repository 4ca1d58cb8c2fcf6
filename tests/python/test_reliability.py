"""Never lose a user's work: faults injected the way real users and machines cause them.

SIGKILL at every rename and at the first write of every file of a training checkpoint, the
export and an in-place convert (AUTOMOE_FAULT_KILL_AT, csrc/automoe/core/fault.h); SIGTERM /
SIGINT / SIGHUP; full disks (/dev/full, RLIMIT_FSIZE); foreign and damaged run directories. Each
case checks that no completed checkpoint or user file is lost, that a failure exits non-zero
naming the path, and that a resumed run's losses and export equal an uninterrupted run's, bit for
bit. AUTOMOE_FAULT_ALL=1 kills at every write too (slow: thousands of runs)."""

from __future__ import annotations

import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO
from test_train import base_recipe, load_tensors, metrics, model_dir, run_train, tokenizer, write_jsonl  # noqa: F401

A = [sys.executable, "-m", "automoe.cli"]
EVERY_POINT = os.environ.get("AUTOMOE_FAULT_ALL") == "1"


@pytest.fixture(scope="module", autouse=True)
def same_kernels_in_every_process():
    """Runs compared bit for bit are separate processes: each measures which CPU GEMM path is
    faster, and near the margin two processes can choose differently (sums rounded in another
    order). The baseline level has no measured choice. (A resumed run adopts the choices of the run
    it continues: see test_a_resumed_run_adopts_the_gemm_paths_of_the_run_it_continues.)"""
    with pytest.MonkeyPatch.context() as mp:  # (module scope: before the reference runs)
        mp.setenv("AUTOMOE_CPU_ISA", "baseline")
        yield


def env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO / "python"), **extra)


def write_recipe(recipe: dict, tmp: Path) -> Path:
    path = tmp / f"recipe-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run(args: list[str], env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(A + args, capture_output=True, text=True, env=env or globals()["env"](),
                          timeout=300, **kw)


def engine(args: list[str], env: dict) -> tuple[list[str], dict]:
    """`automoe ARGS` as the front starts the engine (automoe.engine_binary: the same binary, its
    allocator and LibTorch), without the front's Python start (a second per run) — for the loops
    that run it dozens of times, where every fault point is the engine's. `automoe train`'s front
    resolves the recipe and tokenises first (cached by then), exactly as it does before its exec."""
    from automoe import engine_binary
    from automoe import train as front

    if args[0] == "train":
        recipe = front.resolve(front.load_recipe(args[1], []), args[1])
        args = ["train", "--recipe-text", json.dumps(recipe), "--origin", args[1],
                *front.prepare(recipe, log=io.StringIO())]
    full = engine_binary.allocator_env(env)
    full["LD_LIBRARY_PATH"] = engine_binary.engine_env()["LD_LIBRARY_PATH"]
    return [str(engine_binary.binary()), *args], full


def run_engine(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    cmd, full = engine(args, env or globals()["env"]())
    return subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=300)


def fault_points(args: list[str], tmp: Path) -> list[tuple[int, str, str]]:
    """The fault points one uninterrupted run of `automoe ARGS` passes: (n, what, path)."""
    trace = tmp / f"trace-{time.monotonic_ns()}"
    proc = run(args, env=env(AUTOMOE_FAULT_TRACE=str(trace)))
    assert proc.returncode == 0, proc.stderr
    out = []
    for line in trace.read_text().splitlines():
        n, what, path = line.split(" ", 2)
        out.append((int(n), what, path))
    return out


def kill_points(points, keep=lambda path: True):
    """Every point that changes what a directory holds (renames, removals, fsyncs), plus the first
    write of each file; every write with AUTOMOE_FAULT_ALL=1."""
    seen, out = set(), []
    for n, what, path in points:
        if not keep(path):
            continue
        if what != "write" or EVERY_POINT or path not in seen:
            out.append((n, what, path))
        seen.add(path)
    return out


def same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---- SIGKILL at every step of a save -----------------------------------------------------------

@pytest.fixture(scope="module")
def reference_run(model_dir, tmp_path_factory):
    """An uninterrupted 3-step run that saves after every step (keep_last 1: each save prunes)."""
    tmp = tmp_path_factory.mktemp("reliability")
    recipe = base_recipe(model_dir, tmp, "straight", train={"max_steps": 3},
                         checkpoint={"every": 1, "keep_last": 1})
    args = ["train", str(write_recipe(recipe, tmp))]
    points = fault_points(args, tmp)
    return tmp, recipe, points


def test_sigkill_at_each_rename_and_write_of_checkpoints_and_export_resumes_identically(reference_run, tmp_path):
    tmp, recipe, points = reference_run
    ref_run = Path(recipe["checkpoint"]["dir"])
    ref_losses = {s: r["loss"] for s, r in metrics(ref_run).items()}
    ref_export = load_tensors(ref_run / "export" / "model.safetensors")
    # The second checkpoint (its save, `latest`, pruning the first) and the export's weights and
    # config: the first and third checkpoints and the other exported files run the same code.
    start = next(n for n, _, p in points if ".tmp-step-2" in p)
    end = next(n for n, _, p in points if ".tmp-step-3" in p)
    chosen = [c for c in kill_points(points) if start <= c[0] < end or
              ("/export/" in c[2] and ("model" in c[2] or "config.json" in c[2]))]
    kinds = {what for _, what, _ in chosen}
    assert {"write", "fsync", "rename", "remove"} <= kinds, kinds
    assert any("/export/" in p for _, _, p in chosen)
    for n, what, path in chosen:
        run_dir = tmp_path / f"kill-{n}"
        r = dict(recipe, checkpoint=dict(recipe["checkpoint"], dir=str(run_dir)))
        args = ["train", str(write_recipe(r, tmp_path))]
        killed = run_engine(args, env=env(AUTOMOE_FAULT_KILL_AT=str(n)))
        assert killed.returncode == -signal.SIGKILL, (n, what, path, killed.stderr)
        # No completed checkpoint is lost: `latest` always names a whole one.
        if (run_dir / "latest").exists():
            name = (run_dir / "latest").read_text().strip()
            for f in ("trainer_state.json", "model.safetensors", "optimizer.safetensors"):
                assert (run_dir / name / f).is_file(), (n, what, path, name, f)
        resumed = run_engine(args)
        assert resumed.returncode == 0, (n, what, path, resumed.stderr)
        got = metrics(run_dir)
        assert {s: rec["loss"] for s, rec in got.items()} == ref_losses, (n, what, path)
        same_tensors(load_tensors(run_dir / "export" / "model.safetensors"), ref_export)
        leftovers = [p.name for p in run_dir.rglob("*") if ".tmp" in p.name or ".pending-" in p.name]
        assert not leftovers, (n, what, path, leftovers)


def transformers_state(path: Path) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("first,second", [("per-expert", "fused"), ("fused", "per-expert")])
def test_sigkill_at_each_step_of_an_in_place_convert_leaves_a_loadable_checkpoint(model_dir, tmp_path, first, second):
    """`automoe convert D D`: at every instant D loads in Transformers as the old checkpoint or the
    new one (the same weights in another layout), never a mix and never nothing."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(model_dir, src)
    # Three shards, so that the in-place save has old shards to keep and to replace.
    assert run(["convert", str(src), str(src), "--layout", first, "--max-shard-size", "40KB"]).returncode == 0
    assert len(list(src.glob("model-*.safetensors"))) >= 2
    want = transformers_state(src)
    args = lambda d: ["convert", str(d), str(d), "--layout", second, "--max-shard-size", "40KB"]  # noqa: E731
    probe = tmp_path / "probe"
    shutil.copytree(src, probe)
    # The switch is in the renames and removals; a kill at a file's first write stands for the
    # kills while it is written (the other points are in the training test's list).
    points = [p for p in kill_points(fault_points(args(probe), tmp_path)) if p[1] != "fsync"]
    assert {"rename", "remove", "write"} <= {what for _, what, _ in points}
    for i, (n, what, path) in enumerate(points):
        d = tmp_path / f"kill-{n}"
        shutil.copytree(src, d)
        killed = run_engine(args(d), env=env(AUTOMOE_FAULT_KILL_AT=str(n)))
        assert killed.returncode == -signal.SIGKILL, (n, what, path, killed.stderr)
        got = transformers_state(d)
        same_tensors(got, want)
        if i % 4 == 0:  # AutoMoE then finishes the job and cleans up after the kill
            again = run_engine(args(d))
            assert again.returncode == 0, (n, what, path, again.stderr)
            assert not [p.name for p in d.iterdir() if ".pending-" in p.name or ".tmp." in p.name]
            same_tensors(transformers_state(d), want)
        shutil.rmtree(d)


# ---- signals -----------------------------------------------------------------------------------

def start_train(recipe: dict, tmp: Path) -> subprocess.Popen:
    return subprocess.Popen(A + ["train", str(write_recipe(recipe, tmp))], env=env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and f'"step":{step},' in (run_dir / "metrics.jsonl").read_text():
            return
        time.sleep(0.02)
    raise AssertionError(f"no step {step} before the run ended: {proc.communicate()[1]}")


@pytest.fixture(scope="module")
def slow_reference(model_dir, tmp_path_factory):
    """An uninterrupted run whose steps are slow enough (8 micro-batches) to signal mid-run."""
    tmp = tmp_path_factory.mktemp("signals")
    recipe = base_recipe(model_dir, tmp, "straight", train={"max_steps": 5, "grad_accumulation_steps": 8})
    run_train(recipe, tmp)
    return recipe, Path(recipe["checkpoint"]["dir"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_finishes_the_step_checkpoints_and_the_resumed_run_is_identical(slow_reference, tmp_path, sig):
    recipe, ref = slow_reference
    run_dir = tmp_path / "run"
    recipe = dict(recipe, checkpoint=dict(recipe["checkpoint"], dir=str(run_dir)))
    proc = start_train(recipe, tmp_path)
    wait_for_step(run_dir, proc, 1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 4, err
    stopped = (run_dir / "latest").read_text().strip()
    assert f"stopped by {signal.Signals(sig).name} after step {stopped.split('-')[1]} of 5" in err, err
    assert 1 <= int(stopped.split("-")[1]) < 5
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["type"] == "stopped"
    run_train(recipe, tmp_path)  # the same command resumes
    assert {s: r["loss"] for s, r in metrics(run_dir).items()} == {s: r["loss"] for s, r in metrics(ref).items()}
    same_tensors(load_tensors(run_dir / "export" / "model.safetensors"),
                 load_tensors(ref / "export" / "model.safetensors"))


def test_a_resumed_run_adopts_the_gemm_paths_of_the_run_it_continues(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOMOE_CPU_ISA")
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1})
    run_train(recipe, tmp_path)
    state = json.loads((tmp_path / "run" / "step-1" / "trainer_state.json").read_text())
    isa, brgemm, aten = state["cpu_gemm"].split(":")
    assert isa in ("baseline", "avx2", "avx512", "avx512_bf16", "amx") and brgemm in "01-" and aten in "01-"
    # Choices recorded under another instruction-set level are not adopted (and do no harm).
    state["cpu_gemm"] = "amx:1:1" if isa != "amx" else "avx2:0:0"
    (tmp_path / "run" / "step-1" / "trainer_state.json").write_text(json.dumps(state))
    run_train(recipe, tmp_path, "train.max_steps=2")


def test_a_resumed_run_keeps_its_checkpoints_gemm_choice_over_the_machine_cache(model_dir, tmp_path, monkeypatch):
    # The first run measures and remembers its choice in the cache; when the cache later says
    # otherwise (another run measured the other way, or the file was edited), a resumed run still
    # computes as the run it continues, and its next checkpoint records that choice.
    monkeypatch.delenv("AUTOMOE_CPU_ISA")
    monkeypatch.setenv("AUTOMOE_CACHE", str(tmp_path / "cache"))
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1})
    run_train(recipe, tmp_path)
    saved = json.loads((tmp_path / "run" / "step-1" / "trainer_state.json").read_text())["cpu_gemm"]
    if saved.startswith("baseline"):
        pytest.skip("no measured GEMM choice at baseline")
    cache = tmp_path / "cache" / "cpu_gemm"
    key, value = cache.read_text().splitlines()[0].split("\t")
    assert value == saved
    flipped = saved[:-1] + ("0" if saved[-1] == "1" else "1")
    cache.write_text(f"{key}\t{flipped}\n")
    run_train(recipe, tmp_path, "train.max_steps=2")
    resumed = json.loads((tmp_path / "run" / "step-2" / "trainer_state.json").read_text())["cpu_gemm"]
    assert resumed == saved
    # A fresh run takes the cache's.
    run_train(base_recipe(model_dir, tmp_path, "fresh", train={"max_steps": 1}), tmp_path)
    fresh = json.loads((tmp_path / "fresh" / "step-1" / "trainer_state.json").read_text())["cpu_gemm"]
    assert fresh == flipped


def test_a_second_signal_stops_at_once(slow_reference, tmp_path):
    recipe, _ = slow_reference
    run_dir = tmp_path / "run"
    recipe = dict(recipe, checkpoint=dict(recipe["checkpoint"], dir=str(run_dir)))
    proc = start_train(recipe, tmp_path)
    wait_for_step(run_dir, proc, 1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGTERM


# ---- full and unwritable disks ---------------------------------------------------------------

def limit_file_size(nbytes: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return apply


def test_metrics_on_a_full_disk_stop_the_run_naming_the_file(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 2}, log={"jsonl": "/dev/full"})
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode == 1
    assert "log.jsonl: cannot write /dev/full: No space left on device" in proc.stderr, proc.stderr


def test_a_checkpoint_that_does_not_fit_fails_naming_it_and_keeps_the_previous_one(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 2}, checkpoint={"every": 1})
    path = write_recipe(recipe, tmp_path)
    run_dir = tmp_path / "run"
    assert run(["train", str(path), "train.max_steps=1"]).returncode == 0
    before = load_tensors(run_dir / "step-1" / "model.safetensors")
    # Files up to 64 KiB: metrics fit, a checkpoint's weights do not.
    proc = subprocess.run(A + ["train", str(path)], capture_output=True, text=True, env=env(),
                          preexec_fn=limit_file_size(64 << 10), timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "File too large" in proc.stderr and str(run_dir / ".tmp-step-2") in proc.stderr, proc.stderr
    assert (run_dir / "latest").read_text().strip() == "step-1"
    same_tensors(load_tensors(run_dir / "step-1" / "model.safetensors"), before)
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".tmp-")]
    assert run(["train", str(path)]).returncode == 0  # space again: it resumes and finishes


def test_a_save_that_does_not_fit_fails_naming_it_and_keeps_the_checkpoint_it_replaces(model_dir, tmp_path):
    """The export's and convert's writer (shards written in place, then the switch) on a full disk."""
    import shutil

    d = tmp_path / "m"
    assert run(["convert", str(model_dir), str(d), "--layout", "per-expert", "--max-shard-size", "40KB"]).returncode == 0
    want = transformers_state(d)
    before = sorted(p.name for p in d.iterdir())
    for out in (tmp_path / "new", d):  # a new directory, and in place
        proc = subprocess.run(A + ["convert", str(d), str(out), "--layout", "fused"], capture_output=True,
                              text=True, env=env(), preexec_fn=limit_file_size(16 << 10), timeout=300)
        assert proc.returncode == 1, proc.stderr
        assert "File too large" in proc.stderr and f"{out}/model" in proc.stderr, proc.stderr
        if out.exists():
            assert not [p.name for p in out.iterdir() if ".pending-" in p.name or ".tmp." in p.name]
    assert sorted(p.name for p in d.iterdir()) == before
    same_tensors(transformers_state(d), want)
    shutil.rmtree(tmp_path / "new", ignore_errors=True)


def test_a_full_cache_disk_names_the_cache(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1},
                         data={"cache_dir": str(tmp_path / "cache")})
    proc = subprocess.run(A + ["train", str(write_recipe(recipe, tmp_path))], capture_output=True,
                          text=True, env=env(), preexec_fn=limit_file_size(1024), timeout=300)
    assert proc.returncode == 1
    assert str(tmp_path / "cache") in proc.stderr and "File too large" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ---- the run directory -------------------------------------------------------------------------

def test_a_foreign_directory_is_refused_and_left_untouched(model_dir, tmp_path):
    mine = tmp_path / "mine"
    for name in ("step-1", "step-2"):
        (mine / name).mkdir(parents=True)
        (mine / name / "notes.txt").write_text("my own work")
    recipe = base_recipe(model_dir, tmp_path, "mine", train={"max_steps": 3}, checkpoint={"every": 1, "keep_last": 1})
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode == 1
    assert "is not empty (step-" in proc.stderr and "was not created by automoe train" in proc.stderr, proc.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["step-1", "step-2"]
    assert (mine / "step-1" / "notes.txt").read_text() == "my own work"


def test_an_empty_directory_is_claimed_and_pruning_keeps_foreign_names(model_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    recipe = base_recipe(model_dir, tmp_path, "empty", train={"max_steps": 3}, checkpoint={"every": 1, "keep_last": 1})
    run_train(recipe, tmp_path)
    run_dir = tmp_path / "empty"
    assert (run_dir / ".automoe-run").is_file()
    assert sorted(p.name for p in run_dir.glob("step-*")) == ["step-3"]


def test_a_directory_in_use_is_reported_as_such(model_dir, tmp_path):
    import fcntl

    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1})
    run_train(recipe, tmp_path)
    with open(tmp_path / "run" / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        proc = run_train(recipe, tmp_path, "train.max_steps=2", check=False)
    assert proc.returncode == 1 and "is in use by another automoe train process" in proc.stderr, proc.stderr


def test_a_read_only_directory_is_reported_as_such(model_dir, tmp_path):
    """A run directory on a read-only file system (a tmpfs mounted read-only: needs the right to
    mount, which root in CI's container has; root passes every permission check otherwise)."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a file system here")
    try:
        (mnt / "run").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        recipe = base_recipe(model_dir, tmp_path, "ro/run", train={"max_steps": 1})
        proc = run_train(recipe, tmp_path, check=False)
        assert proc.returncode == 1
        assert f"checkpoint.dir {mnt / 'run'} is not writable" in proc.stderr, proc.stderr
        assert "Read-only file system" in proc.stderr, proc.stderr
        proc = run_train(recipe, tmp_path, f"checkpoint.dir={mnt / 'new'}", check=False)
        assert proc.returncode == 1 and "cannot create the directory: Read-only file system" in proc.stderr
    finally:
        subprocess.run(["umount", str(mnt)])


def test_leftovers_of_a_killed_save_are_removed_at_the_next_start(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1},
                         data={"cache_dir": str(tmp_path / "cache")})
    run_train(recipe, tmp_path)
    run_dir = tmp_path / "run"
    dead = 2**22 + 12345  # above the kernel's pid_max default: no such process
    (run_dir / f".tmp-step-2-{dead}").mkdir()
    (run_dir / f"latest.tmp.{dead}").write_text("x")
    (run_dir / "export" / f"model.safetensors.pending-{dead}").write_bytes(b"0" * 100)
    (run_dir / "export" / f"config.json.tmp.{os.getpid()}").write_text("alive: kept")
    (tmp_path / "cache" / f".x.amds.tmp-{dead}").write_bytes(b"0" * 100)  # a killed tokenisation
    (tmp_path / "cache" / f".x.amds.tmp-{dead}.tokens").write_bytes(b"0" * 100)  # ... and its spill file
    run_train(recipe, tmp_path, "train.max_steps=2")
    names = {p.name for p in run_dir.rglob("*")} | {p.name for p in (tmp_path / "cache").iterdir()}
    assert not any(str(dead) in n for n in names), names
    assert f"config.json.tmp.{os.getpid()}" in names


def test_metrics_appends_start_on_a_fresh_line_after_a_cut_one(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1})
    run_train(recipe, tmp_path)
    log = tmp_path / "run" / "metrics.jsonl"
    log.write_text(log.read_text() + '{"type": "train", "st')  # a line cut by a full disk
    run_train(recipe, tmp_path, "train.max_steps=2")
    lines = log.read_text().splitlines()
    assert sum(1 for line in lines if line.startswith('{"type": "train", "st') and not line.endswith("}")) == 1
    for line in lines:
        if line != '{"type": "train", "st':
            json.loads(line)


# ---- damaged checkpoints and resumable state --------------------------------------------------

def test_a_damaged_latest_checkpoint_offers_the_complete_older_one(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 4}, checkpoint={"every": 2, "keep_last": 2})
    run_train(recipe, tmp_path, "train.max_steps=3")  # step-2 and step-3
    run_dir = tmp_path / "run"
    weights = run_dir / "step-3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode == 1
    assert "step-3/model.safetensors" in proc.stderr and "--resume-from step-2" in proc.stderr, proc.stderr
    proc = run_train(recipe, tmp_path, "--resume-from", "step-2")
    assert (run_dir / "step-3.aside" / "model.safetensors").exists()  # set aside, never deleted
    assert (run_dir / "latest").read_text().strip() == "step-4"
    assert "set aside" in proc.stderr


@pytest.mark.parametrize("field,value,message", [
    ("step", -3, "step -3 does not match its directory step-1"),
    ("tokens_seen", -1, "tokens_seen -1 must not be negative"),
    ("skipped_steps", 9, "skipped_steps 9 must be in [0, step 1]"),
])
def test_resumable_state_out_of_range_is_refused(model_dir, tmp_path, field, value, message):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1})
    run_train(recipe, tmp_path)
    state = tmp_path / "run" / "step-1" / "trainer_state.json"
    j = json.loads(state.read_text())
    j[field] = value
    state.write_text(json.dumps(j))
    proc = run_train(recipe, tmp_path, "train.max_steps=2", check=False)
    assert proc.returncode == 1 and message in proc.stderr and str(state) in proc.stderr, proc.stderr


def test_an_old_checkpoint_that_cannot_be_pruned_is_a_warning(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1})
    run_train(recipe, tmp_path)
    old = tmp_path / "run" / "step-1"
    if subprocess.run(["mount", "--bind", str(old), str(old)], capture_output=True).returncode:
        pytest.skip("cannot mount here")
    try:  # a mount point cannot be removed
        proc = run_train(recipe, tmp_path, "train.max_steps=3", "checkpoint.every=1", "checkpoint.keep_last=1")
        assert "checkpoint.keep_last: could not remove the old checkpoint" in proc.stderr, proc.stderr
        assert (tmp_path / "run" / "export").exists() and (tmp_path / "run" / "latest").read_text().strip() == "step-3"
    finally:
        subprocess.run(["umount", str(old)])


def test_pruning_only_removes_checkpoints_the_trainer_wrote(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1})
    run_train(recipe, tmp_path)
    (tmp_path / "run" / "step-0").mkdir()  # a name like ours, without our files
    (tmp_path / "run" / "step-0" / "keep.txt").write_text("mine")
    run_train(recipe, tmp_path, "train.max_steps=3", "checkpoint.every=1", "checkpoint.keep_last=1")
    assert (tmp_path / "run" / "step-0" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "run").glob("step-*")) == ["step-0", "step-3"]


# ---- bounds and silent cases ------------------------------------------------------------------

@pytest.mark.parametrize("override,message", [
    ("train.global_batch_size=2000000", "every step would repeat documents"),
    ("train.grad_accumulation_steps=2000000", "grad_accumulation_steps: expected <= 1048576"),
    ("train.threads=100000", "threads: expected <= 4096"),
    ("train.threads=4000", "is more than the"),
    ("data.seq_len=100000000", "seq_len: expected <= 1048576"),
    ("train.micro_batch_size=100000", "tokens in one forward"),
    ("train.micro_batch_size=5000", "every step would repeat documents"),
])
def test_values_that_size_memory_or_threads_are_bounded(model_dir, tmp_path, override, message):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1})
    t0 = time.monotonic()
    proc = run_train(recipe, tmp_path, override, check=False)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "step-1").exists()
    assert time.monotonic() - t0 < 120


def test_a_huge_accumulation_streams_micro_batches(model_dir, tmp_path):
    """A step of many micro-batches holds one at a time: its peak memory is a small step's."""
    small = base_recipe(model_dir, tmp_path, "small", train={"max_steps": 1, "micro_batch_size": 1})
    big = base_recipe(model_dir, tmp_path, "big", train={"max_steps": 1, "micro_batch_size": 1,
                                                           "grad_accumulation_steps": 400},
                      data={"seq_len": 32})
    run_train(small, tmp_path, "data.seq_len=32")
    run_train(big, tmp_path)
    peak = {n: metrics(tmp_path / n)[1]["peak_memory_gib"] for n in ("small", "big")}
    assert peak["big"] < peak["small"] * 1.25 + 0.05, peak


def test_config_layers_beyond_the_checkpoint_are_refused_before_allocating(model_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    for layers, message in [(10**9, "expected a positive integer up to 4096"),
                            (3, "num_hidden_layers is 3, but the checkpoint's tensors hold 2 layer(s)")]:
        cfg["num_hidden_layers"] = layers
        (d / "config.json").write_text(json.dumps(cfg))
        proc = run(["inspect", str(d)])
        assert proc.returncode == 1 and message in proc.stderr, proc.stderr


def test_a_stray_single_file_wins_over_the_index_as_in_transformers_with_a_warning(model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    assert run(["convert", str(d), str(d / "sharded"), "--layout", "per-expert", "--max-shard-size", "40KB"]).returncode == 0
    for p in (d / "sharded").iterdir():
        shutil.move(str(p), d / p.name) if p.name.startswith("model-") or p.name.endswith(".index.json") else None
    single = load_file(str(d / "model.safetensors"))
    single = {k: v + 1 if v.is_floating_point() else v for k, v in single.items()}  # another model
    save_file(single, str(d / "model.safetensors"), metadata={"format": "pt"})
    want = transformers_state(d)
    out = tmp_path / "out"
    proc = run(["convert", str(d), str(out), "--layout", "per-expert"])
    assert proc.returncode == 0, proc.stderr
    assert "holds both model.safetensors and model.safetensors.index.json; loading model.safetensors" in proc.stderr
    same_tensors(transformers_state(out), want)


def test_an_index_naming_files_outside_the_checkpoint_is_refused(model_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    assert run(["convert", str(model_dir), str(d), "--layout", "per-expert", "--max-shard-size", "40KB"]).returncode == 0
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    shutil.copy(d / index["weight_map"][name], tmp_path / "outside.safetensors")
    index["weight_map"][name] = "../outside.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = run(["inspect", str(d)])
    assert proc.returncode == 1
    assert '"../outside.safetensors", which is not a file name inside the checkpoint directory' in proc.stderr


def test_a_recipe_section_written_twice_is_refused_with_its_line(model_dir, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(f"model:\n  path: {model_dir}\noptimizer:\n  lr: 0.1\ntrain:\n  max_steps: 1\n"
                    "optimizer:\n  weight_decay: 0.1\n")
    proc = run(["train", str(path)])
    assert proc.returncode == 1
    assert f"{path}:7: key 'optimizer' appears twice (lines 3 and 7)" in proc.stderr, proc.stderr


def test_data_with_no_token_to_learn_within_seq_len_is_refused(model_dir, tmp_path):
    long_prompt = " ".join(["word"] * 300)
    rows = [{"prompt": long_prompt, "completion": " yes"} for _ in range(4)]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    recipe = base_recipe(model_dir, tmp_path, "run", train_file=data, data={"format": "prompt_completion", "seq_len": 64})
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode == 1
    assert "none of its 4 documents has a token to learn within data.seq_len = 64 tokens" in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "export").exists()


def test_truncation_is_reported_on_the_console(model_dir, tmp_path):
    rows = [{"prompt": "hi", "completion": " " + " ".join(["word"] * 200)}, {"prompt": "a", "completion": " b"}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    recipe = base_recipe(model_dir, tmp_path, "run", train_file=data, data={"format": "prompt_completion", "seq_len": 64},
                         log={"progress": "lines"}, train={"max_steps": 1, "micro_batch_size": 1})
    proc = run_train(recipe, tmp_path)
    assert "1 of 2 documents are longer than data.seq_len = 64 and were cut, dropping" in proc.stderr, proc.stderr


# ---- messages that name the file --------------------------------------------------------------

@pytest.mark.parametrize("file,text,message", [
    ("config.json", "[1, 2]", "config.json: expected a JSON object, found array"),
    ("config.json", None, 'config.json: key "hidden_size": expected an integer, found "big"'),
    ("tokenizer.json", '{"model": ', "tokenizer.json: not valid JSON"),
])
def test_a_damaged_model_file_is_named_without_a_traceback(model_dir, tmp_path, file, text, message):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    if text is None:
        cfg = json.loads((d / "config.json").read_text())
        cfg["hidden_size"] = "big"
        text = json.dumps(cfg)
    (d / file).write_text(text)
    recipe = base_recipe(d, tmp_path, "run", train={"max_steps": 1})
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode == 1 and message in proc.stderr and str(d) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_byte_is_reported_on_its_own_line_and_a_lone_surrogate_as_malformed(model_dir, tmp_path):
    good = json.dumps({"text": "hello world " * 400}) + "\n"  # lines far longer than a read buffer
    data = tmp_path / "d.jsonl"
    data.write_bytes((good * 30).encode() + b'{"text": "caf\xe9"}\n' + good.encode())
    recipe = base_recipe(model_dir, tmp_path, "run", train_file=data, data={"format": "text"})
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode == 1 and f"{data}:31: not UTF-8 text" in proc.stderr, proc.stderr
    data.write_text(good * 2 + '{"text": "a \\ud800 b"}\n')
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode == 1 and f"{data}:3: a lone surrogate \\ud800" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_report_on_damaged_files_says_what_it_skipped(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_bytes(b'{"type": "train", "step": 1, "loss": 2.0}\n3\n'
                                            b'{"type": "train", "step": "x"}\n\xff\xfe\n')
    (run_dir / "recipe.json").write_text("{bad")
    proc = run(["report", str(run_dir)])
    assert proc.returncode == 1 and "recipe.json: unreadable" in proc.stderr, proc.stderr
    (run_dir / "recipe.json").unlink()
    proc = run(["report", str(run_dir)])
    assert proc.returncode == 0, proc.stderr
    assert "metrics.jsonl: unreadable or malformed line(s) 2, 3, 4 skipped" in proc.stderr
    assert "Traceback" not in proc.stderr and (run_dir / "loss.png").exists()
