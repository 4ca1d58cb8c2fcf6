"""The Hugging Face drop-in: `from automoe import AutoModelForCausalLM`.

The model's parameters live in the C++ engine. This module only wraps each of them in an
`nn.Parameter` that aliases the engine's tensor (same storage, and the engine is handed the
Parameter back), so that `model.parameters()`, `torch.optim`, `state_dict()` and `.grad` behave as
they do for a Transformers model, under Transformers' parameter names.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from automoe.backend import BackendConfig


def _load_engine():
    """Imports automoe._C after checking it was compiled against the torch that is installed
    (LibTorch's C++ ABI changes between releases: a mismatch would fail with undefined symbols)."""
    try:
        from automoe._build_info import TORCH_VERSION as built_with
    except ImportError as e:
        raise ImportError("automoe: the engine is not built; run `make` (or `pip install .`)") from e
    if built_with != torch.__version__:
        raise ImportError(
            f"automoe was compiled against torch {built_with} but torch {torch.__version__} is "
            "installed; rebuild it against this torch: `make` in the repository, or "
            "`pip install --no-build-isolation .`"
        )
    from automoe import _C

    return _C


_C = _load_engine()

AutoMoEError = _C.AutoMoEError

_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}


def _dtype_name(dtype: Any) -> str | None:
    """None/"auto" -> None (the checkpoint's config dtype); torch.dtype or name -> engine name."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: unsupported {dtype}; expected one of {list(_DTYPES)}")
        return _DTYPES[dtype]
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    raise TypeError(f"dtype: expected a torch.dtype or a string, got {type(dtype).__name__}")


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = size.strip().upper()
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


class _Container(nn.Module):
    """A node of the parameter-name tree ("model", "layers", "0", ...); indexable like ModuleList."""

    def __getitem__(self, idx: int | str) -> nn.Module:
        if isinstance(idx, int) and idx < 0:
            idx += len(self._modules)
        return self._modules[str(idx)]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class MoEForCausalLM(nn.Module):
    """A causal LM whose forward, backward and checkpoint I/O run in the AutoMoE engine."""

    def __init__(self, engine: "_C.Model"):
        super().__init__()
        self._engine = engine
        self._config = None
        # (engine name, owning module, attribute, Parameter the engine holds)
        self._bindings: list[tuple[str, nn.Module, str, nn.Parameter]] = []
        for name, tensor in engine.named_parameters():
            param = nn.Parameter(tensor, requires_grad=True)
            # nn.Parameter makes a new tensor over the same storage; hand it to the engine so that
            # the forward uses (and autograd fills .grad of) exactly this object.
            engine.set_parameter(name, param)
            module, leaf = self._owner(name)
            module.register_parameter(leaf, param)
            self._bindings.append((name, module, leaf, param))
        if engine.spec["tie_word_embeddings"]:
            # As in Transformers: lm_head.weight is the embedding Parameter under a second name
            # (state_dict() has both keys; parameters() yields it once).
            module, leaf = self._owner("lm_head.weight")
            module.register_parameter(leaf, self.get_parameter("model.embed_tokens.weight"))

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        *path, leaf = name.split(".")
        module: nn.Module = self
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = _Container()
                module.add_module(part, child)
            module = child
        return module, leaf

    def _sync_parameters(self) -> None:
        """Re-binds parameters that were replaced on the module (load_state_dict(assign=True),
        PEFT/accelerate swapping tensors) so the engine computes with what the module holds."""
        for i, (name, module, leaf, bound) in enumerate(self._bindings):
            current = module._parameters.get(leaf)
            if current is not bound:
                if current is None:
                    raise AutoMoEError(f"parameter {name} was removed from the model")
                self._engine.set_parameter(name, current)
                self._bindings[i] = (name, module, leaf, current)

    # -- what Transformers users reach for --------------------------------------------------
    @property
    def config(self):
        """The checkpoint's config as a Transformers `PretrainedConfig`."""
        if self._config is None:
            from transformers import AutoConfig

            raw = json.loads(self._engine.config_json)
            self._config = AutoConfig.for_model(**raw)
        return self._config

    @property
    def spec(self) -> dict:
        return self._engine.spec

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def layout(self) -> str:
        """The experts layout of the checkpoint this model was loaded from."""
        return self._engine.layout

    @property
    def backend(self) -> BackendConfig:
        return BackendConfig.from_engine(self._engine.backend())

    def set_backend(self, backend: BackendConfig | dict) -> None:
        self._engine.set_backend(BackendConfig.coerce(backend).to_dict())

    # Transformers' switch: each decoder layer keeps only its input and is recomputed in the
    # backward pass (in training mode), reusing the forward's routing decisions.
    is_gradient_checkpointing = False

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        self.is_gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.is_gradient_checkpointing = False

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        num_items_in_batch: int | float | torch.Tensor | None = None,
        return_dict: bool = True,
        **kwargs: Any,
    ):
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        use_cache = kwargs.pop("use_cache", None)
        # Transformers' arguments that AutoMoE accepts at their no-op values.
        harmless = {"logits_to_keep": 0, "output_hidden_states": False, "output_attentions": False,
                    "past_key_values": None, "inputs_embeds": None, "cache_position": None}
        unsupported = sorted(k for k, v in kwargs.items() if k not in harmless or v not in (None, harmless[k]))
        if unsupported:
            raise TypeError(f"forward(): arguments not supported by AutoMoE: {unsupported}")
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True))
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = float(num_items_in_batch.item())
        self._sync_parameters()
        out = self._engine.forward(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=labels,
            output_router_logits=output_router_logits,
            num_items_in_batch=None if num_items_in_batch is None else float(num_items_in_batch),
            # Transformers splits packed documents (position_ids restarting, no attention_mask)
            # only when it runs without a KV cache.
            split_packed_documents=not use_cache,
            activation_checkpointing=self.is_gradient_checkpointing and self.training,
        )
        result = MoeCausalLMOutputWithPast(
            loss=out["loss"],
            aux_loss=out["aux_loss"],
            logits=out["logits"],
            router_logits=out["router_logits"],
        )
        return result if return_dict else result.to_tuple()

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        layout: str | None = None,
        max_shard_size: int | str = "50GB",
        **kwargs: Any,
    ) -> None:
        """Writes a Hugging Face checkpoint directory (config, safetensors, tokenizer files).

        layout: "per-expert" or "fused"; default, the layout the model was loaded from.
        """
        if kwargs:
            raise TypeError(f"save_pretrained(): arguments not supported by AutoMoE: {sorted(kwargs)}")
        self._sync_parameters()
        self._engine.save_pretrained(os.fspath(save_directory), layout, _parse_size(max_shard_size))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class AutoModelForCausalLM:
    """`from automoe import AutoModelForCausalLM` — the one changed import."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise OSError("AutoModelForCausalLM is a factory: use AutoModelForCausalLM.from_pretrained(path)")

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        torch_dtype: Any = None,
        backend: BackendConfig | dict | None = None,
        *,
        dtype: Any = None,
        attn_implementation: str | None = None,
        **kwargs: Any,
    ) -> MoEForCausalLM:
        """Loads a local Hugging Face checkpoint directory into the AutoMoE engine.

        torch_dtype / dtype: None or "auto" loads in the config's dtype (as Transformers v5 does).
        backend: a BackendConfig or dict choosing each component's implementation.
        attn_implementation: "sdpa" or "eager", as in Transformers (overrides backend.attn).
        """
        if kwargs:
            raise TypeError(f"from_pretrained(): arguments not supported by AutoMoE: {sorted(kwargs)}")
        path = os.fspath(pretrained_model_name_or_path)
        if not os.path.isdir(path):
            raise OSError(
                f"{path}: not a local checkpoint directory (AutoMoE loads local Hugging Face "
                "directories; download with `huggingface-cli download` first)"
            )
        cfg = BackendConfig.coerce(backend)
        if attn_implementation is not None:
            cfg.attn = attn_implementation
        chosen = dtype if dtype is not None else torch_dtype
        engine = _C.load_pretrained(path, _dtype_name(chosen) or "auto", cfg.to_dict())
        return MoEForCausalLM(engine)

