"""One side's kernels (training or rollout): ``SideKernels`` holds one kernel per module, each
running its P or R implementation (``attention.py``, ``ffn.py``, ``logp.py``, ``comm.py``).

Re-exports the names the workload, the engines and the machine probe read from here
(``MODULES``, ``Tiling``, ``r_backend``...; their home is ``base.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_rlkernel_matrix.workload.kernels.attention import AttentionKernel
from pytest_rlkernel_matrix.workload.kernels.base import (
    ALL_MODULES,
    FRAMEWORK,
    MODULES,
    OPTIONAL_MODULES,
    R_BACKEND_IDS,
    R_CONTRACT_VERSION,
    ModuleKernel,
    r_backend,
    r_core_attention,
    r_matmul,
    runtime_platform,
)
from pytest_rlkernel_matrix.workload.kernels.comm import CommKernel
from pytest_rlkernel_matrix.workload.kernels.ffn import FfnKernel
from pytest_rlkernel_matrix.workload.kernels.logp import LogpKernel
from pytest_rlkernel_matrix.workload.parallel import Group
from pytest_rlkernel_matrix.workload.weights import Tiling

# re-exported: the names read from here (their home is base.py, weights.py)
__all__ = ["ALL_MODULES", "FRAMEWORK", "MODULES", "OPTIONAL_MODULES", "R_BACKEND_IDS",
           "R_CONTRACT_VERSION", "AttentionKernel", "CommKernel", "FfnKernel", "LogpKernel",
           "ModuleKernel", "SideKernels", "Tiling", "r_backend", "r_core_attention", "r_matmul",
           "runtime_platform"]


@dataclass
class SideKernels:
    """The kernels one side (training or rollout) runs, one object per module."""

    target: str
    attention: AttentionKernel
    ffn: FfnKernel
    logp: LogpKernel
    comm: CommKernel | None = None  # the TP reduction; None: no TP (a plain residual add)
    tap: Any = None  # probe.Tap (probe / perturbation drill)

    def out(self, name: str, t: Tensor) -> Tensor:
        """A replicated operator output outside the modules (the embedding) to the tap."""
        return t if self.tap is None else self.tap.out(name, t)  # type: ignore[no-any-return]

    @classmethod
    def build(cls, target: str, impls: dict[str, str], dtype: torch.dtype, tiling: Tiling,
              eps: float, backend: str = "torch", tp: Group | None = None,
              tap: Any = None) -> SideKernels:
        """``impls`` maps module -> ``production`` | ``rl_kernel`` (what really runs);
        ``backend`` is the R implementation (``r_backend(device)``); with a TP group of size > 1,
        ``impls["comm"]`` picks the reduction (required then)."""
        g = tp or Group()
        comm = None
        if g.size > 1:
            comm = CommKernel("comm", target, impls["comm"], dtype, tiling, eps, tp=g)
        return cls(target,
                   AttentionKernel("attention", target, impls["attention"], dtype, tiling, eps,
                                   backend, tp=g, tap=tap),
                   FfnKernel("ffn", target, impls["ffn"], dtype, tiling, eps, backend, tp=g,
                             tap=tap),
                   LogpKernel("logp", target, impls["logp"], dtype, tiling, eps, backend, tp=g,
                              tap=tap),
                   comm, tap)

    def module(self, name: str) -> ModuleKernel:
        found = {"attention": self.attention, "ffn": self.ffn, "logp": self.logp,
                 "comm": self.comm}[name]
        if found is None:
            raise KeyError(f"module {name!r} is not built (no tensor parallelism)")
        return found

    def clear_cache(self) -> None:
        """Forget derived weights (new weights after an optimizer step or a weight sync)."""
        for k in (self.attention, self.ffn, self.logp, self.comm):
            if k is not None:
                k._cache.clear()

    def reduce_add(self, x: Tensor, out: Tensor) -> Tensor:
        """``x + out``; with TP, ``out`` is a partial sum the comm kernel reduces first."""
        return x + out if self.comm is None else self.comm.reduce_add(x, out)

    @property
    def framework(self) -> str:
        return FRAMEWORK[self.target]
