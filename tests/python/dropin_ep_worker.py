"""One rank of the drop-in under expert parallelism (run by torchrun on Gloo, from
test_parallel.py): `AutoModelForCausalLM.from_pretrained(path, ep_size=N)` against the
one-process model loaded from the same checkpoint in the same process.

argv: checkpoint directory, output directory, ep_size. A model that takes Transformers' path
(a type the engine does not run natively, GPT-OSS under ep_size) is compared with Transformers'
model in one process; its experts are DTensors sharded over the EP group. Exits non-zero on the
first mismatch."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def local(t):
    """This rank's part of a parameter or gradient (Transformers' model holds its experts as DTensors)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def close(a, b, what, atol=1e-6):
    torch.testing.assert_close(local(a), local(b), rtol=1e-5, atol=atol,
                               msg=lambda m: f"rank {dist.get_rank()}: {what}: {m}")


def main() -> None:
    model_dir, out, ep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from automoe import AutoModelForCausalLM
    from automoe import AutoMoEError

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, ep_size=ep)
    # (the one-process model on the same path: GPT-OSS under ep_size takes Transformers' by itself)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                               force_transformers=model.automoe_path == "transformers")
    par = model.automoe_parallel
    assert par["ep"] == ep and par["dp"] == world // ep and par["rank"] == rank, par
    begin, count = par["expert_begin"], par["expert_count"]
    assert begin == (rank % ep) * count, par
    # (DDP's ignore list also names them as seen from wrappers: PeftModel, compile, ...)
    routed = set(model._ddp_params_and_buffers_to_ignore) & {n for n, _ in model.named_parameters()}
    assert routed and all(".experts." in n for n in routed), routed

    def rows(name, t):  # this rank's part of a one-process tensor
        return t[begin:begin + count] if name in routed else t

    for name, p in model.named_parameters():
        close(p.detach(), rows(name, ref.get_parameter(name).detach()), f"loaded {name}")
    # A copy (TRL's reference model) runs on the same ranks: its forward is the model's.
    import copy

    twin = copy.deepcopy(model).eval()
    with torch.no_grad():
        probe = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(9))
        close(twin(probe).logits, model.eval()(probe).logits, "a deepcopy's logits")
    del twin
    model_path = model.automoe_path
    if model_path == "transformers":  # its experts stay AutoMoE's under ep_size
        try:
            model.set_experts_implementation("grouped_mm")
        except ValueError as e:
            assert "under expert parallelism" in str(e), e
        else:
            raise AssertionError("set_experts_implementation('grouped_mm') under ep_size was accepted")
    # A one-process state dict loads into it (each rank keeps its experts' rows).
    model.load_state_dict(ref.state_dict())
    for name, p in model.named_parameters():
        close(p.detach(), rows(name, ref.get_parameter(name).detach()), f"reloaded {name}")

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, vocab, (2, 11), generator=gen) for _ in range(world)] for _ in range(3)]

    def compare_grads(what):
        for name, p in model.named_parameters():
            r = ref.get_parameter(name).grad
            close(p.grad, rows(name, r), f"{what}: gradient of {name}")

    # 1. Every rank feeds the same batch, no DDP: outputs and gradients are the one process's.
    model.train()
    ref.train()
    ids = batches[0][0]
    got, want = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    close(got.logits, want.logits, "logits")
    close(got.loss, want.loss, "loss")
    got.loss.backward()
    want.loss.backward()
    compare_grads("same batch")
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    # ... and under gradient checkpointing (TRL's SFTTrainer turns it on), whose recomputation the
    # experts' gradient rule must not count twice.
    if model.supports_gradient_checkpointing:
        model.gradient_checkpointing_enable()
        ref.gradient_checkpointing_enable()
        model(input_ids=ids, labels=ids).loss.backward()
        ref(input_ids=ids, labels=ids).loss.backward()
        compare_grads("gradient checkpointing")
        model.gradient_checkpointing_disable()
        ref.gradient_checkpointing_disable()
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)

    # 2. DDP, each rank its own batch (as the Trainer runs it): the gradients of the mean loss,
    # clipped by the global norm.
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for step in range(3):
        mine = batches[step][rank]
        loss = ddp(input_ids=mine, labels=mine).loss
        loss.backward()
        ref_loss = sum(ref(input_ids=b, labels=b).loss for b in batches[step]) / world
        ref_loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        close(mean / world, ref_loss.detach(), f"step {step} loss")
        compare_grads(f"DDP step {step}")
        # The model's clip_grad_norm_ clips by the whole model's norm, the same on every rank.
        norm = model.clip_grad_norm_(0.05)
        close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05), f"step {step} gradient norm")
        compare_grads(f"DDP step {step}, clipped")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)

    # 3. save_pretrained on every rank: one checkpoint (rank 0 writes it, the others' experts
    # gathered), the one-process save's files and tensors, which Transformers loads with the
    # one-process model's logits.
    model.save_pretrained(out / "ep")
    if rank == 0:
        ref.save_pretrained(out / "ref")
    dist.barrier()
    if rank == 0:
        import transformers

        names = sorted(p.name for p in (out / "ref").iterdir())
        assert sorted(p.name for p in (out / "ep").iterdir()) == names, names
        from safetensors.torch import load_file

        for n in names:
            if n.endswith(".safetensors"):  # (the trained weights agree to rounding, not bit for bit)
                a, b = load_file(out / "ep" / n), load_file(out / "ref" / n)
                assert list(a) == list(b), n
                for k in a:
                    # (three AdamW steps: a gradient within rounding of zero may step either way)
                    close(a[k], b[k], f"saved {k}", atol=1e-5)
        probe = batches[0][0]
        with torch.no_grad():
            a = transformers.AutoModelForCausalLM.from_pretrained(out / "ep", dtype=torch.float32).eval()(probe).logits
            b = ref.eval()(probe).logits
        close(a, b, "Transformers' logits of the saved checkpoint", atol=1e-5)  # (its own experts code)
    dist.barrier()

    # 4. generate: prompts and lengths differ between ranks; every rank runs until all are done.
    model.eval()
    ref.eval()
    prompt = batches[1][rank][:1, :3 + rank]
    n_new = 4 + 2 * rank
    g = model.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    r = ref.generate(prompt, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    assert torch.equal(g, r), (g, r)

    # 5. The Transformers Trainer trains it (it wraps it with DDP, which skips the experts); without
    # gradient clipping and checkpoints (docs/parallelism.md): the dense weights stay identical
    # on every rank, the experts train.
    from transformers import Trainer, TrainingArguments

    del ddp
    model.train()
    data = [{"input_ids": b[0], "labels": b[0]} for step in batches for b in step]
    args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=1, max_steps=2,
                             max_grad_norm=0.0, save_strategy="no", report_to=[], learning_rate=1e-3,
                             use_cpu=True, disable_tqdm=True, logging_steps=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    Trainer(model=model, args=args, train_dataset=data).train()
    moved = 0
    for n, p in model.named_parameters():
        moved += not torch.equal(p.detach(), before[n])
        if n not in routed:
            total = p.detach().clone()
            dist.all_reduce(total)
            close(total / world, p.detach(), f"Trainer: {n} on every rank")
    assert moved > len(routed), moved

    # 6. A save that rank 0 alone calls (as the Transformers Trainer does) writes the files a save
    # on every rank writes, byte for byte, while the other ranks wait in a collective (here a
    # barrier); a rank whose save rank 0 never writes fails with a message.
    model.save_pretrained(out / "every")
    if rank == 0:
        model.save_pretrained(out / "alone")
    dist.barrier()
    if rank == 0:
        for f in sorted((out / "every").iterdir()):
            assert f.read_bytes() == (out / "alone" / f.name).read_bytes(), f.name
    # A rank whose optimizer step comes later than rank 0's (rank 0 saves right after its own):
    # rank 0's save waits for it, so the files hold every rank's experts after that step.
    model.zero_grad(set_to_none=True)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model(input_ids=batches[0][0], labels=batches[0][0]).loss.backward()
    if rank == 0:
        sgd.step()
        model.save_pretrained(out / "lagging")
    else:
        time.sleep(1.5)
        sgd.step()
    dist.barrier()
    model.save_pretrained(out / "stepped")
    if rank == 0:
        for f in sorted((out / "stepped").iterdir()):
            assert f.read_bytes() == (out / "lagging" / f.name).read_bytes(), f"a lagging rank's step: {f.name}"
    os.environ["AUTOMOE_EP_SAVE_TIMEOUT_S"] = "2"
    if rank == 1:
        try:
            model.save_pretrained(out / "never")
        except AutoMoEError as e:
            assert "rank 0 writes the checkpoint, and it did not write this directory" in str(e), e
        else:
            raise AssertionError("a save that rank 0 never wrote returned")
    dist.barrier()
    os.environ.pop("AUTOMOE_EP_SAVE_TIMEOUT_S")

    # 7. PEFT's LoRA on fresh models (the same draws on every rank and in one process): the
    # routed experts' adapters run on the ranks holding their experts, their gradients come back
    # whole; the same batch without DDP gives the one-process gradients of every adapter (with
    # and without gradient checkpointing); rank 0 alone saves the adapter (no collective), the
    # one-process save's files byte for byte; PeftModel.from_pretrained loads it under ep_size.
    # Transformers' model refuses adapters on its sharded experts by name (linear layers run).
    from peft import LoraConfig, PeftModel, get_peft_model

    peft_base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, ep_size=ep)
    peft_ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                    force_transformers=model_path == "transformers")
    experts_names = sorted({n.split(".experts.")[-1] for n in routed})
    targets = [f"experts.{n}" for n in experts_names if n.endswith("proj")]
    if model_path == "transformers":
        torch.manual_seed(0)
        refused = get_peft_model(peft_base, LoraConfig(r=2, target_modules=["q_proj"], target_parameters=targets))
        try:
            refused(input_ids=ids)
        except AutoMoEError as e:
            assert "PEFT LoRA on the routed experts (target_parameters)" in str(e), e
        else:
            raise AssertionError("PEFT on Transformers' sharded experts ran")
        peft_base = refused.unload()
        targets = []
    lora = dict(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"], target_parameters=targets)
    torch.manual_seed(0)
    pm = get_peft_model(peft_base, LoraConfig(**lora))
    torch.manual_seed(0)
    pr = get_peft_model(peft_ref, LoraConfig(**lora))
    assert targets == [] or any(".experts." in n and "lora_B" in n for n, _ in pm.named_parameters())
    with torch.no_grad():  # (B starts at zero: give the adapters something to say)
        for (n, p), (_, q) in zip(pm.named_parameters(), pr.named_parameters()):
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(n)))
                q.copy_(p)
    for checkpointing in (False, True):
        if checkpointing:
            pm.gradient_checkpointing_enable()
            pr.gradient_checkpointing_enable()
        got, want = pm(input_ids=ids, labels=ids), pr(input_ids=ids, labels=ids)
        close(got.logits, want.logits, f"PEFT logits (checkpointing {checkpointing})")
        got.loss.backward()
        want.loss.backward()
        for (n, p), (_, q) in zip(pm.named_parameters(), pr.named_parameters()):
            if p.requires_grad:
                close(p.grad, q.grad, f"PEFT gradient of {n} (checkpointing {checkpointing})")
        pm.zero_grad(set_to_none=True)
        pr.zero_grad(set_to_none=True)
    if rank == 0:
        pm.save_pretrained(out / "adapter-ep")
        pr.save_pretrained(out / "adapter-ref")
        for f in sorted((out / "adapter-ref").iterdir()):
            if f.suffix == ".safetensors":
                assert f.read_bytes() == (out / "adapter-ep" / f.name).read_bytes(), f.name
    dist.barrier()
    pm.eval()
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, ep_size=ep), out / "adapter-ref").eval()
    with torch.no_grad():
        close(loaded(input_ids=ids).logits, pr.eval()(input_ids=ids).logits, "PeftModel.from_pretrained under ep_size")
    del pm, pr, peft_base, peft_ref, loaded
    import gc

    del model, ref
    gc.collect()  # (the models' dispatchers hold the groups: released while the interpreter is whole)
    dist.destroy_process_group()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
