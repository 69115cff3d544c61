"""Property tests of the debugger's readers (issue 45): any manifest, any capture record, any
truncation or byte flip of an upstream file is a reason naming the file, never an exception, and
never an `equal` judgement where the files are not upstream's."""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_rlkernel_matrix.judge.localise.debugger import judge_cell

DATA = Path(__file__).parent / "data" / "debugger"
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**20),
                    st.floats(allow_nan=True), st.text(max_size=8))
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=16)
RECORD_KEYS = ("schema_version", "boundary", "side", "identity", "contracts", "route",
               "tensors", "metadata")


def _judge_copy(name: str, change: Any) -> tuple[list[dict[str, Any]], list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / name
        shutil.copytree(DATA / name, root)
        change(root)
        results, problems = judge_cell(root)
        json.dumps(results, allow_nan=True, default=str)  # the record can hold it
        return results, problems


@SETTINGS
@given(boundaries=json_values, schema=st.sampled_from(["rlkernel.capture.v1", "other", None]))
def test_any_manifest_is_a_reason_or_a_judgement(boundaries: Any, schema: Any) -> None:
    def change(root: Path) -> None:
        (root / "capture-manifest.json").write_text(json.dumps(
            {"schema_version": schema, "boundaries": boundaries}))
    results, problems = _judge_copy("equal", change)
    assert problems  # never upstream's manifest: never a clean `equal`
    assert all(r["status"] != "equal" for r in results) or problems


@SETTINGS
@given(cut=st.integers(0, 10**6), flip=st.integers(0, 10**6), byte=st.integers(0, 255))
def test_truncated_or_flipped_records_fail_closed(cut: int, flip: int, byte: int) -> None:
    name = "training-rank1-call1.pt"

    def change(root: Path) -> None:
        path = root / "captures" / name
        raw = bytearray(path.read_bytes())
        if cut % 2:
            raw = raw[: cut % len(raw)]
        else:
            raw[flip % len(raw)] = byte
        path.write_bytes(bytes(raw))
    results, problems = _judge_copy("equal", change)
    (res,) = results  # never an exception; a flip torch's reader ignores may still read equal
    assert res["status"] in ("equal", "diverged", "not_comparable")
    if res["status"] != "equal":
        assert problems or res["status"] == "diverged"


@SETTINGS
@given(record=st.dictionaries(st.sampled_from(RECORD_KEYS), json_values, max_size=8))
def test_foreign_records_are_refused_by_name(record: dict[str, Any]) -> None:
    def change(root: Path) -> None:
        buf = io.BytesIO()
        torch.save(record, buf)
        (root / "captures" / "rollout-rank0-call0.pt").write_bytes(buf.getvalue())
    results, problems = _judge_copy("equal", change)
    assert any("rollout-rank0-call0.pt" in p for p in problems)
    assert all(r["status"] != "equal" for r in results)


@SETTINGS
@given(report=json_values)
def test_any_upstream_report_is_read_or_refused(report: Any) -> None:
    def change(root: Path) -> None:
        (root / "diagnostic-report.json").write_text(json.dumps(report))
    results, problems = _judge_copy("diverged", change)
    assert results[0]["status"] == "diverged"
    assert any("diagnostic-report.json" in p for p in problems)
