"""The logp module, both sides in one place: P (the framework's log-softmax; Megatron's
chunked training logp, ``p/p_logp.py``) and R (fixed row tiles in fp32, or the Triton kernels),
vocab-parallel under TP."""

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
from pytest_rlkernel_matrix.workload.kernels.p import native, p_logp
from pytest_rlkernel_matrix.workload.parallel import fixed_order_sum


class LogpKernel(ModuleKernel):
    """Final norm, LM head, temperature, log-softmax and selected-token gather."""

    def _r_tiles(self, h: Tensor, norm_w: Tensor, lm_head: Tensor, targets: Tensor | None,
                 temperature: float) -> Tensor:
        wl = self._weight((-1, "lm_head"), lambda: lm_head.float().t().contiguous())
        wn = norm_w.float()

        o_ = self._o

        def tile(ht: Tensor, tt: Tensor) -> tuple[Tensor]:
            z = o_("lm_head", torch.mm(o_("model.norm", _r_rms(ht.float(), wn, self.eps)), wl))
            logits = z / temperature
            m = logits.amax(-1, keepdim=True)
            lp = logits - (m + torch.log(torch.exp(logits - m).sum(-1, keepdim=True)))
            lp = o_("log_softmax", lp)
            return (lp if targets is None else lp.gather(-1, tt[:, None])[:, 0],)

        tt = targets if targets is not None else torch.zeros(
            h.shape[0], dtype=torch.long, device=h.device)
        with self._tiles(h.shape[0]):
            return _tiled(tile, self.tiling.row_tile, h, tt)[0]

    def _r_triton(self, h: Tensor, norm_w: Tensor, lm_head: Tensor, targets: Tensor | None,
                  temperature: float) -> Tensor:
        """Chunked over rows; per row: fp32 logits, fixed-order log-sum-exp, ``z - lse``."""
        tk, o_ = _tk(), self._o
        hn = o_("model.norm", tk.rmsnorm(h, norm_w, self.eps, self.dtype))
        tap = None if self.tap is None else lambda s, z: o_("lm_head", z, at=s)
        outs = []
        for s, z in tk.logits_chunks(hn, lm_head, temperature, tap):
            if targets is not None and tap is None:  # gather(z) - lse, one fused backward
                outs.append(tk.selected_logp(z, targets[s:s + z.shape[0]]))
            elif targets is None:
                outs.append(o_("log_softmax", z.sub_(tk.logsumexp(z)[:, None]), at=s))
            else:  # probed: the full row (the same z - lse bits), then gathered
                lp = o_("log_softmax", z - tk.logsumexp(z)[:, None], at=s)
                outs.append(lp.gather(-1, targets[s:s + z.shape[0], None])[:, 0])
        if len(outs) == 1:
            return outs[0]
        return torch.cat(outs) if outs else h.new_empty((0,), dtype=torch.float32)

    def full(self, h: Tensor, norm_w: Tensor, lm_head: Tensor, temperature: float) -> Tensor:
        """fp32 log-probabilities ``[N, V]`` (rollout sampling path)."""
        return self._drifted(self._full(h, norm_w, lm_head, temperature))

    def _full(self, h: Tensor, norm_w: Tensor, lm_head: Tensor, temperature: float) -> Tensor:
        self.call_count += 1
        if self.partial:
            return self._tp_full(h, norm_w, lm_head, temperature)
        if self.uses_triton:
            return self._r_triton(h, norm_w, lm_head, None, temperature)
        if self.implementation == "rl_kernel":
            return self._r_tiles(h, norm_w, lm_head, None, temperature)
        if self._compiled_decode(h):
            return native.compiled(native.decode_logp)(h, norm_w, lm_head, self.eps, temperature)
        return self._o("log_softmax", self._p_full(h, norm_w, lm_head, temperature))

    def _p_full(self, h: Tensor, norm_w: Tensor, lm_head: Tensor, temperature: float) -> Tensor:
        logits = self._o("lm_head", F.linear(self._o("model.norm", self._p_norm(h, norm_w)),
                                             lm_head))
        if self.framework == "megatron":
            return native.megatron_log_softmax(logits, temperature)
        return torch.log_softmax(logits.float() / temperature, dim=-1)

    def selected(self, h: Tensor, norm_w: Tensor, lm_head: Tensor, targets: Tensor,
                 temperature: float) -> Tensor:
        """fp32 log-probability of ``targets`` (training recompute path)."""
        return self._drifted(self._selected(h, norm_w, lm_head, targets, temperature))

    def _selected(self, h: Tensor, norm_w: Tensor, lm_head: Tensor, targets: Tensor,
                  temperature: float) -> Tensor:
        self.call_count += 1
        if self.partial:
            return self._tp_selected(h, norm_w, lm_head, targets, temperature)
        if self.uses_triton:
            return self._r_triton(h, norm_w, lm_head, targets, temperature)
        if self.implementation == "rl_kernel":
            return self._r_tiles(h, norm_w, lm_head, targets, temperature)
        if self.framework == "megatron" and self.tap is None:  # chunked over tokens (p_logp.py)
            return p_logp.selected(self._p_norm(h, norm_w), lm_head, targets, temperature)
        lp = self._o("log_softmax", self._p_full(h, norm_w, lm_head, temperature))
        return lp.gather(-1, targets[:, None])[:, 0]

    # -- vocab-parallel (tp > 1): ``lm_head`` is this rank's ``[V / tp, H]`` slice -------------

    def _r_tp_local(self, h: Tensor, norm_w: Tensor, lm_head: Tensor,
                    temperature: float) -> Tensor:
        """R: this rank's fp32 log-probabilities ``[N, V / tp]``. Fixed-shape tiles for every
        non-correctly-rounded op (mm, exp, log); the global max is exact, the global sum of
        exponentials is an all-gather then a sum in rank order."""
        wl = self._weight((-1, "lm_head"), lambda: lm_head.float().t().contiguous())
        wn = norm_w.float()
        tile = self.tiling.row_tile

        o_ = self._o

        def stage1(ht: Tensor) -> tuple[Tensor, Tensor]:
            z = o_("lm_head", torch.mm(o_("model.norm", _r_rms(ht.float(), wn, self.eps)), wl),
                   "col")
            logits = z / temperature
            return logits, logits.amax(-1, keepdim=True)

        with self._tiles(h.shape[0]):
            logits, m_local = _tiled(stage1, tile, h)
        m = torch.stack(self.tp.gather(m_local)).amax(0)
        s_local = _tiled(lambda lt, mt: (torch.exp(lt - mt).sum(-1, keepdim=True),),
                         tile, logits, m)[0]
        s = fixed_order_sum(self.tp.gather(s_local))
        return o_("log_softmax", _tiled(lambda lt, mt, st: (lt - (mt + torch.log(st)),), tile,
                                        logits, m, s)[0], "col")

    def _p_tp_local(self, h: Tensor, norm_w: Tensor, lm_head: Tensor,
                    temperature: float) -> Tensor:
        """P, Megatron's vocab-parallel cross entropy: all-reduce MAX, then all-reduce SUM."""
        z = self._o("lm_head", F.linear(self._o("model.norm", self._p_norm(h, norm_w)),
                                        lm_head), "col")
        lf = z.div(temperature).float()
        m = self.tp.all_reduce(lf.amax(-1, keepdim=True), "max")
        shifted = lf - m
        s = self.tp.all_reduce(shifted.exp().sum(-1, keepdim=True), "sum")
        return self._o("log_softmax", shifted - torch.log(s), "col")

    def _tp_full(self, h: Tensor, norm_w: Tensor, lm_head: Tensor,
                 temperature: float) -> Tensor:
        if self.implementation == "rl_kernel":
            return torch.cat(self.tp.gather(
                self._r_tp_local(h, norm_w, lm_head, temperature)), dim=-1)
        if self.framework == "megatron":
            return torch.cat(self.tp.gather(
                self._p_tp_local(h, norm_w, lm_head, temperature)), dim=-1)
        # vLLM: gather the logits shards, then one log_softmax over the whole vocabulary.
        z = self._o("lm_head", F.linear(self._o("model.norm", self._p_norm(h, norm_w)), lm_head),
                    "col")
        logits = torch.cat(self.tp.gather(z), dim=-1)
        return self._o("log_softmax", torch.log_softmax(logits.float() / temperature, dim=-1))

    def _tp_selected(self, h: Tensor, norm_w: Tensor, lm_head: Tensor, targets: Tensor,
                     temperature: float) -> Tensor:
        if self.implementation != "rl_kernel" and self.framework != "megatron":
            return self._tp_full(h, norm_w, lm_head, temperature).gather(
                -1, targets[:, None])[:, 0]
        local = (self._r_tp_local if self.implementation == "rl_kernel" else self._p_tp_local)(
            h, norm_w, lm_head, temperature)
        width = local.shape[-1]
        owner = targets // width
        mine = local.gather(-1, (targets - self.tp.rank * width).clamp(0, width - 1)[:, None])
        if self.implementation == "rl_kernel":  # the owner's value, copied (no arithmetic)
            return torch.stack(self.tp.gather(mine[:, 0])).gather(0, owner[None])[0]
        # Megatron: predicted logit masked to zero off-owner, then all-reduce SUM.
        return self.tp.all_reduce(torch.where(owner == self.tp.rank, mine[:, 0], 0.0), "sum")
