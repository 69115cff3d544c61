"""Drift over steps, the weight-version chain and run-to-run reproducibility of one cell.

Three claims are judged here apart from today's numeric (single-step) judgement:

- ``train_rollout_bitwise`` over steps: every step's sidecars bitwise (train == rollout bytes on
  every active token), or the first step that is not, named;
- ``weights_bitwise``: the weight-version chain of both sides (one sha256 per version, from
  ``weight-audit/<version>.json`` and ``weight-audit/rollout/<version>.json``) compared version
  by version; the first version where training and rollout differ is named;
- ``run_to_run_bitwise``: two runs of the same cell with the same seed, sidecar bytes and weight
  chains compared (``compare_runs``); "holds", "fails at step k, rank r, sample s" or
  "not judged: reason".

The drift trend is the least-squares slope of the per-step active-token mean |dlogp| with a
percentile-bootstrap interval over steps (fixed seed, ``RESAMPLES`` draws), following the
timing rule of ``stats.py``: "grows" when the interval lies above 0, "flat" when every step has
the same value or the interval lies inside +-5% of the mean level per step, else "no conclusion".

Nothing here reads a file: `judge.read.steps` reads the series, the chains and the repeat
run into typed objects (`StepSeries`, `RunPair`, `Reproducibility`) where the evidence is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.judge.read.policy import CLAIMS
from pytest_rlkernel_matrix.judge.read.steps import Reproducibility, RunPair, StepSeries

# The drift trend's bootstrap: the same draws and seed as performance/stats.py (a layer imports no
# other layer; tests/test_layout.py holds the two equal).
RESAMPLES = 4000
SEED = 20240601
FLAT_FRACTION = 0.05
MIN_TREND_STEPS = 3


@dataclass
class Claim:
    """One claim's verdict: ``holds``, ``fails`` or ``not judged``, with the sentence."""

    name: str
    status: str
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail,
                "text": f"{self.name}: {self.status}" + (f" ({self.detail})" if self.detail
                                                          else "")}


@dataclass
class Steps(StepSeries):
    """The claims over one run directory's step series (`read.steps.StepSeries`)."""

    @classmethod
    def of(cls, series: StepSeries) -> Steps:
        return cls(series=series.series, weights=series.weights, problems=series.problems)

    def trend(self) -> dict[str, Any]:
        return trend([s["step"] for s in self.series],
                     [s["abs_diff_mean"] for s in self.series])

    def bitwise_claim(self) -> Claim:
        name = "train_rollout_bitwise"
        if self.problems:
            return Claim(name, "not judged", "; ".join(self.problems[:3]))
        if not self.series:
            return Claim(name, "not judged", "no per-step sidecars")
        for s in self.series:
            if not s["active_tokens"]:
                return Claim(name, "not judged", f"step {s['step']}: no active token to "
                             "compare")
            if s["bitwise_mismatch_count"]:
                return Claim(name, "fails", f"first non-bitwise step {s['step']}: "
                             f"{s['bitwise_mismatch_count']} of {s['active_tokens']} tokens")
        return Claim(name, "holds", f"{len(self.series)} steps, every step bitwise")

    def weights_claim(self) -> Claim:
        name = "weights_bitwise"
        if self.problems:
            return Claim(name, "not judged", "; ".join(self.problems[:3]))
        if not self.weights:
            return Claim(name, "not judged", "no per-version weight audits")
        nums = sorted(int(v) for v in self.weights if v.isdigit())
        lost = [n for n in range(nums[0], nums[-1] + 1) if n not in nums] if nums else []
        if lost:
            return Claim(name, "not judged", f"weight versions {nums[0]}..{nums[-1]} lack "
                         f"{lost[:8]}: the chain has gaps")
        for v in sorted(self.weights, key=_version_key):
            sides = self.weights[v]
            missing = [s for s in ("training", "rollout") if s not in sides]
            if missing:
                return Claim(name, "not judged", f"version {v}: no {missing[0]} audit")
            if sides["training"] != sides["rollout"]:
                return Claim(name, "fails", f"first differing version {v}: training "
                             f"{sides['training'][:12]} != rollout {sides['rollout'][:12]}")
        return Claim(name, "holds", f"{len(self.weights)} version(s) equal on both sides")

    def as_dict(self) -> dict[str, Any]:
        return {"series": self.series, "trend": self.trend(),
                "weight_chain": {v: self.weights[v] for v in sorted(self.weights,
                                                                    key=_version_key)},
                "problems": self.problems}


def _version_key(v: str) -> tuple[int, str]:
    return (int(v), v) if v.isdigit() else (1 << 62, v)


