"""Expert and data parallelism in real processes on Gloo, launched by torchrun: the dispatchers
against a float64 reference (outputs, gradients, bytes), and `automoe train` under ep/dp meshes
against the single-process run (losses, gradient norms, weights), resuming under another mesh,
the export in Transformers, a killed rank, and the refusals."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from test_train import base_recipe, load_tensors, metrics, model_dir, run_train, tokenizer  # noqa: F401

HERE = Path(__file__).resolve().parent


def torchrun(nproc: int, *args: str, timeout: int = 600, check: bool = True, **popen):
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:  # the workers' own tracebacks first, torchrun's summary hides them
        ranks = [line for line in proc.stderr.splitlines() if line.startswith("[rank")]
        proc.stderr = "\n".join(ranks[-60:]) + "\n" + proc.stderr[-3000:]
        if check:
            raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stderr}")
    return proc


# ---- dispatchers ------------------------------------------------------------------------------

@pytest.mark.parametrize("nproc", [2, 4])
def test_dispatchers_match_the_reference_with_awkward_routing(nproc):
    cases = []
    for kind in ("alltoall", "alltoall_overlap", "allgather"):
        for backend in ("grouped", "eager"):
            cases.append([kind, backend, "random", [5, 3, 7, 1][:nproc]])
        # every token to the experts of rank 0; one rank has no tokens at all
        for backend in ("grouped", "eager"):
            cases.append([kind, backend, "rank0", [4, 0, 6, 2][:nproc]])
    cases.append(["alltoall", "torch_mm", "random", [5, 3, 7, 1][:nproc]])
    proc = torchrun(nproc, str(HERE / "parallel_worker.py"), json.dumps(cases), check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]


# ---- training ---------------------------------------------------------------------------------

def ep_recipe(model_dir, tmp, run, **parallel):
    r = base_recipe(model_dir, tmp, run,
                    train={"micro_batch_size": 1, "grad_accumulation_steps": 4, "max_steps": 3, "threads": 1})
    if parallel:
        # Gradient buckets of ~8 KiB unless a test says otherwise: dozens per class, launched from
        # inside the backward, saved and resumed across them.
        r["parallel"] = {"bucket_mb": 1 / 128, **{k: v for k, v in parallel.items() if k != "dispatcher"}}
    if "dispatcher" in parallel:
        r["model"]["backend"] = {"dispatcher": parallel["dispatcher"]}
    return r


def run_ranks(recipe: dict, tmp: Path, nproc: int, *overrides: str, check: bool = True):
    import yaml

    path = tmp / f"recipe-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run([sys.executable, "-m", "automoe.cli", "train", str(path), *overrides,
                           "--nproc-per-node", str(nproc)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp)
    if check and proc.returncode != 0:
        raise AssertionError(f"automoe train --nproc-per-node {nproc} failed ({proc.returncode}):\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def weights(run: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in (run / "export").glob("*.safetensors"):
        out.update(load_tensors(f))
    return out


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    run_train(ep_recipe(model_dir, tmp, "run"), tmp)
    return tmp / "run"


MESHES = [  # (processes, ep, dispatcher, zero)
    (2, 2, "alltoall", 1),
    (2, 1, "auto", 2),
    (2, 2, "allgather", 0),
    (4, 2, "alltoall_overlap", 1),
    (4, 4, "allgather", 1),
    (4, 4, "alltoall", 0),
]


@pytest.mark.parametrize("nproc,ep,dispatcher,zero", MESHES,
                         ids=[f"world{n}-ep{e}-{d}-zero{z}" for n, e, d, z in MESHES])
def test_training_on_a_mesh_equals_one_process(model_dir, single, tmp_path, nproc, ep, dispatcher, zero):
    recipe = ep_recipe(model_dir, tmp_path, "run", ep=ep, dispatcher=dispatcher, zero=zero)
    # The export is written collectively (each rank its experts' rows): one directory, the files
    # of the one-process export, in the checkpoint's layout or the other.
    other_layout = (nproc, ep) == (4, 2)
    if other_layout:
        recipe["checkpoint"]["export_layout"] = "per-expert"
    run_ranks(recipe, tmp_path, nproc)
    ref, got = metrics(single), metrics(tmp_path / "run")
    for step in (1, 2, 3):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6), step
        assert got[step]["aux_loss"] == pytest.approx(ref[step]["aux_loss"], rel=1e-6), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-6), step
        assert got[step]["tokens"] == ref[step]["tokens"]
        # expert loads are summed over every rank
        assert [l["counts"] for l in got[step]["expert_load"]] == [l["counts"] for l in ref[step]["expert_load"]]
    a, b = weights(single), weights(tmp_path / "run")
    if other_layout:
        from transformers import AutoModelForCausalLM

        assert any(".experts.3.down_proj.weight" in k for k in b)
        ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            la = AutoModelForCausalLM.from_pretrained(single / "export").eval()(ids).logits
            lb = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "export").eval()(ids).logits
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    else:
        assert a.keys() == b.keys()
        assert sorted(p.name for p in (tmp_path / "run" / "export").iterdir()) == sorted(
            p.name for p in (single / "export").iterdir())
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    rec = got[3]
    assert rec["parallel"] == {**rec["parallel"], "world": nproc, "ep": ep, "dp": nproc // ep}
    assert len(rec["parallel"]["peak_memory_gib_per_rank"]) == nproc
    assert len(rec["parallel"]["gradient_sync_wait_s"]) == nproc
    if ep > 1:
        d = rec["dispatch"]
        assert d["dispatcher"] == ("alltoall" if dispatcher == "auto" else dispatcher)
        assert len(d["bytes_sent"]) == nproc and min(d["bytes_sent"]) > 0
        # every routed row was computed by exactly one rank of its replica
        assert sum(d["expert_rows"]) == sum(sum(l["counts"]) for l in rec["expert_load"])
        files = sorted(p.name for p in (tmp_path / "run" / "step-3").glob("experts-*"))
        assert files == [f"experts-{i:05d}-of-{ep:05d}.safetensors" for i in range(ep)]


LORA_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def lora_ep_recipe(model_dir, tmp, run, **parallel):
    r = ep_recipe(model_dir, tmp, run, **parallel)
    r["peft"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                 "target_parameters": LORA_EXPERTS, "export_merged": True}
    r["optimizer"]["lr"] = 1e-2
    return r


@pytest.fixture(scope="module")
def lora_single(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-single")
    run_train(lora_ep_recipe(model_dir, tmp, "run"), tmp)
    return tmp / "run"


def test_lora_on_an_nf4_base_under_expert_parallelism_equals_one_process(model_dir, tmp_path):
    """Each rank quantises its own experts as it reads them: the losses, the adapters and the merged
    export (dequantised experts + ΔW, written collectively) are one process's."""
    one = lora_ep_recipe(model_dir, tmp_path, "one")
    one["model"]["quantize"] = "nf4"
    run_train(one, tmp_path)
    two = lora_ep_recipe(model_dir, tmp_path, "two", ep=2)
    two["model"]["quantize"] = "nf4"
    run_ranks(two, tmp_path, 2)
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for step in (1, 2, 3):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6), step
    for sub in ("export", "export-merged"):
        a, b = {}, {}
        for f in (tmp_path / "one" / sub).glob("*.safetensors"):
            a.update(load_tensors(f))
        for f in (tmp_path / "two" / sub).glob("*.safetensors"):
            b.update(load_tensors(f))
        assert a.keys() == b.keys() and any("experts" in k for k in a)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("nproc,ep", [(2, 2), (4, 4)], ids=["ep2", "ep4"])
