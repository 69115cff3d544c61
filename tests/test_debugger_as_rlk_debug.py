"""RL-Kernel's debugger read as `rlk debug` reads it (issue 50): dtypes compared, never widened;
the LM head (`heads/`) and the runtime identities (`identity/`) of a replay; failed captures and
manifest-less bundles as reasons; replays at any depth (bounded); upstream's reports where
`rlk debug` and live sessions write them; `single-arm-summary.json`; RL-Kernel's own
`matrix-report.json` never taken for the plugin's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from pytest_rlkernel_matrix.judge.localise.debugger import debugger_evidence, judge_cell

DATA = Path(__file__).parent / "data" / "debugger"


def _copy(name: str, dest: Path) -> Path:
    shutil.copytree(DATA / name, dest)
    return dest


def _retype(root: Path, pattern: str, dtype: torch.dtype) -> None:
    for path in sorted((root / "captures").glob(pattern)):
        data = torch.load(path, weights_only=True)
        data["tensors"]["value"] = data["tensors"]["value"].to(dtype)
        torch.save(data, path)


def test_bf16_training_against_fp32_rollout_is_not_comparable(tmp_path: Path) -> None:
    root = _copy("equal", tmp_path / "cell")
    _retype(root, "training-*.pt", torch.bfloat16)
    results, problems = judge_cell(root)
    assert results[0]["status"] == "not_comparable"
    assert any("shape_or_dtype: training bfloat16 vs rollout float32" in p for p in problems)


def test_both_sides_bf16_stay_equal(tmp_path: Path) -> None:
    root = _copy("equal", tmp_path / "cell")
    _retype(root, "*.pt", torch.bfloat16)
    (root / "diagnostic-report.json").unlink()  # (upstream's report is of the float32 bundle)
    results, problems = judge_cell(root)
    assert results[0]["status"] == "equal", problems
    assert not problems


def test_shards_of_mixed_dtype_are_not_comparable(tmp_path: Path) -> None:
    root = _copy("equal", tmp_path / "cell")
    _retype(root, "training-rank0-*.pt", torch.bfloat16)
    results, problems = judge_cell(root)
    assert results[0]["status"] == "not_comparable"
    assert any("shard dtypes differ" in p for p in problems)


def test_lm_head_divergence_is_a_divergence(tmp_path: Path) -> None:
    root = _copy("replay-head-diverged", tmp_path / "cell")
    results, problems = judge_cell(root)
    assert results[0]["status"] == "diverged", problems
    first = results[0]["first_divergence"]
    assert first["module"] == "lm_head" and first["stage"] == "logits" and first["position"] == 2
    assert first["layer"] == 2  # after the model's two decoder layers, as upstream numbers it


def test_missing_identity_or_head_is_not_comparable(tmp_path: Path) -> None:
    root = _copy("replay-equal", tmp_path / "a")
    (root / "diagnostics" / "identity" / "rollout-pid4500-rank0.json").unlink()
    results, problems = judge_cell(root)
    assert results[0]["status"] == "not_comparable"
    assert any("identities are missing or different" in p for p in problems)
    root = _copy("replay-equal", tmp_path / "b")
    shutil.rmtree(root / "diagnostics" / "heads")
    results, problems = judge_cell(root)
    assert results[0]["status"] == "not_comparable"
    assert any("head_input evidence" in p for p in problems)


def test_a_failed_capture_is_a_reason(tmp_path: Path) -> None:
    root = _copy("replay-equal", tmp_path / "cell")
    (root / "diagnostics" / "errors").mkdir()
    torch.save({"error": "CUDA OOM"}, root / "diagnostics" / "errors" / "rollout-0.pt")
    results, problems = judge_cell(root)
    assert results[0]["status"] == "not_comparable"
    assert any("errors/rollout-0.pt" in p for p in problems)


def test_replays_are_found_at_depth_and_past_the_bound_fail_closed(tmp_path: Path) -> None:
    cell = tmp_path / "cell"
    shutil.copytree(DATA / "replay-diverged", cell / "arms" / "r-r")
    results, problems = judge_cell(cell)
    assert [r["path"] for r in results] == ["arms/r-r/diagnostics"]
    assert results[0]["status"] == "diverged", problems
    deep = tmp_path / "deep"
    shutil.copytree(DATA / "replay-equal", deep / "a" / "b" / "c" / "d" / "e")
    results, problems = judge_cell(deep)
    assert results == [] and any("more than 4 folders below" in p for p in problems)


def test_rlk_debug_report_at_the_run_dir_is_cross_checked(tmp_path: Path) -> None:
    cell = tmp_path / "cell"
    shutil.copytree(DATA / "replay-diverged", cell / "arms" / "r-r")
    (cell / "arms" / "r-r" / "diagnostic-report.json").write_text(json.dumps({
        "schema_version": "rlkernel.diagnostic_report.v1", "status": "equal",
        "first_divergence": None}))
    results, problems = judge_cell(cell)
    assert results[0]["upstream_report_path"] == "arms/r-r/diagnostic-report.json"
    assert any("upstream diagnostic-report.json says equal" in p for p in problems)


def test_a_live_session_report_is_found_by_its_group(tmp_path: Path) -> None:
    cell = tmp_path / "cell"
    shutil.copytree(DATA / "replay-diverged", cell / "arms" / "r-r")
    (cell / "matrix-report.json").write_text(json.dumps({
        "schema_version": "debug_matrix_report.v2", "baseline": "M000",
        "groups": [{"group": "M111", "run_dir": "/elsewhere/session/arms/r-r"}]}))
    (cell / "M111.report.json").write_text(json.dumps({
        "schema_version": "rlkernel.diagnostic_report.v1", "status": "not_comparable",
        "first_divergence": None}))
    results, problems = judge_cell(cell)
    assert results[0]["upstream_report_path"] == "M111.report.json"
    assert any("upstream diagnostic-report.json says not_comparable" in p for p in problems)
    ev = SimpleNamespace(root=cell, problems=[], debugger=[])
    debugger_evidence(ev)
    files = ev.debugger[-1]["files"]
    assert files[0]["file"] == "matrix-report.json" and files[0]["groups"] == ["M111"]
    # and the plugin's table never takes RL-Kernel's report for its own
    run = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.cli", "table",
                          str(cell / "matrix-report.json")], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 2 and "not a rlk-matrix.report.v1 report" in run.stderr


def test_a_bundle_without_its_manifest_is_a_reason(tmp_path: Path) -> None:
    root = _copy("equal", tmp_path / "cell")
    (root / "capture-manifest.json").unlink()
    results, problems = judge_cell(root)
    assert results == []
    assert any("has no capture-manifest.json" in p for p in problems)


def test_single_arm_summary_gates_the_replay(tmp_path: Path) -> None:
    root = _copy("replay-equal", tmp_path / "cell")
    (root / "single-arm-summary.json").write_text(json.dumps(
        {"launcher_returncode": 0, "frozen_sources_match": False, "passed": True}))
    results, problems = judge_cell(root)
    assert results[0]["status"] == "not_comparable"
    assert any("frozen source fingerprint changed" in p for p in problems)
