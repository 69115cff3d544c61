"""Seeded nucleus (top-p) sampling without a full-vocabulary sort (both sides' rollout).

Nucleus sampling keeps the most probable tokens whose probabilities sum to ``top_p`` and samples
among them. Sorting every row of ``[batch, vocab]`` at every decode step costs most of the
sampler's time on a GPU (0.69 s of a 3.14 s rollout on one H200 at 448 x 151,936; see
docs/benchmarks.md). Like FlashInfer's sampler, this one never sorts; it samples by rejection:

1. draw a token ``t`` from the row's distribution restricted to the tokens above a pivot
   (at first: every token), by inverse CDF in vocabulary order;
2. ``t`` is in the nucleus iff the mass of the tokens strictly more probable than ``t`` is below
   ``top_p`` (the sorted rule: the exclusive cumulative sum at ``t``'s rank is below ``top_p``);
3. if it is not, every token at or below ``p[t]`` is outside the nucleus too: raise the pivot to
   ``p[t]`` and draw again from what is left. Each round keeps the whole nucleus, so the
   accepted token follows the nucleus distribution exactly.

A row's token depends on its own probabilities and its own uniform only, never on the batch it
decodes in: the later rounds' uniforms are derived from the row's first one by a fixed integer
hash. Ties at the nucleus' edge are kept together (the sorted rule keeps them in sort order).

Every sum over the vocabulary (the CDF, the mass above a token) is taken in exact integer
arithmetic on the probabilities in fixed point (units of 2^-40), so its value does not depend on
the order a kernel adds in. A floating-point ``cumsum``/``sum`` does: on an H200, torch's CUDA
reductions over 151,936 tokens add in an order that depends on how many rows the batch has,
and the factor matrix (``examples/factors.toml``, ``rollout_batch``) caught R/R rollouts
sampling different tokens with 3 or 1 sequences decoding together than with 8, although every
R logprob was the same bits. Integer sums are associative: the token is the batch's no more.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

# The workload's fast paths: this sampler (both sides) and P's fused CUDA paths (kernels.py).
# RLK_REF_FAST=0 keeps the earlier ones, so benchmarks/step_compare.py measures both side by side.
FAST_PATHS = os.environ.get("RLK_REF_FAST", "1") != "0"

MAX_ROUNDS = 64  # after as many rejections the row takes its most probable token (in the nucleus)


def _round_uniform(u: Tensor, k: int) -> Tensor:
    """The k-th round's uniform in [0, 1) of each row, a fixed hash of the row's first one."""
    if k == 0:
        return u
    mask = (1 << 32) - 1
    h = ((u.double() * 2.0**32).to(torch.int64) + k * 0x9E3779B9) & mask
    for mult in (0x85EBCA6B, 0xC2B2AE35):  # murmur3 finaliser
        h = ((h ^ (h >> 16)) * mult) & mask
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float64).div(2.0**24).to(u.dtype)


FIXED_POINT = 2.0 ** 40  # probability units of the integer sums (vocab x 2^40 << 2^63)


def _fixed(probs: Tensor) -> Tensor:
    """Probabilities in fixed point, int64 (elementwise: a row's values are its own). Scaling
    by a power of two is exact in any float dtype and the cast truncates, which is the floor of
    a value >= 0: the same integers as ``floor(p * 2^40)`` in float64, one pass fewer."""
    return (probs * FIXED_POINT).to(torch.int64)


def _draw(q: Tensor, pivot: Tensor | None, u: Tensor) -> Tensor:
    """Inverse-CDF draw in vocabulary order among the tokens with ``q > pivot`` (int64 ``q``)."""
    cand = q if pivot is None else q * (q > pivot[:, None])
    cdf = cand.cumsum(-1)  # exact: integer
    total = cdf[:, -1]
    x = torch.minimum((u.double() * total.double()).floor().to(torch.int64), total - 1)
    idx = torch.searchsorted(cdf, x[:, None].contiguous(), right=True)
    return idx.clamp(max=q.shape[-1] - 1)[:, 0]


def sample_top_p(logprobs: Tensor, top_p: float, u: Tensor) -> Tensor:
    """Sample one token per row from temperature-scaled ``logprobs [B, V]`` with nucleus top-p.

    ``u [B]``: one uniform number per row, drawn per (sample, position) before the rollout, so
    a row's token depends on its own logprobs only, never on the batch it decodes in."""
    probs = logprobs.exp()
    if not FAST_PATHS:  # RLK_REF_FAST=0: the sort-based rule (same distribution)
        return _sorted_top_p(probs, top_p, u)
    q = _fixed(probs)
    if top_p >= 1.0:
        return _draw(q, None, u)
    limit = int(top_p * FIXED_POINT)
    tok = torch.empty(q.shape[0], dtype=torch.long, device=q.device)
    rows = torch.arange(q.shape[0], device=q.device)
    pivot: Tensor | None = None
    uu = u
    for k in range(MAX_ROUNDS):
        t = _draw(q, pivot, _round_uniform(uu, k))
        qt = q.gather(-1, t[:, None])
        above = (q * (q > qt)).sum(-1)  # exact: integer
        ok = above < limit
        tok[rows[ok]] = t[ok]
        if bool(ok.all()):
            return tok
        keep = (~ok).nonzero()[:, 0]
        rows, q, uu, pivot = rows[keep], q[keep], uu[keep], qt[keep, 0]
    tok[rows] = q.argmax(-1)
    return tok


def _sorted_top_p(probs: Tensor, top_p: float, u: Tensor) -> Tensor:
    """The sort-based rule: inverse CDF over the descending-sorted nucleus."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    cdf = (sorted_p * keep).cumsum(-1)
    choice = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None].contiguous())
    return idx.gather(-1, choice.clamp(max=cdf.shape[-1] - 1))[:, 0]
