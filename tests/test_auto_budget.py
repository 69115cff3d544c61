"""--rlk-processes=auto in practice (issue 52): under xdist, within the budget, stopping early
with the cause; refusals by cause with a remedy that fits the options; unequal cells.

Through the plugin with the fake framework (vime-style perf lines; `FAKE_JITTER` varies each
step, so processes differ) and on known records.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pytest_rlkernel_matrix.judge.performance.factorial import INCONCLUSIVE, Answer, decide, fit
from pytest_rlkernel_matrix.report.perf_text import (
    cause_of,
    one_process_why,
    refusal_lines,
    refusals,
    remedy,
)
from pytest_rlkernel_matrix.spec.limits import over

STEPS = "0.2,0.2,0.2,0.2,0.2,0.2"


def _root(pytester: pytest.Pytester) -> Path:
    (root,) = list(pytester.path.glob("outputs/rlkernel/*"))
    return root


def _report(pytester: pytest.Pytester) -> dict[str, Any]:
    return json.loads((_root(pytester) / "matrix-report.json").read_text())


def _measured_dirs(root: Path) -> dict[str, int]:
    """Per correctness run directory: how many processes ran (1 + its measured runs)."""
    return {d.name: 1 + len(list(d.glob("measured.*"))) for d in (root / "cpu").iterdir()
            if d.is_dir() and (d / "cell-run.json").exists()}


def test_auto_under_xdist_plans_stage_two_once_from_every_workers_stage_one(
        pytester: pytest.Pytester, make_matrix: Callable[..., Path]) -> None:
    """-n 2: no worker holds the whole 2x2, yet stage two is planned once from both workers'
    stage one (`.auto/plan.json`), every cell gets the plan's processes (each worker its own
    runs), and the controller judges the statements over the whole 2x2."""
    # step noise (uniform +-30%) wide enough that 3 processes per cell leave the null
    # statements inconclusive at +-20%, narrow enough that a few more resolve them
    make_matrix(modules='["ffn"]', env={"FAKE_STEP_TIMES": STEPS, "FAKE_JITTER": "0.3"},
                extra="[performance]\nmax_foreign_cpu = 1.0\nmax_relative_spread = 3.0\n"
                      "equivalence = 0.2\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2",
                                           "--rlk-processes=auto", "--rlk-perf-budget=4")
    out = result.stdout.str()
    assert result.ret == 0, out
    root = _root(pytester)
    plan = json.loads((root / ".auto" / "plan.json").read_text())
    assert plan["workers"] == 2 and plan["records"] == 4, plan  # both workers' stage one
    stages = [json.loads(p.read_text()) for p in (root / ".auto").glob("stage1.*.json")]
    assert sorted(len(s["runs"]) for s in stages) != [0, 4], stages  # spread over workers
    ran = _measured_dirs(root)
    assert len(ran) == 4
    if plan["why"] is None:
        assert plan["target"] > 3, plan  # stage two ran, the same rounds in every cell
        assert set(ran.values()) == {plan["target"]}, ran
    else:  # a busy box may make the plan larger than the budget: said, with the figures
        assert set(ran.values()) == {3}, ran
        assert "auto stopped early" in out, out
    entry = next(m for m in _report(pytester)["performance"]["modules"] if m["module"] == "ffn")
    kinds = {s["kind"] for s in entry["statements"]}
    assert "not judged" not in kinds, entry["line"]
    assert {s["processes"][0] for s in entry["statements"]} == {min(ran.values())}


@pytest.fixture
def cpu_burner() -> Iterator[subprocess.Popen[bytes]]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield procs[0]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_contaminated_auto_session_stops_early_and_says_why(
        pytester: pytest.Pytester, make_matrix: Callable[..., Path],
        cpu_burner: subprocess.Popen[bytes]) -> None:
    """Other processes on the cell's CPUs: stage one's processes are refused for contamination,
    the session stops after stage one (no stage two), and says so with the figure; the reasons
    name contamination first; each refused process's full reason list is in the JSON."""
    make_matrix(modules='["ffn"]', env={"FAKE_STEP_TIMES": STEPS, "FAKE_JITTER": "0.02"},
                extra="[performance]\nmax_foreign_cpu = 0.05\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--rlk-processes=auto",
                                           "--rlk-perf-budget=5")
    out = result.stdout.str()
    assert result.ret == 0, out
    assert "rlk: auto: stopped after stage 1:" in out, out
    # named by cell and process: "... (worst: R/P process 3: processes outside the cell used"
    assert re.search(r"refused for contamination \(worst: [RP]/[RP] process \d+: processes "
                     "outside the cell used", out), out
    assert "no statement is possible on this machine now" in out
    assert "performance: auto stopped early:" in out
    assert set(_measured_dirs(_root(pytester)).values()) == {3}  # no stage two
    report = _report(pytester)
    for cell in report["cells"]:
        for run in cell["measured"]["runs"]:
            if not run["used"]:
                assert run["reasons"] and run["reasons"][0].startswith("contaminated"), run
    assert "--rlk-processes=auto" not in "\n".join(
        line for line in out.splitlines() if "remedy" in line)
    assert "50% > 50%" not in out
    assert max(len(line) for line in out.splitlines()) < 400


