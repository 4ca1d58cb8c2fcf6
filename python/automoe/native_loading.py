"""from_pretrained and from_config for the engine-backed classes (`automoe.native`): Transformers'
arguments read (refused or warned about by name when they cannot apply), the local checkpoint
directory and the device found, the mesh for `ep_size` set up, and the engine's model loaded or
initialised and bound to Transformers' module tree. `force_transformers=True` on a native class
hands the load to Transformers' own model (`automoe.fallback`)."""

from __future__ import annotations

import copy
import logging
import os

import torch

from automoe import _engine
from automoe.arguments import EXPERTS_IMPLEMENTATIONS, AutoMoEError, device_of, dtype_name, warn_ignored
from automoe.backend import BackendConfig
from automoe.native_parallel import expert_parallel_world

_C = _engine.load()
logger = logging.getLogger("automoe")

# from_pretrained arguments that concern only downloads from the Hub: meaningless for the local
# directories AutoMoE reads.
_HUB_ONLY = ("cache_dir", "force_download", "local_files_only", "token", "revision", "proxies",
             "mirror", "_from_pipeline", "_from_auto", "commit_hash", "_commit_hash",
             "user_agent", "resume_download")


def _local_dir(path: str | os.PathLike, subfolder: str = "") -> str:
    path = os.path.join(os.fspath(path), subfolder) if subfolder else os.fspath(path)
    if not os.path.isdir(path):
        raise OSError(
            f"{path}: not a local checkpoint directory (AutoMoE loads local Hugging Face "
            "directories; download with `huggingface-cli download` first)"
        )
    return path


def _native_config(cls, path: str, config, kwargs: dict):
    """The checkpoint's config with from_pretrained's config overrides applied, as Transformers
    applies them (keys of the config); other leftover arguments are a TypeError naming them. Read
    with the class's own config class, so that an alias (Kimi-K2's "kimi_k2") reads as the model
    it is."""
    if config is None:
        config, unused = cls.config_class.from_pretrained(path, return_unused_kwargs=True, **kwargs)
    else:
        config = copy.deepcopy(config)  # as Transformers: the caller's config is not modified
        unused = {}
        for key, value in kwargs.items():
            if hasattr(config, key):
                setattr(config, key, value)
            else:
                unused[key] = value
    if unused:
        raise TypeError(f"from_pretrained(): arguments that are neither from_pretrained's nor keys of "
                        f"the {config.model_type} config: {sorted(unused)}")
    return config


def _initialize_as_transformers(model) -> None:
    """What Transformers' from_pretrained does after loading: every loaded tensor is marked
    initialised and the model's `_init_weights` still runs over the module tree. It skips the
    marked tensors, but it evaluates its arguments — Qwen3-Next's `A_log` draws from the global
    generator, for one — so that seeded code after from_pretrained (PEFT's adapter init, a
    dropout mask) sees the generator state Transformers leaves. The engine's tensors are never
    written (Transformers' init functions honour the mark, as its own loading relies on). Our
    subclasses live outside `transformers.`, which Transformers would take for custom code and skip
    whole modules for: they run Transformers' own `_init_weights`, as its class does."""
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            tensor._is_hf_initialized = True
        model.is_custom_code = lambda: False
        try:
            model.initialize_weights()
        finally:
            del model.is_custom_code


def _common_arguments(cls, kwargs: dict, backend, attn_implementation,
                      experts_implementation, expert_parallel: bool = False) -> BackendConfig:
    """Transformers' attn_implementation / experts_implementation folded into a BackendConfig.
    A class whose Transformers model has no sdpa (GPT-OSS, for its attention sinks) defaults to
    eager, as in Transformers, and refuses sdpa."""
    cfg = copy.copy(BackendConfig.coerce(backend))  # (the caller's BackendConfig stays as given)
    has_sdpa = getattr(cls, "_supports_sdpa", True)
    if attn_implementation is not None:
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"attn_implementation={attn_implementation!r}: the AutoMoE engine implements "
                             "'sdpa' and 'eager'")
        cfg.attn = attn_implementation
    elif cfg.attn is None:
        cfg.attn = "sdpa" if has_sdpa else "eager"
    if cfg.attn == "sdpa" and not has_sdpa:
        raise ValueError(f"attn_implementation='sdpa': {cls.__name__} has no sdpa attention (its "
                         "attention sinks need 'eager'), in Transformers as in AutoMoE")
    if experts_implementation is not None:
        if experts_implementation not in EXPERTS_IMPLEMENTATIONS:
            raise ValueError(f"experts_implementation={experts_implementation!r}: the AutoMoE engine "
                             f"implements {sorted(EXPERTS_IMPLEMENTATIONS)}")
        cfg.experts = EXPERTS_IMPLEMENTATIONS[experts_implementation]
    if cfg.dispatcher not in ("auto", "local") and not expert_parallel:
        raise ValueError(f"backend dispatcher={cfg.dispatcher!r}: this model runs every expert in this "
                         "process; the dispatchers that exchange tokens between ranks need "
                         "from_pretrained(..., ep_size=N) under torch.distributed (docs/parallelism.md)")
    return cfg