def test_lora_under_expert_parallelism_equals_one_process(model_dir, lora_single, tmp_path, nproc, ep):
    """Each rank trains the adapters of its own experts beside their weights (drawn as one process
    draws them), the attention adapters replicated: losses, gradient norms, the expert-adapter
    metrics (summed over the EP group), the PEFT export (gathered) and the merged export (written
    collectively) match one process."""
    run_ranks(lora_ep_recipe(model_dir, tmp_path, "run", ep=ep), tmp_path, nproc)
    ref, got = metrics(lora_single), metrics(tmp_path / "run")
    for step in (1, 2, 3):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-6), step
        for g, r in zip(got[step]["expert_lora"], ref[step]["expert_lora"], strict=True):
            assert {k: g[k] for k in ("layer", "experts_with_grad", "experts")} == \
                {k: r[k] for k in ("layer", "experts_with_grad", "experts")}, step
            assert g["update_norm"] == pytest.approx(r["update_norm"], rel=1e-5), step
    a = load_tensors(lora_single / "export" / "adapter_model.safetensors")
    b = load_tensors(tmp_path / "run" / "export" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("experts" in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    assert (tmp_path / "run" / "export" / "adapter_config.json").read_bytes() == \
        (lora_single / "export" / "adapter_config.json").read_bytes()
    ma = {}
    mb = {}
    for f in (lora_single / "export-merged").glob("*.safetensors"):
        ma.update(load_tensors(f))
    for f in (tmp_path / "run" / "export-merged").glob("*.safetensors"):
        mb.update(load_tensors(f))
    assert ma.keys() == mb.keys()
    for k in ma:
        torch.testing.assert_close(mb[k], ma[k], rtol=1e-5, atol=1e-6, msg=k)
    # The checkpoint holds each rank's expert adapters in its own shard.
    files = sorted(p.name for p in (tmp_path / "run" / "step-3").glob("experts-*"))
    assert files == [f"experts-{i:05d}-of-{ep:05d}.safetensors" for i in range(ep)]


def test_lora_exported_under_expert_parallelism_is_the_one_process_export_byte_for_byte(
        model_dir, lora_single, tmp_path):
    """The one-process run's last checkpoint, resumed at ep 2 with no step left to train: the
    gathered PEFT export and the collectively written merged model are the one-process files, byte
    for byte. Then a run checkpointed at ep 2 and resumed in one process continues it."""
    run = tmp_path / "run"
    shutil.copytree(lora_single, run)
    for d in ("export", "export-merged"):
        shutil.rmtree(run / d)
    recipe = lora_ep_recipe(model_dir, tmp_path, "run", ep=2)
    recipe["checkpoint"]["resume"] = True
    run_ranks(recipe, tmp_path, 2)
    for d in ("export", "export-merged"):
        names = sorted(p.name for p in (lora_single / d).iterdir())
        assert names == sorted(p.name for p in (run / d).iterdir()), d
        for n in names:
            assert (run / d / n).read_bytes() == (lora_single / d / n).read_bytes(), (d, n)
    # ep 2 for two steps (a checkpoint), then one process for the third: the one-process losses.
    split = lora_ep_recipe(model_dir, tmp_path, "split", ep=2)
    split["checkpoint"]["every"] = 1
    run_ranks(split, tmp_path, 2, "train.max_steps=2")
    assert sorted(p.name for p in (tmp_path / "split" / "step-2").glob("experts-*")) == [
        "experts-00000-of-00002.safetensors", "experts-00001-of-00002.safetensors"]
    split.pop("parallel")
    split["model"].pop("backend", None)
    run_train(split, tmp_path)
    ref, got = metrics(lora_single), metrics(tmp_path / "split")
    for step in (1, 2, 3):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6), step


def test_zero1_when_one_ranks_last_micro_batch_has_nothing_to_learn(model_dir, tmp_path):
    """Rank 1's last micro-batch of every step (the 4th document: a prompt longer than seq_len)
    has no loss token and is not run, so rank 1 launches its gradient buckets after the loop
    while rank 0 launches them from inside its backward: the same collectives in the same order,
    and the one-process losses."""
    rows = [{"prompt": "word " * 200, "completion": "end"} if i % 4 == 3 else
            {"prompt": f"question {i}", "completion": f"answer number {i}"} for i in range(12)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def recipe(run, **parallel):
        r = ep_recipe(model_dir, tmp_path, run, **parallel)
        r["data"].update(train=str(data), seq_len=32, packing=False, shuffle=False)
        return r

    run_train(recipe("one"), tmp_path)
    run_ranks(recipe("dp", ep=1, zero=1), tmp_path, 2)
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "dp")
    assert ref[1]["truncated_documents"] == 1
    for step in (1, 2, 3):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-6), step


