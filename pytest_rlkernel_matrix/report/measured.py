"""A cell's measured runs (`[performance] processes = N`): which count, and the steps per process.

Process 1 of a cell is its correctness run (the run directory itself); processes 2..N are its
measured runs, `<run>/measured.<k>` (`session/scheduler.py` runs them interleaved with the
other cells'). The cell's record is the correctness run's, judged as ever; this module adds

- `measured`: per process its directory, whether its timings count, and the reason when not;
- `phase_spread.<phase>.processes`: the measured steps of each process that counts (what the
  hierarchical interval of `judge.performance.stats` resamples: processes, then steps), and the
  phase
  medians and spreads over all of them.

A measured run counts only when it exited 0 (no timeout, no interruption), its analysis found no
fallback, the route of every module and side (implementation and backend ids) is the correctness
run's, it is a process of its own (`duplicate_reason`: no other counted run of the cell has its
run id, its run.log bytes or its step timings: a byte copy of a run is one process, not two),
it proves whose it is (`identity_reason`: its cell-run.json names this cell, the role
`measured`, its process index and the run id `<run id>.p<k>`; a missing fact is a reason),
and its own performance judgement holds (phase times present, enough steps, spread within
`[performance]`'s limits, no measured contamination). The correctness run's timings count as
process 1 on the same terms. A record of a run that is not `valid` gets no measured runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

MEASURED_PREFIX = "measured."
ROLE_VAR = "RLK_MATRIX_RUN_ROLE"  # "measured" in a measured run's environment
PROCESS_VAR = "RLK_MATRIX_PROCESS"  # its process number, 2..N
PHASES = ("rollout_wall_time", "training_wall_time", "weight_sync_wall_time",
          "unattributed_wall_time", "step_wall_time")
# What a record's measured runs change (the controller copies these at session end).
FIELDS = (*PHASES, "unattributed_share", "step_account", "phase_spread", "measured",
          "performance_usable", "validity")
_DIR = re.compile(r"^measured\.(\d+)$")


def measured_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(process number, directory) of every measured run under `run_dir`, in order."""
    out = []
    for d in run_dir.glob(f"{MEASURED_PREFIX}*"):
        m = _DIR.match(d.name)
        if m and d.is_dir():
            out.append((int(m[1]), d))
    return sorted(out)


