"""Batch invariance and accuracy of the Triton R kernels (``workload/kernels/r/triton_kernels.py``).

On a GPU: bf16 at qwen3-0.6b-like shapes. Without one, the same tests run under Triton's CPU
interpreter (fp32, small shapes) when ``TRITON_INTERPRET=1`` is set and triton is installed
(``test_interpreter_subprocess`` does that when triton is importable); otherwise they skip.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from types import ModuleType

import pytest
import torch
from triton_env import CUDA, DEV, DT, HAS_TRITON, INTERPRET, needs_kernels, same

# (hidden, q heads, kv heads, head dim, intermediate, vocab)
SHAPE = (1024, 16, 8, 128, 3072, 151936) if CUDA else (64, 4, 2, 16, 96, 300)


def tk() -> ModuleType:
    """The kernels module, imported late so the interpreter setting is read first."""
    from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels

    return triton_kernels


def rnd(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, DT)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any()
    return float((out - ref).norm() / ref.norm())


TOL = 2e-2 if CUDA else 1e-5  # bf16 outputs vs fp32 outputs
SIZES = [1, 2, 3, 7, 16, 64, 129, 300] if CUDA else [1, 2, 5]


@pytest.mark.gpu
@needs_kernels
@pytest.mark.parametrize("kn", [(1024, 4096), (2048, 1024), (3072, 1024)] if CUDA
                         else [(64, 96), (40, 33)])
def test_matmul_rows_batch_invariant(kn: tuple[int, int]) -> None:
    k, n = kn
    m_max = max(SIZES) + 20
    a, w = rnd(m_max, k, seed=1), rnd(n, k, seed=2, scale=0.05)
    full = tk().matmul(a, w, torch.float32)
    for m in SIZES:
        assert same(tk().matmul(a[:m], w, torch.float32), full[:m]), m
        assert same(tk().matmul(a[20:20 + m], w, torch.float32), full[20:20 + m]), m
    perm = torch.randperm(m_max, generator=torch.Generator().manual_seed(3)).to(DEV)
    assert same(tk().matmul(a[perm], w, torch.float32), full[perm])
    assert torch.equal(tk().matmul(a, w, DT), full.to(DT))  # epilogue cast = one rounding
    assert rel(full, a.double() @ w.double().t()) < 1e-5


@pytest.mark.gpu
@needs_kernels
def test_rmsnorm_and_swiglu_rows_batch_invariant() -> None:
    h, inter = SHAPE[0], SHAPE[4]
    x, w = rnd(310, h, seed=4), rnd(h, seed=5, scale=0.1) + 1
    y = tk().rmsnorm(x, w, 1e-6, DT)
    gu = rnd(310, 2 * inter, seed=6).float()
    s = tk().swiglu(gu, DT)
    for m in SIZES:
        assert torch.equal(tk().rmsnorm(x[:m], w, 1e-6, DT), y[:m])
        assert torch.equal(tk().rmsnorm(x[9:9 + m], w, 1e-6, DT), y[9:9 + m])
        assert torch.equal(tk().swiglu(gu[5:5 + m], DT), s[5:5 + m])
    xd = x.double()
    ref = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-6) * w.double()
    assert rel(y, ref) < TOL
    gd = gu.double()
    assert rel(s, torch.nn.functional.silu(gd[:, :inter]) * gd[:, inter:]) < TOL


@pytest.mark.gpu
@needs_kernels
def test_qk_norm_rope_rows_batch_invariant() -> None:
    _, hq, hkv, d, _, _ = SHAPE
    m = 300 if CUDA else 12
    qkv = rnd(m, (hq + 2 * hkv) * d, seed=7).float()
    ang = torch.rand(m, d // 2, generator=torch.Generator().manual_seed(8)).double() * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).float().to(DEV)
    sin = torch.cat([ang.sin(), ang.sin()], -1).float().to(DEV)
    qn, kn = rnd(d, seed=9, scale=0.1) + 1, rnd(d, seed=10, scale=0.1) + 1
    q, k, v = tk().qk_norm_rope(qkv, cos, sin, qn, kn, hq, hkv, 1e-6, DT)
    for n in SIZES:
        n = min(n, m - 3)
        q2, k2, v2 = tk().qk_norm_rope(qkv[3:3 + n], cos[3:3 + n], sin[3:3 + n], qn, kn, hq,
                                       hkv, 1e-6, DT)
        assert torch.equal(q2, q[3:3 + n]) and torch.equal(k2, k[3:3 + n])
        assert torch.equal(v2, v[3:3 + n])
    x = qkv.double().reshape(m, hq + 2 * hkv, d)

    def norm_rope(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6) * w.double()
        rot = torch.cat([-n[..., d // 2:], n[..., :d // 2]], -1)
        return n * cos.double()[:, None] + rot * sin.double()[:, None]

    assert rel(q, norm_rope(x[:, :hq], qn)) < TOL
    assert rel(k, norm_rope(x[:, hq:hq + hkv], kn)) < TOL
    assert rel(v, x[:, hq + hkv:]) < TOL


@pytest.mark.gpu
@needs_kernels
def test_qk_norm_rope_probe_outputs_and_drill() -> None:
    """A probe's switches: the stored fp32 norm outputs leave q/k/v bitwise as measured; the
    drill's scale multiplies q's (or k's) norm output before RoPE and nothing else."""
    _, hq, hkv, d, _, _ = SHAPE
    m = 40 if CUDA else 5
    qkv = rnd(m, (hq + 2 * hkv) * d, seed=27).float()
    ang = torch.rand(m, d // 2, generator=torch.Generator().manual_seed(28)).double() * 6
    cos = torch.cat([ang.cos(), ang.cos()], -1).float().to(DEV)
    sin = torch.cat([ang.sin(), ang.sin()], -1).float().to(DEV)
    qn, kn = rnd(d, seed=29, scale=0.1) + 1, rnd(d, seed=30, scale=0.1) + 1
    base = tk().qk_norm_rope(qkv, cos, sin, qn, kn, hq, hkv, 1e-6, DT)
    q, k, v, nq, nk = tk().qk_norm_rope(qkv, cos, sin, qn, kn, hq, hkv, 1e-6, DT,
                                        store_norm=True)
    assert all(torch.equal(a, b) for a, b in zip(base, (q, k, v), strict=True))
    assert nq.dtype == nk.dtype == torch.float32
    x = qkv.double().reshape(m, hq + 2 * hkv, d)
    for got, h, w in ((nq, x[:, :hq], qn), (nk, x[:, hq:hq + hkv], kn)):
        ref = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-6) * w.double()
        assert rel(got, ref) < 1e-5
    f = 1.0 + 2.0 ** -7
    q2, k2, v2, nq2, nk2 = tk().qk_norm_rope(qkv, cos, sin, qn, kn, hq, hkv, 1e-6, DT,
                                             store_norm=True, scale=(f, 1.0))
    assert torch.equal(nq2, nq) and torch.equal(nk2, nk)  # stored before the drill's scale
    assert torch.equal(k2, k) and torch.equal(v2, v) and not torch.equal(q2, q)
    n = nq.double() * f
    rot = torch.cat([-n[..., d // 2:], n[..., :d // 2]], -1)
    ref = n * cos.double()[:, None] + rot * sin.double()[:, None]
    assert rel(q2, ref) < TOL
    _, k3, _ = tk().qk_norm_rope(qkv, cos, sin, qn, kn, hq, hkv, 1e-6, DT, scale=(1.0, f))
    assert not torch.equal(k3, k)


def _probed_model_run(perturb: tuple[str, str] | None) -> dict[str, dict]:
    """R via Triton on both sides, with probe taps: rollout (prefill + decode) then the training
    recompute; each side's records ``{(sample, logit position): {operator: tensor}}``."""
    from pytest_rlkernel_matrix.workload.evidence.probe import ProbeRequest
    from pytest_rlkernel_matrix.workload.job import run_rollout, run_training
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling
    from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights
    from pytest_rlkernel_matrix.workload.parallel import Group

    cfg = PRESETS["small" if CUDA else "tiny"]
    w = init_weights(cfg, 0, DT, DEV)
    impls = dict.fromkeys(("attention", "ffn", "logp"), "rl_kernel")
    tiling = Tiling.for_device(DEV, 32)
    req = ProbeRequest(enabled=True, perturb=perturb)
    ks = {s: SideKernels.build(s, impls, DT, tiling, cfg.rms_norm_eps, "triton",
                               tap=req.tap(s, Group())) for s in ("training", "rollout")}
    gen = torch.Generator().manual_seed(1)
    plens = [5, 9, 3]
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).to(DEV) for n in plens]
    for s in ks:  # token 0 (the prefill's last row) and token 2 (a decode step)
        ks[s].tap.wanted = {(i, plens[i] + j - 1) for i in range(3) for j in (0, 2)}
    with torch.inference_mode():
        ro = run_rollout(Qwen3(cfg, {n: t.clone() for n, t in w.items()}, 32), ks["rollout"],
                         prompts, [4, 4, 4], 1.0, 0.95, torch.Generator(device=DEV).manual_seed(2),
                         ignore_eos=True)  # fixed lengths: drilled runs keep the same shapes
        train = run_training(Qwen3(cfg, w, 32), ks["training"], ro, 2, 1.0, [2, 0, 1])
    if perturb is None and not INTERPRET:  # the interpreter's numpy dot is not row-invariant
        for a, b in zip(train, ro.logprobs, strict=True):
            assert torch.equal(a, b)
    return {s: ks[s].tap.records for s in ks}


@pytest.mark.gpu
@needs_kernels
def test_probe_taps_every_operator_on_the_triton_path() -> None:
    """Every operator of the probe format is tapped on the Triton R path, with the same shapes
    and, on a GPU, the same bits on rollout and training (R/R). The drill on a fused operator
    (q_norm) and on down_proj changes exactly that operator first, by the drill's factor."""
    from pytest_rlkernel_matrix.workload.evidence.probe import PERTURB_FACTOR, operator_names
    from pytest_rlkernel_matrix.workload.model import PRESETS

    ops = [*operator_names(PRESETS["small" if CUDA else "tiny"].num_hidden_layers),
           "log_softmax"]
    base = _probed_model_run(None)
    assert set(base["training"]) == set(base["rollout"]) and len(base["training"]) == 6
    for key, row in base["training"].items():
        other = base["rollout"][key]
        assert sorted(row) == sorted(other) == sorted(ops), key  # every operator tapped
        for op in ops:
            assert row[op].shape == other[op].shape and row[op].dtype == other[op].dtype
            assert INTERPRET or torch.equal(row[op], other[op]), (key, op)
    drills = ["model.layers.1.self_attn.q_norm", "model.layers.1.mlp.down_proj"]
    for op in drills if CUDA else drills[:1]:  # the interpreter: the fused one only (slow)
        drilled = _probed_model_run(("rollout", op))
        for key in ((0, 4), (1, 8), (2, 2)):  # token 0: same inputs as undrilled (the prompt)
            row, was = drilled["rollout"][key], base["rollout"][key]
            first = next(o for o in ops if not torch.equal(row[o], was[o]))
            assert first == op, (key, first)
            assert torch.equal(row[op], was[op] * PERTURB_FACTOR)  # the drill, as recorded
            assert all(torch.equal(t, base["training"][key][o])  # training: undrilled
                       for o, t in drilled["training"][key].items())
        if not INTERPRET:  # the probe's view: training vs rollout on the same tokens
            for key, row in drilled["training"].items():
                other = drilled["rollout"][key]
                first = next(o for o in ops if not torch.equal(row[o], other[o]))
                assert first == op, (key, first)


def _attn_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    kk, vv = k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), kk) / math.sqrt(d)
    keys = torch.arange(k.shape[1], device=q.device)
    s = s.masked_fill(keys[None, None, None, :] > pos[:, None, :, None], float("-inf"))
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), vv).reshape(b, t, hq * d)


