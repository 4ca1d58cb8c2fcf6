"""`automoe train` end to end: data formats and the cache, recipe errors, train -> export ->
Transformers, resume after SIGKILL, gradient accumulation, packing, non-finite steps, report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, SHARED_DATA_CACHE

EXAMPLES = REPO / "examples" / "data"


@pytest.fixture(scope="session")
def tokenizer():
    from automoe.demo import build_tokenizer

    return build_tokenizer(EXAMPLES / "corpus.txt", vocab_size=400)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer):
    from automoe.demo import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", tokenizer, seed=0,
                            hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=2, mlp_only_layers=[], num_experts=4, head_dim=8,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run_train(recipe: dict, tmp: Path, *overrides: str, check: bool = True, timeout: int = 300):
    import yaml

    path = tmp / f"recipe-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run([sys.executable, "-m", "automoe.cli", "train", str(path), *overrides],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=tmp)
    if check and proc.returncode != 0:
        raise AssertionError(f"automoe train failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def base_recipe(model_dir: Path, tmp: Path, run: str, train_file: Path | None = None, **sections) -> dict:
    r = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        # The tokenised data in the session's shared cache (conftest's AUTOMOE_CACHE): each dataset
        # is tokenised once per session; tests of the cache itself give their own data.cache_dir.
        "data": {"train": str(train_file or EXAMPLES / "chat_train.jsonl"), "seq_len": 128,
                 "cache_dir": str(SHARED_DATA_CACHE)},
        "train": {"micro_batch_size": 2, "max_steps": 4, "seed": 0, "threads": 2},
        "optimizer": {"lr": 1e-3},
        "schedule": {"warmup_steps": 1},
        "checkpoint": {"dir": str(tmp / run)},
        "log": {"every": 1, "progress": "off", "peak_tflops": 1.0},  # no peak measurement per run
    }
    for sec, vals in sections.items():
        r.setdefault(sec, {}).update(vals)
    return r


def metrics(run: Path, kind: str = "train") -> dict[int, dict]:
    """The last record of each step (a resumed run logs the steps after its checkpoint again)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == kind:
            out[rec["step"]] = rec
    return out


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# ---- data --------------------------------------------------------------------------------------

def test_chat_loss_covers_exactly_the_assistant_turns(tokenizer, model_dir, tmp_path):
    from automoe import data

    conv = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "What is two plus two?"},
                         {"role": "assistant", "content": "Two plus two is four."},
                         {"role": "user", "content": "What colour is snow?"},
                         {"role": "assistant", "content": "Snow is white."}]}
    ids, mask = data.Encoder(tokenizer, "auto", "completion")(conv)
    assert ids == tokenizer(tokenizer.apply_chat_template(conv["messages"], tokenize=False),
                            add_special_tokens=False)["input_ids"]
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "Two plus two is four.<|im_end|>\nSnow is white.<|im_end|>\n"
    ids_all, mask_all = data.Encoder(tokenizer, "chat", "all")(conv)
    assert ids_all == ids and all(mask_all)


@pytest.mark.parametrize("fmt,line,target", [
    ("prompt_completion", {"prompt": "Question: What is one plus one?\nAnswer: ", "completion": "Two."}, "Two."),
    ("alpaca", {"instruction": "Name a colour.", "input": "", "output": "Blue."}, "Blue."),
    ("alpaca", {"instruction": "Answer.", "input": "What colour is coal?", "output": "Black."}, "Black."),
])
def test_prompt_formats_put_loss_on_the_completion_and_eos(tokenizer, fmt, line, target):
    from automoe import data

    for f in (fmt, "auto"):
        ids, mask = data.Encoder(tokenizer, f, "completion")(line)
        assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == target + tokenizer.eos_token
        assert mask[0] == 0 and ids[-1] == tokenizer.eos_token_id
    if fmt == "alpaca":
        text = tokenizer.decode(ids)
        assert "### Instruction:" in text and ("### Input:" in text) == bool(line["input"])


def test_text_format_trains_on_every_token(tokenizer):
    from automoe import data

    ids, mask = data.Encoder(tokenizer, "auto", "completion")({"text": "Snow is white."})
    assert all(mask) and ids[-1] == tokenizer.eos_token_id


