"""Statistics behind every performance statement: per-phase summaries and ratio intervals.

The rule (docs/en/verdicts.md, "Performance statements"): a slowdown, a speed-up or a time ratio
is stated only when

1. each side has at least `min_steps` measured steps (warmup excluded),
2. each side's relative spread, (max - min) / median of its measured step times, is at most
   `max_relative_spread`, and
3. the `confidence` interval of the ratio of medians excludes 1.

Otherwise the statement is "no conclusion: noise" with the figures. The interval is a percentile
bootstrap over steps (each side resampled independently, `RESAMPLES` draws, fixed `SEED`), so the
same steps always give the same interval. numpy only: a percentile bootstrap of a ratio of
medians is a few lines of vectorised numpy, and scipy (not a dependency) would add ~40 MB for its
`bootstrap`, which does the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

RESAMPLES = 4000
SEED = 20240601
NOISE = "no conclusion: noise"


@dataclass(frozen=True)
class Policy:
    """The declared limits (`[performance]` in matrix.toml); defaults are the documented ones."""

    min_steps: int = 5
    confidence: float = 0.95
    max_relative_spread: float = 0.5
    max_foreign_cpu: float = 0.25
    max_concurrent_seconds: float = 1.0
    max_foreign_gpu_processes: int = 0
    sample_interval: float = 0.5

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> Policy:
        """From a record or cell-run.json; unknown keys are ignored, missing ones default."""
        if not isinstance(data, Mapping):
            return cls()
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def summary(values: Sequence[float]) -> dict[str, Any]:
    """n, median, min, max and relative spread ((max - min) / median) of measured steps."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return {"n": 0, "median": None, "min": None, "max": None, "relative_spread": None}
    med = float(np.median(x))
    rel = float((x.max() - x.min()) / med) if med > 0 else None
    return {"n": int(x.size), "median": med, "min": float(x.min()), "max": float(x.max()),
            "relative_spread": rel}


def bootstrap_ratio(num: Sequence[float], den: Sequence[float], confidence: float = 0.95,
                    resamples: int = RESAMPLES, seed: int = SEED) -> tuple[float, float, float]:
    """median(num) / median(den) and its percentile-bootstrap interval at `confidence`."""
    a = np.asarray(num, dtype=np.float64)
    b = np.asarray(den, dtype=np.float64)
    if a.size == 0 or b.size == 0:
        raise ValueError("bootstrap_ratio needs at least one value on each side")
    rng = np.random.default_rng(seed)
    ma = np.median(a[rng.integers(0, a.size, (resamples, a.size))], axis=1)
    mb = np.median(b[rng.integers(0, b.size, (resamples, b.size))], axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = ma / mb
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(ratios, [tail, 100.0 - tail])
    return float(np.median(a) / np.median(b)), float(low), float(high)


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
    conclusion: str  # "slower" | "faster" | NOISE
    reasons: list[str]

    @property
    def conclusive(self) -> bool:
        return self.conclusion in ("slower", "faster")

    def figures(self) -> str:
        """'1.23 [1.10, 1.38] 95% CI, n=5/5' (or what is known)."""
        if self.ratio is None:
            return f"n={self.n[0]}/{self.n[1]}"
        ci = "" if self.low is None else (
            f" [{self.low:.2f}, {self.high:.2f}] {self.confidence:.0%} CI")
        return f"{self.ratio:.2f}{ci}, n={self.n[0]}/{self.n[1]}"

    def text(self) -> str:
        if self.conclusive:
            return f"{self.label} {self.figures()}: {self.conclusion}"
        return f"{self.label} {self.figures()}: {NOISE} ({'; '.join(self.reasons)})"

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "ratio": self.ratio, "low": self.low, "high": self.high,
                "confidence": self.confidence, "n": list(self.n),
                "relative_spread": list(self.relative_spread), "conclusion": self.conclusion,
                "reasons": self.reasons, "text": self.text()}


def compare(num: Sequence[float], den: Sequence[float], policy: Policy, label: str) -> Ratio:
    """Apply the rule to `num / den` (e.g. label 'step time, P/R / R/R')."""
    sa, sb = summary(num), summary(den)
    reasons: list[str] = []
    for name, s in (("numerator", sa), ("denominator", sb)):
        if s["n"] < policy.min_steps:
            reasons.append(f"{name} has {s['n']} measured steps, minimum {policy.min_steps}")
        elif s["relative_spread"] is None:
            reasons.append(f"{name} median is not positive")
        elif s["relative_spread"] > policy.max_relative_spread:
            reasons.append(f"{name} spread {s['relative_spread']:.0%} of its median "
                           f"({s['min']:.3g}-{s['max']:.3g} s) > {policy.max_relative_spread:.0%}")
    ratio = low = high = None
    if sa["n"] and sb["n"] and (sb["median"] or 0) > 0:
        ratio, low, high = bootstrap_ratio(num, den, policy.confidence)
        if sa["n"] < 2 or sb["n"] < 2:
            low = high = None
        elif low <= 1.0 <= high:
            reasons.append(f"the {policy.confidence:.0%} interval includes 1")
    conclusion = NOISE
    if not reasons and ratio is not None and low is not None and high is not None:
        conclusion = "slower" if low > 1.0 else "faster"
    return Ratio(label=label, ratio=ratio, low=low, high=high, confidence=policy.confidence,
                 n=(sa["n"], sb["n"]), relative_spread=(sa["relative_spread"],
                                                         sb["relative_spread"]),
                 conclusion=conclusion, reasons=reasons)
