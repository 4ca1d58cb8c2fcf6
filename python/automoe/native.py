"""Native models: Transformers' own model classes whose compute runs in the AutoMoE engine.

`Qwen3MoeForCausalLM` here *is* a `transformers.Qwen3MoeForCausalLM` (a subclass with the same name,
module tree, config, generation config and methods), so Trainer, TRL, accelerate, `generate` and
pipelines drive it unchanged. Its parameters are the engine's tensors: each `nn.Parameter` in the
tree aliases an engine tensor and is handed back to the engine, so an optimizer step changes what
the next forward uses. `forward` (and the backbone's) hands the whole computation to the engine;
no submodule's forward ever runs. Before each forward the engine re-binds parameters that were
replaced on the module tree (`load_state_dict(assign=True)`, `resize_token_embeddings`, a deep
copy), and anything the engine cannot honour (a module swapped for an adapter, a hook on a
submodule, an unsupported argument) is refused by name rather than silently skipped.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import transformers
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from automoe import _engine
from automoe.backend import BackendConfig
from automoe.cache import EngineCache, export_new_positions, import_cache

_C = _engine.load()
AutoMoEError = _C.AutoMoEError
logger = logging.getLogger("automoe")

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
           torch.float64: "float64"}

# Transformers' experts_implementation -> the engine's experts backend ("automoe" is AutoMoE's
# fused experts, what the engine runs by default; see fallback.py for the same name there).
EXPERTS_IMPLEMENTATIONS = {"automoe": "grouped", "grouped_mm": "torch_mm", "eager": "eager"}
ENGINE_EXPERTS = {v: k for k, v in EXPERTS_IMPLEMENTATIONS.items()}

# Keyword arguments of Transformers' forward that carry nothing for the engine: the varlen
# boundaries that TRL's padding-free collator adds for flash-attention kernels (Transformers' own
# sdpa and eager paths ignore them too and split packed documents by position_ids, as the engine
# does), and cache_position, which Transformers 5 no longer reads.
_IGNORED_FORWARD_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
                           "cache_position")


def dtype_name(dtype: Any) -> str | None:
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
    """max_shard_size as Transformers' save_pretrained reads it (huggingface_hub's parser)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    return size if isinstance(size, int) else parse_size_to_int(size)


def warn_ignored(where: str, ignored: dict[str, str]) -> None:
    """One warning naming every argument that has no effect, and why."""
    if ignored:
        warnings.warn(f"{where}: arguments with no effect: "
                      + "; ".join(f"{k} ({why})" for k, why in ignored.items()), stacklevel=3)


def _is_lora_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (lora.Linear, lora.ParamWrapper, ...) wrapping `base_layer`."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer) and hasattr(module, "base_layer")


