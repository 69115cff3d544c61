"""RL-Kernel's sidecar layout, written here from its writer's description (not the plugin's).

Built with `torch.save` from RL-Kernel's writer as described in /work/notes/upstream20.md
section 1 (`tis_metrics._write_sidecar`): tp 2 x cp 2 (4 ranks, Megatron order: `cp_rank =
(rank // tp) % cp`), 2 calls x 2 samples, every rank writes (TP replicas hold the same values),
logprobs CP-sliced zigzag at logit positions `[prompt-1, total-1)`, loss masks full length.
63 response tokens, 8 masked, so 55 active; 25 of them mismatch (rollout = train + 2**-k).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from cellkit import CellKit

SCHEMA = "rlkernel.vime_rocm_attention_mismatch_sidecar.v1"
TP, CP = 2, 2
# call -> [(prompt, response, masked response offsets)]
SAMPLES = {0: [(5, 12, {0, 11}), (7, 16, {3, 4, 5})], 1: [(4, 15, {14}), (6, 20, {0, 1})]}


def held(total: int, response: int, cp_rank: int) -> list[int]:
    """Response offsets CP rank `cp_rank` holds: logit chunks r and 2cp-1-r, clipped."""
    prompt, chunk = total - response, -(-total // (2 * CP))
    out: list[int] = []
    for c in (cp_rank, 2 * CP - 1 - cp_rank):
        lo, hi = max(c * chunk, prompt - 1), min((c + 1) * chunk, total - 1)
        out += [p - (prompt - 1) for p in range(lo, hi)]
    return out


def full_samples(clean: bool) -> dict[tuple[int, int], tuple[int, int, Any, Any, Any]]:
    gen = torch.Generator().manual_seed(20)
    left = 0 if clean else 25
    data = {}
    for call, samples in SAMPLES.items():
        for index, (prompt, response, masked) in enumerate(samples):
            train = -(torch.rand(response, generator=gen, dtype=torch.float32) * 4 + 0.01)
            roll = train.clone()
            mask = torch.ones(response, dtype=torch.int64)
            for m in masked:
                mask[m] = 0
                roll[m] = train[m] - 7.0  # a masked token differs: it must not count
            for pos in range(response):
                if left and mask[pos] == 1 and (pos + index + call) % 2 == 0:
                    roll[pos] = train[pos] + 2.0 ** -(4 + pos % 6)
                    left -= 1
            data[(call, index)] = (prompt + response, response, train, roll, mask)
    assert left == 0
    return data


def upstream_cell(tmp_path: Path, *, clean: bool = False, negzero: bool = False,
                  replica: bool = False, drop: tuple[int, ...] = (),
                  schema: tuple[str, str] = ("schema_version", SCHEMA)) -> CellKit:
    """A clean R/R attention cell (CellKit) whose sidecars are replaced by RL-Kernel-style ones."""
    k = CellKit(tmp_path).write()
    (k.dir / "mismatch-sidecars" / "rank00000.call00000000.pt").unlink()
    data = full_samples(clean or negzero)
    if negzero:
        data[(0, 0)][2][1], data[(0, 0)][3][1] = 0.0, -0.0  # active: offset 1 is unmasked
    for rank in range(TP * CP):
        cp_rank = (rank // TP) % CP
        for call, samples in SAMPLES.items():
            if (rank, call) in drop:
                continue
            lists: dict[str, list[Any]] = {k: [] for k in (
                "train_log_probs", "rollout_log_probs", "loss_masks", "total_lengths",
                "response_lengths")}
            for index in range(len(samples)):
                total, response, train, roll, mask = data[(call, index)]
                pos = torch.tensor(held(total, response, cp_rank), dtype=torch.long)
                t = train[pos].detach().to("cpu").reshape(-1).contiguous()
                if replica and rank == 1 and call == 1 and index == 0:
                    t = t.clone()
                    t[0] += 1e-3
                lists["train_log_probs"].append(t)
                lists["rollout_log_probs"].append(roll[pos].reshape(-1).contiguous())
                lists["loss_masks"].append(mask.clone())
                lists["total_lengths"].append(total)
                lists["response_lengths"].append(response)
            payload = {schema[0]: schema[1], "rank": rank, "call_index": call,
                       "tensor_parallel_size": TP, "context_parallel_size": CP, **lists}
            k.write_sidecar(payload, f"rank{rank:05d}.call{call:08d}.pt")
    return k


def independent_figures(clean: bool = False, skip: tuple[tuple[int, int], ...] = ()
                        ) -> dict[str, Any]:
    """RL-Kernel's figures over the fixture, computed here from the full vectors in float64:
    per shard (rank 0 then rank 2 of each call: file order, TP replicas dropped) the active
    delta = train - rollout, each shard's sum added to a Python float, divided by the count."""
    data = full_samples(clean)
    n = mism = 0
    s_abs = s_kl = s_k3 = 0.0
    top = 0.0
    for rank in (0, 2):
        for call in SAMPLES:
            if (rank, call) in skip:
                continue
            for index in range(len(SAMPLES[call])):
                total, response, train, roll, mask = data[(call, index)]
                pos = held(total, response, (rank // TP) % CP)
                act = mask.numpy()[pos].astype(bool)
                t = train.numpy()[pos][act].astype(np.float64)
                r = roll.numpy()[pos][act].astype(np.float64)
                d = t - r
                n += d.size
                mism += int(np.count_nonzero(t != r))
                s_abs += float(np.abs(d).sum())
                s_kl += float((-d).sum())
                s_k3 += float((np.exp(d) - d - 1.0).sum())
                top = max(top, float(np.abs(d).max(initial=0.0)))
    return {"active_token_count": n, "mismatch_count": mism, "logprob_abs_diff_max": top,
            "train_rollout_logprob_abs_diff": s_abs / n, "mismatch_kl": s_kl / n,
            "mismatch_k3_kl": s_k3 / n}
