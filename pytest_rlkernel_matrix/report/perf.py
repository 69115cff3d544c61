"""Performance statements: which side's R makes which phase slower or faster, by how much.

Per hardware and module with its four cells, per side and phase: the time ratio of the phase
with R on that side over with P on it (R/R over P/R for the training side, R/R over R/P for the
rollout side; below 1: R takes less time), with its hierarchical-bootstrap interval (processes,
then steps; `judge.stats`). One statement per comparison:

- **slower / faster**: the rule of `judge.stats` holds (enough steps and processes, spread within
  the limit, usable timings) and the interval excludes 1: "R on the rollout side makes the
  rollout phase 48% slower (1.48 [1.41, 1.56])";
- **no difference measured**: the rule holds and the interval includes 1; the interval bounds
  the effect ("no difference measured (1.01 [0.97, 1.05])"): a bounded null result;
- **no statement**: anything else, with the reason (one process per cell, too few steps or
  processes, spread, contaminated or otherwise unusable timings); the figure without interval.

Multiple comparisons: every comparison of the report is one of a family of m
(`attribution.comparisons`), and every interval is taken at level 1 - (1 - confidence) / m
(Bonferroni, `attribution.family_policy`), so the chance that *any* slower/faster statement of
the report is false stays at most 1 - confidence whatever the comparisons' dependence. The
terminal gets one line per module (`module_lines`); the HTML the phase times of each cell with
their intervals (`cell_phases`, at the declared level: descriptive, not a comparison).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_rlkernel_matrix.judge.performance.stats import (
    DIRECTION,
    ONE_PROCESS,
    bounds,
    level,
    median_interval,
)
from pytest_rlkernel_matrix.report.attribution import (
    CELLS,
    COMPARED_PHASES,
    MODULES,
    SIDES,
    comparisons,
    family_policy,
    policy_of,
    process_steps,
    timing_ratio,
)

PHASES = COMPARED_PHASES  # rollout, training, weight sync, step
HOW = ("for an interval run several processes per cell: --rlk-processes=3 "
       "(or [performance] processes = 3 in matrix.toml)")


def _phase(name: str) -> str:
    return name.removesuffix("_wall_time").replace("_", " ")


def _groups(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str],
                                                          dict[str, Mapping[str, Any]]]:
    by_key: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
    for rec in records:
        if rec.get("module") in MODULES and rec.get("case") in CELLS:
            by_key.setdefault((str(rec.get("hardware")), str(rec["module"])), {})[
                str(rec["case"])] = rec
    return dict(sorted(by_key.items(), key=lambda kv: (kv[0][0], MODULES.index(kv[0][1]))))


def statement(ratio: Any, side: str, phase: str, measured: bool = False) -> dict[str, Any]:
    """One comparison's statement from its `stats.Ratio` (at the family's level); `measured`:
    the cells ran several processes, so "one process per cell" is not why (dropped ones are)."""
    what = "phase" if phase != "step_wall_time" else "time"
    subject = f"the {_phase(phase)} {what}" if phase != "step_wall_time" else "the step time"
    out: dict[str, Any] = {"side": side, "phase": phase, "ratio": ratio.ratio, "low": ratio.low,
                           "why": None,
                           "high": ratio.high, "confidence": ratio.confidence,
                           "processes": list(ratio.processes), "n": list(ratio.n),
                           "reasons": list(ratio.reasons)}
    figures = ratio.figures()
    interval_only = (ratio.low is not None and len(ratio.reasons) == 1
                     and ratio.reasons[0].endswith("interval includes 1"))
    if ratio.conclusive and ratio.ratio is not None:
        pct = abs(ratio.ratio - 1.0) * 100.0
        out["kind"] = ratio.conclusion
        out["text"] = (f"R on the {side} side makes {subject} {pct:.0f}% {ratio.conclusion} "
                       f"({figures})")
    elif interval_only:
        out["kind"] = "no difference"
        out["text"] = f"R on the {side} side: no difference measured in {subject} ({figures})"
    else:
        one = ONE_PROCESS.removeprefix("no conclusion: ")
        why = next((r for r in ratio.reasons if not (measured and r == one)),
                   ratio.reasons[0] if ratio.reasons else ratio.conclusion)
        out["kind"] = "no statement"
        out["why"] = why
        out["text"] = f"R on the {side} side, {subject}: no statement ({why}; {figures})"
    return out


def _short(s: Mapping[str, Any]) -> str:
    """'rollout 1.48 [1.41, 1.56] slower' for the module line."""
    name = _phase(s["phase"])
    if s["ratio"] is None:
        return f"{name} -"
    ci = "" if s["low"] is None else f" {bounds(s['low'], s['high'])}"
    word = {"slower": "slower", "faster": "faster", "no difference": "no difference"}.get(
        s["kind"], "")
    return f"{name} {s['ratio']:.2f}{ci}" + (f" {word}" if word else "")


def module_line(hardware: str, module: str, stmts: Sequence[Mapping[str, Any]],
                confidence: float, family: int, measured: bool = False) -> str:
    """The terminal's one line for a module: per side its statements (or why there is none)."""
    if not measured and stmts and all(
            ONE_PROCESS.removeprefix("no conclusion: ") in (s["reasons"] or [""])[0]
            for s in stmts):
        return f"{hardware} {module} performance: {ONE_PROCESS}; {HOW}"
    parts = []
    for side, _, own in SIDES:
        mine = [s for s in stmts if s["side"] == side]
        said = [s for s in mine if s["kind"] in ("slower", "faster")]
        null = [s for s in mine if s["kind"] == "no difference" and (
            s["phase"] == own or (s["phase"] == "step_wall_time" and not said))]
        if said or null:
            parts.append(f"R on the {side} side: " + ", ".join(_short(s) for s in said + null))
        else:
            first = next((s for s in mine if s["phase"] == own), mine[0] if mine else None)
            why = ((first.get("why") or (first["reasons"] or ["no timings"])[0]) if first
                   else "no timings")
            parts.append(f"R on the {side} side: no statement ({why})")
    return (f"{hardware} {module} performance: " + "; ".join(parts)
            + f" ({DIRECTION}; {level(confidence)} intervals, Bonferroni over {family} "
              "comparisons)")


