"""torchrun's restarts with real agents on Gloo: a worker SIGKILLed during a step, a checkpoint
save or the export, and torchrun restarting the group (`--max-restarts`), ends with the
uninterrupted run's losses and export, bit for bit; each attempt's groups live in a namespace of
their own in the agent's store (automoe/elastic.py); two agents as two nodes equal one node, a
lost node started again rejoins and the run ends equal, and a node that never comes back stops
the other within the timeouts. The drop-in under a restart forms its groups again.

AUTOMOE_RESTART_TRIALS=N runs N kill trials (default 3: one of each kind)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from test_parallel import ep_recipe, weights
from test_train import metrics, model_dir, tokenizer  # noqa: F401

HERE = Path(__file__).resolve().parent
TRIALS = int(os.environ.get("AUTOMOE_RESTART_TRIALS", "3"))
STEPS, EVERY = 6, 2


def env(**extra) -> dict:
    # The runs compared bit for bit are separate processes, each choosing its CPU GEMM paths by
    # timing: the baseline level has no measured choice (as in test_reliability.py).
    return dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1", AUTOMOE_CPU_ISA="baseline",
                **extra)


def torchrun_worker(*args: str) -> subprocess.CompletedProcess:
    """torchrun --standalone, 2 processes, --max-restarts 1, running elastic_worker.py ARGS; on
    the way out every process it started is gone (a failing run leaves no orphaned worker)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           str(HERE / "elastic_worker.py"), *args]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        out, err = agent.communicate(timeout=300)
    finally:
        kill_tree(agent)
    return subprocess.CompletedProcess(cmd, agent.returncode, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_recipe(recipe: dict, tmp: Path) -> Path:
    import yaml

    path = tmp / f"recipe-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def recipe_for(model_dir, tmp: Path, run: str, steps: int = STEPS) -> dict:
    r = ep_recipe(model_dir, tmp, run, ep=2, timeout_s=20)
    r["train"]["max_steps"] = steps
    r["checkpoint"]["every"] = EVERY
    return r


def standalone(recipe: Path, tmp: Path, max_restarts: int, **extra) -> subprocess.Popen:
    """`automoe train RECIPE --nproc-per-node 2 --max-restarts N` (torchrun --standalone)."""
    cmd = [sys.executable, "-m", "automoe.cli", "train", str(recipe), "--nproc-per-node", "2",
           "--max-restarts", str(max_restarts)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(**extra),
                            cwd=tmp)


def node(recipe: Path, tmp: Path, port: int, tag: str, nnodes: str = "2", max_restarts: int = 1,
         join_timeout: int = 60, rdzv_conf: str = "", **extra) -> subprocess.Popen:
    """One torchrun agent of a two-node job (one process per node), its log in tmp/<tag>.err."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           "--rdzv-id=job", f"--rdzv-conf=join_timeout={join_timeout}{rdzv_conf}", "-m", "automoe.cli", "train", str(recipe)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{tag}.err", "w"), env=env(**extra),
                            cwd=tmp)


def first_node(recipe: Path, tmp: Path, port: int, tag: str, **kw) -> subprocess.Popen:
    """The agent that hosts the rendezvous (c10d backend: the first agent on the endpoint's host
    binds it; the job lives as long as that agent does), started before the others."""
    agent = node(recipe, tmp, port, tag, **kw)
    deadline = time.monotonic() + 60
    while True:
        assert agent.poll() is None, (tmp / f"{tag}.err").read_text()[-3000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return agent
        except OSError:
            assert time.monotonic() < deadline, "the first agent never listened on the rendezvous endpoint"
            time.sleep(0.1)


def workers_of(agent: subprocess.Popen) -> list:
    import psutil

    return [p for p in psutil.Process(agent.pid).children(recursive=True) if "automoe.cli" in " ".join(p.cmdline())]


def kill_tree(agent: subprocess.Popen) -> None:
    import psutil

    try:
        procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def finish(agents: list[subprocess.Popen], timeout: float) -> None:
    try:
        for a in agents:
            a.wait(timeout=timeout)
    finally:
        for a in agents:
            kill_tree(a)


def last_checkpoint(run: Path) -> int:
    try:
        return int((run / "latest").read_text().strip().removeprefix("step-"))
    except (OSError, ValueError):
        return 0


def trained_steps(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(l)["step"] for l in lines if l.endswith("}") and '"type":"train"' in l]
    return max(steps, default=0)


def assert_same_run(got: Path, ref: Path, what: str) -> None:
    """The losses of every step and the export's tensors, bit for bit."""
    a, b = metrics(ref), metrics(got)
    assert sorted(b) == sorted(a), what
    for step in a:
        assert b[step]["loss"] == a[step]["loss"], (what, step)
        assert b[step]["grad_norm"] == a[step]["grad_norm"], (what, step)
    wa, wb = weights(ref), weights(got)
    assert sorted(wb) == sorted(wa), what
    for k in wa:
        assert torch.equal(wb[k], wa[k]), (what, k)
    leftovers = [p.name for p in got.rglob("*") if ".tmp" in p.name or ".pending-" in p.name]
    assert not leftovers, (what, leftovers)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """The uninterrupted two-process run (ep 2), and the fault points rank 1 passes in it."""
    tmp = tmp_path_factory.mktemp("elastic")
    trace = tmp / "trace"
    p = standalone(write_recipe(recipe_for(model_dir, tmp, "straight"), tmp), tmp, 0,
                   AUTOMOE_FAULT_TRACE=str(trace), AUTOMOE_FAULT_RANK="1")
    try:
        _, err = p.communicate(timeout=300)
    finally:
        kill_tree(p)
    assert p.returncode == 0, err[-4000:]
    points = [(int(n), what, path) for n, what, path in
              (line.split(" ", 2) for line in trace.read_text().splitlines())]
    return tmp / "straight", points


def kill_plan(points, trials: int) -> list[tuple[str, object]]:
    """(kind, where) for each trial: a fault point of rank 1 inside a checkpoint save after the
    first, one inside the export, and a moment during training; then random choices."""
    saves = [n for n, _, path in points if f".tmp-step-{EVERY * 2}" in path or f"step-{EVERY * 2}" in path]
    export = [n for n, _, path in points if "/export" in path]
    assert saves and export, points
    rng = random.Random(int(os.environ.get("AUTOMOE_RESTART_SEED", "0")))
    plan = [("save", saves[len(saves) // 2]), ("export", export[len(export) // 2]), ("step", 0.0)]
    kinds = {"save": saves, "export": export}
    while len(plan) < trials:
        kind = rng.choice(["save", "export", "step"])
        plan.append((kind, rng.choice(kinds[kind]) if kind != "step" else rng.uniform(0.0, 0.15)))
    return plan[:trials]


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_worker_killed_and_restarted_by_torchrun_ends_as_the_uninterrupted_run(model_dir, reference, tmp_path,
                                                                                 trial):
    ref, points = reference
    kind, where = kill_plan(points, TRIALS)[trial]
    run = tmp_path / "run"
    recipe = write_recipe(recipe_for(model_dir, tmp_path, "run"), tmp_path)
    if kind == "step":  # SIGKILL from outside, during a step after the first checkpoint
        p = standalone(recipe, tmp_path, 1)
    else:  # SIGKILL by rank 1 itself at a fault point of attempt 0
        p = standalone(recipe, tmp_path, 1, AUTOMOE_FAULT_KILL_AT=str(where), AUTOMOE_FAULT_RANK="1",
                       AUTOMOE_FAULT_ATTEMPT="0")
    try:
        if kind == "step":
            deadline = time.monotonic() + 300
            while last_checkpoint(run) < EVERY:
                assert p.poll() is None, p.communicate()[1][-4000:]
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(where)
            victims = [w for w in workers_of(p) if w.environ().get("RANK") == "1"]
            assert victims and last_checkpoint(run) < STEPS, "the run ended before the kill"
            victims[0].kill()
        _, err = p.communicate(timeout=300)
    finally:
        kill_tree(p)
    what = f"trial {trial}: SIGKILL of rank 1 at {kind} {where}"
    assert p.returncode == 0, f"{what}\n{err[-6000:]}"
    resumed = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"type":"resume"' in l]
    assert len(resumed) == 1, (what, resumed)  # killed once, restarted once
    assert_same_run(run, ref, what)


def test_the_trainer_on_an_expert_parallel_drop_in_resumes_after_torchrun_restarts_it(tmp_path):
    """The Transformers Trainer, unchanged, on the drop-in with ep_size=2 (Mixtral, native) under
    torchrun --max-restarts 1: rank 1 SIGKILLed as step 7 begins, after the step-5 checkpoint
    that rank 0 wrote alone; torchrun restarts the group, whose workers resume from that checkpoint
    (resume_from_checkpoint=True) and end with the uninterrupted one-process run's losses."""
    from test_fallback import write_family_checkpoint

    ckpt = write_family_checkpoint(tmp_path / "mixtral", "mixtral", num_local_experts=4)
    worker = str(HERE / "trainer_ep_worker.py")
    subprocess.run([sys.executable, worker, str(ckpt), str(tmp_path / "one"), "1"], check=True,
                   capture_output=True, env=env(), timeout=600)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           worker, str(ckpt), str(tmp_path / "ep"), "2", "last"]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env(AUTOMOE_TEST_KILL_AT_STEP="7"))
    try:
        _, err = agent.communicate(timeout=300)
    finally:
        kill_tree(agent)
    assert agent.returncode == 0, err[-6000:]
    assert "exitcode: -9" in err, err[-3000:]  # (rank 1 was killed, and torchrun restarted the group)
    ref = json.loads((tmp_path / "one" / "log.json").read_text())
    got = json.loads((tmp_path / "ep" / "log.json").read_text())
    assert [h["step"] for h in got] == [h["step"] for h in ref] == list(range(1, 11))
    for a, b in zip(got, ref):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]


def test_each_attempt_forms_its_groups_in_a_namespace_of_its_own(tmp_path):
    """Attempt 0 forms the world and a subgroup, then rank 1 dies; the restarted ranks agree on a
    new token, their groups' keys are under it, and nothing they use is attempt 0's."""
    out = tmp_path / "attempts.jsonl"
    p = torchrun_worker(str(out))
    assert p.returncode == 0, p.stderr[-4000:]
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    by_attempt = {a: [r for r in recs if r["attempt"] == a] for a in (0, 1)}
    assert all(len(v) == 2 for v in by_attempt.values()), recs
    tokens = {a: {r["token"] for r in v} for a, v in by_attempt.items()}
    assert len(tokens[0]) == len(tokens[1]) == 1 and tokens[0] != tokens[1], tokens
    for r in by_attempt[1]:
        assert r["sum"] == 3.0 and r["subgroup_sum"] == 3.0
        assert r["own_key_under_token"] and not r["own_key_under_old_token"], r
    for r in recs:  # every key the groups wrote is some attempt's (none in the store's open space)
        assert r["unscoped_keys"] == [], r


def test_the_attempt_token_ignores_a_stale_one_and_names_the_ranks_that_never_came():
    """In one process, on a real TCPStore: a rank that reads the previous attempt's token first
    (rank 0 of this attempt publishes later) still ends with this attempt's; rank 0 names the rank
    that never arrived."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from automoe import elastic

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))

    def client():  # each rank its own connection, as each process has
        return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))

    store.set(elastic.PREFIX + "current", "stale")
    got = {}
    t = threading.Thread(target=lambda: got.update(
        r1=elastic.attempt_token(client(), 1, 2, timedelta(seconds=10))))
    t.start()
    time.sleep(0.5)  # rank 1 has said hello under the stale token by now
    token = elastic.attempt_token(store, 0, 2, timedelta(seconds=10))
    t.join(10)
    assert got["r1"] == token != "stale"
    with pytest.raises(elastic.RendezvousError, match=r"rank\(s\) \[2\] of this torchrun attempt did not join"):
        def rank1():  # rank 0 gives up before rank 2 comes, so rank 1 is never answered
            with pytest.raises(elastic.RendezvousError, match="rank 0 of this torchrun attempt did not answer rank 1"):
                elastic.attempt_token(client(), 1, 3, timedelta(seconds=3))

        t = threading.Thread(target=rank1)
        t.start()
        try:
            elastic.attempt_token(store, 0, 3, timedelta(seconds=1))
        finally:
            t.join(10)


def test_max_restarts_passes_to_torchrun_and_needs_several_processes(model_dir, tmp_path):
    from automoe import distributed

    assert distributed.split_count(["r.yaml", "--max-restarts", "3", "x=1"], "--max-restarts", 0) == (3, ["r.yaml", "x=1"])
    assert distributed.split_count(["r.yaml", "--max_restarts=0"], "--max-restarts", 0) == (0, ["r.yaml"])
    with pytest.raises(ValueError, match="--max-restarts: expected an integer >= 0"):
        distributed.split_count(["--max-restarts", "-1"], "--max-restarts", 0)
    recipe = write_recipe(recipe_for(model_dir, tmp_path, "run"), tmp_path)
    p = subprocess.run([sys.executable, "-m", "automoe.cli", "train", str(recipe), "--max-restarts", "2"],
                       capture_output=True, text=True, env=env(), timeout=120)
    assert p.returncode == 1 and "--max-restarts: restarts are torchrun's" in p.stderr, p.stderr[-2000:]


# ---- two agents as two nodes -------------------------------------------------------------------

def test_two_nodes_equal_one_and_a_lost_node_started_again_rejoins(model_dir, reference, tmp_path):
    """Two agents with the c10d rendezvous, one process each: the one-node run's losses and export.
    Then a second job whose second node (agent and worker) is SIGKILLed after a checkpoint and
    started again: the survivor's agent restarts its worker, both rejoin, and the run ends equal.
    (The agents' shared store keeps the first round's address, so a node started again could not
    rejoin it: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as docs/parallelism.md says.)"""
    ref, _ = reference
    port = free_port()
    recipe = write_recipe(recipe_for(model_dir, tmp_path, "two"), tmp_path)
    agents = [first_node(recipe, tmp_path, port, "a")]
    agents.append(node(recipe, tmp_path, port, "b"))
    finish(agents, 300)
    assert [a.returncode for a in agents] == [0, 0], (tmp_path / "a.err").read_text()[-4000:]
    assert_same_run(tmp_path / "two", ref, "two nodes")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in (tmp_path / "a.err").read_text()  # the shared store: warned

    steps = STEPS
    port = free_port()
    recipe = write_recipe(recipe_for(model_dir, tmp_path, "lost", steps), tmp_path)
    fresh = dict(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    quick = ",keep_alive_interval=1,keep_alive_max_attempt=2"  # the lost node's place frees in 2 s
    a = first_node(recipe, tmp_path, port, "a2", rdzv_conf=quick, **fresh)
    b = node(recipe, tmp_path, port, "b2", rdzv_conf=quick, **fresh)
    try:
        deadline = time.monotonic() + 300
        while last_checkpoint(tmp_path / "lost") < EVERY:
            assert a.poll() is None and b.poll() is None, (tmp_path / "a2.err").read_text()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert trained_steps(tmp_path / "lost") < steps, "the run ended before the node was lost"
        kill_tree(b)
        b.wait()
        b = node(recipe, tmp_path, port, "b3", rdzv_conf=quick, **fresh)
        finish([a, b], 300)
    finally:
        kill_tree(a)
        kill_tree(b)
    assert [a.returncode, b.returncode] == [0, 0], (tmp_path / "a2.err").read_text()[-4000:]
    log = (tmp_path / "lost" / "metrics.jsonl").read_text()
    assert log.count('"type":"resume"') == 1, log[-2000:]
    assert_same_run(tmp_path / "lost", ref, "a node lost and started again")


def test_a_node_that_never_comes_back_stops_the_other_within_the_timeouts(model_dir, tmp_path):
    port, join_timeout = free_port(), 6
    recipe_doc = recipe_for(model_dir, tmp_path, "run", steps=10000)
    recipe = write_recipe(recipe_doc, tmp_path)
    a = first_node(recipe, tmp_path, port, "a", join_timeout=join_timeout)
    b = node(recipe, tmp_path, port, "b", join_timeout=join_timeout)
    try:
        deadline = time.monotonic() + 300
        while trained_steps(tmp_path / "run") < 1:
            assert a.poll() is None and b.poll() is None, (tmp_path / "a.err").read_text()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        kill_tree(b)
        t0 = time.monotonic()
        a.wait(timeout=recipe_doc["parallel"]["timeout_s"] + join_timeout + 60)
        elapsed = time.monotonic() - t0
    finally:
        kill_tree(a)
        kill_tree(b)
    err = (tmp_path / "a.err").read_text()
    assert a.returncode != 0
    assert elapsed < recipe_doc["parallel"]["timeout_s"] + join_timeout + 30, elapsed
    assert "a collective failed" in err, err[-3000:]
    assert "RendezvousTimeoutError" in err or "RendezvousClosedError" in err, err[-3000:]


def test_an_elastic_job_goes_on_with_the_node_that_is_left(model_dir, tmp_path):
    """--nnodes 1:2 and data parallelism: when one node is lost, torchrun's rules let the job
    continue with the other; its worker resumes the two-process checkpoint as one process (dp 2 ->
    1) and trains to the end."""
    port, steps = free_port(), 12
    doc = ep_recipe(model_dir, tmp_path, "run", ep=1, timeout_s=20)
    doc["train"]["max_steps"] = steps
    doc["checkpoint"]["every"] = EVERY
    recipe = write_recipe(doc, tmp_path)
    # (the lost node drops out in 2 s; the second node has 10 s to join the first rendezvous: with 1 s,
    # a slow start on a busy 2-core machine left the first node training alone to the end)
    conf = ",last_call_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=2"
    a = first_node(recipe, tmp_path, port, "a", nnodes="1:2", rdzv_conf=conf, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    b = node(recipe, tmp_path, port, "b", nnodes="1:2", rdzv_conf=conf, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    run = tmp_path / "run"
    try:
        deadline = time.monotonic() + 300
        while not (last_checkpoint(run) >= EVERY and '"world":2' in (run / "metrics.jsonl").read_text()):
            assert a.poll() is None and b.poll() is None, (tmp_path / "a.err").read_text()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert trained_steps(run) < steps, "the run ended before the node was lost"
        kill_tree(b)
        finish([a], 300)
    finally:
        kill_tree(a)
        kill_tree(b)
    assert a.returncode == 0, (tmp_path / "a.err").read_text()[-4000:]
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["type"] == "resume" for r in recs)
    last = [r for r in recs if r["type"] == "train"][-1]
    assert last["step"] == steps and last.get("parallel", {"world": 1})["world"] == 1, last  # (one process: none)
    assert (run / "export" / "config.json").exists()


# ---- the drop-in -------------------------------------------------------------------------------

def test_the_drop_in_under_expert_parallelism_forms_its_groups_again_after_a_restart(model_dir, tmp_path):
    """`from_pretrained(ep_size=2)` after the user's own init_process_group(), under torchrun with
    a restart: attempt 0's rank 1 dies after a training step; the restarted ranks form the world
    and the mesh's groups again and train the same step to the same loss."""
    out = tmp_path / "dropin.jsonl"
    p = torchrun_worker(str(out), str(model_dir))
    assert p.returncode == 0, p.stderr[-4000:]
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    first = {r["rank"]: r["loss"] for r in recs if r["attempt"] == 0}
    second = {r["rank"]: r["loss"] for r in recs if r["attempt"] == 1}
    assert sorted(second) == [0, 1] and first, recs
    for rank, loss in first.items():
        assert second[rank] == loss, recs
