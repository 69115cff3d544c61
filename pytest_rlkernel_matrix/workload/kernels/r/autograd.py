"""Backward for the Triton R forward: fast forward, deterministic Triton backward kernels.

The Triton R kernels (``triton_kernels.py``) are wrapped here in one generic
``torch.autograd.Function`` (``Op``): the forward runs the fast kernel and returns its output
unchanged (so the training forward that feeds the loss gives the very bits of the no-grad
Triton forward, and no second forward is needed). The backward is chosen by
``RLK_REF_R_BACKWARD`` (``env.backward_mode``):

- ``triton`` (the default): each op's vector-Jacobian product is a deterministic Triton kernel
  (``triton_backward.py``: fixed reduction order, no atomics, per-row gradients batch-invariant
  as the forward is; the matmul's backward is the forward's persistent matmul), from the op's
  saved inputs (attention: and its output). The probe switches of ``qk_norm_rope``
  (``store_norm``, a drill's ``scale``) fall back to the recompute below.
- ``recompute`` (the method before): the backward recomputes that one op as a native torch
  expression (its *reference*, below) under autograd and hands back ``torch.autograd.grad`` of it.
- ``tiled``: see the end of this docstring.

Only the op's inputs (attention: and its output) are saved, not its intermediates.

In ``recompute`` mode the matmul needs no recompute: its backward is the two products
``grad @ W`` and ``grad^T @ x`` in the operands' dtype (cuBLAS, as autograd of ``F.linear``).
Attention is recomputed as the plain fp32 math expression (``q k^T``, causal mask from the
positions, softmax, ``@ v``: the math SDPA backend's composition), never a fused SDPA backend:
torch's ``scaled_dot_product_attention`` note says cuDNN's may pick a nondeterministic
algorithm, and FlashAttention-2's backward adds up dQ over key blocks with atomics (the Triton
backward here does not: one program per query block owns its dQ); what torch 2.x does
about that per backend under deterministic mode is not something this module relies on.
GQA's key/value sharing is a broadcast, whose gradient is a plain sum (no ``repeat_interleave``,
whose CUDA backward is an index-add).

Every op of that backward is then an ordinary torch kernel with a fixed reduction order, run by
the autograd engine in its fixed order, under ``torch.use_deterministic_algorithms``
(``rl.deterministic``): the gradients are the same bits run to run. Either way they are not the
bits of any other path: close to P's and to torch autograd of the reference expressions, as any
two correct backwards are (``tests/workload/test_triton_backward.py`` states the tolerances).

``RLK_REF_R_BACKWARD=tiled`` keeps the earlier method (the loss forward and backward on the
tiled torch R path, the reported logprobs from a separate no-grad Triton forward), for
comparisons (``benchmarks/step_compare.py``, config ``R-tiledbwd``).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_rlkernel_matrix.workload.kernels.p.native import rotate_half as _rotate_half

BACKWARD_METHODS = {  # the manifest's learning.backward_kernels, per env.backward_mode()
    "triton": "Triton forward; deterministic Triton backward kernels (workload/triton_backward.py: "
              "fixed reduction order, no atomics)",
    "recompute": "Triton forward; per-op native torch recompute backward (workload/autograd.py)",
    "tiled": "torch R path (tiled fp32 forward and its autograd backward; the reported logprobs "
             "from a separate no-grad Triton forward)",
}


# ---------------------------------------------------------------------------------------------
# The generic Function.


@dataclass(frozen=True)
class Op:
    """One op: ``fast`` (any implementation, run without autograd) and ``ref`` (the same math
    as differentiable torch ops), or ``vjp`` (an explicit backward: ``vjp(grads, *args)`` ->
    one gradient or None per argument, or None as a whole: recompute ``ref`` instead) where
    recomputing the forward is not needed. ``with_out``: ``vjp(grads, outs, *args)``, the
    forward's outputs saved too.

    Called with no tensor argument requiring grad (or under no_grad / inference_mode), it is
    just ``fast``."""

    name: str
    fast: Callable[..., Any]
    ref: Callable[..., Any] | None = None
    vjp: Callable[..., tuple[Tensor | None, ...] | None] | None = None
    with_out: bool = False

    def __call__(self, *args: Any, **kw: Any) -> Any:
        if not torch.is_grad_enabled() or not any(
                isinstance(a, Tensor) and a.requires_grad for a in args):
            return self.fast(*args, **kw)
        return _Recompute.apply(self, kw, *args)


class _Recompute(torch.autograd.Function):
    """``forward``: ``op.fast`` on detached inputs. ``backward``: ``op.vjp``, or autograd of
    ``op.ref`` recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx: Any, op: Op, kw: dict, *args: Any) -> Any:
        ctx.set_materialize_grads(False)
        ctx.op, ctx.kw = op, kw
        ctx.is_tensor = [isinstance(a, Tensor) for a in args]
        ctx.others = [None if t else a for t, a in zip(ctx.is_tensor, args, strict=True)]
        out = op.fast(*[a.detach() if isinstance(a, Tensor) else a for a in args], **kw)
        saved = [a for a in args if isinstance(a, Tensor)]
        ctx.n_out = 0
        if op.with_out:
            outs = out if isinstance(out, tuple) else (out,)
            ctx.n_out = len(outs)
            saved += list(outs)
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        tensors = ctx.saved_tensors
        outs = tensors[len(tensors) - ctx.n_out:]
        saved = iter(tensors[:len(tensors) - ctx.n_out])
        args = [next(saved) if t else o for t, o in zip(ctx.is_tensor, ctx.others, strict=True)]
        need = [i for i, t in enumerate(ctx.is_tensor) if t and ctx.needs_input_grad[i + 2]]
        out: list[Tensor | None] = [None] * len(args)
        if not need or all(g is None for g in grads):
            return (None, None, *out)
        op: Op = ctx.op
        if op.vjp is not None:
            got = (op.vjp(grads, outs, *args, **ctx.kw) if op.with_out else
                   op.vjp(grads, *args, **ctx.kw))
            if got is not None and all(got[i] is not None for i in need):
                for i in need:
                    out[i] = got[i]
                return (None, None, *out)
        assert op.ref is not None, f"{op.name}: no reference expression and no vjp"
        with torch.enable_grad():
            inputs = [a.detach().requires_grad_(i in need) if ctx.is_tensor[i] else a
                      for i, a in enumerate(args)]
            res = op.ref(*inputs, **ctx.kw)
            res = res if isinstance(res, tuple) else (res,)
            pairs = [(r, g) for r, g in zip(res, grads, strict=True) if g is not None]
            got = torch.autograd.grad([r for r, _ in pairs], [inputs[i] for i in need],
                                      [g for _, g in pairs], allow_unused=True)
        for i, g in zip(need, got, strict=True):
            out[i] = g
        return (None, None, *out)


