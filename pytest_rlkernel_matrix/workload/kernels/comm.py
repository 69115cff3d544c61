"""The optional ``comm`` module (tp >= 2): the row-parallel reduction and residual add, P
(each framework's own collective) and R (all-gather, then a sum in rank order)."""

from __future__ import annotations

from torch import Tensor

from pytest_rlkernel_matrix.workload.kernels.base import ModuleKernel
from pytest_rlkernel_matrix.workload.parallel import fixed_order_sum


class CommKernel(ModuleKernel):
    """The row-parallel activation reduction plus the residual add (tp > 1).

    R: all-gather the fp32 partials, sum them in rank order, cast, add the residual (the same
    bits on both sides and in every call). P is what each framework naturally does: Megatron
    all-reduces the model-dtype partials with the backend's collective then adds the residual
    (two roundings); vLLM's fused all-reduce + residual add accumulates in fp32 and rounds once.
    """

    def reduce_add(self, x: Tensor, partial: Tensor) -> Tensor:
        self.call_count += 1
        if not self.partial:
            return x + partial.to(x.dtype)
        if self.implementation == "rl_kernel":
            return x + fixed_order_sum(self.tp.gather(partial.float())).to(self.dtype)
        if self.framework == "megatron":
            return x + self.tp.all_reduce(partial.to(self.dtype).contiguous(), "sum")
        summed = self.tp.all_reduce(partial.to(self.dtype).float(), "sum")
        return (x.float() + summed).to(self.dtype)
