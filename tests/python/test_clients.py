"""The drop-in driven by the real clients (pinned in requirements.txt): Transformers' Trainer, TRL's
SFTTrainer and accelerate, each run on AutoMoE's model and on Transformers' own model from the same
checkpoint, data and seed (float32). Per-step losses must agree to 1e-4 relative.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import chat_rows, rel_err

import automoe

LOSS_TOL = 1e-4


def token_dataset(n: int, vocab: int, seed: int):
    """Rows of 4..11 token ids (labels = the ids): uneven lengths, so batches carry padding."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    return datasets.Dataset.from_list(rows)


def pad_collator(pad_id: int, side: str = "right"):
    def collate(batch):
        width = max(len(b["input_ids"]) for b in batch)
        ids = torch.full((len(batch), width), pad_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, b in enumerate(batch):
            n = len(b["input_ids"])
            cols = slice(0, n) if side == "right" else slice(width - n, width)
            ids[i, cols] = torch.tensor(b["input_ids"])
            labels[i, cols] = torch.tensor(b["labels"])
            mask[i, cols] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collate


def trainer_for(model, out_dir, train, evaluation=None, collate=None, **args):
    from transformers import Trainer, TrainingArguments

    defaults = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, learning_rate=2e-3,
                    logging_steps=1, report_to=[], seed=0, use_cpu=True, save_strategy="no",
                    dataloader_num_workers=0, disable_tqdm=True)
    defaults.update(args)
    return Trainer(model=model, args=TrainingArguments(output_dir=str(out_dir), **defaults),
                   train_dataset=train, eval_dataset=evaluation, data_collator=collate)


def losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def both_models(path):
    from transformers import AutoModelForCausalLM as HFModel

    return automoe.AutoModelForCausalLM.from_pretrained(path), HFModel.from_pretrained(path)


def assert_same_curve(ours: list[float], ref: list[float]):
    assert len(ours) == len(ref) > 0
    for step, (a, b) in enumerate(zip(ours, ref), 1):
        assert abs(a - b) <= LOSS_TOL * abs(b), f"step {step}: AutoMoE {a} vs Transformers {b}"


@pytest.mark.parametrize("setting", [
    dict(max_steps=3),
    dict(max_steps=3, gradient_accumulation_steps=2, per_device_train_batch_size=3, padding_side="left"),
    dict(max_steps=3, gradient_checkpointing=True),
])
def test_trainer_steps_match_transformers(checkpoint_factory, tmp_path, setting):
    """Plain; gradient accumulation over left-padded batches (the loss normalised by the window's
    token count via num_items_in_batch); gradient checkpointing. Then evaluate()."""
    path = checkpoint_factory("e5_top2_gqa2_untied")
    setting = dict(setting)
    collate = pad_collator(0, setting.pop("padding_side", "right"))
    train, evaluation = token_dataset(16, 97, seed=0), token_dataset(6, 97, seed=1)
    runs = []
    for model in both_models(path):
        trainer = trainer_for(model, tmp_path, train, evaluation, collate, **setting)
        trainer.train()
        runs.append((losses(trainer), trainer.evaluate()["eval_loss"]))
    (ours, ours_eval), (ref, ref_eval) = runs
    assert_same_curve(ours, ref)
    assert abs(ours_eval - ref_eval) <= LOSS_TOL * abs(ref_eval)


def test_trainer_checkpoints_load_in_transformers_and_resume_the_same_curve(checkpoint_factory, tmp_path):
    from transformers import AutoModelForCausalLM as HFModel

    path = checkpoint_factory("e3_top1_norm_tied")
    train, collate = token_dataset(24, 97, seed=2), pad_collator(0)
    args = dict(max_steps=4, save_strategy="steps", save_steps=2)

    full = trainer_for(automoe.AutoModelForCausalLM.from_pretrained(path), tmp_path / "full", train,
                       collate=collate, **args)
    full.train()
    full.save_model(str(tmp_path / "final"))
    ref = trainer_for(HFModel.from_pretrained(path), tmp_path / "ref", train, collate=collate, max_steps=4)
    ref.train()
    assert_same_curve(losses(full), losses(ref))

    # save_model and checkpoint-N are whole Hugging Face checkpoints: Transformers loads them and
    # computes AutoMoE's logits.
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for ckpt in (tmp_path / "final", tmp_path / "full" / "checkpoint-2"):
            assert (ckpt / "config.json").exists() and (ckpt / "generation_config.json").exists()
            hf_logits = HFModel.from_pretrained(ckpt)(ids).logits
            ours_logits = automoe.AutoModelForCausalLM.from_pretrained(ckpt)(ids).logits
            assert rel_err(ours_logits, hf_logits) <= 1e-5
        assert rel_err(full.model(ids).logits, HFModel.from_pretrained(tmp_path / "final")(ids).logits) <= 1e-5

    # A new process's view: a fresh model from the base checkpoint resumes from checkpoint-2 and
    # continues the uninterrupted run's curve (weights, optimizer, scheduler and data position).
    resumed = trainer_for(automoe.AutoModelForCausalLM.from_pretrained(path), tmp_path / "resumed", train,
                          collate=collate, **args)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    # (the log history before step 3 is restored from the checkpoint; steps 3 and 4 are new)
    assert_same_curve(losses(resumed)[-2:], losses(full)[2:])


