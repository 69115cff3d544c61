"""The three reproducibility claims as people read them: one terminal line per run of an all-R
baseline (or of a cell run twice), the claims table and the drift-over-steps chart of the HTML.

Everything here reads a cell record (``claims`` and ``steps``, from
``judge/reproducibility/steps.py``) as plain
data; a missing or malformed part is said ("not judged", "no per-step series"), never guessed.
The HTML views are plain strings and numbers: the template escapes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

CLAIM_ORDER = ("train_rollout_bitwise", "run_to_run_bitwise", "weights_bitwise")
LABELS = {"train_rollout_bitwise": "train/rollout bitwise",
          "run_to_run_bitwise": "run-to-run bitwise", "weights_bitwise": "weights bitwise"}
MAX_DETAIL = 120

View = dict[str, Any]


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


def _series(record: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    raw = _map(record.get("steps")).get("series")
    return [s for s in raw if isinstance(s, Mapping)] if isinstance(raw, list) else []


def _versions(record: Mapping[str, Any]) -> list[str]:
    chain = _map(_map(record.get("steps")).get("weight_chain"))
    return [str(v) for v in chain]


def claim_phrase(name: str, claim: Any, record: Mapping[str, Any]) -> str:
    """``run-to-run bitwise holds (2 runs, ...)``, ``... FAILS (at step 1, rank 0, sample 3)``
    or ``... not judged (reason)``."""
    label = LABELS.get(name, name)
    c = _map(claim)
    status, detail = str(c.get("status") or "not judged"), str(c.get("detail") or "")
    if not c:
        status, detail = "not judged", "not in the record"
    if status == "holds":
        series, versions = _series(record), _versions(record)
        if name == "train_rollout_bitwise" and series:
            tokens = sum(int(_num(s.get("active_tokens")) or 0) for s in series)
            detail = f"{len(series)} steps, 0 of {tokens} tokens differ"
        elif name == "weights_bitwise" and versions:
            # a bare number reads as v3; a named version (RL-Kernel's weight_v000003) as it is
            first, last = (f"v{v}" if str(v).isdigit() else str(v)
                           for v in (versions[0], versions[-1]))
            detail = (first if len(versions) == 1
                      else f"{first}..{last}, {len(versions)} versions")
        return f"{label} holds" + (f" ({detail})" if detail else "")
    if status == "fails":
        detail = detail.removeprefix("fails ")
        word = "FAILS"
    elif status == "not claimed":
        word = status
    else:
        word = "not judged"
    if len(detail) > MAX_DETAIL:
        detail = detail[:MAX_DETAIL - 3] + "..."
    return f"{label} {word}" + (f" ({detail})" if detail else "")


def drift_phrase(record: Mapping[str, Any]) -> str:
    """``drift over steps: flat`` / ``grows (slope ...)`` / ``no conclusion (reason)``."""
    t = _map(_map(record.get("steps")).get("trend"))
    if not t:
        return "drift over steps: no per-step series"
    conclusion = str(t.get("conclusion") or "no conclusion")
    slope, low, high = _num(t.get("slope")), _num(t.get("low")), _num(t.get("high"))
    if conclusion == "flat" and slope == 0 and low == 0 and high == 0:
        return "drift over steps: flat (every step the same)"
    if slope is not None and low is not None and high is not None:
        return (f"drift over steps: {conclusion} (slope {slope:.3g}/step, 95% CI "
                f"[{low:.3g}, {high:.3g}], n={t.get('n')})")
    return f"drift over steps: {conclusion}" + (f" ({t['reason']})" if t.get("reason") else "")


def wanted(record: Mapping[str, Any]) -> bool:
    """An all-R baseline cell, or a cell whose run was repeated (run_to_run judged)."""
    if not isinstance(record.get("claims"), Mapping) or record.get("verdict") == "not_run":
        return False
    r2r = _map(_map(record["claims"]).get("run_to_run_bitwise"))
    return bool(record.get("baseline")) or r2r.get("status") in ("holds", "fails")


def claim_lines(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per run (cells sharing one run directory, e.g. the all-R baseline that every
    module's R/R names, give one line listing their modules)."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for rec in records:
        if wanted(rec):
            key = str(rec.get("artifact_dir") or rec.get("run_key") or id(rec))
            groups.setdefault(key, []).append(rec)
    lines = []
    for _key, recs in sorted(groups.items(), key=lambda kv: (str(kv[1][0].get("hardware")),
                                                              kv[0])):
        rec = recs[0]
        modules = ", ".join(dict.fromkeys(str(r.get("module")) for r in recs))
        claims = _map(rec.get("claims"))
        parts = [claim_phrase(n, claims.get(n), rec) for n in CLAIM_ORDER]
        lines.append(f"claims {rec.get('hardware')} {modules} {rec.get('case')}: "
                     + "; ".join(parts) + "; " + drift_phrase(rec))
    return lines


def claims_rows(record: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(claim, status, detail) rows for the HTML claims table."""
    claims = _map(record.get("claims"))
    rows = []
    for name in CLAIM_ORDER:
        c = _map(claims.get(name))
        rows.append((LABELS[name], str(c.get("status") or "not judged"),
                     str(c.get("detail") or ("" if c else "not in the record"))))
    return rows


