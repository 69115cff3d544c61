"""Whether a logprob drift matters for the loss: the importance ratio on active tokens.

From the active-token delta = train - rollout (float64, RL-Kernel's sign, what `metrics.compute`
already holds) the ratio pi_train / pi_rollout = exp(delta), and what an RL loss would do with it:

- **PPO clip** (the rule of vime's `dlogp_diagnostics.compute_dlogp_diagnostics`,
  `rlk_audit_clipfrac0`): a token is outside the clip range when |ratio - 1| > eps, eps = 0.2 by
  default. Ours is not vime's figure where a delta is not finite (below): `vime` holds vime's
  own (`clipfrac0`, `ratio0_mean` over the finite tokens only, as vime drops the others).
- **Truncated IS** (verl's rollout correction, token level, `rollout_is_threshold` = 2.0: TIS
  clamps a weight at the cap; its `rollout_is_ratio_fraction_high`): the share of tokens whose
  raw ratio is above the cap.
- **Masked IS** (verl's token-level IcePop / mask mode: tokens with a ratio outside [lower,
  upper] are dropped; the lower bound defaults to 1 / upper, as verl's metrics take it): the
  share of tokens outside the bounds.

A token whose delta is not finite (NaN, +-inf) has no usable ratio: it counts as outside every
range (fail closed) and is left out of the quantiles, which are of the finite ratios.
Everything is vectorised over the arrays `metrics.compute` already made; a cell whose active
tokens are all equal by value (`mismatch_count == 0`, no non-finite delta) has ratio exactly 1
and costs nothing more than a per-step token count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy loads when figures are made, not when the report formats them
    import numpy as np

PPO_CLIP_EPS = 0.2  # vime's dlogp_diagnostics default (eps_clip)
TIS_CAP = 2.0  # verl's rollout_is_threshold default (token-level truncated IS)
MIS_UPPER = 2.0  # verl's token-level masked IS upper bound; lower = 1 / upper
QUANTILES = (50.0, 90.0, 99.0, 99.9)  # percent, of |log ratio|
CONVENTION = ("ratio = exp(train - rollout) per active token; PPO clip: |ratio - 1| > eps "
              "(vime dlogp_diagnostics' rule, eps 0.2; vime's own clipfrac0 drops non-finite "
              "tokens: see `vime`); truncated IS: ratio > cap (verl "
              "rollout correction TIS, rollout_is_ratio_fraction_high, cap 2); masked IS: ratio "
              "outside [1/upper, upper] (verl token-level IcePop/mask, upper 2); a non-finite "
              "delta counts as outside every range")


@dataclass(frozen=True)
class Thresholds:
    """The loss conventions a cell's figures use (one set per session)."""

    clip_eps: float = PPO_CLIP_EPS
    tis_cap: float = TIS_CAP
    mis_upper: float = MIS_UPPER
    mis_lower: float | None = None  # None: 1 / mis_upper

    def __post_init__(self) -> None:
        for name in ("clip_eps", "tis_cap", "mis_upper"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"loss threshold {name} must be a positive finite number, "
                                 f"got {value!r}")
        if self.clip_eps >= 1:
            raise ValueError(f"loss threshold clip_eps must be below 1, got {self.clip_eps!r}")
        if self.lower >= self.mis_upper:
            raise ValueError(f"masked-IS bounds must have lower < upper, got "
                             f"[{self.lower!r}, {self.mis_upper!r}]")

    @property
    def lower(self) -> float:
        return 1.0 / self.mis_upper if self.mis_lower is None else float(self.mis_lower)

    def as_dict(self) -> dict[str, float]:
        return {"clip_eps": self.clip_eps, "tis_cap": self.tis_cap,
                "mis_lower": self.lower, "mis_upper": self.mis_upper}


DEFAULT = Thresholds()


