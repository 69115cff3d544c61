"""P's rollout decode step as vLLM runs it in production: native ops compiled by Inductor.

vLLM (V1) compiles the model's forward with ``torch.compile`` and replays CUDA graphs of the
compiled code; with Inductor its RMSNorm, rotary embedding and SiluAndMul run their
``forward_native`` torch code, which Inductor fuses into a few kernels. Eager, each of those
native ops is its own kernel launch and its own round trip through memory. This module holds
that native math once, as plain functions of tensors (no module state, no taps), so the eager P
path and the compiled one are the same code:

- ``rms_vllm``: cast to fp32, scale by ``rsqrt(mean(x^2) + eps)``, cast back, multiply by the
  weight in the model dtype (vLLM's ``RMSNorm.forward_native``);
- ``decode_attn_pre``: input norm, fused QKV projection, q/k norm and RoPE in the model dtype;
- ``decode_ffn``: post-attention norm, fused gate/up projection, SiLU-and-mul, down projection;
- ``decode_logp``: final norm, LM head, fp32 temperature-scaled log-softmax.

``compiled(fn)`` is ``fn`` compiled (``fullgraph``, the batch dimension dynamic, so the decode
graphs' batch buckets share one compile) on CUDA (``RLK_REF_P_COMPILE=0`` keeps it eager);
the caller keeps the eager function on CPU, under a probe tap, or when the compile fails
(``STATUS`` says which, and the run's manifest records it). docs/benchmarks.md has what each
route gains on one H200.
The KV-cache write and the decode attention stay outside the compiled functions; on CUDA the
attention is ``decode_attention``: vLLM's Triton backend's grouped decode (``triton_decode.py``,
the default) or ``flash_decode`` (flash varlen over each sequence's own keys, as vLLM's
FlashAttention backend); elsewhere masked SDPA over the keys in use. R never comes here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

# The workload's fast paths: the sampler (both sides, rollout/sampling.py) and P's fused CUDA
# paths (kernels/). RLK_REF_FAST=0 keeps the earlier ones, so benchmarks/step_compare.py
# measures both side by side.
FAST_PATHS = os.environ.get("RLK_REF_FAST", "1") != "0"
COMPILE = os.environ.get("RLK_REF_P_COMPILE", "1") != "0"
# What the P rollout decode ran: "inductor" once a compiled function ran, "eager" with a reason.
STATUS: dict[str, str] = {}
_COMPILED: dict[str, Callable[..., Any]] = {}


def rotate_half(x: Tensor) -> Tensor:
    """RoPE's half rotation ``[-x2, x1]`` over the last dimension."""
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rms_vllm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """vLLM's native RMSNorm: fp32 statistics, cast back, then the weight in the model dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * w


def rope_vllm(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """vLLM's native rotary embedding in the model dtype; ``x [B, T, heads, D]``, ``cos``/``sin``
    ``[B, T, D]`` fp32."""
    c, s = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    return x * c + rotate_half(x) * s


def rope_megatron(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Megatron's fused rotary embedding: fp32 math, cast back to the model dtype."""
    xf = x.float()
    return (xf * cos[:, :, None] + rotate_half(xf) * sin[:, :, None]).to(x.dtype)


def megatron_log_softmax(logits: Tensor, temperature: float) -> Tensor:
    """Megatron-style: divide in the model dtype, then fp32 max / exp-sum / log."""
    lf = logits.div(temperature).float()
    shifted = lf - lf.amax(-1, keepdim=True)
    return shifted - torch.log(shifted.exp().sum(-1, keepdim=True))


