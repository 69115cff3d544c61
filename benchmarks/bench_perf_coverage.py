"""Do the performance statements keep their promises at the n a session uses? A simulation.

Not a test (no thresholds): a script that prints measured numbers. Run from the repo root:

    python benchmarks/bench_perf_coverage.py              # 2000 simulated reports per row
    python benchmarks/bench_perf_coverage.py --reps 300   # quicker, coarser

Each simulated report is one module's four cells (R/R, P/R, R/P, P/P) with n processes per
cell and S steps per process, three phases (rollout, training, and the step = rollout +
training + 0.05 s of other work), judged exactly as a report judges them
(`judge.performance.factorial.fit` per phase, `judge.performance.factorial.decide` over the
report's six statements:
two sides x three phases, confidence 95%, equivalence margin 5%). Noise, multiplicative:

- **quiet**: a per-process effect, lognormal sd 5% (shared by the process's phases), and
  per-step noise, sd 2% (each phase and step on its own); S = 6 steps;
- **h200**: what an H200 showed: per-process sd 4%, step noise sd 0.10 of log (0.08-0.13 seen)
  and a warm-up transient: every phase of a process's first measured step takes 10x as long
  (the transient `judge/performance/steady.py` must drop); S = 12 steps.

Two truths: **null** (R and P take the same time everywhere) and **drill** (the rollout phase
1.17x as long wherever the rollout side is R: what `slow:ffn:rollout:1.5` did on an H200).
Printed per row: the coverage of every 95% interval kind (training and rollout main effects,
interaction) against its true value, the simultaneous coverage of the report's intervals (each
at its closed-testing level: nominal 95% together), the family-wise false-statement rate (a
false slower/faster, or a "no difference within 5%" for an effect of at least 5%), how often
each answer was given, and the seconds the statistics of one report took.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_rlkernel_matrix.judge.performance.factorial import (
    CELLS,
    EQUIVALENT,
    FASTER,
    SLOWER,
    WEIGHTS,
    Answer,
    decide,
    fit,
    plan,
)

BASE = {"rollout": 0.60, "training": 0.35}
OTHER = 0.05
NOISE = {"quiet": {"process": 0.05, "step": 0.02, "warmup": 1.0, "steps": 6},
         "h200": {"process": 0.04, "step": 0.10, "warmup": 10.0, "steps": 12}}
TRUTH = {"null": 1.0, "drill": 1.17}
CONFIDENCE, MARGIN = 0.95, 0.05


def cell_times(case: str, rollout_factor: float) -> dict[str, float]:
    """The noise-free phase times of a cell (rollout R cells carry the factor)."""
    roll = BASE["rollout"] * (rollout_factor if case[2] == "R" else 1.0)
    return {"rollout": roll, "training": BASE["training"],
            "step": roll + BASE["training"] + OTHER}


def true_effects(rollout_factor: float) -> dict[tuple[str, str], float]:
    """(side or interaction, phase) -> the true log effect."""
    out = {}
    for phase in ("rollout", "training", "step"):
        logs = np.log([cell_times(c, rollout_factor)[phase] for c in CELLS])
        for name, w in WEIGHTS.items():
            out[(name, phase)] = float(np.dot(w, logs))
    return out


def simulate_report(rng: np.random.Generator, n: int, noise: dict[str, Any],
                    rollout_factor: float) -> dict[str, dict[str, list[list[float]]]]:
    """phase -> case -> per-process step times of one simulated report."""
    out: dict[str, dict[str, list[list[float]]]] = {p: {} for p in ("rollout", "training",
                                                                    "step")}
    s = int(noise["steps"])
    for case in CELLS:
        base = cell_times(case, rollout_factor)
        for p in out:
            out[p][case] = []
        for _ in range(n):
            proc = math.exp(rng.normal(0.0, noise["process"]))
            warm = np.ones(s)
            warm[0] = noise["warmup"]
            roll = base["rollout"] * proc * warm * np.exp(rng.normal(0.0, noise["step"], s))
            train = base["training"] * proc * warm * np.exp(rng.normal(0.0, noise["step"], s))
            step = roll + train + OTHER * proc * warm
            out["rollout"][case].append(list(roll))
            out["training"][case].append(list(train))
            out["step"][case].append(list(step))
    return out


def false_claim(kind: str, theta: float, margin: float = MARGIN) -> bool:
    if kind == SLOWER:
        return theta <= 0
    if kind == FASTER:
        return theta >= 0
    if kind == EQUIVALENT:
        return abs(theta) >= math.log1p(margin)
    return False


def run(n: int, noise_name: str, truth_name: str, reps: int, seed: int = 1) -> dict[str, Any]:
    """Simulate `reps` reports; return coverage, family-wise false rate, answers and cost."""
    rng = np.random.default_rng(seed + 1000 * n)
    noise, factor = NOISE[noise_name], TRUTH[truth_name]
    truth = true_effects(factor)
    cover = {k: 0 for k in WEIGHTS}
    total = {k: 0 for k in WEIGHTS}
    simultaneous = family_false = 0
    answers = {SLOWER: 0, FASTER: 0, EQUIVALENT: 0, "inconclusive": 0}
    seconds = 0.0
    dropped_first = 0
    processes = 0
    for _ in range(reps):
        data = simulate_report(rng, n, noise, factor)
        t0 = time.perf_counter()
        fits = {p: fit(g) for p, g in data.items()}
        stmts = [Answer(("sim", "ffn", side, p), fits[p].effects[side])
                 for p in fits for side in ("training", "rollout")]
        decide(stmts, CONFIDENCE, MARGIN)
        seconds += time.perf_counter() - t0
        for p, f in fits.items():
            for name, eff in f.effects.items():
                b = eff.interval(CONFIDENCE)
                assert b is not None
                total[name] += 1
                cover[name] += math.log(b[0]) <= truth[(name, p)] <= math.log(b[1])
            for cell in f.cells.values():
                processes += cell.n
                dropped_first += sum(1 for s in cell.processes if s.first >= 1)
        all_in = True
        any_false = False
        for a in stmts:
            theta = truth[(a.key[2], a.key[3])]
            assert a.low is not None and a.high is not None
            all_in &= math.log(a.low) <= theta <= math.log(a.high)
            any_false |= false_claim(a.kind, theta)
            answers[a.kind] += 1
        simultaneous += all_in
        family_false += any_false
    count = sum(answers.values())
    return {"n": n, "noise": noise_name, "truth": truth_name, "reps": reps,
            "coverage": {k: cover[k] / total[k] for k in WEIGHTS},
            "simultaneous": simultaneous / reps, "family_false": family_false / reps,
            "answers": {k: v / count for k, v in answers.items()},
            "seconds_per_report": seconds / reps,
            "warmup_dropped": dropped_first / max(1, processes)}


def _judge(data: dict[str, dict[str, list[list[float]]]]) -> tuple[dict[str, Any], list[Answer]]:
    fits = {p: fit(g) for p, g in data.items()}
    stmts = [Answer(("sim", "ffn", side, p), fits[p].effects[side])
             for p in fits for side in ("training", "rollout")]
    decide(stmts, CONFIDENCE, MARGIN)
    return fits, stmts


def run_auto(noise_name: str, truth_name: str, reps: int, cap: int = 16,
             seed: int = 5) -> dict[str, Any]:
    """--rlk-processes=auto's two-stage procedure: 3 processes per cell, then as many as the
    inconclusive statements' plans ask (at most `cap`, a budget), judged once on all of them."""
    rng = np.random.default_rng(seed)
    noise, factor = NOISE[noise_name], TRUTH[truth_name]
    truth = true_effects(factor)
    family_false = simultaneous = 0
    sizes = []
    answers = {SLOWER: 0, FASTER: 0, EQUIVALENT: 0, "inconclusive": 0}
    for _ in range(reps):
        data = simulate_report(rng, 3, noise, factor)
        fits, stmts = _judge(data)
        wanted = [plan(fits[a.key[3]], a.key[2], a.alpha, MARGIN) for a in stmts
                  if a.kind == "inconclusive"]
        n = min(cap, max([3, *[w[0] for w in wanted if w]],
                         default=3) if any(wanted) else (cap if wanted else 3))
        if n > 3:
            more = simulate_report(rng, n - 3, noise, factor)
            for p in data:
                for case in data[p]:
                    data[p][case] += more[p][case]
        _, stmts = _judge(data)
        sizes.append(n)
        all_in, any_false = True, False
        for a in stmts:
            theta = truth[(a.key[2], a.key[3])]
            assert a.low is not None and a.high is not None
            all_in &= math.log(a.low) <= theta <= math.log(a.high)
            any_false |= false_claim(a.kind, theta)
            answers[a.kind] += 1
        simultaneous += all_in
        family_false += any_false
    count = sum(answers.values())
    return {"noise": noise_name, "truth": truth_name, "reps": reps, "cap": cap,
            "processes_median": float(np.median(sizes)), "processes_max": int(max(sizes)),
            "simultaneous": simultaneous / reps, "family_false": family_false / reps,
            "answers": {k: v / count for k, v in answers.items()}}


