"""Batch-invariant R kernels in Triton (CUDA and ROCm from one source).

The CPU R path (``kernels/``: fp32 torch ops over fixed row tiles) stays as it is; on a GPU the
R modules run these kernels instead. Each one computes an output row with an arithmetic that
depends only on that row's own data and on compile-time constants, never on how many rows are
in the batch, where the row sits in it, or whether it comes from training, prefill or decode:

- ``matmul``: a persistent matmul (grid = min(#SMs, #tiles), programs walk output tiles with a
  stride of the grid). One fixed configuration per (platform, dtype), no split-K: every output
  element is one K loop of ``BLOCK_K`` steps accumulated in fp32 in the same order whatever M is.
  Integer arguments that vary with the batch are excluded from Triton's value specialisation,
  so one compiled binary serves every M.
- ``attention``: one kernel for training (causal over the sequence), prefill and decode. Query
  rows are (token, query head of one KV group) pairs; each row walks the KV blocks 0, 1, ...
  of its own sequence in a fixed order with a fixed block size and no split of the KV axis, and
  reads K/V in place (the current forward's K/V or the KV cache, through strides). A row stops at
  the block holding its own position; blocks past it in a larger query tile are fully masked and
  leave the running max, sum and accumulator unchanged (``x * 1 + 0``).
- ``rmsnorm``, ``qk_norm_rope`` and ``swiglu``: one program per row with the whole row in one
  block (fixed-width ``tl.sum``), or elementwise.
- ``logsumexp``: one program per row, sequential fixed-width chunks over the vocabulary with a
  running (max, sum) per lane and one final fixed-order combine; selected and full log-probs are
  then ``z - lse``, one IEEE subtraction, so both give the same bits.

Design after Thinking Machines' ``batch_invariant_ops`` and vLLM's batch-invariant mode
(persistent matmul, fixed configuration, no split-K; row-wise reductions); written for this
workload's shapes (weights stored ``[N, K]`` as in Hugging Face checkpoints, GQA attention over a
token-major KV cache). Tested in ``tests/workload/test_triton_kernels.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

try:  # optional: only the GPU R path needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = [
    "MatmulConfig",
    "attention",
    "available",
    "logsumexp",
    "matmul",
    "matmul_config",
    "qk_norm_rope",
    "rmsnorm",
    "selected_logp",
    "swiglu",
]


def available(device: torch.device) -> bool:
    """True when these kernels can run on ``device`` (a GPU with Triton installed)."""
    return triton is not None and device.type == "cuda"


@dataclass(frozen=True)
class MatmulConfig:
    """The one matmul configuration used for a (platform, dtype): never chosen per shape."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def matmul_config(dtype: torch.dtype, hip: bool) -> MatmulConfig:
    """Fixed per dtype (and per platform: ROCm's LDS holds fewer stages)."""
    if dtype == torch.float32:
        return MatmulConfig(64, 64, 32, 8, 4, 2 if hip else 3)
    # bf16: chosen by benchmarks/matmul_configs.py on an H200 (docs/benchmarks.md), the best
    # single configuration over the qwen3-0.6b weight shapes at training and decode M.
    return MatmulConfig(128, 128, 64, 8, 4, 2 if hip else 4)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    if device.type != "cuda":  # interpreter on CPU
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


_ATTN_BLOCK_M, _ATTN_BLOCK_N = 64, 64
_ROW_CHUNK = 4096  # rows per logits chunk (a row's values do not depend on it)
_LSE_BLOCK = 2048

