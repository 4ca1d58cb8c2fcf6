"""BackendConfig: which implementation runs each component of the model.

Field names follow NeMo AutoModel where the meaning is the same (see DESIGN.md). The engine
checks every value and refuses one it does not implement, naming those it does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class BackendConfig:
    # "sdpa" | "eager"; None: the model's default, as Transformers picks it (sdpa; eager where its
    # class has no sdpa: GPT-OSS, for its attention sinks)
    attn: str | None = None
    # fused ops: router -> permute -> grouped GEMM -> SwiGLU -> grouped GEMM -> unpermute;
    # "torch_mm" (ATen _grouped_mm) or "eager" (Transformers' per-expert loop)
    experts: str = "grouped"
    rms_norm: str = "fused"  # "fused" | "torch"
    rope: str = "fused"  # "fused" | "torch"
    swiglu: str = "fused"  # "fused" | "torch"
    # Mamba-2 mixers (Nemotron-H): the fused depthwise conv1d + SiLU and gated RMSNorm kernels, or
    # their ATen references ("fused" | "torch")
    mamba: str = "fused"
    # dense linear layers (attention projections, dense MLPs, shared experts, the LM head):
    # "auto" (bf16 on a CPU without native bf16 GEMM: AutoMoE's GEMM engine; else at::linear) |
    # "torch" (at::linear)
    linear: str = "auto"
    # "torch": full logits then cross-entropy (logits returned, as in Transformers);
    # "fused_linear_ce": chunked LM head + loss, no logits returned when labels are given
    loss: str = "torch"
    # expert parallelism: "auto" (local at ep_size 1, else alltoall), "local", "allgather",
    # "alltoall", "alltoall_overlap" (see docs/parallelism.md)
    dispatcher: str = "auto"
    fake_balanced_gate: bool = False  # round-robin routing, for performance measurements only

    @classmethod
    def coerce(cls, value: "BackendConfig | dict[str, Any] | None") -> "BackendConfig":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(
                    f"backend: unknown field(s) {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
                )
            return cls(**value)
        raise TypeError(f"backend: expected a BackendConfig or a dict, got {type(value).__name__}")

    def to_dict(self) -> dict[str, str]:
        """The engine's fields (an unresolved attn is left out: the engine keeps its own)."""
        return {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in asdict(self).items()
                if v is not None}

    @classmethod
    def from_engine(cls, fields: dict[str, str]) -> "BackendConfig":
        known = {k: v for k, v in fields.items() if k in cls.__dataclass_fields__}
        known["fake_balanced_gate"] = known.get("fake_balanced_gate", "false") == "true"
        return cls(**known)
