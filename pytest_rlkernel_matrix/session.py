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
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix import extra_runs
from pytest_rlkernel_matrix.extra_runs import RECORD_CACHE
from pytest_rlkernel_matrix.judge.read import preload
from pytest_rlkernel_matrix.report.matrix_report import REPORT_FILE, build_report
from pytest_rlkernel_matrix.report.record import (
    CELL_RUN_FILE,
    alias_record,
    analyze_run,
    cell_to_dict,
    interrupted_record,
    off_mode_record,
    refusal_record,
)
from pytest_rlkernel_matrix.run import contamination, cpushare, procs
from pytest_rlkernel_matrix.run.launchers.base import CellJob, Launcher, Outcome
from pytest_rlkernel_matrix.run.runner import (
    ARTIFACT_SUBDIRS,
    REDACTED,
    RunResult,
    cell_env,
    contract_env,
    is_secret,
    render_case_env,
)
from pytest_rlkernel_matrix.spec.cells import Cell, canonical_cells, expand, expand_factors
from pytest_rlkernel_matrix.spec.limits import Policy
from pytest_rlkernel_matrix.spec.matrix import MatrixFile
from pytest_rlkernel_matrix.store.atomic import write_json_atomic, write_text_atomic
from pytest_rlkernel_matrix.store.redact import Scrubber
from pytest_rlkernel_matrix.store.safeio import (
    MAX_REPORT_BYTES,
    Refused,
    ensure_dir,
    open_lock,
    read_text,
    write_text,
)

PREFLIGHT_FILE = "preflight.json"


def _share_seen(share: Mapping[str, Any] | None, result: RunResult) -> dict[str, Any] | None:
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


