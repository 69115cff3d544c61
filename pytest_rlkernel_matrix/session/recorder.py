"""The session's records: cell-run.json, cell-record.json, recovery, the report.

`Recorder` writes what a run was (`cell-run.json`, scrubbed, atomically), asks the judge for the
record (`report.record.analyze_run`, unchanged) and caches it (`cell-record.json`), reuses the
record of a run an earlier cell of this session made (or refuses another session's), recovers
after a crash the records of runs that never reached a test report (`recover`: only directories
whose run id carries this session's token), and writes `matrix-report.json` with its HTML page.
Every file under the matrix root is read and written through `store/`. It starts no process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.judge.read import preload
from pytest_rlkernel_matrix.report.matrix_report import REPORT_FILE, build_report
from pytest_rlkernel_matrix.report.record import (
    CELL_RUN_FILE,
    alias_record,
    analyze_run,
    cell_to_dict,
    interrupted_record,
    refusal_record,
)
from pytest_rlkernel_matrix.run import cpushare
from pytest_rlkernel_matrix.run.launchers.base import CellJob, Outcome
from pytest_rlkernel_matrix.run.runner import REDACTED, RunResult, is_secret
from pytest_rlkernel_matrix.session.plan import Planner
from pytest_rlkernel_matrix.spec.cells import Cell, expand, expand_factors
from pytest_rlkernel_matrix.store.atomic import write_json_atomic
from pytest_rlkernel_matrix.store.redact import Scrubber
from pytest_rlkernel_matrix.store.safeio import (
    MAX_JSON_BYTES,
    MAX_REPORT_BYTES,
    Refused,
    read_json,
    read_text,
    write_text,
)

RECORD_CACHE = "cell-record.json"
PREFLIGHT_FILE = "preflight.json"


def share_seen(share: Mapping[str, Any] | None, result: RunResult) -> dict[str, Any] | None:
    """The planned share with the affinity the launcher read back from the started process."""
    if share is None:
        return None
    out = dict(share)
    if result.cpu_affinity is not None:
        out["affinity"] = result.cpu_affinity
    elif out.get("affinity") == cpushare.PLANNED:
        out["affinity"] = ("not set: the cell was not started" if result.pid is None
                           else "not read back")
    return out


@dataclass
class Recorder:
    """Writes, reuses and recovers the session's records, and its report."""

    planner: Planner
    hardware: list[str]
    scrubber: Scrubber
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    worker: str | None = None

    @property
    def root(self) -> Path:
        return self.planner.root

    def write_json(self, path: Path, data: Any) -> None:
        """Every JSON file the session writes: scrubbed of secret values, written atomically."""
        write_json_atomic(path, self.scrubber.obj(data))

    def read_json(self, path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
        """A JSON file under the root, through `store` (strict JSON, bounded)."""
        return read_json(path, self.root, max_bytes)

    def rel(self, run_dir: Path) -> str:
        return str(run_dir.relative_to(self.root))

    # -- one run --------------------------------------------------------------------------------
    def finish(self, cell: Cell, mode: str, run_dir: Path, result: RunResult,
               recorded: Mapping[str, str], blockers: list[list[str]],
               outcome: Outcome | None = None, cpu_share: Mapping[str, Any] | None = None,
               analyze: bool = True) -> dict[str, Any]:
        """`cell-run.json` of a run that ended, then (`analyze`) the judge's record, cached."""
        fingerprints: dict[str, str] = dict(self.fingerprints)
        scheduler = outcome.scheduler if outcome is not None else None
        if scheduler is not None:
            # The node's fingerprints, never the login node's; none when the job's probe failed.
            fingerprints = dict(outcome.fingerprints or {})  # type: ignore[union-attr]
            node_pre = outcome.node_preflight  # type: ignore[union-attr]
            if node_pre is not None:
                from pytest_rlkernel_matrix.machine.preflight import detect_hardware

                scheduler["node_hardware"] = detect_hardware(node_pre, self.planner.matrix.hardware)
        runner = self.planner.matrix.runner
        meta = {
            "session": self.planner.token,
            "cell": cell_to_dict(cell),
            "mode": mode,
            "run_id": recorded.get("RL_KERNEL_RUN_ID") or self.planner.run_id(cell, run_dir),
            "artifact_dir": self.rel(run_dir),
            "run": result.as_dict(),
            "timeout": runner.timeout,
            "warmup": runner.warmup,
            "performance_policy": self.planner.matrix.performance.model_dump(),
            "env": {k: (REDACTED if is_secret(k) else v) for k, v in recorded.items()},
            "fingerprints": fingerprints,
            "preflight_blockers": blockers,
            "policy": self.planner.policy(cell),
            "devices": self.planner.devices, "worker": self.worker,
            "window": [result.started_epoch, result.finished_epoch],
            "cpu_share": share_seen(cpu_share, result),
        }
        if scheduler is not None:
            meta["scheduler"] = scheduler
        start = time.perf_counter()
        self.write_json(run_dir / CELL_RUN_FILE, meta)
        spent = {"env_s": 0.0, "launch_wait_s": 0.0, **self.timings.pop(str(run_dir), {}),
                 "record_write_s": time.perf_counter() - start, "import_wait_s": preload.join()}
        meta["overhead"] = {k: round(v, 6) for k, v in spent.items()}
        self.write_json(run_dir / CELL_RUN_FILE, meta)  # cell-run.json's first write: timed
        if not analyze:  # a measured run: its cell's analysis reads it (`report.measured`)
            return meta
        return self.analyze(run_dir, cell)

    def decision(self, run_dir: Path, mode: str, blockers: list[list[str]]) -> None:
        """`capability-decision.json`: what preflight's blockers decided for this run."""
        self.write_json(run_dir / "capability-decision.json", {
            "mode": mode, "blockers": blockers,
            "decision": "not started (strict: fail closed before launch)" if mode == "strict"
            else "started: the requested path may not run; evidence decides"})

    def not_started(self, cell: Cell, mode: str, job: CellJob,
                    blockers: list[list[str]]) -> dict[str, Any]:
        """The record of a strict run that blockers kept from starting (fail closed)."""
        now = datetime.now(UTC).isoformat(timespec="seconds")
        result = RunResult(command=job.command, exit_code=None, timed_out=False,
                           interrupted=False, wall_time=0.0, started=now, finished=now)
        write_text(job.run_dir / "exit-code", self.root, "not-started\n")
        return self.finish(cell, mode, job.run_dir, result, job.recorded, blockers,
                           cpu_share=job.cpu_share)

    def judge(self, run_dir: Path, cell: Cell) -> dict[str, Any]:
        """The judge's record of the run in `run_dir` (not cached)."""
        gaps = self.planner.matrix.hardware[cell.hardware].expect_unsupported
        return analyze_run(run_dir, gaps=gaps, fingerprints=self.fingerprints, cell=cell,
                           artifact_dir=self.rel(run_dir), scrubber=self.scrubber)

    def analyze(self, run_dir: Path, cell: Cell) -> dict[str, Any]:
        """The judge's record of the run in `run_dir`, cached as its `cell-record.json`."""
        record = self.judge(run_dir, cell)
        self.write_json(run_dir / RECORD_CACHE, record)
        return record

    def cached(self, run_dir: Path) -> Any:
        """The run's cached record (`cell-record.json`), read through `store`."""
        return self.read_json(run_dir / RECORD_CACHE, MAX_REPORT_BYTES)

    def label(self, record: dict[str, Any], cell: Cell) -> dict[str, Any]:
        out = alias_record(record, cell)
        out["shared_with"] = self.planner.shared_with(cell)
        return out

    def earlier(self, cell: Cell, mode: str, run_dir: Path) -> dict[str, Any] | None:
        """The record of a run already in `run_dir`: this session's (its cached record, or the
        judge's), another session's or mode's (refused: never overwritten); None when the
        directory is new."""
        meta_path = run_dir / CELL_RUN_FILE
        if meta_path.exists():
            meta = self.read_json(meta_path)
            if meta.get("superseded_by"):  # a requeued run: its second attempt decides
                run_dir = self.root / meta["superseded_by"]
            if meta.get("session") != self.planner.token or meta.get("mode") != mode:
                return refusal_record(cell, mode, run_dir)
            cached = run_dir / RECORD_CACHE
            record = self.cached(run_dir) if cached.exists() else self.judge(run_dir, cell)
            return self.label(record, cell)
        if run_dir.exists() and any(run_dir.iterdir()):
            return refusal_record(cell, mode, run_dir)
        return None

    def update_meta(self, run_dir: Path, **changes: Any) -> None:
        """Rewrite `cell-run.json` with `changes` (a requeue's `superseded_by`, a repeat's
        policy), read back through `store`."""
        meta_path = run_dir / CELL_RUN_FILE
        meta = self.read_json(meta_path)
        meta.update(changes)
        write_json_atomic(meta_path, meta)

    # -- after a crash --------------------------------------------------------------------------
    def own_runs(self) -> Iterator[tuple[Cell, Path, str]]:
        """(cell, run directory, run id) of every run this session started, from the disk."""
        p = self.planner
        layout = expand(p.matrix.matrix, self.hardware, p.layout, p.mode)
        factors = expand_factors(p.matrix.factors, p.matrix.matrix, self.hardware)
        by_dir = {(c.hardware, c.slug): c for c in
                  [*layout, *factors, *(c.baseline_cell(layout) for c in factors)]}
        for case_env in sorted(self.root.glob("*/*/matrix-case.env")):
            run_dir = case_env.parent
            cell = by_dir.get((run_dir.parent.name, run_dir.name))
            if cell is None:
                continue
            run_id = p.own_run_id(cell.hardware, cell.slug)
            try:  # (store: regular, inside the root, bounded; a FIFO is never waited on)
                ours = f"RL_KERNEL_RUN_ID={run_id}\n" in read_text(case_env, self.root)
            except (OSError, UnicodeDecodeError, Refused):
                ours = False
            if ours:
                yield cell, run_dir, run_id

    def all_recorded(self) -> bool:
        """Every run directory this session started holds its record."""
        return all((d / RECORD_CACHE).exists() for _, d, _ in self.own_runs())

    def recover(self) -> None:
        """Controller, at session end: records of runs that never reached a test report.

        An interrupted cell raises KeyboardInterrupt after writing its record to disk, and a
        worker that died leaves its run directory behind without one: both become records here
        (the latter an `error`, "interrupted"), so the report lists every cell that ran. Only
        directories this session wrote count (their `RL_KERNEL_RUN_ID` carries its token).
        """
        have = {r.get("run_key") for r in self.records.values()}
        for cell, run_dir, run_id in self.own_runs():
            if cell.run_key in have:
                continue
            record: dict[str, Any]
            try:
                record = (self.cached(run_dir) if (run_dir / RECORD_CACHE).exists()
                          else self.judge(run_dir, cell))
            except (OSError, ValueError, KeyError, Refused):
                record = interrupted_record(cell, self.planner.mode, self.rel(run_dir), run_id)
            have.add(cell.run_key)
            self.records[cell.id] = self.label(self.scrubber.obj(record), cell)

    def refresh(self) -> int:
        """Controller, at session end: each record whose run got measured runs after its item
        reported takes the timing fields of its run's `cell-record.json`. Returns how many
        did."""
        from pytest_rlkernel_matrix.report.measured import FIELDS

        done = 0
        for record in self.records.values():
            policy = record.get("performance_policy") or {}
            if int(policy.get("processes") or 1) <= 1 or not record.get("artifact_dir"):
                continue
            try:
                fresh = self.cached(self.root / record["artifact_dir"])
            except (OSError, ValueError, Refused):
                continue
            if isinstance(fresh, dict) and fresh.get("measured"):
                for key in FIELDS:
                    if key in fresh:
                        record[key] = fresh[key]
                done += 1
        return done

    # -- the report -----------------------------------------------------------------------------
    def write_report(self, preflight: Mapping[str, Any], expected_cells: int, interrupted: bool,
                     selection: dict[str, Any] | None) -> Path:
        p = self.planner
        m = p.matrix.matrix
        matrix = {"name": m.name, "file": str(p.matrix_path), "layout": p.layout,
                  "mode": p.mode, "hardware": self.hardware, "modules": list(m.modules),
                  "cases": list(m.cases), "fixed_case": m.fixed_case}
        if any(r.get("devices") for r in self.records.values()):
            from pytest_rlkernel_matrix.run.devices import mark_overlaps

            mark_overlaps(self.records)
        pre: dict[str, Any] = {"file": PREFLIGHT_FILE, **self.fingerprints}
        if preflight.get("capabilities"):
            pre["capabilities"] = preflight["capabilities"]
        reused = (preflight.get("probe") or {}).get("reused")
        if reused:  # a test suite's shared probe (RLK_REUSE_PROBE): never a fresh one
            pre["probe_reused"] = reused
        report = build_report(
            list(self.records.values()), matrix=matrix, matrix_root=self.root, preflight=pre,
            created=p.created, expected_cells=expected_cells, interrupted=interrupted)
        if selection is not None:  # a rerun or subset: what it ran, of which root
            from pytest_rlkernel_matrix.report.rerun import apply_selection

            apply_selection(report, selection)
        path = self.root / REPORT_FILE
        report = self.scrubber.obj(report)
        write_json_atomic(path, report)
        from pytest_rlkernel_matrix.report.html import HTML_FILE, write_html

        write_html(report, self.root / HTML_FILE, self.scrubber.obj(dict(preflight)))
        return path