def _describe(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


class _EngineModule:
    """What the causal LM and its backbone share: the engine, parameter binding and the forward."""

    _automoe_prefix = ""  # the parameter-name prefix of this module inside the causal LM
    _automoe_ep: "_ExpertParallel | None" = None  # expert parallelism (from_pretrained(ep_size=N))

    def _automoe_params(self) -> list[torch.Tensor | None]:
        """The tensors this module tree holds for each engine parameter (None: not under this
        module), resolved by name through the module tree as it is now. A module on the path that
        was replaced by something without the parameter (a PEFT adapter layer, say) is an error."""
        out: list[torch.Tensor | None] = []
        prefix = self._automoe_prefix
        for name in self._automoe_names:
            if not name.startswith(prefix):
                out.append(None)
                continue
            *path, leaf = name[len(prefix):].split(".")
            module: nn.Module = self
            for i, part in enumerate(path):
                child = module._modules.get(part)
                if child is None:
                    raise AutoMoEError(
                        f"parameter {name}: module {prefix}{'.'.join(path[:i]) or '(root)'} "
                        f"({_describe(module)}) has no submodule {part!r}; the AutoMoE engine computes "
                        "with the module tree it was loaded with"
                    )
                # PEFT's LoRA layers wrap the module that holds the weight (its `base_layer`); the
                # engine reads the weight there and runs the adapter itself (_automoe_adapters).
                while _is_lora_layer(child):
                    child = child.base_layer
                module = child
            param = module._parameters.get(leaf)
            if param is None:
                param = module._buffers.get(leaf)
            if param is None:
                where = prefix + ".".join(path)
                raise AutoMoEError(
                    f"parameter {name} is gone: {where} is now a {_describe(module)}. The AutoMoE "
                    "engine runs the model's own weights with PEFT's LoRA adapters (lora.Linear, "
                    "lora.ParamWrapper) and cannot run other replaced modules; load with "
                    "AutoModelForCausalLM.from_pretrained(..., force_transformers=True) to run "
                    "Transformers' own model instead"
                )
            out.append(param)
        return out

    def _automoe_adapters(self) -> list[tuple]:
        """PEFT's LoRA adapters on this module tree, as the engine runs them: (base weight name, A,
        B, scaling, dropout) per adapted weight, the factors PEFT's own parameters (views), so that
        autograd fills their .grad. An adapter is never skipped silently: what the engine cannot
        run (DoRA, another PEFT method, several active adapters, ...) is refused by name."""
        if "peft" not in sys.modules:
            return []
        from peft.tuners.tuners_utils import BaseTunerLayer

        out = []
        for name, module in self.named_modules():
            if not isinstance(module, BaseTunerLayer):
                continue
            where = self._automoe_prefix + name
            from peft.tuners import lora

            if not isinstance(module, (lora.Linear, lora.ParamWrapper)) or type(module).__module__ != lora.layer.__name__:
                raise AutoMoEError(
                    f"{where} is a PEFT {_describe(module)}; the AutoMoE engine runs LoRA adapters on "
                    "linear layers (target_modules) and on routed experts (target_parameters) only. "
                    "Load with force_transformers=True to run PEFT's own layers")
            if module.disable_adapters:
                if module.merged:
                    module.unmerge()  # as PEFT's forward does: the base weights without the adapter
                continue
            if module.merged:
                continue  # in the weights already (PEFT's forward adds nothing either)
            active = [a for a in module.active_adapters if a in module.lora_A]
            if not active:
                continue
            if len(active) > 1:
                raise AutoMoEError(f"{where}: {len(active)} active LoRA adapters {active}; the AutoMoE "
                                   "engine runs one adapter per weight (merge the others first, or "
                                   "set_adapter one of them)")
            adapter = active[0]
            for feature, on in (("DoRA (use_dora)", module.use_dora.get(adapter, False)),
                                ("lora_bias", module.lora_bias.get(adapter, False)),
                                (f"the LoRA variant {type(module.lora_variant.get(adapter)).__name__}",
                                 adapter in getattr(module, "lora_variant", {})),
                                ("fan_in_fan_out", getattr(module, "fan_in_fan_out", False))):
                if on:
                    raise AutoMoEError(f"{where}: {feature} is a PEFT feature the AutoMoE engine does "
                                       "not run; load with force_transformers=True to use it")
            a = module.lora_A[adapter].weight
            b = module.lora_B[adapter].weight
            scaling = float(module.scaling[adapter])
            drop = module.lora_dropout[adapter]
            dropout = float(drop.p) if isinstance(drop, nn.Dropout) else 0.0
            path = name.replace(".base_layer", "")
            if isinstance(module, lora.ParamWrapper) and module.num_experts == 1:
                # a 2-D weight (a router's, as PEFT's all-linear targets it on Transformers v5):
                # A [r, in], B [out, r] as for a linear layer; the engine decides if it can run it
                base = f"{self._automoe_prefix}{path}.{module.parameter_name}"
            elif isinstance(module, lora.ParamWrapper):
                experts = module.num_experts
                if not module._did_swap_in_out_features:
                    raise AutoMoEError(
                        f"{where}: target_parameters on {module.parameter_name} "
                        f"{tuple(module.get_param().shape)}; the AutoMoE engine runs parameter adapters "
                        "on routed experts stored [experts, out, in] only")
                r = module.r[adapter]
                base = f"{self._automoe_prefix}{path}.{module.parameter_name}"
                # PEFT: lora_A [E·r, in] expert-major, lora_B [out, r·E] rank-major.
                a = a.view(experts, r, a.shape[-1])
                b = b.view(b.shape[0], r, experts).permute(2, 0, 1)
            else:
                base = f"{self._automoe_prefix}{path}.weight"
            out.append((base, a, b, scaling, dropout))
        return out

    def _automoe_check_hooks(self) -> bool:
        """Refuses hooks on submodules (their forwards never run, so a hook would be skipped
        silently). Hooks on the input embedding are honoured: the embedding then runs as a module
        and the engine takes its output. Returns whether that is needed."""
        embed = self.get_input_embeddings()
        embed_hooked = False
        for name, module in self.named_modules():
            if module is self:
                continue
            hooks = (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                     or module._backward_pre_hooks)
            if not hooks:
                continue
            if module is embed and not (module._backward_hooks or module._backward_pre_hooks):
                embed_hooked = True
                continue
            raise AutoMoEError(
                f"{self._automoe_prefix}{name} ({_describe(module)}) has a hook registered; the "
                "AutoMoE engine runs the whole model at once, so hooks on submodules other than the "
                "input embedding would never run. Remove the hook, or load with "
                "force_transformers=True"
            )
        return embed_hooked

    def _automoe_sync(self) -> "_C.Model":
        """Brings the engine up to date with the module: parameters re-bound, and Transformers'
        attn_implementation / experts_implementation (set_attn_implementation, ...) applied."""
        if getattr(self, "_is_replica", False):
            raise AutoMoEError("nn.DataParallel replicas share one AutoMoE engine and cannot run it "
                               "concurrently; launch one process per device (torchrun / accelerate "
                               "launch, as Transformers recommends) instead")
        engine = self._automoe_engine
        params = self._automoe_params()
        engine.rebind(params)
        adapters = self._automoe_adapters()
        if adapters or getattr(self, "_automoe_has_adapters", False):
            if adapters and self._automoe_ep is not None:
                raise AutoMoEError("PEFT adapters on a model loaded with ep_size > 1 are not supported "
                                   "yet; load it without ep_size")
            engine.set_adapters(adapters)
            self._automoe_has_adapters = bool(adapters)
        if self._automoe_ep is not None:
            self._automoe_ep.hook(self._automoe_names, params)
        backend = engine.backend()
        wanted = dict(backend)
        attn = self.config._attn_implementation or "sdpa"
        if attn not in ("sdpa", "eager"):
            raise AutoMoEError(f"attn_implementation={attn!r}: the AutoMoE engine implements 'sdpa' and 'eager'")
        wanted["attn"] = attn
        experts = getattr(self.config, "_experts_implementation", None)
        if experts is not None:
            if experts not in EXPERTS_IMPLEMENTATIONS:
                raise AutoMoEError(f"experts_implementation={experts!r}: the AutoMoE engine implements "
                                   f"{sorted(EXPERTS_IMPLEMENTATIONS)}")
            wanted["experts"] = EXPERTS_IMPLEMENTATIONS[experts]
        if wanted != backend:
            engine.set_backend(wanted)
        return engine

    def _automoe_forward(self, *, lm_head: bool, input_ids=None, attention_mask=None,
                         position_ids=None, past_key_values=None, inputs_embeds=None, labels=None,
                         use_cache=None, output_router_logits=None, logits_to_keep=0,
                         num_items_in_batch=None, kwargs: dict):
        config = self.config
        return_dict = kwargs.pop("return_dict", None)
        return_dict = config.return_dict if return_dict is None else return_dict
        output_hidden_states = kwargs.pop("output_hidden_states", None)
        output_hidden_states = bool(config.output_hidden_states if output_hidden_states is None
                                    else output_hidden_states)
        output_attentions = kwargs.pop("output_attentions", None)
        if config.output_attentions if output_attentions is None else output_attentions:
            raise TypeError("forward(): output_attentions=True is not supported by the AutoMoE engine "
                            "(its attention kernels do not form the attention weights)")
        if kwargs.pop("shift_labels", None) is not None:
            raise TypeError("forward(): shift_labels is not supported by the AutoMoE engine; pass labels")
        for key in _IGNORED_FORWARD_KWARGS:
            kwargs.pop(key, None)
        if kwargs:
            raise TypeError(f"forward(): arguments not supported by AutoMoE: {sorted(kwargs)}")
        cache = foreign = None
        if past_key_values is not None:
            if isinstance(past_key_values, EngineCache):
                cache = past_key_values
            elif isinstance(past_key_values, Cache):
                if getattr(past_key_values, "offloading", False):
                    raise TypeError("past_key_values: an offloaded cache is not supported by the AutoMoE engine")
                foreign, cache = past_key_values, import_cache(past_key_values, config.num_hidden_layers)
            else:
                raise TypeError(f"past_key_values: expected a transformers Cache, got "
                                f"{type(past_key_values).__name__} (tuples of tensors are not supported, "
                                "as in Transformers 5)")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise TypeError(f"forward(): attention_mask must be 2-D [batch, seq] (1 = token, 0 = padding); "
                            f"got {attention_mask.dim()}-D (custom 4-D masks are not supported)")
        if output_router_logits is None:
            output_router_logits = bool(getattr(config, "output_router_logits", False))

        engine = self._automoe_sync()
        if self._automoe_check_hooks() and inputs_embeds is None and input_ids is not None:
            inputs_embeds, input_ids = self.get_input_embeddings()(input_ids), None

        # Transformers' rule (merge_with_config_defaults): no cache under gradient checkpointing.
        checkpointing = self.training and self.is_gradient_checkpointing
        use_cache = config.use_cache if use_cache is None else use_cache
        if checkpointing:
            use_cache = False
        if cache is None and use_cache:
            cache = EngineCache(config.num_hidden_layers)
        past_length = cache.get_seq_length() if cache is not None else 0

        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = float(num_items_in_batch.item())
        logits_indices = None
        if isinstance(logits_to_keep, torch.Tensor):
            logits_indices, logits_to_keep = logits_to_keep, 0
        out = engine.forward(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=labels,
            output_router_logits=output_router_logits,
            num_items_in_batch=None if num_items_in_batch is None else float(num_items_in_batch),
            # Transformers splits packed documents (position_ids restarting, no attention_mask)
            # only when it runs without a KV cache.
            split_packed_documents=cache is None,
            activation_checkpointing=checkpointing,
            training=self.training,
            inputs_embeds=inputs_embeds,
            cache=None if cache is None else cache.storage,
            lm_head=lm_head,
            logits_to_keep=int(logits_to_keep),
            logits_indices=logits_indices,
            output_hidden_states=output_hidden_states,
            router_aux_loss_coef=getattr(self, "router_aux_loss_coef", None),
        )
        if foreign is not None:
            export_new_positions(cache, foreign, past_length)
            cache = foreign
        if lm_head:
            result = MoeCausalLMOutputWithPast(
                loss=out["loss"], aux_loss=out["aux_loss"], logits=out["logits"],
                past_key_values=cache, hidden_states=out["hidden_states"],
                router_logits=out["router_logits"],
            )
        else:
            result = MoeModelOutputWithPast(
                last_hidden_state=out["last_hidden_state"], past_key_values=cache,
                hidden_states=out["hidden_states"], router_logits=out["router_logits"],
            )
        return result if return_dict else result.to_tuple()


class _ExpertParallel:
    """A model whose experts are spread over the ranks (from_pretrained(ep_size=N)): the
    gradients of this rank's experts are averaged over the world as DistributedDataParallel
    averages the dense ones (DDP skips the experts: `_ddp_params_and_buffers_to_ignore`).

    The dispatcher's backward brings each expert the gradient of every loss of its EP group; the
    hook sums that over the data-parallel replicas holding the same experts and divides by the
    world size. So under DDP (each rank its own batch) the experts get the gradient of the mean
    loss, as the dense weights do, and ranks that all feed the same batch without DDP get exactly
    the one-process gradients."""

    loaded = 0  # models loaded with ep_size in this process (the same order on every rank)

    def __init__(self, info: dict, routed: list[str], groups):
        self.info = info
        self.routed = set(routed)
        self.ep_group, self.dp_group = groups
        _ExpertParallel.loaded += 1
        self.serial = _ExpertParallel.loaded

    def __deepcopy__(self, memo):
        return self  # a copy of the model shares the ranks and their groups

    def meet_to_save(self, directory: str) -> None:
        """Every rank must call save_pretrained: they meet through torch.distributed's store (not
        a collective, so a rank that never comes fails the others with a message instead of
        leaving them in a collective that never completes).

        Each save is a round (its number in the store, advanced once per round, whether it
        succeeded or was abandoned, so that a failed save does not desynchronise later ones).
        One counter decides a round: the rank whose arrival brings it exactly to the world size
        sets "go"; a rank that gives up adds a large number first, after which "go" can no longer
        be set (the last arrival then sets "abort"). A rank goes on only once "go" is set, so
        either every rank writes or every rank fails."""
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        rank, world = self.info["rank"], self.info["world_size"]
        base = f"automoe/save/{self.serial}/"
        number = store.add(base + "round", 0)
        key = f"{base}{number}/"
        gave_up = 1 << 40

        def next_round():  # once per round, by whichever rank ends it first
            store.compare_set(base + "round", str(number), str(number + 1))

        store.set(key + f"dir{rank}", directory)
        n = store.add(key + "count", 1)
        if n == world:
            store.set(key + "go", "1")
            next_round()
        elif n % gave_up == world:
            store.set(key + "abort", "1")
        timeout = float(os.environ.get("AUTOMOE_EP_SAVE_TIMEOUT_S", "300"))
        went = False
        if n < gave_up:  # nobody had given up when this rank arrived
            try:
                store.wait([key + "go"], timedelta(seconds=timeout))
                went = True
            except Exception:  # the store's timeout (its error types differ between backends)
                r = store.add(key + "count", gave_up)
                next_round()
                if r % gave_up == world:  # everyone had come: the last arrival has decided
                    deadline = time.monotonic() + 60
                    while not went and time.monotonic() < deadline:
                        went = store.check([key + "go"])
                        if not went and store.check([key + "abort"]):
                            break
                        time.sleep(0.05)
        if not went:
            missing = [r for r in range(world) if not store.check([key + f"dir{r}"])]
            raise AutoMoEError(
                f"save_pretrained({directory!r}) under expert parallelism (ep_size={self.info['ep']}) is "
                f"collective: every rank writes its experts, but rank(s) {missing or '(late)'} did not call it "
                f"within {timeout:.0f} s (AUTOMOE_EP_SAVE_TIMEOUT_S). Call save_pretrained on every rank (the "
                "Transformers Trainer saves from rank 0 only: see docs/parallelism.md)")
        dirs = {store.get(key + f"dir{r}").decode() for r in range(world)}
        if len(dirs) > 1:
            raise AutoMoEError(f"save_pretrained under expert parallelism: the ranks name different "
                               f"directories {sorted(dirs)}; they write one checkpoint together")

    def hook(self, names: list[str], params: list) -> None:
        for name, p in zip(names, params):
            if p is None or name not in self.routed or getattr(p, "_automoe_ep_hooked", False):
                continue
            if p.requires_grad:  # (a frozen expert is hooked once it requires gradients)
                p.register_hook(self._average)
                p._automoe_ep_hooked = True

    def _average(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad / self.info["world_size"]
        if self.dp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(grad, group=self.dp_group)
        return grad


class EngineBackbone(_EngineModule):
    """The decoder without its LM head (`model.model`, `model.base_model`): hidden states."""

    _automoe_prefix = "model."

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_router_logits=None, **kwargs):
        return self._automoe_forward(
            lm_head=False, input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
            use_cache=use_cache, output_router_logits=output_router_logits, kwargs=kwargs)


class EngineCausalLM(_EngineModule):
    """The causal LM: forward, loss, generation, checkpoints, all through the engine."""

    _automoe_backbone_class: type

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def _automoe_build(cls, engine: "_C.Model", config, source_dir: str | None = None, groups=None):
        """Transformers' module tree for `config` (parameters never allocated), its parameters
        bound to the engine's tensors."""
        config = copy.deepcopy(config)
        spec = engine.spec
        params = engine.named_parameters()
        config.dtype = params[0][1].dtype  # the dtype it was loaded in, as Transformers records it
        config._attn_implementation = engine.backend()["attn"]
        from automoe.fallback import register

        register()  # "automoe" is a valid experts_implementation for Transformers' checks
        from transformers import initialization

        with torch.device("meta"), initialization.no_init_weights(), initialization.no_tie_weights():
            model = cls(config)
        model.model.__class__ = cls._automoe_backbone_class
        model.config._experts_implementation_internal = ENGINE_EXPERTS[engine.backend()["experts"]]
        model._automoe_engine = engine
        model.model._automoe_engine = engine
        names = [name for name, _ in params]
        model._automoe_names = model.model._automoe_names = names
        for name, tensor in params:
            *path, leaf = name.split(".")
            module = model.get_submodule(".".join(path))
            if leaf in module._buffers:
                # A buffer saved with the weights (the routers' e_score_correction_bias): the
                # module holds the engine's tensor itself; it takes no gradient.
                module._buffers[leaf] = tensor
                continue
            if leaf not in module._parameters:
                raise AutoMoEError(f"engine parameter {name} is not a parameter of Transformers' "
                                   f"{type(model).__name__}")
            # nn.Parameter makes a new tensor over the same storage; hand it to the engine so that
            # the forward uses (and autograd fills .grad of) exactly this object.
            param = nn.Parameter(tensor, requires_grad=True)
            engine.set_parameter(name, param)
            module._parameters[leaf] = param
        _materialize_buffers(model)
        if spec["tie_word_embeddings"]:
            model.lm_head._parameters["weight"] = model.model.embed_tokens._parameters["weight"]
        missing = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
        if missing:
            raise AutoMoEError(f"Transformers' {type(model).__name__} has parameters the engine does not: "
                               f"{missing[:5]}")
        if engine.parallel is not None:
            ep = _ExpertParallel(engine.parallel, engine.routed_expert_names, groups)
            model._automoe_ep = model.model._automoe_ep = ep
            # DistributedDataParallel (Trainer, accelerate) all-reduces what it does not ignore:
            # each rank's experts are its own, their gradients are averaged by the hook above.
            model._ddp_params_and_buffers_to_ignore = sorted(ep.routed)
            model.model._ddp_params_and_buffers_to_ignore = sorted(
                n[len("model."):] for n in ep.routed if n.startswith("model."))
            ep.hook(names, [model.get_parameter(n) if n in ep.routed else None for n in names])
        if source_dir is not None:
            try:
                model.generation_config = transformers.GenerationConfig.from_pretrained(source_dir)
            except OSError:
                pass  # no generation_config.json: the one derived from config stays
        model.eval()  # as Transformers' from_pretrained
        model.automoe_path = "native"
        model.automoe_accelerated = {"everything": "AutoMoE engine (C++)", **engine.backend()}
        return model

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return True  # set_experts_implementation() switches the engine's experts backend

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        from automoe.modeling import load_native

        return load_native(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def _from_config(cls, config, **kwargs):
        from automoe.modeling import native_from_config

        return native_from_config(cls, config, **kwargs)

    # -- what the engine exposes ----------------------------------------------------------------
    @property
    def spec(self) -> dict:
        return self._automoe_engine.spec

    @property
    def layout(self) -> str:
        """The experts layout of the checkpoint this model was loaded from (what a save writes)."""
        return self._automoe_engine.layout

    @property
    def backend(self) -> BackendConfig:
        return BackendConfig.from_engine(self._automoe_engine.backend())

    def set_backend(self, backend: BackendConfig | dict) -> None:
        cfg = copy.copy(BackendConfig.coerce(backend))
        if cfg.attn is None:  # not chosen: the attention stays what it is
            cfg.attn = self.config._attn_implementation or self._automoe_engine.backend()["attn"]
        if cfg.attn == "sdpa" and not type(self)._supports_sdpa:
            raise AutoMoEError(f"backend attn='sdpa': {type(self).__name__} has no sdpa attention "
                               "(its attention sinks need 'eager')")
        current = self._automoe_engine.backend()["dispatcher"]
        in_process = cfg.dispatcher == "local" and self._automoe_ep is None  # (what "auto" is then)
        if cfg.dispatcher not in ("auto", current) and not in_process:
            raise AutoMoEError(f"backend dispatcher={cfg.dispatcher!r}: the dispatcher is chosen when the "
                               "model is loaded (from_pretrained(..., ep_size=N, backend={'dispatcher': ...})); "
                               f"this model runs {current!r}")
        cfg.dispatcher = current
        self._automoe_engine.set_backend(cfg.to_dict())
        self.config._attn_implementation = cfg.attn
        self.config._experts_implementation_internal = ENGINE_EXPERTS[cfg.experts]

    # -- forward --------------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_router_logits=None,
                logits_to_keep=0, **kwargs):
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        return self._automoe_forward(
            lm_head=True, input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids, past_key_values=past_key_values, inputs_embeds=inputs_embeds,
            labels=labels, use_cache=use_cache, output_router_logits=output_router_logits,
            logits_to_keep=logits_to_keep, num_items_in_batch=num_items_in_batch, kwargs=kwargs)

    @property
    def automoe_parallel(self) -> dict | None:
        """Expert parallelism (from_pretrained(ep_size=N)): this rank, the mesh and the experts
        it holds; None when one process holds every expert."""
        return None if self._automoe_ep is None else dict(self._automoe_engine.parallel)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this model's parameters; returns the total norm.
        Under expert parallelism it is the norm of the whole model's gradient — each rank's
        experts' part summed over its EP group, the dense part once — the same on every rank (as
        FSDP's clip_grad_norm_), so the ranks clip alike. torch.nn.utils.clip_grad_norm_ on the
        parameters would see only this rank's experts and clip each rank differently."""
        params = [p for p in self.parameters() if p.grad is not None]
        if self._automoe_ep is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        if float(norm_type) != 2.0:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): under expert parallelism AutoMoE "
                             "computes the 2-norm")
        import torch.distributed as dist

        routed = self._automoe_ep.routed
        dense, experts = [], []
        for name, p in self.named_parameters():
            if p.grad is not None:
                (experts if name in routed else dense).append(p.grad)

        device = torch.device(self._automoe_ep.info["device"])

        def squares(grads):  # float64 sum of squares, on the collectives' device
            out = torch.zeros((), dtype=torch.float64, device=device)
            for g in grads:
                out += torch.linalg.vector_norm(g.detach(), dtype=torch.float64).to(device) ** 2
            return out

        sq_experts = squares(experts)
        if self._automoe_ep.ep_group is not None:
            dist.all_reduce(sq_experts, group=self._automoe_ep.ep_group)
        total = (squares(dense) + sq_experts).sqrt().float()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.device))
        return total

    def generate(self, *args, **kwargs):
        """Transformers' generate; under expert parallelism every rank runs a forward at every step
        until all ranks are done (synced_gpus, as under FSDP), since each forward exchanges
        tokens with the other ranks."""
        if self._automoe_ep is not None:
            if kwargs.get("synced_gpus") is False:
                raise ValueError("generate(synced_gpus=False): under expert parallelism every rank "
                                 "must run every step's forward")
            kwargs["synced_gpus"] = True
        return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """generate() keeps the engine's cache between steps rather than a DynamicCache (what
        Transformers would create; a cache the user passed is used as given)."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("past_key_values")
        if (type(cache) is DynamicCache and not getattr(cache, "_is_user_defined", False)
                and not getattr(cache, "offloading", False) and cache.get_seq_length() == 0):
            model_kwargs["past_key_values"] = EngineCache(self.config.num_hidden_layers)

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
        # Under expert parallelism the save is collective whatever is_main_process says: every
        # rank writes its experts' rows into the shard files, rank 0 the rest.
        if self._automoe_ep is not None:
            self._automoe_ep.meet_to_save(os.fspath(save_directory))
        if layout is None and save_original_format is not None:
            layout = "per-expert" if save_original_format else "fused"
        self._automoe_sync()
        tensors = None
        if state_dict is not None:
            tensors = [(k, v) for k, v in state_dict.items()]
        # As Transformers' save_pretrained: the config records the dtype and the class.
        self.config.dtype = str(self.dtype).split(".")[1]
        self.config.architectures = [type(self).__name__]
        extra = {}
        if self.can_generate() and self.generation_config is not None:
            extra["generation_config.json"] = self.generation_config.to_json_string(use_diff=True)
        self._automoe_engine.save_pretrained(
            os.fspath(save_directory), layout, _parse_size(max_shard_size),
            config_json=self.config.to_json_string(use_diff=True), extra_files=extra,
            tensors=tensors)


def _materialize_buffers(model: nn.Module) -> None:
    """Buffers created on the meta device get their values: RoPE's inverse frequencies are
    recomputed as Transformers' own initialisation does; anything else is an error."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for module_name, module in model.named_modules():
        for name, buf in list(module._buffers.items()):
            if buf is None or not buf.is_meta:
                continue
            if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
                fns = {"default": getattr(module, "compute_default_rope_parameters", None),
                       **ROPE_INIT_FUNCTIONS}
                value, _ = fns[module.rope_type](module.config)
                module._buffers[name] = value.to("cpu")
            else:
                raise AutoMoEError(f"cannot materialise buffer {module_name}.{name} of {type(module).__name__}")


