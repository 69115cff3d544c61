"""R's torch attention: a row's bits depend on nothing but the row (issue 46's invariance
tests): batch composition, order, padding, the cache's
capacity, prefill vs decode, micro-batch size."""

from __future__ import annotations

import pytest
import torch

from pytest_rlkernel_matrix.workload.kernels.side import Tiling, r_core_attention

DEV = torch.device("cpu")
HQ, HKV, D = 4, 2, 32


def _qkv(b: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, HQ, D, generator=gen)
    k = torch.randn(b, t, HKV, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, t, HKV, D, generator=gen).to(torch.bfloat16)
    return q, k, v


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    b, t = q.shape[:2]
    return r_core_attention(q, torch.arange(t)[None].expand(b, t), k, v, tiling)


def test_rows_independent_of_batch_order_padding_and_capacity() -> None:
    tiling = Tiling.for_device(DEV, 256)  # key blocks of 32: lengths below cross 1-4 blocks
    lengths = [5, 33, 64, 100, 7]
    seqs = [_qkv(1, n, seed=i) for i, n in enumerate(lengths)]
    alone = [_causal(*s, tiling)[0] for s in seqs]
    t = max(lengths) + 11  # every row right-padded past the longest one
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [3, 0, 4, 1, 2], [1, 3]):
        q = torch.zeros(len(order), t, HQ, D)
        k = torch.zeros(len(order), t, HKV, D, dtype=torch.bfloat16)
        v = torch.zeros_like(k)
        for r, i in enumerate(order):
            n = lengths[i]
            q[r, :n], k[r, :n], v[r, :n] = seqs[i][0][0], seqs[i][1][0], seqs[i][2][0]
        out = _causal(q, k, v, tiling)
        for r, i in enumerate(order):
            assert torch.equal(out[r, :lengths[i]], alone[i]), (order, i)
    # a cache far larger than the keys in use, with garbage past them, gives the same bits
    q, k, v = seqs[3]
    big_k = torch.randn(1, 1000, HKV, D).to(torch.bfloat16)
    big_v = torch.randn(1, 1000, HKV, D).to(torch.bfloat16)
    big_k[:, :100], big_v[:, :100] = k, v
    pos = torch.arange(100)[None]
    got = r_core_attention(q, pos, big_k, big_v, tiling)
    assert torch.equal(got[0], alone[3])


@pytest.mark.parametrize("b", [1, 3, 6])
def test_decode_against_a_growing_cache_equals_training(b: int) -> None:
    tiling = Tiling.for_device(DEV, 160)
    t = 70
    q, k, v = _qkv(b, t, seed=7)
    train = _causal(q, k, v, tiling)
    ck = torch.zeros(b, 160, HKV, D, dtype=torch.bfloat16)
    cv = torch.zeros_like(ck)
    ck[:, :20], cv[:, :20] = k[:, :20], v[:, :20]
    pre = r_core_attention(q[:, :20], torch.arange(20)[None].expand(b, 20), ck, cv, tiling)
    assert torch.equal(pre, train[:, :20])
    # rows at different positions in one decode batch (a shrinking, ragged vLLM batch)
    lens = torch.tensor([20 + 9 * r for r in range(b)])
    for r in range(b):
        ck[r, :lens[r]], cv[r, :lens[r]] = k[r, :lens[r]], v[r, :lens[r]]
    for _ in range(t - 20 - 9 * (b - 1)):
        rows = torch.arange(b)
        ck[rows, lens], cv[rows, lens] = k[rows, lens], v[rows, lens]
        qs = q[rows, lens][:, None]
        step = r_core_attention(qs, lens[:, None], ck, cv, tiling)
        for r in range(b):
            assert torch.equal(step[r, 0], train[r, lens[r]]), (r, int(lens[r]))
        lens = lens + 1


def test_rr_training_equals_rollout_at_every_micro_batch_and_order() -> None:
    """The whole R model: rollout (batched prefill, ragged shrinking decode) and training at
    micro-batch 1, 2 and 5, in two orders, give the same selected logprobs bit for bit."""
    from pytest_rlkernel_matrix.workload.job import run_rollout, run_training
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels
    from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights

    cfg = PRESETS["tiny"]
    w = init_weights(cfg, 5, torch.bfloat16, DEV)
    r = {"attention": "rl_kernel", "ffn": "rl_kernel", "logp": "rl_kernel"}
    tiling = Tiling.for_device(DEV, 96)
    ks = {s: SideKernels.build(s, r, torch.bfloat16, tiling, cfg.rms_norm_eps)
          for s in ("training", "rollout")}
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen) for n in (5, 17, 9, 30, 12)]
    model = Qwen3(cfg, w, 96)
    with torch.inference_mode():
        ro = run_rollout(model, ks["rollout"], prompts, [40, 7, 55, 21, 33], 1.0, 0.95,
                         torch.Generator().manual_seed(2), ignore_eos=True)
    for mb in (1, 2, 5):
        for order in ([0, 1, 2, 3, 4], [3, 1, 4, 0, 2]):
            got = run_training(model, ks["training"], ro, mb, 1.0, order)
            for i in range(5):
                assert torch.equal(got[i], ro.logprobs[i]), (mb, order, i)
