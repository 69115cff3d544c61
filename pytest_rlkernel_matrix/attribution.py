"""Attribution: which side of which module causes a drift or a slowdown, from the 2x2 cells.

Per hardware and module, against the R/R baseline (others fixed):
training effect = P/R - R/R, rollout effect = R/P - R/R,
interaction = P/P - P/R - R/P + R/R; for drift (mean, p99, max |dlogp|, mismatch fraction) and
phase times (rollout, training, weight sync, step). The one-line conclusion refuses rather than
guesses: a needed cell that is not `valid` stops the drift conclusion; noisy, contaminated or
fallback timings stop the performance conclusion, and a time ratio is stated only when its
bootstrap interval excludes 1 (stats.py); otherwise "no conclusion: noise" with the figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pytest_rlkernel_matrix.stats import NOISE, Policy, Ratio, compare
from pytest_rlkernel_matrix.terms import ALL_MODULES as MODULES

DRIFT = ("logprob_abs_diff_mean", "logprob_abs_diff_p99", "logprob_abs_diff_max",
         "mismatch_fraction")
PHASES = ("rollout_wall_time", "training_wall_time", "weight_sync_wall_time", "step_wall_time")
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
        side = "training" if mt > mr else "rollout"
        return lead + (f"drift from both sides (mean |dlogp| training P {mt:.2e}, rollout P "
                       f"{mr:.2e}; larger on the {side} side)")
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


def steps(record: Mapping[str, Any], phase: str) -> list[float]:
    """Every measured step's time for `phase` (warmup excluded), from the record."""
    entry = (record.get("phase_spread") or {}).get(phase) or {}
    values = entry.get("steps")
    if isinstance(values, list):
        return [float(v) for v in values]
    return []


def timing_ratio(num: Mapping[str, Any], den: Mapping[str, Any], phase: str, label: str,
                 policy: Policy) -> Ratio:
    """`num`'s over `den`'s time for `phase` under the rule; timings that are not usable (noise,
    contamination, wrong route) never support a statement, whatever the interval says."""
    ratio = compare(steps(num, phase), steps(den, phase), policy, label)
    for name, rec in (("numerator", num), ("denominator", den)):
        if not rec.get("performance_usable"):
            why = (rec.get("validity") or {}).get("performance", {}).get("reasons") or [
                f"verdict {rec.get('verdict')}"]
            ratio.reasons.append(f"{name} {rec.get('case')} timings not usable: {why[0]}")
            ratio.conclusion = NOISE
    return ratio


# (side, case with P on that side, phase)
TIMED = (("training", "P/R", "training_wall_time"), ("rollout", "R/P", "rollout_wall_time"),
         ("training", "P/R", "step_wall_time"), ("rollout", "R/P", "step_wall_time"))


def _time_conclusion(cells: Mapping[str, Mapping[str, Any]],
                     policy: Policy) -> tuple[str, list[str], list[dict[str, Any]]]:
    """Per side: time with R on that side (R/R) over time with P on it, under the rule."""
    refused: list[str] = []
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
    ratios: list[Ratio] = []
    parts: list[str] = []
    for side, case, phase in TIMED:
        label = phase.removesuffix("_wall_time").replace("_", " ")
        r = timing_ratio(cells["R/R"], cells[case], phase, f"{label} time R/R / {case}", policy)
        ratios.append(r)
        if r.conclusive and r.ratio is not None:
            pct = 100.0 * (r.ratio - 1.0) if r.ratio >= 1 else 100.0 * (1.0 - r.ratio)
            parts.append(f"R on the {side} side {pct:.0f}% {r.conclusion} in {label} than P "
                         f"({r.label} {r.figures()})")
    figures = "; ".join(f"{r.label} {r.figures()}" for r in ratios
                        if r.label.startswith("step") and r.ratio is not None)
    if parts:
        text = "; ".join(parts)
    elif refused:
        text = (f"{NOISE} or contamination ({refused[0]}"
                + (f"; figures: {figures}" if figures else "") + ")")
    else:
        why = "; ".join(dict.fromkeys(x for r in ratios for x in r.reasons))
        text = f"{NOISE} ({figures}; {why})" if figures else f"{NOISE} ({why})"
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


def attribute(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (hardware, module) that has its 2x2 cells in the report."""
    by_key: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
    for rec in records:
        if rec.get("module") in MODULES and rec.get("case") in CELLS:
            by_key.setdefault((str(rec["hardware"]), str(rec["module"])), {})[rec["case"]] = rec
    out: list[dict[str, Any]] = []
    policy = policy_of(records)
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
        entry["conclusion"] = f"{module}: {drift}; {timing}"
        out.append(entry)
    return out
