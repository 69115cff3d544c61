"""Attribution: which side of which module causes a drift or a slowdown, from the 2x2 cells.

Per hardware and module, against the R/R baseline (others fixed):
training effect = P/R - R/R, rollout effect = R/P - R/R,
interaction = P/P - P/R - R/P + R/R; for drift (mean, p99, max |dlogp|, mismatch fraction) and
phase times (rollout, training, weight sync, step). The one-line conclusion refuses rather than
guesses: a needed cell that is not `valid` stops the drift conclusion; noisy, contaminated or
fallback timings stop the performance conclusion, and a time ratio is stated only when each
cell has at least two processes and the hierarchical bootstrap interval (processes, then steps)
excludes 1 (stats.py); otherwise "no conclusion: ..." with the figures. Every ratio reads time
with R over time with P (R/R over the cell with P on the side; below 1: R faster). A side's
effect on step time is stated only when the phase that side runs carries it: the training side's
step statement needs a conclusive training-phase ratio in the same direction that explains at
least half of the step difference; otherwise the phase that did carry it is named.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_rlkernel_matrix.judge.performance.accounting import unattributed_note
from pytest_rlkernel_matrix.judge.performance.stats import (
    DIRECTION,
    NOISE,
    ONE_PROCESS,
    Ratio,
    compare_processes,
)
from pytest_rlkernel_matrix.report.perf_text import timing_text
from pytest_rlkernel_matrix.spec.limits import Policy
from pytest_rlkernel_matrix.spec.terms import ALL_MODULES as MODULES
from pytest_rlkernel_matrix.spec.terms import factor_scope

DRIFT = ("logprob_abs_diff_mean", "logprob_abs_diff_p99", "logprob_abs_diff_max",
         "mismatch_fraction")
PHASES = ("rollout_wall_time", "training_wall_time", "weight_sync_wall_time",
          "unattributed_wall_time", "step_wall_time")
# The phases a performance statement compares (report/perf.py): unattributed time is shown and
# named (judge/performance/accounting.py), but it is no phase a side's R runs in, so no comparison
# of it.
COMPARED_PHASES = tuple(p for p in PHASES if p != "unattributed_wall_time")
CELLS = ("R/R", "P/R", "R/P", "P/P")


def _effects(values: Mapping[str, float | None]) -> dict[str, float | None]:
    rr, pr, rp, pp = (values.get(c) for c in CELLS)
    out: dict[str, float | None] = {"R/R": rr, "P/R": pr, "R/P": rp, "P/P": pp,
                                    "training": None, "rollout": None, "interaction": None}
    if rr is not None and pr is not None:
        out["training"] = pr - rr
    if rr is not None and rp is not None:
        out["rollout"] = rp - rr
    if None not in (rr, pr, rp, pp):
        out["interaction"] = pp - pr - rp + rr  # type: ignore[operator]
    return out


def _drift_conclusion(cells: Mapping[str, Mapping[str, Any]]) -> str:
    def mism(case: str) -> int:
        return int(cells[case].get("mismatch_count") or 0)

    base = mism("R/R")
    t, r = mism("P/R") > base, mism("R/P") > base
    lead = f"R/R baseline itself drifts ({base} mismatching tokens); " if base else ""
    if t and r:
        mt = cells["P/R"].get("logprob_abs_diff_mean") or 0.0
        mr = cells["R/P"].get("logprob_abs_diff_mean") or 0.0
        side = ("equal on both sides" if mt == mr
                else f"larger on the {'training' if mt > mr else 'rollout'} side")
        return lead + (f"drift from both sides (mean |dlogp| training P {mt:.2e}, rollout P "
                       f"{mr:.2e}; {side})")
    if t:
        return lead + "drift from the training side"
    if r:
        return lead + "drift from the rollout side"
    if mism("P/P") > base:
        return lead + "drift only when both sides are P (interaction)"
    return lead + "no drift from either side"


def policy_of(records: Sequence[Mapping[str, Any]]) -> Policy:
    """The declared limits the records were judged with (the first that carries them)."""
    for rec in records:
        if isinstance(rec.get("performance_policy"), Mapping):
            return Policy.from_mapping(rec["performance_policy"])
    return Policy()


def comparisons(records: Sequence[Mapping[str, Any]]) -> int:
    """How many side-and-phase time comparisons the records allow: per (hardware, module) with
    its four cells, per side (R/R against P/R, against R/P), per phase both cells timed. The
    family over which every interval is widened (`family_policy`)."""
    by_key: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
    for rec in records:
        if rec.get("module") in MODULES and rec.get("case") in CELLS:
            by_key.setdefault((str(rec.get("hardware")), str(rec["module"])), {})[
                str(rec["case"])] = rec
    count = 0
    for cells in by_key.values():
        if all(c in cells for c in CELLS):
            count += sum(1 for _, case, _ in SIDES for phase in COMPARED_PHASES
                         if process_steps(cells["R/R"], phase)
                         and process_steps(cells[case], phase))
    return count


def family_policy(records: Sequence[Mapping[str, Any]]) -> Policy:
    """The declared limits with the confidence level widened for the number of comparisons
    (Bonferroni): each of the m intervals at 1 - (1 - confidence) / m, so the chance that any
    statement of the report is false stays at most 1 - confidence (docs/en/performance.md)."""
    from dataclasses import replace

    policy = policy_of(records)
    m = max(1, comparisons(records))
    return replace(policy, confidence=1.0 - (1.0 - policy.confidence) / m)


def steps(record: Mapping[str, Any], phase: str) -> list[float]:
    """Every measured step's time for `phase` (warmup excluded), from the record."""
    return [v for group in process_steps(record, phase) for v in group]


