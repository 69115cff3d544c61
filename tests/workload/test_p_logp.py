"""P's chunked training log-probabilities (workload/kernels/p/p_logp.py) against today's unchunked
P."""

from __future__ import annotations

import pytest
import torch

from pytest_rlkernel_matrix.workload.kernels.p import native, p_logp
from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling
from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights

ALL_P = {"attention": "production", "ffn": "production", "logp": "production"}


def _unchunked(hn: torch.Tensor, w: torch.Tensor, t: torch.Tensor, temp: float) -> torch.Tensor:
    """Today's P before issue 46: the whole micro-batch's logits and log-softmax at once."""
    lp = native.megatron_log_softmax(torch.nn.functional.linear(hn, w), temp)
    return lp.gather(-1, t[:, None])[:, 0]


def _case(n: int = 150, h: int = 128, v: int = 512, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hn = (torch.randn(n, h, generator=gen)).to(torch.bfloat16)
    w = (0.08 * torch.randn(v, h, generator=gen)).to(torch.bfloat16)
    t = torch.randint(0, v, (n,), generator=gen)
    g = torch.randn(n, generator=gen)
    return hn, w, t, g


@pytest.mark.parametrize("rows", [1, 7, 64, 149, 150, 4096])
@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_forward_is_todays_p_bit_for_bit(rows: int, temp: float) -> None:
    hn, w, t, _ = _case()
    want = _unchunked(hn, w, t, temp)
    got = p_logp.selected(hn, w, t, temp, rows)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with torch.no_grad():  # the no-grad path (the reported logprobs) is the same function
        assert torch.equal(p_logp.selected(hn, w, t, temp, rows), want)


@pytest.mark.parametrize("rows", [7, 64, 150, 4096])
def test_gradients_one_chunk_bitwise_several_chunks_fp32_sum(rows: int) -> None:
    hn, w, t, g = _case(seed=1)
    ref_h, ref_w = hn.clone().requires_grad_(), w.clone().requires_grad_()
    _unchunked(ref_h, ref_w, t, 0.8).backward(g)
    got_h, got_w = hn.clone().requires_grad_(), w.clone().requires_grad_()
    p_logp.selected(got_h, got_w, t, 0.8, rows).backward(g)
    assert got_h.grad is not None and got_w.grad is not None
    assert ref_h.grad is not None and ref_w.grad is not None
    # d hn is per row: today's bits whatever the chunking
    assert torch.equal(got_h.grad, ref_h.grad)
    if rows >= hn.shape[0]:  # one chunk: autograd's own d W
        assert torch.equal(got_w.grad, ref_w.grad)
    else:  # the same fp32 sum in another order, then one rounding to bf16: at most 1 ulp
        assert got_w.grad.dtype == torch.bfloat16
        ref = ref_w.grad.float().abs()
        ulp = torch.where(ref > 0, 2.0 ** (torch.floor(torch.log2(ref)) - 7), 2.0 ** -133)
        off = (got_w.grad.float() - ref_w.grad.float()).abs()
        assert bool((off <= ulp).all())
        assert float((off > 0).float().mean()) < 1e-3  # and rarely even that


def test_training_side_uses_it_and_matches_the_full_graph() -> None:
    """The P training logp module goes through the chunked function (Megatron side only)."""
    cfg = PRESETS["tiny"]
    m = Qwen3(cfg, init_weights(cfg, 0, torch.bfloat16, torch.device("cpu")), 64)
    k = SideKernels.build("training", ALL_P, torch.bfloat16,
                          Tiling.for_device(torch.device("cpu"), 64), cfg.rms_norm_eps)
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(90, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    tgt = torch.randint(0, cfg.vocab_size, (90,), generator=gen)
    got = m.selected_logprobs(k, h, tgt, 0.9)
    full = k.logp._p_full(h, m.weights["model.norm.weight"], m.weights["lm_head.weight"], 0.9)
    assert torch.equal(got, full.gather(-1, tgt[:, None])[:, 0])


def test_empty_and_chunk_rows() -> None:
    hn, w, t, _ = _case(n=0)
    assert p_logp.selected(hn, w, t, 1.0).shape == (0,)
    assert p_logp.chunk_rows(151936, 2 ** 27) == 883
    assert p_logp.chunk_rows(512, 2 ** 27) == 2 ** 18
