"""The tensors the model and the kernels share: one layer's weights, one attention call's inputs.

A module of its own so that `workload.kernels` and `workload.model` do not import each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