def process_steps(record: Mapping[str, Any], phase: str) -> list[list[float]]:
    """The measured steps of `phase` per process: `phase_spread.<phase>.processes` (a list of
    per-process step lists) when the record has it, else its `steps` as one process."""
    entry = (record.get("phase_spread") or {}).get(phase) or {}
    procs = entry.get("processes")
    if isinstance(procs, list) and procs and all(isinstance(p, list) for p in procs):
        return [[float(v) for v in p] for p in procs if p]
    values = entry.get("steps")
    if isinstance(values, list) and values:
        return [[float(v) for v in values]]
    return []


# A ratio with a cell whose timings the performance judgement refused: this reason comes first,
# before "one process per cell" and "noise" (`no_conclusion_reason`).
UNUSABLE = "no conclusion: timings not usable"


def timing_ratio(num: Mapping[str, Any], den: Mapping[str, Any], phase: str, label: str,
                 policy: Policy) -> Ratio:
    """`num`'s over `den`'s time for `phase` under the rule; timings that are not usable (noise,
    contamination, wrong route) never support a statement, whatever the interval says."""
    ratio = compare_processes(process_steps(num, phase), process_steps(den, phase), policy, label)
    for name, rec in (("numerator", num), ("denominator", den)):
        if not rec.get("performance_usable"):
            why = (rec.get("validity") or {}).get("performance", {}).get("reasons") or [
                f"verdict {rec.get('verdict')}"]
            ratio.refuse(UNUSABLE, f"{name} {rec.get('case')} timings not usable: {why[0]}")
            ratio.conclusion = UNUSABLE  # before one process per cell and noise
    return ratio


def no_conclusion_reason(ratios: Sequence[Ratio]) -> str:
    """The one "no conclusion: ..." reason of ratios that make no statement, wherever it is
    shown (terminal and HTML attribution, `rlk-matrix table`), in this order: a cell's timings
    not usable (`UNUSABLE`), one process per cell (`ONE_PROCESS`), else noise (`NOISE`)."""
    if any(r.conclusion == UNUSABLE for r in ratios):
        return UNUSABLE
    if ratios and all(r.conclusion == ONE_PROCESS for r in ratios):
        return ONE_PROCESS
    return NOISE


