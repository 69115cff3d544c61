"""One account of a cell's time (issue 53): the phase columns and the step are one step's (the
median one), so rollout + training + weight sync + unattributed = step by construction, in the
record and in every place that shows it (terminal table, HTML)."""

from __future__ import annotations

from pathlib import Path

from cellkit import CellKit

from pytest_rlkernel_matrix.judge.performance.phases import pooled_account, step_account
from pytest_rlkernel_matrix.judge.read.logscan import scan_log
from pytest_rlkernel_matrix.report.html import render_html
from pytest_rlkernel_matrix.report.matrix_report import table

# Steps whose per-column medians do not add up: rollout median 2.0, training median 1.2,
# sync 0.1, step median 5.0 (3.3 of phases against 5.0).
STEPS = [(0, 9.0, 5.0, 3.0, 0.5),  # warm-up, dropped
         (1, 2.0, 1.2, 0.1, 3.4), (2, 2.1, 1.0, 0.1, 5.0), (3, 1.9, 1.3, 0.1, 6.1),
         (4, 4.0, 1.5, 0.1, 5.9)]


def _log(path: Path) -> Path:
    lines = []
    for step, roll, train, sync, total in STEPS:
        lines.append(f"perf {step}: {{'perf/rollout_time': {roll}}}")
        lines.append(f"perf {step}: {{'perf/step_time': {total}, 'perf/train_time': {train}, "
                     f"'perf/update_weights_time': {sync}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_columns_are_the_median_steps_and_add_up(tmp_path: Path) -> None:
    acc = step_account(scan_log(_log(tmp_path / "run.log")), warmup=1)
    assert acc is not None
    # the measured steps' step times 3.4, 5.0, 6.1, 5.9: the (lower) median is 5.0, step 2
    assert acc["step_account"]["step"] == 2 and acc["step_account"]["n"] == 4
    assert acc["step_wall_time"] == 5.0
    assert (acc["rollout_wall_time"], acc["training_wall_time"],
            acc["weight_sync_wall_time"]) == (2.1, 1.0, 0.1)
    parts = (acc["rollout_wall_time"] + acc["training_wall_time"]
             + acc["weight_sync_wall_time"] + acc["unattributed_wall_time"])
    assert abs(parts - acc["step_wall_time"]) < 1e-6
    assert abs(acc["unattributed_share"] - 1.8 / 5.0) < 1e-6


def test_pooled_processes_add_up_too() -> None:
    groups = {"rollout_wall_time": [[1.0, 2.0], [1.5]], "training_wall_time": [[1.0, 1.0], [2.0]],
              "weight_sync_wall_time": [[0.1, 0.1], [0.1]],
              "step_wall_time": [[2.5, 3.5], [4.0]]}
    acc = pooled_account(groups)
    assert acc is not None and acc["step_wall_time"] == 3.5
    assert acc["unattributed_wall_time"] == 0.4 and acc["step_account"]["n"] == 3
    assert pooled_account({**groups, "step_wall_time": []}) is None


def test_record_terminal_and_html_show_one_account(tmp_path: Path) -> None:
    k = CellKit(tmp_path, case="P/R")
    k.write()
    log = k.dir / "run.log"
    kept = [x for x in log.read_text().splitlines() if not x.startswith("perf ")]
    _log(tmp_path / "perf.log")
    log.write_text("\n".join(kept + (tmp_path / "perf.log").read_text().splitlines()) + "\n")
    k.write_meta()
    rec = k.analyze()
    parts = sum(rec[p] for p in ("rollout_wall_time", "training_wall_time",
                                 "weight_sync_wall_time", "unattributed_wall_time"))
    assert abs(parts - rec["step_wall_time"]) < 1e-6, rec["step_account"]
    assert rec["step_account"]["estimator"].startswith("the median step")
    row = table([rec])[1]
    # terminal: rollout, train, sync, unattributed, step of one step
    assert "2.10s" in row and "1.00s" in row and "5.00s" in row, row
    html = render_html({"cells": [rec], "matrix": {}})
    assert "5.00s" in html and "in the median step" in html