def test_the_budget_holds_with_refused_processes(
        pytester: pytest.Pytester, make_matrix: Callable[..., Path]) -> None:
    """A budget smaller than stage one: every process is refused (noise), the correctness runs
    count against the budget, and no process starts that would end past it: the last
    measured process ends within the budget plus about one process."""
    make_matrix(modules='["ffn"]', env={"FAKE_STEP_TIMES": "0.2,0.9,0.2,1.5,0.2,0.2"},
                extra="[performance]\nmax_foreign_cpu = 1.0\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--rlk-processes=auto",
                                           "--rlk-perf-budget=0.2")
    out = result.stdout.str()
    assert result.ret == 0, out
    root = _root(pytester)
    windows, first = [], None
    for meta_path in root.glob("cpu/*/**/cell-run.json"):
        meta = json.loads(meta_path.read_text())
        windows.append(meta["window"])
    start = min(w[0] for w in windows)
    longest = max(w[1] - w[0] for w in windows)
    end = max(w[1] for w in windows)
    # the session began before the first cell started: budget + one process from there
    assert end - start <= 0.2 * 60 + 2 * longest, (end - start, longest)
    assert "did not hold stage 1" in out or "auto stopped early" in out, out
    assert "refused for noise" in out, out
    del first


# -- the terminal's reasons and remedies (no processes) --------------------------------------

def _run(reasons: list[str], share: float | None = None) -> dict[str, Any]:
    return {"used": False, "reason": "timings not usable: " + "; ".join(reasons[:2]),
            "reasons": reasons,
            "contamination": None if share is None else {"foreign_cpu_share": share}}


def test_refusals_count_by_cause_in_order_of_cause_with_the_worst_figure() -> None:
    noisy = "noise: rollout time spread (max-min)/median 720% > 50% (n=5, 0.2-1.8 s)"
    dirty = ("contaminated: processes outside the cell used {}% of the 2 CPUs (limit 25%; "
             "load average 3 mean, 3 max)")
    records = [{"measured": {"runs": [
        _run([noisy]), _run([dirty.format(41), noisy], 0.41),
        _run([dirty.format(55)], 0.55), {"used": True}]}}]
    causes = refusals(records)
    assert list(causes) == ["contamination", "noise"]  # contamination first
    assert causes["contamination"]["count"] == 2 and causes["noise"]["count"] == 1
    lines = refusal_lines(causes, 4)
    assert lines[0].startswith("2 of 4 processes refused for contamination (worst: processes "
                               "outside the cell used 55% of"), lines
    assert lines[1].startswith("1 of 4 processes refused for noise (worst: rollout time "
                               "spread (max-min)/median 720%"), lines
    assert all(len(line) <= 160 for line in lines)
    assert cause_of(["contaminated: x", "noise: y"], None) == "contamination"


@pytest.mark.parametrize("processes,auto", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("causes", [["contamination"], ["noise"], ["duplicate"],
                                    ["contamination", "noise"], []])
def test_the_remedy_fits_what_was_passed(processes: int, auto: bool,
                                         causes: list[str]) -> None:
    text = remedy(causes, processes, auto, 5.0)
    assert text.startswith("remedy: ")
    if auto:  # never suggest what was passed
        assert "--rlk-processes=auto" not in text and "--rlk-perf-budget (now 5 min)" in text
    else:
        assert f"--rlk-processes={max(3, 2 * processes)} or --rlk-processes=auto" in text
    assert ("quiet" in text or "no other job" in text) == bool(
        {"contamination", "noise"} & set(causes))
    why = one_process_why(processes, auto, 5.0)
    assert ("--rlk-processes=auto" in why) == (not auto)
    assert ("refused" in why) == (processes > 1 or auto)


def test_figures_against_limits_never_read_equal() -> None:
    assert over(0.504, 0.5) == ("50.4%", "50.0%")
    assert over(0.55, 0.25) == ("55%", "25%")
    assert over(0.5004, 0.5)[0] != over(0.5004, 0.5)[1]


# -- unequal cells --------------------------------------------------------------------------

def test_a_thin_noisy_cell_makes_the_statement_inconclusive_not_wrong() -> None:
    """Two cells of 2 noisy processes with a 10x first step, two of 8 quiet ones, no true
    effect: the per-cell variances and the thinnest cell's degrees of freedom leave every
    statement inconclusive over many seeds, where pooling claimed differences."""
    rng = np.random.default_rng(7)
    false = 0
    for _ in range(200):
        groups: dict[str, list[list[float]]] = {}
        for case, (n, sd, warm) in zip(("R/R", "P/R", "R/P", "P/P"),
                                       ((2, 0.10, 10.0), (2, 0.10, 10.0), (8, 0.02, 1.0),
                                        (8, 0.02, 1.0)), strict=True):
            procs = []
            for _ in range(n):
                steps = 0.5 * np.exp(rng.normal(0, 0.04) + rng.normal(0, sd, 6))
                steps[0] *= warm
                procs.append(list(steps))
            groups[case] = procs
        f = fit(groups)
        assert not f.pooled and f.effects["rollout"].df == 1.0
        answers = [Answer(("cpu", "ffn", side, "rollout"), f.effects[side])
                   for side in ("training", "rollout")]
        decide(answers, 0.95, 0.05)
        false += sum(a.kind != INCONCLUSIVE for a in answers)
    assert false <= 10  # at most 5% of 200 reports


def test_balanced_equal_cells_still_pool() -> None:
    rng = np.random.default_rng(3)
    groups = {c: [list(0.5 * np.exp(rng.normal(0, 0.02, 6))) for _ in range(3)]
              for c in ("R/R", "P/R", "R/P", "P/P")}
    f = fit(groups)
    assert f.pooled and f.effects["training"].df == 8.0
