"""One matrix session: the thin coordinator of plan -> run -> judge -> record.

`MatrixSession` holds the state the hooks and fixtures share (the matrix, its root, the selected
cells, the records) and wires the rooms, each made from that state when called: the `Planner`
(`plan`: a cell's directory, run id, environment, command, share; pure values), the `CellRunner`
(`runner`: processes), the `Recorder` (`recorder`: cell-run.json, the judge's record, recovery,
the report) and the `Scheduler` (`scheduler`: repeat, profile/probe, measured and auto runs).
A cell goes down once: plan, lock, run, record (the judge inside), follow-ups, label.

The controller owns `preflight.json` and `matrix-report.json`; xdist workers run cells and send
records back on their test reports. Cells with equal effective cases share one run: the first
process to take the run's lock runs it in the run's directory, later ones reuse its record.
Locks are `fcntl.flock` (stdlib; the GPU stacks this drives run on Linux only).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.report.record import off_mode_record
from pytest_rlkernel_matrix.run import cpushare, procs
from pytest_rlkernel_matrix.run.launchers.base import CellJob, Launcher
from pytest_rlkernel_matrix.session.plan import Planner
from pytest_rlkernel_matrix.session.recorder import Recorder
from pytest_rlkernel_matrix.session.runner import CellRunner
from pytest_rlkernel_matrix.session.scheduler import Scheduler
from pytest_rlkernel_matrix.spec.cells import Cell
from pytest_rlkernel_matrix.spec.matrix import MatrixFile
from pytest_rlkernel_matrix.store.redact import Scrubber


@dataclass
class MatrixSession:
    """State shared by the hooks and fixtures of one pytest session."""

    matrix: MatrixFile
    matrix_path: Path
    root: Path
    hardware: list[str]
    mode: str
    layout: str
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    plan: bool = False
    plan_named: bool = False  # --rlk-plan --rlk-hardware: the named machine's plan (`plan`)
    dry: bool = False
    probe: bool = False  # --rlk-probe: probe runs of drifting cells (also [probe] when)
    preflight: dict[str, Any] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    cells: list[Cell] = field(default_factory=list)
    canonical: dict[str, Cell] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    expected_cells: int = 0
    selection: dict[str, Any] | None = None  # report.rerun.apply_selection (set by the plugin)
    # Undoes what the session wrote into its root before any cell ran (a selection of no cell
    # writes no root: issue 53); set by the plugin, None where nothing is to be undone.
    forget_root: Any = None
    interrupted: bool = False
    progress: Callable[[Cell, float, str], None] | None = None
    progress_every: float = 30.0
    devices: list[str] | None = None  # this xdist worker's device set (None: not pinned)
    worker: str | None = None
    cpu_slot: cpushare.Slot = field(default_factory=cpushare.Slot)  # this process's CPU share
    pending: dict[str, CellJob] = field(default_factory=dict)
    scrubber: Scrubber = field(default_factory=Scrubber)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)  # per run dir (overhead)
    # (cell, mode, run directory, env hook) of each run this process started, in order: the
    # measured runs (`[performance] processes`) repeat them round by round (`scheduler`).
    ran: list[tuple[Cell, str, Path, Any]] = field(default_factory=list)
    # --rlk-processes=auto: the session's start (epoch seconds; a worker takes the controller's),
    # the items this process ran and all of the session's, and why auto stopped early.
    started: float = field(default_factory=time.time)
    items_ran: set[str] = field(default_factory=set)
    all_items: set[str] = field(default_factory=set)
    auto_stop: str | None = None
    _launcher: Launcher | None = None

    def __post_init__(self) -> None:
        # Secret values this session can see: its environment, the matrix file's env tables and
        # the command; `pytest_rlk_cell_env` additions join per cell.
        runner = self.matrix.runner
        self.scrubber.add_env(os.environ, runner.command)
        self.scrubber.add_env(runner.env)
        for profile in self.matrix.hardware.values():
            self.scrubber.add_env(profile.env)
        for factor in self.matrix.factors.values():
            for variant in factor.variants.values():
                self.scrubber.add_env(variant.env)

    # -- the rooms, made from the session's state when called -----------------------------------
    @property
    def launcher(self) -> Launcher:
        """The `[runner] launcher` of this session (made on first use)."""
        if self._launcher is None:
            from pytest_rlkernel_matrix.run.launchers import make_launcher

            self._launcher = make_launcher(self.matrix)
        return self._launcher

    @property
    def planner(self) -> Planner:
        return Planner(matrix=self.matrix, matrix_path=self.matrix_path, root=self.root,
                       layout=self.layout, mode=self.mode, token=self.token,
                       created=self.created, cells=self.cells, canonical=self.canonical,
                       devices=self.devices, cpu_slot=self.cpu_slot, preflight=self.preflight)

    @property
    def runner(self) -> CellRunner:
        return CellRunner(planner=self.planner, launcher=lambda: self.launcher,
                          scrubber=self.scrubber, pending=self.pending, timings=self.timings,
                          progress=self.progress, progress_every=self.progress_every)

    @property
    def recorder(self) -> Recorder:
        return Recorder(planner=self.planner, hardware=self.hardware, scrubber=self.scrubber,
                        records=self.records, fingerprints=self.fingerprints,
                        timings=self.timings, worker=self.worker)

    @property
    def scheduler(self) -> Scheduler:
        return Scheduler(runner=self.runner, recorder=self.recorder, worker=self.worker,
                         probe=self.probe)

    def write_json(self, path: Path, data: Any) -> None:
        self.recorder.write_json(path, data)

    def set_selected(self, cells: Sequence[Cell]) -> None:
        """Fix which cell's directory holds each run, from the cells that were selected."""
        self.cells = list(cells)
        self.canonical, self.expected_cells = self.planner.selected(self.cells)

    def blockers(self, cell: Cell, mode: str) -> list[list[str]]:
        return self.planner.blockers(cell, mode)

    def collective_blockers(self, cell: Cell) -> list[tuple[str, str]]:
        return self.planner.collective_blockers(cell)

    # -- one cell, down the floors once ---------------------------------------------------------
    def run_cell(self, cell: Cell, *, mode: str, env_hook: Any = None) -> dict[str, Any]:
        """Run (or reuse) the run behind `cell` and return the cell's record."""
        if mode == "off" and not cell.cases.is_native:
            return off_mode_record(cell, mode)
        if cell.factor is None:
            return self._run_one(cell, mode, env_hook)
        # the baseline's run first (reused when a selected cell ran it), then the factor's run,
        # then the judge's comparison of the two rollouts in the record
        from pytest_rlkernel_matrix.judge.localise.factors import factor_block

        base_cell = self.planner.factor_baseline(cell)
        base = self._run_one(base_cell, mode, env_hook)
        record = self._run_one(cell, mode, env_hook)
        base_dir = self.root / base["artifact_dir"] if base.get("artifact_dir") else None
        own_dir = self.root / record["artifact_dir"] if record.get("artifact_dir") else None
        record["factor"] = factor_block(record, cell.factor.as_dict(), base_cell.id, own_dir,
                                        base_dir, base)
        return record

    def _run_one(self, cell: Cell, mode: str, env_hook: Any) -> dict[str, Any]:
        planner, runner, recorder = self.planner, self.runner, self.recorder
        run_dir = planner.run_dir(cell)
        with runner.lock(cell):
            if cell.run_key not in self.pending:
                earlier = recorder.earlier(cell, mode, run_dir)
                if earlier is not None:
                    return earlier
            record = self._execute(cell, mode, run_dir, env_hook, planner.blockers(cell, mode))
            return recorder.label(record, cell)

    def _execute(self, cell: Cell, mode: str, run_dir: Path, env_hook: Any,
                 blockers: list[list[str]]) -> dict[str, Any]:
        planner, runner, recorder, scheduler = (self.planner, self.runner, self.recorder,
                                                self.scheduler)
        job = self.pending.pop(cell.run_key, None) or runner.prepare(
            planner.cell_plan(cell, mode, run_dir), env_hook)
        if blockers:
            recorder.decision(run_dir, mode, blockers)
        if blockers and mode == "strict":
            return recorder.not_started(cell, mode, job, blockers)
        outcome = runner.wait(cell, job)
        if outcome.result.interrupted:
            # Ctrl-C / SIGTERM: record the cell (error, "interrupted"), then stop the session.
            with procs.STOP.cleaning_up():
                recorder.finish(cell, mode, run_dir, outcome.result, job.recorded, blockers,
                                outcome, cpu_share=job.cpu_share)
            raise KeyboardInterrupt
        record = recorder.finish(cell, mode, run_dir, outcome.result, job.recorded, blockers,
                                 outcome, cpu_share=job.cpu_share)
        if runner.retryable(outcome) and job.attempt == 1:  # a node failed: once more
            requeued = scheduler.requeue(cell, mode, run_dir, env_hook, outcome, blockers)
            if requeued is None:
                return record  # its directory exists: never overwritten
            record, outcome = requeued
        else:
            record = scheduler.maybe_probe(cell, run_dir, job, record)
        if outcome.result.interrupted:
            raise KeyboardInterrupt
        if self.matrix.reproducibility.chooses(planner.names(cell), cell.is_baseline) \
                and not blockers:
            record = scheduler.repeat(cell, mode, self.root / record["artifact_dir"],
                                      env_hook) or record
        if record.get("artifact_dir"):
            self.ran.append((cell, mode, self.root / record["artifact_dir"], env_hook))
        return record

    def submit_ahead(self, cells: Sequence[Cell], mode: str, env_hook: Any = None) -> int:
        """Queue every selected run with a launcher that runs them concurrently (Slurm)."""
        return self.runner.submit_ahead(cells, mode, env_hook)

    # -- after the last item, and at session end ------------------------------------------------
    def run_measured(self, say: Any = None) -> int:
        """The measured runs (and auto stages) of the runs this process started (`scheduler`)."""
        todo, self.ran = list(self.ran), []
        scheduler = self.scheduler
        try:
            return scheduler.run_measured(todo, self.started, self.items_ran, self.all_items, say)
        finally:
            self.auto_stop = scheduler.auto_stop or self.auto_stop

    def stop_everything(self) -> list[int]:
        """Controller, at session end: no cell process outlives pytest (`CellRunner`)."""
        return self.runner.stop_everything(self.interrupted, self.recorder.all_recorded)

    def recover_records(self) -> None:
        self.recorder.recover()

    def add_record(self, nodeid: str, record: dict[str, Any]) -> None:
        self.records[nodeid] = record

    def write_report(self) -> Path:
        return self.recorder.write_report(self.preflight, self.expected_cells, self.interrupted,
                                          self.selection)
