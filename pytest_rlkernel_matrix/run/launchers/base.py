"""The launcher protocol: `start` a prepared cell, `wait` for its outcome, `cancel_all`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pytest_rlkernel_matrix.run.runner import RunResult


@dataclass
class CellJob:
    """One run, prepared: its directory exists and holds `matrix-case.env`."""

    key: str
    label: str
    command: str | list[str]
    cwd: Path
    env: dict[str, str]
    recorded: dict[str, str]
    run_dir: Path
    timeout: float
    progress: Callable[[float, str], None] | None = None
    progress_every: float = 30.0
    attempt: int = 1
    kill_grace: float = 5.0
    session_tag: str = ""
    cpus: list[int] | None = None  # CPU affinity of a local cell (`cpushare`); None: leave it
    cpu_share: dict[str, Any] | None = None  # what `cpu_share` in the cell's record says
    handle: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    """What the launcher saw. `scheduler` (job id, state, nodes, ...) and `fingerprints` (from the
    node that ran the cell) are None for local runs."""

    result: RunResult
    scheduler: dict[str, Any] | None = None
    fingerprints: dict[str, str] | None = None
    node_preflight: dict[str, Any] | None = None


class Launcher(Protocol):
    name: str

    def start(self, job: CellJob) -> None:
        """Begin (or queue) the run; may return before it runs."""

    def wait(self, job: CellJob) -> Outcome:
        """Block until the run is over; `run.log` and `exit-code` are in `job.run_dir`."""

    def cancel_all(self, why: str) -> list[str]:
        """Stop every run of this session that is still queued or running; what was stopped."""

    def render(self, job: CellJob) -> str:
        """What would be run, for `--rlk-plan`."""

    def retryable(self, outcome: Outcome) -> bool:
        """Should this outcome be run once more, into a fresh directory?"""
