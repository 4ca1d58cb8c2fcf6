"""The native model's tensors: how Transformers' module tree and the engine share them.

`_EngineBuild._automoe_build` makes Transformers' module tree on the meta device and binds every
parameter and saved buffer to the engine's tensor (the engine gets the very `nn.Parameter` back,
so both sides hold the same TensorImpl). `_EngineBinding._automoe_sync`, before each forward,
re-binds what is found under each name in the tree now, hands PEFT's LoRA factors to the engine,
refuses hooks the engine would never run, and applies Transformers' attn/experts implementation.
"""

from __future__ import annotations

import copy
import sys

import torch
import transformers
from torch import nn

from automoe import _engine
from automoe.arguments import ENGINE_EXPERTS, EXPERTS_IMPLEMENTATIONS, AutoMoEError
from automoe.native_parallel import _ExpertParallel, sharded_parameter

_C = _engine.load()


def _is_lora_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (lora.Linear, lora.ParamWrapper, ...) wrapping `base_layer`."""
    if "peft" not in sys.modules:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(module, BaseTunerLayer) and hasattr(module, "base_layer")


def _describe(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


class _EngineBinding:
    """What the causal LM and its backbone share: the engine's parameters found in the module
    tree, PEFT's adapters, the hooks check, and the sync before each forward."""

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

    def _automoe_bound(self) -> tuple[list, list]:
        """The engine's tensors (what _automoe_params holds, a DTensor expert's local shard in its
        place, its requires_grad following the DTensor's) and what the module holds."""
        from torch.distributed.tensor import DTensor

        held = self._automoe_params()
        bound = []
        for p in held:
            if isinstance(p, DTensor):
                local = p._local_tensor
                if local.requires_grad != p.requires_grad:
                    local.requires_grad_(p.requires_grad)
                p = local
            bound.append(p)
        return bound, held

    def _automoe_adapters(self) -> list[tuple]:
        """PEFT's LoRA adapters on this module tree, as the engine runs them: (base weight name, A,
        B, scaling, dropout) per adapted weight, the factors PEFT's own parameters (views), so that
        autograd fills their .grad. An adapter is never skipped silently: what the engine cannot
        run (DoRA, another PEFT method, several active adapters, ...) is refused by name."""
        if "peft" not in sys.modules:
            return []
        from peft.tuners.tuners_utils import BaseTunerLayer

        out, expert_sites = [], []
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
                expert_sites.append(len(out))
            else:
                base = f"{self._automoe_prefix}{path}.weight"
            out.append((base, a, b, scaling, dropout))
        if expert_sites and self._automoe_ep is not None:
            # Under expert parallelism each rank runs its own experts' rows of the (replicated)
            # expert adapters; the gradient comes back whole (native_parallel.expert_adapter_rows).
            from automoe.native_parallel import expert_adapter_rows

            info = self._automoe_ep.info
            factors = [t for i in expert_sites for t in out[i][1:3]]
            rows = expert_adapter_rows(self._automoe_ep.ep_group, int(info["expert_begin"]),
                                       int(info["expert_count"]), int(info["ep"]), factors)
            for k, i in enumerate(expert_sites):
                out[i] = (out[i][0], rows[2 * k], rows[2 * k + 1], *out[i][3:])
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
        params, held = self._automoe_bound()
        engine.rebind(params)
        adapters = self._automoe_adapters()
        if adapters or getattr(self, "_automoe_has_adapters", False):
            engine.set_adapters(adapters)
            self._automoe_has_adapters = bool(adapters)
        if self._automoe_ep is not None:
            self._automoe_ep.hook(self._automoe_names, held)
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


class _EngineBuild:
    """The causal LM's construction from an engine model (from_pretrained, from_config), with
    its class's `_automoe_backbone_class` as the backbone."""

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
        mesh, routed = None, set()
        if engine.parallel is not None and groups is not None and groups[0] is not None:
            # Under expert parallelism each routed expert tensor is a DTensor over the EP group
            # whose local shard is the engine's tensor (native_parallel.sharded_parameter).
            from torch.distributed.device_mesh import DeviceMesh

            device = engine.parallel["device"]
            mesh = DeviceMesh.from_group(groups[0], "cuda" if device.startswith("cuda") else "cpu")
            routed = set(engine.routed_expert_names)
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
            module._parameters[leaf] = sharded_parameter(param, mesh) if name in routed else param
        _materialize_buffers(model)
        if spec["tie_word_embeddings"]:
            model.lm_head._parameters["weight"] = model.model.embed_tokens._parameters["weight"]
        missing = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
        if missing:
            raise AutoMoEError(f"Transformers' {type(model).__name__} has parameters the engine does not: "
                               f"{missing[:5]}")
        if engine.parallel is not None:
            _ExpertParallel(engine.parallel, engine.routed_expert_names, groups).attach(model, names)
        if source_dir is not None:
            try:
                model.generation_config = transformers.GenerationConfig.from_pretrained(source_dir)
            except OSError:
                pass  # no generation_config.json: the one derived from config stays
        model.eval()  # as Transformers' from_pretrained
        model.automoe_path = "native"
        model.automoe_accelerated = {"everything": "AutoMoE engine (C++)", **engine.backend()}
        return model


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

