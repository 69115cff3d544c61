"""The Triton R forward's backward (``workload/kernels/r/autograd.py``): fast forward, then the
Triton
backward kernels (the default) or the native recompute.

CPU (always): the generic ``Op`` over the torch R path's own primitives as the fast functions:
the forward is the fast function's bits, the gradients are the native autograd gradients of the
reference expression and the same bits run to run. With the real Triton kernels (a GPU, or
Triton's CPU interpreter: ``test_interpreter_subprocess`` runs the kernel tests of this file
with ``TRITON_INTERPRET=1``): the learning forward's logprobs are the no-grad Triton forward's
bits, two learning steps give the same gradients and weights, and the gradients are close to
the P path's.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor
from triton_env import CUDA, DEV, DT, HAS_TRITON, INTERPRET, needs_kernels

from pytest_rlkernel_matrix.workload import env as wenv
from pytest_rlkernel_matrix.workload.kernels import base as kn
from pytest_rlkernel_matrix.workload.kernels.r import autograd as ag
from pytest_rlkernel_matrix.workload.training import rl

ROOT = Path(__file__).resolve().parents[2]
rl.prepare_deterministic(DEV)  # before the first cuBLAS call: deterministic cuBLAS


def rnd(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = torch.float32,
        grad: bool = True) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(grad)


def rel(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# CPU: the generic Function over the torch R path's primitives.

TILE = 8


def fast_rmsnorm(x: Tensor, w: Tensor, eps: float, dt: torch.dtype) -> Tensor:
    return kn._tiled(lambda t: (kn._r_rms(t.float(), w.float(), eps),), TILE, x)[0].to(dt)


def fast_matmul(a: Tensor, w: Tensor, dt: torch.dtype) -> Tensor:
    return kn.r_matmul(a, w.float().t().contiguous(), TILE).to(dt)


def fast_qk_norm_rope(qkv: Tensor, cos: Tensor, sin: Tensor, qn: Tensor, knw: Tensor, hq: int,
                      hkv: int, eps: float, dt: torch.dtype, *, store_norm: bool = False,
                      scale: tuple[float, float] = (1.0, 1.0)) -> tuple[Tensor, ...]:
    d = qn.shape[0]

    def pre(x: Tensor, c: Tensor, s: Tensor) -> tuple[Tensor, ...]:
        h = x.reshape(-1, hq + 2 * hkv, d)
        q, k = kn._r_rms(h[:, :hq], qn.float(), eps), kn._r_rms(h[:, hq:hq + hkv], knw.float(), eps)
        nq, nk = q, k
        q, k = q * scale[0], k * scale[1]
        q = q * c[:, None] + kn.native.rotate_half(q) * s[:, None]
        k = k * c[:, None] + kn.native.rotate_half(k) * s[:, None]
        return q.to(dt), k.to(dt), h[:, hq + hkv:].to(dt), nq, nk

    out = kn._tiled(pre, TILE, qkv, cos, sin)
    return out if store_norm else out[:3]


def fast_swiglu(gu: Tensor, dt: torch.dtype) -> Tensor:
    i = gu.shape[1] // 2

    def act(x: Tensor) -> tuple[Tensor]:
        g = x[:, :i].float()
        return ((g * torch.sigmoid(g) * x[:, i:].float()).to(dt),)

    return kn._tiled(act, TILE, gu)[0]


def fast_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor) -> Tensor:
    tiling = kn.Tiling.for_device(torch.device("cpu"), k.shape[1])
    return kn.r_core_attention(q.float(), pos, k, v, tiling).to(q.dtype)


def fast_logsumexp(z: Tensor) -> Tensor:
    def lse(t: Tensor) -> tuple[Tensor]:
        m = t.amax(-1, keepdim=True)
        return ((m + torch.log(torch.exp(t - m).sum(-1, keepdim=True)))[:, 0],)

    return kn._tiled(lse, TILE, z)[0]


def _qkv_case() -> tuple[tuple, dict]:
    m, hq, hkv, d = 13, 4, 2, 16
    ang = torch.rand(m, d // 2, generator=torch.Generator().manual_seed(3)).double() * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()
    args = (rnd(m, (hq + 2 * hkv) * d, seed=1), cos, sin, rnd(d, seed=4, scale=0.1) + 1,
            rnd(d, seed=5, scale=0.1) + 1, hq, hkv, 1e-6, torch.float32)
    return args, {}


def _attn_case() -> tuple[tuple, dict]:
    b, t, hq, hkv, d = 2, 11, 4, 2, 16
    pos = torch.arange(t)[None].expand(b, t)
    return (rnd(b, t, hq, d, seed=6), rnd(b, t, hkv, d, seed=7), rnd(b, t, hkv, d, seed=8),
            pos), {}


CASES: dict[str, tuple[Callable, Callable, Callable[[], tuple[tuple, dict]]]] = {
    "rmsnorm": (fast_rmsnorm, ag.ref_rmsnorm, lambda: (
        (rnd(21, 64, seed=1), rnd(64, seed=2, scale=0.1) + 1, 1e-6, torch.float32), {})),
    "matmul": (fast_matmul, ag.ref_matmul, lambda: (
        (rnd(21, 64, seed=1), rnd(40, 64, seed=2, scale=0.05), torch.float32), {})),
    "qk_norm_rope": (fast_qk_norm_rope, ag.ref_qk_norm_rope, _qkv_case),
    "qk_norm_rope_probe": (fast_qk_norm_rope, ag.ref_qk_norm_rope, lambda: (
        _qkv_case()[0], {"store_norm": True, "scale": (1.0 + 2.0 ** -7, 1.0)})),
    "swiglu": (fast_swiglu, ag.ref_swiglu, lambda: ((rnd(21, 96, seed=1), torch.float32), {})),
    "attention": (fast_attention, ag.ref_attention, _attn_case),
    "logsumexp": (fast_logsumexp, ag.ref_logsumexp, lambda: ((rnd(21, 300, seed=1),), {})),
}


def _grads(fn: Callable, args: tuple, kw: dict) -> tuple[list[Tensor], list[Tensor | None]]:
    """Outputs of ``fn`` and the gradients of a fixed random projection of them."""
    ins = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a
           for a in args]
    out = fn(*ins, **kw)
    outs = list(out) if isinstance(out, tuple) else [out]
    gen = torch.Generator().manual_seed(99)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum()
               for o in outs[:3])
    leaves = [a for a in ins if isinstance(a, Tensor) and a.requires_grad]
    got = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in outs], list(got)


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_forward_is_fast_bits_backward_is_the_reference_gradient(name: str) -> None:
    fast, ref, case = CASES[name]
    args, kw = case()
    vjp = ag.vjp_matmul if name == "matmul" else None
    op = ag.Op(name, fast, None if vjp else ref, vjp)
    outs, grads = _grads(op, args, kw)
    with torch.no_grad():
        direct = fast(*args, **kw)
    direct = list(direct) if isinstance(direct, tuple) else [direct]
    assert len(outs) == len(direct)
    assert all(torch.equal(a, b) for a, b in zip(outs, direct, strict=True))  # (a) fast's bits
    ref_outs, ref_grads = _grads(ref, args, kw)  # native autograd through the reference
    assert len(grads) == len(ref_grads) and all(g is not None for g in grads)
    for g, r in zip(grads, ref_grads, strict=True):
        assert r is not None and g is not None and rel(g, r) < 1e-5, name  # (b) close
    for o, r in zip(outs, ref_outs, strict=True):
        assert rel(o, r) < 1e-5, name  # the fast function and the reference: the same math
    _, again = _grads(op, args, kw)
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))  # run to run
    if name == "qk_norm_rope_probe":  # the stored norms are outputs without a gradient path
        assert len(outs) == 5 and outs[3].dtype == torch.float32


def test_op_is_the_fast_function_without_autograd() -> None:
    op = ag.Op("rmsnorm", fast_rmsnorm, ag.ref_rmsnorm)
    x, w = rnd(9, 64, seed=1), rnd(64, seed=2)
    with torch.no_grad():
        assert op(x, w, 1e-6, torch.float32).grad_fn is None
    with torch.inference_mode():
        assert op(x, w, 1e-6, torch.float32).grad_fn is None
    assert op(x.detach(), w.detach(), 1e-6, torch.float32).grad_fn is None
    y = op(x, w, 1e-6, torch.float32)
    assert y.grad_fn is not None and "_Recompute" in type(y.grad_fn).__name__


def test_backward_mode_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(wenv.BACKWARD_ENV, raising=False)
    assert wenv.backward_mode() == "triton"
    for mode in ("recompute", "tiled"):
        monkeypatch.setenv(wenv.BACKWARD_ENV, mode)
        assert wenv.backward_mode() == mode
    assert sorted(ag.BACKWARD_METHODS) == sorted(wenv.R_BACKWARDS)
    monkeypatch.setenv(wenv.BACKWARD_ENV, "atomics")
    with pytest.raises(wenv.UsageError, match="RLK_REF_R_BACKWARD='atomics'"):
        wenv.backward_mode()
    with pytest.raises(ValueError, match="RLK_REF_R_BACKWARD='atomics'"):
        ag.triton_ops()  # the kernel set reads the same variable
    assert ag.triton_ops("triton").mode == "triton"
    assert ag.triton_ops("tiled").mode == ag.triton_ops("recompute").mode == "recompute"


@pytest.mark.parametrize("mode", ["", "tiled"], ids=["default", "tiled"])
def test_job_records_the_backward_method(tmp_path: Path, mode: str) -> None:
    """The manifest says how the learning step's backward ran; R/R stays bitwise either way (on
    a GPU: the loss on the Triton forward, or the tiled torch R path beside a no-grad one)."""
    from test_job import mismatches, run_cell

    proc, d = run_cell(tmp_path / "c", args=["--steps", "1"],
                       extra_env={wenv.BACKWARD_ENV: mode} if mode else None)
    assert proc.returncode == 0, proc.stderr[-2000:]
    learning = json.loads((d / "manifest.json").read_text())["learning"]
    expected = (mode or "triton") if CUDA and HAS_TRITON else "own"
    assert learning["backward_method"] == expected
    assert learning["backward_kernels"] == ag.BACKWARD_METHODS.get(expected,
                                                                   "training side's own")
    bad, n = mismatches(d)
    assert bad == 0 and n > 0


def test_bad_backward_mode_is_a_usage_error_before_the_step(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL_", "RLK_REF_"))}
    env.update(RL_KERNEL_MODE="strict", RL_KERNEL_ARTIFACT_DIR=str(tmp_path / "a"),
               RL_KERNEL_RUN_ID="a", PYTHONPATH=str(ROOT), RLK_REF_R_BACKWARD="fast")
    proc = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.workload"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "RLK_REF_R_BACKWARD='fast'" in proc.stderr
    assert not (tmp_path / "a" / "manifest.json").exists()


# ---------------------------------------------------------------------------------------------
# The real Triton kernels: a learning step of the model (CUDA, or the interpreter on CPU).


def _triton_cases() -> dict[str, tuple[tuple, dict]]:
    """Inputs of each Triton op (GPU: bf16 at qwen3-0.6b's widths; interpreter: fp32, small)."""
    h, hq, hkv, d, inter, v = (1024, 16, 8, 128, 3072, 151936) if CUDA else (64, 4, 2, 16, 96, 300)
    m = 300 if CUDA else 11

    def t(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = DT) -> Tensor:
        return rnd(*shape, seed=seed, scale=scale, dtype=dtype).to(DEV).requires_grad_(True)

    ang = torch.rand(m, d // 2, generator=torch.Generator().manual_seed(3)).double() * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).float().to(DEV)
    sin = torch.cat([ang.sin(), ang.sin()], -1).float().to(DEV)
    qkv = (t(m, (hq + 2 * hkv) * d, seed=1, dtype=torch.float32), cos, sin,
           t(d, seed=4, scale=0.1) + 1, t(d, seed=5, scale=0.1) + 1, hq, hkv, 1e-6, DT)
    b, s = (3, 150) if CUDA else (2, 9)
    pos = torch.arange(s, device=DEV)[None].expand(b, s)
    return {
        "rmsnorm": ((t(m, h, seed=1), t(h, seed=2, scale=0.1) + 1, 1e-6, DT), {}),
        "matmul": ((t(m, h, seed=1), t(inter, h, seed=2, scale=0.05), torch.float32), {}),
        "qk_norm_rope": (qkv, {}),
        "qk_norm_rope_probe": (qkv, {"store_norm": True, "scale": (1.0, 1.0 + 2.0 ** -7)}),
        "swiglu": ((t(m, 2 * inter, seed=1, dtype=torch.float32), DT), {}),
        "attention": ((t(b, s, hq, d, seed=6), t(b, s, hkv, d, seed=7), t(b, s, hkv, d, seed=8),
                       pos), {}),
        "logsumexp": ((t(m, v, seed=1, scale=3.0, dtype=torch.float32),), {}),
    }


TRITON_OPS = ["rmsnorm", "matmul", "qk_norm_rope", "qk_norm_rope_probe", "swiglu", "attention",
              "logsumexp"]


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("name", TRITON_OPS)
def test_triton_op_forward_bits_reference_close_backward_run_to_run(name: str) -> None:
    """Each wrapped Triton op: the forward is the kernel's bits; the reference expression its
    backward recomputes is the kernel's math (close); the gradients repeat bit for bit."""
    from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels as tk

    args, kw = _triton_cases()[name]
    op_name = name.removesuffix("_probe")
    op = getattr(ag.triton_ops(), op_name)
    with rl.deterministic(DEV):
        outs, grads = _grads(op, args, kw)
        again = _grads(op, args, kw)[1]
    with torch.no_grad():
        direct = getattr(tk, op_name)(*args, **kw)
    direct = list(direct) if isinstance(direct, tuple) else [direct]
    assert all(torch.equal(a, b) for a, b in zip(outs, direct, strict=True))
    with torch.no_grad():
        ref = getattr(ag, f"ref_{op_name}")(*args, **kw)
    ref = list(ref) if isinstance(ref, tuple) else [ref]
    for o, r in zip(outs, ref, strict=True):
        assert rel(o, r) < (2e-2 if CUDA else 1e-5), name
    assert grads and all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))


