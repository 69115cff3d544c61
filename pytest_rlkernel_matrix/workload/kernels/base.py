"""Per-module kernels: P (production/native) and R (RL-Kernel aligned) implementations.

Modules: ``attention`` (input norm, QKV projection, q/k norm, RoPE, core attention, output
projection), ``ffn`` (post-attention norm, gate/up/down projections, SwiGLU) and ``logp`` (final
norm, LM head, log-softmax, selected-token gather).

P is the native path as each framework naturally calls it: ``F.linear`` in the model dtype with
fused QKV / gate-up weights, torch SDPA (causal full-sequence on the training side; per-prompt
prefill and masked decode against the KV cache on the rollout side), and each framework's own
norm / RoPE / SwiGLU / log-softmax flavour (Megatron: fused fp32 epilogues and a
max/exp/sum cross-entropy; vLLM: native-dtype epilogues and ``log_softmax``).

R is one implementation used identically on both sides. Every library call it makes has a fixed
shape whatever the batch, the sequence packing or prefill-vs-decode: rows are processed in
fixed-size row tiles, core attention in fixed-size problem chunks over the whole fixed key
span, all in fp32. So each row sees exactly
the same kernels and reduction order, which makes the selected logprobs bitwise identical
between rollout and training.

Tensor parallelism (Megatron/vLLM style): QKV and gate/up are column-parallel (each rank holds a
slice of the heads / intermediate rows), O and down are row-parallel and return a *partial* sum
that the ``comm`` kernel reduces and adds to the residual; the LM head is vocab-parallel. R keeps
its fixed shapes per rank and reduces across ranks only with an all-gather followed by a sum in
rank order (``parallel.fixed_order_sum``), the same on both sides; P uses each framework's own
collective (Megatron: all-reduce in the model dtype, vocab-parallel cross entropy; vLLM: fused
all-reduce + residual add in fp32, all-gathered logits).

On a GPU with Triton, R runs the batch-invariant kernels of ``triton_kernels.py`` instead (bf16
operands, fp32 accumulation, one fixed configuration per dtype): ``r_backend`` is the one place
that chooses. The CPU R path above is unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_rlkernel_matrix.workload.kernels.p import native
from pytest_rlkernel_matrix.workload.kernels.p.native import FAST_PATHS
from pytest_rlkernel_matrix.workload.kernels.r.identity import (
    R_BACKEND_IDS as R_BACKEND_IDS,  # (also read here: env, machine)
)
from pytest_rlkernel_matrix.workload.kernels.r.identity import (
    R_CONTRACT_VERSION as R_CONTRACT_VERSION,
)
from pytest_rlkernel_matrix.workload.kernels.r.r_attention import (
    r_core_attention as r_core_attention,  # (re-exported)
)
from pytest_rlkernel_matrix.workload.parallel import Group
from pytest_rlkernel_matrix.workload.weights import (
    Tiling as Tiling,  # (re-exported: its home is weights.py)
)

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from pytest_rlkernel_matrix.workload.kernels.r.autograd import Ops

MODULES = ("attention", "ffn", "logp")
# `comm` (the row-parallel activation all-reduce) is an optional fourth module: the seed's matrix
# has the three above; comm is this project's extension and needs tensor parallelism (tp >= 2).
OPTIONAL_MODULES = ("comm",)
ALL_MODULES = (*MODULES, *OPTIONAL_MODULES)
FRAMEWORK = {"training": "megatron", "rollout": "vllm"}


def runtime_platform(device: torch.device) -> str:
    """``cpu``, ``cuda`` or ``rocm`` (torch.cuda on a HIP build)."""
    if device.type != "cuda":
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


def _tk() -> Ops:
    """``triton_kernels`` with a backward (``autograd.Ops``), imported on first GPU use."""
    from pytest_rlkernel_matrix.workload.kernels.r.autograd import triton_ops

    return triton_ops()


def r_backend(device: torch.device) -> str:
    """The R implementation for a device: ``triton`` on a GPU with Triton, else ``torch``.

    Set ``RLK_REF_R_BACKEND=torch`` to force the tiled-torch R path on a GPU (comparisons).
    """
    forced = os.environ.get("RLK_REF_R_BACKEND", "").strip()
    usable = device.type == "cuda" and _tk().available(device)
    if forced in ("torch", "triton"):
        if forced == "triton" and not usable:
            raise RuntimeError(f"RLK_REF_R_BACKEND=triton but Triton cannot run on {device}")
        return forced
    return "triton" if usable else "torch"


# ---------------------------------------------------------------------------------------------
# R primitives: fixed-shape, fp32, row-invariant.


def _tiled(fn: Callable[..., tuple[Tensor, ...]], tile: int, *rows: Tensor) -> tuple[Tensor, ...]:
    """Apply ``fn`` to fixed ``[tile, ...]`` row tiles of ``rows`` (zero padded) and re-join."""
    m = rows[0].shape[0]
    mp = -(-m // tile) * tile
    padded = [F.pad(r, (0, 0) * (r.dim() - 1) + (0, mp - m)) if mp != m else r for r in rows]
    clone = rows[0].device.type == "cpu"  # fresh 64-byte-aligned buffers for the CPU BLAS
    outs: list[tuple[Tensor, ...]] = []
    for i in range(0, mp, tile):
        outs.append(fn(*[p[i:i + tile].clone() if clone else p[i:i + tile] for p in padded]))
    return tuple(torch.cat(parts)[:m] for parts in zip(*outs, strict=True))


def r_matmul(a: Tensor, b_t: Tensor, tile: int) -> Tensor:
    """fp32 ``a @ b_t`` computed as one fixed-shape ``[tile, K] x [K, N]`` mm per row tile."""
    return _tiled(lambda x: (torch.mm(x.float(), b_t),), tile, a)[0]


def _r_rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """fp32 RMSNorm over the last dim (caller guarantees fixed shapes)."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


