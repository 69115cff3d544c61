"""Contamination measured, not assumed: what else ran while a cell was being timed.

`watch(...)` wraps a cell's launch. A background thread samples every `sample_interval` s:

- host load (`/proc/loadavg`) and the CPU time used outside the cell: busy jiffies of
  `/proc/stat` minus those of the cell's processes (every descendant of this process: the cell's
  process group and anything it started, from `/proc/<pid>/stat` utime+stime+cutime+cstime) and
  of this process itself (the harness reading the cell's output). A cell pinned to its own CPU
  share (`cpushare`) is measured on its CPUs only (their `cpuN` lines): a cell beside it on other
  CPUs is not in its CPU time;
- on CUDA the compute processes on the cell's GPUs that are not the cell's
  (`nvidia-smi --query-compute-apps`) and SM clocks / active throttle reasons
  (`nvidia-smi --query-gpu`); on ROCm the KFD processes (`rocm-smi --showpids`);
- other cells of the same session: each cell adds a start and an end line to a small shared
  file in the matrix root (`.locks/running-cells.jsonl`, under `flock`), with its devices: its
  GPUs on GPU profiles, its CPUs on CPU profiles (its pinned share, else every CPU of the
  session's mask). Cells that ran at the same time on disjoint devices shared nothing: they are
  listed (`concurrent_cells`, with `shared_devices` empty) and are not contamination; cells that
  shared a device or CPU are.

`owned` in the measurement says what the cell had to itself (CPUs, GPUs) and `concurrent_cells`
what else of the session ran meanwhile and what it shared.

The result is `contamination.json` in the run directory; `judge()` turns it into reasons with the
declared limits (`[performance]`), so a re-analysis with other limits reproduces the decision.
Only performance is affected: drift verdicts never read this file. Linux only (as the GPU stacks
this drives); where `/proc` cannot be read the measurement says so and the timings are not usable.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.spec.limits import Policy

CONTAMINATION_FILE = "contamination.json"
RUNNING_FILE = "running-cells.jsonl"
SCHEMA = "rlk-matrix.contamination.v1"
# clocks_throttle_reasons.active bits that slow a GPU down for reasons outside the workload:
# HW slowdown, SW thermal, HW thermal, HW power brake (nvidia-smi -q documents them).
THROTTLE_BITS = {0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                 0x80: "hw_power_brake_slowdown"}
_SMI_TIMEOUT = 10.0


# -- /proc readers ---------------------------------------------------------------------------------


def read_proc_stat(text: str) -> tuple[int, int]:
    """(busy, total) jiffies from `/proc/stat`'s `cpu` line; busy excludes idle and iowait."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]]
            v += [0] * (8 - len(v))
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            busy = user + nice + system + irq + softirq + steal
            return busy, busy + idle + iowait
    raise ValueError("no 'cpu ' line in /proc/stat")


def read_proc_stat_cpus(text: str, cpus: set[int]) -> tuple[int, int]:
    """(busy, total) jiffies summed over the `cpuN` lines of `cpus` (as `read_proc_stat`)."""
    busy_all = total_all = 0
    seen = 0
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if head.startswith("cpu") and head[3:].isdigit() and int(head[3:]) in cpus:
            busy, total = read_proc_stat("cpu  " + line.split(maxsplit=1)[1])
            busy_all, total_all, seen = busy_all + busy, total_all + total, seen + 1
    if not seen:
        raise ValueError(f"no cpuN line in /proc/stat for CPUs {sorted(cpus)}")
    return busy_all, total_all


def parse_pid_stat(text: str) -> tuple[int, int, int]:
    """(ppid, pgid, cpu jiffies incl. reaped children) from one `/proc/<pid>/stat`."""
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state): ppid=4, pgrp=5, utime=14, stime=15, cutime=16, cstime=17.
    ppid, pgid = int(rest[1]), int(rest[2])
    cpu = int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])
    return ppid, pgid, cpu


def _proc_table(proc: Path) -> dict[int, tuple[int, int, int]]:
    out: dict[int, tuple[int, int, int]] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
        except OSError:  # exited between listing and reading
            continue
        try:
            out[int(entry.name)] = parse_pid_stat(text)
        except (ValueError, IndexError):
            continue
    return out


