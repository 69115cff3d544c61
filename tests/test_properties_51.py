"""Issue 51: property tests over the numeric and performance layers and the report side.

Records with NaN, inf, huge, negative, duplicate, reordered and foreign values: never a valid
judgement out of an impossible number, and never a crash (only the documented `ValueError` of a
refused `cell-run.json`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_rlkernel_matrix.judge.numeric.judge import judge_numeric
from pytest_rlkernel_matrix.judge.performance.judge import judge_performance
from pytest_rlkernel_matrix.judge.performance.phases import impossible_timings
from pytest_rlkernel_matrix.judge.read.evidence import Evidence
from pytest_rlkernel_matrix.judge.read.logscan import scan_log
from pytest_rlkernel_matrix.judge.read.metrics import Sample, compute, log10_histogram
from pytest_rlkernel_matrix.spec.limits import Policy

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])
PHASE = ("perf/step_time", "perf/train_time", "perf/rollout_time", "perf/update_weights_time")
# what a perf record's value may be written as in run.log, and whether it is a possible time
GOOD = st.floats(min_value=0.001, max_value=1e4, allow_nan=False).map(lambda v: (repr(v), True))
BAD = st.sampled_from([("nan", False), ("inf", False), ("-inf", False), ("1e999", False),
                       ("-1e999", False), ("-0.5", False), ("-1e-9", False), ("True", False),
                       ("'3.0'", False), ("None", False), ("tensor(1.0)", False),
                       ("float('nan')", False)])
FOREIGN = st.sampled_from(["'perf/other': 1.0", "'fallback_note': 'x'", "'perf/tokens': nan",
                           "'perf/step_time_ms': -3"])


@st.composite
def perf_logs(draw: st.DrawFn) -> tuple[str, bool]:
    """(run.log text of perf records, whether every phase value in it is a possible time)."""
    ok = True
    lines = []
    steps = draw(st.lists(st.integers(0, 12), min_size=1, max_size=12))  # repeats, any order
    for step in steps:
        items = []
        for key in draw(st.permutations(PHASE)):
            text, good = draw(st.one_of(GOOD, GOOD, GOOD, BAD))
            ok &= good
            items.append(f"'{key}': {text}")
        items += draw(st.lists(FOREIGN, max_size=2))
        if draw(st.booleans()):  # a key twice in one record (the last wins, as Python has it)
            text, good = draw(st.one_of(GOOD, BAD))
            ok &= good
            items.append(f"'perf/step_time': {text}")
        lines.append(f"perf {step}: {{{', '.join(items)}}}")
    return "\n".join(lines) + "\n", ok


@SETTINGS
@given(case=perf_logs())
def test_impossible_timings_never_give_usable_performance(tmp_path: Path,
                                                          case: tuple[str, bool]) -> None:
    text, ok = case
    log = tmp_path / "run.log"
    log.write_text(text)
    scan = scan_log(log, root=tmp_path)
    why = impossible_timings(scan)
    perf = judge_performance(Evidence(root=tmp_path, log=scan), {}, True, "strict", 0,
                             Policy(min_steps=1))
    if not ok:
        assert why and perf.valid is False, (text, why)
    for reason in perf.reasons:  # every reason is text, none crashed on a number
        assert isinstance(reason, str)


@SETTINGS
@given(limit=st.sampled_from([math.nan, math.inf, 0.5, 1e308]),
       values=st.lists(st.floats(min_value=0.01, max_value=100.0), min_size=5, max_size=10),
       odd=st.sampled_from([math.nan, math.inf]), at=st.integers(0, 4))
def test_no_limit_comparison_passes_a_nan(limit: float, values: list[float], odd: float,
                                          at: int) -> None:
    from pytest_rlkernel_matrix.judge.performance.stats import timing_noise

    steps = [*values[:at], odd, *values[at:]]
    spread = {"step_wall_time": {"n": len(steps), "min": min(values), "max": max(values),
                                 "relative_spread": math.nan, "steps": steps}}
    why = timing_noise(spread, Policy(min_steps=1, max_relative_spread=limit))
    assert why, "a NaN spread passed a limit"
    if math.isnan(limit):  # a NaN limit passes nothing, not even a finite spread
        spread["step_wall_time"].update(relative_spread=0.1, steps=values[:3])
        assert timing_noise(spread, Policy(min_steps=1, max_relative_spread=limit))


finite_or_odd = st.one_of(
    st.floats(min_value=-20.0, max_value=0.0),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 1e300, -1e300, -0.0]))


@SETTINGS
@given(train=st.lists(finite_or_odd, min_size=1, max_size=24), data=st.data())
def test_drift_figures_never_crash_and_impossible_logprobs_never_pass(
        train: list[float], data: st.DataObject) -> None:
    t = np.array(train, dtype=np.float64)
    # the rollout: the same, a last bit off, or anything
    how = data.draw(st.sampled_from(["same", "ulp", "any"]))
    r = (t.copy() if how == "same" else np.nextafter(t, 0.0) if how == "ulp"
         else np.array(data.draw(st.lists(finite_or_odd, min_size=t.size, max_size=t.size)),
                       dtype=np.float64))
    sample = Sample(train=t, rollout=r, mask=np.ones(t.size, dtype=bool), sample=0)
    m = compute([sample])
    impossible = bool((~np.isfinite(t)).any() or (~np.isfinite(r)).any()
                      or (t > 0).any() or (r > 0).any())
    ev = Evidence(root=Path("."), metrics=m, samples=[sample])
    num, _, errors = judge_numeric(ev, "strict")
    if impossible:
        assert errors and num.valid is not True, (train, r.tolist())
    if m.histogram:
        assert all(math.isfinite(e) for e in m.histogram["log10_abs_diff_edges"])


@SETTINGS
@given(values=st.lists(st.floats(min_value=1e-30, max_value=1e30), min_size=1, max_size=8),
       ulps=st.integers(0, 3))
def test_the_histogram_takes_any_positive_finite_values(values: list[float], ulps: int) -> None:
    a = np.array(sorted(values))
    for _ in range(ulps):
        a = np.sort(np.concatenate([a, np.nextafter(a[-1:], np.inf)]))
    counts, edges = log10_histogram(a)
    assert int(counts.sum()) == a.size and np.isfinite(edges).all()


# -- the report side: cell-run.json -----------------------------------------------------------

POLICY_VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**6),
                          st.booleans(), st.none(), st.text(max_size=3))
POLICY_KEYS = st.sampled_from(["min_steps", "processes", "confidence", "equivalence",
                               "max_relative_spread", "max_foreign_cpu", "budget",
                               "max_concurrent_seconds", "sample_interval", "min_processes",
                               "foreign_key"])


@st.composite
def cell_run_texts(draw: st.DrawFn) -> str:
    from cellkit import cell_of

    from pytest_rlkernel_matrix.report.record import cell_to_dict

    policy = draw(st.dictionaries(POLICY_KEYS, POLICY_VALUES, max_size=4))
    meta: dict[str, Any] = {
        "session": "t", "cell": cell_to_dict(cell_of()), "mode": "strict", "run_id": "r",
        "run": {"command": "x", "exit_code": 0, "timed_out": False, "interrupted": False,
                "wall_time": draw(st.sampled_from([1.0, -1.0, math.nan, math.inf, 1e308])),
                "started": "s", "finished": "f"},
        "policy": {"backend": "cpu"}, "performance_policy": policy}
    items = list(meta.items())
    items = draw(st.permutations(items))  # reordered keys read the same
    text = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in items) + "}"
    if draw(st.booleans()):  # a key twice
        text = text[:-1] + ', "mode": "off"}'
    return text


@SETTINGS
@given(text=cell_run_texts())
def test_cell_run_json_is_refused_or_finite_and_in_range(tmp_path: Path, text: str) -> None:
    from pytest_rlkernel_matrix.judge.read.cellrun import validated
    from pytest_rlkernel_matrix.report.record import read_cell_run
    from pytest_rlkernel_matrix.spec.matrix import PerformanceSection

    (tmp_path / "cell-run.json").write_text(text)
    try:
        meta = read_cell_run(tmp_path)
    except ValueError as exc:
        assert "cell-run.json" in str(exc)
        return
    assert text.count('"mode"') == 1  # a duplicate key never reads
    checked = validated(meta, tmp_path / "cell-run.json")
    assert checked.run["wall_time"] >= 0 and math.isfinite(checked.run["wall_time"])
    pp = checked.performance_policy
    assert pp is not None
    for name, value in pp.model_dump().items():
        if isinstance(value, float):
            assert math.isfinite(value), name
    PerformanceSection.model_validate(pp.model_dump())  # within the matrix file's own ranges
