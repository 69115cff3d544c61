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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# The workload's fast paths (RLK_REF_FAST): this sampler (both sides) and P's fused CUDA paths;
# read once, in kernels/p/native.py (kernels import no rollout module).
from pytest_rlkernel_matrix.workload.kernels.p.native import FAST_PATHS as FAST_PATHS

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


BLOCK = 128  # tokens per block of the two-level draw (the vocabulary padded to a multiple)
# On CUDA the two passes over the vocabulary (block sums, mass above a token) run as Inductor
# kernels that never write the [B, V] int64 fixed-point tensor: the same integers, the same
# tokens as the eager functions (the casts and the comparisons are exact, the sums integer).
COMPILE = FAST_PATHS and os.environ.get("RLK_REF_SAMPLER_COMPILE", "1") != "0"
STATUS: dict[str, str] = {}  # what the sampler's passes ran: "inductor", or "eager" and why


def _block_sums(probs: Tensor, pivot: Tensor) -> Tensor:
    """``[B, V/BLOCK]`` int64: each block's fixed-point mass of the tokens with ``q > pivot``."""
    q = _fixed(probs)
    q = torch.where(q > pivot[:, None], q, 0)
    return q.view(q.shape[0], -1, BLOCK).sum(-1)


def _mass_above(probs: Tensor, qt: Tensor) -> Tensor:
    """``[B]`` int64: the fixed-point mass of the tokens strictly more probable than ``qt``."""
    q = _fixed(probs)
    return torch.where(q > qt[:, None], q, 0).sum(-1)


def _pass(fn: Any, probs: Tensor) -> Any:
    """``fn`` compiled on CUDA (dynamic batch), else eager; eager for good if compiling fails."""
    if not (COMPILE and probs.is_cuda):
        return fn
    # torch.compile wrapper shared with P's decode math
    from pytest_rlkernel_matrix.workload.kernels.p.native import compiled

    return compiled(fn, (0, 1), STATUS)


