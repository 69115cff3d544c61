"""`launcher = "slurm"`: each cell is one batch job; the pytest session stays on the login node.

Jobs are submitted up to `max_concurrent` at once (the session queues every selected cell ahead of
time; each item waits for its own job, and a finished job makes room for the next). States come
from `squeue --states=all`, details of finished jobs from `scontrol show job` (no slurmdbd
needed; the controller keeps finished jobs for `MinJobAge`), else `sacct`. The Slurm CLI is used
rather than a Python binding (pyslurm must match the cluster's exact Slurm version and build).

A job that did not complete never reads as a clean run: TIMEOUT, OUT_OF_MEMORY, NODE_FAIL,
PREEMPTED, CANCELLED, ... become the run's `launch_error` (so the verdict is `error` with that
reason). Each job writes a marker first; a finished job whose marker the session cannot see means
the matrix root is not on a filesystem the compute nodes share, which is an error too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.run.launchers.base import CellJob, Outcome
from pytest_rlkernel_matrix.run.runner import RunResult, is_secret, last_line
from pytest_rlkernel_matrix.spec.matrix import SlurmSection
from pytest_rlkernel_matrix.store.safeio import (
    MAX_SMALL_BYTES,
    Refused,
    open_append,
    read_text,
    write_new_text,
    write_text,
)

SCRIPT_FILE = "slurm-job.sh"
MARKER_FILE = "slurm-marker"
TIMES_FILE = "slurm-times"
NODE_PREFLIGHT = "node-preflight.json"
CLI_TIMEOUT_S = 60.0

PENDING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                            "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"})
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING"})
# Terminal states other than COMPLETED/FAILED: the command did not run to its end.
ABNORMAL_STATES = frozenset({"TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "CANCELLED",
                             "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})
TERMINAL_STATES = ABNORMAL_STATES | {"COMPLETED", "FAILED"}
_KEY_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=")


class SlurmError(Exception):
    """A Slurm command that failed (the message says which and why)."""


# --------------------------------------------------------------------------- parsing (pure)


def parse_sbatch(text: str) -> str:
    """`sbatch --parsable` prints `jobid` or `jobid;cluster`."""
    for line in text.strip().splitlines()[::-1]:
        head = line.strip().split(";", 1)[0]
        if head.isdigit() or re.fullmatch(r"\d+_\d+", head):
            return head
    raise SlurmError(f"sbatch printed no job id: {text.strip()[:200]!r}")


def base_state(state: str) -> str:
    """`CANCELLED by 0` -> `CANCELLED`; `COMPLETING+` -> `COMPLETING`."""
    word = state.strip().split(" ", 1)[0] if state.strip() else "UNKNOWN"
    return word.rstrip("+").upper()


@dataclass
class JobInfo:
    """What the scheduler says about one job."""

    job_id: str
    state: str
    nodes: str = ""
    reason: str = ""
    exit_code: str = ""
    start: str = ""
    end: str = ""
    run_time: str = ""
    source: str = ""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def as_dict(self) -> dict[str, str]:
        return {"job_id": self.job_id, "state": self.state, "nodes": self.nodes,
                "reason": self.reason, "exit_code": self.exit_code, "start": self.start,
                "end": self.end, "run_time": self.run_time, "source": self.source}


def parse_squeue(text: str) -> dict[str, JobInfo]:
    """Lines of `squeue -h --states=all -o '%i|%T|%N|%r'`."""
    out: dict[str, JobInfo] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or not parts[0]:
            continue
        out[parts[0]] = JobInfo(parts[0], base_state(parts[1]), parts[2],
                                "" if parts[3] in ("None", "(null)") else parts[3],
                                source="squeue")
    return out


def parse_scontrol(text: str) -> dict[str, str]:
    """One `scontrol show job -o` line as key -> value (values may hold spaces)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    starts = [(m.start(1), m.end(), m.group(1)) for m in _KEY_RE.finditer(line)]
    out: dict[str, str] = {}
    for i, (_, value_start, key) in enumerate(starts):
        value_end = starts[i + 1][0] if i + 1 < len(starts) else len(line)
        out[key] = line[value_start:value_end].strip()
    return out


