"""What the reference workload leaves on disk, written the way RL-Kernel writes it: atomic JSON,
the masked train/rollout logprob sidecars (``mismatch-sidecars/``), each step's sidecar and vime
lines (``emit_step``) and the probe files.

Kept apart from ``job.py`` (the step loop) so the engines job writes through the same functions.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_rlkernel_matrix.workload.env import SIDES, Env
from pytest_rlkernel_matrix.workload.evidence.probe import ProbeRequest, operator_names, write_index
from pytest_rlkernel_matrix.workload.evidence.upstream import sidecar_marker, step_lines, write_json
from pytest_rlkernel_matrix.workload.kernels.side import SideKernels
from pytest_rlkernel_matrix.workload.parallel import Grid, zigzag_response_offsets

__all__ = ["Rollout", "emit_step", "write_json", "write_probes", "write_sidecar"]

SIDECAR_SCHEMA = "rlkernel.vime_rocm_attention_mismatch_sidecar.v1"  # RL-Kernel's


@dataclass
class Rollout:
    """What the rollout engine returns: full token sequences and its sampled-token logprobs."""

    tokens: list[Tensor]
    prompt_lengths: list[int]
    logprobs: list[Tensor]
    execution_mode: str = "eager"  # of the decode steps (graphs.DecodeRunner)
    fallback_reason: str = ""


def write_probes(probe: ProbeRequest, kernels: dict[str, SideKernels], ro: Rollout,
                 train_lp: list[Tensor], wanted: list[tuple[int, int]], grid: Grid,
                 manifest: dict, extra: dict[str, dict] | None = None) -> None:
    """Step 0's probe files: ``<side>.rank{r:05d}.pt`` per rank and side, ``index.json``.

    ``extra``: more metadata for one side's file (the engines job: which engine, how it taps)."""
    assert probe.directory is not None
    tokens = []
    for i, j in wanted:
        p, n = ro.prompt_lengths[i], ro.logprobs[i].numel()
        if j < n:
            tokens.append({"sample": i, "token": j, "position": p + j - 1,
                           "token_id": int(ro.tokens[i][p + j]),
                           "rollout_logprob": float(ro.logprobs[i][j]),
                           "train_logprob": float(train_lp[i][j])})
    cfg = manifest["model"]
    ops = operator_names(cfg["num_hidden_layers"])
    meta = {"run_id": manifest["run_id"], "cases": manifest["cases"],
            "tensor_parallel_size": grid.tp, "context_parallel_size": grid.cp,
            "tp_layout": "gathered", "vocab_size": cfg["vocab_size"],
            "num_hidden_layers": cfg["num_hidden_layers"], "dtype": manifest["dtype"],
            "perturb": manifest["probe"]["perturb"]}
    for s in SIDES:
        tap = kernels[s].tap
        assert tap is not None
        tap.write(probe.directory / f"{s}.rank{grid.rank:05d}.pt",
                  {**meta, "rank": grid.rank, "tp_rank": grid.tp_rank, "cp_rank": grid.cp_rank,
                   "framework": kernels[s].framework,
                   "implementations": {m: kernels[s].module(m).implementation
                                       for m in ("attention", "ffn", "logp")},
                   **(extra or {}).get(s, {})},
                  tokens, ops)
        tap.recording = False  # later steps are not probed
    if grid.rank == 0:
        write_index(probe.directory, meta, tokens, ops, grid.world)


def write_sidecar(env: Env, ro: Rollout, train_lp: list[Tensor], grid: Grid | None = None,
                  call: int = 0) -> None:
    """Masked train/rollout logprobs of one call as ``rank{rank:05d}.call{call:08d}.pt``, the
    way RL-Kernel's ``_write_sidecar`` writes them (atomic: dot-tmp file, then rename).

    Every rank writes (TP replicas hold the same samples); a CP rank writes, per sample, the
    logprobs at the logit positions of its zigzag chunks (``parallel.zigzag_response_offsets``)
    and the full loss mask, which the reader slices the same way."""
    grid = grid or Grid()
    train, roll = [x.float().contiguous() for x in train_lp], [
        x.float().contiguous() for x in ro.logprobs]
    if grid.cp > 1:
        held = [zigzag_response_offsets(int(t.numel()), int(x.numel()), grid.cp, grid.cp_rank)
                for t, x in zip(ro.tokens, ro.logprobs, strict=True)]
        train = [x[k].contiguous() for x, k in zip(train, held, strict=True)]
        roll = [x[k].contiguous() for x, k in zip(roll, held, strict=True)]
    data = {
        "schema_version": SIDECAR_SCHEMA, "rank": grid.rank, "call_index": call,
        "tensor_parallel_size": grid.tp, "context_parallel_size": grid.cp,
        "train_log_probs": train,
        "rollout_log_probs": roll,
        "loss_masks": [torch.ones(x.numel(), dtype=torch.float32) for x in ro.logprobs],
        "total_lengths": [int(t.numel()) for t in ro.tokens],
        "response_lengths": [int(x.numel()) for x in ro.logprobs],
    }
    path = env.sidecar_dir / f"rank{grid.rank:05d}.call{call:08d}.pt"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    buf = io.BytesIO()  # not the temp file's name: torch.save names the archive after it
    torch.save(data, buf)
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def emit_step(env: Env, step: int, ro: Rollout, train_lp: list[Tensor], grid: Grid | None,
              max_new: list[int], **lines: Any) -> None:
    """One step's artifacts, as vime + RL-Kernel leave them: the sidecar of call `step` (every
    rank), vime's sidecar marker (step 0) and the `rollout`/`step`/`perf` lines
    (`upstream.step_lines`, whose keyword arguments `lines` passes on)."""
    write_sidecar(env, ro, train_lp, grid, step)
    if step == 0:
        print(sidecar_marker(env.cases["logp"]))
    print("\n".join(step_lines(step, [int(t.numel()) for t in ro.tokens], train_lp,
                               ro.logprobs, max_new, **lines)))
