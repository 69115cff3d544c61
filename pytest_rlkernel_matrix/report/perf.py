"""Performance statements: which side's R makes which phase slower or faster, by how much.

Per hardware and module with its four cells, per side and phase, one statement from the 2x2
factorial on log time (`judge.performance.factorial`: the process is the unit of replication, each
process's steady-state steps give it one location, `judge.performance.steady`): the side's
main effect,
time with R on that side over time with P on it (below 1: R takes less time), with a t interval.
Every statement of the report is judged together (closed testing: the chance that any of them
is false is at most 1 - confidence). Exactly three answers:

- **slower / faster** when the interval excludes 1:
  "R on the rollout side: rollout phase slower, 1.17x [1.08, 1.27]";
- **no difference within +-m** when the whole interval lies inside [1/(1+m), 1+m]
  (``[performance] equivalence``, default 5%);
- **inconclusive** otherwise, with about how many processes x steps per cell would resolve +-m
  (`factorial.plan`, from the measured variance components and the measured cost of a process
  and of a step).

A comparison whose cells' timings are not usable (contaminated, noisy, fell back, a cell not
run) is **not judged**, with the reason: it compared nothing (fail closed), so it is no answer.
The same sentence is the terminal's line, the JSON's ``text`` and the HTML's row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.judge.performance.factorial import (
    CELLS,
    EQUIVALENT,
    FASTER,
    INCONCLUSIVE,
    SLOWER,
    Answer,
    Fit,
    decide,
    fit,
    margin_bounds,
    plan,
)
from pytest_rlkernel_matrix.judge.performance.stats import DIRECTION, bounds, level
from pytest_rlkernel_matrix.report.attribution import (
    COMPARED_PHASES,
    MODULES,
    attribute,
    policy_of,
    process_steps,
)
from pytest_rlkernel_matrix.report.perf_text import (
    compact,
    no_statement,
    refusal_lines,
    refusals,
    remedy,
    report_note,
    report_reasons,
    thin_why,
)

PHASES = COMPARED_PHASES  # rollout, training, weight sync, step
SIDES = ("training", "rollout")
NOT_JUDGED = "not judged"
METHOD = ("2x2 factorial on log time per module and phase (the process the unit of "
          "replication: per process the 20% trimmed mean of its steady-state steps, warm-up "
          "dropped by MSER); main effect of each side with a Student t interval, variance pooled "
          "over the cells unless Bartlett's test rejects equal variances (then "
          "Welch-Satterthwaite); closed testing (Holm's principle, Bonferroni local tests) over "
          "every statement of the report")


def _phase(name: str) -> str:
    return name.removesuffix("_wall_time").replace("_", " ")


def _subject(phase: str) -> str:
    return "step time" if phase == "step_wall_time" else f"{_phase(phase)} phase"


def _groups(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str],
                                                          dict[str, Mapping[str, Any]]]:
    by_key: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
    for rec in records:
        if rec.get("module") in MODULES and rec.get("case") in CELLS:
            by_key.setdefault((str(rec.get("hardware")), str(rec["module"])), {})[
                str(rec["case"])] = rec
    return dict(sorted(by_key.items(), key=lambda kv: (kv[0][0], MODULES.index(kv[0][1]))))


def _unusable(cells: Mapping[str, Mapping[str, Any]]) -> str | None:
    """Why the module's timings support no statement (None: they may)."""
    for case in CELLS:
        c = cells[case]
        if not c.get("performance_usable"):
            why = (c.get("validity") or {}).get("performance", {}).get("reasons") or [
                f"verdict {c.get('verdict')}"]
            return f"{case} timings not usable: {why[0]}"
    prints = {(c.get("hardware_fingerprint"), c.get("build_fingerprint")) for c in cells.values()}
    if len(prints) > 1:
        return "the cells ran under different hardware/build fingerprints"
    return None


