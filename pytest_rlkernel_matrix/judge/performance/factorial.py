"""A module's four cells as a 2x2 factorial on log time, and the three answers a report gives.

The model (docs/en/performance.md, "The statistical model"):

- **Unit of replication: the process.** Each process of a cell gives one number per phase: the
  location of its steady-state steps on log seconds (`steady.py`). Steps of one process
  share its start-up, placement and clocks; they are never counted as replicates.
- **2x2 factorial.** Per module the cells are training side R/P x rollout side R/P. On the cell
  means of log time: the **training side's main effect** is
  ``(RR + RP)/2 - (PR + PP)/2`` (time with R on the training side over time with P on it,
  averaged over the rollout side), the **rollout side's** ``(RR + PR)/2 - (RP + PP)/2``, the
  **interaction** ``RR - PR - RP + PP`` (shown, not a statement). exp() of an effect is a time
  ratio, time with R / time with P; below 1 R takes less time.
- **Variance.** Pooled over the four cells (``df = sum(n_c - 1)``) only when the cells are
  **balanced** (the same number of processes in each) and Bartlett's test (`bartlett_p`:
  scipy.stats.bartlett's statistic) does not reject equal variances at 5%: then the pooled
  standard error of a main effect is exactly the per-cell one and only the degrees of freedom
  differ. Otherwise (cells of unequal size, or unequal variances) each cell's own variance, and
  the degrees of freedom of the **thinnest cell** (``min(n_c - 1)``, Hsu's conservative choice:
  Welch-Satterthwaite's estimated df trusts a 2-process cell's variance, and with cells of 2
  and 8 processes gave 11% false statements where 5% is promised). A cell of 2 processes thus
  gives 1 degree of freedom: its statements are inconclusive, not wrong
  (`benchmarks/bench_perf_coverage.py`, unequal rows). Intervals from Student's t (scipy's,
  `t_quantile`).
- **Three answers per side and phase** (`decide`): "slower"/"faster" when the interval excludes
  1; "no difference within +-m" when the whole interval lies inside ``[1/(1+m), 1+m]``
  (``[performance] equivalence``, default 5%); otherwise "inconclusive", with about how many
  processes x steps per cell would resolve +-m (`plan`, from the measured variance components).
- **Family-wise error over every statement of the report** (`decide`): closed testing with
  Bonferroni local tests over the partition of each effect's line (Holm's step-down principle;
  Finner & Strassburger 2002's partitioning principle). Each statement can be false in one way
  only for a given true effect (a claimed direction when there is none or the other; a claimed
  equivalence when the effect is at least m), and its false-claim probability at level a is at
  most a; a statement's level is ``alpha / j`` where j is the size of the largest family of
  other statements that could still hold a true null; with no statement settled both ways,
  ``j = m`` (Bonferroni). The chance that *any* statement of a report is false is at most
  ``1 - confidence``. `benchmarks/bench_perf_coverage.py` measures it by simulation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.judge.performance.steady import Steady, steady

CELLS = ("R/R", "P/R", "R/P", "P/P")
# contrast weights on the cells' mean log times, in CELLS order
WEIGHTS: dict[str, tuple[float, ...]] = {
    "training": (0.5, -0.5, 0.5, -0.5),
    "rollout": (0.5, 0.5, -0.5, -0.5),
    "interaction": (1.0, -1.0, -1.0, 1.0),
}
EQUAL_VARIANCE_ALPHA = 0.05  # Bartlett's test: below this, Welch-Satterthwaite
MAX_PROCESSES = 64  # the largest processes per cell `plan` proposes ([performance] processes)
MAX_STEPS = 200  # the most steps per process `plan` proposes
DEFAULT_START_STEPS = 10.0  # a process's fixed cost in steady steps, when not measured


# Student t and chi-square from scipy.special (the functions scipy.stats.t and scipy.stats.chi2
# call): importing scipy.stats costs ~0.5 s (2-3 s on a loaded box) per process, scipy.special
# ~0.2 s; tests/test_perf_model.py checks these against scipy.stats.
def t_quantile(p: Any, df: Any) -> Any:
    """scipy.stats.t.ppf(p, df)."""
    from scipy.special import stdtrit

    return stdtrit(df, p)


def t_sf(x: float, df: float) -> float:
    """scipy.stats.t.sf(x, df)."""
    from scipy.special import stdtr

    return float(stdtr(df, -x))


def bartlett_p(samples: Sequence[np.ndarray]) -> float:
    """The p-value of Bartlett's test of equal variances (scipy.stats.bartlett's statistic
    and its chi-square tail, k - 1 degrees of freedom)."""
    from scipy.special import chdtrc

    n = np.array([x.size for x in samples], dtype=np.float64)
    v = np.array([np.var(x, ddof=1) for x in samples])
    k, total = len(samples), float(n.sum())
    pooled = float(((n - 1) * v).sum() / (total - k))
    stat = ((total - k) * math.log(pooled) - float(((n - 1) * np.log(v)).sum())) / (
        1.0 + (float((1.0 / (n - 1)).sum()) - 1.0 / (total - k)) / (3.0 * (k - 1)))
    return float(chdtrc(k - 1, stat))


@dataclass
class CellFit:
    """One cell's processes of one phase."""

    processes: list[Steady]

    @property
    def n(self) -> int:
        return len(self.processes)

    @property
    def y(self) -> np.ndarray:
        return np.array([p.location for p in self.processes])

    @property
    def mean(self) -> float:
        return float(self.y.mean())

    @property
    def var(self) -> float | None:
        return float(np.var(self.y, ddof=1)) if self.n > 1 else None


