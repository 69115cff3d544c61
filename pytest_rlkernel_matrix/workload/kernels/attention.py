"""The attention module, both sides in one place: P (``_p``, ``_p_decode``: the framework's
own SDPA / flash / Triton decode) and R (``_r``: fixed-shape fp32 torch; ``_r_triton``: the
batch-invariant Triton kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_rlkernel_matrix.workload.kernels.base import (
    ModuleKernel,
    _r_rms,
    _tiled,
    _tk,
    r_matmul,
)
from pytest_rlkernel_matrix.workload.kernels.p import native
from pytest_rlkernel_matrix.workload.kernels.p.native import FAST_PATHS
from pytest_rlkernel_matrix.workload.kernels.r.r_attention import r_core_attention
from pytest_rlkernel_matrix.workload.weights import (
    AttnInputs,
    LayerWeights,
)


class AttentionKernel(ModuleKernel):
    """Attention block: norm, fused QKV, q/k norm, RoPE, core attention, output projection."""

    def __call__(self, x: Tensor, lw: LayerWeights, inp: AttnInputs) -> Tensor:
        self.call_count += 1
        if self.uses_triton:
            return self._drifted(self._r_triton(x, lw, inp))
        if self.implementation == "rl_kernel":
            return self._drifted(self._r(x, lw, inp))
        return self._drifted(self._p(x, lw, inp))

    @staticmethod
    def _write_cache(inp: AttnInputs, k: Tensor, v: Tensor) -> None:
        assert inp.cache is not None
        b, t = inp.positions.shape
        bidx = torch.arange(b, device=k.device)[:, None].expand(b, t)
        inp.cache.k[bidx, inp.positions] = k
        inp.cache.v[bidx, inp.positions] = v

    def _r(self, x: Tensor, lw: LayerWeights, inp: AttnInputs) -> Tensor:
        b, t, h = x.shape
        d = lw.q_norm.shape[0]
        hq, hkv = lw.q_proj.shape[0] // d, lw.k_proj.shape[0] // d
        wqkv = self._weight((lw.index, "qkv"), lambda: torch.cat(
            [lw.q_proj, lw.k_proj, lw.v_proj]).float().t().contiguous())
        wo = self._weight((lw.index, "o"), lambda: lw.o_proj.float().t().contiguous())
        win, wqn, wkn = lw.input_norm.float(), lw.q_norm.float(), lw.k_norm.float()

        n = f"model.layers.{lw.index}."
        o_ = self._o

        def pre(xt: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            xn = o_(n + "input_layernorm", _r_rms(xt.float(), win, self.eps))
            qkv = torch.mm(xn, wqkv)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k = o_(n + "self_attn.q_proj", q, "col"), o_(n + "self_attn.k_proj", k, "col")
            v = o_(n + "self_attn.v_proj", v, "col")
            q = o_(n + "self_attn.q_norm", _r_rms(q.reshape(-1, hq, d), wqn, self.eps), "col")
            k = o_(n + "self_attn.k_norm", _r_rms(k.reshape(-1, hkv, d), wkn, self.eps), "col")
            q = q * cos[:, None] + native.rotate_half(q) * sin[:, None]
            k = k * cos[:, None] + native.rotate_half(k) * sin[:, None]
            return q, k.to(self.dtype), v.reshape(-1, hkv, d).to(self.dtype)

        with self._tiles(b * t):
            q, k, v = _tiled(pre, self.tiling.row_tile, x.reshape(b * t, h),
                             inp.cos.reshape(b * t, d), inp.sin.reshape(b * t, d))
        q, k, v = q.reshape(b, t, hq, d), k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d)
        if inp.cache is not None:
            self._write_cache(inp, k, v)
            k, v = inp.cache.k, inp.cache.v
        if inp.kv_gather is not None:  # context parallel: keys/values of every CP rank
            k, v = inp.kv_gather(k, v)
        o = o_(n + "self_attn.attn", r_core_attention(q, inp.positions, k, v, self.tiling), "col")
        out = r_matmul(o.reshape(b * t, hq * d), wo, self.tiling.row_tile)
        out = out if self.partial else out.to(self.dtype)
        return o_(n + "self_attn.o_proj", out, "row").reshape(b, t, h)

    def _r_triton(self, x: Tensor, lw: LayerWeights, inp: AttnInputs) -> Tensor:
        tk = _tk()
        b, t, h = x.shape
        d = lw.q_norm.shape[0]
        hq, hkv = lw.q_proj.shape[0] // d, lw.k_proj.shape[0] // d
        wqkv = self._weight((lw.index, "qkv"), lambda: torch.cat(
            [lw.q_proj, lw.k_proj, lw.v_proj]).contiguous())
        n, o_ = f"model.layers.{lw.index}.", self._o
        xn = o_(n + "input_layernorm",
                tk.rmsnorm(x.reshape(b * t, h), lw.input_norm, self.eps, self.dtype))
        qkv = tk.matmul(xn, wqkv, torch.float32)
        cos, sin = inp.cos.reshape(b * t, d), inp.sin.reshape(b * t, d)
        if self.tap is None:
            q, k, v = tk.qk_norm_rope(qkv, cos, sin, lw.q_norm, lw.k_norm, hq, hkv, self.eps,
                                      self.dtype)
        else:
            q_, k_, v_ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            qkv = torch.cat([o_(n + "self_attn.q_proj", q_), o_(n + "self_attn.k_proj", k_),
                             o_(n + "self_attn.v_proj", v_)], dim=-1)
            # q/k norm are fused with RoPE: the kernel also stores the fp32 norm outputs (and
            # applies a drill on them itself); the tap records them as the torch R path does.
            scale = (self.tap.perturbs(n + "self_attn.q_norm"),
                     self.tap.perturbs(n + "self_attn.k_norm"))
            rec = bool(self.tap.recording)
            q, k, v, *norms = tk.qk_norm_rope(qkv, cos, sin, lw.q_norm, lw.k_norm, hq, hkv,
                                              self.eps, self.dtype, store_norm=rec, scale=scale)
            if rec:
                self.tap.out(n + "self_attn.q_norm", norms[0])
                self.tap.out(n + "self_attn.k_norm", norms[1])
        q, k, v = q.reshape(b, t, hq, d), k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d)
        if inp.cache is not None:
            self._write_cache(inp, k, v)
            k, v = inp.cache.k, inp.cache.v
        o = o_(n + "self_attn.attn", tk.attention(q, k, v, inp.positions))
        out = tk.matmul(o.reshape(b * t, hq * d), lw.o_proj, self.dtype)
        return o_(n + "self_attn.o_proj", out).reshape(b, t, h)

    def _p(self, x: Tensor, lw: LayerWeights, inp: AttnInputs) -> Tensor:
        b, t, _ = x.shape
        d = lw.q_norm.shape[0]
        hq, hkv = lw.q_proj.shape[0] // d, lw.k_proj.shape[0] // d
        wqkv = self._weight((lw.index, "qkv"), lambda: torch.cat([lw.q_proj, lw.k_proj, lw.v_proj]))
        n, o_ = f"model.layers.{lw.index}.", self._o
        if self._compiled_decode(x, t == 1 and inp.cache is not None and inp.kv_gather is None):
            q, k, v = native.compiled(native.decode_attn_pre, (0, 5, 6))(
                x, lw.input_norm, wqkv, lw.q_norm, lw.k_norm, inp.cos, inp.sin, self.eps, hq, hkv,
                d)
            self._write_cache(inp, k, v)
            return self._p_decode(q, inp, lw, b, hq, hkv, d)
        qkv = F.linear(o_(n + "input_layernorm", self._p_norm(x, lw.input_norm)), wqkv)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k = o_(n + "self_attn.q_proj", q, "col"), o_(n + "self_attn.k_proj", k, "col")
        v = o_(n + "self_attn.v_proj", v, "col")
        q = o_(n + "self_attn.q_norm", self._p_norm(q.reshape(b, t, hq, d), lw.q_norm), "col")
        k = o_(n + "self_attn.k_norm", self._p_norm(k.reshape(b, t, hkv, d), lw.k_norm), "col")
        v = v.reshape(b, t, hkv, d)
        rope = native.rope_megatron if self.framework == "megatron" else native.rope_vllm
        q, k = rope(q, inp.cos, inp.sin), rope(k, inp.cos, inp.sin)
        g = hq // hkv
        if inp.cache is not None:
            self._write_cache(inp, k, v)
        if inp.kv_gather is not None:  # context parallel: local queries, every rank's keys
            kf, vf = inp.kv_gather(k, v)
            s = kf.shape[1]
            mask = torch.arange(s, device=x.device)[None, None, :] <= inp.positions[:, :, None]
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), kf.transpose(1, 2).repeat_interleave(g, 1),
                vf.transpose(1, 2).repeat_interleave(g, 1), attn_mask=mask[:, None])
        elif (inp.cache is None or t > 1) and x.is_cuda and FAST_PATHS:  # flash/cuDNN GQA
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True, enable_gqa=True)
        elif inp.cache is None or t > 1:  # training full sequence / rollout prefill: causal
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1),
                v.transpose(1, 2).repeat_interleave(g, 1), is_causal=True)
        else:  # rollout decode
            return self._p_decode(q, inp, lw, b, hq, hkv, d)
        o = o_(n + "self_attn.attn", o.transpose(1, 2).reshape(b, t, hq * d), "col")
        return o_(n + "self_attn.o_proj", F.linear(o, lw.o_proj), "row")

    def _p_decode(self, q: Tensor, inp: AttnInputs, lw: LayerWeights, b: int, hq: int, hkv: int,
                  d: int) -> Tensor:
        """Decode attention (CUDA: ``native.decode_attention``, Triton grouped or flash varlen;
        else masked SDPA over the cache read in place up to ``inp.span``), then ``o_proj``."""
        assert inp.cache is not None
        n, span = f"model.layers.{lw.index}.", inp.span
        if route := (native.decode_route(q) if FAST_PATHS and self.tap is None else ""):
            o = native.decode_attention(route, q.reshape(b, hq, d), inp.cache, inp.positions)
        else:  # [B, Hkv, span, D] views of the cache, query heads grouped per KV head
            kc, vc = inp.cache.k[:, :span].transpose(1, 2), inp.cache.v[:, :span].transpose(1, 2)
            mask = torch.arange(span, device=q.device)[None, :] <= inp.positions
            o = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), kc, vc,
                                               attn_mask=mask[:, None, None, :])
        o = self._o(n + "self_attn.attn", o.reshape(b, 1, hq * d), "col")
        return self._o(n + "self_attn.o_proj", F.linear(o, lw.o_proj), "row")