# Unequal cells (issue 52): what refused processes and R's noisier first steps produce. Per cell
# (R/R, P/R, R/P, P/P): (processes, step sd of log, first-step factor); "random" draws each
# cell's processes from 2..8, its step sd from 0.02..0.10 and its first step 1x or 10x.
THIN, THICK = (2, 0.10, 10.0), (8, 0.02, 1.0)
UNEQUAL: dict[str, Any] = {
    "thin R/R+P/R": (THIN, THIN, THICK, THICK),
    "thin R/R+P/P": (THIN, THICK, THICK, THIN),
    "thin R/R": (THIN, THICK, THICK, THICK),
    "random": None,
}


def simulate_unequal(rng: np.random.Generator, layout: Any, rollout_factor: float,
                     steps: int = 6) -> dict[str, dict[str, list[list[float]]]]:
    """Like `simulate_report`, each cell with its own processes, step noise and warm-up."""
    if layout is None:
        layout = tuple((int(rng.integers(2, 9)), float(rng.uniform(0.02, 0.10)),
                        float(rng.choice([1.0, 10.0]))) for _ in CELLS)
    out: dict[str, dict[str, list[list[float]]]] = {p: {} for p in ("rollout", "training",
                                                                    "step")}
    for case, (n, sd, warmup) in zip(CELLS, layout, strict=True):
        one = simulate_report(rng, n, {"process": 0.04, "step": sd, "warmup": warmup,
                                       "steps": steps}, rollout_factor)
        for p in out:
            out[p][case] = one[p][case]
    return out