def test_each_shipped_example_file_tokenises(tokenizer, model_dir, tmp_path):
    from automoe import data

    for name, fmt in [("chat_train.jsonl", "chat"), ("prompt_completion.jsonl", "prompt_completion"),
                      ("alpaca.jsonl", "alpaca"), ("text.jsonl", "text")]:
        ds = data.build([str(EXAMPLES / name)], tokenizer, str(model_dir), fmt=fmt, cache_dir=tmp_path)
        docs, masks = data.read(ds.path)
        n_lines = sum(1 for l in open(EXAMPLES / name) if l.strip())
        assert len(docs) == n_lines == ds.stats["documents"]
        assert sum(int(m.sum()) for m in masks) == ds.stats["loss_tokens"] > 0
        assert all(int(d.max()) < len(tokenizer) for d in docs)


def test_malformed_lines_name_file_and_line_and_skip_when_asked(tokenizer, model_dir, tmp_path):
    from automoe import data

    f = write_jsonl(tmp_path / "bad.jsonl", [
        {"text": "A fine line."},
        '{"text": "unterminated',
        {"prompt": "no completion"},
        {"messages": [{"role": "user", "content": "hi"}]},  # no assistant turn
        {"text": "Another fine line."},
    ])
    with pytest.raises(data.DataError, match=r"bad\.jsonl:2: "):
        data.build([str(f)], tokenizer, str(model_dir), cache_dir=tmp_path / "c1")
    ds = data.build([str(f)], tokenizer, str(model_dir), on_error="skip", cache_dir=tmp_path / "c2",
                    log=open(os.devnull, "w"))
    assert ds.stats["documents"] == 2 and ds.stats["skipped_lines"] == 3
    with pytest.raises(data.DataError, match="no such file"):
        data.build([str(tmp_path / "missing.jsonl")], tokenizer, str(model_dir), cache_dir=tmp_path)


def test_the_cache_is_reused_and_keyed_by_content_and_settings(tokenizer, model_dir, tmp_path):
    from automoe import data

    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "One two three."}, {"text": "Four five."}])
    a = data.build([str(f)], tokenizer, str(model_dir), cache_dir=tmp_path)
    b = data.build([str(f)], tokenizer, str(model_dir), cache_dir=tmp_path)
    assert not a.stats["reused"] and b.stats["reused"] and a.path == b.path
    c = data.build([str(f)], tokenizer, str(model_dir), train_on="all", cache_dir=tmp_path)
    assert c.key != a.key
    write_jsonl(f, [{"text": "One two three."}, {"text": "Four five six."}])
    d = data.build([str(f)], tokenizer, str(model_dir), cache_dir=tmp_path)
    assert d.key != a.key and not d.stats["reused"]


# ---- recipe errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("override,message", [
    ("train.micro_batchsize=2", "unknown key `train.micro_batchsize`"),
    ("optimizer.lr=-1", "optimizer.lr: expected a number in (0, 10], got -1"),
    ("data.packing=maybe", "data.packing: expected true or false"),
    ("data.train=/nonexistent.jsonl", "data.train: /nonexistent.jsonl: no such file"),
    ("model.path=/nonexistent", "model.path: /nonexistent is not a Hugging Face checkpoint"),
    ("bogus", "expected section.key=value"),
    ("router.bias_update_rate=2", "router.bias_update_rate: expected a number in [0, 1]"),
    # Qwen3-MoE's softmax routers have no correction bias to balance with
    ("router.bias_update_rate=0.01", "router.bias_update_rate: qwen3_moe routers have no "
                                     "e_score_correction_bias"),
])
def test_recipe_errors_name_the_key(model_dir, tmp_path, override, message):
    proc = run_train(base_recipe(model_dir, tmp_path, "run"), tmp_path, override, check=False)
    assert proc.returncode == 1, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ---- training ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    recipe = base_recipe(model_dir, tmp, "run",
                         data={"validation": str(EXAMPLES / "chat_valid.jsonl")},
                         train={"max_steps": 6, "eval_every": 3},
                         checkpoint={"every": 2, "keep_last": 2}, log={"tensorboard": str(tmp / "tb")})
    proc = run_train(recipe, tmp)
    return tmp / "run", proc