def loss_impact(delta: np.ndarray, lengths: np.ndarray, calls: Sequence[int] | np.ndarray,
                mismatch_count: int, thresholds: Thresholds = DEFAULT,
                abs_sorted: np.ndarray | None = None) -> dict[str, Any]:
    """The importance-ratio figures of a cell and of each step.

    `delta`: float64 train - rollout over every active token of every sample, in sample order;
    `lengths`: each sample's active token count (they add up to `delta.size`); `calls`: each
    sample's call index (its step); `mismatch_count`: the active tokens that differ by value
    (`!=`), so 0 with every delta finite means ratio exactly 1; `abs_sorted`: the finite |delta|
    in ascending order, when already made (`metrics.compute` sorts them for its percentiles).

    The flags compare ratios with the thresholds in log space (ratio > cap as delta > log(cap),
    |ratio - 1| > eps as delta outside [log1p(-eps), log1p(eps)]), as verl's metrics do: the same
    flags as in ratio space except for a delta within rounding of a boundary. The quantiles are
    those of |log ratio| = |delta| (from the sorted values the drift percentiles use): p% of the
    tokens have a ratio within [exp(-q), exp(q)]; the extremes are exact (min and max ratio)."""
    import numpy as np

    n = int(delta.size)
    lengths = np.asarray(lengths, dtype=np.int64)
    calls = np.asarray(calls, dtype=np.int64)
    if lengths.size != calls.size or int(lengths.sum()) != n:
        raise ValueError(f"loss figures: {lengths.size} sample lengths adding up to "
                         f"{int(lengths.sum())} for {calls.size} calls and {n} active tokens")
    steps, slot = np.unique(calls, return_inverse=True)
    step_tokens = np.bincount(slot, weights=lengths, minlength=steps.size).astype(np.int64)
    out: dict[str, Any] = {"convention": CONVENTION, "thresholds": thresholds.as_dict(),
                           "active_tokens": n}
    if n == 0:
        out.update(exact=None, steps=[], brief="no active tokens")
        return out
    finite = np.isfinite(delta)
    nonfinite = n - int(np.count_nonzero(finite))
    if mismatch_count == 0 and nonfinite == 0:  # every delta is 0 (-0.0 == +0.0): ratio 1
        out.update(exact=True, nonfinite_count=0, ratio_min=1.0, ratio_max=1.0,
                   ratio_mean=1.0, abs_log_ratio_quantiles={_q(q): 0.0 for q in QUANTILES},
                   **{f"{k}_count": 0 for k in ("clip", "tis_truncated", "mis_masked")},
                   **{f"{k}_fraction": 0.0 for k in ("clip", "tis_truncated", "mis_masked")},
                   steps=[_step(int(s), int(t), 0, 0, 0) for s, t in
                          zip(steps.tolist(), step_tokens.tolist(), strict=True)])
        out["vime"] = _vime(n, n, 0, 1.0)
        out["brief"] = "ratio exactly 1"
        return out
    eps = thresholds.clip_eps
    lo_clip, hi_clip = math.log1p(-eps), math.log1p(eps)
    bounds = (hi_clip, -lo_clip, math.log(thresholds.tis_cap), math.log(thresholds.mis_upper),
              -math.log(thresholds.lower))
    if (nonfinite == 0 and abs_sorted is not None and abs_sorted.size == n
            and float(abs_sorted[-1]) < min(bounds)):
        # every |delta| is inside every bound (the usual drift): no flag is set anywhere
        per_step = [np.zeros(steps.size, dtype=np.int64)] * 3
    else:
        clip = (delta > hi_clip) | (delta < lo_clip)
        tis = delta > bounds[2]
        mis = (delta > bounds[3]) | (delta < -bounds[4])
        if nonfinite:  # NaN compares false and -inf gives ratio 0: no usable ratio, outside all
            clip, tis, mis = clip | ~finite, tis | ~finite, mis | ~finite
        per_step = [_grouped(flags, lengths, slot, steps.size) for flags in (clip, tis, mis)]
    good = delta[finite] if nonfinite else delta
    out.update(exact=False, nonfinite_count=nonfinite)
    if good.size:
        if abs_sorted is None or abs_sorted.size != good.size:
            abs_sorted = np.sort(np.abs(good))
        with np.errstate(over="ignore"):  # (a ratio past float64's range is inf)
            mean = float(np.exp(good).mean())
            out.update(ratio_min=_exp(float(good.min())),
                       ratio_max=_exp(float(good.max())), ratio_mean=mean,
                       abs_log_ratio_quantiles={
                           _q(q): _sorted_quantile(abs_sorted, q) for q in QUANTILES})
    else:
        out.update(ratio_min=None, ratio_max=None, ratio_mean=None, abs_log_ratio_quantiles={})
    for name, by_step in zip(("clip", "tis_truncated", "mis_masked"), per_step, strict=True):
        count = int(by_step.sum())
        out[f"{name}_count"] = count
        out[f"{name}_fraction"] = count / n
    out["steps"] = [_step(int(s), int(t), int(c), int(u), int(m)) for s, t, c, u, m in zip(
        steps.tolist(), step_tokens.tolist(), *(p.tolist() for p in per_step), strict=True)]
    finite_n = n - nonfinite
    out["vime"] = _vime(n, finite_n, out["clip_count"] - nonfinite, out.get("ratio_mean"))
    out["brief"] = brief(out)
    return out