def info_from_scontrol(fields: Mapping[str, str]) -> JobInfo:
    def clean(v: str | None) -> str:
        return "" if v in (None, "None", "(null)", "Unknown") else str(v)

    return JobInfo(
        job_id=fields.get("JobId", ""), state=base_state(fields.get("JobState", "UNKNOWN")),
        nodes=clean(fields.get("NodeList")), reason=clean(fields.get("Reason")),
        exit_code=clean(fields.get("ExitCode")), start=clean(fields.get("StartTime")),
        end=clean(fields.get("EndTime")), run_time=clean(fields.get("RunTime")),
        source="scontrol",
    )


SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Start", "End", "Elapsed", "Reason")


def parse_sacct(text: str) -> dict[str, JobInfo]:
    """`sacct -n -P -X -o JobID,State,ExitCode,NodeList,Start,End,Elapsed,Reason` lines."""
    out: dict[str, JobInfo] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < len(SACCT_FIELDS) or not parts[0] or "." in parts[0]:
            continue
        jid, state, code, nodes, start, end, elapsed, reason = parts[:8]
        out[jid] = JobInfo(jid, base_state(state), "" if nodes == "None assigned" else nodes,
                           "" if reason == "None" else reason, code,
                           "" if start == "Unknown" else start, "" if end == "Unknown" else end,
                           elapsed, source="sacct")
    return out


def seconds(value: str) -> float | None:
    """Slurm durations: `MM:SS`, `HH:MM:SS`, `D-HH:MM:SS` -> seconds."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", value.strip())
    if not m:
        return None
    d, h, mi, s = (int(g) if g else 0 for g in m.groups())
    return float(((d * 24 + h) * 60 + mi) * 60 + s)


def scheduler_reason(info: JobInfo) -> str | None:
    """The reason a job's run cannot count, or None when the job ran its script to the end."""
    if info.state in ("COMPLETED", "FAILED"):
        return None
    where = f" on {info.nodes}" if info.nodes else ""
    detail = ", ".join(x for x in (info.reason and f"reason {info.reason}",
                                   info.exit_code and f"exit {info.exit_code}") if x)
    what = {
        "TIMEOUT": "hit its Slurm time limit",
        "OUT_OF_MEMORY": "was killed for exceeding its memory",
        "NODE_FAIL": "lost its node",
        "PREEMPTED": "was preempted",
        "CANCELLED": "was cancelled (scancel)",
    }.get(info.state, f"ended {info.state}")
    return (f"{info.state}: Slurm job {info.job_id}{where} {what}"
            + (f" ({detail})" if detail else "") + "; the command did not run to its end")


# --------------------------------------------------------------------------- batch script


def time_limit(section: SlurmSection, timeout: float) -> str:
    """`[runner.slurm] time`, else the runner timeout plus 2 minutes for the node preflight."""
    if section.time:
        return section.time
    return str(max(1, math.ceil(timeout / 60.0)) + 2)


def sbatch_options(section: SlurmSection, job: CellJob) -> list[str]:
    opts = [f"--job-name=rlk-{job.label.replace('/', '-')}",
            f"--output={job.run_dir / 'slurm-%j.out'}", f"--chdir={job.cwd}", "--no-requeue",
            f"--nodes={section.nodes}", f"--time={time_limit(section, job.timeout)}"]
    for flag, value in (("--partition", section.partition),
                        ("--gpus-per-node", section.gpus_per_node), ("--gres", section.gres),
                        ("--cpus-per-task", section.cpus_per_task),
                        ("--account", section.account), ("--qos", section.qos),
                        ("--constraint", section.constraint)):
        if value is not None:
            opts.append(f"{flag}={value}")
    return opts + list(section.extra_args)