def test_export_loads_in_transformers_with_the_same_logits(trained, model_dir):
    from transformers import AutoModelForCausalLM

    import automoe

    run, _ = trained
    export = run / "export"
    assert (export / "tokenizer.json").exists() and (export / "config.json").exists()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (2, 24), generator=g)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(export)(input_ids=ids).logits
        ours = automoe.AutoModelForCausalLM.from_pretrained(export)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(model_dir)(input_ids=ids).logits
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base, ref), "the export equals the untrained model"
    # The export holds the final master weights (the checkpoint's dtype: float32 here).
    final = load_tensors(run / "step-6" / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(export).state_dict()
    torch.testing.assert_close(hf["model.embed_tokens.weight"], final["model.embed_tokens.weight"], rtol=0, atol=0)


def test_run_directory_has_checkpoints_metrics_and_eval(trained):
    run, proc = trained
    assert (run / "latest").read_text().strip() == "step-6"
    assert sorted(p.name for p in run.glob("step-*")) == ["step-4", "step-6"]  # keep_last 2
    steps = metrics(run)
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    rec = steps[6]
    for key in ("loss", "aux_loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "peak_memory_gib"):
        assert np.isfinite(rec[key]) and rec[key] >= 0, key
    assert rec["expert_load"] and {"layer", "min", "max", "cv", "empty", "counts"} <= set(rec["expert_load"][0])
    assert len(rec["expert_load"][0]["counts"]) == 4
    evals = metrics(run, "eval")
    assert sorted(evals) == [3, 6] and all(np.isfinite(e["eval_loss"]) for e in evals.values())
    state = json.loads((run / "step-6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["data_position"]["cursor"] > 0


def test_report_draws_loss_and_expert_load(trained):
    run, _ = trained
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run([sys.executable, "-m", "automoe.cli", "report", str(run)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("loss.png", "expert_load.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_after_sigkill_continues_with_the_same_losses(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "straight", train={"max_steps": 40},
                         checkpoint={"every": 3, "keep_last": 3})
    run_train(recipe, tmp_path)
    ref = metrics(tmp_path / "straight")
    # Where a CPU GEMM path is chosen by timing, two runs from scratch could measure differently and
    # sum in another order (docs/recipes.md); the machine cache (the tests' own) makes them agree,
    # and the killed run is pinned to the straight run's choice besides, so that this test checks
    # the resume alone. Its resume takes the choice from the checkpoint.
    state = json.loads((tmp_path / "straight" / "step-40" / "trainer_state.json").read_text())

    # The killed run saves after every step, so the kill often lands in the middle of a save.
    recipe["checkpoint"].update(dir=str(tmp_path / "killed"), every=1, keep_last=2)
    import yaml

    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), AUTOMOE_CPU_GEMM_DECISIONS=state["cpu_gemm"])
    proc = subprocess.Popen([sys.executable, "-m", "automoe.cli", "train", str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = tmp_path / "killed" / "latest"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() not in ("", "step-1", "step-2", "step-3", "step-4", "step-5"):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = int(latest.read_text().strip().split("-")[1])
    assert 5 < killed_at < 40

    run_train(recipe, tmp_path)  # resumes by default
    got = metrics(tmp_path / "killed")
    assert sorted(got) == sorted(ref) == list(range(1, 41))
    for step in ref:
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6, abs=0), step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5), step
    a = load_tensors(tmp_path / "straight" / "step-40" / "model.safetensors")
    b = load_tensors(tmp_path / "killed" / "step-40" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=1e-7)


def test_existing_run_is_not_overwritten_without_resume(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 1})
    run_train(recipe, tmp_path)
    proc = run_train(recipe, tmp_path, "checkpoint.resume=false", check=False)
    assert proc.returncode == 1 and "already holds a run" in proc.stderr, proc.stderr


@pytest.mark.parametrize("packing", [True, False])
def test_gradient_accumulation_matches_one_larger_batch(model_dir, tmp_path, packing):
    runs = {}
    for micro, accum in [(4, 1), (2, 2), (1, 4)]:
        name = f"m{micro}a{accum}"
        recipe = base_recipe(model_dir, tmp_path, name, data={"packing": packing, "seq_len": 96},
                             train={"micro_batch_size": micro, "grad_accumulation_steps": accum, "max_steps": 3},
                             model={"router_aux_loss_coef": 0.0}, optimizer={"max_grad_norm": 0.0})
        run_train(recipe, tmp_path)
        runs[name] = tmp_path / name
    ref = metrics(runs["m4a1"])
    for name, run in runs.items():
        got = metrics(run)
        for step in (1, 2, 3):
            assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), (name, step)
            assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), (name, step)
            assert got[step]["tokens"] == ref[step]["tokens"]
        a = load_tensors(runs["m4a1"] / "step-3" / "model.safetensors")
        b = load_tensors(run / "step-3" / "model.safetensors")
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)


