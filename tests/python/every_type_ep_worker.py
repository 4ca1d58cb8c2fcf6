"""One rank of test_every_moe_type.py's expert-parallel check (torchrun, Gloo): for each type, the
drop-in with ep_size = world against the one-process model from the same checkpoint, every rank
feeding the same padded batch — the loss, and each parameter's gradient (this rank's experts of
the one-process gradient), equal; a type whose experts skip Transformers' experts interface is
refused by name.

argv: the directory of checkpoints (one per type), the types (JSON), the refused types (JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from moe_types import padded_batch
from torch.distributed.tensor import DTensor

from automoe import AutoModelForCausalLM, AutoMoEError


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def main() -> None:
    root, types, refused = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, mask, labels = padded_batch()
    for model_type in types:
        path = root / model_type
        ref = AutoModelForCausalLM.from_pretrained(path, force_transformers=True, dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(path, force_transformers=True, dtype=torch.float32,
                                                     ep_size=world)
        par = model.automoe_parallel
        begin, count = par["expert_begin"], par["expert_count"]
        routed = set(model._ddp_params_and_buffers_to_ignore)
        assert routed, model_type
        ref.train()
        model.train()
        torch.manual_seed(2)  # (the same random draws on both sides: PhiMoE jitters its router)
        want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
        torch.manual_seed(2)
        got = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, msg=lambda m: f"{model_type}: loss: {m}")
        want.backward()
        got.backward()
        for name, p in model.named_parameters():
            r = ref.get_parameter(name).grad
            if r is None:
                assert p.grad is None, f"{model_type}: {name}"
                continue
            if name in routed:
                r = r[begin:begin + count]
            # (each rank's backward brings its experts the gradient of every rank's identical loss,
            # averaged over the world by the experts' hook: the one-process gradient)
            # (atol 5e-6: an AVX2-only CPU's kernels round one embedding row 2.1e-6 apart)
            torch.testing.assert_close(local(p.grad), r, rtol=1e-5, atol=5e-6,
                                       msg=lambda m: f"{model_type}: gradient of {name}: {m}")
    for model_type in refused:
        try:
            AutoModelForCausalLM.from_pretrained(root / model_type, ep_size=world)
        except AutoMoEError as e:
            assert "no experts module that uses Transformers' experts interface" in str(e), e
        else:
            raise AssertionError(f"{model_type}: loaded with ep_size={world}")
    import gc

    gc.collect()  # (the models' dispatchers hold the groups: released while the interpreter is whole)
    dist.destroy_process_group()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