def route_signature(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per module and side: (implementation, backend ids, fallback) as the record reports it."""
    out: dict[str, dict[str, Any]] = {}
    for module, entry in (record.get("routes") or {}).items():
        sides: dict[str, Any] = {}
        for side in ("training", "rollout"):
            r = entry.get(side) if isinstance(entry, Mapping) else None
            sides[side] = None if not isinstance(r, Mapping) else (
                r.get("implementation"), tuple(r.get("backend_ids") or ()), bool(r.get("fallback")))
        out[str(module)] = sides
    return out


def route_change(first: Mapping[str, Any], other: Mapping[str, Any]) -> str | None:
    """How `other`'s routes differ from `first`'s (None: the same)."""
    a, b = route_signature(first), route_signature(other)
    for module in sorted(set(a) | set(b)):
        for side in ("training", "rollout"):
            ra = (a.get(module) or {}).get(side)
            rb = (b.get(module) or {}).get(side)
            if ra != rb:
                def shown(r: Any) -> str:
                    return "unreported" if r is None else f"{r[0]} {','.join(r[1]) or '-'}"
                return f"route changed: {module} {side} {shown(ra)} -> {shown(rb)}"
    return None


def drop_reason(first: Mapping[str, Any], other: Mapping[str, Any]) -> str | None:
    """Why measured run `other` does not count for the timings of `first`'s cell."""
    verdict = other.get("verdict")
    why = [str(r) for r in other.get("reasons") or []]
    if other.get("timed_out"):
        return "timed out"
    if other.get("exit_code") not in (0, None) or verdict == "error":
        return f"{verdict}: {why[0] if why else 'exit code ' + str(other.get('exit_code'))}"
    if other.get("fallbacks") or verdict == "fallback":
        return f"fell back: {why[0] if why else other.get('fallbacks')}"
    change = route_change(first, other)
    if change:
        return change
    if verdict in ("unsupported", "incomparable"):
        return f"{verdict}: {why[0] if why else ''}"
    perf = (other.get("validity") or {}).get("performance") or {}
    if perf.get("valid") is not True:
        return "timings not usable: " + "; ".join((perf.get("reasons") or ["not judged"])[:2])
    return None


def fingerprint(record: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    """What makes a run a process of its own: its run id, the sha256 of its run.log and its
    step timings (every phase's measured steps, in order)."""
    from pytest_rlkernel_matrix.store.safeio import MAX_LOG_BYTES, Refused, sha256_file

    log = run_dir / "run.log"
    try:  # a regular file under the run only, read in pieces: a FIFO or a link is refused
        digest: str | None = sha256_file(log, run_dir, MAX_LOG_BYTES)
    except (OSError, Refused):
        digest = None
    timings = tuple(tuple(_steps(record, p)) for p in PHASES)
    return {"run_id": record.get("run_id"), "log": digest,
            "timings": timings if any(timings) else None}


def duplicate_reason(mine: Mapping[str, Any],
                     seen: list[tuple[str, Mapping[str, Any]]]) -> str | None:
    """Why a run whose `fingerprint` is `mine` duplicates one of `seen` ((dir, fingerprint) of
    the cell's runs already counted); None: it is a process of its own."""
    for where, other in seen:
        for key, what in (("run_id", "run id"), ("log", "run.log bytes"),
                          ("timings", "step timings")):
            if mine.get(key) is not None and mine.get(key) == other.get(key):
                return (f"duplicate of {where}: the same {what}"
                        + (f" ({mine['run_id']})" if key == "run_id" else "")
                        + "; a copy of a run is not another process")
    return None


def identity_reason(record: Mapping[str, Any], run_dir: Path, k: int) -> str | None:
    """Why `run_dir` is not provably process `k` of `record`'s run (None: it is). Its
    `cell-run.json` must name the role (`RLK_MATRIX_RUN_ROLE=measured`), the process index
    (`RLK_MATRIX_PROCESS=k`) and the run id `<correctness run id>.p<k>` that the scheduler gives
    it; a missing fact is named, never assumed."""
    from pytest_rlkernel_matrix.judge.read.cellrun import validated
    from pytest_rlkernel_matrix.store.safeio import Refused, read_json

    base = record.get("run_id")
    if not isinstance(base, str) or not base:
        return ("identity: the correctness run names no run id: its measured runs cannot be "
                "shown to be its own")
    try:
        meta = read_json(run_dir / "cell-run.json", run_dir)
        validated(meta, run_dir / "cell-run.json")
    except (OSError, Refused, ValueError, RecursionError) as exc:
        return f"identity: cell-run.json unreadable: {str(exc)[:200]}"
    env = meta.get("env") if isinstance(meta.get("env"), dict) else {}
    role, index, rid = env.get(ROLE_VAR), env.get(PROCESS_VAR), meta.get("run_id")
    if role != "measured":
        return (f"identity: {ROLE_VAR} is {role!r}, not 'measured'" if role is not None else
                f"identity: cell-run.json names no {ROLE_VAR}: not shown to be a measured run")
    if index != str(k):
        return (f"identity: {PROCESS_VAR} is {index!r}, not this directory's process {k}"
                if index is not None else
                f"identity: cell-run.json names no {PROCESS_VAR}: process index unknown")
    if rid != f"{base}.p{k}":
        return (f"identity: run id {rid!r} is not {base}.p{k}: another run's process"
                if rid is not None else "identity: cell-run.json names no run_id")
    return None


def _own_reason(record: Mapping[str, Any]) -> str | None:
    perf = (record.get("validity") or {}).get("performance") or {}
    if record.get("verdict") != "valid":
        return f"the correctness run is {record.get('verdict')}"
    if perf.get("valid") is not True:
        return "timings not usable: " + "; ".join((perf.get("reasons") or ["not judged"])[:2])
    return None


def _steps(record: Mapping[str, Any], phase: str) -> list[float]:
    entry = (record.get("phase_spread") or {}).get(phase) or {}
    values = entry.get("steps") if isinstance(entry, Mapping) else None
    return [float(v) for v in values] if isinstance(values, list) else []


def attach(record: dict[str, Any], run_dir: Path,
           analyze: Callable[[Path], dict[str, Any]]) -> None:
    """Add `measured` and the per-process steps to the correctness run's `record` (in place);
    `analyze` makes a measured run's own record. Nothing changes for one process per cell."""
    if run_dir.name.startswith(MEASURED_PREFIX):
        return  # a measured run's own analysis
    policy = record.get("performance_policy") or {}
    wanted = int(policy.get("processes") or 1)
    found = measured_dirs(run_dir)
    if wanted <= 1 and not found:
        return
    from pytest_rlkernel_matrix.judge.performance.stats import summary

    own = _own_reason(record)
    runs: list[dict[str, Any]] = [{"process": 1, "dir": ".", "role": "correctness",
                                   "used": own is None, "reason": own,
                                   "reasons": [str(r) for r in ((record.get("validity") or {})
                                               .get("performance") or {}).get("reasons") or []]
                                   if own else []}]
    groups: dict[str, list[list[float]]] = {p: [] for p in PHASES}
    if own is None:
        for phase in PHASES:
            if _steps(record, phase):
                groups[phase].append(_steps(record, phase))
    seen: list[tuple[str, Mapping[str, Any]]] = [(".", fingerprint(record, run_dir))]
    for k, d in found:
        other = analyze(d)
        why = drop_reason(record, other) if record.get("verdict") == "valid" else (
            f"the correctness run is {record.get('verdict')}")
        mine = fingerprint(other, d)
        why = why or duplicate_reason(mine, seen) or identity_reason(record, d, k)
        if why is None:
            seen.append((d.name, mine))
        runs.append({"process": k, "dir": d.name, "role": "measured", "used": why is None,
                     "reason": why, "run_id": other.get("run_id"),
                     # every reason its timings were refused, in order of cause (issue 52)
                     "reasons": [str(r) for r in ((other.get("validity") or {}).get(
                         "performance") or {}).get("reasons") or []],
                     "window": other.get("window"),
                     # the plugin's own seconds on this process (session + its analysis) and
                     # the process's wall time: benchmarks/bench_overhead.py --processes
                     "overhead_s": other.get("overhead_s"),
                     "process_wall_s": other.get("process_wall_time"),
                     "contamination": _contamination(other)})
        if why is None:
            for phase in PHASES:
                if _steps(other, phase):
                    groups[phase].append(_steps(other, phase))
    used = sum(1 for r in runs if r["used"])
    notes: list[str] = []
    if record.get("scheduler") and not found:
        notes.append("no measured runs: under a scheduler's launcher the node cannot be sampled "
                     "for contamination, so no timing of it is usable")
    elif record.get("verdict") != "valid" and not found:
        notes.append(f"no measured runs: the correctness run is {record.get('verdict')}")
    elif 1 + len(found) < wanted:
        notes.append(f"{1 + len(found)} of {wanted} processes ran (the session stopped early, "
                     "or a measured run's directory already existed)")
    dropped_runs = [f"{r['dir']}: {r['reason']}" for r in runs if not r["used"]]
    record["measured"] = {"requested": wanted, "ran": 1 + len(found), "used": used,
                          "dropped": len(dropped_runs), "dropped_runs": dropped_runs,
                          "runs": runs, "notes": notes}
    spread = dict(record.get("phase_spread") or {})
    for phase, procs in groups.items():
        if not procs:
            continue
        pooled = [v for g in procs for v in g]
        spread[phase] = {**summary(pooled), "steps": pooled, "processes": procs}
        record[phase] = spread[phase]["median"]
    record["phase_spread"] = spread
    # the step time in no phase, from every counted process like the phases (accounting.py)
    u, step = record.get("unattributed_wall_time"), record.get("step_wall_time")
    if isinstance(u, (int, float)) and isinstance(step, (int, float)) and step > 0:
        record["unattributed_share"] = float(u) / float(step)
    if any(groups.values()):
        # one account of the cell's time over every counted process: the median step's phases,
        # so the columns add up (issue 53; judge/performance/phases.py)
        from pytest_rlkernel_matrix.judge.performance.phases import pooled_account

        account = pooled_account(groups)
        record.update(account or {"step_account": None})
    usable = record.get("verdict") == "valid" and used > 0
    validity = dict(record.get("validity") or {})
    perf = dict(validity.get("performance") or {})
    dropped = [f"process {r['process']} ({r['dir']}) not counted: {r['reason']}"
               for r in runs if not r["used"]]
    perf["reasons"] = ([r for r in perf.get("reasons") or [] if own is None]
                       + dropped + notes)
    perf["valid"] = bool(usable)
    validity["performance"] = perf
    record["validity"] = validity
    record["performance_usable"] = bool(usable)


def _contamination(record: Mapping[str, Any]) -> dict[str, Any] | None:
    m = record.get("contamination_measured")
    if not isinstance(m, Mapping):
        return None
    return {k: m.get(k) for k in ("foreign_cpu_share", "load1_mean", "owned", "devices")}


AUTO_DIR = ".auto"  # --rlk-processes=auto's shared files under the matrix root (scheduler)


def auto_stop(root: Path) -> str | None:
    """Why an auto session stopped early: the first reason any worker left in
    `<root>/.auto/stop.<worker>.json` (read through store), or None. The report's
    `performance.auto_stop` (the JSON and the HTML say it as the terminal does)."""
    import json

    from pytest_rlkernel_matrix.store.safeio import Refused, read_bytes

    folder = root / AUTO_DIR
    if not folder.is_dir():
        return None
    for path in sorted(folder.glob("stop.*.json")):
        try:
            why = json.loads(read_bytes(path, root, 1 << 16)).get("why")
        except (OSError, ValueError, AttributeError, Refused):
            continue
        if isinstance(why, str) and why:
            return why
    return None