def absent_cells(cells: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """'R/R is not_run', ... for each cell without a judged run (not run, an error before any
    judgement: no `performance_usable`, or not started: strict refused it before launch),
    hence with no timings and no fingerprints."""
    out = []
    for case in CELLS:
        c = cells[case]
        if c.get("verdict") == "not_run" or "performance_usable" not in c:
            out.append(f"{case} is {c.get('verdict')}")
        elif "exit_code" in c and c["exit_code"] is None and not c.get("timed_out"):
            out.append(f"{case} is {c.get('verdict')}, not started")
    return out


# (side, case with P on that side, the phase that side runs)
SIDES = (("training", "P/R", "training_wall_time"), ("rollout", "R/P", "rollout_wall_time"))
STEP_PHASES = ("rollout_wall_time", "training_wall_time", "weight_sync_wall_time")


def _label(phase: str) -> str:
    return phase.removesuffix("_wall_time").replace("_", " ")


def carrier(rr: Mapping[str, Any], other: Mapping[str, Any], own: str) -> str | None:
    """Why the step difference between `rr` and `other` is not the `own` phase's (None: it is).

    Carried means: the `own` phase's median difference has the step difference's sign and is at
    least half of it. Otherwise the reason names the phase with the largest difference of that
    sign, which does not run the side's kernels."""
    def delta(phase: str) -> float | None:
        a, b = rr.get(phase), other.get(phase)
        return None if a is None or b is None else float(a) - float(b)

    step = delta("step_wall_time")
    if step is None or step == 0:
        return None
    mine = delta(own)
    if mine is not None and mine * step > 0 and abs(mine) >= 0.5 * abs(step):
        return None
    case = other.get("case")
    shown = "unknown" if mine is None else f"{mine:+.3g} s"
    why = (f"the step difference (R/R - {case} {step:+.3g} s) is not carried by the "
           f"{_label(own)} phase ({shown})")
    others = {p: delta(p) for p in STEP_PHASES if p != own}
    same = {p: d for p, d in others.items() if d is not None and d * step > 0}
    if same:
        top = max(same, key=lambda p: abs(same[p]))
        side, other = (("training", "rollout") if own == "training_wall_time"
                       else ("rollout", "training"))
        why += f"; the {_label(top)} phase carries it ({same[top]:+.3g} s), " + (
            f"which runs the same {other} side in both cells" if top == f"{other}_wall_time"
            else f"which is not the {side} side's phase")
    return why


def side_ratios(rr: Mapping[str, Any], other: Mapping[str, Any],
                policy: Policy) -> tuple[Ratio, Ratio, str | None]:
    """For a cell with P on one side (P/R: training, R/P: rollout): the side's own phase ratio
    and the step ratio (both R/R over `other`), the step ratio refused unless the side's phase
    carries the step difference, and the reason when it was refused for that."""
    case = other.get("case")
    phase = dict((c, ph) for _, c, ph in SIDES)[str(case)]
    own = timing_ratio(rr, other, phase, f"{_label(phase)} time R/R / {case}", policy)
    step = timing_ratio(rr, other, "step_wall_time", f"step time R/R / {case}", policy)
    note = carrier(rr, other, phase)
    if note is None and step.conclusive and own.conclusion != step.conclusion:
        note = (f"the {_label(phase)} phase ratio ({own.label} {own.figures()}: "
                f"{own.conclusion}) does not support it")
    if note:
        step.refuse(f"no statement: not carried by the {_label(phase)} phase", note)
    return own, step, note


def _time_conclusion(cells: Mapping[str, Mapping[str, Any]],
                     policy: Policy) -> tuple[str, list[str], list[dict[str, Any]]]:
    """Per side: time with R on that side (R/R) over time with P on it, under the rule; the
    side's step statement only when its own phase carries the step difference."""
    refused: list[str] = []
    absent = absent_cells(cells)
    if absent:  # not the nodes: those cells have no run, hence no fingerprint and no timings
        refused.append(f"cells without a run: {'; '.join(absent)}")
        return f"no performance conclusion ({'; '.join(absent)})", refused, []
    prints = {(c.get("hardware_fingerprint"), c.get("build_fingerprint")) for c in cells.values()}
    if len(prints) > 1:
        # Cells run on different nodes (Slurm) with different hardware or builds: like a
        # comparison across hardware, no timing ratio is drawn across them.
        shown = ", ".join(f"{case}: {cells[case].get('hardware_fingerprint')}/"
                          f"{cells[case].get('build_fingerprint')}" for case in CELLS)
        refused.append(f"cells ran under different hardware/build fingerprints ({shown})")
        return "no performance conclusion (cells ran on nodes that differ)", refused, []
    for case in CELLS:
        c = cells[case]
        if not c.get("performance_usable"):
            why = "; ".join((c.get("validity") or {}).get("performance", {}).get("reasons", [])[:2])
            refused.append(f"{case} timings not usable ({why or c.get('verdict')})")
    rr = cells["R/R"]
    ratios: list[Ratio] = []
    parts: list[str] = []
    notes: list[str] = []
    for side, case, phase in SIDES:
        own, step, note = side_ratios(rr, cells[case], policy)
        if note:
            notes.append(f"no {side}-side step statement: {note}")
        ratios += [own, step]
        for r, what in ((own, _label(phase)), (step, "step")):
            if r.conclusive and r.ratio is not None:
                pct = 100.0 * (r.ratio - 1.0) if r.ratio >= 1 else 100.0 * (1.0 - r.ratio)
                parts.append(f"R on the {side} side {pct:.0f}% {r.conclusion} in {what} than P "
                             f"({r.label} {r.figures()})")
    figures = "; ".join(f"{r.label} {r.figures()}" for r in ratios
                        if r.label.startswith("step") and r.ratio is not None)
    if figures:
        figures = f"{figures} ({DIRECTION})"
    # P/P is in no side ratio: its refused timings are said beside the reason, never as it
    pp = [r for r in refused if r.startswith("P/P ")]
    if parts:
        text = "; ".join(parts + notes) + f" ({DIRECTION})"
    else:
        reason = no_conclusion_reason(ratios)
        if reason == UNUSABLE:
            first = next(x for r in ratios if r.conclusion == UNUSABLE for x in r.reasons
                         if "timings not usable" in x)
            shown = [first.split(" ", 1)[1]] + ([f"figures: {figures}"] if figures else [])
        elif reason == ONE_PROCESS:
            shown = ([figures] if figures else []) + notes + pp
        else:
            why = "; ".join(dict.fromkeys(x for r in ratios for x in r.reasons))
            shown = ([figures] if figures else []) + notes + pp + [why]
        text = reason + (f" ({'; '.join(shown)})" if shown else "")
    return text, refused, [r.as_dict() for r in ratios]


def _signature(cell: Mapping[str, Any]) -> tuple[Any, ...] | None:
    keys = ("mismatch_count", "active_token_count", "logprob_abs_diff_mean",
            "logprob_abs_diff_max")
    values = tuple(cell.get(k) for k in keys)
    return None if None in values or not cell.get("mismatch_count") else values


def baseline_suspects(records: Sequence[Mapping[str, Any]], hardware: str) -> list[str]:
    """When R/R breaks its contract, the single-module P cells it drifts *exactly* like.

    A deterministic job whose R/R run secretly runs P for one side of one module produces the
    same logprobs as that module's P cell on that side, so equal drift statistics point at it.
    """
    rr = next((r for r in records if r.get("hardware") == hardware and r.get("baseline")), None)
    if rr is None or rr.get("verdict") != "contract_mismatch":
        return []
    sig = _signature(rr)
    out: list[str] = []
    for r in records:
        if (r.get("hardware") == hardware and r.get("module") in MODULES
                and r.get("case") in ("P/R", "R/P") and _signature(r) == sig):
            side = "training" if r["case"] == "P/R" else "rollout"
            out.append(f"{r['module']} {side}")
    return out


def attribute(records: Sequence[Mapping[str, Any]],
              statements: Mapping[tuple[str, str], Sequence[Mapping[str, Any]]] | None = None,
              ) -> list[dict[str, Any]]:
    """One entry per (hardware, module) that has its 2x2 cells in the report; `statements`:
    the report's performance sentences per (hardware, module) (`report.perf.attribute_said`),
    which the conclusion then says instead of the two-cell ratios."""
    by_key: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
    for rec in records:
        if rec.get("module") in MODULES and rec.get("case") in CELLS:
            by_key.setdefault((str(rec["hardware"]), str(rec["module"])), {})[rec["case"]] = rec
    out: list[dict[str, Any]] = []
    policy = family_policy(records)
    statements = statements or {}
    for (hardware, module), cells in sorted(by_key.items(),
                                            key=lambda kv: (kv[0][0], MODULES.index(kv[0][1]))):
        entry: dict[str, Any] = {"hardware": hardware, "module": module, "refused": []}
        missing = [c for c in CELLS if c not in cells]
        if missing == ["P/R", "R/P"]:
            pp_drift = (cells["P/P"].get("mismatch_count") or 0) > (
                cells["R/R"].get("mismatch_count") or 0)
            entry["conclusion"] = (f"{module}: P/P {'drifts' if pp_drift else 'does not drift'} "
                                   "against R/R; run the pairwise layout to tell which side")
            out.append(entry)
            continue
        if missing:
            entry["refused"].append(f"cells not in this run: {', '.join(missing)}")
            entry["conclusion"] = f"{module}: no conclusion (missing {', '.join(missing)})"
            out.append(entry)
            continue
        entry["effects"] = {
            "drift": {m: _effects({c: cells[c].get(m) for c in CELLS}) for m in DRIFT},
            "time": {p: _effects({c: cells[c].get(p) for c in CELLS}) for p in PHASES},
        }
        invalid = [f"{c} is {cells[c].get('verdict')}" for c in CELLS
                   if cells[c].get("verdict") != "valid"]
        suspects = baseline_suspects(records, hardware)
        entry["refused"].extend(invalid)
        if suspects:
            entry["suspects"] = suspects
            drift = (f"R/R breaks its bitwise contract and drifts exactly like "
                     f"{' and '.join(s + '-P' for s in suspects)}: suspect a silent fallback "
                     f"to P on the {' / '.join(suspects)} side")
        elif invalid:
            drift = f"no drift conclusion ({'; '.join(invalid)})"
        else:
            drift = _drift_conclusion(cells)
        timing, refused, ratios = _time_conclusion(cells, policy)
        entry["refused"].extend(refused)
        entry["timing"] = ratios
        said = statements.get((hardware, module))
        if said and not timing.startswith("no performance conclusion"):
            # the report's own sentences (report/perf.py): one answer, said one way; cells
            # without a run or on nodes that differ keep the refusal above
            entry["statements"] = said
            own = [s for s in said if s["phase"] in ("step_wall_time",
                                                     f"{s['side']}_wall_time")]
            # no statement for a reason all share: said once, the remedy left to the report
            timing = timing_text(own) or "; ".join(s["text"] for s in own)
        entry["conclusion"] = f"{module}: {drift}; {timing}"
        note = unattributed_note(cells)  # the step share in no phase, above its limit
        if note:
            entry["unattributed"] = note
            entry["conclusion"] += f"; {note}"
        out.append(entry)
    return out


# -- framework factors ------------------------------------------------------------------------

def _factor_case_label(rec: Mapping[str, Any]) -> str:
    """`R/R`, or `attention R/P` for a factor cell at one module's case (the others fixed)."""
    cases = rec.get("cases")
    scope = factor_scope(str(rec.get("case")), cases) if isinstance(cases, Mapping) else ""
    return f"{scope} {rec.get('case')}" if scope else str(rec.get("case"))


def _factor_case(rec: Mapping[str, Any]) -> tuple[str, bool | None]:
    """(words, invariant?) for one factor cell against its baseline cell."""
    f = rec.get("factor") or {}
    c = f.get("comparison") or {}
    case, name, variant = _factor_case_label(rec), f.get("name"), f.get("variant")
    applied = ((c.get("workload_factors") or {}).get(str(name)) or {}).get("applied")
    note = ((c.get("workload_factors") or {}).get(str(name)) or {}).get("note")
    if rec.get("verdict") != "valid":  # its own evidence failed: never blame the factor
        why = "; ".join(str(r) for r in (rec.get("reasons") or [])[:1])
        return (f"{case}: no conclusion (the factor cell is {rec.get('verdict')}"
                + (f": {why}" if why else "") + ")"), None
    if not c.get("judged"):
        return f"{case}: {c.get('why') or 'not judged: no comparison with the baseline cell'}", None
    if applied is False:
        return f"{case}: {name}={variant} could not act ({note or 'the workload says so'})", None
    n, k = c.get("compared_logprobs", 0), c.get("rollout_logprobs_differ", 0)
    # RL-Kernel's sidecars carry no token ids: unknown tokens are said, never read as equal
    known = c.get("tokens_known", True)
    tok = ("" if c.get("tokens_equal") else ", sampled tokens not in the sidecars" if not known
           else f", sampled tokens differ in {c.get('samples_tokens_differ')} of "
           f"{c.get('samples')} samples")
    paired = not c.get("unpaired_samples")
    steps = ""
    if c.get("weights_diverge_at") is not None:  # later steps ran on other weights
        last = c["steps_compared"] - 1
        steps = (f"; step{' 0' if last == 0 else f's 0-{last}'} only: the training weights "
                 f"differ from the baseline cell's from version {c['weights_diverge_at']} on")
    if f.get("expect") == "invariant":
        if k == 0 and paired and (c.get("tokens_equal") or not known):
            return (f"{case} is invariant to {name} ({variant} vs {f.get('baseline')}: "
                    f"0 of {n} logprobs differ{steps})"), True
        return f"{case} is not ({k} of {n}{tok}{steps})", False
    own = c.get("own_drift") or {}
    base = c.get("baseline_drift") or {}
    m, total, b = own.get("mismatch_count"), own.get("active_token_count"), base.get(
        "mismatch_count")
    if m and not b:
        return (f"{name}={variant} drifts with kernels at {case} ({m} of {total} train/rollout "
                f"logprobs differ, baseline cell 0): the factor, not a kernel"), False
    if m:
        return (f"{name}={variant} at {case}: {m} of {total} train/rollout logprobs differ, "
                f"baseline cell {b}: the baseline itself drifts, the factor's share is not "
                "separable"), False
    return f"{name}={variant} at {case}: no train/rollout drift ({total} logprobs)", True


def _factor_order(rec: Mapping[str, Any]) -> tuple[int, int]:
    cases = rec.get("cases")
    case = str(rec.get("case"))
    scope = factor_scope(case, cases) if isinstance(cases, Mapping) else ""
    order = ("R/R", "P/P", "P/R", "R/P")
    return (MODULES.index(scope) + 1 if scope in MODULES else 0,
            order.index(case) if case in order else len(order))


def attribute_factors(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (hardware, factor, variant): its cases' words, joined in one line."""
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for rec in records:
        f = rec.get("factor")
        if isinstance(f, Mapping) and f.get("name"):
            groups.setdefault((str(rec.get("hardware")), str(f["name"]), str(f.get("variant"))),
                              []).append(rec)
    out: list[dict[str, Any]] = []
    for (hardware, name, variant), recs in groups.items():
        recs.sort(key=_factor_order)  # R/R first, then P/P, then per module and side
        parts = [_factor_case(r) for r in recs]
        words = [p[0] for p in parts]
        # "R/R is invariant ... ; P/P is not (k of N)": the short form follows an invariant one
        text = "; ".join(words)
        out.append({"hardware": hardware, "factor": name, "variant": variant,
                    "cases": [_factor_case_label(r) for r in recs],
                    "invariant": {_factor_case_label(r): p[1] for r, p in zip(recs, parts,
                                                                               strict=True)},
                    "conclusion": f"{name} {variant}: {text}"})
    return out