def test_packed_documents_train_like_unpacked_ones(model_dir, tmp_path):
    # Six short chats: packed into one row of 512 tokens, or one per row, padded. The first step
    # sees the same six documents either way; with no attention across documents and positions
    # restarting, loss, aux loss and gradients agree.
    lines = [l for l in open(EXAMPLES / "chat_valid.jsonl")][:6]
    f = tmp_path / "six.jsonl"
    f.write_text("".join(lines))
    out = {}
    for packing, micro in [(True, 1), (False, 6)]:
        name = f"packing-{packing}"
        recipe = base_recipe(model_dir, tmp_path, name, f, train={"micro_batch_size": micro, "max_steps": 1},
                             model={"router_aux_loss_coef": 0.05})
        recipe["data"].update(packing=packing, seq_len=512, shuffle=False)
        run_train(recipe, tmp_path)
        out[packing] = metrics(tmp_path / name)[1]
    assert out[True]["tokens"] == out[False]["tokens"]
    for key in ("loss", "aux_loss", "grad_norm"):
        assert out[True][key] == pytest.approx(out[False][key], rel=1e-5), key
    assert [l["counts"] for l in out[True]["expert_load"]] == [l["counts"] for l in out[False]["expert_load"]]


def test_bfloat16_compute_keeps_float32_masters_and_exports_the_checkpoint_dtype(model_dir, tmp_path):
    recipe = base_recipe(model_dir, tmp_path, "bf16", model={"dtype": "bfloat16"}, train={"max_steps": 2},
                         optimizer={"master_weights": "float32", "state_dtype": "float32"})
    run_train(recipe, tmp_path)
    run = tmp_path / "bf16"
    assert all(t.dtype == torch.float32 for t in load_tensors(run / "step-2" / "model.safetensors").values())
    assert json.loads((run / "export" / "config.json").read_text())["dtype"] == "float32"
    assert all(np.isfinite(r["loss"]) for r in metrics(run).values())


def test_bfloat16_default_precision_is_remainders_and_8bit_and_a_resume_keeps_its_checkpoints(model_dir, tmp_path):
    """optimizer.master_weights / state_dtype "auto" (the defaults): one bf16 process keeps its float32
    masters as remainders with 8-bit moments; ZeRO and float32 runs keep float32; a resumed run keeps
    the precision its checkpoint was written with (one from an explicit float32 run continues)."""
    def state(run: Path, step: int) -> dict:
        return json.loads((run / f"step-{step}" / "trainer_state.json").read_text())["optimizer_precision"]

    auto = base_recipe(model_dir, tmp_path, "auto", model={"dtype": "bfloat16"}, train={"max_steps": 2},
                       checkpoint={"every": 2})
    run_train(auto, tmp_path)
    assert state(tmp_path / "auto", 2)["master_weights"] == "remainders"
    assert state(tmp_path / "auto", 2)["state_dtype"] == "8bit"
    f32 = base_recipe(model_dir, tmp_path, "f32", model={"dtype": "float32"}, train={"max_steps": 2})
    run_train(f32, tmp_path)
    assert state(tmp_path / "f32", 2) == {"master_weights": "float32", "state_dtype": "float32"}
    old = base_recipe(model_dir, tmp_path, "old", model={"dtype": "bfloat16"}, train={"max_steps": 2},
                      optimizer={"master_weights": "float32", "state_dtype": "float32"}, checkpoint={"every": 2})
    run_train(old, tmp_path)
    old["optimizer"] = {"lr": 1e-3}  # back to "auto"
    old["train"]["max_steps"] = 3
    run_train(old, tmp_path)
    assert state(tmp_path / "old", 3) == {"master_weights": "float32", "state_dtype": "float32"}


