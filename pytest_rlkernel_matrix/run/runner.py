"""Run one cell's command in a fresh process under the RL-Kernel environment contract.

Writes `matrix-case.env` (a sourceable copy of what the cell was given, secrets redacted),
streams stdout+stderr to `run.log`, writes `exit-code`. On timeout or Ctrl-C/SIGTERM, and after
the main process exits, every process the cell started is stopped: SIGTERM, a grace period, then
SIGKILL, to the whole process family (`procs`: the process group, `setsid()` escapes, background
children left behind), and `run.log` says so.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from pytest_rlkernel_matrix.run import cpushare, procs
from pytest_rlkernel_matrix.spec.cells import Cell
from pytest_rlkernel_matrix.store.redact import REDACTED, Scrubber, is_secret
from pytest_rlkernel_matrix.store.safeio import (
    MAX_LOG_BYTES,
    Refused,
    open_append,
    open_regular,
    write_text,
)

__all__ = ["REDACTED", "RunResult", "is_secret", "run_cell_command"]

# Inherited variables worth recording in matrix-case.env (the rest of os.environ is not copied
# into the file; the process still inherits it): these names, and names with these prefixes.
RECORDED_INHERITED = (
    "VIME_ROOT", "RL_KERNEL_ROOT", "MEGATRON_ROOT", "PYTHON_BIN", "PYTHONPATH",
    "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "ROCM_HOME", "ROCM_PATH", "HIP_PATH",
    "PYTORCH_ROCM_ARCH",
)
RECORDED_PREFIXES = (
    "RL_KERNEL_", "RLK_", "VIME_", "VLLM_", "MEGATRON_", "NCCL_", "RCCL_", "HSA_", "CUDA_",
    "HIP_", "ROCR_", "TORCH_", "NVTE_",
)
ARTIFACT_SUBDIRS = {
    "RL_KERNEL_READBACK_DIR": "readbacks",
    "RL_KERNEL_MISMATCH_SIDECAR_DIR": "mismatch-sidecars",
    "RL_KERNEL_WEIGHT_AUDIT_DIR": "weight-audit",
}
KILL_GRACE_S = 5.0


@dataclass
class RunResult:
    """What the process did, as seen from outside it."""

    command: str | list[str]
    exit_code: int | None
    timed_out: bool
    interrupted: bool
    wall_time: float
    started: str
    finished: str
    launch_error: str | None = None
    # The main process's pid, and every pid the runner had to signal to stop the cell (on
    # timeout/interrupt, or left behind after the main process exited).
    pid: int | None = None
    killed_pids: list[int] = field(default_factory=list)
    leftover_pids: list[int] = field(default_factory=list)
    started_epoch: float | None = None  # time.time() bounds: overlap checks between cells
    finished_epoch: float | None = None
    # CPU affinity the cell's main process was started with (`cpushare`): "applied (...)", why
    # not, or None when none was asked for.
    cpu_affinity: str | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def contract_env(
    cell: Cell, *, mode: str, aligned: bool, run_id: str, artifact_dir: Path,
    repeats: int = 1, warmup: int = 0, topology: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """The request's env contract for one cell (plus the profile's parallel sizes, which the
    reference workload reads; other commands may ignore them)."""
    env = {
        "RL_KERNEL_MODE": mode,
        "RL_KERNEL_ALIGNED": "1" if aligned else "0",
        **cell.cases.env(),
        "RL_KERNEL_RUN_ID": run_id,
        "RL_KERNEL_ARTIFACT_DIR": str(artifact_dir),
        "RL_KERNEL_ROUTE_REPORT": "1",
        # Measured steps the job should run: `warmup` unmeasured ones, then `repeats`.
        "RL_KERNEL_MATRIX_REPEATS": str(repeats),
        "RL_KERNEL_MATRIX_WARMUP": str(warmup),
    }
    for var, sub in ARTIFACT_SUBDIRS.items():
        env[var] = str(artifact_dir / sub)
    for axis, size in (topology or {}).items():
        env[f"RL_KERNEL_MATRIX_{axis.upper()}"] = str(size)
    return env


def cell_env(
    contract: Mapping[str, str],
    *,
    profile_env: Mapping[str, str],
    runner_env: Mapping[str, str],
    python: str,
    base: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """Full process env and the part to record. Precedence: contract > runner > profile > base."""
    inherited = dict(os.environ if base is None else base)
    given: dict[str, str] = {}
    if "PYTHON_BIN" not in inherited:
        given["PYTHON_BIN"] = python
    given.setdefault("PYTHONUNBUFFERED", "1")
    given.update(profile_env)
    given.update(runner_env)
    given.update(contract)
    full = {**inherited, **given}
    recorded = {k: v for k, v in inherited.items()
                if k in RECORDED_INHERITED or k.startswith(RECORDED_PREFIXES)}
    recorded.update(given)
    return full, recorded


def render_case_env(recorded: Mapping[str, str], command: str | Sequence[str], cwd: Path,
                    scrubber: Scrubber | None = None, comment: str = "") -> str:
    """`matrix-case.env`: sourceable `export` lines plus the command, secrets redacted by name
    and (through `scrubber`, by default one built from `recorded` and `command`) by value."""
    scrub = scrubber or Scrubber.from_env(recorded, command)
    shown = command if isinstance(command, str) else shlex.join(command)
    lines = [
        "# matrix-case.env written by pytest-rlkernel-matrix; `source` it to rerun this cell:",
        f"#   cd {shlex.quote(str(cwd))} && {shown}",
        *([comment] if comment else []),
    ]
    for key in sorted(recorded):
        value = REDACTED if is_secret(key) else recorded[key]
        lines.append(f"export {key}={shlex.quote(value)}")
    return scrub.text("\n".join(lines) + "\n")


def _utc() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def last_line(log_path: Path, tail_bytes: int = 4096) -> str:
    """The last non-empty line of a (growing) log, read from its end only."""
    try:
        handle, _ = open_regular(log_path, log_path.parent, MAX_LOG_BYTES)
        with handle as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - tail_bytes))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except (OSError, Refused):
        return ""
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return ""


def _stop(main: procs.Main, family: procs.Family, grace: float) -> list[int]:
    """Stop the whole family, the main process included; returns the pids signalled.

    Bounded: at most about `2 * grace + 10` s however the processes behave (a second Ctrl-C or
    SIGTERM cuts the graces short). The main process is waited for through `procs.Main`, never
    `Popen.wait`, whose lock an interrupt may have left held (then `wait()` never returns). One
    that is still not collected after SIGKILL and the waits (stuck in the kernel) is left: its
    exit code stays unknown (`None`) and the caller says so.
    """
    with procs.STOP.cleaning_up():
        hurry = procs.STOP.hurry()
        killed = procs.terminate(family, grace, hurry)
        if not main.wait(grace + 5, hurry):  # terminate() sent SIGKILL already
            main.kill()
            main.wait(5)
        family.main_alive = False
        return killed + procs.terminate(family, grace, procs.STOP.hurry())


def run_cell_command(
    command: str | Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout: float,
    artifact_dir: Path,
    progress: Callable[[float, str], None] | None = None,
    progress_every: float = 30.0,
    kill_grace: float = KILL_GRACE_S,
    raise_on_interrupt: bool = True,
    session_tag: str = "",
    cpus: Sequence[int] | None = None,
) -> RunResult:
    """Run the command; `run.log` and `exit-code` land in `artifact_dir`.

    `progress(elapsed_s, last_log_line)` is called every `progress_every` seconds while it runs.
    Every process the command started is stopped before this returns (`procs`): on timeout and
    on KeyboardInterrupt (Ctrl-C, or SIGTERM once the plugin's handler is installed) the whole
    family, and after a normal exit whatever it left running, with SIGTERM, `kill_grace` seconds,
    then SIGKILL. An interrupted run re-raises KeyboardInterrupt after writing `exit-code`
    unless `raise_on_interrupt` is False (then `RunResult.interrupted` says so: the caller records
    the cell, then raises). `session_tag` prefixes the marker variable the cell's processes carry.
    `cpus`: the CPU affinity the cell's process group starts with (`cpushare.pinned_start`).
    """
    argv: list[str] = ["bash", "-c", command] if isinstance(command, str) else list(command)
    log_path = artifact_dir / "run.log"
    started, t0, epoch0 = _utc(), time.monotonic(), time.time()
    timed_out = interrupted = False
    exit_code: int | None = None
    launch_error: str | None = None
    killed: list[int] = []
    leftover: list[int] = []
    pid: int | None = None
    affinity: str | None = None
    marker = f"{session_tag}:{uuid.uuid4().hex}" if session_tag else uuid.uuid4().hex
    child_env = {**env, procs.MARKER_VAR: marker}
    before = frozenset(procs.children(os.getpid())) if procs.available() else frozenset()
    reaper = procs.set_subreaper(True)
    try:
        with open_append(log_path, artifact_dir) as log:  # never through a link (store)
            pin = cpushare.pinned_start(cpus)
            try:
                with pin:
                    proc = subprocess.Popen(
                        argv, cwd=cwd, env=child_env, stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True,
                    )
            except OSError as exc:
                launch_error = f"cannot start {argv[0]!r}: {exc.strerror or exc}"
                log.write(f"[rlk-matrix] {launch_error}\n".encode())
            else:
                pid = proc.pid
                family = procs.Family(proc.pid, marker, before)
                main = procs.Main(proc)  # never Popen.wait: see procs.Main
                try:
                    if cpus:
                        affinity = _affinity_seen(proc.pid, cpus, pin.error)
                        if not affinity.startswith("applied"):
                            log.write(f"[rlk-matrix] CPU affinity {affinity}\n".encode())
                            log.flush()
                    deadline = t0 + timeout
                    while True:
                        step = min(progress_every, deadline - time.monotonic())
                        if main.wait(max(step, 0.01)):
                            exit_code = main.returncode
                            break
                        if time.monotonic() >= deadline:
                            raise subprocess.TimeoutExpired(argv, timeout)
                        if progress is not None:
                            log.flush()
                            progress(time.monotonic() - t0, last_line(log_path))
                except subprocess.TimeoutExpired:
                    timed_out = True
                    killed = _stop(main, family, kill_grace)
                    exit_code = main.returncode
                    _unknown_exit(main, log)
                    log.write(
                        f"\n[rlk-matrix] timeout after {timeout:g} s: killed process group "
                        f"{proc.pid} and {len(killed)} process(es) of the cell: "
                        f"{_pids(killed)}\n".encode()
                    )
                except KeyboardInterrupt:
                    with procs.STOP.cleaning_up():
                        interrupted = True
                        killed = _stop(main, family, kill_grace)
                        exit_code = main.returncode
                        _unknown_exit(main, log)
                        log.write(
                            f"\n[rlk-matrix] interrupted: killed process group {proc.pid} and "
                            f"{len(killed)} process(es) of the cell: {_pids(killed)}\n".encode()
                        )
                else:
                    # The main process exited: nothing it started may outlive it.
                    family.main_alive = False
                    with procs.STOP.cleaning_up():
                        leftover = procs.terminate(family, kill_grace, procs.STOP.hurry())
                    if leftover:
                        killed = leftover
                        log.write(
                            f"\n[rlk-matrix] the main process exited ({exit_code}) leaving "
                            f"{len(leftover)} process(es) running: killed {_pids(leftover)}\n"
                            .encode()
                        )
    finally:
        if reaper:
            procs.set_subreaper(False)
    result = RunResult(
        command=command if isinstance(command, str) else list(command),
        exit_code=exit_code,
        timed_out=timed_out,
        interrupted=interrupted,
        wall_time=round(time.monotonic() - t0, 3),
        started=started,
        finished=_utc(),
        launch_error=launch_error,
        pid=pid,
        killed_pids=killed,
        leftover_pids=leftover,
        started_epoch=round(epoch0, 3),
        finished_epoch=round(time.time(), 3),
        cpu_affinity=affinity,
    )
    write_text(artifact_dir / "exit-code", artifact_dir,
               f"{'' if exit_code is None else exit_code}\n")
    if interrupted and raise_on_interrupt:
        raise KeyboardInterrupt
    return result


def _unknown_exit(main: procs.Main, log: BinaryIO) -> None:
    if not main.poll():
        log.write(f"\n[rlk-matrix] the main process {main.proc.pid} was not seen to exit after "
                  f"SIGKILL (stuck in the kernel?): its exit code is unknown\n".encode())


def _affinity_seen(pid: int, cpus: Sequence[int], error: str | None) -> str:
    """What the started process's affinity is, read back from the kernel."""
    if error:
        return f"not set: {error}"
    if not cpushare.can_pin():
        return "not set: this OS has no sched_setaffinity"
    want = cpushare.cpu_list(cpus)
    try:
        got = cpushare.cpu_list(sorted(os.sched_getaffinity(pid)))
    except OSError:  # it exited already: it started on the starting thread's mask
        return f"applied (cpus {want})"
    return f"applied (cpus {want})" if got == want else f"not as asked: {got}, wanted {want}"


def _pids(pids: Sequence[int]) -> str:
    return ", ".join(map(str, pids[:20])) + (" ..." if len(pids) > 20 else "") or "none"
