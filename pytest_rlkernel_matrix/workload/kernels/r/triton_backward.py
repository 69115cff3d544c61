"""Deterministic Triton backward kernels for the R forward of ``triton_kernels.py``.

Each function is the vector-Jacobian product of one forward kernel, computed from the forward's
inputs (and, for attention, its output). The rules that make them deterministic and, where the
forward is, batch-invariant:

- **No atomics, fixed reduction order.** A gradient that sums over rows (a norm weight's, a key's
  or value's over the query rows that see it) is summed by one program in a fixed loop order, or
  written as per-program partial sums that ``_colsum_kernel`` adds up in program order. The
  programs a row belongs to depend only on the number of rows, so two runs of one shape give the
  same bits.
- **Per-row gradients are per-row arithmetic.** ``dx`` of RMSNorm, ``dqkv`` of q/k norm + RoPE,
  ``dgu`` of SwiGLU and ``dz`` of the selected log-probability use only their row's data; ``dq``
  of attention walks the row's own key blocks 0, 1, ... like the forward; the matmul's ``dX`` is
  the persistent no-split-K matmul of the forward (``triton_kernels.matmul``). None of them
  depends on the batch.
- **Attention** is a FlashAttention-2-style backward in two kernels, none of whose sums crosses
  programs: ``_attn_bwd_dq`` (per query block: the row's log-sum-exp recomputed over its keys,
  ``delta = rowsum(dO * O)``, then ``dQ`` over the key blocks in order) and ``_attn_bwd_dkdv``
  (per key block of one (sequence, KV head): ``dK`` and ``dV`` summed over the query rows of
  every query head of the group, blocks in order). GQA's sum over the group is inside the
  program, not an atomic add across heads.

Weight gradients (``dW = dY^T X`` and the norm weights') are sums over the batch: deterministic
run to run, not batch-invariant (nothing that sums over the batch can be). Tested against torch
autograd of the reference expressions in ``tests/workload/test_triton_backward.py`` (GPU, and
Triton's CPU interpreter).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels as fwd

triton, tl = fwd.triton, fwd.tl

_ROWS = 16  # rows per program of the row-wise backwards (their weight-gradient partials)
_ATTN_BM, _ATTN_BN = 64, 64
_EW_BLOCK = 1024
_LSE_BWD_BLOCK = 4096

if triton is not None:

    @triton.jit
    def _colsum_kernel(p_ptr, out_ptr, R, C, BLOCK: tl.constexpr):
        """``out[c] = sum_r p[r, c]``, r in order (the weight-gradient partials)."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < C
        acc = tl.zeros((BLOCK,), tl.float32)
        for r in range(0, R):
            acc += tl.load(p_ptr + r * C + cols, mask=mask, other=0.0)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["M"])
    def _rmsnorm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dwp_ptr, M, H, s_xm, s_dym, s_dxm,
                            eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """Rows ``ROWS * pid ..``: ``dx``; this program's partial of ``dw`` (rows in order)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK,), tl.float32)
        for i in range(0, ROWS):
            row = pid * ROWS + i
            if row < M:
                x = tl.load(x_ptr + row * s_xm + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * s_dym + cols, mask=mask, other=0.0).to(tl.float32)
                r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
                xh = x * r
                dxh = dy * w
                dx = r * (dxh - xh * (tl.sum(dxh * xh, axis=0) / H))
                tl.store(dx_ptr + row * s_dxm + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw += dy * xh
        tl.store(dwp_ptr + pid * H + cols, dw, mask=mask)

    @triton.jit
    def _qk_heads_bwd(x_base, do_base, dx_base, s_head, s_dohead, c1, c2, s1, s2, w1, w2, eps,
                      NH: tl.constexpr, NHP: tl.constexpr, D: tl.constexpr):
        """One row's heads of q (or k): RoPE then RMSNorm backward; returns the two halves of
        this row's contribution to the norm weight's gradient (summed over the heads)."""
        hh = tl.arange(0, NHP)
        half = tl.arange(0, D // 2)
        hm = (hh < NH)[:, None]
        off = hh[:, None] * s_head + half[None, :]
        doff = hh[:, None] * s_dohead + half[None, :]
        x1 = tl.load(x_base + off, mask=hm, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + D // 2 + off, mask=hm, other=0.0).to(tl.float32)
        do1 = tl.load(do_base + doff, mask=hm, other=0.0).to(tl.float32)
        do2 = tl.load(do_base + D // 2 + doff, mask=hm, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)
        xh1 = x1 * r[:, None]
        xh2 = x2 * r[:, None]
        # o1 = n1 c1 - n2 s1, o2 = n2 c2 + n1 s2 (n = xh * w): d/dn
        dn1 = do1 * c1[None, :] + do2 * s2[None, :]
        dn2 = do2 * c2[None, :] - do1 * s1[None, :]
        dxh1 = dn1 * w1[None, :]
        dxh2 = dn2 * w2[None, :]
        dot = (tl.sum(dxh1 * xh1, axis=1) + tl.sum(dxh2 * xh2, axis=1)) / D
        dx1 = r[:, None] * (dxh1 - xh1 * dot[:, None])
        dx2 = r[:, None] * (dxh2 - xh2 * dot[:, None])
        tl.store(dx_base + off, dx1, mask=hm)
        tl.store(dx_base + D // 2 + off, dx2, mask=hm)
        return tl.sum(dn1 * xh1, axis=0), tl.sum(dn2 * xh2, axis=0)

    @triton.jit(do_not_specialize=["M"])
    def _qk_norm_rope_bwd_kernel(qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, dq_ptr, dk_ptr,
                                 dv_ptr, dqkv_ptr, dqnp_ptr, dknp_ptr, M, s_qkv, s_dq, s_dk,
                                 s_dv, s_cos, s_dqkv, eps, HQ: tl.constexpr, HQP: tl.constexpr,
                                 HKV: tl.constexpr, HKVP: tl.constexpr, D: tl.constexpr,
                                 ROWS: tl.constexpr):
        pid = tl.program_id(0)
        half = tl.arange(0, D // 2)
        qw1 = tl.load(qn_ptr + half).to(tl.float32)
        qw2 = tl.load(qn_ptr + D // 2 + half).to(tl.float32)
        kw1 = tl.load(kn_ptr + half).to(tl.float32)
        kw2 = tl.load(kn_ptr + D // 2 + half).to(tl.float32)
        aq1 = tl.zeros((D // 2,), tl.float32)
        aq2 = tl.zeros((D // 2,), tl.float32)
        ak1 = tl.zeros((D // 2,), tl.float32)
        ak2 = tl.zeros((D // 2,), tl.float32)
        hv = tl.arange(0, HKVP)
        dd = tl.arange(0, D)
        for i in range(0, ROWS):
            row = pid * ROWS + i
            if row < M:
                c1 = tl.load(cos_ptr + row * s_cos + half)
                c2 = tl.load(cos_ptr + row * s_cos + D // 2 + half)
                s1 = tl.load(sin_ptr + row * s_cos + half)
                s2 = tl.load(sin_ptr + row * s_cos + D // 2 + half)
                xb = qkv_ptr + row * s_qkv
                db = dqkv_ptr + row * s_dqkv
                g1, g2 = _qk_heads_bwd(xb, dq_ptr + row * s_dq, db, D, D, c1, c2, s1, s2,
                                       qw1, qw2, eps, HQ, HQP, D)
                aq1 += g1
                aq2 += g2
                g1, g2 = _qk_heads_bwd(xb + HQ * D, dk_ptr + row * s_dk, db + HQ * D, D, D, c1,
                                       c2, s1, s2, kw1, kw2, eps, HKV, HKVP, D)
                ak1 += g1
                ak2 += g2
                vm = (hv < HKV)[:, None]
                voff = hv[:, None] * D + dd[None, :]
                dv = tl.load(dv_ptr + row * s_dv + voff, mask=vm, other=0.0).to(tl.float32)
                tl.store(db + (HQ + HKV) * D + voff, dv, mask=vm)
        tl.store(dqnp_ptr + pid * D + half, aq1)
        tl.store(dqnp_ptr + pid * D + D // 2 + half, aq2)
        tl.store(dknp_ptr + pid * D + half, ak1)
        tl.store(dknp_ptr + pid * D + D // 2 + half, ak2)

    @triton.jit(do_not_specialize=["M"])
    def _swiglu_bwd_kernel(gu_ptr, dy_ptr, dgu_ptr, M, INTER, s_gu, s_dy, s_dgu,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < INTER
        g = tl.load(gu_ptr + row * s_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * s_gu + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * s_dy + cols, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        dg = dy * u * (s * (1.0 + g * (1.0 - s)))
        du = dy * (g * s)
        tl.store(dgu_ptr + row * s_dgu + cols, dg, mask=mask)
        tl.store(dgu_ptr + row * s_dgu + INTER + cols, du, mask=mask)

    @triton.jit(do_not_specialize=["M"])
    def _lse_bwd_kernel(z_ptr, lse_ptr, g_ptr, t_ptr, dz_ptr, M, V, s_zm, s_dzm,
                        HAS_T: tl.constexpr, BLOCK: tl.constexpr):
        """``dz = g (onehot(t) - exp(z - lse))`` (selected log-prob) or ``g exp(z - lse)``."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(z_ptr + row * s_zm + cols, mask=mask, other=0.0)
        lse = tl.load(lse_ptr + row)
        g = tl.load(g_ptr + row)
        p = tl.exp(z - lse)
        if HAS_T:
            t = tl.load(t_ptr + row)
            dz = tl.where(cols == t, g, 0.0) - g * p
        else:
            dz = g * p
        tl.store(dz_ptr + row * s_dzm + cols, dz, mask=mask)

    @triton.jit
    def _attn_rows(pos_ptr, b, pid_m, T, s_pb, s_pt, G: tl.constexpr, BLOCK_M: tl.constexpr):
        """Query rows ``(t, g)`` of block ``pid_m``: t, head within the group, valid, position."""
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        t = r // G
        valid = t < T
        tc = tl.where(valid, t, 0)
        pos = tl.load(pos_ptr + b * s_pb + tc * s_pt, mask=valid, other=-1)
        return tc, r % G, valid, pos

    @triton.jit(do_not_specialize=["T", "HKV"])
    def _attn_bwd_dq(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, dq_ptr, lse_ptr, dl_ptr, pos_ptr,
                     s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ob, s_ot, s_oh,
                     s_db, s_dt, s_dh, s_pb, s_pt, T, HKV, qk_scale, sm_scale,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Per query block of one (sequence, KV head): the rows' log-sum-exp (base 2) over their
        keys, ``delta = rowsum(dO * O)``, then ``dQ`` over key blocks 0, 1, ... in order."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HKV
        kvh = bh % HKV
        tc, g, valid, pos = _attn_rows(pos_ptr, b, pid_m, T, s_pb, s_pt, G, BLOCK_M)
        head = kvh * G + g
        d = tl.arange(0, D)
        rows = tc[:, None] * s_qt + head[:, None] * s_qh + d[None, :]
        q = tl.load(q_ptr + b * s_qb + rows, mask=valid[:, None], other=0.0)
        o = tl.load(o_ptr + b * s_ob + tc[:, None] * s_ot + head[:, None] * s_oh + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)
        do = tl.load(do_ptr + b * s_db + tc[:, None] * s_dt + head[:, None] * s_dh + d[None, :],
                     mask=valid[:, None], other=0.0)
        delta = tl.sum(do.to(tl.float32) * o, axis=1)
        hi = tl.max(pos, axis=0) + 1
        k_base = k_ptr + b * s_kb + kvh * s_kh
        v_base = v_ptr + b * s_vb + kvh * s_vh
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(0, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            kt = tl.load(k_base + n[None, :] * s_ks + d[:, None], mask=(n < hi)[None, :],
                         other=0.0)
            if IEEE:  # noqa: SIM108 - a constexpr branch, resolved at compile time
                s = tl.dot(q, kt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
            s = tl.where(n[None, :] <= pos[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # pad rows: no -inf - -inf
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
            m_i = m_new
        lse = tl.where(valid, m_i + tl.log2(tl.where(valid, l_i, 1.0)), 0.0)
        dq = tl.zeros((BLOCK_M, D), tl.float32)
        for start in range(0, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            in_span = n < hi
            kt = tl.load(k_base + n[None, :] * s_ks + d[:, None], mask=in_span[None, :],
                         other=0.0)
            vt = tl.load(v_base + n[None, :] * s_vs + d[:, None], mask=in_span[None, :],
                         other=0.0)
            if IEEE:
                s = tl.dot(q, kt, input_precision="ieee")
                dp = tl.dot(do, vt, input_precision="ieee")
            else:
                s = tl.dot(q, kt)
                dp = tl.dot(do, vt)
            seen = (n[None, :] <= pos[:, None]) & valid[:, None]
            p = tl.where(seen, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
            if IEEE:
                dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision="ieee")
            else:
                dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
        tl.store(dq_ptr + b * s_qb + rows, (dq * sm_scale).to(dq_ptr.dtype.element_ty),
                 mask=valid[:, None])
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(lse_ptr + bh * T * G + r, lse, mask=valid)
        tl.store(dl_ptr + bh * T * G + r, delta, mask=valid)

    @triton.jit(do_not_specialize=["T", "S", "HKV"])
    def _attn_bwd_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse_ptr, dl_ptr, pos_ptr,
                       s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_db, s_dt, s_dh,
                       s_dkb, s_dks, s_dkh, s_pb, s_pt, T, S, HKV, qk_scale, sm_scale,
                       G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Per key block of one (sequence, KV head): ``dK``, ``dV`` over the query rows of every
        query head of the group, query blocks 0, 1, ... in order."""
        pid_n = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HKV
        kvh = bh % HKV
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < S
        d = tl.arange(0, D)
        k = tl.load(k_ptr + b * s_kb + kvh * s_kh + n[:, None] * s_ks + d[None, :],
                    mask=n_ok[:, None], other=0.0)
        v = tl.load(v_ptr + b * s_vb + kvh * s_vh + n[:, None] * s_vs + d[None, :],
                    mask=n_ok[:, None], other=0.0)
        dk = tl.zeros((BLOCK_N, D), tl.float32)
        dv = tl.zeros((BLOCK_N, D), tl.float32)
        first = pid_n * BLOCK_N
        for pid_m in range(0, tl.cdiv(T * G, BLOCK_M)):
            tc, g, valid, pos = _attn_rows(pos_ptr, b, pid_m, T, s_pb, s_pt, G, BLOCK_M)
            if tl.max(pos, axis=0) >= first:  # some row of the block sees a key of this block
                head = kvh * G + g
                q = tl.load(q_ptr + b * s_qb + tc[:, None] * s_qt + head[:, None] * s_qh
                            + d[None, :], mask=valid[:, None], other=0.0)
                do = tl.load(do_ptr + b * s_db + tc[:, None] * s_dt + head[:, None] * s_dh
                             + d[None, :], mask=valid[:, None], other=0.0)
                r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                lse = tl.load(lse_ptr + bh * T * G + r, mask=valid, other=0.0)
                delta = tl.load(dl_ptr + bh * T * G + r, mask=valid, other=0.0)
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                    dp = tl.dot(do, tl.trans(v), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))
                    dp = tl.dot(do, tl.trans(v))
                seen = (n[None, :] <= pos[:, None]) & valid[:, None] & n_ok[None, :]
                p = tl.where(seen, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
                ds = p * (dp - delta[:, None])
                if IEEE:
                    dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision="ieee")
                    dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision="ieee")
                else:
                    dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv)
                    dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)
        out = b * s_dkb + kvh * s_dkh + n[:, None] * s_dks + d[None, :]
        tl.store(dk_ptr + out, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=n_ok[:, None])
        tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=n_ok[:, None])


def _colsum(partials: Tensor, dtype: torch.dtype) -> Tensor:
    """Sum of ``partials [R, C]`` over R, in row order, in ``dtype``."""
    r, c = partials.shape
    out = torch.empty(c, device=partials.device, dtype=dtype)
    block = 256
    _colsum_kernel[(triton.cdiv(c, block),)](partials, out, r, c, BLOCK=block, num_warps=4)
    return out


def tokens_last(x: Tensor, unit: int) -> Tensor:
    """``x [M, C]`` as a contiguous ``[C, M']``: ``x^T`` with its row length (the reduction
    axis of a weight gradient, the micro-batch's tokens) rounded up to ``M'``, a multiple of
    ``unit``, the added columns zero."""
    m, c = x.shape
    mp = -(-m // unit) * unit
    out = x.new_empty(c, mp)
    if mp > m:
        out[:, m:].zero_()
    out[:, :m].copy_(x.t())
    return out


def matmul_bwd(g: Tensor, a: Tensor, w: Tensor, need_a: bool = True,
               need_w: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """The backward of ``triton_kernels.matmul(a, w)``: ``dA = g W`` and ``dW = g^T A`` in the
    operands' dtype, each one persistent no-split-K matmul (``dA``: batch-invariant rows).

    The operands go in as contiguous copies with the reduction axis last (``W^T``, ``g^T``,
    ``A^T``), the layout of the forward: read in place through transposed strides (contiguous
    along the tile's row axis, which the kernel's edge-row clamp likely hides from the compiler)
    the same kernel ran about 17 times slower per product on an H200 (docs/benchmarks.md).

    ``dW``'s reduction axis is the micro-batch's tokens, ``M = samples x padded length``, any
    number: ``g^T`` and ``A^T`` are laid out with their rows padded with zeros to a multiple of
    the matmul's ``BLOCK_K`` (``tokens_last``). Unpadded, an ``M`` that is not a multiple of 16
    makes every row stride of both operands one Triton cannot prove 16-byte aligned (no
    vectorised loads) and the K loop a masked one: on an H100 R's training cost per token went
    from 23.9 to 48.9 ms per 1,000 tokens at 8,448 tokens per micro-batch when the padded
    lengths stopped being multiples of 16 (issue 55, docs/benchmarks.md). The padded product is
    the same bits: the masked loads of the last K block read zeros there too (``other=0.0``),
    and every K block before it is the same, in the same order."""
    g = g.to(a.dtype)
    da = fwd.matmul(g, w.t().contiguous(), a.dtype) if need_a else None
    dw = None
    if need_w:
        unit = fwd.matmul_config(a.dtype, bool(torch.version.hip)).block_k
        dw = fwd.matmul(tokens_last(g, unit), tokens_last(a, unit), w.dtype)
    return da, dw


def rmsnorm_bwd(dy: Tensor, x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` of ``rmsnorm(x, w, eps)``: dx in x's dtype, dw in w's."""
    if x.stride(1) != 1:
        x = x.contiguous()
    dy = dy.contiguous()
    m, h = x.shape
    dx = torch.empty_like(x)
    nprog = max(1, triton.cdiv(m, _ROWS))
    part = torch.zeros(nprog, h, device=x.device, dtype=torch.float32)
    if m:
        _rmsnorm_bwd_kernel[(nprog,)](x, w, dy, dx, part, m, h, x.stride(0), dy.stride(0),
                                      dx.stride(0), eps, ROWS=_ROWS,
                                      BLOCK=triton.next_power_of_2(h), num_warps=4)
    return dx, _colsum(part, w.dtype)


def qk_norm_rope_bwd(dq: Tensor | None, dk: Tensor | None, dv: Tensor | None, qkv: Tensor,
                     cos: Tensor, sin: Tensor, q_norm: Tensor, k_norm: Tensor, hq: int,
                     hkv: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dqkv, dq_norm, dk_norm)`` of ``qk_norm_rope`` (no probe switches): dqkv in qkv's
    dtype, the norm weights' gradients in theirs. A missing output gradient counts as zero."""
    m, d = qkv.shape[0], q_norm.shape[0]
    outs = []
    for gr, h in ((dq, hq), (dk, hkv), (dv, hkv)):
        gr = torch.zeros(m, h, d, device=qkv.device, dtype=qkv.dtype) if gr is None else gr
        outs.append(gr.reshape(m, h * d).contiguous())
    dq2, dk2, dv2 = outs
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    dqkv = torch.empty(m, (hq + 2 * hkv) * d, device=qkv.device, dtype=torch.float32)
    nprog = max(1, triton.cdiv(m, _ROWS))
    pq = torch.zeros(nprog, d, device=qkv.device, dtype=torch.float32)
    pk = torch.zeros(nprog, d, device=qkv.device, dtype=torch.float32)
    if m:
        _qk_norm_rope_bwd_kernel[(nprog,)](
            qkv, cos, sin, q_norm, k_norm, dq2, dk2, dv2, dqkv, pq, pk, m, qkv.stride(0),
            dq2.stride(0), dk2.stride(0), dv2.stride(0), cos.stride(0), dqkv.stride(0), eps,
            HQ=hq, HQP=triton.next_power_of_2(hq), HKV=hkv, HKVP=triton.next_power_of_2(hkv),
            D=d, ROWS=_ROWS, num_warps=4)
    return dqkv.to(qkv.dtype), _colsum(pq, q_norm.dtype), _colsum(pk, k_norm.dtype)


def swiglu_bwd(dy: Tensor, gu: Tensor) -> Tensor:
    """``dgu`` (gu's dtype) of ``swiglu(gu)``."""
    m, two_i = gu.shape
    inter = two_i // 2
    dy = dy.contiguous()
    dgu = torch.empty(m, two_i, device=gu.device, dtype=torch.float32)
    if m:
        _swiglu_bwd_kernel[(m, triton.cdiv(inter, _EW_BLOCK))](
            gu, dy, dgu, m, inter, gu.stride(0), dy.stride(0), dgu.stride(0), BLOCK=_EW_BLOCK,
            num_warps=4)
    return dgu.to(gu.dtype)


def logsumexp_bwd(g: Tensor, z: Tensor, targets: Tensor | None = None) -> Tensor:
    """``dz`` of ``logsumexp(z)`` for its gradient ``g [M]``; with ``targets``, of
    ``selected_logp(z, targets) = z[t] - logsumexp(z)``. The log-sum-exp is recomputed by the
    forward kernel (its bits)."""
    m, v = z.shape
    lse = fwd.logsumexp(z)
    g = g.float().contiguous()
    dz = torch.empty_like(z)
    if m:
        t = targets.contiguous() if targets is not None else lse
        _lse_bwd_kernel[(m, triton.cdiv(v, _LSE_BWD_BLOCK))](
            z, lse, g, t, dz, m, v, z.stride(0), dz.stride(0), HAS_T=targets is not None,
            BLOCK=_LSE_BWD_BLOCK, num_warps=8)
    return dz


def attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor,
                  positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``attention(q, k, v, positions)`` whose output was ``o``
    (``[B, T, Hq * D]``), for its gradient ``do`` (the same shape)."""
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    do4 = do.reshape(b, t, hq, d)
    if do4.stride(3) != 1:
        do4 = do4.contiguous()
    o4 = o.reshape(b, t, hq, d)
    dq = torch.empty_like(q)
    dk = torch.empty(b, s, hkv, d, device=k.device, dtype=k.dtype)
    dv = torch.empty(b, s, hkv, d, device=v.device, dtype=v.dtype)
    if b * t == 0:
        return dq, dk.zero_(), dv.zero_()
    lse = torch.empty(b * hkv, t * g, device=q.device, dtype=torch.float32)
    delta = torch.empty_like(lse)
    sm_scale = 1.0 / math.sqrt(d)
    qk_scale = sm_scale * 1.4426950408889634
    ieee = q.dtype == torch.float32
    _attn_bwd_dq[(triton.cdiv(t * g, _ATTN_BM), b * hkv)](
        q, k, v, o4, do4, dq, lse, delta, positions, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o4.stride(0), o4.stride(1), o4.stride(2), do4.stride(0), do4.stride(1), do4.stride(2),
        positions.stride(0), positions.stride(1), t, hkv, qk_scale, sm_scale, G=g, D=d,
        BLOCK_M=_ATTN_BM, BLOCK_N=_ATTN_BN, IEEE=ieee, num_warps=4, num_stages=2)
    _attn_bwd_dkdv[(triton.cdiv(s, _ATTN_BN), b * hkv)](
        q, k, v, do4, dk, dv, lse, delta, positions, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        do4.stride(0), do4.stride(1), do4.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        positions.stride(0), positions.stride(1), t, s, hkv, qk_scale, sm_scale, G=g, D=d,
        BLOCK_M=_ATTN_BM, BLOCK_N=_ATTN_BN, IEEE=ieee, num_warps=8, num_stages=2)
    return dq, dk, dv