def test_a_checkpoint_saved_at_ep2_resumes_as_dp2_and_loads_in_transformers(model_dir, single, tmp_path):
    from transformers import AutoModelForCausalLM

    recipe = ep_recipe(model_dir, tmp_path, "run", ep=2)
    recipe["checkpoint"]["every"] = 2
    run_ranks(recipe, tmp_path, 2)
    # Back to step 2, then continue with experts replicated (ep = 1, dp = 2).
    run = tmp_path / "run"
    shutil.rmtree(run / "step-3")
    shutil.rmtree(run / "export")
    (run / "latest").write_text("step-2\n")
    recipe = ep_recipe(model_dir, tmp_path, "run", ep=1)
    recipe["checkpoint"]["every"] = 2
    run_ranks(recipe, tmp_path, 2)
    ref, got = metrics(single), metrics(run)
    assert got[3]["loss"] == pytest.approx(ref[3]["loss"], rel=1e-6)
    assert got[3]["grad_norm"] == pytest.approx(ref[3]["grad_norm"], rel=1e-6)
    a, b = weights(single), weights(run)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    # The EP run's export, in Transformers, gives the single-process export's logits.
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la = AutoModelForCausalLM.from_pretrained(single / "export").eval()(ids).logits
        lb = AutoModelForCausalLM.from_pretrained(run / "export").eval()(ids).logits
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)


def training_started(log: Path) -> bool:
    return log.exists() and any(json.loads(l).get("type") == "train" for l in log.read_text().splitlines())


@contextlib.contextmanager
def long_run_on_two_ranks(model_dir, tmp_path, timeout_s: float):
    """`automoe train --nproc-per-node 2` (ep 2) started in the background; yields the launcher and
    its two rank processes once the first step is logged. Everything is killed on the way out."""
    import psutil
    import yaml

    recipe = ep_recipe(model_dir, tmp_path, "run", ep=2, timeout_s=timeout_s)
    recipe["train"]["max_steps"] = 10000
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    launcher = subprocess.Popen([sys.executable, "-m", "automoe.cli", "train", str(path), "--nproc-per-node", "2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while not training_started(tmp_path / "run" / "metrics.jsonl"):
            assert launcher.poll() is None, launcher.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.5)
        workers = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                   if "automoe.cli" in " ".join(p.cmdline())]
        assert len(workers) == 2, [p.cmdline() for p in workers]
        yield launcher, workers
    finally:
        for p in psutil.Process().children(recursive=True):
            try:
                p.resume()
                p.kill()
            except psutil.Error:
                pass


def all_gone(workers) -> bool:
    import psutil

    return all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in workers)


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(model_dir, tmp_path):
    """SIGTERM reaches one rank only: the ranks agree on the stop in the step's loss reduction,
    write one checkpoint together and exit with status 4; the same command then resumes."""
    with long_run_on_two_ranks(model_dir, tmp_path, timeout_s=60) as (launcher, workers):
        os.kill(workers[1].pid, signal.SIGTERM)
        _, err = launcher.communicate(timeout=180)
        assert launcher.returncode != 0
        run_dir = tmp_path / "run"
        last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        assert last["type"] == "stopped", err[-3000:]
        assert (run_dir / "latest").read_text().strip() == f"step-{last['step']}"
        assert (run_dir / f"step-{last['step']}" / "trainer_state.json").exists()
        assert f"stopped by {last['signal']} after step {last['step']}" in err, err[-3000:]
    recipe = ep_recipe(model_dir, tmp_path, "run", ep=2)
    recipe["train"]["max_steps"] = last["step"] + 1
    run_ranks(recipe, tmp_path, 2)
    assert (run_dir / f"step-{last['step'] + 1}").exists()


def test_a_killed_rank_stops_every_rank_with_an_error(model_dir, tmp_path):
    with long_run_on_two_ranks(model_dir, tmp_path, timeout_s=30) as (launcher, workers):
        os.kill(workers[1].pid, signal.SIGKILL)
        _, err = launcher.communicate(timeout=120)
        assert launcher.returncode != 0
        assert "SIGKILL" in err or "Signal 9" in err or "exitcode" in err, err[-3000:]
        assert all_gone(workers)