def load_native(cls, pretrained_model_name_or_path, *model_args, backend=None,
                torch_dtype=None, dtype=None, attn_implementation=None, experts_implementation=None,
                config=None, device_map=None, subfolder: str = "", output_loading_info: bool = False,
                low_cpu_mem_usage=None, trust_remote_code=None, use_safetensors=None,
                force_transformers: bool = False, ep_size: int | None = None, **kwargs):
    """from_pretrained for an engine-backed class (see AutoModelForCausalLM.from_pretrained)."""
    if ep_size not in (None, 1) and cls.config_class.model_type == "gpt_oss" and not force_transformers:
        # The engine's dispatchers do not take GPT-OSS's biased, transposed experts yet;
        # Transformers' model with its experts sharded does (automoe.fallback_parallel).
        logger.info("automoe: gpt_oss with ep_size=%s runs as Transformers' model (the engine's expert "
                    "parallelism does not take GPT-OSS's experts yet)", ep_size)
        force_transformers = True
    if force_transformers:  # (Qwen3MoeForCausalLM.from_pretrained(..., force_transformers=True))
        from automoe import fallback

        given = dict(torch_dtype=torch_dtype, dtype=dtype, attn_implementation=attn_implementation,
                     experts_implementation=experts_implementation, config=config, device_map=device_map,
                     subfolder=subfolder or None, output_loading_info=output_loading_info or None,
                     low_cpu_mem_usage=low_cpu_mem_usage, trust_remote_code=trust_remote_code,
                     use_safetensors=use_safetensors)
        return fallback.load(pretrained_model_name_or_path, *model_args, backend=backend, ep_size=ep_size,
                             **{k: v for k, v in given.items() if v is not None}, **kwargs)
    if model_args:
        raise TypeError("from_pretrained(): positional model arguments are not supported by AutoMoE")
    path = _local_dir(pretrained_model_name_or_path, subfolder)
    ignored = {k: "only used to download from the Hub; AutoMoE reads local directories"
               for k in _HUB_ONLY if kwargs.pop(k, None) is not None}
    if low_cpu_mem_usage is not None:
        ignored["low_cpu_mem_usage"] = ("AutoMoE always loads with low memory: safetensors are "
                                        "memory-mapped and each tensor is read once")
    if trust_remote_code:
        ignored["trust_remote_code"] = f"{cls.__name__} runs AutoMoE's engine, not remote code"
    if use_safetensors is False:
        raise ValueError("from_pretrained(use_safetensors=False): AutoMoE reads safetensors checkpoints only")
    for key in ("quantization_config", "key_mapping", "tp_plan", "tp_size", "device_mesh", "max_memory",
                "offload_folder", "offload_state_dict", "offload_buffers", "gguf_file", "variant",
                "adapter_name", "adapter_kwargs"):
        if kwargs.get(key) is not None:
            raise ValueError(f"from_pretrained({key}=...): not supported by AutoMoE's engine; "
                             "load with force_transformers=True to use Transformers' loader")
    if kwargs.pop("ignore_mismatched_sizes", False):
        raise ValueError("from_pretrained(ignore_mismatched_sizes=True): AutoMoE refuses checkpoints "
                         "whose tensors do not match their config")
    warn_ignored("from_pretrained()", ignored)
    device = device_of(device_map, ep_size)
    parallel = expert_parallel_world(ep_size, device)
    cfg = _common_arguments(cls, kwargs, backend, attn_implementation, experts_implementation,
                            expert_parallel=parallel is not None)
    config = _native_config(cls, path, config, kwargs)
    chosen = dtype if dtype is not None else torch_dtype
    groups = parallel.pop("_groups") if parallel else None
    _check_weights_fit(path, config, dtype_name(chosen), ep_size or 1, device)
    engine = _C.load_pretrained(path, dtype_name(chosen) or "auto", cfg.to_dict(),
                                config_json=config.to_json_string(use_diff=False), parallel=parallel)
    # Dequantised on load (MXFP4 experts, bitsandbytes' quantised linear layers): the model is no
    # longer quantised.
    if engine.spec["mxfp4_experts"] or engine.spec["bnb_quantized"]:
        config.quantization_config = None
        del config.quantization_config
    model = cls._automoe_build(engine, config, source_dir=path, groups=groups)
    model.config._name_or_path = os.fspath(pretrained_model_name_or_path)
    model.name_or_path = os.fspath(pretrained_model_name_or_path)
    if device is not None and device.type != "cpu":
        model.to(device)
    _initialize_as_transformers(model)
    logger.info("automoe: %s (%s) runs natively in the AutoMoE engine: %s", path, config.model_type,
                ", ".join(f"{k}={v}" for k, v in engine.backend().items()))
    if output_loading_info:
        return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [],
                       "error_msgs": []}
    return model