if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bn, s_bk, s_cm, s_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, EVEN_K: tl.constexpr,
                   IEEE: tl.constexpr, NUM_STAGES: tl.constexpr):
        """``c[M, N] = a[M, K] @ b[N, K]^T``, fp32 accumulation, persistent over tiles."""
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        num_tiles = num_pid_m * num_pid_n
        k_tiles = tl.cdiv(K, BLOCK_K)
        in_group = GROUP_M * num_pid_n
        offs_k = tl.arange(0, BLOCK_K)
        for tile in tl.range(pid, num_tiles, NUM_SMS):
            group = tile // in_group
            first_m = group * GROUP_M
            size_m = min(num_pid_m - first_m, GROUP_M)
            pid_m = first_m + (tile % in_group) % size_m
            pid_n = (tile % in_group) // size_m
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rm_l = tl.where(rm < M, rm, 0)  # edge rows re-load row 0; their results are dropped
            rn_l = tl.where(rn < N, rn, 0)
            a_ptrs = a_ptr + rm_l[:, None] * s_am + offs_k[None, :] * s_ak
            b_ptrs = b_ptr + rn_l[None, :] * s_bn + offs_k[:, None] * s_bk
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in tl.range(0, k_tiles, num_stages=NUM_STAGES):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    kk = ki * BLOCK_K + offs_k
                    a = tl.load(a_ptrs, mask=kk[None, :] < K, other=0.0)
                    b = tl.load(b_ptrs, mask=kk[:, None] < K, other=0.0)
                if IEEE:  # noqa: SIM108 - a constexpr branch, resolved at compile time
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
                a_ptrs += BLOCK_K * s_ak
                b_ptrs += BLOCK_K * s_bk
            c_ptrs = c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty),
                     mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit(do_not_specialize=["M"])
    def _rmsnorm_kernel(x_ptr, w_ptr, y_ptr, M, H, s_xm, s_ym, eps,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * s_xm + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / H
        y = x * (1.0 / tl.sqrt(var + eps)) * w
        tl.store(y_ptr + row * s_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["M"])
    def _qk_norm_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, q_ptr, k_ptr, v_ptr,
                             qo_ptr, ko_ptr, M, s_qkv, s_q, s_k, s_v, s_cos, s_qo, s_ko, eps,
                             q_scale, k_scale, HQ: tl.constexpr, HKV: tl.constexpr,
                             D: tl.constexpr, STORE_NORM: tl.constexpr, SCALE: tl.constexpr):
        """Per (token, head): q/k RMSNorm over the head dim, then RoPE; v is cast.

        Probes only (compile-time switches; off, the kernel is the measured one): STORE_NORM
        also stores the fp32 q/k norm outputs before RoPE to ``qo``/``ko``; SCALE multiplies
        them by ``q_scale``/``k_scale`` before RoPE (the perturbation drill)."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        half = tl.arange(0, D // 2)
        base = qkv_ptr + row * s_qkv + head * D
        x1 = tl.load(base + half).to(tl.float32)
        x2 = tl.load(base + D // 2 + half).to(tl.float32)
        if head < HQ + HKV:
            if head < HQ:
                w_base = qn_ptr
                out = q_ptr + row * s_q + head * D
                nrm = qo_ptr + row * s_qo + head * D
            else:
                w_base = kn_ptr
                out = k_ptr + row * s_k + (head - HQ) * D
                nrm = ko_ptr + row * s_ko + (head - HQ) * D
            w1 = tl.load(w_base + half).to(tl.float32)
            w2 = tl.load(w_base + D // 2 + half).to(tl.float32)
            var = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D
            r = 1.0 / tl.sqrt(var + eps)
            n1 = x1 * r * w1
            n2 = x2 * r * w2
            if STORE_NORM:
                tl.store(nrm + half, n1)
                tl.store(nrm + D // 2 + half, n2)
            if SCALE:
                sc = tl.where(head < HQ, q_scale, k_scale)
                n1 = n1 * sc
                n2 = n2 * sc
            c1 = tl.load(cos_ptr + row * s_cos + half)
            c2 = tl.load(cos_ptr + row * s_cos + D // 2 + half)
            s1 = tl.load(sin_ptr + row * s_cos + half)
            s2 = tl.load(sin_ptr + row * s_cos + D // 2 + half)
            o1 = n1 * c1 - n2 * s1
            o2 = n2 * c2 + n1 * s2
            tl.store(out + half, o1.to(out.dtype.element_ty))
            tl.store(out + D // 2 + half, o2.to(out.dtype.element_ty))
        else:
            out = v_ptr + row * s_v + (head - HQ - HKV) * D
            tl.store(out + half, x1.to(out.dtype.element_ty))
            tl.store(out + D // 2 + half, x2.to(out.dtype.element_ty))

    @triton.jit(do_not_specialize=["M"])
    def _swiglu_kernel(gu_ptr, y_ptr, M, INTER, s_gu, s_y, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < INTER
        g = tl.load(gu_ptr + row * s_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * s_gu + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        y = g * (1.0 / (1.0 + tl.exp(-g))) * u
        tl.store(y_ptr + row * s_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["T", "HKV"])
    def _attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr,
                     s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh,
                     s_ob, s_ot, s_oh, s_pb, s_pt, T, HKV, qk_scale,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Causal GQA attention: query rows (t, g) of one (batch, kv head); keys 0..pos."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HKV
        kvh = bh % HKV
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        t = r // G
        head = kvh * G + r % G
        valid = t < T
        tc = tl.where(valid, t, 0)
        pos = tl.load(pos_ptr + b * s_pb + tc * s_pt, mask=valid, other=0)  # pad rows: key 0
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * s_qb + tc[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                    mask=valid[:, None], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        hi = tl.max(pos, axis=0) + 1
        k_base = k_ptr + b * s_kb + kvh * s_kh
        v_base = v_ptr + b * s_vb + kvh * s_vh
        for start in range(0, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            in_span = n < hi
            kt = tl.load(k_base + n[None, :] * s_ks + d[:, None], mask=in_span[None, :],
                         other=0.0)
            if IEEE:  # noqa: SIM108 - a constexpr branch, resolved at compile time
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(n[None, :] <= pos[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + n[:, None] * s_vs + d[None, :], mask=in_span[:, None],
                        other=0.0)
            if IEEE:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(o_ptr + b * s_ob + tc[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=valid[:, None])

    @triton.jit(do_not_specialize=["M"])
    def _lse_kernel(z_ptr, out_ptr, M, V, s_zm, BLOCK: tl.constexpr):
        """Row log-sum-exp over fixed-width chunks of the vocabulary, in order."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, V, BLOCK):
            c = start + cols
            z = tl.load(z_ptr + row * s_zm + c, mask=c < V, other=float("-inf"))
            m_new = tl.maximum(m, z)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - safe) + tl.exp(z - safe)
            m = m_new
        mx = tl.max(m, axis=0)
        tot = tl.sum(s * tl.exp(m - mx), axis=0)
        tl.store(out_ptr + row, mx + tl.log(tot))