def test_a_stalled_rank_fails_the_others_within_the_timeout(model_dir, tmp_path):
    import psutil

    with long_run_on_two_ranks(model_dir, tmp_path, timeout_s=5) as (launcher, workers):
        workers[1].suspend()  # alive, holding its sockets open, never reaching the next collective
        t0 = time.monotonic()
        psutil.wait_procs([workers[0]], timeout=120)  # rank 0 gives up after parallel.timeout_s
        assert not workers[0].is_running() or workers[0].status() == psutil.STATUS_ZOMBIE
        assert time.monotonic() - t0 < 60
        # The launcher now stops the stalled rank; a stopped process takes torchrun's SIGTERM only
        # when it runs again (torchrun would wait 30 s, then SIGKILL it): let it run.
        workers[1].resume()
        _, err = launcher.communicate(timeout=180)
        assert launcher.returncode != 0
        assert time.monotonic() - t0 < 120
        assert "a collective failed" in err, err[-3000:]
        assert all_gone(workers)


def test_ranks_take_rank_0s_cpu_gemm_choice_and_warn_at_another_isa_level(model_dir, tmp_path):
    """The CPU GEMM paths are chosen by timing in each process; the ranks take rank 0's choice. A
    rank whose CPU kernels run at another instruction-set level cannot, and says so, and the run
    goes on (its sums round differently, nothing more)."""
    import yaml

    import automoe  # noqa: F401  (registers torch.ops.automoe)

    if torch.ops.automoe._cpu_kernel_paths()["cpu_isa"] == "baseline":
        pytest.skip("this CPU has one instruction-set level only")
    recipe = ep_recipe(model_dir, tmp_path, "run", ep=1)
    recipe["train"]["max_steps"] = 1
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = torchrun(2, str(HERE / "rank_env_worker.py"), "1:AUTOMOE_CPU_ISA=baseline", "train", str(path))
    assert "warning: rank 1 runs the CPU kernels at another instruction-set level (baseline:-:-)" \
        in proc.stderr, proc.stderr[-4000:]
    assert (tmp_path / "run" / "step-1" / "trainer_state.json").exists()


@pytest.mark.parametrize("override,nproc,message", [
    ("parallel.ep=3", 2, "parallel.ep = 3 does not divide the 2 processes"),
    ("parallel.zero=3", 2, "ZeRO-3 (sharded weights) is not implemented"),
    ("model.backend.dispatcher=local", 2, "cannot reach the experts of other ranks"),
    ("parallel.dp=2", 2, "parallel.dp = 2 but 2 processes with ep = 2 make dp = 1"),
])
def test_bad_meshes_are_refused_before_any_weight_is_read(model_dir, tmp_path, override, nproc, message):
    proc = run_ranks(ep_recipe(model_dir, tmp_path, "run", ep=2), tmp_path, nproc, override, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-4000:]


def test_experts_that_do_not_split_over_ep_are_refused(tmp_path, tokenizer):
    from automoe.demo import build_checkpoint

    ckpt = build_checkpoint(tmp_path / "six", tokenizer, seed=0, hidden_size=32, intermediate_size=48,
                            moe_intermediate_size=16, num_hidden_layers=1, mlp_only_layers=[], num_experts=6,
                            num_experts_per_tok=2, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256)
    recipe = ep_recipe(ckpt, tmp_path, "run", ep=4)
    proc = run_ranks(recipe, tmp_path, 4, check=False)
    assert proc.returncode != 0
    assert "does not divide the model's 6 experts" in proc.stderr, proc.stderr[-4000:]


def test_bf16_activation_checkpointing_zero2_and_evaluation_under_ep(model_dir, tmp_path):
    # Checkpointed layers recompute their exchanges in the backward; every rank evaluates its share.
    def recipe(run, **parallel):
        r = ep_recipe(model_dir, tmp_path, run, **parallel)
        r["model"]["dtype"] = "bfloat16"
        # float32 masters and moments on both sides (ZeRO's; one process would take 8-bit moments)
        r["optimizer"].update(master_weights="float32", state_dtype="float32")
        r["train"]["activation_checkpointing"] = True
        r["data"]["validation"] = str(REPO / "examples" / "data" / "chat_valid.jsonl")
        return r

    run_train(recipe("one"), tmp_path)
    # ZeRO-2 with small buckets: gradients leave from inside the checkpointed layers' backward.
    run_ranks(recipe("ep", ep=2, dispatcher="alltoall_overlap", zero=2, bucket_mb=1 / 64), tmp_path, 2)
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "ep")
    for step in (1, 2, 3):  # bf16 compute: the same math, rounded at other places
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=2e-3), step
    ev_ref, ev_got = metrics(tmp_path / "one", "eval"), metrics(tmp_path / "ep", "eval")
    assert ev_got[3]["eval_tokens"] == ev_ref[3]["eval_tokens"]
    assert ev_got[3]["eval_loss"] == pytest.approx(ev_ref[3]["eval_loss"], rel=2e-3)


def test_bf16_masters_and_moments_train_data_parallel_without_zero_and_are_refused_with_it(model_dir, tmp_path):
    """optimizer.master_weights none + state_dtype bfloat16 on two data-parallel processes
    (parallel.zero: 0, the bf16 gradients all-reduced in float32) trains as one process does; with
    ZeRO (sharded float32 masters) the options are refused by name."""
    def recipe(run, **parallel):
        r = ep_recipe(model_dir, tmp_path, run, **parallel)
        r["model"]["dtype"] = "bfloat16"
        r["optimizer"].update(master_weights="none", state_dtype="bfloat16")
        r["train"]["grad_accumulation_steps"] = 2  # one micro-batch per rank: bf16 gradients
        return r

    run_train(recipe("one"), tmp_path)
    run_ranks(recipe("dp", ep=1, zero=0), tmp_path, 2)
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "dp")
    for step in (1, 2, 3):  # bf16 compute: the same math, rounded at other places
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=2e-3), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=2e-2), step
    proc = run_ranks(recipe("zero", ep=1, zero=1), tmp_path, 2, check=False)
    assert proc.returncode != 0
    assert "optimizer.master_weights: none, state_dtype: bfloat16: only for bf16 weights trained " \
           "in full without ZeRO" in proc.stderr, proc.stderr[-4000:]


