"""The report says one thing in every place: the route that ran (issue 32)."""

from __future__ import annotations

from pathlib import Path

from cellkit import CellKit

from pytest_rlkernel_matrix.report.html import render_html
from pytest_rlkernel_matrix.report.matrix_report import route_shown, table
from pytest_rlkernel_matrix.report.record import ran

SILENT = ("[RL-Kernel][route] framework=vllm target=rollout module=attention "
          "requested=rl_kernel actual=vllm.production.attention fallback=false")


def test_route_column_shows_the_route_line_over_the_readback(tmp_path: Path) -> None:
    """The readback claims rl_kernel, the route line says actual=vllm.production.attention:
    the rollout route shown is production, with the requested rl_kernel beside it, in the
    terminal table, the record and the HTML route table."""
    kit = CellKit(tmp_path, case="R/R", mode="audit").write()
    kit.log(SILENT)
    rec = kit.analyze()
    assert rec["verdict"] != "valid"  # the fallback is judged as before
    side = rec["routes"]["attention"]["rollout"]
    assert side["implementation"] == "rl_kernel" and side["ran"] == "production"
    assert side["route_line"] == ["vllm.production.attention"]
    assert rec["actual_rollout_implementation"] == "production"
    assert rec["requested_rollout_implementation"] == "rl_kernel"
    assert route_shown(rec, "rollout") == "production (requested rl_kernel)"
    assert route_shown(rec, "training") == "rl_kernel"
    _head, row = table([rec])
    assert "production (requested rl_kernel)" in row and row.index("rl_kernel") < row.index(
        "production")
    page = render_html({"cells": [rec]})
    assert ("production (P vs R); readback rl_kernel, route line "
            "actual=vllm.production.attention") in page


def test_a_clean_cell_shows_its_route_once(tmp_path: Path) -> None:
    rec = CellKit(tmp_path, case="P/R", mode="audit").write().analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert (route_shown(rec, "training"), route_shown(rec, "rollout")) == ("production",
                                                                          "rl_kernel")
    assert "requested" not in table([rec])[1]


def test_ran_prefers_the_source_that_contradicts_the_request() -> None:
    assert ran("rl_kernel", ["rl_kernel", "production"]) == "production"
    assert ran("production", ["production", "rl_kernel"]) == "rl_kernel"
    assert ran("rl_kernel", ["rl_kernel", "rl_kernel"]) == "rl_kernel"
    assert ran("rl_kernel", [None]) is None and ran("rl_kernel", ["mixed", "x"]) == "mixed"


def test_report_command_on_a_first_run_and_a_relative_root(tmp_path: Path) -> None:
    """`rlk-matrix report <relative root>` with no cache yet: one count line for the cells read
    without a cache entry (not one per cell), and `matrix_root` stays absolute."""
    import json
    import subprocess
    import sys

    root = tmp_path / "root"
    for module, case in (("attention", "R/R"), ("attention", "P/R"), ("ffn", "R/P")):
        CellKit(root, module=module, case=case).write()
    cmd = [sys.executable, "-m", "pytest_rlkernel_matrix.cli", "report", "root", "--jobs", "1"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=True)
    cache_lines = [x for x in done.stderr.splitlines() if x.startswith("cache:")]
    assert cache_lines == [
        "cache: 3 of 3 run directories not cached yet (no cache entry, as on a first report): "
        "read", "cache: 0 of 3 run directories unchanged (reused), 3 read"], done.stderr
    report = json.loads((root / "matrix-report.json").read_text())
    assert report["matrix_root"] == str(root) and Path(report["matrix_root"]).is_absolute()
    assert report["timings"] == {"usable": 0, "not_usable": 3}  # one step each: too few
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert [x for x in again.stderr.splitlines() if x.startswith("cache:")] == [
        "cache: 3 of 3 run directories unchanged (reused), 0 read"]
    assert json.loads((root / "matrix-report.json").read_text())["matrix_root"] == str(root)


def test_shared_reasons_are_grouped_once() -> None:
    """A strict session whose cells do not start: every cell has (some of) the same blockers;
    one group per verdict, every reason once, a reason of only some cells naming them."""
    from pytest_rlkernel_matrix.report.matrix_report import problem_groups

    blockers = ["r_backend.attention unavailable", "r_backend.ffn unavailable",
                "r_backend.logp unavailable"]
    recs = [{"hardware": "cpu", "module": m, "case": c, "verdict": "unsupported",
             "failed": True, "reasons": list(blockers)}
            for m in ("attention", "ffn", "logp") for c in ("R/R", "P/R")]
    recs.append({"hardware": "cpu", "module": "logp", "case": "P/P", "verdict": "valid",
                 "failed": False, "reasons": []})
    ((group, head, lines),) = problem_groups(recs)
    assert head == ("cpu attention R/R, attention P/R, ffn R/R, ffn P/R, logp R/R, logp P/R: "
                    "unsupported (FAILED)")
    assert lines == blockers and len(group) == 6
    recs[1]["reasons"] = blockers[1:]
    ((_, _, lines),) = problem_groups(recs)
    assert lines == [f"{blockers[0]} [attention R/R, ffn R/R, ffn P/R, logp R/R, logp P/R]",
                     *blockers[1:]]
    recs[0]["failed"] = False
    assert [h for _, h, _ in problem_groups(recs)] == [
        "cpu attention R/R: unsupported (recorded)",
        "cpu attention P/R, ffn R/R, ffn P/R, logp R/R, logp P/R: unsupported (FAILED)"]


def test_a_runs_own_declared_r_backend_in_a_route_line_shows_as_r(tmp_path: Path) -> None:
    """The reference workload's R is its own (`rlk-ref.*`, declared in each readback's
    runtime_policy): its route lines `actual=rlk-ref....` are R in the route column, as the
    verdict judges them, not "production (requested rl_kernel)"."""
    policy = {"backend_prefix": "rlk-ref.", "platform": "cpu", "triton_allowed": True}
    kit = CellKit(tmp_path, case="R/R", mode="audit").write()
    for side in ("training", "rollout"):
        kit.edit_readback(side, lambda d: [op.update(backend_id="rlk-ref." + m)
                                           or d.update(runtime_policy=policy)
                                           for m, op in d["operators"].items()])
    kit.log("[RL-Kernel][route] framework=vllm target=rollout module=attention "
            "requested=rl_kernel actual=rlk-ref.attention.deterministic.v1 fallback=false")
    rec = kit.analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["routes"]["attention"]["rollout"]["ran"] == "rl_kernel"
    assert route_shown(rec, "rollout") == "rl_kernel" == route_shown(rec, "training")