class Qwen3MoeModel(EngineBackbone, transformers.Qwen3MoeModel):
    pass


class Qwen3MoeForCausalLM(EngineCausalLM, transformers.Qwen3MoeForCausalLM):
    _automoe_backbone_class = Qwen3MoeModel


class DeepseekV3Model(EngineBackbone, transformers.DeepseekV3Model):
    pass


class DeepseekV3ForCausalLM(EngineCausalLM, transformers.DeepseekV3ForCausalLM):
    _automoe_backbone_class = DeepseekV3Model


class Glm4MoeModel(EngineBackbone, transformers.Glm4MoeModel):
    pass


class Glm4MoeForCausalLM(EngineCausalLM, transformers.Glm4MoeForCausalLM):
    _automoe_backbone_class = Glm4MoeModel


class MixtralModel(EngineBackbone, transformers.MixtralModel):
    pass


class MixtralForCausalLM(EngineCausalLM, transformers.MixtralForCausalLM):
    _automoe_backbone_class = MixtralModel


class Qwen2MoeModel(EngineBackbone, transformers.Qwen2MoeModel):
    pass


class Qwen2MoeForCausalLM(EngineCausalLM, transformers.Qwen2MoeForCausalLM):
    _automoe_backbone_class = Qwen2MoeModel


class OlmoeModel(EngineBackbone, transformers.OlmoeModel):
    pass


class OlmoeForCausalLM(EngineCausalLM, transformers.OlmoeForCausalLM):
    _automoe_backbone_class = OlmoeModel


class GptOssModel(EngineBackbone, transformers.GptOssModel):
    pass


class GptOssForCausalLM(EngineCausalLM, transformers.GptOssForCausalLM):
    _automoe_backbone_class = GptOssModel


# model_type -> the engine-backed causal-LM class
NATIVE_CLASSES: dict[str, type] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "kimi_k2": DeepseekV3ForCausalLM,  # Kimi-K2's config.json names its remote code; it is DeepSeek-V3
    "glm4_moe": Glm4MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "gpt_oss": GptOssForCausalLM,
}