def steps_chart(record: Mapping[str, Any]) -> View | None:
    """Drift over steps: active-token mean |dlogp| per step (linear y from 0), a point per
    step (red where the step is not bitwise), the first non-bitwise step ringed, the trend."""
    series = [s for s in _series(record) if _num(s.get("step")) is not None]
    if not series:
        return None
    w, h, left, right, top, bottom = 440, 150, 52, 12, 10, 30
    steps = [int(_num(s["step"]) or 0) for s in series]
    ys = [_num(s.get("abs_diff_mean")) or 0.0 for s in series]
    lo_x, hi_x = min(steps), max(steps)
    peak = max(ys) or 1.0
    base = h - bottom

    def px(step: int) -> float:
        return left + (w - left - right) * ((step - lo_x) / (hi_x - lo_x) if hi_x > lo_x else 0.5)

    def py(v: float) -> float:
        return base - (base - top) * v / peak

    points, first = [], None
    for s, step, y in zip(series, steps, ys, strict=True):
        bad = int(_num(s.get("bitwise_mismatch_count")) or 0)
        n = int(_num(s.get("active_tokens")) or 0)
        mark = bool(bad or not n) and first is None
        first = step if mark else first
        points.append({
            "x": f"{px(step):.1f}", "y": f"{py(y):.1f}", "cls": "pt-bad" if bad or not n
            else "pt-ok", "mark": mark,
            "title": f"step {step}: mean |dlogp| {y:.3g}, max "
                     f"{_num(s.get('abs_diff_max')) or 0.0:.3g}, not bitwise {bad} of {n} "
                     f"tokens, k3 KL {_num(s.get('k3')) or 0.0:.3g}"})
    ticks = [{"x": str(left - 4), "y": str(base), "anchor": "end", "text": "0"},
             {"x": f"{px(lo_x):.1f}", "y": str(base + 12), "anchor": "middle",
              "text": str(lo_x)}]
    if max(ys):
        ticks.append({"x": str(left - 4), "y": str(top + 8), "anchor": "end",
                      "text": f"{peak:.2g}"})
    if hi_x > lo_x:
        ticks.append({"x": f"{px(hi_x):.1f}", "y": str(base + 12), "anchor": "middle",
                      "text": str(hi_x)})
    return {"w": w, "h": h, "points": points, "ticks": ticks,
            "line": " ".join(f"{p['x']},{p['y']}" for p in points),
            "axis": {"x1": left, "y": base, "x2": w - right},
            "caption": {"x": f"{(left + w) / 2:.0f}", "y": h - 3},
            "first": first, "trend": drift_phrase(record)}
