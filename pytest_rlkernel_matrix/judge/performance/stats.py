"""Statistics behind every performance statement: per-phase summaries and ratio intervals.

The rule (docs/en/verdicts.md, "Performance statements"): a slowdown, a speed-up or a time ratio
is stated only when

1. each side has at least `min_steps` measured steps (warmup excluded),
2. each side's relative spread, (max - min) / median of its measured step times, is at most
   `max_relative_spread`,
3. each side has at least `min_processes` processes (default 2): steps of one process share its
   start-up, placement and clocks, so an interval over them misses the variation between
   processes; with one process per cell the statement is "no conclusion: one process per cell,
   between-process variation not measured" (the figure is shown, no interval), and
4. the `confidence` interval of the ratio of medians excludes 1.

Otherwise the statement is "no conclusion: noise" with the figures. The interval is a
hierarchical percentile bootstrap: each draw resamples a side's processes, then the steps within
each drawn process (each side independently, `RESAMPLES` draws, fixed `SEED`), so the variation
between processes is inside the interval and the same steps always give the same interval.
numpy only: a few lines of vectorised numpy (scipy, not a dependency, would add ~40 MB).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.spec.limits import Policy

RESAMPLES = 4000
SEED = 20240601
NOISE = "no conclusion: noise"
ONE_PROCESS = "no conclusion: one process per cell, between-process variation not measured"
# The one ratio direction of every report, terminal and table: time with R on the side (or the
# module) over time with P on it; below 1 means R is faster.
DIRECTION = "time with R / time with P; below 1: R takes less time"


def level(confidence: float) -> str:
    """'95%', '99.8%', '99.79%': a confidence level with the digits that tell it apart."""
    return f"{confidence * 100:.4g}%"


def bounds(low: float, high: float) -> str:
    """'[0.79, 0.997]': two decimals, or three where a bound would round onto 1 without
    touching it (an interval that excludes 1 never reads as reaching it)."""
    def one(x: float) -> str:
        shown = f"{x:.2f}"
        return f"{x:.3f}" if shown == "1.00" and x != 1.0 else shown
    return f"[{one(low)}, {one(high)}]"


def summary(values: Sequence[float]) -> dict[str, Any]:
    """n, median, min, max and relative spread ((max - min) / median) of measured steps."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return {"n": 0, "median": None, "min": None, "max": None, "relative_spread": None}
    med = float(np.median(x))
    rel = float((x.max() - x.min()) / med) if med > 0 else None
    return {"n": int(x.size), "median": med, "min": float(x.min()), "max": float(x.max()),
            "relative_spread": rel}


Groups = Sequence[Sequence[float]]


def _groups(groups: Groups) -> list[np.ndarray]:
    return [np.asarray(g, dtype=np.float64) for g in groups if len(g)]


def _medians(groups: list[np.ndarray], rng: np.random.Generator, resamples: int) -> np.ndarray:
    """Per draw: the median of the steps of resampled processes, each resampled within."""
    sizes = np.array([g.size for g in groups])
    width = int(sizes.max())
    padded = np.full((len(groups), width), np.nan)
    for i, g in enumerate(groups):
        padded[i, :g.size] = g
    proc = rng.integers(0, len(groups), (resamples, len(groups)))
    n = sizes[proc]
    step = (rng.random((resamples, len(groups), width)) * n[..., None]).astype(np.int64)
    values = padded[proc[..., None], step]
    values[np.arange(width) >= n[..., None]] = np.nan
    return np.nanmedian(values.reshape(resamples, -1), axis=1)


def bootstrap_processes(num: Groups, den: Groups, confidence: float = 0.95,
                        resamples: int = RESAMPLES,
                        seed: int = SEED) -> tuple[float, float, float]:
    """median(num) / median(den) over all steps, and its hierarchical-bootstrap interval:
    processes resampled, then steps within each drawn process (`num`, `den`: steps per process).
    """
    a, b = _groups(num), _groups(den)
    if not a or not b:
        raise ValueError("bootstrap_processes needs at least one value on each side")
    rng = np.random.default_rng(seed)
    ma, mb = _medians(a, rng, resamples), _medians(b, rng, resamples)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = ma / mb
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(ratios, [tail, 100.0 - tail])
    return (float(np.median(np.concatenate(a)) / np.median(np.concatenate(b))), float(low),
            float(high))


def resamples_for(confidence: float) -> int:
    """Bootstrap draws for a `confidence` interval: `RESAMPLES`, more where each tail would hold
    fewer than 20 draws (a Bonferroni-widened level, e.g. 99.8%, needs 20,000)."""
    return max(RESAMPLES, math.ceil(40.0 / max(1e-9, 1.0 - confidence)))


def median_interval(groups: Groups, confidence: float = 0.95,
                    seed: int = SEED) -> tuple[float, float | None, float | None]:
    """The median of every step of `groups` (steps per process) and its hierarchical-bootstrap
    interval (processes, then steps); no interval (None) from fewer than two processes."""
    g = _groups(groups)
    if not g:
        raise ValueError("median_interval needs at least one value")
    med = float(np.median(np.concatenate(g)))
    if len(g) < 2:
        return med, None, None
    rng = np.random.default_rng(seed)
    draws = _medians(g, rng, resamples_for(confidence))
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(draws, [tail, 100.0 - tail])
    return med, float(low), float(high)


def bootstrap_ratio(num: Sequence[float], den: Sequence[float], confidence: float = 0.95,
                    resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float, float]:
    """median(num) / median(den) and the interval over the steps of one process per side (what
    `bootstrap_processes` reduces to with one process; never a statement on its own)."""
    return bootstrap_processes([num], [den], confidence, resamples, seed)


