"""The deterministic Triton backward kernels (``workload/kernels/r/triton_backward.py``).

Each kernel against torch autograd of the op's reference expression (``autograd.ref_*``, fp32),
within a stated tolerance: on a GPU (bf16 operands at qwen3-0.6b's widths) ``TOL_BF16`` for a
gradient the kernel writes in bf16 or computes from bf16 tensor-core products, ``TOL_F32`` for
one computed and written in fp32; under Triton's CPU interpreter (fp32, small) ``TOL_F32``
everywhere. Then: two runs give the same bits; a row's gradient does not depend on the batch
(where the forward's output does not); the kernels hold no atomic operation.
``test_interpreter_subprocess`` runs this file under ``TRITON_INTERPRET=1`` on a CPU box.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import Tensor
from triton_env import CUDA, DEV, DT, HAS_TRITON, INTERPRET, needs_kernels, same

from pytest_rlkernel_matrix.workload.kernels.r import autograd as ag

TOL_BF16 = 2e-2 if CUDA else 1e-5  # bf16 outputs or bf16 products (bf16 rounding: 4e-3)
TOL_F32 = 1e-4 if CUDA else 1e-5  # fp32 math on the same inputs
H, HQ, HKV, D, INTER, V = (1024, 16, 8, 128, 3072, 151936) if CUDA else (64, 4, 2, 16, 96, 300)
M = 300 if CUDA else 11


def tb() -> ModuleType:
    """The module, imported late so the interpreter setting is read first."""
    from pytest_rlkernel_matrix.workload.kernels.r import triton_backward

    return triton_backward


def rnd(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = DT) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def rel(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert not torch.isnan(a).any()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _rope(m: int) -> tuple[Tensor, Tensor]:
    ang = torch.rand(m, D // 2, generator=torch.Generator().manual_seed(3)).double() * 6
    return (torch.cat([ang.cos(), ang.cos()], -1).float().to(DEV),
            torch.cat([ang.sin(), ang.sin()], -1).float().to(DEV))


def _attn_inputs(b: int, t: int, s: int, offset: int) -> tuple[Tensor, ...]:
    """q ``[b, t]`` at positions ``offset + 0..t-1`` (each row of batch ``i`` shifted by i),
    keys ``[b, s]``: training (offset 0, s == t) or a prefill over earlier keys."""
    pos = (torch.arange(t)[None] + offset + torch.arange(b)[:, None] % 3).clamp_max(s - 1)
    return (rnd(b, t, HQ, D, seed=6), rnd(b, s, HKV, D, seed=7), rnd(b, s, HKV, D, seed=8),
            pos.to(DEV))


def _ref_grads(ref: Callable, args: list, grads: list[Tensor], leaves: list[int],
               **kw: object) -> list[Tensor]:
    """torch autograd of ``ref`` at fp32 leaves ``args[i] for i in leaves``."""
    ins = [a.detach().float().requires_grad_(True) if i in leaves else a
           for i, a in enumerate(args)]
    out = ref(*ins, **kw)
    outs = list(out) if isinstance(out, tuple) else [out]
    got = torch.autograd.grad([o.float() for o in outs[:len(grads)]], [ins[i] for i in leaves],
                              [g.float() for g in grads])
    return list(got)


def _cases() -> dict[str, Callable[[], tuple[list[Tensor], list[Tensor], list[float]]]]:
    """name -> () -> (the kernel's gradients, torch autograd's, the tolerance of each)."""

    def matmul() -> tuple:
        a, w = rnd(M, H, seed=1), rnd(INTER, H, seed=2, scale=0.05)
        g = rnd(M, INTER, seed=3, dtype=torch.float32)
        return (list(tb().matmul_bwd(g, a, w)), _ref_grads(ag.ref_matmul, [a, w, DT], [g],
                                                          [0, 1]), [TOL_BF16] * 2)

    def rmsnorm() -> tuple:
        x, w = rnd(M, H, seed=1), rnd(H, seed=2, scale=0.1) + 1
        g = rnd(M, H, seed=3)
        return (list(tb().rmsnorm_bwd(g, x, w, 1e-6)),
                _ref_grads(ag.ref_rmsnorm, [x, w, 1e-6, DT], [g], [0, 1]), [TOL_BF16] * 2)

    def qk_norm_rope() -> tuple:
        cos, sin = _rope(M)
        qkv = rnd(M, (HQ + 2 * HKV) * D, seed=1, dtype=torch.float32)
        qn, kn = rnd(D, seed=4, scale=0.1) + 1, rnd(D, seed=5, scale=0.1) + 1
        gs = [rnd(M, h, D, seed=10 + i) for i, h in enumerate((HQ, HKV, HKV))]
        got = tb().qk_norm_rope_bwd(*gs, qkv, cos, sin, qn, kn, HQ, HKV, 1e-6)
        ref = _ref_grads(ag.ref_qk_norm_rope, [qkv, cos, sin, qn, kn, HQ, HKV, 1e-6, DT], gs,
                         [0, 3, 4])
        return list(got), ref, [TOL_F32, TOL_BF16, TOL_BF16]  # norm weights: bf16 outputs

    def swiglu() -> tuple:
        gu, g = rnd(M, 2 * INTER, seed=1, dtype=torch.float32), rnd(M, INTER, seed=2)
        return ([tb().swiglu_bwd(g, gu)], _ref_grads(ag.ref_swiglu, [gu, DT], [g], [0]),
                [TOL_F32])

    def attention(b: int, t: int, s: int, offset: int) -> Callable[[], tuple]:
        def run() -> tuple:
            from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels as tk

            q, k, v, pos = _attn_inputs(b, t, s, offset)
            o = tk.attention(q, k, v, pos)
            g = rnd(*o.shape, seed=9)
            return (list(tb().attention_bwd(g, q, k, v, o, pos)),
                    _ref_grads(ag.ref_attention, [q, k, v, pos], [g], [0, 1, 2]),
                    [TOL_BF16] * 3)
        return run

    def logsumexp(selected: bool) -> Callable[[], tuple]:
        def run() -> tuple:
            z = rnd(M, V, seed=1, scale=3.0, dtype=torch.float32)
            g = rnd(M, seed=2, dtype=torch.float32)
            t = torch.randint(0, V, (M,), generator=torch.Generator().manual_seed(4)).to(DEV)
            if selected:
                return ([tb().logsumexp_bwd(g, z, t)],
                        _ref_grads(ag.ref_selected_logp, [z, t], [g], [0]), [TOL_F32])
            return ([tb().logsumexp_bwd(g, z)], _ref_grads(ag.ref_logsumexp, [z], [g], [0]),
                    [TOL_F32])
        return run

    b, t = (3, 150) if CUDA else (2, 9)
    return {"matmul": matmul, "rmsnorm": rmsnorm, "qk_norm_rope": qk_norm_rope,
            "swiglu": swiglu, "attention_training": attention(b, t, t, 0),
            "attention_prefill": attention(b, t // 2, t + 5, 5),
            "logsumexp": logsumexp(False), "selected_logp": logsumexp(True)}


CASES = sorted(_cases())


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("name", CASES)
def test_triton_backward_matches_torch_autograd_and_repeats(name: str) -> None:
    run = _cases()[name]
    got, ref, tols = run()
    assert len(got) == len(ref) == len(tols)
    for i, (g, r, tol) in enumerate(zip(got, ref, tols, strict=True)):
        assert g is not None and g.shape == r.shape, (name, i)
        assert bool(torch.isfinite(g).all()), (name, i)
        assert rel(g, r) < tol, (name, i, rel(g, r), tol)
    again = run()[0]
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), name  # run to run


@pytest.mark.gpu
@needs_kernels
def test_triton_backward_rows_batch_invariant() -> None:
    """A row's gradient does not depend on which rows are batched with it: the rows of a
    sub-batch equal the full batch's (weight gradients, sums over the batch, excepted)."""
    from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels as tk

    x, w = rnd(M, H, seed=1), rnd(H, seed=2, scale=0.1) + 1
    gy = rnd(M, H, seed=3)
    a, wm = rnd(M, H, seed=4), rnd(INTER, H, seed=5, scale=0.05)
    gm = rnd(M, INTER, seed=6)
    gu, gs = rnd(M, 2 * INTER, seed=7, dtype=torch.float32), rnd(M, INTER, seed=8)
    cos, sin = _rope(M)
    qkv = rnd(M, (HQ + 2 * HKV) * D, seed=9, dtype=torch.float32)
    qn, kn = rnd(D, seed=10, scale=0.1) + 1, rnd(D, seed=11, scale=0.1) + 1
    gq = [rnd(M, h, D, seed=12 + i) for i, h in enumerate((HQ, HKV, HKV))]
    z = rnd(M, V, seed=15, scale=3.0, dtype=torch.float32)
    gz = rnd(M, seed=16, dtype=torch.float32)
    tg = torch.randint(0, V, (M,), generator=torch.Generator().manual_seed(17)).to(DEV)

    def rows(lo: int, hi: int) -> list[Tensor]:
        return [tb().rmsnorm_bwd(gy[lo:hi], x[lo:hi], w, 1e-6)[0],
                tb().matmul_bwd(gm[lo:hi], a[lo:hi], wm, need_w=False)[0],
                tb().swiglu_bwd(gs[lo:hi], gu[lo:hi]),
                tb().qk_norm_rope_bwd(*[g[lo:hi] for g in gq], qkv[lo:hi], cos[lo:hi],
                                      sin[lo:hi], qn, kn, HQ, HKV, 1e-6)[0],
                tb().logsumexp_bwd(gz[lo:hi], z[lo:hi], tg[lo:hi])]

    full = rows(0, M)
    for lo, hi in ((0, 1), (3, 10), (M // 2, M - 1)):
        for f, part in zip(full, rows(lo, hi), strict=True):
            assert same(part, f[lo:hi]), (lo, hi)
    b, t = (5, 150) if CUDA else (3, 9)
    q, k, v, pos = _attn_inputs(b, t, t, 0)
    o = tk.attention(q, k, v, pos)
    g = rnd(*o.shape, seed=18)
    whole = tb().attention_bwd(g, q, k, v, o, pos)
    for sel in ([1], [0, 3], [4, 2]) if CUDA else ([1], [2, 0]):
        ix = torch.tensor(sel, device=DEV)
        part = tb().attention_bwd(g[ix], q[ix], k[ix], v[ix], o[ix], pos[ix])
        for p, f in zip(part, whole, strict=True):
            assert same(p, f[ix]), sel


@pytest.mark.gpu
@needs_kernels
def test_weight_gradient_over_padded_tokens_is_the_unpadded_bits() -> None:
    """``dW = g^T A`` over a token count that is not a multiple of 16 or of ``BLOCK_K``: the
    tokens axis padded with zeros (aligned rows, an unmasked K loop, issue 55) gives the bits of
    the product over the unpadded, masked operands, whatever the count."""
    from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels as tk

    unit = tk.matmul_config(DT, bool(torch.version.hip)).block_k
    w = rnd(INTER, H, seed=2, scale=0.05)
    for m in (1, 7, unit - 1, unit, unit + 5, 3 * unit + 17):
        a, g = rnd(m, H, seed=1), rnd(m, INTER, seed=3)
        padded = tb().tokens_last(a, unit)
        assert padded.shape == (H, -(-m // unit) * unit) and padded.is_contiguous()
        assert torch.equal(padded[:, :m], a.t()) and not padded[:, m:].any()
        got = tb().matmul_bwd(g, a, w, need_a=False)[1]
        want = tk.matmul(g.t().contiguous(), a.t().contiguous(), w.dtype)  # before issue 55
        assert got is not None and torch.equal(got, want), m


def test_backward_kernels_hold_no_atomics() -> None:
    src = (Path(__file__).resolve().parents[2] / "pytest_rlkernel_matrix" / "workload" /
           "kernels" / "r" / "triton_backward.py").read_text()
    assert "tl.atomic" not in src and "atomic_" not in src  # tl.atomic_add, atomic_cas, ...


@pytest.mark.skipif(CUDA or not HAS_TRITON or INTERPRET,
                    reason="runs this file's kernel tests under Triton's CPU interpreter: needs "
                           "triton installed and no GPU")
def test_interpreter_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:rlkernel_matrix", "-k", "not interpreter_subprocess",
                        __file__], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{len(CASES) + 3} passed" in r.stdout
