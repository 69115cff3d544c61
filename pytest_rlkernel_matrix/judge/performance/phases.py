"""Per-phase wall-clock of a run's `perf N` records (read by `read.logscan`): the series per
phase in step order, the time in no phase (`accounting`), and the medians over the measured
steps with their spread (what `stats` and the performance judgement take).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_rlkernel_matrix.judge.performance.accounting import (
    ACCOUNTED,
    SHARE,
    UNATTRIBUTED,
    unattributed_series,
)
from pytest_rlkernel_matrix.judge.read.logscan import PHASE_KEYS, LogScan


def phase_series(scan: LogScan) -> dict[str, list[float]]:
    """Per phase, the value of each `perf` record that has it, in step order."""
    out: dict[str, list[float]] = {}
    perf = sorted(scan.records.get("perf", []), key=lambda r: r[0])
    for name, keys in PHASE_KEYS.items():
        # The first key (in priority order) that any record carries; never a mix of keys.
        for key in keys:
            values = [
                float(v) for _, rec in perf
                if isinstance(v := rec.get(key), (int, float)) and not isinstance(v, bool)
                and math.isfinite(v) and v >= 0  # the others: `impossible_timings`' reasons
            ]
            if values:
                out[name] = values
                break
    rest = unattributed_series(perf, PHASE_KEYS)  # step minus its phases (accounting.py)
    if rest:
        out[UNATTRIBUTED] = rest
    return out


def impossible_timings(scan: LogScan) -> list[str]:
    """Reasons against a run's timings: `perf` records (or any record) run.log holds but that
    could not be read, and phase times that are not finite or are negative (issue 51: a NaN
    or a `1e999` never slips past a limit, an unread record is never just a counter)."""
    why: list[str] = []
    if scan.unparsed_records:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(scan.unparsed_kinds.items()))
        why.append(f"run.log: {scan.unparsed_records} record line(s) could not be read "
                   f"({kinds or 'of unknown kind'}): the timings are not shown complete")
    keys = {k for names in PHASE_KEYS.values() for k in names}
    bad: list[str] = []
    for step, rec in sorted(scan.records.get("perf", []), key=lambda r: r[0]):
        for key in sorted(keys & set(rec)):
            v = rec[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                bad.append(f"perf {step}: {key}={v!r} is not a number")
            elif not math.isfinite(v):
                bad.append(f"perf {step}: {key}={v!r} is not finite")
            elif v < 0:
                bad.append(f"perf {step}: {key}={v!r} is a negative time")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        why.append("impossible timings in run.log: " + "; ".join(bad[:3]) + more)
    return why


def phases(scan: LogScan, warmup: int = 0,
           ) -> tuple[dict[str, float | None], dict[str, object]]:
    """Median per phase over the measured steps (the first `warmup` dropped) + spread."""
    series = phase_series(scan)
    medians: dict[str, float | None] = dict.fromkeys((*PHASE_KEYS, UNATTRIBUTED))
    spread: dict[str, object] = {}
    for name, values in series.items():
        measured = values[warmup:] if len(values) > warmup else values
        if name == "peak_memory":
            medians[name] = max(values)
            continue
        medians[name] = med = statistics.median(measured)
        spread[name] = {
            "n": len(measured), "min": min(measured), "max": max(measured),
            "relative_spread": (max(measured) - min(measured)) / med if med > 0 else None,
            "warmup_dropped": len(values) - len(measured),
            "steps": measured,  # every measured step, for intervals (stats.py)
        }
    step, rest = medians.get("step_wall_time"), medians.get(UNATTRIBUTED)
    medians[SHARE] = (rest / step if rest is not None and step else None)
    return medians, spread


STEP_ACCOUNT = ("rollout_wall_time", "training_wall_time", "weight_sync_wall_time",
                UNATTRIBUTED, "step_wall_time")
ACCOUNT_ESTIMATOR = ("the median step: of the measured steps that carry a step time and all "
                     "three phases, the one whose step time is the (lower) median, with its own "
                     "phases; unattributed = its step - its phases")


def step_account(scan: LogScan, warmup: int = 0) -> dict[str, Any] | None:
    """One account of a cell's time (issue 53): the phase columns and the step of ONE step, the
    median one, so rollout + training + weight sync + unattributed = step by construction (a
    median per column does not add up). None when no measured step carries all four times."""
    merged: dict[int, dict[str, object]] = {}
    for step, rec in sorted(scan.records.get("perf", []), key=lambda r: r[0]):
        merged.setdefault(step, {}).update(rec)
    chosen: dict[str, str] = {}
    for name in (*ACCOUNTED, "step_wall_time"):
        present = [k for k in PHASE_KEYS[name] if any(k in r for r in merged.values())]
        if not present:
            return None
        chosen[name] = present[0]
    complete: list[tuple[int, dict[str, float]]] = []
    for step in sorted(merged):
        values = {}
        for name, key in chosen.items():
            v = merged[step].get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                values[name] = float(v)
        if len(values) == len(chosen):
            complete.append((step, values))
    measured = complete[warmup:] if len(complete) > warmup else complete
    if not measured:
        return None
    middle = statistics.median_low([v["step_wall_time"] for _, v in measured])
    step, values = next((s, v) for s, v in measured if v["step_wall_time"] == middle)
    values[UNATTRIBUTED] = round(values["step_wall_time"] - sum(values[n] for n in ACCOUNTED), 6)
    return {**{n: values[n] for n in STEP_ACCOUNT},
            SHARE: (values[UNATTRIBUTED] / values["step_wall_time"]
                    if values["step_wall_time"] > 0 else None),
            "step_account": {"step": step, "n": len(measured), "estimator": ACCOUNT_ESTIMATOR}}


def pooled_account(groups: Mapping[str, Sequence[Sequence[float]]]) -> dict[str, Any] | None:
    """`step_account` over several processes' measured steps (``groups``: phase -> one series
    per process, in step order, as `report.measured` pools them): the median step of all the
    processes' steps whose phases line up (a process whose phase series differ in length gives
    none). None when no step of any process is complete."""
    needed = (*ACCOUNTED, "step_wall_time")
    if any(not groups.get(name) for name in needed):
        return None
    steps: list[dict[str, float]] = []
    count = min(len(groups[name]) for name in needed)
    for j in range(count):
        series = [groups[name][j] for name in needed]
        if len({len(s) for s in series}) != 1:
            continue
        steps += [dict(zip(needed, values, strict=True)) for values in zip(*series, strict=True)]
    if not steps:
        return None
    middle = statistics.median_low([s["step_wall_time"] for s in steps])
    values = next(s for s in steps if s["step_wall_time"] == middle)
    rest = round(values["step_wall_time"] - sum(values[n] for n in ACCOUNTED), 6)
    return {**{n: values[n] for n in needed}, UNATTRIBUTED: rest,
            SHARE: rest / values["step_wall_time"] if values["step_wall_time"] > 0 else None,
            "step_account": {"step": None, "n": len(steps), "processes": count,
                             "estimator": ACCOUNT_ESTIMATOR + " (over every counted process)"}}