def test_bfloat16_optimizer_precision_options_train_checkpoint_and_refuse_a_mismatched_resume(model_dir, tmp_path):
    """optimizer.master_weights / state_dtype through `automoe train` (two micro-batches a step, so
    the gradients go float32 from the second): remainders keep the float32 masters (the losses of
    the float32-master run, up to the bf16 copy's rounding at exact ties), none + bfloat16 moments
    trains; the checkpoints hold what each keeps (bf16 weights, int16 remainders, bf16 moments); a
    resume with other settings is refused by name, with the same ones it continues."""
    from automoe import _C

    runs = {}
    for mw, sd in [("float32", "float32"), ("remainders", "float32"), ("none", "bfloat16")]:
        recipe = base_recipe(model_dir, tmp_path, f"{mw}-{sd}", model={"dtype": "bfloat16"},
                             train={"max_steps": 3, "grad_accumulation_steps": 2},
                             optimizer={"master_weights": mw, "state_dtype": sd},
                             checkpoint={"every": 3})
        run_train(recipe, tmp_path)
        runs[mw] = (recipe, tmp_path / f"{mw}-{sd}")
    ref, rem, none = (metrics(runs[k][1]) for k in ("float32", "remainders", "none"))
    for step in (1, 2, 3):
        assert rem[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-3), step
        assert np.isfinite(none[step]["loss"])
    assert ref[1]["loss"] == pytest.approx(none[1]["loss"], rel=1e-6)  # the same start

    f32 = load_tensors(runs["float32"][1] / "step-3" / "model.safetensors")
    w = load_tensors(runs["remainders"][1] / "step-3" / "model.safetensors")
    opt = load_tensors(runs["remainders"][1] / "step-3" / "optimizer.safetensors")
    for name, t in f32.items():
        if name not in w or t.dtype != torch.float32 or "correction_bias" in name:
            continue
        assert w[name].dtype == torch.bfloat16 and opt[f"remainder.{name}"].dtype == torch.int16
        assert opt[f"exp_avg.{name}"].dtype == torch.float32
        master = _C._join_master(w[name], opt[f"remainder.{name}"])
        # The same masters but where a bf16 copy's rounding at an exact tie moved a gradient:
        # Adam's normalised step is then up to 2 lr away, each of the 3 steps.
        assert (master - t).abs().max() <= 6 * 1e-3, name
        # ... and they hold more than the bf16 weights do (the remainders are not empty)
        assert (master != w[name].float()).float().mean() > 0.9, name
    opt_none = load_tensors(runs["none"][1] / "step-3" / "optimizer.safetensors")
    assert all(t.dtype == torch.bfloat16 for k, t in opt_none.items() if k.startswith("exp_avg"))
    assert not any(k.startswith("remainder.") for k in opt_none)

    recipe, run = runs["remainders"]
    recipe["train"]["max_steps"] = 4
    proc = run_train(recipe, tmp_path, "optimizer.master_weights=float32", check=False)
    assert proc.returncode == 1, proc.stderr
    assert ("the checkpoint's optimizer state was written with optimizer.master_weights: "
            "remainders, state_dtype: float32; this run has master_weights: float32") in proc.stderr
    run_train(recipe, tmp_path)
    assert sorted(metrics(run)) == [1, 2, 3, 4]


