"""Cells that run side by side share the CPUs instead of fighting over them.

As xdist workers own disjoint GPU sets, they own disjoint CPU sets: the session's CPU affinity
mask (`os.sched_getaffinity(0)`, which honours `taskset`, cgroups' cpusets and a scheduler's
binding, unlike `os.cpu_count()`) is cut into one contiguous slice per worker. A local cell

- runs with its slice as CPU affinity (the launcher sets it on the thread that starts the cell,
  so the cell's process group inherits it from its first instruction: no `preexec_fn`, no race
  with a process that starts threads early);
- gets `OMP_NUM_THREADS` / `MKL_NUM_THREADS` = the slice's size and `RLK_MATRIX_THREADS` (the
  reference workload calls `torch.set_num_threads` from it, divided among its ranks), unless the
  user set a thread variable: a value in the environment, in the matrix file's `[runner.env]` or
  the profile's `env`, or from a `pytest_rlk_cell_env` hook wins and the record says whose it is.

A serial session's one cell gets the whole mask. Under the Slurm launcher nothing is set: Slurm's
own CPU binding (`--cpus-per-task`, task affinity) decides on the node, and the record says so.
With more workers than CPUs, workers share CPUs round-robin (and the record says that too).

The assignment is the cell record's `cpu_share` (`matrix-report.json`, `cell-run.json`) and a
comment plus the variables in `matrix-case.env`. Stdlib only: imported by the plugin at load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
CELL_THREADS_VAR = "RLK_MATRIX_THREADS"  # the cell's share; the reference workload divides it
CELL_CPUS_VAR = "RLK_MATRIX_CPUS"  # the cell's CPU list, as `taskset -c` writes it
PLANNED = "to be set by the local launcher"  # replaced by what the launcher saw


def session_cpus() -> list[int]:
    """The CPUs this process may run on: its affinity mask where the OS has one."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is not None:
        try:
            return sorted(getter(0))
        except OSError:
            pass
    return list(range(os.cpu_count() or 1))


def can_pin() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def cpus_for_slot(cpus: Sequence[int], slot: int, count: int) -> list[int]:
    """Slot `slot` of `count`'s contiguous slice of `cpus` (disjoint while count <= len(cpus);
    the first `len(cpus) % count` slices are one CPU larger). More slots than CPUs: one CPU each,
    round-robin."""
    n, count = len(cpus), max(1, count)
    if n == 0:
        return []
    if count > n:
        return [cpus[slot % n]]
    base, extra = divmod(n, count)
    start = slot * base + min(slot, extra)
    return list(cpus[start:start + base + (1 if slot < extra else 0)])


def cpu_list(cpus: Sequence[int]) -> str:
    """`0-3,6`: the list format of `taskset -c` and `/proc/<pid>/status`."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass(frozen=True)
class Slot:
    """Which share of the session's CPUs this process's cells get."""

    index: int = 0
    count: int = 1
    worker: str | None = None  # the xdist worker id; None: a serial session
    cpus: tuple[int, ...] = ()  # the session's mask as the controller saw it

    @property
    def label(self) -> str:
        if self.worker is None:
            return "serial: the session's whole CPU affinity mask"
        return f"xdist worker {self.index + 1} of {self.count} ({self.worker})"


@dataclass
class CpuShare:
    """One cell's CPUs and threads, and the variables that carry them."""

    cpus: list[int] | None
    threads: int | None
    source: str
    share: str
    user_set: dict[str, str] = field(default_factory=dict)
    affinity: str = ""
    env: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"cpus": self.cpus, "threads": self.threads, "source": self.source,
                "share": self.share, "user_set": dict(self.user_set), "affinity": self.affinity}

    def comment(self) -> str:
        """The `matrix-case.env` line saying what the cell was given."""
        if self.cpus is None:
            return f"# cpu share: {self.share}"
        cpus = cpu_list(self.cpus)
        users = ", ".join(f"{k} from {v}" for k, v in sorted(self.user_set.items()))
        threads = (f"{self.threads} thread(s) set by the user ({users})" if self.user_set
                   else f"{self.threads} thread(s)")
        pin = (f"; rerun pinned: taskset -c {cpus} <command>" if self.affinity == PLANNED
               else f"; affinity {self.affinity}")
        return f"# cpu share: cpus {cpus} ({self.share}), {threads}{pin}"

    def with_hook(self, extra: Mapping[str, str]) -> CpuShare:
        """A `pytest_rlk_cell_env` hook that set a thread variable overrides the share."""
        hooked = {k: "pytest_rlk_cell_env" for k in THREAD_VARS if k in extra}
        if not hooked:
            return self
        user = {**self.user_set, **hooked}
        return CpuShare(cpus=self.cpus, threads=_threads_of(extra, self.threads),
                        source="user", share=self.share, user_set=user,
                        affinity=self.affinity, env={})