# ---------------------------------------------------------------------------------------------
# Reference expressions (the signatures of ``triton_kernels``' functions).


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """fp32 RMSNorm over the last dim times ``w``."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.float()


def ref_rmsnorm(x: Tensor, w: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    return _rms(x, w, eps).to(out_dtype)


def ref_matmul(a: Tensor, w: Tensor, out_dtype: torch.dtype) -> Tensor:
    return F.linear(a, w).to(out_dtype)


def vjp_matmul(grads: tuple[Tensor | None, ...], a: Tensor, w: Tensor,
               out_dtype: torch.dtype) -> tuple[Tensor | None, ...]:
    """``ref_matmul``'s backward without its forward: ``grad @ W`` and ``grad^T @ a`` in the
    operands' dtype (the gradient is first cast to it, as autograd of ``F.linear(...).to()``)."""
    g = grads[0]
    assert g is not None
    g = g.to(a.dtype)
    return g.mm(w), g.t().mm(a), None


def ref_qk_norm_rope(qkv: Tensor, cos: Tensor, sin: Tensor, q_norm: Tensor, k_norm: Tensor,
                     hq: int, hkv: int, eps: float, out_dtype: torch.dtype, *,
                     store_norm: bool = False,
                     scale: tuple[float, float] = (1.0, 1.0)) -> tuple[Tensor, ...]:
    m, d = qkv.shape[0], q_norm.shape[0]
    x = qkv.float().reshape(m, hq + 2 * hkv, d)
    qn, kn = _rms(x[:, :hq], q_norm, eps), _rms(x[:, hq:hq + hkv], k_norm, eps)
    c, s = cos.float()[:, None], sin.float()[:, None]
    q, k = qn * scale[0], kn * scale[1]
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    out = (q.to(out_dtype), k.to(out_dtype), x[:, hq + hkv:].to(out_dtype))
    return (*out, qn, kn) if store_norm else out