def render_script(section: SlurmSection, job: CellJob, *, python: str,
                  topology: Mapping[str, Any] | None = None) -> str:
    """The batch script of one cell: marker, env contract, node preflight, the command."""
    q = shlex.quote
    run_dir = q(str(job.run_dir))
    lines = ["#!/bin/bash",
             f"# pytest-rlkernel-matrix: cell run {job.label} (attempt {job.attempt})"]
    lines += [f"#SBATCH {opt}" for opt in sbatch_options(section, job)]
    lines += [
        "set -u",
        f"RLK_RUN_DIR={run_dir}",
        "# 1. the marker the session must find: proves the matrix root is shared with this node",
        'printf "%s %s %s\\n" "${SLURM_JOB_ID:-?}" "$(hostname)" "$(date +%s.%N)" '
        f'> "$RLK_RUN_DIR/{MARKER_FILE}"',
        f"cd {q(str(job.cwd))} || exit 97",
        "# 2. the env contract (secrets are not written here: they come from the submitting",
        "#    environment, which sbatch exports)",
    ]
    for key in sorted(job.recorded):
        if is_secret(key):
            lines.append(f"# {key}: from the submitting environment (secret)")
        else:
            lines.append(f"export {key}={q(job.recorded[key])}")
    probe = [python, "-m", "pytest_rlkernel_matrix.run.launchers.node",
             f"{job.run_dir}/{NODE_PREFLIGHT}"]
    probe_cmd = " ".join(q(p) for p in probe) + ' --python "${PYTHON_BIN:-python3}"'
    if topology is not None:
        probe_cmd += f" --topology {q(json.dumps(dict(topology), sort_keys=True))}"
    command = (f"bash -c {q(job.command)}" if isinstance(job.command, str)
               else " ".join(q(a) for a in job.command))
    lines += [
        "# 3. the same preflight probe as the login node, on this node: its fingerprints",
        f'{probe_cmd} > "$RLK_RUN_DIR/node-preflight.log" 2>&1 '
        '|| echo "[rlk-matrix] node preflight failed: see node-preflight.log"',
        "# 4. the cell's command, logged and its exit code kept as a local run keeps them",
        f'echo "command_start $(date +%s.%N)" >> "$RLK_RUN_DIR/{TIMES_FILE}"',
        f'{command} >> "$RLK_RUN_DIR/run.log" 2>&1 < /dev/null',
        "code=$?",
        'printf "%s\\n" "$code" > "$RLK_RUN_DIR/exit-code"',
        f'echo "command_end $(date +%s.%N)" >> "$RLK_RUN_DIR/{TIMES_FILE}"',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the CLI


def _cli(argv: Sequence[str],
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
                              env=None if env is None else dict(env), stdin=subprocess.DEVNULL,
                              check=False)
    except FileNotFoundError as exc:
        raise SlurmError(f"{argv[0]} not found: is Slurm's client installed? ({exc})") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv[:3])} did not answer in {CLI_TIMEOUT_S:g} s") from None


def query(job_ids: Sequence[str]) -> dict[str, JobInfo]:
    """States of these jobs: squeue for all at once, scontrol/sacct for what squeue lost."""
    if not job_ids:
        return {}
    proc = _cli(["squeue", "-h", "--states=all", "-j", ",".join(job_ids), "-o", "%i|%T|%N|%r"])
    found = parse_squeue(proc.stdout) if proc.returncode == 0 else {}
    for jid in job_ids:
        if jid not in found:
            info = details(jid)
            if info is not None:
                found[jid] = info
    return found