def _costs(cells: Mapping[str, Mapping[str, Any]]) -> tuple[float, float] | None:
    """(a process's fixed seconds, a steady step's seconds), measured: the step from the
    cells' median steps, the fixed part from the measured runs' process wall times."""
    steps = [float(c["step_wall_time"]) for c in cells.values()
             if isinstance(c.get("step_wall_time"), (int, float)) and c["step_wall_time"] > 0]
    if not steps:
        return None
    step = float(np.median(steps))
    fixed = []
    for c in cells.values():
        n = sum(len(g) for g in process_steps(c, "step_wall_time")) / max(
            1, len(process_steps(c, "step_wall_time")))
        for run in (c.get("measured") or {}).get("runs") or []:
            wall = run.get("process_wall_s")
            if isinstance(wall, (int, float)) and wall > 0:
                fixed.append(max(0.0, float(wall) - n * step))
    return (float(np.median(fixed)) if fixed else 10.0 * step, step)


def _process_counts(record: Mapping[str, Any], requested: int) -> dict[str, int]:
    """A cell's processes: asked, run, counted (their timings used) and refused."""
    m = record.get("measured")
    if isinstance(m, Mapping) and m.get("runs") is not None:
        runs = list(m.get("runs") or [])
        counted = sum(1 for r in runs if r.get("used"))
        return {"requested": int(m.get("requested") or requested), "ran": len(runs),
                "counted": counted, "refused": len(runs) - counted}
    counted = 1 if record.get("performance_usable") else 0
    return {"requested": requested, "ran": 1, "counted": counted, "refused": 1 - counted}


def sentence(side: str, phase: str, kind: str, ratio: float | None, low: float | None,
             high: float | None, margin: float, resolve: tuple[int, int] | None = None,
             why: str | None = None) -> str:
    """The one sentence of a statement, everywhere it is shown."""
    head = f"R on the {side} side: {_subject(phase)}"
    fig = "" if ratio is None else f"{ratio:.2f}x" + (
        "" if low is None or high is None else f" {bounds(low, high)}")
    if kind in (SLOWER, FASTER):
        return f"{head} {kind}, {fig}"
    if kind == EQUIVALENT:
        return f"{head}: no difference within ±{margin:.0%} ({fig})"
    if kind == NOT_JUDGED:
        return f"{head} not judged ({why})"
    what = (f"about {resolve[0]} processes x {resolve[1]} steps per cell would resolve "
            f"±{margin:.0%}" if resolve else (why or f"more processes would resolve ±{margin:.0%}"))
    return f"{head} inconclusive" + (f", {fig}" if fig else "") + f": {what}"


def _cell_phases(f: Fit, phase: str, out: dict[str, dict[str, Any]], confidence: float) -> None:
    """Each cell's steady location of `phase` (seconds) with a t interval over its processes
    (descriptive, at the declared level) and which steps of each process counted."""
    from pytest_rlkernel_matrix.judge.performance.factorial import t_quantile

    for case, cell in f.cells.items():
        y = cell.y
        entry: dict[str, Any] = {"median": math.exp(float(y.mean())), "low": None, "high": None,
                                 "n": int(sum(p.n for p in cell.processes)),
                                 "processes": cell.n,
                                 "steady": [{"first_kept": p.first, "kept": p.n,
                                             "measured": p.total} for p in cell.processes]}
        if cell.n > 1:
            half = float(t_quantile(0.5 + confidence / 2, cell.n - 1)) * float(
                np.std(y, ddof=1)) / math.sqrt(cell.n)
            entry["low"], entry["high"] = (math.exp(float(y.mean()) - half),
                                           math.exp(float(y.mean()) + half))
        out.setdefault(case, {})[phase] = entry


