"""The native causal LM's checkpoints: `save_pretrained` (a Hugging Face directory written by the
engine; collective under expert parallelism) and `load_state_dict` (also a state dict named as on
disk, in either experts layout)."""

from __future__ import annotations

import os

from automoe.arguments import warn_ignored


def _parse_size(size: int | str) -> int:
    """max_shard_size as Transformers' save_pretrained reads it (huggingface_hub's parser)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    return size if isinstance(size, int) else parse_size_to_int(size)


class _EngineCheckpoint:
    """The causal LM's checkpoint methods."""

    # -- checkpoints ----------------------------------------------------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module.load_state_dict, also for a state dict named as on disk in either experts
        layout (what Trainer's resume_from_checkpoint reads from a saved checkpoint)."""
        own = self.state_dict(keep_vars=True).keys()
        if any(k not in own for k in state_dict):
            state_dict = dict(self._automoe_engine.to_memory_tensors(list(state_dict.items())))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def save_pretrained(self, save_directory: str | os.PathLike, is_main_process: bool = True,
                        state_dict: dict | None = None, push_to_hub: bool = False,
                        max_shard_size: int | str = "50GB", variant: str | None = None,
                        token: str | bool | None = None, save_peft_format: bool = True,
                        save_original_format: bool | None = None,
                        distributed_checkpoint: bool = False, layout: str | None = None, **kwargs):
        """Writes a Hugging Face checkpoint directory from the engine: config.json,
        generation_config.json, safetensors (sharded above `max_shard_size`, with
        model.safetensors.index.json), tokenizer files copied from the source directory; every file
        atomically.

        layout: "per-expert" or "fused"; `save_original_format=True/False` means per-expert/fused
        as in Transformers; default, the layout the model was loaded from.
        """
        if push_to_hub:
            raise ValueError("save_pretrained(push_to_hub=True): AutoMoE writes local directories only; "
                             "upload with `huggingface-cli upload` afterwards")
        if variant is not None:
            raise ValueError(f"save_pretrained(variant={variant!r}): weight-file variants are not supported "
                             "by AutoMoE's writer")
        if distributed_checkpoint:
            raise ValueError("save_pretrained(distributed_checkpoint=True) is not supported: AutoMoE writes "
                             "a Hugging Face checkpoint (under expert parallelism every rank writes its "
                             "experts into it)")
        ignored = {}
        if token is not None:
            ignored["token"] = "only used to push to the Hub"
        if not save_peft_format:
            ignored["save_peft_format"] = "the model has no adapters"
        if "save_function" in kwargs:
            kwargs.pop("save_function")
            ignored["save_function"] = ("Transformers v5 writes safetensors itself and does not call it "
                                        "either; AutoMoE's engine writes them")
        if kwargs.pop("safe_serialization", True) is False:
            ignored["safe_serialization"] = "weights are always written as safetensors, as Transformers v5 does"
        for key in sorted(kwargs):
            ignored[key] = "only used by push_to_hub in Transformers"
        warn_ignored("save_pretrained()", ignored)
        if not is_main_process and self._automoe_ep is None:
            return  # as Transformers: only the main process writes
        directory = os.fspath(save_directory)
        # Under expert parallelism rank 0 writes the whole checkpoint, the other ranks' experts
        # gathered by the save service (automoe.ep_checkpoint), whatever is_main_process says; a
        # call on another rank returns once rank 0 has written the directory.
        service = None if self._automoe_ep is None else self._automoe_ep.service
        if service is not None:
            if state_dict is not None:
                raise ValueError("save_pretrained(state_dict=...) under expert parallelism: the model gathers "
                                 "its own experts; save without state_dict")
            if service.rank != 0:
                service.wait_saved(directory)
                return
        if layout is None and save_original_format is not None:
            layout = "per-expert" if save_original_format else "fused"
        if service is not None:
            service.saving(directory)
        try:
            engine = self._automoe_sync()
            tensors = None
            if state_dict is not None:
                tensors = [(k, v) for k, v in state_dict.items()]
            elif service is not None:
                names = [n for n, _ in engine.named_parameters()]
                full = service.gather_model(self, [n for n in names if n in self._automoe_ep.routed])
                tensors = [(n, full.get(n, t)) for n, t in engine.named_parameters()]
            # As Transformers' save_pretrained: the config records the dtype and the class.
            self.config.dtype = str(self.dtype).split(".")[1]
            self.config.architectures = [type(self).__name__]
            extra = {}
            if self.can_generate() and self.generation_config is not None:
                extra["generation_config.json"] = self.generation_config.to_json_string(use_diff=True)
            engine.save_pretrained(directory, layout, _parse_size(max_shard_size),
                                   config_json=self.config.to_json_string(use_diff=True), extra_files=extra,
                                   tensors=tensors, gathered=service is not None)
        except Exception as e:  # the other ranks' calls fail alike
            if service is not None:
                service.saved(directory, f"{type(e).__name__}: {e}")
            raise
        if service is not None:
            service.saved(directory)
