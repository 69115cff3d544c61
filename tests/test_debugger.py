"""RL-Kernel's consistency debugger read as localisation evidence (issue 45): capture bundles
and Qwen3 layer-replay files written by upstream's own writers (tests/data/debugger, see the
generating scripts there), judged by upstream's comparison rules, cross-checked against the
`diagnostic-report.json` upstream's `analyze_bundle` wrote; malformed, partial and foreign files
fail the cell closed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from cellkit import CellKit

from pytest_rlkernel_matrix.judge.localise.debugger import bitdiff, judge_cell
from pytest_rlkernel_matrix.judge.read.capture import read_bundle

DATA = Path(__file__).parent / "data" / "debugger"


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    return dst


@pytest.mark.parametrize(("name", "status", "where"), [
    ("equal", "equal", None),
    ("diverged", "diverged", ("ffn", "mlp_output", 0, 2)),
    ("signed-zero", "diverged", ("attention", "attention_output", 0, 1)),
    ("nonfinite", "not_comparable", ("logp", "logp", None, 0)),
    ("partial", "not_comparable", ("ffn", "mlp_output", 0, 0)),
])
def test_upstream_bundles_are_judged_as_upstream_judges_them(name, status, where) -> None:
    root = DATA / name
    results, problems = judge_cell(root)
    (res,) = results
    upstream = json.loads((root / "diagnostic-report.json").read_text())
    assert res["status"] == upstream["status"] == status
    first = res["first_divergence"]
    if where is None:
        assert first is None and upstream["first_divergence"] is None
    else:
        assert (first["module"], first["stage"], first["layer"], first["position"]) == where
        assert first["boundary"] == upstream["first_divergence"]["boundary"]
    # no disagreement with upstream's own report; not comparable fails closed
    assert not [p for p in problems if "upstream diagnostic-report.json" in p]
    assert bool(problems) == (status == "not_comparable")


def test_divergence_figures_and_input_evidence() -> None:
    (res,), _ = judge_cell(DATA / "diverged")
    first = res["first_divergence"]
    assert first["bitwise_mismatches"] == 1 and first["elements"] == 8
    assert first["first_index"] == [5] and first["input_evidence"] == "equal"
    assert 0 < first["max_abs_diff"] < 1e-8
    assert "first at ffn mlp_output layer 0 position 2" in res["summary"]
    assert [r["status"] for r in res["boundaries"]] == ["equal", "diverged", "equal"]


def test_signed_zero_differs_and_nan_never_passes() -> None:
    import numpy as np

    d = bitdiff(np.array([0.0], np.float32), np.array([-0.0], np.float32))
    assert d["equal"] is False and d["bitwise_mismatches"] == 1 and d["max_abs_diff"] == 0.0
    n = bitdiff(np.array([np.nan], np.float32), np.array([np.nan], np.float32))
    assert n["bitwise_mismatches"] == 0 and n["finite"] is False and n["equal"] is False
    assert bitdiff(np.zeros(2, np.float32), np.zeros(2, np.float64))["comparable"] is False


def test_disagreement_with_upstreams_report_names_both(tmp_path: Path) -> None:
    root = _copy("diverged", tmp_path)
    report = json.loads((root / "diagnostic-report.json").read_text())
    report["status"] = "equal"
    report["first_divergence"] = None
    (root / "diagnostic-report.json").write_text(json.dumps(report))
    _, problems = judge_cell(root)
    (p,) = [p for p in problems if "upstream" in p]
    assert "says equal" in p and "comparison says diverged" in p and "layer0.ffn.output" in p
    report = json.loads((DATA / "diverged" / "diagnostic-report.json").read_text())
    report["first_divergence"]["position"] = 3
    (root / "diagnostic-report.json").write_text(json.dumps(report))
    _, problems = judge_cell(root)
    (p,) = [p for p in problems if "upstream" in p]
    assert "position 3" in p and "position 2" in p


@pytest.mark.parametrize(("edit", "expect"), [
    (lambda m: m.update(schema_version="rlkernel.capture.v9"), "foreign or newer bundle"),
    (lambda m: m.update(boundaries=[]), "at least one semantic boundary"),
    (lambda m: m["boundaries"][1].update(inputs=["logp"]), "inputs must precede"),
    (lambda m: m["boundaries"][0].update(width=16), "feature width differs from manifest"),
    (lambda m: m["boundaries"][0].update(positions=[0, 1, 2, 3, 4]),
     "missing logical row coverage"),
    (lambda m: m["boundaries"][0].update(contracts=["scale", "dtype"]),
     "missing required contract dtype"),
])
def test_manifest_problems_fail_closed(tmp_path: Path, edit, expect: str) -> None:
    root = _copy("equal", tmp_path)
    manifest = json.loads((root / "capture-manifest.json").read_text())
    edit(manifest)
    (root / "capture-manifest.json").write_text(json.dumps(manifest))
    _, problems = judge_cell(root)
    assert any(expect in p for p in problems), problems


def test_partial_foreign_and_truncated_records_fail_closed(tmp_path: Path) -> None:
    root = _copy("equal", tmp_path)
    caps = root / "captures"
    (caps / "rollout-rank1-call2.pt").unlink()
    (caps / "rollout-rank1-call2.lock").write_text("")
    raw = (caps / "training-rank0-call0.pt").read_bytes()
    (caps / "training-rank0-call0.pt").write_bytes(raw[: len(raw) // 2])
    (caps / "stray.pt").write_bytes(b"x")
    _, problems = judge_cell(root)
    text = "\n".join(problems)
    assert "incomplete capture: rollout-rank1-call2" in text
    assert "training-rank0-call0.pt" in text and "unreadable" in text
    assert "stray.pt: not a capture record's name" in text
    assert "missing logical row coverage" in text or "feature coverage" in text


def test_a_record_of_another_bundle_is_refused(tmp_path: Path) -> None:
    root = _copy("equal", tmp_path)
    other = json.loads((root / "capture-manifest.json").read_text())
    other["boundaries"][0]["id"] = "renamed"
    other["boundaries"][1]["inputs"] = ["renamed"]
    (root / "capture-manifest.json").write_text(json.dumps(other))
    b = read_bundle(root, root)
    assert any("boundary 'layer0.attention.output' is not in the manifest" in p
               for p in b.problems)


@pytest.mark.parametrize(("name", "status", "where"), [
    ("replay-equal", "equal", None),
    ("replay-diverged", "diverged", ("ffn", "mlp_output", 1, 3)),
])
def test_layer_replay_files(name, status, where) -> None:
    (res,), problems = judge_cell(DATA / name)
    assert res["status"] == status and problems == []
    first = res["first_divergence"]
    if where is not None:
        assert (first["module"], first["stage"], first["layer"], first["position"]) == where
    assert [r["layer"] for r in res["layers"]] == [0, 1]


def test_layer_replay_missing_weights_and_layer_fail_closed(tmp_path: Path) -> None:
    root = _copy("replay-equal", tmp_path)
    diag = root / "diagnostics"
    next(iter(sorted((diag / "weights").glob("rollout-*layer1.json")))).unlink()
    (diag / "layers" / "training-pid4500-rank0-layer0-call0.pt").unlink()
    (res,), problems = judge_cell(root)
    text = "\n".join(problems)
    assert res["status"] == "not_comparable"
    assert "missing runtime weight evidence" in text
    assert "missing training or rollout layer snapshots" in text


def test_a_cells_record_terminal_and_html_carry_the_first_divergence(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.report.debug_views import debugger_lines, debugger_view

    kit = CellKit(tmp_path).write()
    shutil.copytree(DATA / "diverged", kit.dir / "debug" / "ffn-step3")
    rec = kit.analyze()
    (res,) = rec["debugger"]
    assert res["path"] == "debug/ffn-step3" and res["status"] == "diverged"
    assert res["upstream_report"]["status"] == "diverged"
    assert rec["verdict"] == "valid"  # a localisation agreeing with upstream: evidence, no error
    (line,) = debugger_lines([rec])
    assert "first at ffn mlp_output layer 0 position 2" in line
    view = debugger_view(rec["debugger"])
    assert view["rows"][0][1:7] == ["diverged", "ffn", "mlp_output", "0", "training vs rollout",
                                    "2"]


def test_a_cells_partial_bundle_keeps_it_from_valid(tmp_path: Path) -> None:
    kit = CellKit(tmp_path).write()
    shutil.copytree(DATA / "partial", kit.dir / "debug" / "x")
    rec = kit.analyze()
    assert rec["verdict"] != "valid"
    assert any("debugger capture bundle debug/x" in r for r in rec["reasons"])


def test_positions_and_offsets_are_checked_against_the_manifest(tmp_path: Path) -> None:
    root = _copy("equal", tmp_path)
    manifest = json.loads((root / "capture-manifest.json").read_text())
    manifest["boundaries"][2]["positions"] = [0, 1, 2]  # the records hold position 3 too
    (root / "capture-manifest.json").write_text(json.dumps(manifest))
    _, problems = judge_cell(root)
    assert any("positions [3] are not declared in the manifest" in p for p in problems)