@pytest.mark.gpu
@needs_kernels
def test_attention_training_prefill_decode_bitwise() -> None:
    """Training (causal, K/V of the forward), prefill and decode (K/V cache read in place, with
    stale data past each row's position) give the same bits per query row, at any batch size,
    slot, and mix of positions."""
    _, hq, hkv, d, _, _ = SHAPE
    b, t, cap = (6, 150, 256) if CUDA else (3, 21, 32)
    q, k, v = rnd(b, t, hq, d, seed=11), rnd(b, t, hkv, d, seed=12), rnd(b, t, hkv, d, seed=13)
    pos = torch.arange(t, device=DEV)[None].expand(b, t)
    train = tk().attention(q, k, v, pos)
    assert rel(train, _attn_ref(q, k, v, pos)) < TOL
    kc, vc = rnd(b, cap, hkv, d, seed=14), rnd(b, cap, hkv, d, seed=15)  # stale cache contents
    kc[:, :t], vc[:, :t] = k, v
    for n in range(1, b + 1):  # batch sizes 1..N
        assert same(tk().attention(q[:n], k[:n], v[:n], pos[:n]), train[:n])
    pre = t // 3
    assert same(tk().attention(q[:, :pre], kc, vc, pos[:, :pre]), train[:, :pre])
    for step in sorted({0, 1, t // 2, t - 1}):  # decode at block edges and inside
        out = tk().attention(q[:, step:step + 1], kc, vc, pos[:, step:step + 1])
        assert same(out, train[:, step:step + 1]), step
    # one decode batch mixing rows at different positions, in a shuffled slot order
    rows = torch.tensor(list(range(b))[::-1], device=DEV)
    steps = torch.tensor([(7 * i + 3) % t for i in range(b)], device=DEV)
    out = tk().attention(q[rows, steps][:, None], kc[rows], vc[rows], steps[:, None])
    assert same(out[:, 0], train[rows, steps])


@pytest.mark.gpu
@needs_kernels
def test_logp_selected_full_and_batch_invariant() -> None:
    h, v = SHAPE[0], SHAPE[5]
    n = 70 if CUDA else 9
    x, w = rnd(n, h, seed=16), rnd(v, h, seed=17, scale=0.05)
    tgt = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(18)).to(DEV)
    for temp in (1.0, 0.7):
        (_, z), = tk().logits_chunks(x, w, temp)
        lse = tk().logsumexp(z)
        full = z - lse[:, None]
        sel = z.gather(-1, tgt[:, None])[:, 0] - lse
        assert torch.equal(full.gather(-1, tgt[:, None])[:, 0], sel)
        for m in SIZES[:5]:
            (_, zm), = tk().logits_chunks(x[4:4 + m], w, temp)
            assert torch.equal(tk().logsumexp(zm), lse[4:4 + m])
        ref = torch.log_softmax((x.double() @ w.double().t()) / temp, -1)
        assert (full.double() - ref).abs().max() < (1e-3 if CUDA else 1e-5)


@pytest.mark.gpu
@needs_kernels
@pytest.mark.skipif(not CUDA, reason="model-level check needs a GPU (interpreter too slow)")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_model_rollout_equals_training_bitwise(graphs: bool) -> None:
    """R via Triton: rollout (prefill + shrinking decode, eager or graphed) logprobs equal the
    training recompute over other micro-batches, bit for bit; graphs don't change the bits."""
    from pytest_rlkernel_matrix.workload.job import run_rollout, run_training
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling
    from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights

    cfg = PRESETS["small"]
    w = init_weights(cfg, 0, torch.bfloat16, DEV)
    impls = dict.fromkeys(("attention", "ffn", "logp"), "rl_kernel")
    tiling = Tiling.for_device(DEV, 96)
    ks = {s: SideKernels.build(s, impls, torch.bfloat16, tiling, cfg.rms_norm_eps, "triton")
          for s in ("training", "rollout")}
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg.vocab_size, (int(n),), generator=gen).to(DEV)
               for n in torch.randint(4, 24, (40,), generator=gen)]
    max_new = torch.randint(20, 60, (40,), generator=gen).tolist()
    with torch.inference_mode():
        ro = run_rollout(Qwen3(cfg, {n: t.clone() for n, t in w.items()}, 96), ks["rollout"],
                         prompts, max_new, 1.0, 0.95,
                         torch.Generator(device=DEV).manual_seed(2), graphs)
        train = run_training(Qwen3(cfg, w, 96), ks["training"], ro, 7, 1.0,
                             torch.randperm(40, generator=gen).tolist())
    graph_mode = "compiled_hip_graph" if torch.version.hip else "compiled_cuda_graph"
    assert ro.execution_mode == (graph_mode if graphs else "eager")
    for a, b in zip(train, ro.logprobs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(CUDA or not HAS_TRITON or INTERPRET,
                    reason="runs this file under Triton's CPU interpreter: needs triton "
                           "installed and no GPU")
def test_interpreter_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:rlkernel_matrix", __file__], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "passed" in r.stdout
