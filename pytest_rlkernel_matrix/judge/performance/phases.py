"""Per-phase wall-clock of a run's `perf N` records (read by `read.logscan`): the series per
phase in step order, the time in no phase (`accounting`), and the medians over the measured
steps with their spread (what `stats` and the performance judgement take).
"""

from __future__ import annotations

import math
import statistics

from pytest_rlkernel_matrix.judge.performance.accounting import (
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