@dataclass
class Effect:
    """One contrast's estimate on log time, its standard error and degrees of freedom."""

    name: str
    estimate: float
    se: float | None  # None: no between-process variance measured (one process in a cell)
    df: float | None
    pooled: bool

    def interval(self, level: float) -> tuple[float, float] | None:
        """exp() of the two-sided `level` t interval: time ratio bounds."""
        if self.se is None or self.df is None:
            return None
        half = float(t_quantile(0.5 + level / 2.0, self.df)) * self.se
        return math.exp(self.estimate - half), math.exp(self.estimate + half)

    @property
    def ratio(self) -> float:
        return math.exp(self.estimate)

    def p_difference(self) -> float:
        """Two-sided p-value of 'no effect' (the smallest alpha whose interval excludes 0)."""
        if self.se is None or self.df is None:
            return 1.0
        if self.se == 0:
            return 0.0 if self.estimate != 0 else 1.0
        return 2.0 * t_sf(abs(self.estimate) / self.se, self.df)

    def p_equivalence(self, delta: float) -> float:
        """The smallest alpha whose two-sided interval lies inside (-delta, delta)."""
        if self.se is None or self.df is None or abs(self.estimate) >= delta:
            return 1.0
        if self.se == 0:
            return 0.0
        return 2.0 * t_sf((delta - abs(self.estimate)) / self.se, self.df)


@dataclass
class Fit:
    """One module and phase: the cells' processes, the effects, the variance components."""

    cells: dict[str, CellFit]
    effects: dict[str, Effect]
    pooled: bool
    bartlett_p: float | None
    within_var: float | None  # step noise: pooled variance of log step time within processes
    between_var: float | None  # between processes: cell variance minus step noise / steps
    steps: float  # mean kept steps per process
    measured_steps: float = 0.0  # mean measured steps per process (before MSER)
    notes: list[str] = field(default_factory=list)

    def used(self) -> dict[str, list[dict[str, Any]]]:
        """Per cell, per process: which steps counted and their location (for the record)."""
        return {case: [p.as_dict() for p in cell.processes] for case, cell in self.cells.items()}


def _welch(weights: Sequence[float], cells: Sequence[CellFit]) -> tuple[float, float]:
    """Per-cell variances: the standard error, and the degrees of freedom of the thinnest cell
    the contrast weighs (Hsu; never more than Welch-Satterthwaite's)."""
    terms = [w * w * (c.var or 0.0) / c.n for w, c in zip(weights, cells, strict=True)]
    se2 = sum(terms)
    denom = sum(t * t / (c.n - 1) for t, c in zip(terms, cells, strict=True))
    thinnest = float(min(c.n - 1 for w, c in zip(weights, cells, strict=True) if w))
    df = min(thinnest, se2 * se2 / denom) if denom > 0 else thinnest
    return math.sqrt(se2), df