def performance(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The report's `performance` section: every statement, a line per module and each cell's
    phase times (steady locations with their intervals)."""
    declared = policy_of(records)
    margin = float(getattr(declared, "equivalence", 0.05))
    modules: list[dict[str, Any]] = []
    answers: list[tuple[dict[str, Any], Answer, Fit, tuple[float, float] | None]] = []
    for (hardware, module), cells in _groups(records).items():
        entry: dict[str, Any] = {"hardware": hardware, "module": module, "statements": [],
                                 "cells": {}}
        modules.append(entry)
        missing = [c for c in CELLS if c not in cells]
        if missing:
            entry["line"] = (f"{hardware} {module} performance: not judged (cells not in this "
                             f"run: {', '.join(missing)})")
            continue
        refused = _unusable(cells)
        costs = _costs(cells)
        # measured runs that did not count, named (report/measured.py says why)
        entry["dropped"] = [f"{case} process {r.get('process')} ({r.get('dir')}): "
                            f"{r.get('reason')}" for case in CELLS
                            for r in (cells[case].get("measured") or {}).get("runs") or []
                            if not r.get("used")]
        # the terminal counts them by cause, in order of cause, with the worst figure
        entry["refused"] = refusals(cells[c] for c in CELLS)
        entry["ran"] = sum(len((cells[c].get("measured") or {}).get("runs") or [])
                           for c in CELLS)
        entry.update(requested=int(declared.processes), auto=bool(declared.auto),
                     budget=float(declared.budget))
        # per cell: processes asked, run, counted and refused (what a thin cell's reason names)
        entry["processes"] = {c: _process_counts(cells[c], int(declared.processes))
                              for c in CELLS}
        for phase in PHASES:
            groups = {c: process_steps(cells[c], phase) for c in CELLS}
            if not all(groups.values()):
                continue
            if any(v <= 0 or v != v for g in groups.values() for x in g for v in x):
                # a phase timed at 0 s (a job without weight sync) has no ratio on log time
                for side in SIDES:
                    entry["statements"].append({
                        "side": side, "phase": phase, "kind": NOT_JUDGED, "ratio": None,
                        "low": None, "high": None, "resolve": None,
                        "why": f"{_phase(phase)} times not all positive"})
                continue
            f = fit(groups)
            _cell_phases(f, phase, entry["cells"], declared.confidence)
            inter = f.effects["interaction"]
            for side in SIDES:
                s: dict[str, Any] = {"side": side, "phase": phase,
                                     "processes": [f.cells[c].n for c in CELLS],
                                     "n": [int(sum(p.n for p in f.cells[c].processes))
                                           for c in CELLS],
                                     "ratio": f.effects[side].ratio, "low": None, "high": None,
                                     "pooled_variance": f.pooled, "bartlett_p": f.bartlett_p,
                                     "df": f.effects[side].df,
                                     "interaction": inter.ratio,
                                     "variance": {"between_process_log": f.between_var,
                                                  "within_process_log": f.within_var,
                                                  "steps_per_process": f.steps},
                                     "why": None, "resolve": None}
                entry["statements"].append(s)
                if refused:
                    s.update(kind=NOT_JUDGED, why=refused)
                elif f.effects[side].se is None:
                    counts = {c: {**entry["processes"][c], "counted": f.cells[c].n}
                              for c in CELLS}
                    s.update(kind=INCONCLUSIVE, why=thin_why(
                        counts, int(declared.processes), bool(declared.auto),
                        float(declared.budget)))
                else:
                    answers.append((s, Answer((hardware, module, side, phase), f.effects[side]),
                                    f, costs))
    decide([a for _, a, _, _ in answers], declared.confidence, margin)
    for s, a, f, costs in answers:
        s.update(kind=a.kind, low=a.low, high=a.high, level=1.0 - a.alpha)
        if a.kind == INCONCLUSIVE:
            resolve = plan(f, str(s["side"]), a.alpha, margin, costs)
            s["resolve"] = None if resolve is None else {"processes": resolve[0],
                                                         "steps": resolve[1]}
            if resolve is not None:  # at the steps the workload runs (what auto can add)
                now = plan(f, str(s["side"]), a.alpha, margin, costs,
                           max_steps=round(f.measured_steps or f.steps))
                s["resolve"]["processes_at_measured_steps"] = None if now is None else now[0]
            if resolve is None:
                s["why"] = (f"more than {64} processes per cell would be needed for ±"
                            f"{margin:.0%} at this noise")
    for entry in modules:
        for s in entry["statements"]:
            r = s.get("resolve")
            s["text"] = sentence(s["side"], s["phase"], s["kind"], s["ratio"], s["low"],
                                 s["high"], margin,
                                 None if not r else (r["processes"], r["steps"]), s["why"])
    note = report_note(modules)  # a reason every module shares, once for the report
    said = report_reasons(modules)
    for entry in modules:
        if "line" not in entry:
            entry["line"] = module_line(entry, margin, len(answers), declared.confidence, said)
    import os

    from pytest_rlkernel_matrix.report.drill import drill_of

    drill = drill_of(records, os.environ)
    if drill:  # a drill's statements say so, wherever they are shown
        for entry in modules:
            entry["line"] = f"[{drill['text']}]\n{entry['line']}"
    low, high = margin_bounds(margin)
    return {"drill": drill, "direction": DIRECTION, "family": len(answers), "note": note,
            "confidence": declared.confidence,
            "family_confidence": declared.confidence, "equivalence": margin,
            "equivalence_bounds": [low, high],
            "processes": sorted({int((r.get("performance_policy") or {}).get("processes") or 1)
                                 for r in records}),
            "method": METHOD,
            "cell_interval": (f"per cell the mean of its processes' steady locations (log "
                              f"scale) with a {level(declared.confidence)} t interval over "
                              "processes (descriptive)"),
            "modules": modules}


def module_line(entry: Mapping[str, Any], margin: float, family: int,
                confidence: float, said: Sequence[str] = ()) -> str:
    """The terminal's lines for a module: a header, then one sentence per side and phase; when
    no statement can be made, one line: the reason once (the one-process reason not at all
    when the report's note says it: `said`) and the point figures (`report.perf_text`)."""
    stmts = entry["statements"]
    name = f"{entry['hardware']} {entry['module']} performance"
    causes = entry.get("refused") or {}
    tail = "".join(f"\n  {line}" for line in refusal_lines(causes, int(entry.get("ran") or 0)))
    if causes:
        tail += "\n  " + remedy(causes, int(entry.get("requested") or 1),
                                bool(entry.get("auto")), float(entry.get("budget") or 0))
    if not stmts:
        return f"{name}: no phase timed in all four cells" + tail
    reasons = no_statement(stmts)
    if reasons is not None or not family:
        return compact(name, reasons or [], stmts, DIRECTION, said) + tail
    head = (f"{name} ({DIRECTION}; {level(confidence)} family-wise over {family} statements, "
            f"closed testing; equivalence ±{margin:.0%})")
    return head + ":\n" + "\n".join(f"  {s['text']}" for s in stmts if "text" in s) + tail


def budget_stop(records: Sequence[Mapping[str, Any]], first: int, budget: float, used: float,
                per_process: float) -> str:
    """Why an auto session stopped inside stage one (the budget ran out before its `first`
    processes per cell ran), with what it could resolve: the processes run per cell, how many
    statements the processes that ran resolve (and why not, when none), the time stage one
    needs at the measured cost of a process, and the budget that would hold it (issue 52: an
    H100 session said only '285 s used, a process costs about 28 s')."""
    from pytest_rlkernel_matrix.report.perf_text import split_why

    order = {c: i for i, c in enumerate(CELLS)}
    cells = sorted((r for r in records if r.get("case") in order),
                   key=lambda r: (str(r.get("hardware")), str(r.get("module")),
                                  order[str(r["case"])]))
    ran = {f"{r.get('module')} {r['case']}" if len({x.get("module") for x in cells}) > 1
           else str(r["case"]): int((r.get("measured") or {}).get("ran") or 1) for r in cells}
    wanted = first * len(cells)
    need = wanted * per_process
    said = [s for m in performance(records)["modules"] for s in m["statements"]]
    answered = [s for s in said if s.get("low") is not None]
    whys = list(dict.fromkeys(split_why(str(s["why"]))[0] for s in said
                              if s.get("low") is None and s.get("why")))
    resolved = (f"{len(answered)} of {len(said)} statements resolved"
                + (f" ({whys[0].split(' (')[0]})" if whys and not answered else ""))
    return (f"the budget ({budget:g} min) did not hold stage 1 ({wanted} processes, {first} per "
            f"cell, ~{per_process:.0f} s each: {need / 60:.1f} min): {sum(ran.values())} ran in "
            f"{used:.0f} s (" + ", ".join(f"{k} {v}" for k, v in ran.items())
            + f"); {resolved}; --rlk-perf-budget={max(1, math.ceil(need / 60))} would hold "
            "stage 1")


def said_by_module(perf: Mapping[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(hardware, module) -> the statements of a `performance` section."""
    return {(str(m["hardware"]), str(m["module"])): list(m["statements"])
            for m in perf.get("modules") or [] if m.get("statements")}


def attribute_said(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`attribution.attribute` whose timing conclusions are the report's sentences."""
    return attribute(records, said_by_module(performance(records)))
