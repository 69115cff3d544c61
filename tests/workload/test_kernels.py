"""R kernels are batch-, position- and prefill/decode-invariant; P differs from R a little."""

from __future__ import annotations

import pytest
import torch

from pytest_rlkernel_matrix.workload.kernels.side import (
    SideKernels,
    Tiling,
    r_core_attention,
    r_matmul,
)
from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]
ALL_R = {"attention": "rl_kernel", "ffn": "rl_kernel", "logp": "rl_kernel"}
ALL_P = {"attention": "production", "ffn": "production", "logp": "production"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kn", [(128, 768), (256, 512), (1024, 3072)])
def test_r_matmul_row_count_invariant(device: str, kn: tuple[int, int]) -> None:
    k, n = kn
    tile = Tiling.for_device(torch.device(device), 64).row_tile
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(300, k, generator=gen).to(device)
    b = torch.randn(k, n, generator=gen).to(device)
    full = r_matmul(a, b, tile)
    for m in [*range(1, 71), 97, 128, 129, 200, 300]:
        assert torch.equal(r_matmul(a[:m], b, tile), full[:m]), m
    for i in range(0, 300, 7):  # a row alone gives the same bits as inside any batch
        assert torch.equal(r_matmul(a[i:i + 1], b, tile), full[i:i + 1]), i


def test_plain_mm_is_not_row_invariant_on_this_platform_sanity() -> None:
    """Documents why R exists: the native GEMM's bits depend on the row count (CPU here)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=gen), torch.randn(256, 512, generator=gen)
    full = torch.mm(a, b)
    diffs = sum(not torch.equal(torch.mm(a[i:i + 1], b), full[i:i + 1]) for i in range(64))
    assert diffs >= 0  # informative only: platforms differ; R must not depend on it


@pytest.mark.parametrize("device", DEVICES)
def test_r_attention_prefill_equals_decode(device: str) -> None:
    dev = torch.device(device)
    span, b, hq, hkv, d = 48, 3, 4, 2, 32
    tiling = Tiling.for_device(dev, span)
    gen = torch.Generator().manual_seed(1)
    t = 40
    q = torch.randn(b, t, hq, d, generator=gen).to(dev)
    k = torch.randn(b, t, hkv, d, generator=gen).to(dev).to(torch.bfloat16)
    v = torch.randn(b, t, hkv, d, generator=gen).to(dev).to(torch.bfloat16)
    pos = torch.arange(t, device=dev)[None].expand(b, t)
    prefill = r_core_attention(q, pos, k, v, tiling)
    cache_k = torch.zeros(b, span, hkv, d, dtype=torch.bfloat16, device=dev)
    cache_v = torch.zeros_like(cache_k)
    for p in range(t):  # decode token by token against a growing cache
        cache_k[:, p], cache_v[:, p] = k[:, p], v[:, p]
        step = r_core_attention(q[:, p:p + 1], pos[:, p:p + 1], cache_k, cache_v, tiling)
        assert torch.equal(step[:, 0], prefill[:, p]), p
    # a single sequence alone (batch 1) matches its row in the batch
    alone = r_core_attention(q[1:2], pos[1:2], k[1:2], v[1:2], tiling)
    assert torch.equal(alone[0], prefill[1])


def _model(device: str) -> Qwen3:
    cfg = PRESETS["tiny"]
    w = init_weights(cfg, 0, torch.bfloat16, torch.device(device))
    return Qwen3(cfg, w, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_r_logp_row_count_invariant(device: str) -> None:
    m = _model(device)
    k = SideKernels.build("training", ALL_R, torch.bfloat16,
                          Tiling.for_device(torch.device(device), 64), m.cfg.rms_norm_eps)
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(150, m.cfg.hidden_size, generator=gen).to(device).to(torch.bfloat16)
    tgt = torch.randint(0, m.cfg.vocab_size, (150,), generator=gen).to(device)
    full = m.selected_logprobs(k, h, tgt, 0.8)
    for n in [1, 2, 5, 17, 33, 64, 100]:
        assert torch.equal(m.selected_logprobs(k, h[:n], tgt[:n], 0.8), full[:n])
    whole = m.logprobs(k, h[:7], 0.8)  # rollout's full-vocab path gathers the same bits
    assert torch.equal(whole.gather(-1, tgt[:7, None])[:, 0], full[:7])


@pytest.mark.parametrize("device", DEVICES)
def test_r_model_prefill_decode_bitwise_and_p_close_not_equal(device: str) -> None:
    m = _model(device)
    tiling = Tiling.for_device(torch.device(device), 64)
    gen = torch.Generator().manual_seed(3)
    toks = torch.randint(2, m.cfg.vocab_size, (2, 24), generator=gen).to(device)
    pos = torch.arange(24, device=device)[None].expand(2, 24)
    out = {}
    for name, impls in (("R", ALL_R), ("P", ALL_P)):
        train = SideKernels.build("training", impls, torch.bfloat16, tiling, m.cfg.rms_norm_eps)
        roll = SideKernels.build("rollout", impls, torch.bfloat16, tiling, m.cfg.rms_norm_eps)
        full = m.hidden(train, toks, pos, None)
        caches = m.new_cache(2)
        m.hidden(roll, toks[:, :8], pos[:, :8], caches)  # prefill
        steps = [m.hidden(roll, toks[:, p:p + 1], pos[:, p:p + 1], caches)[:, 0]
                 for p in range(8, 24)]
        dec = torch.stack(steps, dim=1)
        tgt = toks[:, 9:].reshape(-1)
        lp_train = m.selected_logprobs(train, full[:, 8:23].reshape(-1, full.shape[-1]), tgt, 1.0)
        lp_roll = m.selected_logprobs(roll, dec[:, :15].reshape(-1, dec.shape[-1]), tgt, 1.0)
        out[name] = (lp_train, lp_roll)
    assert torch.equal(*out["R"])
    r_train, p_train = out["R"][0], out["P"][0]
    assert torch.allclose(r_train, p_train, atol=0.1) and not torch.equal(r_train, p_train)
