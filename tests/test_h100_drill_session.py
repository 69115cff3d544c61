"""What the H100 drill session of issue 52 printed against itself, fixed
(docs/examples/h100-perf-drill-ffn-slow-1.5/):

(a) "1 of 10 processes refused for contamination (worst: other processes used 0% of the cell's
    CPUs)": the process was refused because the contamination probe (nvidia-smi) was killed
    (exit -15) by the runner's clean-up of the cell's leftover processes; the refusal line
    showed the CPU share, which decided nothing. Now the probe is no cell's orphan, and the line
    names what decided.
(b) "no statement: one process per cell" while 10 processes ran over 4 cells (3/3/2/1 counted):
    now the reason names the thin cell with the counts per cell and why it is thin.
(c) the early stop says what stage one needed and the budget that would hold it.

Real subprocesses where the bug was one (a fake nvidia-smi on PATH, the real runner); the
report's committed JSON where the text was.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_rlkernel_matrix.report.perf_text import (
    refusal_lines,
    refusals,
    remedy,
    thin_why,
)
from pytest_rlkernel_matrix.run import contamination
from pytest_rlkernel_matrix.run.runner import run_cell_command
from pytest_rlkernel_matrix.spec.limits import Policy

EXAMPLE = (Path(__file__).resolve().parents[1] / "docs" / "examples"
           / "h100-perf-drill-ffn-slow-1.5" / "b-slow-1.5-matrix-report.json")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and subreapers: Linux")
def test_a_contamination_probe_in_flight_is_not_killed_as_the_cells_leftover(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's nvidia-smi runs while the cell's main process exits: the runner's clean-up
    of what the cell left running must not take the probe for the cell's (it did: exit -15)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    # slow enough to be in flight when the cell exits; answers both queries the sampler makes
    smi.write_text(f"#!{sys.executable}\n"
                   "import sys, time\n"
                   "time.sleep(0.8)\n"
                   "q = ' '.join(sys.argv)\n"
                   "print('0, GPU-x, 1980, 0x0' if 'query-gpu' in q else '')\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    root, run_dir = tmp_path / "root", tmp_path / "root" / "run"
    run_dir.mkdir(parents=True)
    policy = Policy(sample_interval=0.05)
    with contamination.watch(root=root, run_dir=run_dir, run_id="r", backend="cuda",
                             env={"CUDA_VISIBLE_DEVICES": "0"}, policy=policy):
        result = run_cell_command([sys.executable, "-c", "import time; time.sleep(0.5)"],
                                  cwd=tmp_path, env=dict(os.environ), timeout=30,
                                  artifact_dir=run_dir, kill_grace=2.0)
    measured = contamination.read_measurement(run_dir)
    assert measured is not None
    assert result.exit_code == 0 and not result.leftover_pids, result
    assert measured["gpu"]["samples"] >= 1, measured
    assert measured["errors"] == [], measured["errors"]
    assert not [r for r in contamination.judge(measured, policy) if "not fully" in r]


def test_a_probe_killed_by_a_signal_says_which(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nkill -TERM $$\n")
    smi.chmod(0o755)
    with pytest.raises(OSError, match=r"exited -15 \(killed by SIGTERM\)"):
        contamination._run([str(smi), "--query-compute-apps=x"])


def _refused(reason: str, share: float | None = 0.0027) -> dict[str, Any]:
    return {"process": 2, "dir": "measured.2", "used": False,
            "reason": f"timings not usable: {reason}", "reasons": [reason],
            "contamination": {"foreign_cpu_share": share}}


SMI = ("contamination not fully measured: cuda process/clock query failed: nvidia-smi "
       "--query-compute-apps=gpu_uuid,pid,used_memory exited -15: ")


def test_the_refusal_line_shows_what_decided_not_the_cpu_share() -> None:
    """(a): refused because the measurement failed: the line says so, not 'used 0% of the
    cell's CPUs' (the share measured meanwhile, under every limit)."""
    records = [{"case": "P/P", "measured": {"runs": [{"process": 1, "used": True},
                                                      _refused(SMI)]}}]
    causes = refusals(records)
    assert list(causes) == ["contamination not measured"], causes
    (line,) = refusal_lines(causes, 10)
    assert line.startswith("1 of 10 processes refused for contamination not measured (worst: "
                           "P/P process 2: cuda process/clock query failed: nvidia-smi"), line
    assert "exited -15" in line and "0% of" not in line and len(line) <= 240
    text = remedy(causes, 3, True, 5.0)
    assert "probe" in text and "no other job" not in text, text


def test_measured_contamination_of_any_kind_shows_its_own_figure() -> None:
    gpu = ("contaminated: 1 other compute process(es) on the cell's GPUs (pids 77; 0 not "
           "visible in this pid namespace; limit 0)")
    cpu = ("contaminated: processes outside the cell used 41% of the 2 CPUs (limit 25%; load "
           "average 3 mean, 3 max)")
    records = [{"case": "R/R", "measured": {"runs": [_refused(gpu, 0.0), _refused(cpu, 0.41)]}},
               {"case": "P/R", "measured": {"runs": [_refused(SMI)]}}]
    causes = refusals(records)
    assert list(causes) == ["contamination", "contamination not measured"]
    lines = refusal_lines(causes, 6)
    assert lines[0].startswith("2 of 6 processes refused for contamination (worst: R/R process "
                               "2: processes outside the cell used 41% of"), lines
    only_gpu = refusal_lines(refusals([{"case": "R/R", "measured": {"runs": [
        _refused(gpu, 0.0)]}}]), 6)
    assert "other compute process" in only_gpu[0] and "0% of" not in only_gpu[0], only_gpu


def _counts(**cells: tuple[int, int, int]) -> dict[str, dict[str, int]]:
    return {c.replace("_", "/"): {"requested": r, "ran": n, "counted": k}
            for c, (r, n, k) in cells.items()}


def test_a_thin_cell_is_named_with_the_counts_per_cell() -> None:
    """(b): 3/3/2/1 processes counted, P/P's second refused and its third not run (the budget
    stopped stage one): not 'one process per cell'."""
    counts = _counts(R_R=(3, 3, 3), P_R=(3, 3, 3), R_P=(3, 2, 2), P_P=(3, 2, 1))
    why = thin_why(counts, 3, True, 5.0)
    assert why.startswith("one process in P/P (processes counted: R/R 3, P/R 3, R/P 2, P/P 1 "
                          "of 3 asked; P/P: 1 refused, 1 not run)"), why
    assert "one process per cell" not in why
    assert "fix the refusal's cause" in why and "--rlk-perf-budget (now 5 min)" in why
    assert "--rlk-processes=auto" not in why
    # one process asked and run everywhere: the old sentence and remedy
    plain = thin_why(_counts(R_R=(1, 1, 1), P_R=(1, 1, 1), R_P=(1, 1, 1), P_P=(1, 1, 1)), 1,
                     False, 10.0)
    assert plain.startswith("one process per cell: the variation between processes is not "
                            "measured; run several processes"), plain
    # fixed N, nothing refused, a cell short of processes: more processes, not 'refused'
    short = thin_why(_counts(R_R=(3, 3, 3), P_R=(3, 3, 3), R_P=(3, 3, 3), P_P=(3, 1, 1)), 3,
                     False, 10.0)
    assert "refused" not in short and "P/P: 2 not run" in short, short


def test_the_committed_h100_report_reads_consistently_when_judged_again() -> None:
    """(b), (d) on the committed H100 session: its records judged again by this code give a
    statement reason that names P/P and the counts, and a refusal line that names the failed
    probe; the per-cell process counts are in the JSON."""
    from pytest_rlkernel_matrix.report.perf import performance

    report = json.loads(EXAMPLE.read_text())
    perf = performance(report["cells"])
    (entry,) = perf["modules"]
    assert entry["processes"] == {
        "R/R": {"requested": 3, "ran": 3, "counted": 3, "refused": 0},
        "P/R": {"requested": 3, "ran": 3, "counted": 3, "refused": 0},
        "R/P": {"requested": 3, "ran": 2, "counted": 2, "refused": 0},
        "P/P": {"requested": 3, "ran": 2, "counted": 1, "refused": 1}}, entry["processes"]
    whys = {s["why"] for s in entry["statements"]}
    assert len(whys) == 1 and next(iter(whys)).startswith("one process in P/P"), whys
    assert "one process per cell" not in (perf["note"] or "") + entry["line"]
    assert ("processes refused for contamination not measured (worst: P/P process 2: cuda "
            "process/clock query failed: nvidia-smi") in entry["line"], entry["line"]
    assert "0% of the cell's CPUs" not in entry["line"]
    assert entry["ran"] == 10


def test_the_early_stop_says_what_stage_one_resolved_and_the_budget_it_needs() -> None:
    """(c): the H100 session's stop, from its records: the processes per cell, what they
    resolve (nothing: the thin cell), and the budget that holds stage one at the measured cost
    (12 x 28.5 s = 5.7 min: 6 min)."""
    from pytest_rlkernel_matrix.report.perf import budget_stop

    cells = json.loads(EXAMPLE.read_text())["cells"]
    text = budget_stop(cells, 3, 5.0, 285.0, 28.5)
    assert text == ("the budget (5 min) did not hold stage 1 (12 processes, 3 per cell, ~28 s "
                    "each: 5.7 min): 10 ran in 285 s (R/R 3, P/R 3, R/P 2, P/P 2); 0 of 8 "
                    "statements resolved (one process in P/P); --rlk-perf-budget=6 would hold "
                    "stage 1"), text
    assert len(text) <= 240


def test_the_early_stop_is_in_the_json_and_the_html_as_in_the_terminal(tmp_path: Path) -> None:
    """(d): the terminal said 'auto stopped early: ...'; the JSON and the HTML did not."""
    from pytest_rlkernel_matrix.report.html import write_html
    from pytest_rlkernel_matrix.report.matrix_report import build_report

    old = json.loads(EXAMPLE.read_text())
    (tmp_path / ".auto").mkdir()
    why = "the budget (5 min) did not hold stage 1 (12 processes ...)"
    (tmp_path / ".auto" / "stop.main.json").write_text(json.dumps({"why": why}))
    report = build_report(old["cells"], matrix=old["matrix"], matrix_root=tmp_path,
                          preflight={}, created=old["created"], expected_cells=4,
                          interrupted=False)
    assert report["performance"]["auto_stop"] == why
    write_html(report, tmp_path / "r.html", {})
    page = (tmp_path / "r.html").read_text()
    assert "auto stopped early: the budget (5 min) did not hold stage 1" in page
    quiet = tmp_path / "quiet"
    quiet.mkdir()
    assert build_report(old["cells"], matrix=old["matrix"], matrix_root=quiet, preflight={},
                        created=old["created"], expected_cells=4,
                        interrupted=False)["performance"]["auto_stop"] is None