def run_unequal(layout_name: str, truth_name: str, reps: int, seed: int = 11) -> dict[str, Any]:
    """Coverage and family-wise false statements with unequal cells (`UNEQUAL`)."""
    rng = np.random.default_rng(seed)
    factor = TRUTH[truth_name]
    truth = true_effects(factor)
    cover = {k: 0 for k in ("training", "rollout")}
    total = simultaneous = family_false = 0
    answers = {SLOWER: 0, FASTER: 0, EQUIVALENT: 0, "inconclusive": 0}
    for _ in range(reps):
        data = simulate_unequal(rng, UNEQUAL[layout_name], factor)
        fits, stmts = _judge(data)
        for p, f in fits.items():
            for name in cover:
                b = f.effects[name].interval(CONFIDENCE)
                assert b is not None
                cover[name] += math.log(b[0]) <= truth[(name, p)] <= math.log(b[1])
            total += 1
        all_in, any_false = True, False
        for a in stmts:
            theta = truth[(a.key[2], a.key[3])]
            assert a.low is not None and a.high is not None
            all_in &= math.log(a.low) <= theta <= math.log(a.high)
            any_false |= false_claim(a.kind, theta)
            answers[a.kind] += 1
        simultaneous += all_in
        family_false += any_false
    count = sum(answers.values())
    return {"coverage": {k: v / total for k, v in cover.items()},
            "simultaneous": simultaneous / reps, "family_false": family_false / reps,
            "answers": {k: v / count for k, v in answers.items()}}


