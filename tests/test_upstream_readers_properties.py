"""Property tests of issue 50's readers: any vime audit record, any identity or head file, any
truncation, a foreign schema, a wrong dtype: a reason or a judgement, never an exception, never a
clean pass where the files are not upstream's."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_rlkernel_matrix.judge.localise.debugger import judge_cell
from pytest_rlkernel_matrix.judge.read.evidence import read_evidence

GOLDEN = Path(__file__).parent / "golden" / "upstream" / "vime"
sys.path.insert(0, str(GOLDEN))
import cases  # noqa: E402

DATA = Path(__file__).parent / "data" / "debugger"
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6),
                    st.floats(allow_nan=True), st.text(max_size=6))
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10)
AUDIT = ("consistency_metadata", "consistency_replay_manifest", "consistency_result_cube",
         "consistency_metadata_validation", "runtime_provenance",
         "consistency_runtime_provenance", "consistency_batch_layout_fingerprints")


@SETTINGS
@given(key=st.sampled_from(AUDIT), value=json_values)
def test_any_audit_record_is_a_reason_or_a_judgement(key: str, value: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        payload = cases.build("audit_complete")
        payload["rollout_data"][key] = value
        path = Path(tmp) / "train-data" / "0.rank0.pt"
        path.parent.mkdir()
        torch.save(payload, path)
        ev = read_evidence(Path(tmp))
        json.dumps(ev.vime_audit, default=str)  # the record can hold it
        assert ev.vime_audit is not None
        assert "drift_report" in ev.vime_audit


@SETTINGS
@given(cut=st.integers(1, 10**5), dtype=st.sampled_from([torch.float16, torch.bfloat16,
                                                          torch.float64, torch.int64]))
def test_truncated_or_retyped_dumps_fail_closed(cut: int, dtype: torch.dtype) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = cases.write("equal_active_inactive_differ", Path(tmp))
        raw = path.read_bytes()
        path.write_bytes(raw[: cut % len(raw)])
        ev = read_evidence(Path(tmp))
        assert ev.problems or ev.sample_problems
    with tempfile.TemporaryDirectory() as tmp:
        payload = cases.build("equal_active_inactive_differ")
        rd = payload["rollout_data"]
        rd["log_probs"] = [t.to(dtype) for t in rd["log_probs"]]
        path = Path(tmp) / "train-data" / "0.rank0.pt"
        path.parent.mkdir()
        torch.save(payload, path)
        ev = read_evidence(Path(tmp))  # never raises; a half dtype is vime's refusal
        if dtype in (torch.float16, torch.bfloat16):
            assert any("vime cannot audit" in r for r in ev.vime_semantic)


@SETTINGS
@given(value=json_values, side=st.sampled_from(["training", "rollout"]))
def test_any_identity_file_is_never_a_clean_equal(value: Any, side: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "cell"
        shutil.copytree(DATA / "replay-equal", root)
        (root / "diagnostics" / "identity" / f"{side}-pid4500-rank0.json").write_text(
            json.dumps(value))
        results, problems = judge_cell(root)
        assert results[0]["status"] != "equal" and problems


@SETTINGS
@given(cut=st.integers(0, 10**5), schema=st.sampled_from(["other", None, "frozen_replay.v2"]))
def test_truncated_heads_and_foreign_session_files_fail_closed(cut: int, schema: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "cell"
        shutil.copytree(DATA / "replay-equal", root)
        head = root / "diagnostics" / "heads" / "rollout-pid4500-rank0-call0.pt"
        raw = head.read_bytes()
        head.write_bytes(raw[: cut % len(raw)])
        results, problems = judge_cell(root)
        assert results[0]["status"] != "equal" and problems
        (root / "frozen-replay.json").write_text(json.dumps({"schema_version": schema}))
        from types import SimpleNamespace

        from pytest_rlkernel_matrix.judge.localise.debugger import debugger_evidence

        ev = SimpleNamespace(root=root, problems=[], debugger=[])
        debugger_evidence(ev)
        assert any("frozen-replay.json" in p for p in ev.problems)