def details(job_id: str) -> JobInfo | None:
    """Full facts of one job from scontrol, else sacct; None when neither knows it."""
    proc = _cli(["scontrol", "show", "job", "-o", job_id])
    if proc.returncode == 0 and proc.stdout.strip():
        return info_from_scontrol(parse_scontrol(proc.stdout))
    with contextlib.suppress(SlurmError):
        acct = _cli(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", ",".join(SACCT_FIELDS)])
        if acct.returncode == 0:
            return parse_sacct(acct.stdout).get(job_id)
    return None


def scancel(job_ids: Sequence[str]) -> None:
    if job_ids:
        with contextlib.suppress(SlurmError):
            _cli(["scancel", *job_ids])


# --------------------------------------------------------------------------- the launcher


def _utc() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _read_times(run_dir: Path) -> dict[str, float]:
    out: dict[str, float] = {}
    with contextlib.suppress(OSError, Refused):
        for line in read_text(run_dir / TIMES_FILE, run_dir, MAX_SMALL_BYTES).splitlines():
            parts = line.split()
            with contextlib.suppress(ValueError, IndexError):
                out[parts[0]] = float(parts[1])
    with contextlib.suppress(OSError, ValueError, IndexError, Refused):
        out["marker"] = float(read_text(run_dir / MARKER_FILE, run_dir, MAX_SMALL_BYTES)
                              .split()[2])
    return out


class SlurmLauncher:
    """Queue, submit, poll and collect the batch jobs of one pytest session."""

    name = "slurm"

    def __init__(self, section: SlurmSection, *, python: str | None = None,
                 topology: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.section = section
        self.python = python or sys.executable
        self.topology = dict(topology or {})  # hardware profile -> topology
        self.queue: list[CellJob] = []
        self.active: dict[str, CellJob] = {}  # job id -> job
        self.finished: dict[str, JobInfo] = {}  # job id -> final info
        self.cancelled: set[str] = set()
        self._sigterm_installed = False

    # -- protocol -------------------------------------------------------------------------------
    def render(self, job: CellJob) -> str:
        hardware = job.label.split("/", 1)[0]
        return render_script(self.section, job, python=self.python,
                             topology=self.topology.get(hardware))

    def start(self, job: CellJob) -> None:
        if job.handle.get("queued"):
            return
        job.handle["queued"] = True
        self.queue.append(job)
        self._pump()

    def wait(self, job: CellJob) -> Outcome:
        self.start(job)
        interrupted = runner_timeout = False
        last_state, last_report = "", 0.0
        try:
            while True:
                self._poll()
                jid = job.handle.get("job_id")
                if job.handle.get("error") or (jid and jid in self.finished):
                    break
                state = job.handle.get("state", "QUEUED")
                if state in RUNNING_STATES:
                    job.handle.setdefault("running_since", time.monotonic())
                    if time.monotonic() - job.handle["running_since"] > job.timeout:
                        runner_timeout = True
                        scancel([jid])
                        self.cancelled.add(jid)
                        self._await_end(jid)
                        break
                now = time.monotonic()
                if job.progress is not None and (state != last_state
                                                 or now - last_report >= job.progress_every):
                    last_state, last_report = state, now
                    job.progress(now - job.handle.get("submitted_mono", now), self._line(job))
                time.sleep(self.section.poll_interval)
        except KeyboardInterrupt:
            interrupted = True
            self.cancel_all("interrupted")
            if job.handle.get("job_id"):
                self._await_end(job.handle["job_id"])
        return self._outcome(job, interrupted=interrupted, runner_timeout=runner_timeout)

    def cancel_all(self, why: str) -> list[str]:
        """scancel every job of this session still queued or running; drop the local queue."""
        ids = [jid for jid in self.active if jid not in self.finished]
        for job in self.queue:
            job.handle["error"] = f"CANCELLED: not submitted ({why})"
        self.queue.clear()
        scancel(ids)
        self.cancelled.update(ids)
        return ids

    def retryable(self, outcome: Outcome) -> bool:
        state = (outcome.scheduler or {}).get("state")
        return state in self.section.requeue_on

    # -- internals ------------------------------------------------------------------------------
    def _line(self, job: CellJob) -> str:
        jid = job.handle.get("job_id", "-")
        state = job.handle.get("state", "QUEUED")
        where = job.handle.get("nodes") or job.handle.get("reason") or ""
        tail = last_line(job.run_dir / "run.log")
        text = f"slurm job {jid} {state}" + (f" {where}" if where else "")
        return text + (f"; run.log: {tail}" if tail else "")

    def _install_sigterm(self) -> None:
        if self._sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: Any) -> None:
            self.cancel_all("SIGTERM")
            if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
                previous(signum, frame)
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, on_term)
        self._sigterm_installed = True

    def _pump(self) -> None:
        while self.queue and sum(1 for j in self.active if j not in self.finished) < \
                self.section.max_concurrent:
            self._submit(self.queue.pop(0))

    def _submit(self, job: CellJob) -> None:
        self._install_sigterm()
        script = job.run_dir / SCRIPT_FILE
        try:  # (store: created new, never through a link planted at its path)
            write_new_text(script, self.render(job))
        except FileExistsError:
            job.handle["error"] = f"refusing to overwrite {script}"
            return
        job.handle.update(submitted=_utc(), submitted_mono=time.monotonic(), script=SCRIPT_FILE)
        try:
            proc = _cli(["sbatch", "--parsable", str(script)], env=job.env)
            if proc.returncode != 0:
                raise SlurmError(f"sbatch exited {proc.returncode}: "
                                 f"{(proc.stderr or proc.stdout).strip()[:300]}")
            jid = parse_sbatch(proc.stdout)
        except SlurmError as exc:
            job.handle["error"] = f"sbatch failed: {exc}"
            return
        job.handle.update(job_id=jid, state="PENDING")
        self.active[jid] = job

    def _poll(self) -> None:
        live = [jid for jid in self.active if jid not in self.finished]
        if live:
            try:
                states = query(live)
            except SlurmError as exc:
                for jid in live:
                    self.active[jid].handle["poll_error"] = str(exc)
                return
            for jid in live:
                job = self.active[jid]
                info = states.get(jid)
                if info is None:
                    job.handle["lost"] = job.handle.get("lost", 0) + 1
                    if job.handle["lost"] >= 3:
                        self.finished[jid] = JobInfo(jid, "LOST", source="none")
                        job.handle["state"] = "LOST"
                    continue
                job.handle.update(state=info.state, nodes=info.nodes, reason=info.reason)
                if info.state in RUNNING_STATES:
                    job.handle.setdefault("running_since", time.monotonic())
                if info.terminal:
                    full = details(jid) or info
                    if not full.terminal:
                        full = info
                    self.finished[jid] = full
                    job.handle["collected_mono"] = time.monotonic()
        self._pump()

    def _await_end(self, jid: str, limit: float = 60.0) -> None:
        deadline = time.monotonic() + limit
        while jid not in self.finished and time.monotonic() < deadline:
            self._poll()
            if jid not in self.finished:
                time.sleep(min(self.section.poll_interval, 0.5))

    def _outcome(self, job: CellJob, *, interrupted: bool, runner_timeout: bool) -> Outcome:
        jid = job.handle.get("job_id")
        info = self.finished.get(jid) if jid else None
        run_dir = job.run_dir
        code_path = run_dir / "exit-code"
        exit_code: int | None = None
        if code_path.exists():
            with contextlib.suppress(ValueError, OSError, Refused):
                exit_code = int(read_text(code_path, run_dir, MAX_SMALL_BYTES).strip())
        times = _read_times(run_dir)
        launch_error: str | None = job.handle.get("error")
        if launch_error is None and info is None:
            launch_error = (f"LOST: Slurm job {jid} is known to neither squeue, scontrol nor "
                            "sacct; its outcome is unknown")
        elif launch_error is None and info is not None:
            launch_error = scheduler_reason(info)
            if info.state in ("COMPLETED", "FAILED") and "marker" not in times:
                launch_error = (
                    f"shared filesystem: Slurm job {jid} ran on {info.nodes or '?'} but its marker "
                    f"{run_dir / MARKER_FILE} is not visible from {socket.gethostname()}: the "
                    "matrix root must be on a filesystem the compute nodes mount at the same path"
                )
            elif info.state in ("COMPLETED", "FAILED") and exit_code is None:
                launch_error = (f"{info.state}: Slurm job {jid} ended (exit {info.exit_code}) "
                                "before the command wrote exit-code")
        if launch_error and runner_timeout:
            launch_error = None  # our own scancel at the runner timeout: reported as a timeout
        if interrupted and launch_error is None:
            launch_error = f"CANCELLED: Slurm job {jid} cancelled: the session was interrupted"
        if not code_path.exists() and not code_path.is_symlink():
            write_text(code_path, run_dir, f"{'' if exit_code is None else exit_code}\n")
        note = (f"\n[rlk-matrix] timeout after {job.timeout:g} s: scancel {jid}\n"
                if runner_timeout else f"\n[rlk-matrix] {launch_error}\n" if launch_error
                else "")
        with open_append(run_dir / "run.log", run_dir) as log:  # (store: never through a link)
            log.write(note.encode("utf-8"))
        wall = (times["command_end"] - times["command_start"]
                if {"command_start", "command_end"} <= times.keys() else
                (seconds(info.run_time) if info and info.run_time else None))
        scheduler: dict[str, Any] = {
            "launcher": "slurm", "attempt": job.attempt, "script": SCRIPT_FILE,
            "submitted": job.handle.get("submitted"),
            **(info.as_dict() if info else {"job_id": jid, "state": job.handle.get("state")}),
        }
        if info is None and job.handle.get("error"):
            scheduler["state"] = "NOT_SUBMITTED"
        if "marker" in times and "command_end" in times:
            scheduler["job_wall_s"] = round(times["command_end"] - times["marker"], 3)
        if "submitted_mono" in job.handle and "collected_mono" in job.handle:
            scheduler["session_wall_s"] = round(
                job.handle["collected_mono"] - job.handle["submitted_mono"], 3)
        with contextlib.suppress(OSError, ValueError, IndexError, Refused):
            scheduler["marker_host"] = read_text(run_dir / MARKER_FILE, run_dir,
                                                 MAX_SMALL_BYTES).split()[1]
        fingerprints, node_pre = self._node_fingerprints(run_dir)
        result = RunResult(
            command=job.command, exit_code=exit_code, timed_out=runner_timeout,
            interrupted=interrupted, wall_time=round(wall or 0.0, 3),
            started=info.start if info and info.start else str(job.handle.get("submitted")),
            finished=info.end if info and info.end else _utc(), launch_error=launch_error,
        )
        return Outcome(result=result, scheduler=scheduler, fingerprints=fingerprints,
                       node_preflight=node_pre)

    @staticmethod
    def _node_fingerprints(run_dir: Path) -> tuple[dict[str, str] | None, dict[str, Any] | None]:
        path = run_dir / NODE_PREFLIGHT
        if not path.exists():
            return None, None
        try:
            data = json.loads(read_text(path, run_dir))
        except (OSError, ValueError, Refused):
            return None, None
        from pytest_rlkernel_matrix.machine import preflight as pf

        hw, build = pf.fingerprint(data)
        return {"hardware_fingerprint": hw, "build_fingerprint": build}, data


def slurm_available() -> str | None:
    """None when `sinfo` answers with a usable node, else why not (for skips and errors)."""
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                              timeout=20, check=False, env=os.environ.copy())
    except FileNotFoundError:
        return "sinfo not found: Slurm's client is not installed"
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 20 s"
    if proc.returncode != 0:
        return f"sinfo failed: {(proc.stderr or proc.stdout).strip()[:200]}"
    states = {base_state(s) for s in proc.stdout.split()}
    if not states & {"IDLE", "MIXED", "ALLOCATED", "COMPLETING"}:
        return f"no usable node (sinfo states: {', '.join(sorted(states)) or 'none'})"
    return None
