"""The session's processes: launch, wait, interrupt, sweep.

`CellRunner` takes a `CellPlan` (`session.plan`), creates its run directory with
`matrix-case.env` and hands the job to the `[runner] launcher` (`run.launchers`; `run.runner` owns
one process and its interrupt path, which this wraps); it waits with contamination sampling on
this host, holds the jobs queued ahead (Slurm), takes a run key's lock, and at session end stops
every process of the session (`stop_everything`). It writes no record: that is the recorder's.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.judge.read import preload
from pytest_rlkernel_matrix.run import contamination, procs
from pytest_rlkernel_matrix.run.launchers.base import CellJob, Launcher, Outcome
from pytest_rlkernel_matrix.run.runner import ARTIFACT_SUBDIRS, render_case_env
from pytest_rlkernel_matrix.session.plan import CellPlan, Planner
from pytest_rlkernel_matrix.spec.cells import Cell
from pytest_rlkernel_matrix.spec.limits import Policy
from pytest_rlkernel_matrix.store.atomic import write_text_atomic
from pytest_rlkernel_matrix.store.redact import Scrubber
from pytest_rlkernel_matrix.store.safeio import ensure_dir, open_lock


@contextmanager
def locked(path: Path, root: Path | None = None) -> Iterator[None]:
    """An exclusive `flock` on `path`, opened through `store.safeio.open_lock` (never through
    a link planted at its path; a folder linked out of `root` is refused)."""
    root = root or path.parent
    ensure_dir(path.parent, root)
    with open_lock(path, root) as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@dataclass
class CellRunner:
    """Launches and waits for the session's cell processes (one launcher per session)."""

    planner: Planner
    launcher: Callable[[], Launcher]
    scrubber: Scrubber
    pending: dict[str, CellJob] = field(default_factory=dict)
    # Per run directory: seconds the plugin spent around the cell's processes (`overhead`).
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    progress: Callable[[Cell, float, str], None] | None = None
    progress_every: float = 30.0

    @property
    def matrix(self) -> Any:
        return self.planner.matrix

    def lock(self, cell: Cell) -> Any:
        return locked(self.planner.lock_path(cell), self.planner.root)

    def prepare(self, plan: CellPlan, env_hook: Any = None, attempt: int = 1) -> CellJob:
        """Create the run directory with `matrix-case.env`: what any launcher needs. The
        `pytest_rlk_cell_env` hook's additions join the plan (and the scrubber)."""
        start = time.perf_counter()
        run_dir, cell = plan.run_dir, plan.cell
        run_dir.mkdir(parents=True, exist_ok=True)
        for sub in ARTIFACT_SUBDIRS.values():
            (run_dir / sub).mkdir(exist_ok=True)
        if env_hook is not None:
            extra: dict[str, str] = {}
            env_hook(cell=cell, env=extra)
            self.scrubber.add_env(extra)
            plan = plan.with_hook(extra)
        write_text_atomic(run_dir / "matrix-case.env",
                          render_case_env(plan.recorded, plan.command, plan.cwd, self.scrubber,
                                          comment=plan.share.comment()))
        report_progress = self.progress

        def progress(elapsed: float, line: str) -> None:
            if report_progress is not None:
                report_progress(cell, elapsed, line)

        runner = self.matrix.runner
        self.timings[str(run_dir)] = {"env_s": time.perf_counter() - start}
        return CellJob(key=cell.run_key, label=plan.label, command=plan.command, cwd=plan.cwd,
                       env=plan.env, recorded=plan.recorded, run_dir=run_dir,
                       timeout=runner.timeout, progress=progress,
                       progress_every=self.progress_every, attempt=attempt,
                       kill_grace=runner.kill_grace, session_tag=self.planner.token,
                       cpus=plan.share.cpus if runner.launcher == "local" else None,
                       cpu_share=plan.share.as_dict())

    def start_ahead(self, job: CellJob) -> None:
        """Queue `job` now (a launcher that runs jobs concurrently); its item waits for it."""
        self.launcher().start(job)
        self.pending[job.key] = job

    def submit_ahead(self, cells: Sequence[Cell], mode: str, env_hook: Any = None) -> int:
        """Queue every selected run with a launcher that runs them concurrently (Slurm); a
        run whose directory is not empty is left to its item (which reports the refusal)."""
        planner, started = self.planner, 0
        for cell in cells:
            if cell.run_key in self.pending or (mode == "off" and not cell.cases.is_native):
                continue
            if mode == "strict" and planner.blockers(cell, mode):
                continue
            run_dir = planner.run_dir(cell)
            with self.lock(cell):
                if run_dir.exists() and any(run_dir.iterdir()):
                    continue  # the item reports the refusal
                self.start_ahead(self.prepare(planner.cell_plan(cell, mode, run_dir), env_hook))
                started += 1
        return started

    def wait(self, cell: Cell, job: CellJob) -> Outcome:
        """Wait for the launcher's outcome. Local runs are sampled for contamination on this host;
        a Slurm job runs on a compute node this process cannot sample, so its run directory gets
        no `contamination.json` and its timings are "not measured" (fail closed)."""
        start = time.perf_counter()
        preload.start()  # the analysis' imports, while the cell's process runs (once per process)
        launcher = self.launcher()
        try:
            if self.matrix.runner.launcher != "local":
                outcome = launcher.wait(job)
            else:
                run_id = job.env.get("RL_KERNEL_RUN_ID") or self.planner.run_id(cell, job.run_dir)
                with contamination.watch(
                        root=self.planner.root, run_dir=job.run_dir, run_id=run_id, cpus=job.cpus,
                        backend=self.matrix.hardware[cell.hardware].backend, env=job.env,
                        policy=Policy(**self.matrix.performance.model_dump())):
                    outcome = launcher.wait(job)
        finally:
            waited = time.perf_counter() - start
        # launch + contamination sampling + waiting slack: the wait beyond the process's wall
        self.timings.setdefault(str(job.run_dir), {})["launch_wait_s"] = max(
            0.0, waited - float(outcome.result.wall_time or 0.0))
        return outcome

    def run(self, plan: CellPlan, env_hook: Any = None) -> tuple[CellJob, Outcome]:
        """One more process (a measured run, a repeat): prepared, started, waited for."""
        job = self.prepare(plan, env_hook)
        return job, self.wait(plan.cell, job)

    def retryable(self, outcome: Outcome) -> bool:
        return self.launcher().retryable(outcome)

    def stop_everything(self, interrupted: bool, done: Callable[[], bool]) -> list[int]:
        """Controller, at session end: no cell process outlives pytest.

        xdist workers of this session get SIGTERM (each stops its own cell and records it as
        interrupted) and some time to do so: until they exit, or no cell process of this session
        is left and `done()` (every run directory it started holds its record). Then whatever
        process of any cell of this session is still alive (a worker died, a cell outlived its
        worker) is stopped here. Returns those pids.
        """
        token, grace = self.planner.token, self.matrix.runner.kill_grace
        with procs.STOP.cleaning_up():
            workers = procs.session_workers(token) if interrupted else []
            for pid in workers:
                with suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace + 10
            while workers and time.monotonic() < deadline:
                if not procs.alive(workers) or (not procs.session_processes(token) and done()):
                    break
                time.sleep(0.05)
            return procs.sweep(token, grace)
