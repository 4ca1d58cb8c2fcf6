"""TRL's SFTTrainer, unchanged, on the drop-in: run in one process (ep 1) and under torchrun with
ep_size (from test_parallel.py). The same 16 chat conversations in order, 4 per step in all (one
process: a batch of 4; N ranks: 4 / N each), gradient clipping, a checkpoint at step 2 (written
by rank 0 alone), save_model at the end; rank 0 writes the log history (losses, gradient norms).

argv: checkpoint directory (with its tokenizer and chat template), output directory, ep_size[,
the checkpoint to resume from]."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main() -> None:
    model_dir, out, ep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    import datasets
    from conftest import chat_rows
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from automoe import AutoModelForCausalLM

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 **({"ep_size": ep} if ep > 1 else {}))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = datasets.Dataset.from_list([{"messages": r["messages"]} for r in chat_rows(16)])
    # router_aux_loss_coef=0: the load-balancing loss is a function of the whole batch's routing,
    # so any data-parallel run (DDP on Transformers' model too) differs from one process by it.
    # SGD: AdamW's first steps move each weight by about lr x sign(gradient), so a gradient within
    # rounding of zero moves it either way; SGD keeps rounding differences at rounding's size.
    args = SFTConfig(output_dir=str(out / "sft"), per_device_train_batch_size=4 // world, max_steps=4,
                     router_aux_loss_coef=0.0, optim="sgd",
                     max_grad_norm=0.5, learning_rate=0.5, save_strategy="steps", save_steps=2, report_to=[],
                     use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0, max_length=96,
                     train_sampling_strategy="sequential")
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(out / "final"))
    if trainer.args.process_index == 0:
        (out / "log.json").write_text(json.dumps([h for h in trainer.state.log_history if "loss" in h]))
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