def test_8bit_moments_saved_under_ep2_resume_data_parallel_and_in_backward_is_refused(model_dir, tmp_path):
    """optimizer.state_dtype 8bit under expert parallelism: each EP rank's experts file holds its
    experts' codes and block scales (rows per expert), which dequantize to the single process's
    moments; the checkpoint resumes with the experts replicated (ep 1, dp 2) and continues the
    single process's losses. optimizer.in_backward on two processes is refused by name."""
    def recipe(run, **parallel):
        r = ep_recipe(model_dir, tmp_path, run, **parallel)
        r["model"]["dtype"] = "bfloat16"
        r["optimizer"].update(master_weights="none", state_dtype="8bit")
        r["checkpoint"]["every"] = 2
        return r

    run_train(recipe("one"), tmp_path)
    run_ranks(recipe("run", ep=2, zero=0), tmp_path, 2)
    from automoe import _C

    one = load_tensors(tmp_path / "one" / "step-2" / "optimizer.safetensors")
    step2 = tmp_path / "run" / "step-2"
    parts = [load_tensors(step2 / f"experts-0000{r}-of-00002.safetensors") for r in (0, 1)]
    name = next(k[len("exp_avg_scale."):] for k in parts[0] if k.startswith("exp_avg_scale.") and "experts" in k)
    codes = torch.cat([p[f"exp_avg.{name}"] for p in parts])
    scales = torch.cat([p[f"exp_avg_scale.{name}"] for p in parts])
    assert codes.dtype == torch.uint8 and codes.shape == one[f"exp_avg.{name}"].shape
    got = _C._dequantize8(codes, scales, True)
    want = _C._dequantize8(one[f"exp_avg.{name}"], one[f"exp_avg_scale.{name}"], True)
    assert (got - want).abs().max() <= 0.05 * want.abs().max(), name  # bf16 compute elsewhere

    shutil.rmtree(tmp_path / "run" / "step-3")
    shutil.rmtree(tmp_path / "run" / "export")
    (tmp_path / "run" / "latest").write_text("step-2\n")
    run_ranks(recipe("run", ep=1, zero=0), tmp_path, 2)
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "run")
    assert sorted(got) == [1, 2, 3]
    assert got[3]["loss"] == pytest.approx(ref[3]["loss"], rel=2e-3)

    r = recipe("ib", ep=1, zero=0)
    r["optimizer"].update(in_backward=True, max_grad_norm=0.0)
    r["train"]["grad_accumulation_steps"] = 1
    proc = run_ranks(r, tmp_path, 2, check=False)
    assert proc.returncode != 0
    assert "optimizer.in_backward: one process only" in proc.stderr, proc.stderr[-4000:]


def test_deepseek_bias_balancing_counts_every_rank(tmp_path, tokenizer):
    from test_train_families import SIZES
    from automoe.demo import build_checkpoint

    ckpt = build_checkpoint(tmp_path / "ds", tokenizer, family="deepseek_v3", **SIZES["deepseek_v3"])

    def recipe(run, **parallel):
        r = ep_recipe(ckpt, tmp_path, run, **parallel)
        r["router"] = {"bias_update_rate": 0.01}
        return r

    run_train(recipe("one"), tmp_path)
    run_ranks(recipe("ep", ep=2), tmp_path, 2)
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "ep")
    for step in (1, 2, 3):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6), step
        assert got[step]["router_bias"] == ref[step]["router_bias"], step
    a, b = weights(tmp_path / "one"), weights(tmp_path / "ep")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
@pytest.mark.parametrize("nproc,ep,dispatcher", [(2, 2, "alltoall"), (4, 4, "allgather")],
                         ids=["ep2-alltoall", "ep4-allgather"])
def test_a_hybrid_recurrent_attention_moe_model_under_ep_equals_one_process(tmp_path, tmp_path_factory, tokenizer,
                                                                           nproc, ep, dispatcher, family):
    """Nemotron-H (Mamba-2 + attention + relu2 MoE) and Qwen3-Next (gated DeltaNet + gated
    attention + MoE with a gated shared expert): experts sharded over the EP group, the recurrent
    and attention mixers replicated; losses, gradient norms and the export match one process."""
    from test_train_families import tiny_family_checkpoint

    ckpt = tiny_family_checkpoint(family, tmp_path_factory, tokenizer)
    run_train(ep_recipe(ckpt, tmp_path, "one"), tmp_path)
    run_ranks(ep_recipe(ckpt, tmp_path, "ep", ep=ep, dispatcher=dispatcher), tmp_path, nproc)
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "ep")
    for step in (1, 2, 3):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-6), step
    assert got[3]["parallel"]["ep"] == ep and min(got[3]["dispatch"]["bytes_sent"]) > 0
    a, b = weights(tmp_path / "one"), weights(tmp_path / "ep")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=5e-5, atol=5e-5, msg=k)


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_lora_on_a_hybrid_model_under_ep2_dp2_equals_one_process(tmp_path, tmp_path_factory, tokenizer, family):
    """LoRA on the recurrent mixers' and attention's projections (replicated, reduced over all four
    ranks) and on the routed experts (two experts' rows per rank, reduced over the two replicas)."""
    from test_train_families import tiny_family_checkpoint
    from test_train_lora import HYBRID_LORA

    ckpt = tiny_family_checkpoint(family, tmp_path_factory, tokenizer)
    modules, experts = HYBRID_LORA[family]

    def recipe(run, **parallel):
        r = lora_ep_recipe(ckpt, tmp_path, run, **parallel)
        r["peft"].update(target_modules=modules, target_parameters=experts, export_merged=False)
        return r

    run_train(recipe("one"), tmp_path)
    run_ranks(recipe("ep", ep=2), tmp_path, 4)
    ref, got = metrics(tmp_path / "one"), metrics(tmp_path / "ep")
    assert got[3]["parallel"]["dp"] == 2
    for step in (1, 2, 3):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-6), step
    a = load_tensors(tmp_path / "one" / "export" / "adapter_model.safetensors")
    b = load_tensors(tmp_path / "ep" / "export" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("experts" in k for k in a)
    for k in a:  # (an element whose Adam step divides rounding-level gradients: 1e-5)
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-5, msg=k)


