"""Where the Triton kernel tests of this folder run: a CUDA/ROCm device with triton, or
Triton's CPU interpreter (``TRITON_INTERPRET=1`` with triton installed, fp32 and small)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = not CUDA and HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(
    not (CUDA and HAS_TRITON) and not INTERPRET,
    reason="needs a CUDA/ROCm device with triton (or TRITON_INTERPRET=1 with triton installed: "
           "Triton's CPU interpreter)")
DEV = torch.device("cuda" if CUDA else "cpu")
DT = torch.bfloat16 if CUDA else torch.float32  # the interpreter has no bf16 tensor cores


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit on a device. Under the interpreter ``tl.dot`` is numpy's matmul, whose
    roundings depend on a row's place in the tile (OpenBLAS's edge kernels): there, equal to
    fp32 rounding (the kernels' batch invariance is a device property; the GPU runs check it)."""
    if INTERPRET:
        return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    return torch.equal(a, b)