def descendants(table: Mapping[int, tuple[int, int, int]], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


# -- GPU tool readers ------------------------------------------------------------------------------


# The probes (nvidia-smi, rocm-smi) are children of the process that runs the cell, started
# while the cell runs: without a marker of their own, the runner's clean-up after the cell's
# main process exits (`run.procs.Family`, rule 3: a new child of the runner that carries no
# cell's marker is the cell's orphan) took an in-flight probe for the cell's and SIGTERMed it,
# and the measurement then read "nvidia-smi ... exited -15" (a process of an H100 session was
# refused for it, issue 52). A probe carries this marker: no cell's, no session's prefix.
PROBE_MARKER = "rlk-contamination-probe"


def _run(argv: list[str]) -> str:
    from pytest_rlkernel_matrix.run.procs import MARKER_VAR

    env = {**os.environ, MARKER_VAR: PROBE_MARKER}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=_SMI_TIMEOUT, check=False,
                          env=env)
    if proc.returncode != 0:
        code = str(proc.returncode)
        if proc.returncode < 0:  # killed by a signal: say which, not only a negative code
            import signal

            try:
                code += f" (killed by {signal.Signals(-proc.returncode).name})"
            except ValueError:
                code += " (killed by a signal)"
        raise OSError(f"{' '.join(argv[:2])} exited {code}: "
                      f"{(proc.stderr or proc.stdout).strip()[:200]}")
    return proc.stdout


def parse_compute_apps(text: str) -> list[dict[str, Any]]:
    """`nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory --format=csv,noheader`."""
    out: list[dict[str, Any]] = []
    for row in csv.reader(io.StringIO(text)):
        cells = [c.strip() for c in row]
        if len(cells) < 2 or not cells[1].isdigit():
            continue
        out.append({"gpu_uuid": cells[0], "pid": int(cells[1]),
                    "used_memory": cells[2] if len(cells) > 2 else None})
    return out


def parse_gpu_clocks(text: str) -> list[dict[str, Any]]:
    """`nvidia-smi --query-gpu=index,uuid,clocks.sm,clocks_throttle_reasons.active
    --format=csv,noheader,nounits`."""
    out: list[dict[str, Any]] = []
    for row in csv.reader(io.StringIO(text)):
        cells = [c.strip() for c in row]
        if len(cells) < 4 or not cells[0].isdigit():
            continue
        try:
            reasons = int(cells[3], 16) if cells[3].lower().startswith("0x") else int(cells[3])
        except ValueError:
            reasons = None
        out.append({"index": int(cells[0]), "uuid": cells[1],
                    "clocks_sm": int(cells[2]) if cells[2].isdigit() else None,
                    "throttle_active": reasons})
    return out


def parse_rocm_pids(text: str) -> list[int]:
    """PIDs in `rocm-smi --showpids` ("PID  PROCESS NAME  GPU(s) ..." rows)."""
    pids: list[int] = []
    for line in text.splitlines():
        first = line.split(maxsplit=1)[0] if line.strip() else ""
        if first.isdigit():
            pids.append(int(first))
    return pids


def _visible(env: Mapping[str, str], names: tuple[str, ...]) -> list[str] | None:
    for name in names:
        value = env.get(name)
        if value is not None:
            return [v.strip() for v in value.split(",") if v.strip()]
    return None


def cell_devices(backend: str, env: Mapping[str, str],
                 cpus: Sequence[int] | None = None) -> list[str]:
    """What the cell's timings share with another cell: GPUs on GPU backends, else the CPUs
    (`cpus`, its pinned share; else this process's whole affinity mask)."""
    if backend == "cuda":
        ids = _visible(env, ("CUDA_VISIBLE_DEVICES",))
        return [f"cuda:{i}" for i in ids] if ids is not None else ["cuda:*"]
    if backend == "rocm":
        ids = _visible(env, ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
                             "CUDA_VISIBLE_DEVICES"))
        return [f"rocm:{i}" for i in ids] if ids is not None else ["rocm:*"]
    return [f"cpu:{c}" for c in sorted(cpus or os.sched_getaffinity(0))]


def _share(a: list[str], b: list[str]) -> list[str]:
    def star(x: list[str]) -> set[str]:
        return {d.split(":")[0] for d in x if d.endswith(":*")}

    sa, sb = set(a), set(b)
    shared = sa & sb
    shared |= {d for d in sb if d.split(":")[0] in star(a)}
    shared |= {d for d in sa if d.split(":")[0] in star(b)}
    return sorted(shared)


# -- the sampler -----------------------------------------------------------------------------------