def trend(steps: list[int], values: list[float]) -> dict[str, Any]:
    """Least-squares slope per step of ``values`` and its bootstrap interval, with the verdict."""
    x, y = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    out: dict[str, Any] = {"metric": "active-token mean |dlogp|", "n": int(x.size),
                           "slope": None, "low": None, "high": None, "confidence": 0.95}
    if x.size < MIN_TREND_STEPS:
        out.update(conclusion="no conclusion",
                   reason=f"{x.size} step(s), at least {MIN_TREND_STEPS} needed")
        return out
    if np.all(y == y[0]):
        out.update(slope=0.0, low=0.0, high=0.0, conclusion="flat",
                   reason="every step has the same value")
        return out
    rng = np.random.default_rng(SEED)
    idx = rng.integers(0, x.size, (RESAMPLES, x.size))
    xs, ys = x[idx], y[idx]
    xm, ym = xs.mean(1, keepdims=True), ys.mean(1, keepdims=True)
    den = ((xs - xm) ** 2).sum(1)
    ok = den > 0
    slopes = (((xs - xm) * (ys - ym)).sum(1)[ok] / den[ok])
    slope = float(np.polyfit(x, y, 1)[0])
    low, high = (float(v) for v in np.percentile(slopes, [2.5, 97.5]))
    band = FLAT_FRACTION * float(np.abs(y).mean())
    if low > 0:
        conclusion = "grows"
    elif -band <= low and high <= band:
        conclusion = "flat"
    else:
        conclusion = "no conclusion"
    out.update(slope=slope, low=low, high=high, conclusion=conclusion,
               text=f"slope {slope:.3g}/step [{low:.3g}, {high:.3g}] 95% CI, n={x.size}: "
               f"{conclusion}")
    return out


def compare_runs(pair: RunPair) -> Claim:
    """run_to_run_bitwise of two runs read side by side (`read.steps.read_pair`): sidecar bytes
    per (step, rank), then both weight chains. A pair that is one run, or whose evidence is
    incomplete or unreadable, is "not judged", never "holds"."""
    name = "run_to_run_bitwise"
    if pair.unusable:
        return Claim(name, "not judged", pair.unusable)
    if not pair.first_keys:
        return Claim(name, "not judged", f"no sidecars in {pair.first}")
    if pair.first_keys != pair.second_keys:
        only = sorted(pair.first_keys ^ pair.second_keys)[0]
        return Claim(name, "not judged", f"step {only[0]} rank {only[1]}: sidecar in one run "
                     "only")
    if pair.differs_at is not None:
        step, rank, sample = pair.differs_at
        return Claim(name, "fails", f"fails at step {step}, rank {rank}, sample {sample}")
    if pair.chains is None:  # (the reader stopped without saying why: never a pass)
        return Claim(name, "not judged", "the weight chains were not read")
    ca, cb = pair.chains
    for v in sorted(set(ca) | set(cb), key=_version_key):
        if ca.get(v) != cb.get(v):
            return Claim(name, "fails", f"fails at weight version {v}")
    return Claim(name, "holds", f"{len(pair.first_keys)} sidecar(s) and {len(ca)} weight "
                 "version(s) byte-identical across 2 runs")


def judge_claims(rep: Reproducibility | None) -> tuple[dict[str, dict[str, str]],
                                                        dict[str, Any]]:
    """The three claims (``CLAIMS``) and the drift-over-steps data of one run directory, from
    what `read.steps.read_reproducibility` read of it (None: not read, every claim not judged)."""
    if rep is None or rep.steps is None:
        why = rep.steps_error if rep is not None else "the per-step evidence was not read"
        return {c: Claim(c, "not judged", why).as_dict() for c in CLAIMS}, {}
    st = Steps.of(rep.steps)
    if rep.repeat is not None:
        r2r = compare_runs(rep.repeat)
    else:
        r2r = Claim("run_to_run_bitwise", "not judged", "one run (set [reproducibility] "
                    "runs = 2 or --rlk-repeat-baseline)")
    claims = {"train_rollout_bitwise": st.bitwise_claim(), "run_to_run_bitwise": r2r,
              "weights_bitwise": st.weights_claim()}
    return {k: v.as_dict() for k, v in claims.items()}, st.as_dict()


def apply_declared(claims: dict[str, dict[str, str]], declared: tuple[str, ...], mode: str,
                   verdict: str, reasons: list[str], waived: tuple[str, ...] = (),
                   ) -> tuple[str, list[str]]:
    """An all-R cell's claims. In strict mode a claim that was judged and fails makes a valid
    cell ``contract_mismatch``, declared (``[matrix] baseline_claims``) or not, and a declared
    claim that was not judged makes it ``incomparable``; otherwise a declared claim that does
    not hold is a reason (``also:`` on a valid cell) and an undeclared one is only reported.
    ``waived``: undeclared claims the cell's own contract speaks for instead (a declared
    tolerance allows train/rollout drift within it: ``train_rollout_bitwise``)."""
    order = [*declared, *(n for n in CLAIMS if n not in declared), *(
        n for n in claims if n not in declared and n not in CLAIMS)]
    for name in order:
        c = claims.get(name)
        if name in declared and not isinstance(c, dict):
            c = Claim(name, "not judged", "not in the record").as_dict()
        if not isinstance(c, dict) or c.get("status") == "holds":
            continue
        if name not in declared and (c.get("status") != "fails" or mode != "strict"
                                     or name in waived or verdict != "valid"):
            continue  # an undeclared claim is only reported, unless it fails under strict
        label = "declared baseline claim" if name in declared else "baseline claim (not declared)"
        why = f"{label} {c.get('text') or name}"
        if mode == "strict" and verdict == "valid":
            verdict = "contract_mismatch" if c.get("status") == "fails" else "incomparable"
            reasons = [why]
        elif why not in reasons:
            reasons = [*reasons, why if verdict != "valid" else f"also: {why}"]
    return verdict, reasons