@dataclass
class Ratio:
    """One time ratio `num / den` with its interval and whether it supports a statement."""

    label: str
    ratio: float | None
    low: float | None
    high: float | None
    confidence: float
    n: tuple[int, int]
    relative_spread: tuple[float | None, float | None]
    conclusion: str  # "slower" | "faster" | NOISE | ONE_PROCESS | "no statement: ..."
    reasons: list[str]
    processes: tuple[int, int] = (1, 1)

    @property
    def conclusive(self) -> bool:
        return self.conclusion in ("slower", "faster")

    def refuse(self, conclusion: str, reason: str) -> None:
        """No statement from this ratio, for `reason` (the figures stay)."""
        self.reasons.append(reason)
        if self.conclusive or self.conclusion == NOISE:
            self.conclusion = conclusion

    def figures(self) -> str:
        """'1.23 [1.10, 1.38] 95% CI, n=5/5, 3/3 processes' (or what is known)."""
        procs = f", {self.processes[0]}/{self.processes[1]} processes"
        if self.ratio is None:
            return f"n={self.n[0]}/{self.n[1]}{procs}"
        ci = "" if self.low is None else (
            f" {bounds(self.low, self.high)} {level(self.confidence)} CI")
        return f"{self.ratio:.2f}{ci}, n={self.n[0]}/{self.n[1]}{procs}"

    def text(self) -> str:
        if self.conclusive:
            return f"{self.label} {self.figures()}: {self.conclusion}"
        why = [r for r in self.reasons if r != self.conclusion.removeprefix("no conclusion: ")]
        return (f"{self.label} {self.figures()}: {self.conclusion}"
                + (f" ({'; '.join(why)})" if why else ""))

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "ratio": self.ratio, "low": self.low, "high": self.high,
                "confidence": self.confidence, "n": list(self.n),
                "processes": list(self.processes),
                "relative_spread": list(self.relative_spread), "conclusion": self.conclusion,
                "reasons": self.reasons, "text": self.text()}


def compare_processes(num: Groups, den: Groups, policy: Policy, label: str) -> Ratio:
    """Apply the rule to `num / den`, each given as the measured steps of each of its processes
    (e.g. label 'step time R/R / P/R')."""
    ga, gb = _groups(num), _groups(den)
    flat_a = [float(v) for g in ga for v in g]
    flat_b = [float(v) for g in gb for v in g]
    sa, sb = summary(flat_a), summary(flat_b)
    reasons: list[str] = []
    for name, s in (("numerator", sa), ("denominator", sb)):
        if s["n"] < policy.min_steps:
            reasons.append(f"{name} has {s['n']} measured steps, minimum {policy.min_steps}")
        elif s["relative_spread"] is None:
            reasons.append(f"{name} median is not positive")
        elif s["relative_spread"] > policy.max_relative_spread:
            reasons.append(f"{name} spread {s['relative_spread']:.0%} of its median "
                           f"({s['min']:.3g}-{s['max']:.3g} s) > {policy.max_relative_spread:.0%}")
    procs = (len(ga), len(gb))
    conclusion = NOISE
    single = min(procs) <= 1
    if single:
        conclusion = ONE_PROCESS
        reasons.insert(0, ONE_PROCESS.removeprefix("no conclusion: "))
    elif min(procs) < policy.min_processes:
        reasons.insert(0, f"{min(procs)} processes on a side, minimum {policy.min_processes} "
                          "([performance] min_processes)")
    ratio = low = high = None
    if sa["n"] and sb["n"] and (sb["median"] or 0) > 0:
        if single or min(procs) < policy.min_processes or sa["n"] < 2 or sb["n"] < 2:
            # An interval over the steps of one process misses the between-process variation:
            # none is shown rather than one that looks tighter than the truth (none drawn).
            ratio = float(sa["median"]) / float(sb["median"])
        else:
            ratio, low, high = bootstrap_processes(ga, gb, policy.confidence,
                                                   resamples_for(policy.confidence))
        if low is not None and high is not None and low <= 1.0 <= high:
            reasons.append(f"the {level(policy.confidence)} interval includes 1")
    if not reasons and ratio is not None and low is not None and high is not None:
        conclusion = "slower" if low > 1.0 else "faster"
    return Ratio(label=label, ratio=ratio, low=low, high=high, confidence=policy.confidence,
                 n=(sa["n"], sb["n"]), relative_spread=(sa["relative_spread"],
                                                         sb["relative_spread"]),
                 conclusion=conclusion, reasons=reasons, processes=procs)


def compare(num: Sequence[float], den: Sequence[float], policy: Policy, label: str) -> Ratio:
    """The rule for one process per side: never a statement (`ONE_PROCESS`), figures shown."""
    return compare_processes([num], [den], policy, label)


def timing_noise(spread: Mapping[str, Any], policy: Policy) -> list[str]:
    """Too few measured steps, or a spread past the declared limit, per timed phase."""
    why: list[str] = []
    for key in ("step_wall_time", "rollout_wall_time", "training_wall_time"):
        s = spread.get(key)
        if not isinstance(s, Mapping):
            continue
        label = key.removesuffix("_wall_time")
        if s["n"] < policy.min_steps:
            why.append(f"noise: {s['n']} measured step(s), the declared minimum is "
                       f"{policy.min_steps} ([performance] min_steps; raise [runner] repeats)")
            break
        rel = s.get("relative_spread")
        if rel is None or rel > policy.max_relative_spread:
            shown = "undefined" if rel is None else f"{rel:.0%}"
            why.append(f"noise: {label} time spread (max-min)/median {shown} > "
                       f"{policy.max_relative_spread:.0%} (n={s['n']}, "
                       f"{s['min']:.3g}-{s['max']:.3g} s)")
    return why