# ---------------------------------------------------------------------------------------------
# Module kernels.


@dataclass
class ModuleKernel:
    """One module's implementation on one side, with what it records for the readback."""

    module: str
    target: str  # training | rollout
    implementation: str  # production | rl_kernel
    dtype: torch.dtype
    tiling: Tiling
    eps: float
    backend: str = "torch"  # R only: torch (tiled fp32, CPU) | triton (GPU kernels)
    call_count: int = 0
    _cache: dict[tuple[int, str], Tensor] = field(default_factory=dict, repr=False)
    tp: Group = field(default_factory=Group)  # tensor-parallel group (size 1: no TP)
    tap: Any = None  # probe.Tap (probe / perturbation drill); None: neither asked for

    def _o(self, name: str, t: Tensor, shard: str | None = None, at: int | None = None) -> Tensor:
        """Hand operator ``name``'s output to the tap (``shard``: col/row under TP; ``at``: the
        first of the forward's rows ``t`` holds, for a chunk of rows)."""
        if self.tap is None:
            return t
        out: Tensor = self.tap.out(name, t, shard if self.tp.size > 1 else None, at)
        return out

    def _tiles(self, rows: int) -> AbstractContextManager[None]:
        return nullcontext() if self.tap is None else self.tap.tiled(rows)
    drift: float = 0.0  # drift_growth drill: relative perturbation of this module's output

    def _drifted(self, out: Tensor) -> Tensor:
        return out if not self.drift else out * (1.0 + self.drift)

    @property
    def partial(self) -> bool:
        """Row-parallel outputs are partial sums left to the ``comm`` kernel (tp > 1)."""
        return self.tp.size > 1

    @property
    def framework(self) -> str:
        return FRAMEWORK[self.target]

    @property
    def uses_triton(self) -> bool:
        # The Triton kernels compute whole (unsharded) outputs: under TP the torch R path, which
        # leaves fp32 partial sums to the comm kernel, runs instead (job.py also picks it for CP).
        return self.implementation == "rl_kernel" and self.backend == "triton" and not self.partial

    @property
    def backend_id(self) -> str:
        if self.implementation == "rl_kernel":
            return R_BACKEND_IDS[self.module]
        return f"{self.framework}.production.{self.module}"

    def _compiled_decode(self, x: Tensor, decoding: bool = True) -> bool:
        """P's rollout decode math runs compiled (``native.py``): vLLM on CUDA, no tap."""
        return (decoding and self.tap is None and self.framework == "vllm"
                and not self.partial and native.use_compiled(x))

    def _weight(self, key: tuple[int, str], make: Callable[[], Tensor]) -> Tensor:
        """Derived weight (fp32 transposed or fused), built once per engine."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _p_norm(self, x: Tensor, w: Tensor) -> Tensor:
        """Native RMSNorm: Megatron/TE fused fp32 epilogue vs vLLM's cast-then-scale."""
        if x.is_cuda and FAST_PATHS and self.framework == "megatron":  # fused, fp32 inside
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        if self.framework != "megatron":
            return native.rms_vllm(x, w, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * w.float()).to(x.dtype)