class Sampler:
    """Samples contamination around one cell's launch; `stop()` returns the measurement."""

    def __init__(self, *, root: Path, run_id: str, backend: str, env: Mapping[str, str],
                 policy: Policy, proc: Path = Path("/proc"),
                 cpus: Sequence[int] | None = None) -> None:
        self.root, self.run_id, self.backend, self.proc = root, run_id, backend, proc
        self.policy = policy
        self.cpus = set(cpus or ())  # the cell's pinned CPU share (empty: not pinned)
        self.devices = cell_devices(backend, env, sorted(self.cpus))
        self.me = os.getpid()
        self.hz = os.sysconf("SC_CLK_TCK")
        self.ncpu = len(self.cpus) or os.cpu_count() or 1
        gpus = [d for d in self.devices if not d.startswith("cpu:")]
        self.owned = {"cpus": sorted(self.cpus) or None, "gpus": gpus or None,
                      "cpu_time_measured_on": (f"the cell's {len(self.cpus)} CPU(s)" if self.cpus
                                               else "every CPU of the machine (not pinned)")}
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.gpu: dict[str, Any] = {"foreign_processes": {}, "clocks_sm_min": None,
                                    "throttle": {}, "samples": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlk-contamination", daemon=True)
        self._prev: tuple[float, int, int] | None = None
        self._gpu_uuids: set[str] | None = None
        self.started = self.ended = 0.0

    # shared file of running cells
    def _running(self, event: str) -> None:
        from pytest_rlkernel_matrix.store.safeio import Refused, ensure_dir, open_append

        path = self.root / ".locks" / RUNNING_FILE
        line = json.dumps({"event": event, "run": self.run_id, "pid": self.me,
                           "t": time.time(), "devices": self.devices})
        try:  # (store: a .locks or a file linked out of the root, or a FIFO: refused)
            ensure_dir(path.parent, self.root)
            fh = open_append(path, self.root)
        except Refused as exc:
            self.errors.append(f"cannot record the running cells: {exc}")
            return
        with fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                fh.write((line + "\n").encode("utf-8"))
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _overlaps(self) -> list[dict[str, Any]]:
        path = self.root / ".locks" / RUNNING_FILE
        windows: dict[str, dict[str, Any]] = {}
        from pytest_rlkernel_matrix.store.safeio import MAX_JSON_BYTES, Refused, open_regular

        try:  # (store: regular, under the root, bounded; a FIFO is refused, never waited on)
            handle, _ = open_regular(path, self.root, MAX_JSON_BYTES)
            with handle as fh:
                fcntl.flock(fh, fcntl.LOCK_SH)
                text = fh.read(MAX_JSON_BYTES).decode("utf-8", "replace")
                fcntl.flock(fh, fcntl.LOCK_UN)
        except (OSError, Refused) as exc:
            self.errors.append(f"cannot read {path}: {exc}")
            return []
        for raw in text.splitlines():
            try:
                e = json.loads(raw)
            except json.JSONDecodeError:
                self.errors.append(f"{path}: unreadable line {raw[:80]!r}")
                continue
            w = windows.setdefault(e["run"], {"devices": e.get("devices", []), "start": None,
                                              "end": None})
            w["start" if e["event"] == "start" else "end"] = float(e["t"])
        out: list[dict[str, Any]] = []
        for run, w in windows.items():
            if run == self.run_id or w["start"] is None:
                continue
            end = w["end"] if w["end"] is not None else self.ended
            overlap = min(end, self.ended) - max(w["start"], self.started)
            if overlap > 0:
                out.append({"run": run, "overlap_s": round(overlap, 3),
                            "shared_devices": _share(self.devices, w["devices"]),
                            "still_running": w["end"] is None})
        return out

    # one sample
    def _cpu_sample(self) -> None:
        try:
            text = (self.proc / "stat").read_text()
            busy, _ = (read_proc_stat_cpus(text, self.cpus) if self.cpus
                       else read_proc_stat(text))
            table = _proc_table(self.proc)
            load1 = float((self.proc / "loadavg").read_text().split()[0])
        except (OSError, ValueError) as exc:
            if not self.errors or "cannot read /proc" not in self.errors[-1]:
                self.errors.append(f"cannot read /proc: {exc}")
            return
        tree = descendants(table, self.me)
        ours = sum(table[p][2] for p in tree) + (table[self.me][2] if self.me in table else 0)
        now = time.monotonic()
        if self._prev is not None:
            t0, busy0, ours0 = self._prev
            dt = now - t0
            foreign = max(0, (busy - busy0) - max(0, ours - ours0)) / self.hz
            self.samples.append({"dt": round(dt, 3), "load1": load1,
                                 "foreign_cpu_s": round(foreign, 3),
                                 "cell_cpu_s": round(max(0, ours - ours0) / self.hz, 3),
                                 "cell_processes": len(tree)})
        self._prev = (now, busy, ours)
        self._tree = tree

    def _gpu_sample(self) -> None:
        if self.backend not in ("cuda", "rocm"):
            return
        tree = getattr(self, "_tree", set()) | {self.me}
        try:
            if self.backend == "cuda":
                self._nvidia(tree)
            else:
                self._rocm(tree)
            self.gpu["samples"] += 1
        except (OSError, subprocess.SubprocessError) as exc:
            msg = f"{self.backend} process/clock query failed: {exc}"
            if msg not in self.errors:
                self.errors.append(msg)

    def _nvidia(self, tree: set[int]) -> None:
        if shutil.which("nvidia-smi") is None:
            raise OSError("nvidia-smi not found: other GPU processes and clocks not measured")
        clocks: list[dict[str, Any]] = []
        for field in ("clocks_throttle_reasons.active", "clocks_event_reasons.active"):
            try:
                clocks = parse_gpu_clocks(_run(["nvidia-smi", f"--query-gpu=index,uuid,clocks.sm,"
                                                f"{field}", "--format=csv,noheader,nounits"]))
                break
            except OSError:
                if field == "clocks_event_reasons.active":
                    raise
        wanted = {d.split(":")[1] for d in self.devices}
        mine = [g for g in clocks if "*" in wanted or str(g["index"]) in wanted
                or g["uuid"] in wanted]
        self._gpu_uuids = {g["uuid"] for g in mine}
        for g in mine:
            sm = g["clocks_sm"]
            if sm is not None and (self.gpu["clocks_sm_min"] is None
                                   or sm < self.gpu["clocks_sm_min"]):
                self.gpu["clocks_sm_min"] = sm
            bits = g["throttle_active"] or 0
            for bit, name in THROTTLE_BITS.items():
                if bits & bit:
                    self.gpu["throttle"][name] = self.gpu["throttle"].get(name, 0) + 1
        apps = parse_compute_apps(_run(["nvidia-smi",
                                        "--query-compute-apps=gpu_uuid,pid,used_memory",
                                        "--format=csv,noheader"]))
        for app in apps:
            if app["gpu_uuid"] in self._gpu_uuids and app["pid"] not in tree:
                visible = (self.proc / str(app["pid"])).exists()
                self.gpu["foreign_processes"][str(app["pid"])] = {
                    "gpu_uuid": app["gpu_uuid"], "used_memory": app["used_memory"],
                    "visible_here": visible}

    def _rocm(self, tree: set[int]) -> None:
        if shutil.which("rocm-smi") is None:
            raise OSError("rocm-smi not found: other GPU processes not measured")
        for pid in parse_rocm_pids(_run(["rocm-smi", "--showpids"])):
            if pid not in tree:
                self.gpu["foreign_processes"][str(pid)] = {
                    "gpu_uuid": None, "visible_here": (self.proc / str(pid)).exists(),
                    "note": "rocm-smi --showpids does not name the device: any KFD process "
                            "of another program counts"}

    def _loop(self) -> None:
        while not self._stop.wait(self.policy.sample_interval):
            self._cpu_sample()
            self._gpu_sample()

    # lifecycle
    def start(self) -> Sampler:
        self.started = time.time()
        self._running("start")
        self._cpu_sample()
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=self.policy.sample_interval + _SMI_TIMEOUT + 5)
        self._cpu_sample()
        self.ended = time.time()
        self._running("end")
        wall = sum(s["dt"] for s in self.samples)
        foreign = sum(s["foreign_cpu_s"] for s in self.samples)
        loads = [s["load1"] for s in self.samples]
        # A share of the capacity is at most 1: jiffy counters and the monotonic clock are read
        # at slightly different instants, so on a saturated box a sample can come out above it.
        shares = [min(1.0, s["foreign_cpu_s"] / (self.ncpu * s["dt"])) for s in self.samples
                  if s["dt"] > 0]
        return {
            "schema_version": SCHEMA,
            "run_id": self.run_id,
            "started": self.started, "ended": self.ended,
            "sample_interval": self.policy.sample_interval,
            "samples": len(self.samples),
            "cpus": self.ncpu,
            "devices": self.devices,
            "owned": self.owned,
            "foreign_cpu_s": round(foreign, 3),
            "foreign_cpu_share": (round(min(1.0, foreign / (self.ncpu * wall)), 4) if wall > 0
                                  else None),
            "foreign_cpu_share_max": round(max(shares), 4) if shares else None,
            "cell_cpu_s": round(sum(s["cell_cpu_s"] for s in self.samples), 3),
            "load1_mean": round(sum(loads) / len(loads), 3) if loads else None,
            "load1_max": max(loads) if loads else None,
            "concurrent_cells": self._overlaps(),
            "gpu": self.gpu if self.backend in ("cuda", "rocm") else None,
            "errors": self.errors,
        }


