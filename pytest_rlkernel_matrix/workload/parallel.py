"""Ranks for the reference workload: the launch, the TP x CP grid and the collectives it uses.

Rank layout is RL-Kernel's (Megatron's default order): ``rank = tp_rank + tp * cp_rank``, so the
CP rank of a sidecar is ``(rank // tp) % cp`` and TP replicas are neighbours. One command runs
every rank: without ``RANK`` in the environment the process launches ``tp * cp`` copies of
itself (a minimal ``torchrun``: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*``) and waits;
under ``torchrun`` the ranks are already there. Backend: ``gloo`` on CPU, ``nccl`` on CUDA
(RCCL on a ROCm build of torch, which answers to the same name).

Context parallelism uses the zigzag split: a sequence padded to ``2*cp`` equal chunks, rank ``r``
holds chunks ``r`` and ``2*cp-1-r`` (balances causal-attention work).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class Group:
    """One process group as the kernels see it: size, this process's index, the handle."""

    size: int = 1
    rank: int = 0
    handle: Any = None

    def gather(self, t: Tensor) -> list[Tensor]:
        """All-gather ``t`` (same shape on every member): a copy, no arithmetic, rank order."""
        if self.size == 1:
            return [t]
        import torch.distributed as dist

        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.handle)
        return out

    def all_reduce(self, t: Tensor, op: str = "sum") -> Tensor:
        """The backend's own all-reduce, in place (its order depends on algorithm and size)."""
        if self.size == 1:
            return t
        import torch.distributed as dist

        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op],
                        group=self.handle)
        return t


def fixed_order_sum(parts: Sequence[Tensor]) -> Tensor:
    """``((p0 + p1) + p2) + ...`` in rank order: the same bits on every rank and every call."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


@dataclass
class Grid:
    """This process's place in the TP x CP grid."""

    tp: int = 1
    cp: int = 1
    rank: int = 0
    backend: str | None = None
    tp_group: Group = field(default_factory=Group)
    cp_group: Group = field(default_factory=Group)

    @property
    def world(self) -> int:
        return self.tp * self.cp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp


class LaunchError(Exception):
    """A topology this machine cannot run (wrong world size, backend or device count)."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_grid(tp: int, cp: int, device: torch.device) -> Grid:
    """Join the process group named by the environment and build the TP and CP groups."""
    world = tp * cp
    if world == 1:
        return Grid()
    import torch.distributed as dist

    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world != world:
        raise LaunchError(f"WORLD_SIZE={env_world} but tp*cp = {tp}*{cp} = {world}")
    backend = backend_for(device)
    available = dist.is_available() and (
        dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available())
    if not available:
        raise LaunchError(f"torch.distributed backend {backend} is not available in this build")
    rank = int(os.environ["RANK"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    grid = Grid(tp=tp, cp=cp, rank=rank, backend=backend)
    # Every rank creates every group, in the same order (a collective requirement).
    for c in range(cp):
        ranks = [t + tp * c for t in range(tp)]
        handle = dist.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            grid.tp_group = Group(tp, ranks.index(rank), handle)
    for t in range(tp):
        ranks = [t + tp * c for c in range(cp)]
        handle = dist.new_group(ranks) if cp > 1 else None
        if rank in ranks:
            grid.cp_group = Group(cp, ranks.index(rank), handle)
    return grid


def shutdown(grid: Grid) -> None:
    if grid.world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Zigzag context parallelism.


def zigzag_index(length: int, cp: int, cp_rank: int, device: torch.device | None = None,
                 ) -> Tensor:
    """Positions rank ``cp_rank`` holds of a sequence of ``length`` (a multiple of ``2*cp``)."""
    chunk = length // (2 * cp)
    idx = [*range(cp_rank * chunk, (cp_rank + 1) * chunk),
           *range((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)]
    return torch.tensor(idx, dtype=torch.long, device=device)


def zigzag_response_offsets(total: int, response: int, cp: int, cp_rank: int) -> Tensor:
    """Response offsets a CP rank's sidecar holds, in stored order (RL-Kernel's slicing).

    Offset ``j`` of a response is logit position ``prompt - 1 + j`` (the logit at ``t``
    predicts token ``t + 1``); the rank holds the logit positions of its zigzag chunks ``r``
    and ``2cp-1-r`` of ``ceil(total / 2cp)`` positions each, clipped to
    ``[prompt - 1, total - 1)``, chunk ``r`` first."""
    if cp == 1:
        return torch.arange(response, dtype=torch.long)
    base = total - response - 1
    chunk = -(-total // (2 * cp))
    held: list[int] = []
    for c in (cp_rank, 2 * cp - 1 - cp_rank):
        held.extend(range(max(c * chunk, base) - base, min((c + 1) * chunk, total - 1) - base))
    return torch.tensor(held, dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Launch.


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_rank_process() -> bool:
    """True under torchrun or our own launcher (the ranks are already there)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(argv: Sequence[str], world: int, poll_s: float = 0.2) -> int:
    """Start ``world`` ranks of ``python -m pytest_rlkernel_matrix.workload argv`` and wait.

    When one rank fails, the others are stopped (a collective would wait for it forever).
    Returns the first non-zero exit code, else 0.
    """
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pytest_rlkernel_matrix.workload", *argv], env=env))
    codes: list[int | None] = [None] * world
    first_bad = 0
    try:
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None and (rc := p.poll()) is not None:
                    codes[i] = rc
                    if rc != 0 and first_bad == 0:
                        first_bad = rc
                        print(f"[rlk-reference] rank {i} exited with {rc}: stopping the other "
                              "ranks", file=sys.stderr, flush=True)
                        _stop(procs)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    return first_bad


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
