"""The tensors the model and the kernels share: one layer's weights, one attention call's inputs,
and the R path's fixed shapes (`Tiling`, re-exported by `workload.kernels`).

A module of its own so that `workload.kernels` and `workload.model` do not import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LayerWeights:
    """Views of one decoder layer's weights."""

    index: int
    input_norm: Tensor
    q_proj: Tensor
    k_proj: Tensor
    v_proj: Tensor
    o_proj: Tensor
    q_norm: Tensor
    k_norm: Tensor
    post_norm: Tensor
    gate_proj: Tensor
    up_proj: Tensor
    down_proj: Tensor


@dataclass
class KVCache:
    """One layer's key/value cache, token-major ``[batch, capacity, kv_heads, head_dim]``."""

    k: Tensor
    v: Tensor

    def select(self, rows: Tensor) -> KVCache:
        """Keep only the given batch rows (finished sequences are freed)."""
        return KVCache(self.k.index_select(0, rows), self.v.index_select(0, rows))


@dataclass
class AttnInputs:
    """Per-call attention context: positions ``[B, T]``, RoPE cos/sin ``[B, T, D]``, cache."""

    positions: Tensor
    cos: Tensor
    sin: Tensor
    cache: KVCache | None
    span: int = 0  # decode: keys in use (max position + 1), host-side metadata like vLLM's
    # Context parallel: local ``k, v [B, T_local, Hkv, D]`` -> every rank's, in position order.
    kv_gather: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None


@dataclass(frozen=True)
class Tiling:
    """Fixed shapes of the R path: row tile, attention query tile, problem chunk and key span
    (the cache's capacity)."""

    row_tile: int
    query_tile: int
    chunk: int
    key_span: int

    @classmethod
    def for_device(cls, device: torch.device, key_span: int) -> Tiling:
        """Tile sizes tuned per device class (fixed for a run; both sides use the same)."""
        if device.type == "cuda":
            return cls(row_tile=256, query_tile=16, chunk=1024, key_span=key_span)
        return cls(row_tile=32, query_tile=8, chunk=32, key_span=key_span)
