"""One matrix session: where output goes, running a cell once per run key, collecting records.

The controller owns `preflight.json` and `matrix-report.json`; xdist workers run cells and send
records back on their test reports. Cells with equal effective cases share one run: the first
process to take the run's lock runs it in the run's directory, later ones reuse its record.
Locks are `fcntl.flock` (stdlib; the GPU stacks this drives run on Linux only, so `filelock`'s
portability would buy nothing).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.cells import Cell, canonical_cells
from pytest_rlkernel_matrix.matrix import MatrixFile
from pytest_rlkernel_matrix.report import (
    CELL_RUN_FILE,
    REPORT_FILE,
    alias_record,
    analyze_run,
    build_report,
    cell_to_dict,
    not_run_record,
    write_json_atomic,
)
from pytest_rlkernel_matrix.runner import (
    ARTIFACT_SUBDIRS,
    RunResult,
    cell_env,
    contract_env,
    is_secret,
    render_case_env,
    run_cell_command,
)

RECORD_CACHE = "cell-record.json"
PREFLIGHT_FILE = "preflight.json"


def utc_stamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


def default_root(matrix_path: Path, option: str | None, env: Mapping[str, str]) -> Path:
    """`--rlk-matrix-root`, else `$MATRIX_ROOT`, else `outputs/rlkernel/ablation-matrix-<stamp>`
    next to the matrix file (`$MATRIX_STAMP` or the UTC time)."""
    if option:
        return Path(option).expanduser().resolve()
    if env.get("MATRIX_ROOT"):
        return Path(env["MATRIX_ROOT"]).expanduser().resolve()
    stamp = env.get("MATRIX_STAMP") or utc_stamp()
    return matrix_path.parent / "outputs" / "rlkernel" / f"ablation-matrix-{stamp}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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
    dry: bool = False
    preflight: dict[str, Any] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    cells: list[Cell] = field(default_factory=list)
    canonical: dict[str, Cell] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    expected_cells: int = 0
    interrupted: bool = False
    progress: Callable[[Cell, float, str], None] | None = None
    progress_every: float = 30.0
    devices: list[str] | None = None  # this xdist worker's device set (None: not pinned)
    worker: str | None = None

    # -- layout ---------------------------------------------------------------------------------
    def set_selected(self, cells: Sequence[Cell]) -> None:
        """Fix which cell's directory holds each run, from the cells that were selected."""
        self.cells = list(cells)
        self.canonical = canonical_cells(cells)
        self.expected_cells = len(cells)

    def run_dir(self, cell: Cell) -> Path:
        owner = self.canonical.get(cell.run_key, cell)
        return self.root / owner.hardware / owner.slug

    def shared_with(self, cell: Cell) -> list[str]:
        return [c.id for c in self.cells if c.run_key == cell.run_key and c.id != cell.id]

    # -- environment ----------------------------------------------------------------------------
    def run_id(self, cell: Cell) -> str:
        owner = self.canonical.get(cell.run_key, cell)
        stamp = self.created.replace("-", "").replace(":", "").split("+")[0]
        return f"{owner.hardware}-{owner.slug}-{stamp}Z-{self.token[:8]}"

    def command_cwd(self) -> Path:
        cwd = self.matrix.runner.cwd
        base = self.matrix_path.parent
        return (base / os.path.expandvars(cwd)).resolve() if cwd else base

    def environment(self, cell: Cell, mode: str, run_dir: Path,
                    base: Mapping[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
        runner = self.matrix.runner
        profile = self.matrix.hardware[cell.hardware]
        topo = profile.topology
        contract = contract_env(cell, mode=mode, aligned=self.matrix.matrix.aligned,
                                run_id=self.run_id(cell), artifact_dir=run_dir,
                                repeats=runner.repeats, warmup=runner.warmup,
                                topology={"tp": topo.tp, "cp": topo.cp, "pp": topo.pp,
                                          "gpus_per_cell": topo.devices_per_cell})
        full, recorded = cell_env(contract, profile_env=profile.env,
                                  runner_env=self.matrix.runner.env, python=sys.executable,
                                  base=base)
        if self.devices is not None and profile.backend != "cpu":
            from pytest_rlkernel_matrix.integrations.xdist import device_env

            pinned = device_env(profile.backend, self.devices)
            full.update(pinned)
            recorded.update(pinned)
        return full, recorded

    def plan_text(self, cells: Sequence[Cell], mode: str) -> str:
        """Copy-paste template per run: the env contract and the command, nothing executed."""
        out: list[str] = []
        seen: set[str] = set()
        command = self.matrix.runner.command
        shown = command if isinstance(command, str) else shlex.join(command)
        for cell in cells:
            if cell.run_key in seen:
                continue
            seen.add(cell.run_key)
            names = [c.id for c in cells if c.run_key == cell.run_key]
            run_dir = self.run_dir(cell)
            _, recorded = self.environment(cell, mode, run_dir, base={})
            out.append(f"# {', '.join(names)}  (mode {mode})")
            out.append(f"cd {shlex.quote(str(self.command_cwd()))} && env \\")
            for key in sorted(recorded):
                value = "<redacted>" if is_secret(key) else recorded[key]
                out.append(f"  {key}={shlex.quote(value)} \\")
            out.append(f"  bash -c {shlex.quote(shown)}" if isinstance(command, str)
                       else f"  {shown}")
            out.append("")
        return "\n".join(out)

    # -- running --------------------------------------------------------------------------------
    def run_cell(self, cell: Cell, *, mode: str, env_hook: Any = None) -> dict[str, Any]:
        """Run (or reuse) the run behind `cell` and return the cell's record."""
        if mode == "off" and not cell.cases.is_native:
            return not_run_record(
                cell, mode, "not run in off mode: RL-Kernel is disabled, only P/P cells run",
                "not_run",
            )
        run_dir = self.run_dir(cell)
        lock = self.root / ".locks" / f"{cell.run_key.replace('/', '__')}.lock"
        with _locked(lock):
            cached = run_dir / RECORD_CACHE
            meta_path = run_dir / CELL_RUN_FILE
            if meta_path.exists():
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                if meta.get("session") != self.token or meta.get("mode") != mode:
                    return self._refusal(cell, mode, run_dir)
                if cached.exists():
                    record = json.loads(cached.read_text(encoding="utf-8"))
                else:
                    record = self._analyze(run_dir, cell)
                return self._label(record, cell)
            if run_dir.exists() and any(run_dir.iterdir()):
                return self._refusal(cell, mode, run_dir)
            record = self._execute(cell, mode, run_dir, env_hook, self.blockers(cell, mode))
            return self._label(record, cell)

    def _refusal(self, cell: Cell, mode: str, run_dir: Path) -> dict[str, Any]:
        record = not_run_record(
            cell, mode,
            f"artifact directory {run_dir} is not empty: refusing to overwrite another run's "
            "artifacts (choose a new --rlk-matrix-root or MATRIX_STAMP)",
            "error",
        )
        record["failed"] = True
        return record

    def blockers(self, cell: Cell, mode: str) -> list[list[str]]:
        """(class, reason) for each module whose requested R backend preflight found unavailable."""
        caps = self.preflight.get("capabilities")
        collective = [list(b) for b in self.collective_blockers(cell)]
        if mode == "off" or not caps:
            return collective
        from pytest_rlkernel_matrix.capability import requested_r_blockers

        wanted = [m for m in cell.cases.as_dict() if "R" in cell.cases.of(m)]
        return [list(b) for b in requested_r_blockers(caps, wanted)] + collective

    def collective_blockers(self, cell: Cell) -> list[tuple[str, str]]:
        """A multi-rank cell needs its collective backend: NCCL/RCCL on GPUs, gloo on CPU."""
        profile = self.matrix.hardware[cell.hardware]
        if profile.topology.world_size <= 1:
            return []
        cls = "communication_path_unsupported"
        if profile.backend == "cpu":
            raw = ((self.preflight.get("probe") or {}).get("capabilities_raw") or {})
            if (raw.get("nccl") or {}).get("gloo_available") is False:
                return [(cls, f"tp*cp*pp = {profile.topology.world_size} ranks need the gloo "
                              "backend of torch.distributed, which this torch lacks")]
            return []
        entry = ((self.preflight.get("capabilities") or {}).get("capabilities") or {}).get(
            "collectives") or {}
        if entry.get("status") == "unavailable":
            return [(cls, f"tp*cp*pp = {profile.topology.world_size} ranks need "
                          f"{entry.get('name', 'the collective backend')}: {entry.get('reason')}")]
        return []

    def _execute(self, cell: Cell, mode: str, run_dir: Path, env_hook: Any,
                 blockers: list[list[str]]) -> dict[str, Any]:
        run_dir.mkdir(parents=True, exist_ok=True)
        for sub in ARTIFACT_SUBDIRS.values():
            (run_dir / sub).mkdir(exist_ok=True)
        env, recorded = self.environment(cell, mode, run_dir)
        if env_hook is not None:
            extra: dict[str, str] = {}
            env_hook(cell=cell, env=extra)
            env.update(extra)
            recorded.update(extra)
        command = self.matrix.runner.command
        cwd = self.command_cwd()
        (run_dir / "matrix-case.env").write_text(render_case_env(recorded, command, cwd))
        if blockers:
            write_json_atomic(run_dir / "capability-decision.json", {
                "mode": mode, "blockers": blockers,
                "decision": "not started (strict: fail closed before launch)" if mode == "strict"
                else "started: the requested path may not run; evidence decides",
            })
        if blockers and mode == "strict":
            now = datetime.now(UTC).isoformat(timespec="seconds")
            result = RunResult(command=command if isinstance(command, str) else list(command),
                               exit_code=None, timed_out=False, interrupted=False,
                               wall_time=0.0, started=now, finished=now)
            (run_dir / "exit-code").write_text("not-started\n")
            return self._finish(cell, mode, run_dir, result, recorded, blockers)
        report_progress = self.progress

        def progress(elapsed: float, line: str) -> None:
            if report_progress is not None:
                report_progress(cell, elapsed, line)

        result = run_cell_command(command, cwd=cwd, env=env, timeout=self.matrix.runner.timeout,
                                  artifact_dir=run_dir, progress=progress,
                                  progress_every=self.progress_every)
        record = self._finish(cell, mode, run_dir, result, recorded, blockers)
        if result.interrupted:
            raise KeyboardInterrupt
        return record

    def _finish(self, cell: Cell, mode: str, run_dir: Path, result: RunResult,
                recorded: Mapping[str, str], blockers: list[list[str]]) -> dict[str, Any]:
        meta = {
            "session": self.token,
            "cell": cell_to_dict(cell),
            "mode": mode,
            "run_id": self.run_id(cell),
            "artifact_dir": str(run_dir.relative_to(self.root)),
            "run": result.as_dict(),
            "timeout": self.matrix.runner.timeout,
            "warmup": self.matrix.runner.warmup,
            "env": {k: ("<redacted>" if is_secret(k) else v) for k, v in recorded.items()},
            "fingerprints": self.fingerprints,
            "preflight_blockers": blockers,
            "devices": self.devices, "worker": self.worker,
            "window": [result.started_epoch, result.finished_epoch],
        }
        write_json_atomic(run_dir / CELL_RUN_FILE, meta)
        record = self._analyze(run_dir, cell)
        write_json_atomic(run_dir / RECORD_CACHE, record)
        return record

    def _analyze(self, run_dir: Path, cell: Cell) -> dict[str, Any]:
        gaps = self.matrix.hardware[cell.hardware].expect_unsupported
        return analyze_run(run_dir, gaps=gaps, fingerprints=self.fingerprints)

    def _label(self, record: dict[str, Any], cell: Cell) -> dict[str, Any]:
        out = alias_record(record, cell)
        out["shared_with"] = self.shared_with(cell)
        return out

    # -- report ---------------------------------------------------------------------------------
    def add_record(self, nodeid: str, record: dict[str, Any]) -> None:
        self.records[nodeid] = record

    def write_report(self) -> Path:
        matrix = {
            "name": self.matrix.matrix.name, "file": str(self.matrix_path),
            "layout": self.layout, "mode": self.mode, "hardware": self.hardware,
            "modules": list(self.matrix.matrix.modules), "cases": list(self.matrix.matrix.cases),
            "fixed_case": self.matrix.matrix.fixed_case,
        }
        if any(r.get("devices") for r in self.records.values()):
            from pytest_rlkernel_matrix.integrations.xdist import mark_overlaps

            mark_overlaps(self.records)
        pre: dict[str, Any] = {"file": PREFLIGHT_FILE, **self.fingerprints}
        if self.preflight.get("capabilities"):
            pre["capabilities"] = self.preflight["capabilities"]
        report = build_report(
            list(self.records.values()), matrix=matrix, matrix_root=self.root, preflight=pre,
            created=self.created, expected_cells=self.expected_cells,
            interrupted=self.interrupted,
        )
        path = self.root / REPORT_FILE
        write_json_atomic(path, report)
        from pytest_rlkernel_matrix.html import HTML_FILE, write_html

        write_html(report, self.root / HTML_FILE, self.preflight)
        return path
