"""Our safetensors reader and writer against the `safetensors` package, in every dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from automoe import _C

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def sample(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g) * 3
    return (x > 0) if dtype == torch.bool else x.to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("shape", [(), (0,), (3, 5), (2, 3, 7)])
def test_reads_every_dtype_the_safetensors_package_writes(tmp_path, shape):
    tensors = {f"t.{str(d).split('.')[-1]}": sample(d, shape) for d in DTYPES}
    save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt", "note": "hi"})
    ours, metadata = _C.load_safetensors(str(tmp_path / "x.safetensors"))
    assert metadata == {"format": "pt", "note": "hi"}
    got = dict(ours)
    assert got.keys() == tensors.keys()
    for name, t in tensors.items():
        assert same_bytes(got[name], t), name


def test_the_safetensors_package_reads_what_we_write(tmp_path):
    tensors = [(f"layer.{i}.{str(d).split('.')[-1]}", sample(d, (4, 3))) for i, d in enumerate(DTYPES)]
    tensors.append(("scalar", torch.tensor(2.5)))
    _C.save_safetensors(str(tmp_path / "y.safetensors"), tensors, {"origin": "automoe"})
    with safe_open(tmp_path / "y.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "origin": "automoe"}
        assert set(f.keys()) == {n for n, _ in tensors}
        for name, t in tensors:
            assert same_bytes(f.get_tensor(name), t), name