VIME_CONVENTION = ("vime dlogp_diagnostics: a non-finite active dlogp is dropped (its "
                   "non_finite_dlogp warning) before clipfrac0 and ratio0_mean; "
                   "active_token_count counts it")


def _vime(active: int, finite: int, clipped: int, ratio_mean: float | None) -> dict[str, Any]:
    """The figures as vime's `compute_dlogp_diagnostics` states them (non-finite tokens
    dropped, 0.0 where nothing is left), beside ours (non-finite counts as outside)."""
    return {"convention": VIME_CONVENTION, "active_token_count": active,
            "dropped_non_finite": active - finite,
            "clipfrac0": clipped / finite if finite else 0.0,
            "ratio0_mean": ratio_mean if finite and ratio_mean is not None else 0.0}


def _exp(x: float) -> float:
    return math.exp(x) if x < 709.78 else math.inf


def _sorted_quantile(ascending: np.ndarray, q: float) -> float:
    """numpy's linear-method percentile `q` of values already in ascending order."""
    n = ascending.size
    at = q / 100.0 * (n - 1)
    lo = math.floor(at)
    hi = min(lo + 1, n - 1)
    a, b = float(ascending[lo]), float(ascending[hi])
    return a + (b - a) * (at - lo) if b != a else a


def _q(q: float) -> str:
    return f"p{q:g}"


def _step(step: int, tokens: int, clip: int, tis: int, mis: int) -> dict[str, Any]:
    share = (lambda k: k / tokens) if tokens else (lambda k: None)
    return {"step": step, "active_tokens": tokens, "clip_count": clip,
            "clip_fraction": share(clip), "tis_truncated_count": tis,
            "tis_truncated_fraction": share(tis), "mis_masked_count": mis,
            "mis_masked_fraction": share(mis)}


def _grouped(flags: np.ndarray, lengths: np.ndarray, slot: np.ndarray, steps: int) -> np.ndarray:
    """Per step: the flagged tokens of its samples (per sample by reduceat, then summed)."""
    import numpy as np

    per_sample = np.zeros(lengths.size, dtype=np.int64)
    some = lengths > 0
    if some.any():
        starts = (np.cumsum(lengths) - lengths)[some]
        per_sample[some] = np.add.reduceat(flags, starts, dtype=np.int64)
    return np.bincount(slot, weights=per_sample, minlength=steps).astype(np.int64)


def _pct(x: float) -> str:
    if x == 0:
        return "0%"
    return f"{100 * x:.2g}%" if x < 0.01 else f"{100 * x:.1f}%"