def _check(x: Tensor, name: str, dim: int) -> None:
    if x.dim() != dim:
        raise ValueError(f"{name}: expected {dim}-d tensor, got shape {tuple(x.shape)}")


def matmul(a: Tensor, w: Tensor, out_dtype: torch.dtype,
           config: MatmulConfig | None = None) -> Tensor:
    """``a [M, K] @ w[N, K]^T`` -> ``[M, N]`` in ``out_dtype``; fp32 accumulation, no split-K.

    ``config`` overrides the fixed per-dtype configuration (config sweeps only; the R modules
    never pass it).
    """
    _check(a, "matmul a", 2)
    _check(w, "matmul w", 2)
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k or a.dtype != w.dtype:
        raise ValueError(f"matmul: a {tuple(a.shape)} {a.dtype} vs w {tuple(w.shape)} {w.dtype}")
    c = torch.empty(m, n, device=a.device, dtype=out_dtype)
    if m == 0:
        return c
    cfg = config or matmul_config(a.dtype, bool(torch.version.hip))
    sms = _sms(a.device)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    _mm_kernel[(min(sms, tiles),)](
        a, w, c, m, n, k, a.stride(0), a.stride(1), w.stride(0), w.stride(1),
        c.stride(0), c.stride(1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_SMS=sms, EVEN_K=k % cfg.block_k == 0,
        IEEE=a.dtype == torch.float32, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    return c


def rmsnorm(x: Tensor, w: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """Row RMSNorm of ``x [M, H]`` (fp32 math) times ``w [H]``."""
    _check(x, "rmsnorm x", 2)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, h = x.shape
    y = torch.empty(m, h, device=x.device, dtype=out_dtype)
    if m:
        _rmsnorm_kernel[(m,)](x, w, y, m, h, x.stride(0), y.stride(0), eps,
                              BLOCK=triton.next_power_of_2(h), num_warps=4)
    return y


def qk_norm_rope(qkv: Tensor, cos: Tensor, sin: Tensor, q_norm: Tensor, k_norm: Tensor,
                 hq: int, hkv: int, eps: float, out_dtype: torch.dtype, *,
                 store_norm: bool = False,
                 scale: tuple[float, float] = (1.0, 1.0)) -> tuple[Tensor, ...]:
    """Split ``qkv [M, (hq + 2 hkv) D]``: q/k RMSNorm + RoPE, v cast.

    ``cos``/``sin`` ``[M, D]`` fp32 are each row's RoPE values (gathered at its position).
    Returns ``q [M, hq, D]``, ``k [M, hkv, D]``, ``v [M, hkv, D]`` in ``out_dtype``; with
    ``store_norm`` also the fp32 q/k norm outputs before RoPE, ``[M, hq, D]`` and ``[M, hkv, D]``
    (a probe's ``self_attn.q_norm`` / ``k_norm``). ``scale``: (q, k) factors applied to the norm
    outputs before RoPE (the perturbation drill; ``(1.0, 1.0)`` compiles the measured kernel).
    """
    _check(qkv, "qk_norm_rope qkv", 2)
    m = qkv.shape[0]
    d = q_norm.shape[0]
    if qkv.shape[1] != (hq + 2 * hkv) * d or qkv.stride(1) != 1:
        raise ValueError(f"qk_norm_rope: qkv shape {tuple(qkv.shape)} for hq={hq} hkv={hkv} d={d}")
    if cos.shape != (m, d) or sin.shape != (m, d):
        raise ValueError(f"qk_norm_rope: cos/sin must be [{m}, {d}]")
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    q = torch.empty(m, hq, d, device=qkv.device, dtype=out_dtype)
    k = torch.empty(m, hkv, d, device=qkv.device, dtype=out_dtype)
    v = torch.empty(m, hkv, d, device=qkv.device, dtype=out_dtype)
    qo, ko = q, k  # not written unless store_norm
    if store_norm:
        qo = torch.empty(m, hq, d, device=qkv.device, dtype=torch.float32)
        ko = torch.empty(m, hkv, d, device=qkv.device, dtype=torch.float32)
    if m:
        _qk_norm_rope_kernel[(m, hq + 2 * hkv)](
            qkv, cos, sin, q_norm, k_norm, q, k, v, qo, ko, m, qkv.stride(0), q.stride(0),
            k.stride(0), v.stride(0), cos.stride(0), qo.stride(0), ko.stride(0), eps,
            float(scale[0]), float(scale[1]), HQ=hq, HKV=hkv, D=d, STORE_NORM=store_norm,
            SCALE=tuple(scale) != (1.0, 1.0), num_warps=1)
    return (q, k, v, qo, ko) if store_norm else (q, k, v)


def swiglu(gu: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``silu(gate) * up`` for ``gu = [gate | up]`` of shape ``[M, 2 I]`` (fp32 math)."""
    _check(gu, "swiglu gu", 2)
    m, two_i = gu.shape
    inter = two_i // 2
    y = torch.empty(m, inter, device=gu.device, dtype=out_dtype)
    if m:
        block = 1024
        _swiglu_kernel[(m, triton.cdiv(inter, block))](gu, y, m, inter, gu.stride(0),
                                                       y.stride(0), BLOCK=block, num_warps=4)
    return y


def attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> Tensor:
    """Causal GQA attention, one kernel for training, prefill and decode.

    ``q [B, T, Hq, D]``; ``k``/``v`` ``[B, S, Hkv, D]`` (the current forward's keys or the KV
    cache, read in place: only the head dim must be contiguous); ``positions [B, T]``: query
    ``(b, t)`` sees keys ``0..positions[b, t]`` of row ``b``. Returns ``[B, T, Hq * D]``.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    if hq % hkv or k.shape[3] != d or v.shape != k.shape or positions.shape != (b, t):
        raise ValueError(f"attention: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"positions {tuple(positions.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(3) != 1:
            raise ValueError(f"attention: {name} head dim must be contiguous")
    g = hq // hkv
    o = torch.empty(b, t, hq, d, device=q.device, dtype=q.dtype)
    if b * t == 0:
        return o.reshape(b, t, hq * d)
    qk_scale = 1.0 / math.sqrt(d) * 1.4426950408889634  # log2(e): exp2 in the kernel
    grid = (triton.cdiv(t * g, _ATTN_BLOCK_M), b * hkv)
    _attn_kernel[grid](
        q, k, v, o, positions, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1),
        o.stride(2), positions.stride(0), positions.stride(1), t, hkv, qk_scale, G=g, D=d,
        BLOCK_M=_ATTN_BLOCK_M, BLOCK_N=_ATTN_BLOCK_N, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2)
    return o.reshape(b, t, hq * d)


def logsumexp(z: Tensor) -> Tensor:
    """Row log-sum-exp of fp32 ``z [M, V]``, fixed chunk order over V."""
    _check(z, "logsumexp z", 2)
    if z.dtype != torch.float32 or z.stride(1) != 1:
        raise ValueError("logsumexp: expects contiguous fp32 rows")
    m, v = z.shape
    out = torch.empty(m, device=z.device, dtype=torch.float32)
    if m:
        _lse_kernel[(m,)](z, out, m, v, z.stride(0), BLOCK=_LSE_BLOCK, num_warps=8)
    return out


def selected_logp(z: Tensor, targets: Tensor) -> Tensor:
    """``z[row, targets[row]] - logsumexp(z[row])`` per row: the selected log-probability of
    fp32 logits ``z [M, V]`` (one gather, one IEEE subtraction: the bits of ``(z - lse)`` at
    the target, as the full log-probabilities give them)."""
    return z.gather(-1, targets[:, None])[:, 0] - logsumexp(z)


def logits_chunks(hn: Tensor, lm_head: Tensor, temperature: float,
                  tap: Callable[[int, Tensor], Tensor] | None = None,
                  mm: Callable[..., Tensor] | None = None) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(row_start, z)``: temperature-scaled fp32 logits per chunk of rows.

    ``tap(row_start, logits)`` (a probe's ``lm_head``) sees each chunk's logits before the
    temperature and returns the ones to go on with. ``mm``: the matmul to use (default
    ``matmul``; ``autograd.Ops`` passes its differentiable one)."""
    mm = mm or matmul
    for s in range(0, hn.shape[0], _ROW_CHUNK):
        z = mm(hn[s:s + _ROW_CHUNK], lm_head, torch.float32)
        if tap is not None:
            z = tap(s, z)
        if temperature != 1.0:
            z.div_(temperature)  # one IEEE division per element, as on every path
        yield s, z
