"""vime's consistency audit read from a run (issue 45): its replay manifest, result cube and
metadata in the debug dump, its rlk_audit_* metrics in run.log, and its metadata validation as
semantic-validity reasons (fixtures: tests/data/vime_audit, see make_fixtures.py there)."""

from __future__ import annotations

import shutil
from pathlib import Path

from cellkit import CellKit

from pytest_rlkernel_matrix.judge.read.vime_audit import REPLAY_CASES, audit_metrics

DATA = Path(__file__).parent / "data" / "vime_audit"


def _cell(tmp_path: Path, name: str | None) -> CellKit:
    kit = CellKit(tmp_path).write()
    if name is not None:
        shutil.copytree(DATA / name / "train-data", kit.dir / "train-data")
    return kit


def test_a_complete_audit_is_read_and_keeps_the_cell_valid(tmp_path: Path) -> None:
    rec = _cell(tmp_path, "complete").analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    files = rec["vime_audit"]["files"]
    manifest = files["train-data/0.rank0.pt"]["replay_manifest"]
    assert manifest["batch_invariance_cases"] == dict.fromkeys(REPLAY_CASES, 3)
    assert manifest["mode"] == "audit" and manifest["sample_count"] == 3
    cube = files["train-data/0.rank0.pt"]["result_cube"]
    assert cube["axes"]["tp"] == 2 and cube["metrics"]["runtime_fallback"] == 0.0
    from pytest_rlkernel_matrix.report.debug_views import vime_rows

    rows = dict(vime_rows(rec["vime_audit"]))
    assert "same_sample_alone 3" in rows["vime replay manifest (train-data/0.rank0.pt)"]


def test_missing_metadata_is_a_semantic_reason(tmp_path: Path) -> None:
    rec = _cell(tmp_path, "missing").analyze()
    # the cube's runtime fallback is a fallback (issue 50), the metadata gaps semantic reasons
    assert rec["verdict"] == "fallback", rec["reasons"]
    text = "\n".join(rec["validity"]["semantic"]["reasons"])
    assert "session_id_missing: sample.session_id missing for 1 of 3 samples (positions 1)" in text
    assert "quantization_metadata_missing: quantization.fingerprint missing for 1 of 3" in text
    assert "weight_update_status_missing: weight.pre_update missing for 3 of 3" in text
    assert "linear_logp runtime fallback" in text


def test_rlk_audit_metrics_from_run_log(tmp_path: Path) -> None:
    kit = _cell(tmp_path, None)
    kit.log("[2026-01-01 00:00:00] model.py:10 - step 0: {'train/rlk_audit_clipfrac0': 0.008, "
            "'train/rlk_audit_dlogp_abs_max': 0.03, 'train/loss': 1.0}")
    rec = kit.analyze()
    assert rec["vime_audit"]["rlk_audit_metrics"] == {
        "0": {"rlk_audit_clipfrac0": 0.008, "rlk_audit_dlogp_abs_max": 0.03}}
    assert rec["verdict"] == "valid"  # metrics alone: noted, no precondition to check
    assert "could not be checked" in rec["vime_audit"]["note"]


def test_no_audit_no_block(tmp_path: Path) -> None:
    rec = _cell(tmp_path, None).analyze()
    assert rec["vime_audit"] is None and rec["verdict"] == "valid"
    assert audit_metrics([(1, {"x": 1}), (2, "not a dict")]) == {}


def _vime_cell(tmp_path: Path, case: str) -> dict:
    """A clean cell with a vime debug dump of `case` (tests/golden/upstream/vime/cases.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "golden" / "upstream" / "vime"))
    import cases

    kit = CellKit(tmp_path).write()
    cases.write(case, kit.dir)
    return kit.analyze()


def test_a_fallback_vime_records_anywhere_is_the_cells_fallback(tmp_path: Path) -> None:
    # (every place at the reader level: tests/test_golden_upstream.py)
    for i, case in enumerate(("fallback_manifest_runtime_provenance",
                              "fallback_sample_undeclared")):
        rec = _vime_cell(tmp_path / str(i), case)
        assert rec["verdict"] == "fallback", (case, rec["reasons"])


def test_vimes_refusals_and_drift_report_are_reasons(tmp_path: Path) -> None:
    rec = _vime_cell(tmp_path / "a", "audit_missing_contract_id")
    assert rec["verdict"] == "incomparable"
    assert any("logprob_contract_id_missing" in r for r in rec["reasons"])
    rec = _vime_cell(tmp_path / "b", "strict_failure_runtime_provenance")
    assert rec["verdict"] != "valid"
    assert any("vime's drift report says FAIL" in r for r in rec["reasons"]), rec["reasons"]
    assert rec["vime_audit"]["drift_report"]["status"] == "FAIL"
    rec = _vime_cell(tmp_path / "c", "audit_complete")
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["vime_audit"]["drift_report"]["status"] == "PASS"