def utc_stamp(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")


def default_root(matrix_path: Path, option: str | None, env: Mapping[str, str],
                 now: datetime | None = None) -> Path:
    """`--rlk-matrix-root`, else `$MATRIX_ROOT`, else `outputs/rlkernel/ablation-matrix-<stamp>`
    next to the matrix file (`$MATRIX_STAMP` or the UTC time `now`: pass the session's
    `created`, so the root's stamp and the run ids' stamp are one instant)."""
    if option:
        return Path(option).expanduser().resolve()
    if env.get("MATRIX_ROOT"):
        return Path(env["MATRIX_ROOT"]).expanduser().resolve()
    stamp = env.get("MATRIX_STAMP") or utc_stamp(now)
    return matrix_path.parent / "outputs" / "rlkernel" / f"ablation-matrix-{stamp}"


@contextmanager
def _locked(path: Path, root: Path | None = None) -> Iterator[None]:
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
    # Per run directory: seconds the plugin spent around the cell's processes (`overhead`).
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    # (cell, mode, run directory, env hook) of each run this process started, in order: the
    # measured runs (`[performance] processes`) repeat them round by round (`extra_runs`).
    ran: list[tuple[Cell, str, Path, Any]] = field(default_factory=list)
    # --rlk-processes=auto (`extra_runs`): the session's start (epoch seconds; a worker takes
    # the controller's), the items this process ran and all of the session's (under xdist: when
    # every worker's stage one is in), and why the session stopped early (None: it did not).
    started: float = field(default_factory=time.time)
    items_ran: set[str] = field(default_factory=set)
    all_items: set[str] = field(default_factory=set)
    auto_stop: str | None = None

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

    def write_json(self, path: Path, data: Any) -> None:
        """Every JSON file the session writes: scrubbed of secret values, written atomically."""
        write_json_atomic(path, self.scrubber.obj(data))
    _launcher: Launcher | None = None

    @property
    def launcher(self) -> Launcher:
        """The `[runner] launcher` of this session (made on first use)."""
        if self._launcher is None:
            from pytest_rlkernel_matrix.run.launchers import make_launcher

            self._launcher = make_launcher(self.matrix)
        return self._launcher

    # -- layout ---------------------------------------------------------------------------------
    def set_selected(self, cells: Sequence[Cell]) -> None:
        """Fix which cell's directory holds each run, from the cells that were selected.

        A selected factor cell needs its baseline's run: that run gets a directory too (the
        layout's cell of that case, or `factor-baseline-<case>`) even when it is not selected."""
        self.cells = list(cells)
        extra = [self.factor_baseline(c) for c in cells if c.factor is not None]
        self.canonical = canonical_cells([*cells, *extra])
        # a baseline no selected cell runs is run (and reported) for the factor cells
        selected = {c.run_key for c in cells}
        self.expected_cells = len(cells) + len({b.run_key for b in extra} - selected)

    def factor_baseline(self, cell: Cell) -> Cell:
        """The unmodified cell a factor cell is compared with (every module at its case)."""
        layout = [*self.cells, *expand(self.matrix.matrix, [cell.hardware], self.layout,
                                       self.mode)]
        return cell.baseline_cell(layout)

    def command(self, cell: Cell) -> str | list[str]:
        """The cell's command: the runner's, with a factor variant's arguments appended."""
        command = self.matrix.runner.command
        args = cell.factor.args if cell.factor is not None else ()
        if isinstance(command, str):
            if not args:
                return command
            import shlex

            return command + " " + " ".join(shlex.quote(a) for a in args)
        return [*command, *args]

    def run_dir(self, cell: Cell) -> Path:
        owner = self.canonical.get(cell.run_key, cell)
        return self.root / owner.hardware / owner.slug

    def shared_with(self, cell: Cell) -> list[str]:
        return [c.id for c in self.cells if c.run_key == cell.run_key and c.id != cell.id]

    # -- environment ----------------------------------------------------------------------------
    def run_id(self, cell: Cell, run_dir: Path | None = None) -> str:  # a repeat: its own id
        owner, again = self.canonical.get(cell.run_key, cell), run_dir and run_dir.suffix
        tail = again.replace(".repeat", "-repeat") if again and ".repeat" in again else ""
        return f"{owner.hardware}-{owner.slug}-{self._stamp()}Z-{self.token[:8]}{tail}"

    def _stamp(self) -> str:
        return self.created.replace("-", "").replace(":", "").split("+")[0]

    def command_cwd(self) -> Path:
        cwd = self.matrix.runner.cwd
        base = self.matrix_path.parent
        return (base / os.path.expandvars(cwd)).resolve() if cwd else base

    def environment(self, cell: Cell, mode: str, run_dir: Path,
                    base: Mapping[str, str] | None = None,
                    run_id: str | None = None) -> tuple[dict[str, str], dict[str, str]]:
        runner = self.matrix.runner
        profile = self.matrix.hardware[cell.hardware]
        topo = profile.topology
        contract = contract_env(cell, mode=mode, aligned=self.matrix.matrix.aligned,
                                run_id=run_id or self.run_id(cell, run_dir), artifact_dir=run_dir,
                                repeats=runner.repeats, warmup=runner.warmup,
                                topology={"tp": topo.tp, "cp": topo.cp, "pp": topo.pp,
                                          "gpus_per_cell": topo.devices_per_cell})
        full, recorded = cell_env(contract, profile_env=profile.env,
                                  runner_env=self.matrix.runner.env, python=sys.executable,
                                  base=base)
        share = self.cpu_share(cell, base)
        full.update(share.env)
        recorded.update(share.env)
        if cell.factor is not None:  # the variant's env: after the profile's and the runner's
            full.update(cell.factor.env)
            recorded.update(cell.factor.env)
        if self.devices is not None and profile.backend != "cpu":
            from pytest_rlkernel_matrix.run.devices import device_env

            pinned = device_env(profile.backend, self.devices)
            full.update(pinned)
            recorded.update(pinned)
        return full, recorded

    def cpu_share(self, cell: Cell, base: Mapping[str, str] | None = None) -> cpushare.CpuShare:
        """The CPUs and threads a cell of this process gets (`cpushare`); a thread variable the
        user set (environment, profile env, `[runner.env]`) wins. `--rlk-plan` passes an empty
        base: it still reports this session's own variables."""
        profile = self.matrix.hardware[cell.hardware]
        return cpushare.plan_share(self.cpu_slot, launcher=self.matrix.runner.launcher,
                                   inherited=base or os.environ, profile_env=profile.env,
                                   runner_env=self.matrix.runner.env)

    # -- running --------------------------------------------------------------------------------
    def run_cell(self, cell: Cell, *, mode: str, env_hook: Any = None) -> dict[str, Any]:
        """Run (or reuse) the run behind `cell` and return the cell's record."""
        if mode == "off" and not cell.cases.is_native:
            return off_mode_record(cell, mode)
        if cell.factor is not None:
            return self._run_factor_cell(cell, mode, env_hook)
        return self._run_one(cell, mode, env_hook)

    def _run_factor_cell(self, cell: Cell, mode: str, env_hook: Any) -> dict[str, Any]:
        """The baseline's run first (reused when a selected cell already ran it), then the
        factor's run, then the judge's comparison of the two rollouts in the record."""
        from pytest_rlkernel_matrix.judge.localise.factors import factor_block

        base_cell = self.factor_baseline(cell)
        base = self._run_one(base_cell, mode, env_hook)
        record = self._run_one(cell, mode, env_hook)
        base_dir = self.root / base["artifact_dir"] if base.get("artifact_dir") else None
        own_dir = self.root / record["artifact_dir"] if record.get("artifact_dir") else None
        record["factor"] = factor_block(record, cell.factor.as_dict(),  # type: ignore[union-attr]
                                        base_cell.id, own_dir, base_dir, base)
        return record

    def _run_one(self, cell: Cell, mode: str, env_hook: Any) -> dict[str, Any]:
        run_dir = self.run_dir(cell)
        lock = self.root / ".locks" / f"{cell.run_key.replace('/', '__')}.lock"
        with _locked(lock, self.root):
            cached = run_dir / RECORD_CACHE
            meta_path = run_dir / CELL_RUN_FILE
            if cell.run_key in self.pending:
                record = self._execute(cell, mode, run_dir, env_hook, self.blockers(cell, mode))
                return self._label(record, cell)
            if meta_path.exists():
                meta = json.loads(read_text(meta_path, self.root))
                if meta.get("superseded_by"):  # a requeued run: its second attempt decides
                    run_dir = self.root / meta["superseded_by"]
                    cached = run_dir / RECORD_CACHE
                if meta.get("session") != self.token or meta.get("mode") != mode:
                    return refusal_record(cell, mode, run_dir)
                if cached.exists():
                    record = json.loads(read_text(cached, self.root, MAX_REPORT_BYTES))
                else:
                    record = self._analyze(run_dir, cell)
                return self._label(record, cell)
            if run_dir.exists() and any(run_dir.iterdir()):
                return refusal_record(cell, mode, run_dir)
            record = self._execute(cell, mode, run_dir, env_hook, self.blockers(cell, mode))
            return self._label(record, cell)

    def blockers(self, cell: Cell, mode: str) -> list[list[str]]:
        """(class, reason) for each module whose requested R backend preflight found unavailable."""
        caps = self.preflight.get("capabilities")
        # Under Slurm the login node's capabilities and collectives say nothing about the compute
        # nodes: the node's own evidence (routes, fallbacks) decides there.
        if self.matrix.runner.launcher != "local":
            return []
        collective = [list(b) for b in self.collective_blockers(cell)]
        if mode == "off" or not caps:
            return collective
        from pytest_rlkernel_matrix.machine.capability import requested_r_blockers

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

    def _prepare(self, cell: Cell, mode: str, run_dir: Path, env_hook: Any,
                 attempt: int = 1, run_id: str | None = None,
                 extra_env: Mapping[str, str] | None = None) -> CellJob:
        """Create the run directory with `matrix-case.env`: what any launcher needs (`run_id`,
        `extra_env`: a measured run's own id and role variables)."""
        start = time.perf_counter()
        run_dir.mkdir(parents=True, exist_ok=True)
        for sub in ARTIFACT_SUBDIRS.values():
            (run_dir / sub).mkdir(exist_ok=True)
        env, recorded = self.environment(cell, mode, run_dir, run_id=run_id)
        env.update(extra_env or {})
        recorded.update(extra_env or {})
        share = self.cpu_share(cell)
        if env_hook is not None:
            extra: dict[str, str] = {}
            env_hook(cell=cell, env=extra)
            env.update(extra)
            recorded.update(extra)
            self.scrubber.add_env(extra)
            hooked = share.with_hook(extra)
            if hooked is not share:  # the hook's thread variable wins: drop the share's
                for var in share.env:
                    if var not in extra:
                        env.pop(var, None)
                        recorded.pop(var, None)
            share = hooked
        command = self.command(cell)
        cwd = self.command_cwd()
        write_text_atomic(run_dir / "matrix-case.env",
                          render_case_env(recorded, command, cwd, self.scrubber,
                                          comment=share.comment()))
        report_progress = self.progress

        def progress(elapsed: float, line: str) -> None:
            if report_progress is not None:
                report_progress(cell, elapsed, line)

        owner = self.canonical.get(cell.run_key, cell)
        self.timings[str(run_dir)] = {"env_s": time.perf_counter() - start}
        return CellJob(key=cell.run_key, label=f"{owner.hardware}/{run_dir.name}",
                       command=command if isinstance(command, str) else list(command),
                       cwd=cwd, env=env, recorded=recorded, run_dir=run_dir,
                       timeout=self.matrix.runner.timeout, progress=progress,
                       progress_every=self.progress_every, attempt=attempt,
                       kill_grace=self.matrix.runner.kill_grace, session_tag=self.token,
                       cpus=share.cpus if self.matrix.runner.launcher == "local" else None,
                       cpu_share=share.as_dict())

    def submit_ahead(self, cells: Sequence[Cell], mode: str, env_hook: Any = None) -> int:
        """Queue every selected run with a launcher that runs them concurrently (Slurm)."""
        started = 0
        for cell in cells:
            if cell.run_key in self.pending or (mode == "off" and not cell.cases.is_native):
                continue
            if mode == "strict" and self.blockers(cell, mode):
                continue
            run_dir = self.run_dir(cell)
            with _locked(self.root / ".locks" / f"{cell.run_key.replace('/', '__')}.lock",
                         self.root):
                if run_dir.exists() and any(run_dir.iterdir()):
                    continue  # the item reports the refusal
                job = self._prepare(cell, mode, run_dir, env_hook)
                self.launcher.start(job)
                self.pending[cell.run_key] = job
                started += 1
        return started

    def _wait(self, cell: Cell, job: CellJob) -> Outcome:
        """Wait for the launcher's outcome. Local runs are sampled for contamination on this host;
        a Slurm job runs on a compute node this process cannot sample, so its run directory gets
        no `contamination.json` and its timings are "not measured" (fail closed)."""
        start = time.perf_counter()
        preload.start()  # the analysis' imports, while the cell's process runs (once per process)
        try:
            if self.matrix.runner.launcher != "local":
                outcome = self.launcher.wait(job)
            else:
                with contamination.watch(
                        root=self.root, run_dir=job.run_dir,
                        run_id=job.env.get("RL_KERNEL_RUN_ID") or self.run_id(cell, job.run_dir),
                        cpus=job.cpus,
                        backend=self.matrix.hardware[cell.hardware].backend, env=job.env,
                        policy=Policy(**self.matrix.performance.model_dump())):
                    outcome = self.launcher.wait(job)
        finally:
            waited = time.perf_counter() - start
        # launch + contamination sampling + waiting slack: the wait beyond the process's wall
        self.timings.setdefault(str(job.run_dir), {})["launch_wait_s"] = max(
            0.0, waited - float(outcome.result.wall_time or 0.0))
        return outcome

    def _execute(self, cell: Cell, mode: str, run_dir: Path, env_hook: Any,
                 blockers: list[list[str]]) -> dict[str, Any]:
        job = self.pending.pop(cell.run_key, None) or self._prepare(cell, mode, run_dir, env_hook)
        command, recorded = job.command, job.recorded
        if blockers:
            self.write_json(run_dir / "capability-decision.json", {
                "mode": mode, "blockers": blockers,
                "decision": "not started (strict: fail closed before launch)" if mode == "strict"
                else "started: the requested path may not run; evidence decides",
            })
        if blockers and mode == "strict":
            now = datetime.now(UTC).isoformat(timespec="seconds")
            result = RunResult(command=command, exit_code=None, timed_out=False,
                               interrupted=False, wall_time=0.0, started=now, finished=now)
            write_text(run_dir / "exit-code", self.root, "not-started\n")
            return self._finish(cell, mode, run_dir, result, recorded, blockers,
                                cpu_share=job.cpu_share)
        outcome = self._wait(cell, job)
        if outcome.result.interrupted:
            # Ctrl-C / SIGTERM: record the cell (error, "interrupted"), then stop the session.
            with procs.STOP.cleaning_up():
                self._finish(cell, mode, run_dir, outcome.result, recorded, blockers, outcome,
                             cpu_share=job.cpu_share)
            raise KeyboardInterrupt
        record = self._finish(cell, mode, run_dir, outcome.result, recorded, blockers, outcome,
                              cpu_share=job.cpu_share)
        if not self.launcher.retryable(outcome) or job.attempt != 1:
            record = extra_runs.maybe_probe(self, cell, run_dir, job, record)
        if (self.launcher.retryable(outcome) and job.attempt == 1
                and not outcome.result.interrupted):
            retry_dir = run_dir.with_name(f"{run_dir.name}.attempt2")
            if retry_dir.exists():
                return record  # never overwrite
            meta_path = run_dir / CELL_RUN_FILE
            meta = json.loads(read_text(meta_path, self.root))
            meta["superseded_by"] = str(retry_dir.relative_to(self.root))
            write_json_atomic(meta_path, meta)
            retry = self._prepare(cell, mode, retry_dir, env_hook, attempt=2)
            first = {"artifact_dir": str(run_dir.relative_to(self.root)),
                     **(outcome.scheduler or {})}
            outcome = self._wait(cell, retry)
            if outcome.scheduler is not None:
                outcome.scheduler["previous_attempts"] = [first]
            record = self._finish(cell, mode, retry_dir, outcome.result, retry.recorded,
                                  blockers, outcome, cpu_share=retry.cpu_share)
            if not outcome.result.interrupted:  # the attempt that decides gets the probe
                record = extra_runs.maybe_probe(self, cell, retry_dir, retry, record)
        if outcome.result.interrupted:
            raise KeyboardInterrupt
        names = [c.name for c in self.cells if c.run_key == cell.run_key] + [cell.name]
        if self.matrix.reproducibility.chooses(names, cell.is_baseline) and not blockers:
            record = extra_runs.repeat(self, cell, mode, Path(self.root / record["artifact_dir"]),
                                       env_hook) or record
        if record.get("artifact_dir"):
            self.ran.append((cell, mode, self.root / record["artifact_dir"], env_hook))
        return record

    def _finish(self, cell: Cell, mode: str, run_dir: Path, result: RunResult,
                recorded: Mapping[str, str], blockers: list[list[str]],
                outcome: Outcome | None = None, cpu_share: Mapping[str, Any] | None = None,
                analyze: bool = True) -> dict[str, Any]:
        fingerprints: dict[str, str] = dict(self.fingerprints)
        scheduler = outcome.scheduler if outcome is not None else None
        if scheduler is not None:
            # The node's fingerprints, never the login node's; none when the job's probe failed.
            fingerprints = dict(outcome.fingerprints or {})  # type: ignore[union-attr]
            node_pre = outcome.node_preflight  # type: ignore[union-attr]
            if node_pre is not None:
                from pytest_rlkernel_matrix.machine.preflight import detect_hardware

                scheduler["node_hardware"] = detect_hardware(node_pre, self.matrix.hardware)
        meta = {
            "session": self.token,
            "cell": cell_to_dict(cell),
            "mode": mode,
            "run_id": recorded.get("RL_KERNEL_RUN_ID") or self.run_id(cell, run_dir),
            "artifact_dir": str(run_dir.relative_to(self.root)),
            "run": result.as_dict(),
            "timeout": self.matrix.runner.timeout,
            "warmup": self.matrix.runner.warmup,
            "performance_policy": self.matrix.performance.model_dump(),
            "env": {k: (REDACTED if is_secret(k) else v) for k, v in recorded.items()},
            "fingerprints": fingerprints,
            "preflight_blockers": blockers,
            "policy": self.policy(cell),
            "devices": self.devices, "worker": self.worker,
            "window": [result.started_epoch, result.finished_epoch],
            "cpu_share": _share_seen(cpu_share, result),
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
        record = self._analyze(run_dir, cell)
        self.write_json(run_dir / RECORD_CACHE, record)
        return record

    def policy(self, cell: Cell) -> dict[str, Any]:
        """How the matrix file says to judge `cell` (frozen into cell-run.json for re-analysis)."""
        m = self.matrix.matrix
        contract = m.baseline_contract
        return {"baseline_contract": None if contract is None else contract.as_dict(),
                "min_samples_per_rank": m.min_samples_per_rank,
                "min_active_tokens": m.min_active_tokens,
                "baseline_claims": list(m.baseline_claims),
                "require_rollout_weight_audit": m.require_rollout_weight_audit,
                "backend": self.matrix.hardware[cell.hardware].backend}

    def _analyze(self, run_dir: Path, cell: Cell) -> dict[str, Any]:
        gaps = self.matrix.hardware[cell.hardware].expect_unsupported
        return analyze_run(run_dir, gaps=gaps, fingerprints=self.fingerprints, cell=cell,
                           artifact_dir=str(run_dir.relative_to(self.root)),
                           scrubber=self.scrubber)

    def _label(self, record: dict[str, Any], cell: Cell) -> dict[str, Any]:
        out = alias_record(record, cell)
        out["shared_with"] = self.shared_with(cell)
        return out

    # -- stopping -------------------------------------------------------------------------------
    def stop_everything(self) -> list[int]:
        """Controller, at session end: no cell process outlives pytest.

        xdist workers of this session get SIGTERM (each stops its own cell and records it as
        interrupted) and some time to do so: until they exit, or no cell process of this session
        is left and every run directory it started holds its record. Then whatever process of
        any cell of this session is still alive (a worker died, a cell outlived its worker) is
        stopped here. Returns those pids.
        """
        grace = self.matrix.runner.kill_grace
        with procs.STOP.cleaning_up():
            workers = procs.session_workers(self.token) if self.interrupted else []
            for pid in workers:
                with suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace + 10
            while workers and time.monotonic() < deadline:
                if not procs.alive(workers) or (
                    not procs.session_processes(self.token)
                    and all((d / RECORD_CACHE).exists() for _, d, _ in self._own_runs())
                ):
                    break
                time.sleep(0.05)
            return procs.sweep(self.token, grace)

    def _own_runs(self) -> Iterator[tuple[Cell, Path, str]]:
        """(cell, run directory, run id) of every run this session started, from the disk."""
        layout = expand(self.matrix.matrix, self.hardware, self.layout, self.mode)
        factors = expand_factors(self.matrix.factors, self.matrix.matrix, self.hardware)
        by_dir = {(c.hardware, c.slug): c for c in
                  [*layout, *factors, *(c.baseline_cell(layout) for c in factors)]}
        for case_env in sorted(self.root.glob("*/*/matrix-case.env")):
            run_dir = case_env.parent
            cell = by_dir.get((run_dir.parent.name, run_dir.name))
            if cell is None:
                continue
            run_id = f"{cell.hardware}-{cell.slug}-{self._stamp()}Z-{self.token[:8]}"
            try:  # (store: regular, inside the root, bounded; a FIFO is never waited on)
                ours = f"RL_KERNEL_RUN_ID={run_id}\n" in read_text(case_env, self.root)
            except (OSError, UnicodeDecodeError, Refused):
                ours = False
            if ours:
                yield cell, run_dir, run_id

    def recover_records(self) -> None:
        """Controller, at session end: records of runs that never reached a test report.

        An interrupted cell raises KeyboardInterrupt after writing its record to disk, and a
        worker that died leaves its run directory behind without one: both become records here
        (the latter an `error`, "interrupted"), so the report lists every cell that ran. Only
        directories this session wrote count (their `RL_KERNEL_RUN_ID` carries its token).
        """
        have = {r.get("run_key") for r in self.records.values()}
        for cell, run_dir, run_id in self._own_runs():
            if cell.run_key in have:
                continue
            record: dict[str, Any]
            try:
                cached = run_dir / RECORD_CACHE
                record = (json.loads(read_text(cached, self.root, MAX_REPORT_BYTES))
                          if cached.exists() else self._analyze(run_dir, cell))
            except (OSError, ValueError, KeyError, Refused):
                record = interrupted_record(cell, self.mode,
                                            str(run_dir.relative_to(self.root)), run_id)
            have.add(cell.run_key)
            self.add_record(cell.id, self._label(self.scrubber.obj(record), cell))

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
            from pytest_rlkernel_matrix.run.devices import mark_overlaps

            mark_overlaps(self.records)
        pre: dict[str, Any] = {"file": PREFLIGHT_FILE, **self.fingerprints}
        if self.preflight.get("capabilities"):
            pre["capabilities"] = self.preflight["capabilities"]
        reused = (self.preflight.get("probe") or {}).get("reused")
        if reused:  # a test suite's shared probe (RLK_REUSE_PROBE): never a fresh one
            pre["probe_reused"] = reused
        report = build_report(
            list(self.records.values()), matrix=matrix, matrix_root=self.root, preflight=pre,
            created=self.created, expected_cells=self.expected_cells,
            interrupted=self.interrupted,
        )
        if self.selection is not None:  # a rerun or subset: what it ran, of which root
            from pytest_rlkernel_matrix.report.rerun import apply_selection

            apply_selection(report, self.selection)
        path = self.root / REPORT_FILE
        report = self.scrubber.obj(report)
        write_json_atomic(path, report)
        from pytest_rlkernel_matrix.report.html import HTML_FILE, write_html

        write_html(report, self.root / HTML_FILE, self.scrubber.obj(self.preflight))
        return path
