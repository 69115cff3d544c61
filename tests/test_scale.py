"""Analysis at scale: the restricted `.pt` reader, the parallel and cached `rlk-matrix report`,
the progress bar and the plugin's overhead fields."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_rlkernel_matrix.judge.evidence import read_pt
from pytest_rlkernel_matrix.judge.ptfile import Unsupported, load_plain


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and torch.equal(a, b))
    if isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def test_fast_reader_gives_what_torch_load_gives() -> None:
    base = torch.arange(12, dtype=torch.float32)
    obj = {"schema_version": "x", "rank": 3, "f": 1.5, "none": None, "ok": True,
           "lists": [torch.randn(7, dtype=torch.bfloat16), torch.randn(5, dtype=torch.float16),
                     torch.randn(4, dtype=torch.float64), torch.tensor([True, False]),
                     torch.arange(6), base[2:9], base.view(3, 4).t(), base[:0]],
           "nested": ({"a": [1, 2]}, (base[1:3],)), 5: "int key"}
    raw = _saved(obj)
    assert _same(load_plain(raw), torch.load(io.BytesIO(raw), weights_only=True))


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("obj", [
    {"size": torch.Size([2, 3])},                       # a global outside the allowlist
    {"p": torch.nn.Parameter(torch.ones(2))},           # requires_grad / another rebuilder
    {"s": {1, 2}},                                      # a type outside plain data
])
def test_fast_reader_refuses_what_it_does_not_know_and_torch_decides(obj: Any) -> None:
    raw = _saved(obj)
    with pytest.raises(Unsupported):
        load_plain(raw)
    assert _same(read_pt(raw, torch), torch.load(io.BytesIO(raw), weights_only=True))


def test_no_unpickler_runs_a_foreign_global(tmp_path: Path) -> None:
    buf = io.BytesIO()
    torch.save({"x": _Evil()}, buf, pickle_module=pickle)
    raw = buf.getvalue()
    with pytest.raises(Unsupported, match=r"global (posix|os)\.system"):
        load_plain(raw)
    with pytest.raises(pickle.UnpicklingError):  # and torch's weights_only path refuses it
        read_pt(raw, torch)
    with pytest.raises(Unsupported):
        load_plain(b"not a zip at all")
