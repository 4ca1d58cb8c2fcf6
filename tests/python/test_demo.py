"""The README's main command (`make demo`) end to end: builds the tiny model and tokenizer,
fine-tunes it on the shipped chat data, exports, and compares with Transformers."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import REPO


def test_make_demo_fine_tunes_and_transformers_agrees(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run([sys.executable, "-m", "automoe.demo", "--cache", str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
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
    held = re.search(r"loss ([0-9.]+) before -> ([0-9.]+) after", out)
    assert held and float(held.group(2)) < 0.9 * float(held.group(1)), out
    parity = re.search(r"relative difference ([0-9.e+-]+)\)", out)
    assert parity and float(parity.group(1)) <= 1e-5, out
    run = tmp_path / "demo-run-lora"
    assert (run / "export" / "adapter_config.json").exists()
    assert (run / "export-merged" / "config.json").exists()
