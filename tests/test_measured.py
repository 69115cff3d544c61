"""Measured processes per cell and the performance statements they support (issue 33).

Through the plugin with the fake framework (a vime-style job: perf lines only) carrying a planted
slowdown (`FAKE_SLOW=ffn:rollout:1.5`: the rollout phase takes 1.5 times as long wherever ffn
runs R on the rollout side) and real between-process variation (`FAKE_JITTER`); the statements'
rule and its multiple-comparison control on known records.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_rlkernel_matrix.report.attribution import comparisons
from pytest_rlkernel_matrix.report.perf import performance
from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

STEPS = "0.2,0.2,0.2,0.2,0.2,0.2"
# The shared 2-core box: other people's jobs are not what these tests are about.
QUIET = "[performance]\nmax_foreign_cpu = 1.0\n"


def _report(pytester: pytest.Pytester) -> dict[str, Any]:
    (found,) = list(pytester.path.glob("outputs/rlkernel/*/matrix-report.json"))
    return json.loads(found.read_text())


def _statements(report: dict[str, Any], module: str) -> dict[tuple[str, str], dict[str, Any]]:
    entry = next(m for m in report["performance"]["modules"] if m["module"] == module)
    return {(s["side"], s["phase"]): s for s in entry["statements"]}


def test_planted_rollout_slowdown_is_named_with_its_side_phase_and_interval(
        pytester: pytest.Pytester, make_matrix: Callable[..., Path]) -> None:
    make_matrix(modules='["ffn"]', extra=QUIET,
                env={"FAKE_STEP_TIMES": STEPS, "FAKE_SLOW": "ffn:rollout:1.5",
                     "FAKE_JITTER": "0.03"})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--rlk-processes=3")
    assert result.ret == 0, result.stdout.str()
    report = _report(pytester)
    perf = report["performance"]
    assert perf["processes"] == [3] and perf["family"] == 8  # 2 sides x 4 phases
    assert perf["family_confidence"] == pytest.approx(0.95) and perf["equivalence"] == 0.05
    said = _statements(report, "ffn")
    rollout = said[("rollout", "rollout_wall_time")]
    assert rollout["kind"] == "slower", rollout
    assert rollout["low"] > 1.0 and rollout["low"] <= 1.5 <= rollout["high"], rollout
    # kept steady steps per cell: MSER keeps at least half of each process's 6 measured steps
    assert rollout["processes"] == [3, 3, 3, 3] and all(9 <= n <= 18 for n in rollout["n"])
    assert rollout["text"].startswith("R on the rollout side: rollout phase slower, ")
    # The rows without the drill claim nothing beyond noise: no slower/faster anywhere else
    # but the step time the slower rollout phase is part of.
    others = {k: s["kind"] for k, s in said.items()
              if k not in {("rollout", "rollout_wall_time"), ("rollout", "step_wall_time")}}
    assert set(others.values()) <= {"no difference", "inconclusive"}, others
    # The terminal: a line per module, then the same sentence per side and phase.
    at = next(i for i, x in enumerate(result.outlines) if x.startswith("cpu ffn performance "))
    assert "95% family-wise over 8 statements, closed testing" in result.outlines[at]
    assert f"  {rollout['text']}" in result.outlines[at + 1:at + 9]
    assert all(x.startswith("  R on the ") for x in result.outlines[at + 1:at + 9])
    assert perf["note"] is None and "performance: no statement" not in result.stdout.str()
    # The HTML: per module, each cell's phase times with their intervals.
    rr = next(m for m in perf["modules"] if m["module"] == "ffn")["cells"]["R/R"]
    assert rr["rollout_wall_time"]["processes"] == 3
    assert rr["rollout_wall_time"]["low"] <= rr["rollout_wall_time"]["median"] \
        <= rr["rollout_wall_time"]["high"]
    html = next(pytester.path.glob("outputs/rlkernel/*/matrix-report.html")).read_text()
    assert "Steady-state phase times per cell" in html
    assert rollout["text"] in html.replace("&#177;", "±")

    # Interleaved: R/R, P/R, R/P, P/P, then again, and again; each its own directory and run id.
    root = next(pytester.path.glob("outputs/rlkernel/*"))
    windows = []
    for meta_path in root.glob("cpu/*/**/cell-run.json"):
        meta = json.loads(meta_path.read_text())
        windows.append((meta["window"][0], meta["cell"]["case"], meta["run_id"]))
    order = [case for _, case, _ in sorted(windows)]
    assert order == ["R/R", "P/R", "R/P", "P/P"] * 3, order
    assert len({rid for _, _, rid in windows}) == 12
    env = (root / "cpu" / "ffn-rp" / "measured.3" / "matrix-case.env").read_text()
    assert "RLK_MATRIX_RUN_ROLE=measured" in env and "RLK_MATRIX_PROCESS=3" in env
    cell = next(c for c in report["cells"] if c["case"] == "R/P")
    assert [r["dir"] for r in cell["measured"]["runs"]] == [".", "measured.2", "measured.3"]
    assert cell["measured"]["used"] == 3
    assert len(cell["phase_spread"]["rollout_wall_time"]["processes"]) == 3


def test_under_xdist_each_worker_interleaves_its_own_cells(
        pytester: pytest.Pytester, make_matrix: Callable[..., Path]) -> None:
    # jitter: each process its own timings (identical timings would be one process, refused)
    make_matrix(modules='["ffn"]', extra=QUIET, env={"FAKE_STEP_TIMES": STEPS,
                                                       "FAKE_JITTER": "0.02"})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2",
                                           "--rlk-processes=2")
    assert result.ret == 0, result.stdout.str()
    root = next(pytester.path.glob("outputs/rlkernel/*"))
    by_worker: dict[str, list[tuple[float, str, str]]] = {}
    for meta_path in root.glob("cpu/*/**/cell-run.json"):
        meta = json.loads(meta_path.read_text())
        by_worker.setdefault(meta["worker"], []).append(
            (meta["window"][0], meta["cell"]["case"], meta_path.parent.name))
    assert len(by_worker) == 2, by_worker
    for runs in by_worker.values():
        order = [case for _, case, _ in sorted(runs)]
        half = len(order) // 2
        assert half and order[:half] == order[half:], order  # round 1, then round 2 alike
        assert all(not d.startswith("measured.") for _, _, d in sorted(runs)[:half])
    # the controller's report has every cell's measured runs (they ran after the items reported)
    for cell in _report(pytester)["cells"]:
        assert cell["measured"]["used"] == 2, cell["measured"]
        assert len(cell["phase_spread"]["step_wall_time"]["processes"]) == 2


def test_one_process_per_cell_says_how_to_get_a_conclusion(
        pytester: pytest.Pytester, make_matrix: Callable[..., Path]) -> None:
    make_matrix(modules='["ffn"]', extra=QUIET, env={"FAKE_STEP_TIMES": STEPS})
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == 0
    text = result.stdout.str()
    # The reason every statement shares and its remedy: once for the report, never per side
    # and phase; the module's point figures on one line; never "over 0 statements".
    note = ("performance: no statement: one process per cell (the variation between processes "
            "is not measured); run --rlk-processes=3 (or [performance] processes = 3 in "
            "matrix.toml) or --rlk-processes=auto")
    timings_unusable = "performance: no statement: R/R timings not usable" in text
    if not timings_unusable:  # the shared box too noisy: that reason once instead
        assert text.count(note) == 1, text
        (line,) = [x for x in result.outlines if x.startswith("cpu ffn performance (")]
        assert "point figures, no interval): training side rollout " in line, line
        assert "; rollout side rollout " in line and "step " in line, line
    assert text.count("--rlk-processes=3") == 1 and text.count("one process per cell") <= 2
    assert "over 0 statements" not in text and "inconclusive" not in text, text
    assert "R on the training side" not in text, text  # no per-statement sentence
    report = _report(pytester)
    said = _statements(report, "ffn")  # the JSON keeps every statement and its sentence
    assert len(said) == 8 and all(s["text"].startswith("R on the ") for s in said.values())
    if not timings_unusable:
        assert all(s["text"].endswith("or --rlk-processes=auto") for s in said.values())
        assert report["performance"]["note"] == note
    html = next(pytester.path.glob("outputs/rlkernel/*/matrix-report.html")).read_text()
    assert "over 0 statements" not in html and "0 statements" not in html
    assert html.count("--rlk-processes=auto") <= 1
    root = next(pytester.path.glob("outputs/rlkernel/*"))
    assert not list(root.glob("cpu/*/measured.*"))
    assert "measured" not in _report(pytester)["cells"][0]


def test_a_measured_run_that_falls_back_is_dropped_with_its_reason(
        pytester: pytest.Pytester, make_matrix: Callable[..., Path]) -> None:
    """The measured runs of R/R fall back (attention's rollout R to production): their timings
    are not R's, so they are dropped; the correctness run is judged as before."""
    make_matrix(modules='["attention"]', extra='cases = ["R/R", "P/P"]\n' + QUIET,
                env={"FAKE_STEP_TIMES": STEPS, "FAKE_MEASURED_SCENARIO": "recorded_fallback",
                     "FAKE_ONLY_WHEN": "A-RR_F-RR_L-RR", "FAKE_JITTER": "0.02"})
    result = pytester.runpytest("-p", "no:cacheprovider", "--rlk-processes=2")
    assert result.ret == 0, result.stdout.str()
    cells = {c["case"]: c for c in _report(pytester)["cells"]}
    rr, pp = cells["R/R"], cells["P/P"]
    assert rr["verdict"] == "valid"
    (dropped,) = [r for r in rr["measured"]["runs"] if not r["used"]]
    assert dropped["dir"] == "measured.2" and dropped["reason"].startswith("fell back: "), dropped
    assert rr["measured"]["used"] == 1 and pp["measured"]["used"] == 2
    assert len(rr["phase_spread"]["step_wall_time"]["processes"]) == 1
    assert any("process 2 (measured.2) not counted: fell back" in r
               for r in rr["validity"]["performance"]["reasons"])


def test_reanalysis_reads_the_measured_runs_and_the_cache_keys_on_them(
        pytester: pytest.Pytester, make_matrix: Callable[..., Path]) -> None:
    from pytest_rlkernel_matrix.report.reanalyze import reanalyze

    make_matrix(modules='["logp"]', extra='cases = ["R/R", "P/P"]\n' + QUIET,
                env={"FAKE_STEP_TIMES": STEPS})
    assert pytester.runpytest("-p", "no:cacheprovider", "--rlk-processes=2").ret == 0
    root = next(pytester.path.glob("outputs/rlkernel/*"))
    session = {c["case"]: c for c in _report(pytester)["cells"]}
    lines: list[str] = []
    again = json.loads(reanalyze(root, log=lines.append, progress=False, jobs=1).read_text())
    cells = {c["case"]: c for c in again["cells"]}
    for case in ("R/R", "P/P"):
        # the fake prints the same timings in every process: a copy, not a second process
        assert cells[case]["measured"]["used"] == 1
        (dup,) = [r for r in cells[case]["measured"]["runs"] if not r["used"]]
        assert dup["reason"].startswith("duplicate of .: the same step timings"), dup
        assert cells[case]["measured"]["dropped_runs"] == [f"measured.2: {dup['reason']}"]
        assert cells[case]["phase_spread"] == session[case]["phase_spread"]
    # a measured run's log changes: that cell is read again, and the new times count
    log = root / "cpu" / "logp-pp" / "measured.2" / "run.log"
    log.write_text(log.read_text().replace("'perf/step_time': 0.2", "'perf/step_time': 0.4"))
    lines.clear()
    again = json.loads(reanalyze(root, log=lines.append, progress=False, jobs=1).read_text())
    assert "cache: cpu/logp-pp: read again: measured.2/run.log changed (sha256)" in lines[0] \
        or any("measured.2/run.log changed" in x for x in lines), lines
    pp = next(c for c in again["cells"] if c["case"] == "P/P")
    assert pp["measured"]["used"] == 2  # its own timings now: a process of its own
    assert pp["phase_spread"]["step_wall_time"]["processes"][1] == [0.4] * 6


# -- the rule and its multiple-comparison control on known records -------------------------------


def _record(case: str, module: str, rollout: list[list[float]],
            training: list[list[float]]) -> dict[str, Any]:
    def spread(groups: list[list[float]]) -> dict[str, Any]:
        return {"steps": [v for g in groups for v in g], "processes": groups}

    step = [[r + t for r, t in zip(rg, tg, strict=True)]
            for rg, tg in zip(rollout, training, strict=True)]
    return {"hardware": "cpu", "module": module, "case": case, "verdict": "valid",
            "performance_usable": True,
            "performance_policy": {"processes": len(rollout)},
            "phase_spread": {"rollout_wall_time": spread(rollout),
                             "training_wall_time": spread(training),
                             "step_wall_time": spread(step)}}


def _procs(base: float, n: int = 3, steps: int = 6) -> list[list[float]]:
    return [[base * (1 + 0.01 * ((i * 7 + j * 3) % 5 - 2)) for j in range(steps)]
            for i in range(n)]


def _module(module: str, rollout_effect: float) -> list[dict[str, Any]]:
    """A module's four cells: R on the rollout side multiplies the rollout phase."""
    fast, slow = _procs(1.0), _procs(rollout_effect)
    train = _procs(2.0)
    return [_record("R/R", module, slow, train), _record("P/R", module, slow, train),
            _record("R/P", module, fast, train), _record("P/P", module, fast, train)]


def test_statements_name_side_phase_and_size_and_bound_the_null() -> None:
    records = _module("ffn", 1.5)
    perf = performance(records)
    said = {(s["side"], s["phase"]): s for s in perf["modules"][0]["statements"]}
    assert perf["family"] == comparisons(records) == 6  # no weight-sync times
    slow = said[("rollout", "rollout_wall_time")]
    assert slow["kind"] == "slower" and slow["low"] > 1
    assert slow["text"].startswith("R on the rollout side: rollout phase slower, 1.50x [")
    null = said[("training", "training_wall_time")]
    assert null["kind"] == "no difference" and 1 / 1.05 <= null["low"] <= 1 <= null["high"] <= 1.05
    assert null["text"].startswith("R on the training side: training phase: no difference "
                                   "within ±5% (1.00x [")


def test_more_comparisons_widen_every_interval() -> None:
    """Closed testing over the report: the same cells among 18 statements get a wider interval
    than among 6 (never a narrower one); each statement's level is in the JSON."""
    one = _module("ffn", 1.03)
    many = one + _module("attention", 1.0) + _module("logp", 1.0)
    assert comparisons(many) == 18
    assert performance(one)["family"] == 6 and performance(many)["family"] == 18
    a = {(s["side"], s["phase"]): s for s in performance(one)["modules"][0]["statements"]}
    b = {(s["side"], s["phase"]): s for s in performance(many)["modules"][1]["statements"]}
    key = ("rollout", "rollout_wall_time")
    assert b[key]["low"] <= a[key]["low"] and b[key]["high"] >= a[key]["high"]
    assert a[key]["ratio"] == b[key]["ratio"]
    assert 1 - 0.05 / 6 <= a[key]["level"] < b[key]["level"] <= 1 - 0.05 / 18 + 1e-12


def test_contaminated_or_single_process_cells_state_nothing() -> None:
    records = _module("ffn", 1.5)
    records[2]["performance_usable"] = False
    records[2]["validity"] = {"performance": {"reasons": ["contaminated: a burner"]}}
    said = {(s["side"], s["phase"]): s for s in performance(records)["modules"][0]["statements"]}
    assert said[("rollout", "rollout_wall_time")]["kind"] == "not judged"
    single = [dict(r, performance_policy={"processes": 1},
                   phase_spread={k: {"steps": v["steps"][:6]} for k, v in
                                    r["phase_spread"].items()}) for r in _module("ffn", 1.5)]
    perf = performance(single)
    line = perf["modules"][0]["line"]
    # one line: the point figures; the reason and its remedy once, in the report's note
    assert line == ("cpu ffn performance (time with R / time with P; below 1: R takes less "
                    "time; point figures, no interval): training side rollout 1.00x, training "
                    "1.00x, step 1.00x; rollout side rollout 1.50x, training 1.00x, step 1.17x")
    assert perf["note"].startswith("performance: no statement: one process per cell (")
    assert perf["note"].count("--rlk-processes") == 2  # =3 and =auto, said once
    said = perf["modules"][0]["statements"]  # the statements' sentences are unchanged
    assert "R on the rollout side: rollout phase inconclusive, 1.50x: one process per cell: " \
        "the variation between processes is not measured; run several processes per cell: " \
        "--rlk-processes=3" in [s["text"] for s in said][1]


def test_a_phase_timed_at_zero_is_not_judged_and_the_rest_is() -> None:
    records = _module("ffn", 1.5)
    for r in records:
        zero = [[0.0] * 6 for _ in range(3)]
        r["phase_spread"]["weight_sync_wall_time"] = {"steps": [0.0] * 18, "processes": zero}
    said = {(s["side"], s["phase"]): s for s in performance(records)["modules"][0]["statements"]}
    assert said[("rollout", "weight_sync_wall_time")]["text"] == (
        "R on the rollout side: weight sync phase not judged (weight sync times not all "
        "positive)")
    assert said[("rollout", "rollout_wall_time")]["kind"] == "slower"


def test_measured_cells_whose_runs_were_all_dropped_say_why_not_how() -> None:
    """Three processes asked for, none counted (noise): the line gives the reason, never the
    advice to run several processes."""
    records = []
    for r in _module("ffn", 1.5):
        one = {k: {"steps": v["steps"][:6]} for k, v in r["phase_spread"].items()}
        records.append(dict(r, phase_spread=one, performance_usable=False,
                            measured={"requested": 3, "ran": 3, "used": 0},
                            validity={"performance": {"reasons": [
                                "process 2 (measured.2) not counted: timings not usable: noise"]}}))
    line = performance(records)["modules"][0]["line"]
    assert "--rlk-processes" not in line and "one process per cell" not in line, line
    assert "not counted: timings not usable: noise" in line, line


def test_min_processes_below_two_is_refused_with_the_way_to_supply_processes(
        tmp_path: Path) -> None:
    path = tmp_path / "matrix.toml"
    base = ('[matrix]\nname = "t"\n[runner]\ncommand = "true"\n'
            '[hardware.cpu]\nbackend = "cpu"\n')
    path.write_text(base + "[performance]\nmin_processes = 1\n")
    with pytest.raises(MatrixFileError) as err:
        load_matrix(path)
    assert "processes = 3" in str(err.value) and "--rlk-processes=3" in str(err.value)
    path.write_text(base + "[performance]\nprocesses = 0\n")
    with pytest.raises(MatrixFileError):
        load_matrix(path)
    path.write_text(base + "[performance]\nprocesses = 4\n")
    assert load_matrix(path).performance.processes == 4


def test_the_docs_vime_example_gives_enough_steps() -> None:
    """docs/en/cuda-h100.md's vime example must not declare fewer steps than min_steps."""
    for lang in ("en", "zh"):
        text = (Path(__file__).parents[1] / "docs" / lang / "cuda-h100.md").read_text()
        for line in text.splitlines():
            if line.strip().startswith("repeats ="):
                assert int(line.split("=")[1].split("#")[0]) >= 5, (lang, line)
    assert os.sep  # (the docs exist in both languages)


def test_a_measured_run_whose_route_changed_or_failed_is_dropped() -> None:
    from pytest_rlkernel_matrix.report.measured import drop_reason

    def rec(impl: str = "rl_kernel", **extra: Any) -> dict[str, Any]:
        route = {"implementation": impl, "backend_ids": [f"{impl}.ffn"], "fallback": False}
        return {"verdict": "valid", "exit_code": 0, "fallbacks": [], "reasons": [],
                "routes": {"ffn": {"requested": "R/R", "training": dict(route),
                                   "rollout": dict(route)}},
                "validity": {"performance": {"valid": True, "reasons": []}}, **extra}

    first = rec()
    assert drop_reason(first, rec()) is None
    changed = rec()
    changed["routes"]["ffn"]["rollout"] = {"implementation": "production",
                                           "backend_ids": ["vllm.production.ffn"],
                                           "fallback": False}
    assert drop_reason(first, changed) == ("route changed: ffn rollout rl_kernel rl_kernel.ffn "
                                           "-> production vllm.production.ffn")
    assert drop_reason(first, rec(exit_code=1, verdict="error",
                                  reasons=["exit code 1"])) == "error: exit code 1"
    assert drop_reason(first, rec(timed_out=True)) == "timed out"
    noisy = rec(validity={"performance": {"valid": False, "reasons": ["noise: spread 80%"]}})
    assert drop_reason(first, noisy) == "timings not usable: noise: spread 80%"


def test_a_byte_copied_measured_run_is_refused_and_named(
        pytester: pytest.Pytester, make_matrix: Callable[..., Path]) -> None:
    """A measured-run directory that is a byte copy of the correctness run (same run id, same
    run.log) is one process, not two: refused with the reason, counted and named as dropped in
    the record and the report; the module's statements say it."""
    import shutil

    from pytest_rlkernel_matrix.report.reanalyze import reanalyze

    make_matrix(modules='["logp"]', extra=QUIET,
                env={"FAKE_STEP_TIMES": STEPS, "FAKE_JITTER": "0.02"})
    assert pytester.runpytest("-p", "no:cacheprovider", "--rlk-processes=2").ret == 0
    root = next(pytester.path.glob("outputs/rlkernel/*"))
    run = root / "cpu" / "logp-rr"
    shutil.copytree(run, run / "measured.3", ignore=shutil.ignore_patterns("measured.*"))
    report = json.loads(reanalyze(root, log=lambda _: None, progress=False, jobs=1).read_text())
    rr = next(c for c in report["cells"] if c["case"] == "R/R")
    runs = {r["dir"]: r for r in rr["measured"]["runs"]}
    assert runs["measured.2"]["used"] is True
    assert runs["measured.3"]["used"] is False
    assert runs["measured.3"]["reason"].startswith("duplicate of .: the same run id"), runs
    assert rr["measured"]["used"] == 2 and rr["measured"]["dropped"] == 1
    assert len(rr["phase_spread"]["step_wall_time"]["processes"]) == 2
    entry = next(m for m in report["performance"]["modules"] if m["module"] == "logp")
    assert any(d.startswith("R/R process 3 (measured.3): duplicate of .") for d in
               entry["dropped"]), entry["dropped"]
    # the terminal counts refusals by cause, with the worst figure, and a remedy
    assert ("1 of 9 processes refused for duplicate (worst: R/R process 3: duplicate of .: "
            "the same run id") \
        in entry["line"], entry["line"]
    assert "remedy: fix what the refused processes' reasons name" in entry["line"]
    assert "--rlk-processes=4 or --rlk-processes=auto" in entry["line"]


def test_a_drill_report_says_so_at_the_top(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_rlkernel_matrix.report.html import render_html
    from pytest_rlkernel_matrix.report.matrix_report import build_report

    records = _module("ffn", 1.5)
    records[0]["fault_drill"] = {"kind": "slow", "module": "ffn", "side": "rollout",
                                 "factor": 1.5, "applied": True}
    monkeypatch.setenv("RLK_REF_FAULT", "slow:ffn:rollout:1.5")
    report = build_report(records, matrix={"name": "t"}, matrix_root=Path("/nonexistent"),
                          preflight=None, created="now", expected_cells=4, interrupted=False)
    assert next(iter(report)) == "schema_version" and list(report)[1] == "drill"
    text = report["drill"]["text"]
    assert text.startswith("FAULT DRILL: RLK_REF_FAULT=slow:ffn:rollout:1.5; applied in 1 cell")
    assert report["performance"]["modules"][0]["line"].startswith(f"[{text}]")
    html = render_html(report)
    assert html.index("FAULT DRILL") < html.index("<h1>")
    monkeypatch.delenv("RLK_REF_FAULT")
    for r in records:
        r.pop("fault_drill", None)
    clean = build_report(records, matrix={"name": "t"}, matrix_root=Path("/nonexistent"),
                         preflight=None, created="now", expected_cells=4, interrupted=False)
    assert clean["drill"] is None and "FAULT DRILL" not in render_html(clean)


def test_auto_processes_run_a_first_stage_and_find_the_planted_slowdown(
        pytester: pytest.Pytester, make_matrix: Callable[..., Path]) -> None:
    """--rlk-processes=auto: stage one (3 processes per cell, interleaved) with progress; the
    planted rollout slowdown is found; stage two runs only what the plans ask within the
    budget."""
    make_matrix(modules='["ffn"]', extra=QUIET,
                env={"FAKE_STEP_TIMES": STEPS, "FAKE_SLOW": "ffn:rollout:1.5",
                     "FAKE_JITTER": "0.03"})
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--rlk-processes=auto",
                                           "--rlk-perf-budget=5")
    assert result.ret == 0, result.stdout.str()
    out = result.stdout.str()
    assert "rlk: auto stage 1: process 3 of 3 per cell (4 cells)" in out, out
    assert "rlk: auto:" in out
    said = _statements(_report(pytester), "ffn")
    rollout = said[("rollout", "rollout_wall_time")]
    assert rollout["kind"] == "slower" and rollout["low"] > 1.0, rollout
    # the same processes in every cell: stage one's 3, or what stage two's plan asked
    assert len(set(rollout["processes"])) == 1 and rollout["processes"][0] >= 3
    assert said[("training", "training_wall_time")]["kind"] in ("no difference", "inconclusive")


def test_auto_target_follows_the_plan_within_the_budget() -> None:
    from pytest_rlkernel_matrix.session.scheduler import auto_target

    records = _module("ffn", 1.0)
    target, said = auto_target(records, 3, round_s=10.0, left_s=1e6)
    assert len(said) == 6 and target >= 3
    # what the statements ask for is what stage two runs when it fits in the budget; a plan
    # that does not fit stops the session after stage one (auto_plan says why)
    from pytest_rlkernel_matrix.session.scheduler import auto_plan

    assert auto_target(records, 3, round_s=10.0, left_s=25.0)[0] in (3, 4, 5)
    assert auto_target(records, 3, round_s=10.0, left_s=0.0)[0] == 3
    if target > 3:
        why = auto_plan(records, 3, round_s=10.0, left_s=0.0)[2]
        assert why is not None and "fits 3" in why, why


def test_processes_option_takes_a_number_or_auto(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.session.scheduler import performance_options

    path = tmp_path / "matrix.toml"
    path.write_text('[matrix]\nname = "t"\n[runner]\ncommand = "true"\n'
                    '[hardware.cpu]\nbackend = "cpu"\n')
    matrix = load_matrix(path)
    auto = performance_options(matrix, "auto", 7).performance
    assert auto.auto and auto.processes == 3 and auto.budget == 7
    assert performance_options(matrix, "4", None).performance.processes == 4
    for bad in ("0", "many", "65"):
        with pytest.raises(pytest.UsageError, match="--rlk-processes"):
            performance_options(matrix, bad, None)
    with pytest.raises(pytest.UsageError, match="--rlk-perf-budget"):
        performance_options(matrix, "auto", 0)
    path.write_text(path.read_text() + "[performance]\nequivalence = 0\n")
    with pytest.raises(MatrixFileError, match=r"(?s)matrix\.toml: .*performance\.equivalence"):
        load_matrix(path)


def test_a_reason_every_module_shares_is_said_once_for_the_report() -> None:
    """One process per cell in three modules: the remedy once; each module one compact line;
    R/R's timings not usable (R/R is every module's baseline): that reason once too."""
    def single(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [dict(r, phase_spread={k: {"steps": v["steps"][:6]} for k, v in
                                      r["phase_spread"].items()}) for r in records]

    records = single(_module("ffn", 1.5) + _module("attention", 1.0) + _module("logp", 1.0))
    perf = performance(records)
    lines = [perf["note"], *(m["line"] for m in perf["modules"])]
    text = "\n".join(lines)
    assert len(text.splitlines()) == 4 and perf["family"] == 0
    assert text.count("one process per cell") == 1 and text.count("--rlk-processes=auto") == 1
    assert "over 0 statements" not in text and "inconclusive" not in text
    assert [x.split(" (")[0] for x in lines[1:]] == [
        "cpu attention performance", "cpu ffn performance", "cpu logp performance"]
    assert "rollout side rollout 1.50x" in lines[2]
    # the attribution's timing part: the reason without the remedy, then the figures
    from pytest_rlkernel_matrix.report.perf import attribute_said

    for entry in attribute_said(records):
        assert "timings: no statement (one process per cell): training side " in \
            entry["conclusion"] and "--rlk-processes" not in entry["conclusion"], entry

    for r in records:
        if r["case"] == "R/R":
            r.update(performance_usable=False,
                     validity={"performance": {"reasons": ["noise: step spread 173% > 50%"]}})
    perf = performance(records)
    assert perf["note"] == ("performance: no statement: R/R timings not usable: noise: step "
                            "spread 173% > 50%")
    assert [m["line"] for m in perf["modules"]] == [
        f"cpu {m} performance: no statement" for m in ("attention", "ffn", "logp")]
    # the HTML: the reason once, no table of rows that all say it, no "0 statements"
    from pytest_rlkernel_matrix.report.html import render_html

    html = render_html({"performance": perf, "cells": records})
    assert html.count("R/R timings not usable: noise") == 1 and "0 statements" not in html
