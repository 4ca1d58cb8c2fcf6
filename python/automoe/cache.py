"""The engine's KV cache behind Transformers' `Cache` interface.

`EngineCache` is what the drop-in model returns as `past_key_values` and what `generate()` uses:
its storage is the C++ engine's (`automoe._C.KVCache`: per-layer buffers in the model's dtype that
grow geometrically, so a decoding step copies only its new positions). Transformers' generation
code drives it through the usual methods (`get_seq_length`, `reorder_cache`, `crop`, ...), and each
layer shows its keys and values as `cache.layers[i].keys` / `.values` like a `DynamicLayer`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from automoe import _engine

_C = _engine.load()


class EngineCacheLayer(CacheLayerMixin):
    """A view of one layer of an `EngineCache`: keys/values are [B, N_kv, length, D] or None."""

    is_compileable = False
    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, storage: "_C.KVCache", layer_idx: int):  # no super().__init__: keys/values are views
        self._storage = storage
        self._layer_idx = layer_idx

    @property
    def keys(self) -> torch.Tensor | None:
        return self._storage.keys(self._layer_idx)

    @property
    def values(self) -> torch.Tensor | None:
        return self._storage.values(self._layer_idx)

    @property
    def is_initialized(self) -> bool:
        return self._storage.length(self._layer_idx) > 0

    @property
    def batch_size(self) -> int:
        return self._storage.batch_size

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the engine allocates on the first append

    def update(self, key_states, value_states, *args, **kwargs):
        return self._storage.append(self._layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._storage.length(self._layer_idx)

    def get_max_length(self) -> int:
        return -1

    def __repr__(self) -> str:
        return f"EngineCacheLayer(layer={self._layer_idx}, length={self.get_seq_length()})"


class EngineCache(Cache):
    """Transformers' `Cache` whose keys and values live in the AutoMoE engine."""

    def __init__(self, num_layers: int):
        self._storage = _C.KVCache(num_layers)
        super().__init__(layers=[EngineCacheLayer(self._storage, i) for i in range(num_layers)])

    @property
    def storage(self) -> "_C.KVCache":
        return self._storage

    def __deepcopy__(self, memo) -> "EngineCache":
        """An independent copy (Transformers' prefix-reuse pattern: deepcopy a prompt's cache)."""
        out = EngineCache.__new__(EngineCache)
        out._storage = self._storage.clone()
        Cache.__init__(out, layers=[EngineCacheLayer(out._storage, i) for i in range(len(self.layers))])
        memo[id(self)] = out
        return out

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self._storage.append(layer_idx, key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._storage.length(layer_idx) if layer_idx < len(self.layers) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._storage.index_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._storage.index_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._storage.repeat_interleave_batch(repeats)

    def crop(self, tokens_to_remove: int) -> None:
        """As `DynamicCache.crop`: a negative value removes that many positions from the end; a
        positive one (Transformers' legacy form) is the length to keep."""
        length = self.get_seq_length()
        remove = -tokens_to_remove if tokens_to_remove <= 0 else max(length - tokens_to_remove, 0)
        if remove:
            self._storage.remove_last(remove)

    def reset(self) -> None:
        self._storage.reset()

    @property
    def batch_size(self) -> int:
        return self._storage.batch_size if self._storage.batch_size else -1

    def __repr__(self) -> str:
        return f"EngineCache(layers={len(self.layers)}, length={self.get_seq_length()})"


def import_cache(cache: Cache, num_layers: int) -> EngineCache:
    """A Transformers `DynamicCache` (plain full-attention layers) copied into a new EngineCache, so
    that the engine can attend to what it holds; anything else is refused by name."""
    if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])})
        raise TypeError(
            f"past_key_values: AutoMoE's engine reads its own EngineCache or a DynamicCache of plain "
            f"layers; got {type(cache).__name__} (layers: {kinds or 'none'}). Pass "
            "past_key_values=None and use the cache the model returns."
        )
    if len(cache.layers) not in (0, num_layers):
        raise ValueError(f"past_key_values: a cache for {len(cache.layers)} layers; the model has {num_layers}")
    out = EngineCache(num_layers)
    for i, layer in enumerate(cache.layers):
        if layer.is_initialized and layer.keys is not None and layer.keys.numel() > 0:
            out.update(layer.keys.detach(), layer.values.detach(), i)
    return out


def export_new_positions(engine_cache: EngineCache, target: Cache, start: int) -> None:
    """Appends what `engine_cache` holds from position `start` on to `target` (Transformers'
    `update`, layer by layer), so that a DynamicCache passed in is updated in place as
    Transformers' own model would update it."""
    for i in range(len(engine_cache.layers)):
        k, v = engine_cache.layers[i].keys, engine_cache.layers[i].values
        if k is None:
            continue
        target.update(k[:, :, start:], v[:, :, start:], i)
