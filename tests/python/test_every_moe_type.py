"""Every MoE causal-LM type of the pinned Transformers, enumerated from Transformers' own registry
(moe_types.py): as Transformers' model with AutoMoE's experts (the drop-in's path for types the
engine does not run natively; force_transformers=True for those it does), logits and loss to 1e-5
and every gradient to 1e-4 of Transformers' own, float32, a left-padded batch; the experts run on
AutoMoE's kernels (asserted from the autograd graph), whatever their layout. Under expert
parallelism (ep_size 2 and 4, Gloo, real processes): the losses and gradients of one process
(every_type_ep_worker.py). A type a Transformers upgrade adds is in these lists without an edit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_grads_close, autograd_node_names, rel_err
from moe_types import (moe_causal_lm_types, moe_types_without_experts_interface, padded_batch,
                       runnable_moe_types, tiny_config)

import automoe
from automoe.native import NATIVE_CLASSES

HERE = Path(__file__).parent
REPO = HERE.parent.parent


def spread_(model: torch.nn.Module) -> torch.nn.Module:
    """Wider than Transformers' init: decisive routing and signal in every weight."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1 if "bias" in name else 0.2)
    return model


def test_the_registry_lists_the_moe_types():
    types = moe_causal_lm_types()
    assert len(types) >= 40 and {"mixtral", "gpt_oss", "nemotron_h", "deepseek_v4", "gemma4"} <= set(types)
    assert not set(types) & set(moe_types_without_experts_interface())


# DeepSeek-V4's hyper-connections (Sinkhorn-normalised mixing) amplify the one-ulp difference of
# the fused RMSNorm (float32 statistics summed in another order) to ~1e-3 in their gradients, and
# its hash-routed gates' gradients are zero up to cancellation: compared with Transformers'
# RMSNorm, so that what is measured is the experts.
RMSNORM_TORCH = {"deepseek_v4"}


@pytest.mark.parametrize("model_type", runnable_moe_types())
def test_every_moe_type_matches_transformers_with_automoe_experts(model_type):
    from transformers import AutoModelForCausalLM as HFModel

    config = tiny_config(model_type)
    torch.manual_seed(0)
    ref = spread_(HFModel.from_config(config))
    backend = {"rms_norm": "torch"} if model_type in RMSNORM_TORCH else None
    ours = automoe.AutoModelForCausalLM.from_config(config, force_transformers=model_type in NATIVE_CLASSES,
                                                    backend=backend)
    ours.load_state_dict(ref.state_dict())
    assert type(ours) is type(ref) and ours.automoe_path == "transformers"
    assert ours.automoe_accelerated["experts"].startswith("AutoMoE grouped GEMMs"), ours.automoe_accelerated

    ids, mask, labels = padded_batch()
    ours.train()
    ref.train()
    # (the same random draws on both sides: PhiMoE jitters its router in training)
    torch.manual_seed(2)
    got = ours(input_ids=ids, attention_mask=mask, labels=labels)
    torch.manual_seed(2)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert rel_err(got.logits, want.logits) <= 1e-5
    assert rel_err(got.loss, want.loss) <= 1e-5
    ran = {n.split("::")[-1].rstrip(">") for n in autograd_node_names(got.loss) if "automoe::ops" in n}
    assert {"PermuteFn", "GroupedGemmFn", "UnpermuteFn"} <= ran, ran
    got.loss.backward()
    want.loss.backward()
    assert_grads_close(ours, ref)


def test_types_whose_experts_skip_the_interface_run_as_transformers_model():
    """Transformers' own experts code runs them; the load report says so (and expert parallelism
    refuses them by name: every_type_ep_worker.py)."""
    for model_type in ("jetmoe", "aria_text"):
        model = automoe.AutoModelForCausalLM.from_config(tiny_config(model_type))
        assert model.automoe_accelerated["experts"] == "Transformers' (no experts module uses the ExpertsInterface)"


def write_checkpoints(root: Path, types: list[str], experts: int) -> None:
    from transformers import AutoModelForCausalLM as HFModel

    for model_type in types:
        torch.manual_seed(0)
        spread_(HFModel.from_config(tiny_config(model_type, experts=experts))).save_pretrained(root / model_type)


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_moe_type_under_expert_parallelism_equals_one_process(tmp_path, nproc):
    types = runnable_moe_types()
    refused = sorted(moe_types_without_experts_interface())[:1]
    write_checkpoints(tmp_path, types + refused, experts=8)
    env = {"PYTHONPATH": f"{REPO / 'python'}:{HERE}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "every_type_ep_worker.py"), str(tmp_path), json.dumps(types), json.dumps(refused)]
    import os

    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **env), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.count(": ok") == nproc
