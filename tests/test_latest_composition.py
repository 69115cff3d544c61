"""`latest` composes only what belongs together (issue 53): sessions of the same matrix, mode,
drill state and hardware; a drill never merges into a non-drill view; each cell names its
session; a cell a later session did not run keeps its earlier verdict; "interrupted" is the
session's that was interrupted; the latest report carries the drill marker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.report.rerun import latest

CELLS = [("attention", "R/R"), ("attention", "P/R"), ("logp", "R/R")]


def _report(root: str, verdicts: dict[tuple[str, str], str], *, mode: str = "audit",
            drill: dict[str, Any] | None = None, interrupted: bool = False) -> dict[str, Any]:
    cells = [{"hardware": "cpu", "module": m, "case": c, "verdict": v, "reasons": [],
              "failed": False, "mode": mode, "artifact_dir": f"cpu/{m}-{c}", "run_id": root}
             for (m, c), v in verdicts.items()]
    return {"schema": "rlk-matrix.report.v1", "matrix_root": root, "created": root,
            "matrix": {"name": "m", "layout": "pairwise", "mode": mode, "hardware": ["cpu"]},
            "cells": cells, "complete": len(cells) == len(CELLS), "interrupted": interrupted,
            "drill": drill, "summary": {},
            "selection": {"matrix_cells": [f"cpu::{m}[{c}]" for m, c in CELLS]}}


def _verdicts(report: dict[str, Any]) -> dict[tuple[str, str], tuple[str, str]]:
    return {(c["module"], c["case"]): (c["verdict"], c["from"]) for c in report["cells"]}


def test_a_later_not_run_keeps_the_earlier_verdict_and_each_cell_names_its_session() -> None:
    first = _report("/r/1", dict.fromkeys(CELLS, "valid"))
    second = _report("/r/2", {("attention", "P/R"): "error", ("logp", "R/R"): "not_run"},
                     interrupted=False)
    out = latest([(Path("/r/1/matrix-report.json"), first),
                  (Path("/r/2/matrix-report.json"), second)])
    assert _verdicts(out) == {("attention", "R/R"): ("valid", "/r/1"),
                              ("attention", "P/R"): ("error", "/r/2"),
                              ("logp", "R/R"): ("valid", "/r/1")}
    assert out["interrupted"] is False and out["latest"]["not_composed"] == []


def test_interrupted_is_the_interrupted_sessions_own() -> None:
    first = _report("/r/1", dict.fromkeys(CELLS, "valid"), interrupted=True)
    second = _report("/r/2", {("attention", "P/R"): "valid"})
    out = latest([(Path("/r/1/x.json"), first), (Path("/r/2/x.json"), second)])
    assert out["interrupted"] is False and out["complete"] is True
    assert [s["interrupted"] for s in out["sources"]] == [True, False]


def test_a_drill_never_merges_with_a_non_drill_session_and_the_marker_stays() -> None:
    drill = {"env": "slow:attention:rollout:2", "kinds": ["slow"], "applied_cells": [],
             "text": "FAULT DRILL: RLK_REF_FAULT=slow:attention:rollout:2"}
    plain = _report("/r/1", dict.fromkeys(CELLS, "valid"))
    drilled = _report("/r/2", {("attention", "R/R"): "fallback"}, drill=drill)
    out = latest([(Path("/r/1/x.json"), plain), (Path("/r/2/x.json"), drilled)])
    assert _verdicts(out) == {("attention", "R/R"): ("fallback", "/r/2")}
    assert out["drill"] == drill
    assert out["latest"]["not_composed"][0].startswith("not composed: /r/1/x.json")
    assert "drill" in out["latest"]["not_composed"][0]
    # and the other way round: a plain session after a drill does not take the drill's cells
    back = latest([(Path("/r/2/x.json"), drilled), (Path("/r/3/x.json"), plain)])
    assert {v for v, _ in _verdicts(back).values()} == {"valid"} and back["drill"] is None


def test_another_mode_is_not_composed() -> None:
    audit = _report("/r/1", dict.fromkeys(CELLS, "valid"))
    off = _report("/r/2", {("logp", "R/R"): "not_run"}, mode="off")
    out = latest([(Path("/r/1/x.json"), audit), (Path("/r/2/x.json"), off)])
    assert _verdicts(out) == {("logp", "R/R"): ("not_run", "/r/2")}
    assert "mode 'audit' vs 'off'" in out["latest"]["not_composed"][0]