def cell_phases(record: Mapping[str, Any], confidence: float) -> dict[str, Any]:
    """Per phase: median, its interval (two or more processes), steps and processes."""
    out: dict[str, Any] = {}
    for phase in PHASES:
        groups = process_steps(record, phase)
        if not groups:
            continue
        med, low, high = median_interval(groups, confidence)
        out[phase] = {"median": med, "low": low, "high": high,
                      "n": sum(len(g) for g in groups), "processes": len(groups)}
    return out


def performance(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The report's `performance` section: the family, every statement, a line per module and
    each cell's phase times with their intervals."""
    family = comparisons(records)
    policy = family_policy(records)
    declared = policy_of(records)
    modules: list[dict[str, Any]] = []
    for (hardware, module), cells in _groups(records).items():
        entry: dict[str, Any] = {"hardware": hardware, "module": module, "statements": []}
        if all(c in cells for c in CELLS):
            rr = cells["R/R"]
            # several processes asked for: dropped ones, not "one process per cell", say why
            measured = all(int((c.get("measured") or {}).get("requested") or 1) > 1
                           for c in cells.values())
            for side, case, _ in SIDES:
                for phase in PHASES:
                    if process_steps(rr, phase) and process_steps(cells[case], phase):
                        label = f"{_phase(phase)} time R/R / {case}"
                        ratio = timing_ratio(rr, cells[case], phase, label, policy)
                        entry["statements"].append(statement(ratio, side, phase, measured))
            entry["line"] = module_line(hardware, module, entry["statements"],
                                        policy.confidence, family, measured)
        else:
            missing = ", ".join(c for c in CELLS if c not in cells)
            entry["line"] = (f"{hardware} {module} performance: no statement (cells not in "
                             f"this run: {missing})")
        entry["cells"] = {case: cell_phases(rec, declared.confidence)
                          for case, rec in cells.items()}
        modules.append(entry)
    processes = sorted({int((r.get("performance_policy") or {}).get("processes") or 1)
                        for r in records})
    return {"direction": DIRECTION, "family": family, "confidence": declared.confidence,
            "family_confidence": policy.confidence, "processes": processes,
            "method": ("hierarchical percentile bootstrap (processes, then steps) of the ratio "
                       "of medians; Bonferroni: each of the family's intervals at level "
                       "1 - (1 - confidence) / family"),
            "cell_interval": (f"median of each phase with its {level(declared.confidence)} "
                              "hierarchical-bootstrap interval (two or more processes)"),
            "modules": modules}
