"""The FFN module, both sides in one place: P (fused gate/up in the model dtype, the
framework's SwiGLU) and R (fixed row tiles in fp32, or the Triton kernels on a GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_rlkernel_matrix.workload.kernels.base import (
    ModuleKernel,
    _r_rms,
    _tiled,
    _tk,
)
from pytest_rlkernel_matrix.workload.kernels.p import native
from pytest_rlkernel_matrix.workload.weights import LayerWeights


class FfnKernel(ModuleKernel):
    """FFN block: post-attention norm, fused gate/up, SwiGLU, down projection."""

    def __call__(self, x: Tensor, lw: LayerWeights) -> Tensor:
        return self._drifted(self._ffn(x, lw))

    def _ffn(self, x: Tensor, lw: LayerWeights) -> Tensor:
        self.call_count += 1
        b, t, h = x.shape
        inter = lw.gate_proj.shape[0]
        n, o_ = f"model.layers.{lw.index}.", self._o
        if self.uses_triton:
            tk = _tk()
            wgu = self._weight((lw.index, "gu"), lambda: torch.cat(
                [lw.gate_proj, lw.up_proj]).contiguous())
            xn = o_(n + "post_attention_layernorm",
                    tk.rmsnorm(x.reshape(b * t, h), lw.post_norm, self.eps, self.dtype))
            gu = tk.matmul(xn, wgu, torch.float32)
            if self.tap is not None:
                gu = torch.cat([o_(n + "mlp.gate_proj", gu[:, :inter]),
                                o_(n + "mlp.up_proj", gu[:, inter:])], dim=-1)
            act = o_(n + "mlp.act_fn", tk.swiglu(gu, self.dtype))
            return o_(n + "mlp.down_proj",
                      tk.matmul(act, lw.down_proj, self.dtype)).reshape(b, t, h)
        if self.implementation == "rl_kernel":
            wgu = self._weight((lw.index, "gu"), lambda: torch.cat(
                [lw.gate_proj, lw.up_proj]).float().t().contiguous())
            wd = self._weight((lw.index, "d"), lambda: lw.down_proj.float().t().contiguous())
            wn = lw.post_norm.float()

            def mlp(xt: Tensor) -> tuple[Tensor]:
                xn = o_(n + "post_attention_layernorm", _r_rms(xt.float(), wn, self.eps))
                gu = torch.mm(xn, wgu)
                gate = o_(n + "mlp.gate_proj", gu[:, :inter], "col")
                up = o_(n + "mlp.up_proj", gu[:, inter:], "col")
                act = o_(n + "mlp.act_fn", gate * torch.sigmoid(gate) * up, "col")
                down = torch.mm(act, wd)
                return (o_(n + "mlp.down_proj", down if self.partial else down.to(self.dtype),
                           "row"),)

            with self._tiles(b * t):
                out = _tiled(mlp, self.tiling.row_tile, x.reshape(b * t, h))[0]
            return out.reshape(b, t, h)
        wgu = self._weight((lw.index, "gu"), lambda: torch.cat([lw.gate_proj, lw.up_proj]))
        if self._compiled_decode(x, t == 1):
            return native.compiled(native.decode_ffn)(x, lw.post_norm, wgu, lw.down_proj,
                                                      self.eps, inter)
        gu = F.linear(o_(n + "post_attention_layernorm", self._p_norm(x, lw.post_norm)), wgu)
        gate = o_(n + "mlp.gate_proj", gu[..., :inter], "col")
        up = o_(n + "mlp.up_proj", gu[..., inter:], "col")
        if self.framework == "megatron":  # fused bias-SwiGLU: fp32 inside
            act = (F.silu(gate.float()) * up.float()).to(x.dtype)
        else:  # vLLM SiluAndMul native: model dtype
            act = F.silu(gate) * up
        act = o_(n + "mlp.act_fn", act, "col")
        return o_(n + "mlp.down_proj", F.linear(act, lw.down_proj), "row")