def decode_attn_pre(x: Tensor, in_w: Tensor, wqkv: Tensor, qn_w: Tensor, kn_w: Tensor,
                    cos: Tensor, sin: Tensor, eps: float, hq: int, hkv: int,
                    d: int) -> tuple[Tensor, Tensor, Tensor]:
    """``x [B, T, H]`` -> RoPE'd ``q [B, T, Hq, D]``, ``k``/``v [B, T, Hkv, D]`` (vLLM native)."""
    b, t, _ = x.shape
    qkv = F.linear(rms_vllm(x, in_w, eps), wqkv)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = rms_vllm(q.reshape(b, t, hq, d), qn_w, eps)
    k = rms_vllm(k.reshape(b, t, hkv, d), kn_w, eps)
    return rope_vllm(q, cos, sin), rope_vllm(k, cos, sin), v.reshape(b, t, hkv, d)


def decode_ffn(x: Tensor, post_w: Tensor, wgu: Tensor, wd: Tensor, eps: float,
               inter: int) -> Tensor:
    """vLLM's MLP: norm, fused gate/up, ``SiluAndMul`` in the model dtype, down projection."""
    gu = F.linear(rms_vllm(x, post_w, eps), wgu)
    return F.linear(F.silu(gu[..., :inter]) * gu[..., inter:], wd)


def decode_logp(h: Tensor, norm_w: Tensor, lm_head: Tensor, eps: float,
                temperature: float) -> Tensor:
    """fp32 log-probabilities ``[N, V]``: final norm, LM head, temperature, log-softmax."""
    logits = F.linear(rms_vllm(h, norm_w, eps), lm_head)
    return torch.log_softmax(logits.float() / temperature, dim=-1)


# P's decode attention on CUDA, as vLLM decodes: by default its Triton backend's grouped decode
# (``triton_decode.py``: the query heads of a KV head in one tile, each key read once per KV
# head); RLK_REF_P_DECODE_ATTN=flash is its FlashAttention backend's route, flash varlen over
# each sequence's own keys (``seqused_k``), the token-major cache read in place, one query row
# per head; =flash-packed packs the query heads of a KV head as rows of its sequence instead
# (the same bits as flash, slower on one H200: docs/benchmarks.md); =sdpa keeps the masked SDPA
# over the whole span. A route that cannot run here falls to the next (triton, flash, sdpa).
DECODE_ATTN = os.environ.get("RLK_REF_P_DECODE_ATTN", "triton")
PACK_GQA = DECODE_ATTN == "flash-packed"


def decode_route(q: Tensor) -> str:
    """P's decode attention route for ``q``: ``"triton"``, ``"flash"`` or ``""`` (masked SDPA).
    Decided on the first CUDA call by a trial call of each route in turn; ``STATUS`` says which
    and why the ones before it could not run."""
    if DECODE_ATTN not in ("triton", "flash", "flash-packed") or not q.is_cuda:
        return ""
    if "decode_attention" in STATUS:
        said = STATUS["decode_attention"]
        return "triton" if said.startswith("triton") else (
            "flash" if said.startswith("flash") else "")
    z = q.new_zeros(2, 1, 1, q.shape[-1])
    trial = (q.new_zeros(2, 1, q.shape[-1]), z, z, torch.zeros(2, 1, device=q.device))
    refused = []
    if DECODE_ATTN == "triton":
        from pytest_rlkernel_matrix.workload.kernels.p import triton_decode

        why = "" if triton_decode.available(q.device) else "triton not importable"
        if not why:
            try:
                triton_decode.decode_attention(*trial)
            except Exception as exc:  # a compiler or driver refusal: the next route
                why = f"triton failed: {type(exc).__name__}: {str(exc)[:160]}"
        if not why:
            STATUS["decode_attention"] = ("triton grouped decode (block_n, warps, stages, "
                                          f"splits = {triton_decode.config()})")
            return "triton"
        refused.append(why)
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    why = ("no aten._flash_attention_forward" if op is None
           else "its flash forward takes no seqused_k" if "seqused_k" not in str(op.default._schema)
           else f"dtype {q.dtype}" if q.dtype not in (torch.bfloat16, torch.float16)
           else "")
    if not why:  # a trial call on this device (a ROCm build may lack the varlen path)
        try:
            flash_decode(*trial)
        except RuntimeError as exc:
            why = f"flash varlen failed: {str(exc)[:160]}"
    after = f" ({'; '.join(refused)})" if refused else ""
    if why:
        STATUS["decode_attention"] = f"masked sdpa: {'; '.join([*refused, why])}"
        return ""
    STATUS["decode_attention"] = ("flash_varlen, gqa packed" if PACK_GQA
                                  else "flash_varlen, a row per head") + after
    return "flash"


