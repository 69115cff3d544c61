"""P's rollout decode attention in Triton, as vLLM's Triton attention backend decodes (GPU).

One query token per sequence against that sequence's own keys in the token-major KV cache
``[B, cap, Hkv, D]``, read in place. One program per (sequence, KV head) holds the ``G`` query
heads of that KV head as rows of one tile (padded to ``BLOCK_H`` rows for the tensor cores, as
vLLM's grouped decode kernel does), so each key and value is read once per KV head, not once
per query head; it walks the sequence's keys ``0 .. used - 1`` in blocks of ``BLOCK_N`` with an
online softmax in fp32. ``SPLITS > 1`` cuts the key axis into that many slices, one program each,
and a second kernel combines the slices by their log-sum-exp (vLLM's split-KV decode; for long
contexts with few sequences). At this workload's lengths (up to a few hundred keys) one slice
suffices; the benchmark in ``benchmarks/profile_decode.py`` measures the configurations.

This is a production kernel, not an R one: its reduction order depends on the split and block
configuration, which a production engine tunes per shape. ``native.decode_attention`` routes
P's decode here on CUDA (``RLK_REF_P_DECODE_ATTN=triton``, the default where triton imports).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

try:  # optional: only the GPU P decode needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

# The launch configuration (RLK_REF_P_DECODE_CONFIG="block_n,warps,stages,splits"; the default
# was measured on one H200 at qwen3-0.6b's shape, docs/benchmarks.md).
_CONFIG = tuple(int(x) for x in os.environ.get("RLK_REF_P_DECODE_CONFIG", "64,4,2,1").split(","))

if triton is not None:

    @triton.jit(do_not_specialize=["HKV", "CHUNK"])
    def _decode_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, used_ptr,
                       s_qb, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ob, s_os, s_oh,
                       HKV, CHUNK, qk_scale, G: tl.constexpr, D: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Query heads ``kvh*G .. kvh*G+G-1`` of sequence ``b`` over keys of slice ``split``."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = pid // HKV
        kvh = pid % HKV
        h = tl.arange(0, BLOCK_H)
        hm = h < G
        head = kvh * G + h
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * s_qb + head[:, None] * s_qh + d[None, :], mask=hm[:, None],
                    other=0.0)
        used = tl.load(used_ptr + b)
        lo = split * CHUNK
        hi = tl.minimum(used, lo + CHUNK)
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, D), tl.float32)
        k_base = k_ptr + b * s_kb + kvh * s_kh
        v_base = v_ptr + b * s_vb + kvh * s_vh
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nm = n < hi
            kt = tl.load(k_base + n[None, :] * s_ks + d[:, None], mask=nm[None, :], other=0.0)
            if IEEE:  # noqa: SIM108 - a constexpr branch, resolved at compile time
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(nm[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + n[:, None] * s_vs + d[None, :], mask=nm[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        # An empty slice (lo >= used) leaves l_i = 0: its lse is -inf, its output 0.
        safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / safe[:, None]
        tl.store(o_ptr + b * s_ob + split * s_os + head[:, None] * s_oh + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=hm[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(safe), float("-inf"))
        tl.store(lse_ptr + (b * tl.num_programs(1) + split) * HKV * G + head, lse, mask=hm)

    @triton.jit
    def _combine_kernel(part_ptr, lse_ptr, o_ptr, HQ, s_pb, s_ps, s_ph, s_ob, s_oh,
                        SPLITS: tl.constexpr, D: tl.constexpr):
        """Combine the slices of (sequence, query head) by their base-2 log-sum-exp."""
        pid = tl.program_id(0)
        b = pid // HQ
        head = pid % HQ
        d = tl.arange(0, D)
        m = tl.load(lse_ptr + b * SPLITS * HQ + head)
        for s in tl.static_range(1, SPLITS):
            m = tl.maximum(m, tl.load(lse_ptr + (b * SPLITS + s) * HQ + head))
        tot = tl.zeros((D,), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        for s in tl.static_range(SPLITS):
            w = tl.exp2(tl.load(lse_ptr + (b * SPLITS + s) * HQ + head) - m)
            part = tl.load(part_ptr + b * s_pb + s * s_ps + head * s_ph + d)
            acc += w * part
            tot += w
        tl.store(o_ptr + b * s_ob + head * s_oh + d, (acc / tot).to(o_ptr.dtype.element_ty))


def config() -> tuple[int, ...]:
    """The launch configuration in use: ``(block_n, warps, stages, splits)``."""
    return _CONFIG


def available(device: torch.device) -> bool:
    """Whether this kernel can run on ``device`` (triton imported; CUDA/ROCm, or the CPU
    interpreter under ``TRITON_INTERPRET=1``)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor,
                     config: tuple[int, ...] | None = None) -> Tensor:
    """``q [B, Hq, D]`` (one query per sequence) against ``k_cache``/``v_cache [B, cap, Hkv, D]``;
    row ``i`` attends to its keys ``0 .. positions[i]`` -> ``[B, Hq, D]`` in ``q``'s dtype.
    ``config``: ``(block_n, warps, stages, splits)`` (default ``RLK_REF_P_DECODE_CONFIG``)."""
    b, hq, d = q.shape
    _, cap, hkv, _ = k_cache.shape
    if (hq % hkv or k_cache.shape[0] != b or k_cache.shape[3] != d or v_cache.shape != k_cache.shape
            or positions.numel() != b):
        raise ValueError(f"decode_attention: q {tuple(q.shape)} k {tuple(k_cache.shape)} "
                         f"v {tuple(v_cache.shape)} positions {tuple(positions.shape)}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} head dim must be contiguous")
    block_n, warps, stages, splits = config or _CONFIG
    g = hq // hkv
    used = (positions.reshape(b) + 1).to(torch.int32)
    chunk = -(-cap // splits)
    chunk = -(-chunk // block_n) * block_n  # each slice a whole number of key blocks
    out = torch.empty(b, hq, d, device=q.device, dtype=q.dtype)
    part = out[:, None] if splits == 1 else torch.empty(b, splits, hq, d, device=q.device,
                                                        dtype=torch.float32)
    lse = torch.empty(b, splits, hq, device=q.device, dtype=torch.float32)
    if b == 0:
        return out
    qk_scale = 1.0 / math.sqrt(d) * 1.4426950408889634  # log2(e): exp2 in the kernel
    _decode_kernel[(b * hkv, splits)](
        q, k_cache, v_cache, part, lse, used, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), part.stride(0), part.stride(1), part.stride(2), hkv, chunk, qk_scale,
        G=g, D=d, BLOCK_H=max(16, triton.next_power_of_2(g)), BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages)
    if splits > 1:
        _combine_kernel[(b * hq,)](part, lse, out, hq, part.stride(0), part.stride(1),
                                   part.stride(2), out.stride(0), out.stride(1), SPLITS=splits,
                                   D=d, num_warps=1)
    return out