def cost(processes: int = 8, steps: int = 12) -> None:
    """Print what a whole report's statistics cost: `report.perf.performance` on three modules
    x four cells x `processes` x `steps` (every statement, its plan, the cells' intervals),
    and scipy.special's import, once per process (in a fresh interpreter)."""
    import subprocess

    from pytest_rlkernel_matrix.report.perf import performance

    rng = np.random.default_rng(3)
    records = []
    for module in ("attention", "ffn", "logp"):
        for case in CELLS:
            data = simulate_report(rng, processes, {**NOISE["h200"], "steps": steps}, 1.17)
            spread = {f"{p}_wall_time": {"processes": g[case],
                                         "steps": [v for x in g[case] for v in x]}
                      for p, g in data.items()}
            records.append({"hardware": "sim", "module": module, "case": case,
                            "verdict": "valid", "performance_usable": True,
                            "step_wall_time": float(np.median(spread["step_wall_time"]["steps"])),
                            "phase_spread": spread, "performance_policy": {"processes": processes}})
    performance(records)  # imports
    t0 = time.perf_counter()
    perf = performance(records)
    took = time.perf_counter() - t0
    code = ("import time; t = time.perf_counter(); import scipy.special; "
            "print(time.perf_counter() - t)")
    imp = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout)
    print(f"\nstatistics of a whole report ({perf['family']} statements: 3 modules x 4 cells x "
          f"{processes} processes x {steps} steps, with plans and cell intervals): {took:.3f} s; "
          f"import scipy.special once per process: {imp:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--n", type=int, nargs="*", default=list(range(2, 9)))
    parser.add_argument("--auto-reps", type=int, default=500,
                        help="reports per row of the two-stage (auto) table; 0: none")
    parser.add_argument("--unequal-reps", type=int, default=2000,
                        help="reports per row of the unequal-cells table; 0: none")
    parser.add_argument("--unequal-only", action="store_true",
                        help="only the unequal-cells table")
    args = parser.parse_args()
    if args.unequal_only:
        args.n = []
    print(f"confidence {CONFIDENCE:.0%}, margin +-{MARGIN:.0%}, {args.reps} reports per row; "
          "coverage of the 95% intervals (training, rollout, interaction), simultaneous "
          "coverage of the report's 6 intervals, family-wise false-statement rate, answers "
          "(slower/faster/no difference/inconclusive), seconds of statistics per report")
    print("| noise | truth | n | cov training | cov rollout | cov interaction | simultaneous "
          "| family-wise false | slower | faster | no diff | inconclusive | warm-up dropped "
          "| s/report |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for noise_name in NOISE:
        for truth_name in TRUTH:
            for n in args.n:
                r = run(n, noise_name, truth_name, args.reps)
                c, a = r["coverage"], r["answers"]
                print(f"| {noise_name} | {truth_name} | {n} | {c['training']:.3f} | "
                      f"{c['rollout']:.3f} | {c['interaction']:.3f} | {r['simultaneous']:.3f} "
                      f"| {r['family_false']:.3f} | {a[SLOWER]:.2f} | {a[FASTER]:.2f} | "
                      f"{a[EQUIVALENT]:.2f} | {a['inconclusive']:.2f} | "
                      f"{r['warmup_dropped']:.2f} | {r['seconds_per_report']:.4f} |",
                      flush=True)

    if args.unequal_reps:
        print()
        print("unequal cells (per cell: processes, step sd(log), first step; thin = 2, 0.10, "
              "10x; thick = 8, 0.02, 1x; random: 2..8, 0.02..0.10, 1x or 10x), 6 steps")
        print("| cells | truth | cov training | cov rollout | simultaneous | family-wise false "
              "| slower | faster | no diff | inconclusive |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for layout in UNEQUAL:
            for truth_name in TRUTH:
                r = run_unequal(layout, truth_name, args.unequal_reps)
                c, a = r["coverage"], r["answers"]
                print(f"| {layout} | {truth_name} | {c['training']:.3f} | {c['rollout']:.3f} | "
                      f"{r['simultaneous']:.3f} | {r['family_false']:.3f} | {a[SLOWER]:.2f} | "
                      f"{a[FASTER]:.2f} | {a[EQUIVALENT]:.2f} | {a['inconclusive']:.2f} |",
                      flush=True)
        if args.unequal_only:
            return
    cost()
    if args.auto_reps:
        print()
        print("two-stage (--rlk-processes=auto): 3 processes per cell, then what the plans ask, "
              "at most 16 (the budget)")
        print("| noise | truth | processes median | max | simultaneous | family-wise false "
              "| slower | faster | no diff | inconclusive |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for noise_name in NOISE:
            for truth_name in TRUTH:
                r = run_auto(noise_name, truth_name, args.auto_reps)
                a = r["answers"]
                print(f"| {noise_name} | {truth_name} | {r['processes_median']:.0f} | "
                      f"{r['processes_max']} | {r['simultaneous']:.3f} | {r['family_false']:.3f} "
                      f"| {a[SLOWER]:.2f} | {a[FASTER]:.2f} | {a[EQUIVALENT]:.2f} | "
                      f"{a['inconclusive']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