def fit(groups: Mapping[str, Sequence[Sequence[float]]]) -> Fit:
    """The factorial of one module and phase: `groups` maps each of the four cases to its
    processes' measured steps (seconds, warmup excluded)."""
    missing = [c for c in CELLS if not [g for g in groups.get(c) or [] if len(g)]]
    if missing:
        raise ValueError(f"fit needs every cell's steps; none for {', '.join(missing)}")
    cells = {c: CellFit([steady(g) for g in groups[c] if len(g)]) for c in CELLS}
    ordered = [cells[c] for c in CELLS]
    means = np.array([c.mean for c in ordered])
    notes: list[str] = []
    single = [c for c in CELLS if cells[c].n < 2]
    within = [p.within_var for c in ordered for p in c.processes if p.within_var is not None]
    dof = [p.n - 1 for c in ordered for p in c.processes if p.within_var is not None]
    within_var = (float(np.dot(within, dof) / sum(dof)) if dof and sum(dof) > 0 else None)
    steps = float(np.mean([p.n for c in ordered for p in c.processes]))
    measured = float(np.mean([p.total for c in ordered for p in c.processes]))
    effects: dict[str, Effect] = {}
    if single:
        notes.append(f"one process in {', '.join(single)}: the variation between processes is "
                     "not measured")
        for name, w in WEIGHTS.items():
            effects[name] = Effect(name, float(np.dot(w, means)), None, None, False)
        return Fit(cells, effects, False, None, within_var, None, steps, measured, notes)
    variances = [float(c.var or 0.0) for c in ordered]
    pooled_var = sum((c.n - 1) * v for c, v in zip(ordered, variances, strict=True)) / sum(
        c.n - 1 for c in ordered)
    bartlett: float | None = None
    balanced = len({c.n for c in ordered}) == 1
    if all(v > 0 for v in variances):
        bartlett = bartlett_p([c.y for c in ordered])
        pooled = balanced and bartlett >= EQUAL_VARIANCE_ALPHA
    else:
        pooled = balanced  # a cell of identical processes: nothing to test
    if not pooled:
        sizes = "/".join(str(c.n) for c in ordered)
        why = (f"cell variances differ (Bartlett p={bartlett:.3g})" if balanced and bartlett
               is not None else f"cells of unequal size ({sizes} processes)")
        notes.append(f"{why}: each cell's own variance, the thinnest cell's degrees of "
                     "freedom")
    for name, w in WEIGHTS.items():
        est = float(np.dot(w, means))
        if pooled:
            se = math.sqrt(pooled_var * sum(wi * wi / c.n for wi, c in zip(w, ordered,
                                                                           strict=True)))
            df = float(sum(c.n - 1 for c in ordered))
        else:
            se, df = _welch(w, ordered)
        effects[name] = Effect(name, est, se, df, pooled)
    between = None
    if within_var is not None:
        between = max(0.0, pooled_var - within_var / steps)
    return Fit(cells, effects, pooled, bartlett, within_var, between, steps, measured, notes)


# -- the three answers ---------------------------------------------------------------------------

SLOWER, FASTER, EQUIVALENT, INCONCLUSIVE = "slower", "faster", "no difference", "inconclusive"
KINDS = (SLOWER, FASTER, EQUIVALENT, INCONCLUSIVE)


def margin_bounds(margin: float) -> tuple[float, float]:
    return 1.0 / (1.0 + margin), 1.0 + margin


def closed_levels(p_claim: Sequence[float], p_other: Sequence[float],
                  alpha: float) -> list[float]:
    """Per statement, the alpha it is judged at: alpha / j, j the largest family size for which
    enough other statements could still hold a true null (their larger p above alpha / j)."""
    m = len(p_claim)
    out = []
    for s in range(m):
        others = [q for k, q in enumerate(p_other) if k != s]
        j_s = 1
        for j in range(1, m + 1):
            if sum(1 for q in others if q > alpha / j) >= j - 1:
                j_s = j
        out.append(alpha / j_s)
    return out