def _draw(probs: Tensor, pivot: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw in vocabulary order among the tokens with ``q > pivot``, in two levels:
    the block holding the draw from the blocks' cumulative masses, then the token inside it.
    The index is the one-level ``searchsorted(cumsum(q), x, right=True)``'s (exact integers)."""
    b = probs.shape[0]
    sums = _pass(_block_sums, probs)(probs, pivot)
    bcdf = sums.cumsum(-1)
    total = bcdf[:, -1]
    x = torch.minimum((u.double() * total.double()).floor().to(torch.int64), total - 1)
    j = torch.searchsorted(bcdf, x[:, None].contiguous(), right=True).clamp(
        max=bcdf.shape[-1] - 1)
    before = torch.where(j > 0, bcdf.gather(-1, (j - 1).clamp(min=0)), 0)
    blk = probs.view(b, -1, BLOCK).gather(1, j[:, :, None].expand(b, 1, BLOCK))[:, 0]
    q = _fixed(blk)
    q = torch.where(q > pivot[:, None], q, 0)
    idx = torch.searchsorted(q.cumsum(-1), (x[:, None] - before).contiguous(), right=True)
    return (j * BLOCK + idx.clamp(max=BLOCK - 1))[:, 0]


@dataclass
class Drawn:
    """A batch's first sampling rounds, taken with no host sync (so a decode graph can hold
    them). Round 0 over every row: the draw ``t`` over the row's whole distribution, its
    fixed-point probability ``qt`` (the next round's pivot) and whether it is in the nucleus
    (``ok``). Round 1 (``spare`` > 0) over the first ``spare`` rows round 0 rejected, in row
    order: ``t1``/``done1`` are each row's token and whether it is settled after both rounds,
    ``q1`` the pivot of round 2, ``overflow`` whether more rows were rejected than round 1
    took. ``probs`` are the rows' probabilities (vocabulary padded to ``BLOCK``); row ``i`` is
    ``probs[at[i]]`` (``at`` None: ``probs[i]``), so a graph's batch bucket can keep rows it no
    longer samples."""

    probs: Tensor
    t: Tensor
    qt: Tensor
    ok: Tensor
    vocab: int
    at: Tensor | None = None
    t1: Tensor | None = None
    q1: Tensor | None = None
    done1: Tensor | None = None
    overflow: Tensor | None = None

    def rows(self, idx: Tensor) -> Drawn:
        """The rows ``idx`` of these rounds (``probs`` kept whole, ``at`` mapping into it)."""
        def pick(x: Tensor | None) -> Tensor | None:
            return None if x is None else x.index_select(0, idx)
        at = idx if self.at is None else self.at.index_select(0, idx)
        return Drawn(self.probs, self.t.index_select(0, idx), self.qt.index_select(0, idx),
                     self.ok.index_select(0, idx), self.vocab, at, pick(self.t1),
                     pick(self.q1), pick(self.done1), self.overflow)


SPARE = 64  # rows a decode graph's round 1 takes (about 5% of 448 rows are rejected at 0.95)


def first_round(logprobs: Tensor, top_p: float, u: Tensor, spare: int = 0) -> Drawn:
    """Round 0 of ``sample_top_p`` over every row, and round 1 over the first ``spare`` rows
    round 0 rejected: tensor ops only, no host sync (each row's arithmetic is its own)."""
    probs = logprobs.exp()
    v = probs.shape[-1]
    if v % BLOCK:  # zero-probability padding: never drawn, never above a token
        probs = torch.nn.functional.pad(probs, (0, BLOCK - v % BLOCK))
    b = probs.shape[0]
    pivot = torch.full((b,), -1, dtype=torch.int64, device=probs.device)
    t = _draw(probs, pivot, u)
    qt = _fixed(probs.gather(-1, t[:, None]))[:, 0]
    if top_p >= 1.0:
        return Drawn(probs, t, qt, torch.ones_like(t, dtype=torch.bool), v)
    limit = int(top_p * FIXED_POINT)
    ok = _pass(_mass_above, probs)(probs, qt) < limit
    d = Drawn(probs, t, qt, ok, v)
    if spare <= 0:
        return d
    k = min(spare, b)
    rank = torch.arange(b, device=probs.device)
    order = torch.argsort(torch.where(ok, rank + b, rank))[:k]  # rejected rows first, in order
    taken = ~ok.index_select(0, order)
    p1 = probs.index_select(0, order)
    t_1 = _draw(p1, qt.index_select(0, order), _round_uniform(u.index_select(0, order), 1))
    q_1 = _fixed(p1.gather(-1, t_1[:, None]))[:, 0]
    ok_1 = taken & (_pass(_mass_above, p1)(p1, q_1) < limit)
    d.t1 = t.scatter(0, order, torch.where(ok_1, t_1, t.index_select(0, order)))
    d.q1 = qt.scatter(0, order, torch.where(taken, q_1, qt.index_select(0, order)))
    d.done1 = ok.scatter(0, order, ok.index_select(0, order) | ok_1)
    d.overflow = (~ok).sum() > k
    return d


def finish(d: Drawn, top_p: float, u: Tensor) -> Tensor:
    """The tokens of the rows of ``d`` (``u``: their uniforms): settled rows' tokens from the
    rounds taken, the later rounds for the rows left (one host sync per round)."""
    if top_p >= 1.0:
        return d.t
    start, tok, ok, pivot = 1, d.t, d.ok, d.qt
    if d.done1 is not None and d.t1 is not None and d.q1 is not None:
        settled, overflow = torch.stack([d.done1.all(), d.overflow]).tolist()  # one sync
        if settled:
            return d.t1
        if not overflow:  # every row round 0 rejected had its round 1: go on from round 2
            start, tok, ok, pivot = 2, d.t1, d.done1, d.q1
    elif bool(ok.all()):
        return tok
    limit = int(top_p * FIXED_POINT)
    tok = tok.clone()
    rows = (~ok).nonzero()[:, 0]
    src = rows if d.at is None else d.at.index_select(0, rows)
    probs, uu, pivot = d.probs.index_select(0, src), u[rows], pivot[rows]
    for k in range(start, MAX_ROUNDS):
        t = _draw(probs, pivot, _round_uniform(uu, k))
        qt = _fixed(probs.gather(-1, t[:, None]))[:, 0]
        ok = _pass(_mass_above, probs)(probs, qt) < limit
        tok[rows[ok]] = t[ok]
        if bool(ok.all()):
            return tok
        keep = (~ok).nonzero()[:, 0]
        rows, probs, uu, pivot = rows[keep], probs[keep], uu[keep], qt[keep]
    tok[rows] = _fixed(probs[:, :d.vocab]).argmax(-1)
    return tok


def sample_top_p(logprobs: Tensor, top_p: float, u: Tensor) -> Tensor:
    """Sample one token per row from temperature-scaled ``logprobs [B, V]`` with nucleus top-p.

    ``u [B]``: one uniform number per row, drawn per (sample, position) before the rollout, so
    a row's token depends on its own logprobs only, never on the batch it decodes in. Round 0
    (``first_round``) may also run inside a decode graph; ``finish`` takes the rest."""
    if not FAST_PATHS:  # RLK_REF_FAST=0: the sort-based rule (same distribution)
        return _sorted_top_p(logprobs.exp(), top_p, u)
    return finish(first_round(logprobs, top_p, u), top_p, u)


def sampler_mode() -> str:
    """One line for the manifest: how the sampler's passes over the vocabulary ran."""
    if not FAST_PATHS:
        return "sort-based (RLK_REF_FAST=0)"
    passes = {k: v for k, v in STATUS.items() if k != "decode_graph"}
    line = ("; ".join(f"{k}: {v}" for k, v in sorted(passes.items())) if passes
            else "eager" if not COMPILE else "eager (no CUDA input)")
    graph = STATUS.get("decode_graph")
    return f"{line}; decode graph: {graph}" if graph else line


def _sorted_top_p(probs: Tensor, top_p: float, u: Tensor) -> Tensor:
    """The sort-based rule: inverse CDF over the descending-sorted nucleus."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    cdf = (sorted_p * keep).cumsum(-1)
    choice = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None].contiguous())
    return idx.gather(-1, choice.clamp(max=cdf.shape[-1] - 1))[:, 0]
