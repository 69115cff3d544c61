"""The fully accounted step: the time of a step that no phase holds.

A step's wall time is weight sync + rollout + training + the rest. ``unattributed_wall_time``
is, per step, ``perf/step_time`` minus the rollout, training and weight-sync times of the same
step (the keys of ``logscan.PHASE_KEYS``), so a framework's orchestration, waits and anything
the job does inside the step but outside its phases (upstream's ``analyze_performance.py`` calls
the wait part ``wait_residual``: ``perf/train_wait_time`` minus rollout minus weight update) is
shown, not hidden in the step; ``perf/data_preprocess_time`` is in it too. The
record carries its median over the measured steps and its share of the median step
(``unattributed_share``).

``UNATTRIBUTED_LIMIT`` (10%): above it, the cell's performance statements name the share. Why
10%: with the same unattributed time U in both cells and a phase ratio r, the step ratio is
``1 + (r - 1) * (1 - u)`` where u is U's share of the step, so U shrinks every step effect by
the share: at 10% a 1.20 phase ratio reads 1.18 in the step, inside the usual interval's width;
at the 44% seen on an H200 with the weight audit inside the step, 1.43 read 1.19. And a U that
differs between the cells moves the step ratio with work that is no module's. Below 10% the
step ratio is a fair summary of the phases; above it, read the phase ratios.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

UNATTRIBUTED = "unattributed_wall_time"
SHARE = "unattributed_share"
DEBUG = "debug_wall_time"  # the reference job's own debug work, off the step clock
ACCOUNTED = ("rollout_wall_time", "training_wall_time", "weight_sync_wall_time")
UNATTRIBUTED_LIMIT = 0.10


def _value(rec: Mapping[str, object], keys: Sequence[str]) -> float | None:
    for key in keys:
        v = rec.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def unattributed_series(perf: Sequence[tuple[int, Mapping[str, object]]],
                        keys: Mapping[str, Sequence[str]]) -> list[float]:
    """Per step (in step order) that has a step time and all three phases: step minus phases.

    ``perf``: the log's ``perf N`` records (a step's keys may be split over several records, as
    vime prints rollout and training separately); ``keys``: ``logscan.PHASE_KEYS``. Each phase
    uses the first key of its list that any record carries (the same rule as the phase series)."""
    merged: dict[int, dict[str, object]] = {}
    for step, rec in perf:
        merged.setdefault(step, {}).update(rec)
    chosen = {}
    for name in (*ACCOUNTED, "step_wall_time"):
        present = [k for k in keys[name] if any(k in r for r in merged.values())]
        if not present:
            return []
        chosen[name] = present[0]
    out = []
    for step in sorted(merged):
        rec = merged[step]
        values = {n: _value(rec, [k]) for n, k in chosen.items()}
        if any(v is None for v in values.values()):
            continue
        rest = values["step_wall_time"] - sum(values[n] for n in ACCOUNTED)  # type: ignore[misc]
        out.append(round(rest, 6))
    return out


def share(record: Mapping[str, Any]) -> float | None:
    """The record's unattributed median over its median step (None: unknown)."""
    u, step = record.get(UNATTRIBUTED), record.get("step_wall_time")
    if not isinstance(u, (int, float)) or not isinstance(step, (int, float)) or step <= 0:
        return None
    return float(u) / float(step)


def unattributed_note(cells: Mapping[str, Mapping[str, Any]],
                      limit: float = UNATTRIBUTED_LIMIT) -> str | None:
    """The sentence a performance statement adds when, in any of the compared ``cells`` (case
    -> record), more than ``limit`` of the step is in no phase; None otherwise."""
    shown, over = [], False
    for case, rec in cells.items():
        s = share(rec)
        if s is None:
            continue
        over = over or s > limit
        shown.append(f"{case} {float(rec[UNATTRIBUTED]):.3g} s ({s:.0%})")
    if not over:
        return None
    return (f"unattributed step time above {limit:.0%} of the step (in no phase: "
            f"{', '.join(shown)}): the step ratio dilutes the phases' difference by that share; "
            "read the phase ratios")


def table_cell(record: Mapping[str, Any]) -> str:
    """'0.012 (4%)' for tables: the median and its share of the step."""
    u, s = record.get(UNATTRIBUTED), share(record)
    if not isinstance(u, (int, float)):
        return "-"
    return f"{u:.3g}" + (f" ({s:.0%})" if s is not None else "")