def _check_weights_fit(path: str, config, dtype: str | None, ep: int, device) -> None:
    """Before any weight is read: this rank's weights (its E/ep experts) against the memory it has
    — the CPU's (shared by the node's ranks), and the GPU's when the model goes there. A model that
    cannot fit is refused with what would, instead of being killed by the out-of-memory killer."""
    # (the config's own dtype as written: the engine refuses one it does not run, with its message)
    name = dtype or str(getattr(config, "dtype", None) or "float32").replace("torch.", "")
    width = {"float32": 4.0, "float64": 8.0}.get(name, 2.0)
    text = config.to_json_string(use_diff=False)
    need, cpu, experts = _C.plan_weights(text, ep, width)
    # (the processes a launcher started on this machine each load their copy)
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    places = [("this machine", cpu / ranks)]
    if device is not None and device.type == "cuda":
        places.append((str(device), float(torch.cuda.mem_get_info(device)[0])))
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    for where, have in places:
        if need <= have:
            continue
        hint = ""
        for e in (e for e in range(ep + 1, min(experts, world) + 1) if experts % e == 0 and world % e == 0):
            per_rank = _C.plan_weights(text, e, width)[0]
            if per_rank <= have:
                hint = f"; with ep_size={e} each rank would hold {per_rank / 2**30:.2f} GiB"
                break
        raise MemoryError(
            f"from_pretrained({path!r}{f', ep_size={ep}' if ep > 1 else ''}): the weights need "
            f"{need / 2**30:.2f} GiB per rank in {name}, and {where} has {have / 2**30:.2f} GiB available"
            f"{hint} (training needs more: `automoe plan` counts all of it). Nothing was loaded; "
            "AUTOMOE_AVAILABLE_MEMORY=BYTES overrides the memory this check assumes.")


def native_from_config(cls, config, *, backend=None, torch_dtype=None, dtype=None,
                       attn_implementation=None, experts_implementation=None, **kwargs):
    """from_config for an engine-backed class: fresh parameters, initialised as Transformers does
    (normal(0, initializer_range), ones for norms), drawn from torch's global generator's seed."""
    kwargs.pop("trust_remote_code", None)
    if kwargs.get("ep_size") not in (None, 1):
        raise ValueError(f"from_config(ep_size={kwargs['ep_size']}): expert parallelism loads a checkpoint; "
                         "save the fresh model and load it with from_pretrained(path, ep_size=...)")
    kwargs.pop("ep_size", None)
    cfg = _common_arguments(cls, kwargs, backend, attn_implementation, experts_implementation)
    config = copy.deepcopy(config)  # as Transformers: the caller's config is not modified
    for key, value in list(kwargs.items()):
        if hasattr(config, key):
            setattr(config, key, kwargs.pop(key))
    if kwargs:
        raise TypeError(f"from_config(): arguments not supported by AutoMoE: {sorted(kwargs)}")
    chosen = dtype if dtype is not None else torch_dtype
    name = dtype_name(chosen) or dtype_name(getattr(config, "dtype", None)) or "float32"
    seed = int(torch.randint(0, 2**62, (1,)).item())
    engine = _C.init_model(config.to_json_string(use_diff=False), name, cfg.to_dict(), seed)
    if engine.spec["mxfp4_experts"]:  # fresh experts are dense: the model is not quantised
        config.quantization_config = None
        del config.quantization_config
    return cls._automoe_build(engine, config)
