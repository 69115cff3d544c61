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

from pytest_rlkernel_matrix.workload.kernels.p import native, p_logp
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
from pytest_rlkernel_matrix.workload.parallel import Group, fixed_order_sum
from pytest_rlkernel_matrix.workload.weights import AttnInputs, LayerWeights
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