@dataclass
class Answer:
    """One statement: a side (or the interaction) of one module and phase."""

    key: tuple[str, ...]  # (hardware, module, side, phase)
    effect: Effect
    alpha: float = 0.0  # the level it was judged at (1 - alpha interval)
    kind: str = INCONCLUSIVE
    low: float | None = None
    high: float | None = None
    plan: tuple[int, int] | None = None  # processes x steps per cell that would resolve it
    why: str | None = None


def decide(answers: Sequence[Answer], confidence: float, margin: float) -> None:
    """Judge every statement of a report together (in place): the family-wise error over all of
    them at most 1 - confidence (closed testing; see the module's docstring)."""
    alpha = 1.0 - confidence
    delta = math.log1p(margin)
    judged = [a for a in answers if a.effect.se is not None]
    p_diff = [a.effect.p_difference() for a in judged]
    p_eq = [a.effect.p_equivalence(delta) for a in judged]
    claim = [min(d, e) for d, e in zip(p_diff, p_eq, strict=True)]
    other = [max(d, e) for d, e in zip(p_diff, p_eq, strict=True)]
    for a, lvl, d, e in zip(judged, closed_levels(claim, other, alpha), p_diff, p_eq,
                            strict=True):
        a.alpha = lvl
        bounds = a.effect.interval(1.0 - lvl)
        assert bounds is not None
        a.low, a.high = bounds
        if d <= lvl:
            a.kind = SLOWER if a.effect.estimate > 0 else FASTER
        elif e <= lvl:
            a.kind = EQUIVALENT
        else:
            a.kind = INCONCLUSIVE
    for a in answers:
        if a.effect.se is None:
            a.kind = INCONCLUSIVE
            a.alpha = alpha / max(1, len(judged) or 1)


def plan(f: Fit, effect: str, alpha: float, margin: float,
         costs: tuple[float, float] | None = None,
         max_steps: int | None = None) -> tuple[int, int] | None:
    """About how many processes per cell x steps per process would resolve `effect` at +-margin:
    a two-sided 1 - alpha interval of half-width at most log(1 + margin) / 2 either excludes 1
    or lies inside the margin, whatever the estimate. From the measured variance components
    (between processes, step noise) and `costs` (a process's fixed seconds, a step's seconds;
    unmeasured: a process costs `DEFAULT_START_STEPS` steps), the cheapest (N, S) in time;
    None when no N <= `MAX_PROCESSES` would. `max_steps`: S at most that (the steps the
    workload runs: what `--rlk-processes=auto` can add is processes, not steps)."""
    if f.within_var is None or f.between_var is None:
        return None
    c0, c1 = costs if costs else (DEFAULT_START_STEPS, 1.0)
    c1 = max(c1, 1e-9)
    target = math.log1p(margin) / 2.0
    w = WEIGHTS[effect]
    cw = sum(x * x for x in w)  # with N processes in every cell: var = cw / N * var(process)
    ns = np.arange(2, MAX_PROCESSES + 1)
    quant = t_quantile(1.0 - alpha / 2.0, 4.0 * (ns - 1))
    best: tuple[float, int, int] | None = None
    s_min = max(2, round(f.measured_steps or f.steps))
    for s in range(s_min, max(s_min, min(MAX_STEPS, max_steps or MAX_STEPS)) + 1):
        var_proc = f.between_var + f.within_var / s
        ok = np.nonzero(quant * np.sqrt(cw * var_proc / ns) <= target)[0]
        if ok.size:
            n = int(ns[ok[0]])
            cost = 4 * n * (c0 + s * c1)
            if best is None or cost < best[0]:
                best = (cost, n, s)
        if f.between_var > 0 and f.within_var / s < 0.01 * f.between_var:
            break  # more steps no longer help
    return None if best is None else (best[1], best[2])
