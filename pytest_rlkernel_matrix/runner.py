"""Run one cell's command in a fresh process under the RL-Kernel environment contract.

Writes `matrix-case.env` (a sourceable copy of what the cell was given, secrets redacted),
streams stdout+stderr to `run.log`, writes `exit-code`, and on timeout or Ctrl-C kills the
whole process group (launchers start vLLM/Megatron children) and says so in `run.log`.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from pytest_rlkernel_matrix.cells import Cell

SECRET_RE = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
REDACTED = "<redacted>"

# Inherited variables worth recording in matrix-case.env (the rest of os.environ is not copied
# into the file; the process still inherits it): these names, and names with these prefixes.
RECORDED_INHERITED = (
    "VIME_ROOT", "RL_KERNEL_ROOT", "MEGATRON_ROOT", "PYTHON_BIN", "PYTHONPATH",
    "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "ROCM_HOME", "ROCM_PATH", "HIP_PATH",
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
    started_epoch: float | None = None  # time.time() bounds: overlap checks between cells
    finished_epoch: float | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def is_secret(name: str) -> bool:
    return bool(SECRET_RE.search(name))


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


def render_case_env(recorded: Mapping[str, str], command: str | Sequence[str], cwd: Path) -> str:
    """`matrix-case.env`: sourceable `export` lines plus the command, secrets redacted."""
    shown = command if isinstance(command, str) else shlex.join(command)
    lines = [
        "# matrix-case.env written by pytest-rlkernel-matrix; `source` it to rerun this cell:",
        f"#   cd {shlex.quote(str(cwd))} && {shown}",
    ]
    for key in sorted(recorded):
        value = REDACTED if is_secret(key) else recorded[key]
        lines.append(f"export {key}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def _utc() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def last_line(log_path: Path, tail_bytes: int = 4096) -> str:
    """The last non-empty line of a (growing) log, read from its end only."""
    try:
        with log_path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - tail_bytes))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.strip():
            return line.strip()
    return ""


def run_cell_command(
    command: str | Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    timeout: float,
    artifact_dir: Path,
    progress: Callable[[float, str], None] | None = None,
    progress_every: float = 30.0,
) -> RunResult:
    """Run the command; `run.log` and `exit-code` land in `artifact_dir`.

    `progress(elapsed_s, last_log_line)` is called every `progress_every` seconds while it runs.
    """
    argv: list[str] = ["bash", "-c", command] if isinstance(command, str) else list(command)
    log_path = artifact_dir / "run.log"
    started, t0, epoch0 = _utc(), time.monotonic(), time.time()
    timed_out = interrupted = False
    exit_code: int | None = None
    launch_error: str | None = None
    with log_path.open("ab") as log:
        try:
            proc = subprocess.Popen(
                argv, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        except OSError as exc:
            launch_error = f"cannot start {argv[0]!r}: {exc.strerror or exc}"
            log.write(f"[rlk-matrix] {launch_error}\n".encode())
        else:
            try:
                deadline = t0 + timeout
                while True:
                    step = min(progress_every, deadline - time.monotonic())
                    try:
                        exit_code = proc.wait(timeout=max(step, 0.01))
                        break
                    except subprocess.TimeoutExpired:
                        if time.monotonic() >= deadline:
                            raise
                        if progress is not None:
                            log.flush()
                            progress(time.monotonic() - t0, last_line(log_path))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                exit_code = proc.returncode
                log.write(
                    f"\n[rlk-matrix] timeout after {timeout:g} s: killed process group "
                    f"{proc.pid}\n".encode()
                )
            except KeyboardInterrupt:
                interrupted = True
                _kill_group(proc)
                exit_code = proc.returncode
                log.write(f"\n[rlk-matrix] interrupted: killed process group {proc.pid}\n".encode())
    result = RunResult(
        command=command if isinstance(command, str) else list(command),
        exit_code=exit_code,
        timed_out=timed_out,
        interrupted=interrupted,
        wall_time=round(time.monotonic() - t0, 3),
        started=started,
        finished=_utc(),
        launch_error=launch_error,
        started_epoch=round(epoch0, 3),
        finished_epoch=round(time.time(), 3),
    )
    (artifact_dir / "exit-code").write_text(f"{'' if exit_code is None else exit_code}\n")
    if interrupted:
        raise KeyboardInterrupt
    return result
