"""The Transformers Trainer, unchanged, on the drop-in: run in one process (ep 1) and under torchrun
with ep_size (from test_parallel.py). The same 40 fixed-length examples in order, 4 per step in
all (one process: a batch of 4; N ranks: 4 / N each), AdamW, gradient clipping at a norm the
gradients exceed; a checkpoint every 5 steps (the Trainer writes it from rank 0 alone);
`trainer.save_model` at the end, on every rank. Rank 0 writes the Trainer's log history (losses,
gradient norms) as JSON and the final model's logits on a fixed batch.

argv: checkpoint directory, output directory, ep_size[, the checkpoint to resume from, or "last":
the output directory's last checkpoint if there is one]. AUTOMOE_TEST_KILL_AT_STEP=N: rank 1 of
torchrun's first attempt SIGKILLs itself as step N begins. AUTOMOE_TEST_PEFT=1: LoRA (PEFT's
get_peft_model, r 4 on q_proj / v_proj and the routed experts) on the model, the base frozen."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch


def main() -> None:
    model_dir, out, ep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from automoe import AutoModelForCausalLM  # (first: torchrun's restarts then form groups anew)

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 **({"ep_size": ep} if ep > 1 else {}))
    vocab = model.config.vocab_size
    if os.environ.get("AUTOMOE_TEST_PEFT") == "1":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # (PEFT draws A from torch's generator: the same on every rank)
        model = get_peft_model(model, LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    gen = torch.Generator().manual_seed(5)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, vocab, (40, 12), generator=gen)]
    args = TrainingArguments(output_dir=str(out / "trainer"), per_device_train_batch_size=4 // world, max_steps=10,
                             max_grad_norm=0.5, learning_rate=2e-3, save_strategy="steps", save_steps=5,
                             report_to=[],
                             use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0,
                             train_sampling_strategy="sequential")
    kill_at = int(os.environ.get("AUTOMOE_TEST_KILL_AT_STEP", "0"))

    class Kill(TrainerCallback):  # (a crashed or OOM-killed worker)
        def on_step_begin(self, args, state, control, **kwargs):
            if (state.global_step + 1 == kill_at and args.process_index == 1
                    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Kill()] if kill_at else None)
    if resume == "last":
        resume = True if list((out / "trainer").glob("checkpoint-*")) else None
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(out / "final"))
    model.eval()
    with torch.no_grad():  # (a collective forward under ep_size: every rank runs it)
        logits = model(data[0]["input_ids"][None]).logits
    if trainer.args.process_index == 0:
        steps = [h for h in trainer.state.log_history if "loss" in h]
        (out / "log.json").write_text(json.dumps(steps))
        torch.save(logits, out / "logits.pt")
    rank = trainer.args.process_index
    del trainer, model
    if world > 1:  # (PyTorch's rule: a rank that exits with its groups alive may abort in Gloo's teardown)
        import gc

        import torch.distributed as dist

        gc.collect()
        dist.destroy_process_group()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
