"""`rlk-matrix compare`: per-cell changes between two reports, and a regression gate for CI.

Cells match on (hardware, module, case). Drift and mismatch counts are always compared; phase
times only when both cells are `performance_usable` and share hardware and build fingerprints
(otherwise the reason is given, never a number). Thresholds given turn changes into violations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pytest_rlkernel_matrix.report.matrix_report import cell_order
from pytest_rlkernel_matrix.report.merge import CellKey, cell_key
from pytest_rlkernel_matrix.spec.terms import plural

COMPARE_SCHEMA = "rlk-matrix.compare.v1"
TIMES = ("step_wall_time", "rollout_wall_time", "training_wall_time")
TIME_LABEL = {"step_wall_time": "step", "rollout_wall_time": "rollout",
              "training_wall_time": "training"}


@dataclass(frozen=True)
class Thresholds:
    """Gate limits; None = not checked."""

    max_drift_increase: float | None = None
    max_mismatch_increase: int | None = None
    max_time_increase_pct: float | None = None
    fail_on_verdict_change: bool = False

    @property
    def any(self) -> bool:
        return (self.fail_on_verdict_change or self.max_drift_increase is not None
                or self.max_mismatch_increase is not None
                or self.max_time_increase_pct is not None)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _delta(old: Any, new: Any) -> dict[str, Any]:
    a, b = _num(old), _num(new)
    return {"old": old, "new": new, "delta": None if a is None or b is None else b - a}


def time_comparability(old: Mapping[str, Any], new: Mapping[str, Any],
                       accept_build_change: bool = False) -> list[str]:
    """Why the two cells' times cannot be compared (empty: they can).

    `accept_build_change`: a CI regression gate compares a new build against the old one on the
    same hardware on purpose; then only the hardware fingerprint must match.
    """
    why: list[str] = []
    for side, cell in (("old", old), ("new", new)):
        if cell.get("performance_usable") is not True:
            why.append(f"{side} cell is not performance_usable")
    names = ("hardware_fingerprint",) if accept_build_change else (
        "hardware_fingerprint", "build_fingerprint")
    for name in names:
        a, b = old.get(name), new.get(name)
        if not a or not b:
            why.append(f"{name.replace('_', ' ')} missing ({'old' if not a else 'new'})")
        elif a != b:
            why.append(f"{name.replace('_', ' ')} differs ({a} vs {b})")
    return why


def _cell_change(old: Mapping[str, Any], new: Mapping[str, Any],
                 accept_build_change: bool = False) -> dict[str, Any]:
    why = time_comparability(old, new, accept_build_change)
    times: dict[str, Any] = {"comparable": not why, "reasons": why}
    for name in TIMES:
        a, b = _num(old.get(name)), _num(new.get(name))
        entry: dict[str, Any] = {"old": a, "new": b, "pct": None}
        if not why and a is not None and b is not None and a > 0:
            entry["pct"] = (b - a) / a * 100.0
        times[name] = entry
    return {
        "hardware": old.get("hardware"), "module": old.get("module"), "case": old.get("case"),
        "verdict": {"old": old.get("verdict"), "new": new.get("verdict"),
                    "changed": old.get("verdict") != new.get("verdict")},
        "logprob_abs_diff_max": _delta(old.get("logprob_abs_diff_max"),
                                       new.get("logprob_abs_diff_max")),
        "mismatch_count": _delta(old.get("mismatch_count"), new.get("mismatch_count")),
        "times": times,
    }


def _violations(change: Mapping[str, Any], t: Thresholds) -> list[dict[str, Any]]:
    name = " ".join(str(change[k]) for k in ("hardware", "module", "case"))
    out: list[dict[str, Any]] = []

    def add(check: str, message: str) -> None:
        out.append({"cell": name, "check": check, "message": f"{name}: {message}"})

    v = change["verdict"]
    if t.fail_on_verdict_change and v["changed"]:
        add("verdict", f"verdict changed {v['old']} -> {v['new']}")
    d = change["logprob_abs_diff_max"]
    if t.max_drift_increase is not None and d["delta"] is not None \
            and d["delta"] > t.max_drift_increase:
        add("drift", f"max |dlogp| rose by {d['delta']:.3g} ({d['old']:.3g} -> {d['new']:.3g}), "
                     f"limit {t.max_drift_increase:g}")
    m = change["mismatch_count"]
    if t.max_mismatch_increase is not None and m["delta"] is not None \
            and m["delta"] > t.max_mismatch_increase:
        add("mismatch", f"mismatch_count rose by {int(m['delta'])} ({m['old']} -> {m['new']}), "
                        f"limit {t.max_mismatch_increase}")
    if t.max_time_increase_pct is not None:
        for key in TIMES:
            e = change["times"][key]
            if e["pct"] is not None and e["pct"] > t.max_time_increase_pct:
                add("time", f"{TIME_LABEL[key]} time rose {e['pct']:.1f}% ({e['old']:.3f}s -> "
                            f"{e['new']:.3f}s), limit {t.max_time_increase_pct:g}%")
    return out


def _index(report: Mapping[str, Any], side: str) -> dict[CellKey, Mapping[str, Any]]:
    out: dict[CellKey, Mapping[str, Any]] = {}
    for c in report.get("cells") or []:
        key = cell_key(c)
        if key in out:
            raise ValueError(f"{side} report holds cell ({', '.join(key)}) more than once "
                             "(a merge with --allow-duplicates?); compare needs unique cells")
        out[key] = c
    return out


def compare_reports(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    thresholds: Thresholds | None = None,
    *,
    old_name: str = "old",
    new_name: str = "new",
    accept_build_change: bool = False,
) -> dict[str, Any]:
    """The comparison (JSON-able): per-cell changes, one-sided cells and threshold violations."""
    t = thresholds or Thresholds()
    a, b = _index(old, "old"), _index(new, "new")
    common = sorted((k for k in a if k in b), key=lambda k: (k[0], cell_order(a[k])))
    changes = [_cell_change(a[k], b[k], accept_build_change) for k in common]
    violations = [v for c in changes for v in _violations(c, t)]
    if t.fail_on_verdict_change:
        violations += [{"cell": " ".join(k), "check": "verdict",
                        "message": f"{' '.join(k)}: in old, missing from new"}
                       for k in a if k not in b]
    skipped = sum(1 for c in changes if not c["times"]["comparable"])
    return {
        "schema_version": COMPARE_SCHEMA,
        "old": {"file": old_name, "matrix_name": (old.get("matrix") or {}).get("name"),
                "created": old.get("created")},
        "new": {"file": new_name, "matrix_name": (new.get("matrix") or {}).get("name"),
                "created": new.get("created")},
        "thresholds": asdict(t),
        "cells": changes,
        "only_old": [list(k) for k in a if k not in b],
        "only_new": [list(k) for k in b if k not in a],
        "times_not_compared": skipped,
        "violations": violations,
        "gate": "not set" if not t.any else ("failed" if violations else "passed"),
    }


def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _signed(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, "+" + spec)


def render(comparison: Mapping[str, Any]) -> list[str]:
    """The comparison as text: a table, timing notes, one-sided cells, violations, gate."""
    head = ("hardware", "module", "case", "verdict", "max|dlogp| old -> new (delta)",
            "mismatches old -> new (delta)", "step s (%)", "rollout s (%)", "training s (%)")
    rows: list[tuple[str, ...]] = [head]
    notes: list[str] = []
    for c in comparison["cells"]:
        v, d, m, t = c["verdict"], c["logprob_abs_diff_max"], c["mismatch_count"], c["times"]
        name = f"{c['hardware']} {c['module']} {c['case']}"
        timed = []
        for key in TIMES:
            e = t[key]
            if not t["comparable"]:
                timed.append("not compared")
            else:
                timed.append(f"{_f(e['old'], '.3f')} -> {_f(e['new'], '.3f')} "
                             f"({_signed(e['pct'], '.1f')}%)")
        if not t["comparable"]:
            notes.append(f"  {name}: times not compared: {'; '.join(t['reasons'])}")
        rows.append((
            str(c["hardware"]), str(c["module"]), str(c["case"]),
            f"{v['old']} -> {v['new']}" if v["changed"] else str(v["new"]),
            f"{_f(d['old'], '.3g')} -> {_f(d['new'], '.3g')} ({_signed(d['delta'], '.3g')})",
            f"{_f(m['old'], ',')} -> {_f(m['new'], ',')} ({_signed(m['delta'], ',.0f')})",
            *timed,
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"compare: {comparison['old']['file']} -> {comparison['new']['file']}"]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    if notes:
        lines += ["", "timing (compared only for performance_usable cells with the same hardware "
                  "and build fingerprints):", *notes]
    skipped = comparison["times_not_compared"]
    if skipped and comparison["thresholds"]["max_time_increase_pct"] is not None:
        lines.append(f"note: --max-time-increase-pct not applied to "
                     f"{plural(skipped, 'cell')} whose times are not comparable")
    for side in ("old", "new"):
        only = comparison[f"only_{side}"]
        if only:
            lines.append(f"only in {side}: " + ", ".join(" ".join(k) for k in only))
    if not comparison["cells"]:
        lines.append("no cell in common: nothing compared")
    for v in comparison["violations"]:
        lines.append(f"VIOLATION {v['check']}: {v['message']}")
    gate = comparison["gate"]
    lines.append(f"gate: {gate}" + (f" ({plural(len(comparison['violations']), 'violation')})"
                                    if gate == "failed" else ""))
    return lines