@contextmanager
def watch(*, root: Path, run_dir: Path, run_id: str, backend: str, env: Mapping[str, str],
          policy: Policy, cpus: Sequence[int] | None = None) -> Iterator[Sampler]:
    """Sample while the body runs; write `contamination.json` in `run_dir` afterwards (`cpus`:
    the cell's pinned CPU share, measured on its own)."""
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    sampler = Sampler(root=root, run_id=run_id, backend=backend, env=env, policy=policy,
                      cpus=cpus).start()
    try:
        yield sampler
    finally:
        write_json_atomic(run_dir / CONTAMINATION_FILE, sampler.stop())


def read_measurement(run_dir: Path) -> dict[str, Any] | None:
    """A run directory's `contamination.json`, or None when it is missing or unreadable."""
    from pytest_rlkernel_matrix.store.safeio import Refused, read_json

    try:  # through store: a regular file under the run, bounded; NaN and duplicate keys refused
        data = read_json(run_dir / CONTAMINATION_FILE, run_dir)
    except (OSError, ValueError, RecursionError, Refused):
        return None
    return data if isinstance(data, dict) else None


def _scope(measured: Mapping[str, Any]) -> str:
    owned = measured.get("owned")
    cpus = owned.get("cpus") if isinstance(owned, Mapping) else None
    return f" it owned ({','.join(map(str, cpus))})" if cpus else ""