def _learn(backend: str, impl: str, learn: bool, opt_step: bool = False,
           dtype: torch.dtype = DT) -> tuple[list[Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """One training pass (``learn``: with the GRPO loss and backward, then optionally one
    AdamW step) of a fixed batch at temperature 0.7; returns the logprobs, the gradients and
    the weights."""
    from pytest_rlkernel_matrix.workload.evidence.artifacts import Rollout
    from pytest_rlkernel_matrix.workload.job import run_training
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling
    from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights

    cfg = PRESETS["small" if CUDA else "tiny"]
    gen = torch.Generator().manual_seed(0)
    plens, new = ([9, 17, 5, 23, 12, 30], [40, 25, 33, 18, 40, 9]) if CUDA else (
        [3, 4, 2], [2, 3, 3])  # the interpreter runs each Triton program in Python: short
    toks = [torch.randint(2, cfg.vocab_size, (p + m,), generator=gen).to(DEV)
            for p, m in zip(plens, new, strict=True)]
    ro = Rollout(toks, plens, [torch.zeros(m) for m in new])
    span = 96 if CUDA else 32
    w = init_weights(cfg, 0, dtype, DEV)
    params = [w[n] for n in sorted(w)]
    impls = dict.fromkeys(("attention", "ffn", "logp"), impl)
    k = SideKernels.build("training", impls, dtype, Tiling.for_device(DEV, span),
                          cfg.rms_norm_eps, backend)
    order = [2, 0, 5, 1, 4, 3] if CUDA else [2, 0, 1]
    if not learn:
        with torch.no_grad():
            lp = run_training(Qwen3(cfg, w, span), k, ro, 2, 0.7, order)
        return lp, {}, w
    for p in params:
        p.requires_grad_(True)
    adv = rl.grpo_advantages([0.1, 0.7, 0.4, 0.9, 0.2, 0.5][:len(toks)], 2)
    lp = run_training(Qwen3(cfg, w, span), k, ro, 2, 0.7, order,
                      learn=rl.Learn(adv, sum(new), None))
    grads = {n: t.grad.detach().clone() for n, t in w.items() if t.grad is not None}
    if opt_step:
        with rl.deterministic(DEV):
            rl.make_optimizer(params, 1e-3).step()
    return lp, grads, {n: t.detach() for n, t in w.items()}


@pytest.mark.gpu
@needs_kernels
def test_triton_learning_step_forward_bits_deterministic_backward_close_to_p() -> None:
    """The learning forward's logprobs are the no-grad Triton forward's bits (the loss runs on
    the Triton forward); two learning steps give the same gradients and weights, bit for bit;
    the gradients are close to the P path's."""
    plain, _, _ = _learn("triton", "rl_kernel", learn=False)
    lp, grads, weights = _learn("triton", "rl_kernel", learn=True, opt_step=True)
    assert all(torch.equal(a, b) for a, b in zip(lp, plain, strict=True))
    lp2, grads2, weights2 = _learn("triton", "rl_kernel", learn=True, opt_step=True)
    assert all(torch.equal(a, b) for a, b in zip(lp2, lp, strict=True))
    assert sorted(grads) == sorted(grads2) and len(grads) == len(weights)
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)
    assert all(torch.equal(weights[n], weights2[n]) for n in weights)
    _, p_grads, _ = _learn("torch", "production", learn=True)
    errs = {n: rel(grads[n], p_grads[n]) for n in grads}
    worst = max(errs, key=errs.__getitem__)
    if not CUDA:  # fp32 (the interpreter): the same math, to rounding
        assert errs[worst] < 1e-4, (worst, errs[worst])
        return
    # bf16: R's gradients are as close to fp32 P's as bf16 P's are (P's own rounding noise)
    _, p32, _ = _learn("torch", "production", learn=True, dtype=torch.float32)
    for n in grads:
        r_err, p_err = rel(grads[n], p32[n]), rel(p_grads[n], p32[n])
        assert r_err <= 2 * p_err + 1e-2, (n, r_err, p_err)
    flat = [torch.cat([g[n].double().flatten() for n in sorted(grads)]) for g in (grads, p32)]
    assert rel(*flat) < 2e-2, rel(*flat)
    assert math.isfinite(errs[worst])


@pytest.mark.skipif(CUDA or not HAS_TRITON or INTERPRET,
                    reason="runs this file's kernel tests under Triton's CPU interpreter: needs "
                           "triton installed and no GPU")
def test_interpreter_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:rlkernel_matrix", "-k", "triton_", __file__], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{len(TRITON_OPS) + 1} passed" in r.stdout