def test_8bit_moments_train_checkpoint_codes_and_scales_and_resume_to_the_same_losses(model_dir, tmp_path):
    """optimizer.state_dtype 8bit: the checkpoint holds uint8 codes for tensors of two or more
    dimensions, with float32 block scales ([..., ceil(cols / 256)]) that dequantize to the moments a
    bf16-moment run keeps (to the map's resolution), float32 moments for 1-D ones; the
    losses follow the bf16-moment run's; a run stopped at step 2 and resumed makes the same
    losses and weights as one that went straight to step 4."""
    from automoe import _C

    def recipe(name, moments, steps):
        return base_recipe(model_dir, tmp_path, name, model={"dtype": "bfloat16"},
                           train={"max_steps": steps},
                           optimizer={"master_weights": "none", "state_dtype": moments},
                           checkpoint={"every": 2})

    run_train(recipe("straight", "8bit", 4), tmp_path)
    run_train(recipe("bf16", "bfloat16", 2), tmp_path)
    stopped = recipe("stopped", "8bit", 2)
    run_train(stopped, tmp_path)
    stopped["train"]["max_steps"] = 4
    run_train(stopped, tmp_path)

    ref, got, bf16 = (metrics(tmp_path / n) for n in ("straight", "stopped", "bf16"))
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for step in ref:
        assert got[step]["loss"] == ref[step]["loss"], step
    assert ref[2]["loss"] == pytest.approx(bf16[2]["loss"], rel=1e-2)
    a, b = (load_tensors(tmp_path / n / "step-4" / "model.safetensors") for n in ("straight", "stopped"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    state = load_tensors(tmp_path / "straight" / "step-2" / "optimizer.safetensors")
    state16 = load_tensors(tmp_path / "bf16" / "step-2" / "optimizer.safetensors")
    weights = load_tensors(tmp_path / "straight" / "step-2" / "model.safetensors")
    quantized = 0
    for name, w in weights.items():
        if f"exp_avg.{name}" not in state:
            continue
        m, v = state[f"exp_avg.{name}"], state[f"exp_avg_sq.{name}"]
        if w.dim() < 2:
            assert m.dtype == v.dtype == torch.float32 and f"exp_avg_scale.{name}" not in state
            continue
        quantized += 1
        sm, sv = state[f"exp_avg_scale.{name}"], state[f"exp_avg_sq_scale.{name}"]
        assert m.dtype == v.dtype == torch.uint8 and m.shape == w.shape, name
        blocks = -(-w.shape[-1] // 256)
        assert sm.dtype == torch.float32 and sm.shape == (*w.shape[:-1], blocks), name
        # the same gradients at step 1, one update apart at step 2: the moments agree to the map's
        # resolution (and bf16's) relative to their magnitude
        for codes, scale, signed, ref16 in ((m, sm, True, state16[f"exp_avg.{name}"]),
                                            (v, sv, False, state16[f"exp_avg_sq.{name}"])):
            deq = _C._dequantize8(codes, scale, signed).float()
            err = (deq - ref16.float()).abs().max()
            assert err <= 0.05 * ref16.float().abs().max(), name
    assert quantized >= 3  # embeddings, LM head, the experts' gate_up


@pytest.mark.parametrize("dtype,masters,moments,checkpointing", [
    ("bfloat16", "none", "bfloat16", True), ("bfloat16", "none", "8bit", False),
    ("bfloat16", "float32", "float32", False),
    ("float32", "float32", "float32", False)])
def test_optimizer_in_backward_makes_the_same_weights_and_state_as_the_step_after_it(
        model_dir, tmp_path, dtype, masters, moments, checkpointing):
    """optimizer.in_backward updates each tensor in its gradient's hook, during the backward:
    bit for bit the weights, moments and losses of the ordinary step (the same update on the same
    gradients, so nothing the backward still needs was changed under it), the gradient norm the
    same up to the summation order; with activation checkpointing too."""
    runs = {}
    for in_bwd in (False, True):
        name = f"{dtype}-{masters}-{in_bwd}"
        optimizer = {"max_grad_norm": 0.0, "in_backward": in_bwd, "weight_decay": 0.1}
        if dtype == "bfloat16":
            optimizer.update(master_weights=masters, state_dtype=moments)
        recipe = base_recipe(model_dir, tmp_path, name, model={"dtype": dtype},
                             train={"max_steps": 3,
                                    "activation_checkpointing": checkpointing and in_bwd},
                             optimizer=optimizer, checkpoint={"every": 3})
        run_train(recipe, tmp_path)
        runs[in_bwd] = tmp_path / name
    ref, got = metrics(runs[False]), metrics(runs[True])
    assert sorted(got) == [1, 2, 3]
    for step in (1, 2, 3):
        assert got[step]["loss"] == ref[step]["loss"], step
        assert got[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-6), step
    for f in ("model.safetensors", "optimizer.safetensors"):
        a, b = (load_tensors(runs[k] / "step-3" / f) for k in (False, True))
        assert sorted(a) == sorted(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (f, k)
    # ... and trained: the weights moved
    start = load_tensors(model_dir / "model.safetensors")
    after = load_tensors(runs[True] / "step-3" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(start[q].float(), after[q].float())


def test_optimizer_in_backward_refuses_what_it_cannot_honour_by_name(model_dir, tmp_path):
    def error(**sections):
        recipe = base_recipe(model_dir, tmp_path, f"refused-{time.monotonic_ns()}", **sections)
        proc = run_train(recipe, tmp_path, check=False)
        assert proc.returncode != 0
        return proc.stderr

    assert "set optimizer.max_grad_norm: 0 (it is 1)" in error(optimizer={"in_backward": True})
    assert "train.grad_accumulation_steps is 2" in error(
        optimizer={"in_backward": True, "max_grad_norm": 0.0}, train={"grad_accumulation_steps": 2})
    assert "optimizer.in_backward with peft" in error(
        optimizer={"in_backward": True, "max_grad_norm": 0.0},
        peft={"r": 2, "target_modules": ["q_proj"]})


def test_optimizer_in_backward_skips_a_non_finite_step_without_touching_the_weights(model_dir, tmp_path):
    """A NaN loss makes the first gradient the backward completes non-finite: no tensor is
    updated, the step is skipped as without in_backward, and the skip says how many tensors the
    backward had updated (none)."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan-model"
    shutil.copytree(model_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    recipe = base_recipe(broken, tmp_path, "nan", model={"dtype": "bfloat16"},
                         train={"max_steps": 5, "max_nonfinite_steps": 2},
                         optimizer={"in_backward": True, "max_grad_norm": 0.0,
                                    "master_weights": "none", "state_dtype": "bfloat16"})
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode == 3, proc.stderr
    run = tmp_path / "nan"
    skips = metrics(run, "skip")
    assert len(skips) == 2 and all(s["tensors_updated"] == 0 for s in skips.values())
    saved = load_tensors(run / "step-2" / "model.safetensors")
    common = [k for k in saved if k in weights]  # (the experts are stored fused there)
    assert len(common) >= 10
    for k in common:
        assert torch.testing.assert_close(saved[k], weights[k].to(saved[k].dtype), rtol=0, atol=0,
                                          equal_nan=True) is None, k


def test_non_finite_steps_are_skipped_then_the_run_stops_with_a_checkpoint(model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan-model"
    shutil.copytree(model_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    recipe = base_recipe(broken, tmp_path, "nan", train={"max_steps": 10, "max_nonfinite_steps": 3})
    proc = run_train(recipe, tmp_path, check=False)
    assert proc.returncode == 3, proc.stderr
    assert "3 consecutive non-finite steps" in proc.stderr
    run = tmp_path / "nan"
    assert (run / "latest").read_text().strip() == "step-3"
    assert len(metrics(run, "skip")) == 3
    assert not (run / "export").exists()


def test_activation_checkpointing_trains_identically(model_dir, tmp_path):
    out = {}
    for ckpt in (False, True):
        name = f"ckpt-{ckpt}"
        recipe = base_recipe(model_dir, tmp_path, name, train={"max_steps": 3, "activation_checkpointing": ckpt})
        run_train(recipe, tmp_path)
        out[ckpt] = metrics(tmp_path / name)
    for step in (1, 2, 3):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert out[True][step][key] == pytest.approx(out[False][step][key], rel=1e-5), (step, key)


def test_drop_in_gradient_checkpointing_matches_the_plain_backward(model_dir):
    import automoe

    model = automoe.AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(0))

    def grads():
        model.zero_grad()
        model(ids, labels=ids, output_router_logits=True).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    model.train()
    plain = grads()
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing
    ckpt = grads()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], rtol=1e-5, atol=1e-7)


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = _crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _fields(buf: bytes):
    """(field number, wire type, value) of a protobuf message."""
    import struct

    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(buf, i)
        elif wire == 1:
            v, i = struct.unpack_from("<d", buf, i)[0], i + 8
        elif wire == 5:
            v, i = struct.unpack_from("<f", buf, i)[0], i + 4
        elif wire == 2:
            n, i = _varint(buf, i)
            v, i = buf[i:i + n], i + n
        else:
            raise AssertionError(f"unexpected wire type {wire}")
        yield field, wire, v


def _varint(buf: bytes, i: int):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


def test_tensorboard_event_file_holds_the_logged_scalars(trained):
    import struct

    run, _ = trained
    files = list((run.parent / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1
    raw = files[0].read_bytes()
    i, events = 0, []
    while i < len(raw):
        (n,) = struct.unpack_from("<Q", raw, i)
        assert struct.unpack_from("<I", raw, i + 8)[0] == _masked(raw[i:i + 8])
        payload = raw[i + 12:i + 12 + n]
        assert struct.unpack_from("<I", raw, i + 12 + n)[0] == _masked(payload)
        events.append(payload)
        i += 12 + n + 4
    first = dict((f, v) for f, _, v in _fields(events[0]))
    assert first[3] == b"brain.Event:2"
    scalars = {}
    for ev in events[1:]:
        f = {field: v for field, _, v in _fields(ev)}
        for _, _, value in _fields(f[5]):
            val = {field: v for field, _, v in _fields(value)}
            scalars[(val[1].decode(), f[2])] = val[2]
    for step, rec in metrics(run).items():
        assert scalars[("train/loss", step)] == pytest.approx(rec["loss"], rel=1e-6)
        assert scalars[("train/lr", step)] == pytest.approx(rec["lr"], rel=1e-6)
    for step, rec in metrics(run, "eval").items():
        assert scalars[("eval/loss", step)] == pytest.approx(rec["eval_loss"], rel=1e-6)
    assert ("moe/layer0/load_cv", 6) in scalars


def test_recipe_yaml_reads_numbers_and_booleans_as_yaml_1_2(tmp_path, model_dir):
    from automoe import train

    f = tmp_path / "r.yaml"
    f.write_text("model: {path: m}\ndata: {train: t.jsonl}\ncheckpoint: {dir: run}\n"
                 "optimizer: {lr: 3e-4}\nlog: {progress: off}\n")
    doc = train.load_recipe(str(f), ["optimizer.eps=1e-6", "data.packing=false", "train.seed=017",
                                     "model.backend.experts=eager"])
    r = train.resolve(doc, str(f))
    assert r["optimizer"]["lr"] == 3e-4 and r["optimizer"]["eps"] == 1e-6
    assert r["log"]["progress"] == "off" and r["data"]["packing"] is False
    assert r["train"]["seed"] == 17 and r["model"]["backend"] == {"experts": "eager"}
    assert r["train"]["global_batch_size"] == 1 and r["schedule"]["type"] == "cosine"


def test_a_checkpoint_renamed_into_place_before_latest_moved_is_replaced(model_dir, tmp_path):
    # A kill between renaming step-N into place and updating `latest` leaves step-N on disk with
    # `latest` still on an older step: the resumed run redoes the steps and replaces step-N.
    recipe = base_recipe(model_dir, tmp_path, "run", train={"max_steps": 4}, checkpoint={"every": 2, "keep_last": 3})
    run_train(recipe, tmp_path)
    run = tmp_path / "run"
    ref = metrics(run)
    (run / "latest").write_text("step-2\n")
    (run / "step-4" / "marker").write_text("stale")
    run_train(recipe, tmp_path)
    assert (run / "latest").read_text().strip() == "step-4"
    assert not (run / "step-4" / "marker").exists()
    got = metrics(run)
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6)
    assert any(json.loads(l)["type"] == "resume" for l in (run / "metrics.jsonl").read_text().splitlines())


def test_a_template_that_refuses_a_conversation_is_a_data_error_with_its_line(tokenizer, model_dir, tmp_path):
    import copy

    from automoe import data

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('System role not supported') }}{% endif %}"
                            "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    f = write_jsonl(tmp_path / "sys.jsonl", [
        {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                      {"role": "assistant", "content": "Hello."}]},
    ])
    with pytest.raises(data.DataError, match=r"sys\.jsonl:2: the chat template refused .*System role"):
        data.build([str(f)], strict, str(model_dir), cache_dir=tmp_path / "a")
    ds = data.build([str(f)], strict, str(model_dir), on_error="skip", cache_dir=tmp_path / "b",
                    log=open(os.devnull, "w"))
    assert ds.stats["documents"] == 1 and ds.stats["skipped_lines"] == 1


def test_non_finite_recipe_values_name_the_key(model_dir, tmp_path):
    proc = run_train(base_recipe(model_dir, tmp_path, "run"), tmp_path, "optimizer.max_grad_norm=.inf", check=False)
    assert proc.returncode == 1 and "optimizer.max_grad_norm: expected a finite number" in proc.stderr, proc.stderr


def test_checkpointed_backward_survives_the_model_object(model_dir):
    import gc

    import automoe

    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    m = automoe.AutoModelForCausalLM.from_pretrained(model_dir)
    params = dict(m.named_parameters())
    m.gradient_checkpointing_enable()
    m.train()
    loss = m(ids, labels=ids, output_router_logits=True).loss
    del m
    gc.collect()
    loss.backward()
    assert all(p.grad is not None for p in params.values())


def test_epochs_set_the_length_and_the_export_takes_the_asked_layout_and_dtype(model_dir, tmp_path):
    lines = [l for l in open(EXAMPLES / "chat_valid.jsonl")][:12]
    f = tmp_path / "twelve.jsonl"
    f.write_text("".join(lines))
    recipe = base_recipe(model_dir, tmp_path, "epochs", f, train={"micro_batch_size": 2, "max_steps": 0, "epochs": 1.5},
                         checkpoint={"export_layout": "fused", "export_dtype": "bfloat16"})
    recipe["data"]["packing"] = False  # one document per row: 6 micro-batches per epoch
    run_train(recipe, tmp_path)
    run = tmp_path / "epochs"
    start = next(json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines())
    assert start["type"] == "start" and start["total_steps"] == 9
    steps = metrics(run)
    assert sorted(steps) == list(range(1, 10)) and steps[9]["epoch"] == pytest.approx(1.5)
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    exported = load_tensors(run / "export" / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in exported
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