def brief(figures: Mapping[str, Any]) -> str:
    """One line: "ratio exactly 1", or "0.8% outside clip 0.2 (TIS>2 0.01%, MIS 0.02%)"."""
    if figures.get("exact") is True:
        return "ratio exactly 1"
    if figures.get("exact") is None:
        return str(figures.get("brief") or "no active tokens")
    th = figures.get("thresholds") or {}
    text = (f"{_pct(figures.get('clip_fraction') or 0.0)} of tokens outside the clip range "
            f"(eps {th.get('clip_eps', PPO_CLIP_EPS):g}); TIS cap {th.get('tis_cap', TIS_CAP):g} "
            f"cuts {_pct(figures.get('tis_truncated_fraction') or 0.0)}, MIS "
            f"[{th.get('mis_lower', 1 / MIS_UPPER):g}, {th.get('mis_upper', MIS_UPPER):g}] masks "
            f"{_pct(figures.get('mis_masked_fraction') or 0.0)}")
    lo, hi = figures.get("ratio_min"), figures.get("ratio_max")
    if lo is not None and hi is not None:
        text += f"; ratio in [{lo:.4g}, {hi:.4g}]"
    q99 = (figures.get("abs_log_ratio_quantiles") or {}).get("p99")
    if isinstance(q99, int | float):
        text += f", 99% of tokens within a factor {_exp(q99):.4g} of 1"
    if figures.get("nonfinite_count"):
        text += f"; {figures['nonfinite_count']} non-finite"
    return text


def loss_short(figures: Mapping[str, Any] | None) -> str:
    """The terminal table's cell: "=1", "clip 0.8%" (and "nf 3" for non-finite), or "-"."""
    if not isinstance(figures, Mapping) or figures.get("exact") is None:
        return "-"
    if figures.get("exact") is True:
        return "=1"
    text = f"clip {_pct(figures.get('clip_fraction') or 0.0)}"
    if figures.get("nonfinite_count"):
        text += f" nf {figures['nonfinite_count']}"
    return text


DRIFT_SAMPLES = 3  # the worst samples drawn along the response
DRIFT_POINTS = 200  # points per sample at most (each bucket keeps its largest |dlogp|)


def token_drift(samples: Sequence[Any], worst_tokens: Sequence[Mapping[str, Any]],
                ) -> list[dict[str, Any]]:
    """For the samples holding the worst tokens (at most `DRIFT_SAMPLES`, worst first): dlogp =
    train - rollout along the response at the active positions, thinned to `DRIFT_POINTS` by
    keeping the largest |dlogp| of each bucket of consecutive positions (spikes survive)."""
    import numpy as np

    seen: list[tuple[Any, Any, Any]] = []
    for w in worst_tokens:
        key = (w.get("sample"), w.get("rank"), w.get("call"))
        if key not in seen:
            seen.append(key)
        if len(seen) == DRIFT_SAMPLES:
            break
    index = {(s.sample, s.rank, s.call): s for s in samples}
    out = []
    for key in seen:
        s = index.get(key)
        if s is None:
            continue
        mask = s.mask.astype(bool) if s.mask.dtype != np.bool_ else s.mask
        pos = np.flatnonzero(mask)
        if not pos.size:
            continue
        with np.errstate(invalid="ignore"):
            d = s.train[mask].astype(np.float64) - s.rollout[mask].astype(np.float64)
        d = np.where(np.isfinite(d), d, np.nan)
        if pos.size > DRIFT_POINTS:
            edges = np.linspace(0, pos.size, DRIFT_POINTS + 1).astype(np.int64)
            score = np.nan_to_num(np.abs(d), nan=np.inf)
            pick = [int(a + np.argmax(score[a:b])) for a, b in pairwise(edges.tolist())
                    if b > a]
            pos, d = pos[pick], d[pick]
        finite = np.isfinite(d)
        top = int(np.argmax(np.abs(np.where(finite, d, 0.0))))
        out.append({"sample": key[0], "rank": key[1], "call": key[2],
                    "positions": pos[finite].tolist(), "dlogp": d[finite].tolist(),
                    "max_abs": float(abs(d[top])) if finite.any() else None,
                    "argmax": int(pos[top]), "active_tokens": int(np.count_nonzero(mask))})
    return out