def test_trainer_neftune_embedding_hook_is_honoured(checkpoint_factory, tmp_path):
    """NEFTune adds noise through a forward hook on the input embedding: the engine runs the
    embedding module so the hook applies (same losses as Transformers, same seed; and not the
    losses without the noise)."""
    path = checkpoint_factory("e5_top2_gqa2_untied")
    train, collate = token_dataset(8, 97, seed=3), pad_collator(0)
    curves = []
    for model in both_models(path):
        trainer = trainer_for(model, tmp_path, train, collate=collate, max_steps=2, neftune_noise_alpha=20.0)
        trainer.train()
        curves.append(losses(trainer))
    assert_same_curve(*curves)
    quiet = trainer_for(automoe.AutoModelForCausalLM.from_pretrained(path), tmp_path, train, collate=collate,
                        max_steps=2)
    quiet.train()
    assert abs(losses(quiet)[1] - curves[0][1]) > 10 * LOSS_TOL * abs(curves[0][1])


def sft_curves(checkpoint, out_dir, rows: int, **config) -> list[list[float]]:
    """TRL SFTTrainer on chat messages, AutoMoE's model then Transformers' own: their loss curves."""
    import datasets
    from transformers import AutoModelForCausalLM as HFModel
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    data = datasets.Dataset.from_list([{"messages": r["messages"]} for r in chat_rows(rows)])
    curves = []
    for model in (automoe.AutoModelForCausalLM.from_pretrained(checkpoint), HFModel.from_pretrained(checkpoint)):
        args = SFTConfig(output_dir=str(out_dir), per_device_train_batch_size=4, learning_rate=2e-3,
                         logging_steps=1, report_to=[], seed=0, use_cpu=True, save_strategy="no",
                         max_length=96, disable_tqdm=True, **config)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        assert next(trainer.model.parameters()).dtype == torch.float32
        curves.append(losses(trainer))
    return curves


@pytest.mark.parametrize("packing", [False, True])
def test_trl_sft_trainer_on_messages_matches_trl_on_transformers(chat_checkpoint, tmp_path, packing):
    """TRL's SFTTrainer (chat template, its fused LM head over our backbone, the aux loss from router
    logits); with packing, TRL's padding-free batches (position_ids restarting per document, no
    attention mask)."""
    assert_same_curve(*sft_curves(chat_checkpoint, tmp_path, 24, max_steps=3, packing=packing, bf16=False))


def test_trl_default_bf16_autocast_runs_the_engine_in_bfloat16(chat_checkpoint, tmp_path):
    """TRL's default SFTConfig (bf16=True) trains a float32 model under bf16 autocast: the engine
    runs the matmuls in bfloat16 from float32 parameters, as Transformers does. The first step's
    loss agrees closely; later ones drift a little, because the router stays float32 in AutoMoE
    (Transformers runs it in bf16 under autocast) and Adam amplifies the small router-gradient
    differences."""
    from trl import SFTConfig

    assert SFTConfig(output_dir=str(tmp_path), use_cpu=True).bf16
    ours, ref = sft_curves(chat_checkpoint, tmp_path, 16, max_steps=2)
    assert abs(ours[0] - ref[0]) <= 1e-4 * abs(ref[0])
    assert abs(ours[1] - ref[1]) <= 1e-2 * abs(ref[1])
    from transformers import AutoModelForCausalLM as HFModel

    model = automoe.AutoModelForCausalLM.from_pretrained(chat_checkpoint)
    ref = HFModel.from_pretrained(chat_checkpoint, experts_implementation="eager")
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = model(ids, labels=ids), ref(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16  # bf16 matmuls, as Transformers under autocast
    assert rel_err(out.loss, want.loss) <= 1e-3
    out.loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
    assert model(ids).logits.dtype == torch.float32  # and float32 again outside autocast


def test_accelerate_prepare_train_and_save_with_its_state_dict(checkpoint_factory, tmp_path, monkeypatch):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM as HFModel

    path = checkpoint_factory("e5_top2_gqa2_untied")
    from accelerate.state import AcceleratorState

    # Trainers run earlier in this process leave bf16 in accelerate's shared state and environment.
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    assert accelerator.mixed_precision == "no"
    model = automoe.AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    model.train()
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    unwrapped = accelerator.unwrap_model(model)
    with pytest.warns(UserWarning, match=r"save_function \(Transformers v5 writes safetensors itself"):
        unwrapped.save_pretrained(tmp_path / "out", is_main_process=accelerator.is_main_process,
                                  state_dict=accelerator.get_state_dict(model), save_function=accelerator.save)
    with torch.no_grad():
        saved = HFModel.from_pretrained(tmp_path / "out")(ids).logits
        assert rel_err(unwrapped.eval()(ids).logits, saved) <= 1e-5
    assert not torch.equal(saved, HFModel.from_pretrained(path)(ids).logits.detach())  # it trained
    # Not the main process: nothing is written, as in Transformers.
    unwrapped.save_pretrained(tmp_path / "other", is_main_process=False)
    assert not (tmp_path / "other").exists() or not os.listdir(tmp_path / "other")