def decode_attention(route: str, q: Tensor, cache: Any, positions: Tensor) -> Tensor:
    """P's decode attention by ``route`` (``decode_route``): ``q [B, Hq, D]`` against the KV
    ``cache`` (``.k``/``.v`` ``[B, cap, Hkv, D]``), row ``i`` over its keys ``0..positions[i]``."""
    if route == "triton":
        from pytest_rlkernel_matrix.workload.kernels.p import triton_decode

        return triton_decode.decode_attention(q, cache.k, cache.v, positions)
    return flash_decode(q, cache.k, cache.v, positions)


def flash_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor,
                 pack: bool | None = None) -> Tensor:
    """One query per sequence ``q [B, Hq, D]`` against the token-major cache ``[B, cap, Hkv, D]``,
    row ``i`` attending to its keys ``0 .. positions[i]`` -> ``[B, Hq, D]``. ``pack`` (default
    ``PACK_GQA``): query head ``h * g + j`` becomes query row ``j`` of KV head ``h`` (``g`` rows
    per sequence, not causal: every row sees the same keys)."""
    b, cap, hkv, d = k_cache.shape
    hq = q.shape[1]
    g = hq // hkv if (PACK_GQA if pack is None else pack) else 1
    cu = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    used = (positions.reshape(b) + 1).to(torch.int32)
    qp = q.view(b, hkv, g, d).transpose(1, 2).reshape(b * g, hkv, d) if g > 1 else q
    out = torch.ops.aten._flash_attention_forward(
        qp, k_cache.view(b * cap, hkv, d), v_cache.view(b * cap, hkv, d), cu * g, cu * cap, g,
        cap, 0.0, False, False, seqused_k=used)[0]
    return out.view(b, g, hkv, d).transpose(1, 2).reshape(b, hq, d) if g > 1 else out


def use_compiled(x: Tensor) -> bool:
    """Whether P's decode math runs compiled for an input on ``x``'s device."""
    return COMPILE and x.is_cuda


def compiled(fn: Callable[..., Any], batch_args: tuple[int, ...] = (0,),
             status: dict[str, str] | None = None) -> Callable[..., Any]:
    """``fn`` compiled by Inductor with a dynamic batch (dimension 0 of the tensor arguments at
    ``batch_args``), built on first use; the eager ``fn`` when compiling fails, said in
    ``status`` (default ``STATUS``; the sampler keeps its own)."""
    status = STATUS if status is None else status
    name = fn.__name__
    found = _COMPILED.get(name)
    if found is not None:
        return found
    comp = torch.compile(fn, fullgraph=True)

    def run(*args: Any) -> Any:
        if _COMPILED.get(name) is fn:  # an earlier compile failed: eager from then on
            return fn(*args)
        for i in batch_args:
            if args[i].shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(args[i], 0)
        try:
            out = comp(*args)
        except Exception as exc:  # Inductor missing a compiler, an unsupported op, ...
            status[name] = f"eager: compile failed: {type(exc).__name__}: {str(exc)[:200]}"
            _COMPILED[name] = fn
            print(f"[rlk-reference] {name}: {status[name]}")
            return fn(*args)
        status.setdefault(name, "inductor")
        return out

    _COMPILED[name] = run
    return run


def decode_mode() -> str:
    """One line for the manifest: how P's rollout decode math and attention ran here."""
    math = {k: v for k, v in STATUS.items() if k != "decode_attention"}
    line = ("; ".join(f"{k}: {v}" for k, v in sorted(math.items())) if math
            else "eager" if not COMPILE else "not used")
    attn = STATUS.get("decode_attention")
    return f"{line}; attention: {attn}" if attn else line