def _number(value: Any) -> bool:
    """A finite share in [0, 1] (bool is not a number here)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 <= value <= 1)


def judge(measured: Mapping[str, Any] | None, policy: Policy) -> list[str]:
    """Why the measured contamination makes the cell's timings unusable (empty: usable)."""
    if not isinstance(measured, Mapping):
        return [f"contamination not measured (no readable {CONTAMINATION_FILE})"]
    why: list[str] = []
    for err in measured.get("errors") or []:
        why.append(f"contamination not fully measured: {err}")
    if not measured.get("samples"):
        why.append("contamination not measured: no samples during the run")
    share = measured.get("foreign_cpu_share")
    if share is not None and not _number(share):
        why.append(f"contamination not measured: foreign_cpu_share {share!r} is not a finite "
                   "share in [0, 1]")
    elif share is not None and not share <= policy.max_foreign_cpu:  # (NaN fails the limit)
        from pytest_rlkernel_matrix.spec.limits import over

        got, lim = over(float(share), float(policy.max_foreign_cpu))
        why.append(
            f"contaminated: processes outside the cell used {got} of the "
            f"{measured.get('cpus')} CPUs{_scope(measured)} (limit {lim}; "
            f"load average {measured.get('load1_mean')} mean, {measured.get('load1_max')} max)")
    concurrent = [c for c in measured.get("concurrent_cells") or [] if c.get("shared_devices")]
    total = sum(float(c.get("overlap_s", 0)) for c in concurrent)
    if not total <= policy.max_concurrent_seconds:  # (NaN fails the limit)
        names = ", ".join(f"{c['run']} ({c['overlap_s']:.1f} s)" for c in concurrent[:3])
        why.append(f"contaminated: other cells of this session ran on the same devices for "
                   f"{total:.1f} s (limit {policy.max_concurrent_seconds:g} s): {names}")
    gpu = measured.get("gpu")
    if isinstance(gpu, Mapping):
        foreign = gpu.get("foreign_processes") or {}
        if len(foreign) > policy.max_foreign_gpu_processes:
            hidden = sum(1 for f in foreign.values() if not f.get("visible_here"))
            why.append(f"contaminated: {len(foreign)} other compute process(es) on the cell's "
                       f"GPUs (pids {', '.join(sorted(foreign)[:5])}; {hidden} not visible in this "
                       f"pid namespace; limit {policy.max_foreign_gpu_processes})")
        throttle = gpu.get("throttle") or {}
        if throttle:
            shown = ", ".join(f"{k} in {v} samples" for k, v in sorted(throttle.items()))
            why.append(f"contaminated: GPU clocks throttled ({shown}; min SM clock "
                       f"{gpu.get('clocks_sm_min')} MHz)")
    return why