# ---- the drop-in ------------------------------------------------------------------------------

@pytest.mark.parametrize("nproc,ep", [(2, 2), (4, 2)], ids=["ep2", "ep2-dp2"])
def test_the_drop_in_under_expert_parallelism_matches_one_process(model_dir, tmp_path, nproc, ep):
    """from_pretrained(ep_size=N) under torchrun: logits, gradients with and without DDP, torch.optim
    steps, a collective save_pretrained that Transformers loads, generate with ranks of different
    lengths, and a save that one rank alone calls refused with a message (dropin_ep_worker.py)."""
    proc = torchrun(nproc, str(HERE / "dropin_ep_worker.py"), str(model_dir), str(tmp_path), str(ep),
                    check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.count(": ok") == nproc


@pytest.mark.parametrize("family", ["nemotron_h", "qwen3_next"])
def test_the_drop_in_of_a_hybrid_model_under_expert_parallelism_matches_one_process(tmp_path, tmp_path_factory,
                                                                                    tokenizer, family):
    """The same checks on Nemotron-H and Qwen3-Next (experts sharded, the recurrent mixers and
    attention replicated; generate carries each rank's conv and recurrent state)."""
    from test_train_families import tiny_family_checkpoint

    ckpt = tiny_family_checkpoint(family, tmp_path_factory, tokenizer)
    proc = torchrun(2, str(HERE / "dropin_ep_worker.py"), str(ckpt), str(tmp_path), "2", check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.count(": ok") == 2


@pytest.mark.parametrize("family,nproc", [("granitemoe", 2), ("granitemoe", 4), ("gpt_oss", 2)],
                         ids=["granitemoe-ep2", "granitemoe-ep2-dp2", "gpt_oss-ep2"])
def test_transformers_model_under_expert_parallelism_matches_one_process(tmp_path, family, nproc):
    """The same checks on Transformers' own model (a type the engine does not run natively, and
    GPT-OSS, whose biased, transposed experts the engine's dispatcher does not take): the experts are DTensors
    sharded over the EP group, read from disk as this rank's share, run through the engine's
    dispatcher on AutoMoE's kernels; the collective save is the one-process checkpoint."""
    from test_fallback import write_family_checkpoint

    ckpt = write_family_checkpoint(tmp_path / family, family, **({"num_local_experts": 8} if family == "granitemoe"
                                                                  else {}))
    proc = torchrun(nproc, str(HERE / "dropin_ep_worker.py"), str(ckpt), str(tmp_path / "out"), "2",
                    check=False)  # (GPT-OSS with ep_size takes Transformers' model by itself)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.count(": ok") == nproc


@pytest.mark.parametrize("family", ["mixtral", "granitemoe", "dots1"])
def test_the_transformers_trainer_under_expert_parallelism_equals_one_process(tmp_path, family):
    """The Trainer, unchanged, with ep_size=2 × DDP 2 (4 processes, a batch of 1 each) against one
    process (a batch of 4), on the engine's model (Mixtral) and on Transformers' (GraniteMoE,
    dots1): 10 steps with gradient clipping (the Trainer takes the global norm of the DTensor
    experts itself), the same losses and gradient norms; the
    checkpoint the Trainer writes at step 5 from rank 0 alone holds every expert and every
    expert's optimizer moments as one process's does, and a run resumed from it (4 processes)
    ends on the same curve; save_model's directory loads in plain Transformers with the EP model's
    logits."""
    from test_fallback import write_family_checkpoint
    from transformers import AutoModelForCausalLM

    experts = {"mixtral": {"num_local_experts": 4}, "granitemoe": {"num_local_experts": 8}, "dots1": {}}[family]
    ckpt = write_family_checkpoint(tmp_path / family, family, **experts)
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(HERE / "trainer_ep_worker.py"), str(ckpt), str(tmp_path / "one"), "1"],
                   check=True, capture_output=True, env=env, timeout=600)
    proc = torchrun(4, str(HERE / "trainer_ep_worker.py"), str(ckpt), str(tmp_path / "ep"), "2", check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    step5 = tmp_path / "ep" / "trainer" / "checkpoint-5"
    proc = torchrun(4, str(HERE / "trainer_ep_worker.py"), str(ckpt), str(tmp_path / "resumed"), "2", str(step5),
                    check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    ref = json.loads((tmp_path / "one" / "log.json").read_text())
    for run in ("ep", "resumed"):
        got = json.loads((tmp_path / run / "log.json").read_text())
        assert [h["step"] for h in got] == [h["step"] for h in ref] == list(range(1, 11))
        for a, b in zip(got, ref):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (run, a["step"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (run, a["step"])
            assert b["grad_norm"] > 0.5  # (the clipping at 0.5 acts at every step)
    mine = torch.load(step5 / "optimizer.pt", weights_only=True)["state"]
    theirs = torch.load(tmp_path / "one" / "trainer" / "checkpoint-5" / "optimizer.pt", weights_only=True)["state"]
    assert mine.keys() == theirs.keys()
    for i in theirs:
        for key, value in theirs[i].items():
            assert mine[i][key].shape == value.shape, (i, key)
            torch.testing.assert_close(mine[i][key], value, rtol=1e-4, atol=1e-7)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ep" / "final", dtype=torch.float32)
    with torch.no_grad():
        ids = torch.load(tmp_path / "ep" / "logits.pt", weights_only=True)
        data_ids = torch.randint(3, plain.config.vocab_size, (40, 12), generator=torch.Generator().manual_seed(5))[0]
        torch.testing.assert_close(plain(data_ids[None]).logits, ids, rtol=1e-5, atol=1e-5)


def test_peft_lora_under_the_trainer_with_ep_size_equals_one_process(tmp_path):
    """PEFT's get_peft_model on a drop-in loaded with ep_size=2 (× DDP 2), trained by the Trainer:
    each rank runs its experts' rows of the expert adapters, the gradients come back whole (the
    experts' rule through DDP): the one-process losses and gradient norms, optimizer.pt with every
    adapter's moments, a resumed run on the same curve; the adapter save_model writes loads with
    PEFT onto plain Transformers' model with the EP model's logits."""
    from peft import PeftModel
    from test_fallback import write_family_checkpoint
    from transformers import AutoModelForCausalLM

    ckpt = write_family_checkpoint(tmp_path / "mixtral", "mixtral", num_local_experts=4)
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1", AUTOMOE_TEST_PEFT="1")
    subprocess.run([sys.executable, str(HERE / "trainer_ep_worker.py"), str(ckpt), str(tmp_path / "one"), "1"],
                   check=True, capture_output=True, env=env, timeout=600)
    os.environ["AUTOMOE_TEST_PEFT"] = "1"
    try:
        proc = torchrun(4, str(HERE / "trainer_ep_worker.py"), str(ckpt), str(tmp_path / "ep"), "2", check=False)
        assert proc.returncode == 0, proc.stderr[-6000:]
        step5 = tmp_path / "ep" / "trainer" / "checkpoint-5"
        proc = torchrun(4, str(HERE / "trainer_ep_worker.py"), str(ckpt), str(tmp_path / "resumed"), "2",
                        str(step5), check=False)
        assert proc.returncode == 0, proc.stderr[-6000:]
    finally:
        del os.environ["AUTOMOE_TEST_PEFT"]
    ref = json.loads((tmp_path / "one" / "log.json").read_text())
    for run in ("ep", "resumed"):
        got = json.loads((tmp_path / run / "log.json").read_text())
        assert [h["step"] for h in got] == [h["step"] for h in ref] == list(range(1, 11))
        for a, b in zip(got, ref):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (run, a["step"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (run, a["step"])
    mine = torch.load(step5 / "optimizer.pt", weights_only=True)["state"]
    theirs = torch.load(tmp_path / "one" / "trainer" / "checkpoint-5" / "optimizer.pt", weights_only=True)["state"]
    assert mine.keys() == theirs.keys() and len(theirs) == 2 * 2 * 4  # (2 layers, 4 adapted weights, A and B)
    for i in theirs:
        for key, value in theirs[i].items():
            torch.testing.assert_close(mine[i][key], value, rtol=1e-4, atol=1e-7)
    final = tmp_path / "ep" / "final"

    def config(d):  # (PEFT writes its targets from sets: their order follows the hash seed)
        c = json.loads((d / "adapter_config.json").read_text())
        return {**c, "target_modules": sorted(c["target_modules"]), "target_parameters": sorted(c["target_parameters"])}

    assert config(final) == config(tmp_path / "one" / "final")
    a = load_tensors(tmp_path / "one" / "final" / "adapter_model.safetensors")
    b = load_tensors(final / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("experts" in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6, msg=k)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), final).eval()
    with torch.no_grad():
        want = torch.load(tmp_path / "ep" / "logits.pt", weights_only=True)
        ids = torch.randint(3, plain.config.vocab_size, (40, 12), generator=torch.Generator().manual_seed(5))[0]
        torch.testing.assert_close(plain(ids[None]).logits, want, rtol=1e-5, atol=1e-5)


def test_trl_sft_trainer_under_expert_parallelism_equals_data_parallelism(tmp_path, tokenizer):
    """TRL's SFTTrainer, unchanged (gradient checkpointing on, its default), on chat conversations
    with ep_size=2 × DDP 2: the losses and clipped gradient norms of plain DDP over the same 4
    processes (2e-4: the sums' order differs, and SGD at lr 0.5 grows it; 1.2e-4 in step 3's gradient
norm on an AVX2-only CPU, whose kernels round differently), and of one process (1e-3: its batch of
4 is padded);
    resumed from its step-2 checkpoint (written by rank 0 alone), the curve of one process resumed
    from its own (TRL's resume does not repeat the uninterrupted curve here, on Transformers' own
    model either)."""
    from automoe.demo import build_checkpoint

    ckpt = build_checkpoint(tmp_path / "qwen3-moe-chat", tokenizer, hidden_size=32, intermediate_size=48,
                            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, num_experts=4, mlp_only_layers=[])
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(HERE / "sft_ep_worker.py"), str(ckpt), str(tmp_path / "one"), "1"],
                   check=True, capture_output=True, env=env, timeout=600)
    torchrun(4, str(HERE / "sft_ep_worker.py"), str(ckpt), str(tmp_path / "ddp"), "1")
    torchrun(4, str(HERE / "sft_ep_worker.py"), str(ckpt), str(tmp_path / "ep"), "2")
    torchrun(4, str(HERE / "sft_ep_worker.py"), str(ckpt), str(tmp_path / "resumed"), "2",
             str(tmp_path / "ep" / "sft" / "checkpoint-2"))
    subprocess.run([sys.executable, str(HERE / "sft_ep_worker.py"), str(ckpt), str(tmp_path / "one-resumed"), "1",
                    str(tmp_path / "one" / "sft" / "checkpoint-2")], check=True, capture_output=True, env=env, timeout=600)
    runs = ("one", "ddp", "ep", "resumed", "one-resumed")
    log = {run: json.loads((tmp_path / run / "log.json").read_text()) for run in runs}
    for run, ref, tol in (("ep", "ddp", 2e-4), ("ep", "one", 1e-3), ("resumed", "one-resumed", 1e-3)):
        assert [h["step"] for h in log[run]] == [h["step"] for h in log[ref]] == [1, 2, 3, 4]
        for a, b in zip(log[run], log[ref]):
            assert a["loss"] == pytest.approx(b["loss"], rel=tol), (run, ref, a["step"])
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=tol), (run, ref, a["step"])
            assert b["grad_norm"] > 0.5  # (the clipping acts)


def test_transformers_model_refuses_what_its_expert_parallelism_cannot_do(tmp_path):
    import automoe
    from test_fallback import write_family_checkpoint

    path = write_family_checkpoint(tmp_path / "granitemoe", "granitemoe", num_local_experts=8)
    load = automoe.AutoModelForCausalLM.from_pretrained
    with pytest.raises(ValueError, match=r"ep_size=True\): expected a positive integer"):
        load(path, ep_size=True)
    with pytest.raises(ValueError, match="dispatcher 'local' runs every expert in this process"):
        load(path, ep_size=2, backend={"dispatcher": "local"})
    with pytest.raises(ValueError, match=r"ep_size=2, tp_plan=...\): AutoMoE's expert parallelism"):
        load(path, ep_size=2, tp_plan="auto")
    with pytest.raises(ValueError, match="runs the experts on AutoMoE's kernels"):
        load(path, ep_size=2, experts_implementation="grouped_mm")
    with pytest.raises(ValueError, match=r"from_config\(ep_size=...\): expert parallelism loads a checkpoint"):
        automoe.AutoModelForCausalLM.from_config(load(path).config, ep_size=2)


def test_the_drop_in_refuses_what_expert_parallelism_cannot_do(model_dir):
    import automoe
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="dispatcher='alltoall': this model runs every expert in this process"):
        automoe.AutoModelForCausalLM.from_pretrained(model_dir, backend={"dispatcher": "alltoall"})
    with pytest.raises(automoe.AutoMoEError, match=r"ep_size=2\): expert parallelism needs torch.distributed"):
        automoe.AutoModelForCausalLM.from_pretrained(model_dir, ep_size=2)
    with pytest.raises(ValueError, match=r"ep_size=0\): expected a positive integer"):
        automoe.AutoModelForCausalLM.from_pretrained(model_dir, ep_size=0)
    with pytest.raises(automoe.AutoMoEError, match=r"ep_size=2\): expert parallelism needs torch.distributed"):
        automoe.AutoModelForCausalLM.from_pretrained(model_dir, ep_size=2, force_transformers=True)
    model = automoe.AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(automoe.AutoMoEError, match="the dispatcher is chosen when the model is loaded"):
        model.set_backend({"dispatcher": "alltoall"})
    with pytest.raises(ValueError, match=r"from_config\(ep_size=2\): expert parallelism loads a checkpoint"):
        automoe.AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), ep_size=2)


