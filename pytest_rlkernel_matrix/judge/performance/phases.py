"""Per-phase wall-clock of a run's `perf N` records (read by `read.logscan`): the series per
phase in step order, the time in no phase (`accounting`), and the medians over the measured
steps with their spread (what `stats` and the performance judgement take).
"""

from __future__ import annotations

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
            ]
            if values:
                out[name] = values
                break
    rest = unattributed_series(perf, PHASE_KEYS)  # step minus its phases (accounting.py)
    if rest:
        out[UNATTRIBUTED] = rest
    return out


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
