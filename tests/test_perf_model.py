"""The statistical model of the performance statements (judge.performance:
steady, factorial):
the warm-up transient, the 2x2 factorial's intervals against scipy, the three answers, and a
small coverage simulation (the full one: benchmarks/bench_perf_coverage.py)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from pytest_rlkernel_matrix.judge.performance.factorial import (
    EQUIVALENT,
    INCONCLUSIVE,
    SLOWER,
    Answer,
    closed_levels,
    decide,
    fit,
    plan,
)
from pytest_rlkernel_matrix.judge.performance.steady import mser, steady

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_perf_coverage.py"


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_perf_coverage", BENCH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_warm_up_transient_is_dropped_and_the_kept_steps_are_recorded() -> None:
    # an H200 process: the first step 10x, then ~1 s
    s = steady([10.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.03, 0.97])
    assert s.first == 1 and s.n == 7 and s.total == 8
    assert s.seconds == pytest.approx(1.0, rel=0.02)
    assert s.as_dict()["first_kept"] == 1
    # no transient: nothing (or little) dropped, never more than half
    assert mser([1.0] * 10) == 0
    assert mser(list(np.linspace(5, 1, 12))) <= 6
    # one slow step in the middle moves the trimmed mean little
    assert steady([1.0, 1.0, 5.0, 1.0, 1.0]).seconds == pytest.approx(1.0)
    with pytest.raises(ValueError):
        steady([1.0, 0.0])


def _cells(effects: dict[str, float], n: int = 3, seed: int = 0) -> dict[str, list[list[float]]]:
    rng = np.random.default_rng(seed)
    return {c: [list(f * math.exp(rng.normal(0, 0.03)) * np.exp(rng.normal(0, 0.02, 6)))
                for _ in range(n)] for c, f in effects.items()}


def test_main_effects_are_contrasts_with_pooled_t_intervals_as_scipy_computes() -> None:
    from scipy.stats import t

    # constant steps: each process's location is exactly its value
    y = {"R/R": [1.2, 1.25, 1.22], "P/R": [1.0, 1.02, 0.99], "R/P": [1.21, 1.2, 1.23],
         "P/P": [1.01, 0.98, 1.0]}
    f = fit({c: [[v] * 5 for v in vs] for c, vs in y.items()})
    logs = {c: np.log(vs) for c, vs in y.items()}
    est = (logs["R/R"].mean() + logs["R/P"].mean() - logs["P/R"].mean()
           - logs["P/P"].mean()) / 2
    sp2 = np.mean([np.var(v, ddof=1) for v in logs.values()])
    se = math.sqrt(sp2 * 4 * 0.25 / 3)
    half = t.ppf(0.975, 8) * se
    eff = f.effects["training"]
    assert f.pooled and eff.df == 8 and eff.estimate == pytest.approx(est)
    assert eff.interval(0.95) == (pytest.approx(math.exp(est - half)),
                                  pytest.approx(math.exp(est + half)))
    assert f.effects["rollout"].ratio == pytest.approx(1.0, abs=0.02)
    assert f.effects["interaction"].se == pytest.approx(2 * se)
    # one cell far noisier: Bartlett rejects, Welch-Satterthwaite df (fewer than 8)
    noisy = dict(y, **{"P/P": [0.7, 1.4, 1.0]})
    g = fit({c: [[v] * 5 for v in vs] for c, vs in noisy.items()})
    assert not g.pooled and g.effects["training"].df < 8
    with pytest.raises(ValueError, match="P/P"):
        fit({c: [[1.0] * 5] for c in ("R/R", "P/R", "R/P")})


def test_three_answers_and_how_many_processes_would_resolve() -> None:
    slow = fit(_cells({"R/R": 1.3, "P/R": 1.3, "R/P": 1.0, "P/P": 1.0}, n=4))
    same = fit(_cells({"R/R": 1.0, "P/R": 1.0, "R/P": 1.0, "P/P": 1.0}, n=8, seed=1))
    a = [Answer(("cpu", "ffn", "rollout", "rollout"), slow.effects["rollout"]),
         Answer(("cpu", "ffn", "training", "rollout"), same.effects["training"])]
    decide(a, 0.95, 0.10)
    assert a[0].kind == SLOWER and a[0].low is not None and a[0].low > 1
    assert a[1].kind == EQUIVALENT and 1 / 1.1 <= a[1].low <= 1 <= a[1].high <= 1.1
    b = [Answer(("cpu", "ffn", "training", "rollout"), slow.effects["training"])]
    decide(b, 0.95, 0.03)  # +-3%: too tight for 4 processes of this noise
    assert b[0].kind == INCONCLUSIVE
    n, s = plan(slow, "training", b[0].alpha, 0.03) or (0, 0)
    assert n > 4 and s >= 6
    assert plan(slow, "training", b[0].alpha, 0.001) is None  # beyond 64 processes: said so
    # more steps cost less than more processes when a process's start is dear
    dear = plan(slow, "training", 0.05, 0.05, costs=(100.0, 1.0))
    cheap = plan(slow, "training", 0.05, 0.05, costs=(0.1, 1.0))
    assert dear and cheap and dear[1] >= cheap[1]


def test_t_and_bartlett_are_scipy_stats() -> None:
    from scipy import stats

    from pytest_rlkernel_matrix.judge.performance.factorial import bartlett_p, t_quantile, t_sf

    for df in (1.0, 2.5, 4.0, 28.0):
        assert t_quantile(0.975, df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-10)
        assert t_sf(1.7, df) == pytest.approx(stats.t.sf(1.7, df), rel=1e-10)
    rng = np.random.default_rng(2)
    for n in (2, 3, 8):
        xs = [rng.normal(0, s, n) for s in (1.0, 1.2, 0.8, 3.0)]
        assert bartlett_p(xs) == pytest.approx(stats.bartlett(*xs).pvalue, rel=1e-9)


def test_closed_levels_are_bonferroni_unless_statements_are_settled_both_ways() -> None:
    assert closed_levels([0.001, 0.5, 0.5], [0.9, 0.9, 0.9], 0.05) == pytest.approx([0.05 / 3] * 3)
    # two statements settled both ways (both p small): the third is judged at 0.05
    assert closed_levels([0.001, 0.001, 0.04], [0.001, 0.001, 0.9], 0.05)[2] == pytest.approx(
        0.05)


def test_small_coverage_simulation_keeps_nominal_coverage_and_family_wise_error() -> None:
    """A few seconds of benchmarks/bench_perf_coverage.py: 150 reports at 2 and 3 processes
    per cell, no true difference, H200-like noise with a warm-up step. Binomial slack: at 150
    reports a true 95% reads below 0.90 with probability < 0.5%."""
    bench = _bench()
    for n in (2, 3):
        r = bench.run(n, "h200", "null", 150, seed=11)
        assert r["warmup_dropped"] == 1.0  # every process's transient found
        assert min(r["coverage"].values()) >= 0.90, r
        assert r["simultaneous"] >= 0.90 and r["family_false"] <= 0.10, r
        assert r["seconds_per_report"] < 1.0


def test_noise_gate_reads_the_steady_steps_and_says_what_it_dropped() -> None:
    """A first step of 15 s among 3 s ones (what a CPU drill run showed) is the warm-up
    transient, not noise; a slow step in the middle still is, named with the dropped ones."""
    from pytest_rlkernel_matrix.judge.performance.stats import summary, timing_noise
    from pytest_rlkernel_matrix.spec.limits import Policy

    def spread(steps: list[float]) -> dict:
        return {"step_wall_time": {**summary(steps), "steps": steps}}

    assert timing_noise(spread([15.2, 3.0, 3.1, 2.98, 3.05, 3.02]), Policy()) == []
    (why,) = timing_noise(spread([15.2, 3.0, 3.1, 3.05, 3.02, 2.99, 9.0, 3.01]), Policy())
    assert why.startswith("noise: step time spread (max-min)/median 199% > 50% (n=7") and \
        "after 1 warm-up step(s)" in why, why
    assert timing_noise(spread([3.0] * 4), Policy())[0].startswith("noise: 4 measured step")