def ref_swiglu(gu: Tensor, out_dtype: torch.dtype) -> Tensor:
    inter = gu.shape[1] // 2
    g = gu[:, :inter].float()
    return (F.silu(g) * gu[:, inter:].float()).to(out_dtype)


def ref_attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    """fp32 math attention: query ``(b, t)`` sees keys ``0..positions[b, t]``; GQA as a
    broadcast of each KV head over its ``g`` query heads."""
    b, t, hq, d = q.shape
    span, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qf = q.float().reshape(b, t, hkv, g, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kf = k.float().permute(0, 2, 1, 3)[:, :, None]  # [B, Hkv, 1, S, D]
    vf = v.float().permute(0, 2, 1, 3)[:, :, None]
    s = torch.matmul(qf, kf.transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [B, Hkv, G, T, S]
    hidden = torch.arange(span, device=q.device)[None, None, :] > positions[:, :, None]
    s = s.masked_fill(hidden[:, None, None], float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), vf)  # [B, Hkv, G, T, D]
    return o.permute(0, 3, 1, 2, 4).reshape(b, t, hq * d).to(q.dtype)


def ref_logsumexp(z: Tensor) -> Tensor:
    return torch.logsumexp(z, dim=-1)


# ---------------------------------------------------------------------------------------------
# The wrapped kernel set.


def ref_selected_logp(z: Tensor, targets: Tensor) -> Tensor:
    return z.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(z, dim=-1)


# ---------------------------------------------------------------------------------------------
# The Triton backward kernels as vector-Jacobian products (``triton_backward.py``).


def _tb() -> ModuleType:
    from pytest_rlkernel_matrix.workload.kernels.r import triton_backward

    return triton_backward


def tvjp_matmul(grads: tuple[Tensor | None, ...], a: Tensor, w: Tensor,
                out_dtype: torch.dtype) -> tuple[Tensor | None, ...]:
    assert grads[0] is not None
    return (*_tb().matmul_bwd(grads[0], a, w, a.requires_grad, w.requires_grad), None)


def tvjp_rmsnorm(grads: tuple[Tensor | None, ...], x: Tensor, w: Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[Tensor | None, ...]:
    assert grads[0] is not None
    return (*_tb().rmsnorm_bwd(grads[0], x, w, eps), None, None)


def tvjp_qk_norm_rope(grads: tuple[Tensor | None, ...], qkv: Tensor, cos: Tensor, sin: Tensor,
                      q_norm: Tensor, k_norm: Tensor, hq: int, hkv: int, eps: float,
                      out_dtype: torch.dtype, *, store_norm: bool = False,
                      scale: tuple[float, float] = (1.0, 1.0)) -> tuple[Tensor | None, ...] | None:
    if store_norm or tuple(scale) != (1.0, 1.0):
        return None  # the probe's switches: the reference recompute
    dqkv, dqn, dkn = _tb().qk_norm_rope_bwd(grads[0], grads[1], grads[2], qkv, cos, sin, q_norm,
                                            k_norm, hq, hkv, eps)
    return dqkv, None, None, dqn, dkn, None, None, None, None


def tvjp_swiglu(grads: tuple[Tensor | None, ...], gu: Tensor,
                out_dtype: torch.dtype) -> tuple[Tensor | None, ...]:
    assert grads[0] is not None
    return _tb().swiglu_bwd(grads[0], gu), None


def tvjp_attention(grads: tuple[Tensor | None, ...], outs: tuple[Tensor, ...], q: Tensor,
                   k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor | None, ...]:
    assert grads[0] is not None
    return (*_tb().attention_bwd(grads[0], q, k, v, outs[0], positions), None)


def tvjp_logsumexp(grads: tuple[Tensor | None, ...], z: Tensor) -> tuple[Tensor | None, ...]:
    assert grads[0] is not None
    return (_tb().logsumexp_bwd(grads[0], z),)


def tvjp_selected_logp(grads: tuple[Tensor | None, ...], z: Tensor,
                       targets: Tensor) -> tuple[Tensor | None, ...]:
    assert grads[0] is not None
    return _tb().logsumexp_bwd(grads[0], z, targets), None


# ---------------------------------------------------------------------------------------------
# The wrapped kernel set.


class Ops:
    """``triton_kernels``' functions with a backward: same names and signatures. ``mode``:
    ``triton`` (the Triton backward kernels) or ``recompute`` (the native recompute)."""

    def __init__(self, fast: ModuleType, mode: str = "triton") -> None:
        self.fast, self.mode = fast, mode
        self.available = fast.available
        t = mode == "triton"
        self.rmsnorm = Op("rmsnorm", fast.rmsnorm, ref_rmsnorm, tvjp_rmsnorm if t else None)
        self.matmul = Op("matmul", fast.matmul, vjp=tvjp_matmul if t else vjp_matmul)
        self.qk_norm_rope = Op("qk_norm_rope", fast.qk_norm_rope, ref_qk_norm_rope,
                               tvjp_qk_norm_rope if t else None)
        self.swiglu = Op("swiglu", fast.swiglu, ref_swiglu, tvjp_swiglu if t else None)
        self.attention = Op("attention", fast.attention, ref_attention,
                            tvjp_attention if t else None, with_out=t)
        self.logsumexp = Op("logsumexp", fast.logsumexp, ref_logsumexp,
                            tvjp_logsumexp if t else None)
        self.selected_logp = Op("selected_logp", fast.selected_logp, ref_selected_logp,
                                tvjp_selected_logp if t else None)

    def logits_chunks(self, hn: Tensor, lm_head: Tensor, temperature: float,
                      tap: Callable[[int, Tensor], Tensor] | None = None,
                      ) -> Iterator[tuple[int, Tensor]]:
        """``triton_kernels.logits_chunks`` with this set's (differentiable) matmul."""
        return self.fast.logits_chunks(hn, lm_head, temperature, tap, mm=self.matmul)  # type: ignore[no-any-return]


def triton_ops(mode: str | None = None) -> Ops:
    """The Triton R kernels with the backward of ``mode`` (default: ``RLK_REF_R_BACKWARD``'s,
    which ``env.backward_mode`` checks for the user first; ``tiled`` runs its loss elsewhere,
    its Triton ops only without autograd). Imports Triton on first use."""
    mode = mode or os.environ.get("RLK_REF_R_BACKWARD", "").strip() or "triton"
    if mode not in BACKWARD_METHODS:
        raise ValueError(f"RLK_REF_R_BACKWARD={mode!r}: expected one of {sorted(BACKWARD_METHODS)}")
    return _ops("triton" if mode == "triton" else "recompute")


@functools.cache
def _ops(mode: str) -> Ops:
    from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels

    return Ops(triton_kernels, mode)
