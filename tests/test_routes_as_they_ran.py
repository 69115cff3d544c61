"""Routes as they ran (issue 53): a run that did not finish shows its state, never a side it did
not run to the end; a route nothing reports is never a passed route judgement, in every mode
(`off` says what it expected)."""

from __future__ import annotations

import json
from pathlib import Path

from cellkit import CellKit, cell_of

from pytest_rlkernel_matrix.report.html import render_html
from pytest_rlkernel_matrix.report.matrix_report import route_shown, table
from pytest_rlkernel_matrix.report.record import interrupted_record


def test_an_interrupted_run_shows_interrupted_on_both_sides(tmp_path: Path) -> None:
    k = CellKit(tmp_path, case="R/R")
    k.write()
    # its log had not yet declared its own backends: read alone, the route lines would say
    # production on an R side (a fallback it never had)
    k.write_meta(interrupted=True, exit_code=None)
    rec = k.analyze()
    assert rec["verdict"] == "error"
    for side in ("training", "rollout"):
        assert rec[f"actual_{side}_implementation"] == "interrupted"
        assert route_shown(rec, side) == "interrupted"
    assert all(e["unfinished"] == "interrupted" for e in rec["routes"].values())
    assert "production (requested" not in "\n".join(table([rec]))
    # the record as the session reports it under each cell naming the run (alias_record)
    from pytest_rlkernel_matrix.report.record import alias_record

    alias = alias_record(rec, cell_of("attention", "R/R"))
    assert route_shown(alias, "training") == route_shown(alias, "rollout") == "interrupted"


def test_a_timed_out_run_and_the_interrupted_record(tmp_path: Path) -> None:
    k = CellKit(tmp_path, case="P/R")
    k.write()
    k.write_meta(timed_out=True, exit_code=None)
    rec = k.analyze()
    assert route_shown(rec, "training") == route_shown(rec, "rollout") == "timed out"
    stopped = interrupted_record(cell_of("attention", "R/R"), "audit", "cpu/x", "r1")
    assert route_shown(stopped, "rollout") == "interrupted"


def test_an_unreported_production_route_is_not_judged_in_every_mode(tmp_path: Path) -> None:
    for mode in ("audit", "off"):
        k = CellKit(tmp_path / mode, case="P/P", mode=mode)
        k.write()
        # the rollout side's record of attention is gone: nothing reports that side's route
        for f in (k.dir / "readbacks").glob("*rollout*"):
            data = json.loads(f.read_text())
            del data["operators"]["attention"]
            data["installed_hooks"].pop("attention", None)
            f.write_text(json.dumps(data))
        log = k.dir / "run.log"
        log.write_text("".join(line for line in log.read_text().splitlines(keepends=True)
                               if not ("target=rollout" in line and "module=attention" in line)))
        rec = k.analyze()
        route = rec["validity"]["route"]
        assert route["valid"] is not True, (mode, route)
        said = [r for r in route["reasons"] if r.startswith("attention rollout")]
        assert said, route
        if mode == "off":
            assert said[0] == ("attention rollout: off mode expects production (RL-Kernel "
                               "disabled), but no readback or route line reports this side: "
                               "route not reported, not judged"), said
        assert route_shown(rec, "rollout").startswith("not reported"), rec[
            "actual_rollout_implementation"]


def test_the_html_shows_the_interrupted_route(tmp_path: Path) -> None:
    k = CellKit(tmp_path, case="R/R")
    k.write()
    k.write_meta(interrupted=True, exit_code=None)
    rec = k.analyze()
    report = {"schema": "rlk-matrix.report.v1", "cells": [rec], "matrix": {}}
    html = render_html(json.loads(json.dumps(report, default=str)))
    assert "interrupted (reported before it stopped:" in html


def test_a_read_only_cell_directory_is_a_clear_error() -> None:
    """Issue 53: an OSError writing a cell's files names the path and the reason, not
    'internal error' (as root no permission can be taken away here, so the error is built)."""
    import errno

    from pytest_rlkernel_matrix.report.record import os_error_record

    exc = PermissionError(errno.EACCES, "Permission denied", "/m/cpu/attention-rr/readbacks")
    rec = os_error_record(cell_of("attention", "R/R"), "audit", exc)
    assert rec["verdict"] == "error" and rec["failed"] is True
    (reason,) = rec["reasons"]
    assert reason.startswith("cannot use the cell's files: /m/cpu/attention-rr/readbacks: "
                             "Permission denied (PermissionError)")
    assert "internal error" not in reason
