"""The README's main command (`make demo`) end to end: builds the tiny model and tokenizer,
fine-tunes it on the shipped chat data, exports, and compares with Transformers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO


def test_make_demo_fine_tunes_and_transformers_agrees(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run([sys.executable, "-m", "automoe.demo", "--cache", str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "(tiny qwen3_moe, 8 experts, top-2;" in out, out
    held = re.search(r"loss ([0-9.]+) before -> ([0-9.]+) after", out)
    assert held and float(held.group(2)) < 0.5 * float(held.group(1)), out
    parity = re.search(r"relative difference ([0-9.e+-]+)\)", out)
    assert parity and float(parity.group(1)) <= 1e-5, out
    assert (tmp_path / "demo-run" / "export" / "tokenizer.json").exists()
    assert (tmp_path / "qwen3-moe-tiny-chat-v1" / "tokenizer.json").exists()


def test_demo_lora_fine_tunes_adapters_that_peft_loads(tmp_path):
    """examples/lora.yaml on the demo model: LoRA on attention and the experts, under a minute on
    a CPU; the held-out loss falls, and PEFT on Transformers' model gives AutoMoE's loss."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run([sys.executable, "-m", "automoe.demo", "--lora", "--cache", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "(tiny qwen3_moe, 8 experts, top-2;" in out, out
    held = re.search(r"loss ([0-9.]+) before -> ([0-9.]+) after", out)
    assert held and float(held.group(2)) < 0.9 * float(held.group(1)), out
    parity = re.search(r"relative difference ([0-9.e+-]+)\)", out)
    assert parity and float(parity.group(1)) <= 1e-5, out
    run = tmp_path / "demo-run-lora"
    assert (run / "export" / "adapter_config.json").exists()
    assert (run / "export-merged" / "config.json").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "glm4_moe", "mixtral", "qwen2_moe", "olmoe",
                                    "gpt_oss", "nemotron_h", "qwen3_next"])
def test_demo_names_the_experts_of_every_family(tmp_path, family):
    """The demo's first line reads the number of routed experts from the config.json Transformers
    writes for each `--model` family, whichever key that family saves it under (Qwen3-MoE's
    num_experts is written as num_local_experts by Transformers v5)."""
    import transformers

    from automoe.demo import FAMILY_DEMOS, num_experts

    config_class, config, _, _ = FAMILY_DEMOS[family]
    getattr(transformers, config_class)(**config, vocab_size=64).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert num_experts(saved) == 8 == next(v for k, v in config.items()
                                           if k in ("num_experts", "n_routed_experts", "num_local_experts"))
