"""vime's five batch-invariance replay cases as rollout layouts of the reference workload.

vime's consistency audit (RL-Align/vime `vime/utils/consistency_audit.py`,
`build_batch_invariance_replay_cases`) names five cases that keep one sample fixed while its
batch changes; `RLK_REF_BATCH_INVARIANCE` = one of them runs the rollout in that layout, and the
factor comparison (`judge/localise/factors.py`) then counts, against the unmodified cell of the
same kernel cases, how many of the fixed samples' logprobs changed. A factor's cases may name one
module (`attention[R/P]`: attention's rollout on P, the rest R/R), so each case is judged per
module and side (`examples/batch-invariance.toml`):

- `same_sample_alone` (batch size, neighbouring samples): each sample decodes alone;
- `same_sample_mixed_batch` (batch order, micro-batch membership): the samples decode in
  reverse order;
- `padding_packing_variant` (padding side, packed order, micro-batch offset): a neighbour up to
  twice the longest prompt's length (within the model's sequence limit) goes first and leaves
  after one token: the prefill pads every row further and every row moves one down;
- `active_token_density_variant` (active-mask density): each sample gets a neighbour that stops
  after one token, so the decode batch is twice as dense at the first step only;
- `dynamic_sampling_keep_drop_variant` (dynamic-sampling keep/drop): each sample gets a twin of
  its prompt with other noise, decoded with it and then dropped (a dynamic-sampling filter).

Neighbours draw their sampling noise from their own generator (seeded), never from the step's:
the fixed samples draw exactly the noise they draw in the unmodified cell, so a difference is
the kernels' (or the sampler's) dependence on the batch. Only the rollout's batch changes; the
training side recomputes the kept samples in its usual micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

CASES = ("same_sample_alone", "same_sample_mixed_batch", "padding_packing_variant",
         "active_token_density_variant", "dynamic_sampling_keep_drop_variant")
NEIGHBOUR_SEED = 4545


@dataclass
class Plan:
    """The rollout's jobs: prompts, max new tokens, noise rows, chunk size, and where each
    fixed sample's result is (`keep[i]`: the job index of sample i)."""

    prompts: list[Tensor]
    max_new: list[int]
    noise: Tensor
    size: int
    keep: list[int]
    note: str


def plan(case: str, prompts: list[Tensor], max_new: list[int], noise: Tensor,
         max_seq_len: int | None = None) -> Plan:
    """The layout of `case` for the fixed samples `prompts` (their noise rows `noise`);
    `max_seq_len`: the model's sequence limit (the padding neighbour stays within it)."""
    n = len(prompts)
    width = noise.shape[1]
    gen = torch.Generator(device=noise.device).manual_seed(NEIGHBOUR_SEED)

    def fresh(rows: int, cols: int) -> Tensor:
        return torch.rand((rows, cols), generator=gen, device=noise.device)

    if case == "same_sample_alone":
        return Plan(list(prompts), list(max_new), noise, 1, list(range(n)),
                    "each sample decodes alone")
    if case == "same_sample_mixed_batch":
        order = list(range(n))[::-1]
        return Plan([prompts[i] for i in order], [max_new[i] for i in order], noise[order], n,
                    [order.index(i) for i in range(n)], "the samples decode in reverse order")
    if case == "padding_packing_variant":
        longest = max(prompts, key=lambda p: p.numel())
        room = 2 * longest.numel() if max_seq_len is None else min(2 * longest.numel(),
                                                                   max_seq_len - 1)
        pad = torch.cat([longest, longest])[:max(room, longest.numel())]
        return Plan([pad, *prompts], [1, *max_new],  # (it leaves after its first token)
                    torch.cat([fresh(1, width), noise]), n + 1, list(range(1, n + 1)),
                    f"a {pad.numel()}-token neighbour first (longest prompt "
                    f"{longest.numel()}): more padding, every row one further down")
    if case == "active_token_density_variant":
        jobs, new, rows, keep = [], [], [], []
        extra = fresh(n, width)
        for i in range(n):
            keep.append(len(jobs))
            jobs += [prompts[i], prompts[i]]
            new += [max_new[i], 1]
            rows += [noise[i], extra[i]]
        return Plan(jobs, new, torch.stack(rows), 2 * n, keep,
                    "each sample with a neighbour that stops after one token")
    if case == "dynamic_sampling_keep_drop_variant":
        jobs, new, rows, keep = [], [], [], []
        extra = fresh(n, width)
        for i in range(n):
            keep.append(len(jobs))
            jobs += [prompts[i], prompts[i]]
            new += [max_new[i], max_new[i]]
            rows += [noise[i], extra[i]]
        return Plan(jobs, new, torch.stack(rows), 2 * n, keep,
                    "each sample decoded with a twin (other noise) that is then dropped")
    raise ValueError(f"unknown batch-invariance case {case!r}: expected one of {CASES}")