def test_gpt_oss_experts_under_expert_parallelism_are_refused(tmp_path, tokenizer):
    from test_train_families import SIZES
    from automoe.demo import build_checkpoint

    ckpt = build_checkpoint(tmp_path / "oss", tokenizer, family="gpt_oss", **SIZES["gpt_oss"])
    proc = run_ranks(ep_recipe(ckpt, tmp_path, "run", ep=2), tmp_path, 2, check=False)
    assert proc.returncode != 0
    assert "GPT-OSS's experts (biases, transposed storage) do not run under an expert-parallel" in proc.stderr, \
        proc.stderr[-4000:]


def test_lora_dropout_on_two_ranks_resumes_with_each_ranks_masks(model_dir, tmp_path):
    """Data-parallel ranks draw their LoRA dropout masks from (train.seed, rank, step): a run on
    two processes stopped at step 2 and resumed continues with the losses of the uninterrupted
    run (checkpoints used to carry rank 0's generator, which every rank restored)."""
    def recipe(run):
        r = ep_recipe(model_dir, tmp_path, run, ep=1)
        r["train"]["max_steps"] = 4
        r["checkpoint"]["every"] = 2
        r["peft"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj"],
                     "lora_dropout": 0.5}
        r["optimizer"]["lr"] = 1e-2
        return r

    run_ranks(recipe("straight"), tmp_path, 2)
    run_ranks(recipe("split"), tmp_path, 2, "train.max_steps=2")
    run_ranks(recipe("split"), tmp_path, 2)
    ref, got = metrics(tmp_path / "straight"), metrics(tmp_path / "split")
    for step in (1, 2, 3, 4):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6), step