def _threads_of(env: Mapping[str, str], default: int | None) -> int | None:
    for var in THREAD_VARS:
        raw = env.get(var, "").strip()
        if raw:
            try:
                return max(1, int(raw.split(",")[0]))
            except ValueError:
                return None  # not a number: recorded as unknown, the user's value still wins
    return default


def plan_share(slot: Slot, *, launcher: str, inherited: Mapping[str, str],
               profile_env: Mapping[str, str], runner_env: Mapping[str, str]) -> CpuShare:
    """The share one cell of this process gets, and the variables to give it."""
    if launcher != "local":
        return CpuShare(cpus=None, threads=None, source=launcher, share=(
            f"left to {launcher}: its own CPU binding (--cpus-per-task, task affinity) decides "
            "on the node; no affinity or thread variables set by the plugin"),
            affinity=f"not set (the {launcher} launcher)")
    cpus = cpus_for_slot(list(slot.cpus) or session_cpus(), slot.index, slot.count)
    if slot.count > len(slot.cpus or cpus) and slot.worker is not None:
        share = (f"{slot.label}; {slot.count} workers on {len(slot.cpus)} CPU(s): "
                 "workers share CPUs round-robin")
    else:
        share = slot.label
    user: dict[str, str] = {}
    values: dict[str, str] = {}
    for where, env in (("the environment", inherited), ("the matrix profile's env", profile_env),
                       ("matrix.toml [runner.env]", runner_env)):
        for var in THREAD_VARS:
            if var in env:
                user[var], values[var] = where, env[var]
    affinity = PLANNED if can_pin() else "not set: this OS has no sched_setaffinity"
    if user:
        return CpuShare(cpus=cpus, threads=_threads_of(values, None), source="user",
                        share=share, user_set=user, affinity=affinity)
    threads = max(1, len(cpus))
    env = {var: str(threads) for var in THREAD_VARS}
    env[CELL_THREADS_VAR] = str(threads)
    env[CELL_CPUS_VAR] = cpu_list(cpus)
    return CpuShare(cpus=cpus, threads=threads, source=share, share=share, affinity=affinity,
                    env=env)


def pinned_start(cpus: Sequence[int] | None) -> _Pinned:
    """Context manager: the calling thread runs on `cpus` while it starts the cell's process.

    Linux keeps affinity per thread and a child inherits its parent thread's mask; setting it on
    this thread only (never the whole pytest process) and restoring it right after `Popen` pins
    the cell from its first instruction while the harness and its sampler keep every CPU."""
    return _Pinned(cpus)


class _Pinned:
    def __init__(self, cpus: Sequence[int] | None) -> None:
        self.cpus = set(cpus or ())
        self.before: set[int] | None = None
        self.error: str | None = None

    def __enter__(self) -> _Pinned:
        if not self.cpus or not can_pin():
            return self
        try:
            self.before = set(os.sched_getaffinity(0))
            if self.cpus != self.before:
                os.sched_setaffinity(0, self.cpus)
        except OSError as exc:
            self.before, self.error = None, f"cannot set CPU affinity {sorted(self.cpus)}: {exc}"
        return self

    def __exit__(self, *exc: object) -> None:
        if self.before is not None and self.cpus != self.before:
            os.sched_setaffinity(0, self.before)
