"""cell-run.json and its recorded policy as pydantic models (judge/read/cellrun.py): unknown
keys handled on purpose, wrong values a reason naming the file and the key, never a pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cellkit import CellKit, cell_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_rlkernel_matrix.judge.read.policy import Policy
from pytest_rlkernel_matrix.report.record import cell_to_dict, read_cell_run

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
POLICY = {"baseline_contract": {"kind": "bitwise"}, "min_samples_per_rank": 1,
          "min_active_tokens": 1, "baseline_claims": ["weights_bitwise"],
          "require_rollout_weight_audit": False, "backend": "cpu", "repeat_dir": "b"}
STRINGS = ("backend", "repeat_dir")
COUNTS = ("min_samples_per_rank", "min_active_tokens")


def meta(**policy: Any) -> dict[str, Any]:
    return {"session": "t", "cell": cell_to_dict(cell_of()), "mode": "strict", "run_id": "r1",
            "run": {}, "warmup": 0, "env": {}, "preflight_blockers": [],
            "policy": {**POLICY, **policy}}


def refused(data: Any, tmp: Path, key: str) -> str:
    """The reason `read_cell_run` gives for `data` written as tmp/cell-run.json (it must give
    one naming the file and `key`)."""
    (tmp / "cell-run.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        read_cell_run(tmp)
    why = str(info.value)
    assert str(tmp / "cell-run.json") in why and key in why, why
    return why


def test_a_clean_record_reads_and_types_its_policy(tmp_path: Path) -> None:
    (tmp_path / "cell-run.json").write_text(json.dumps(meta()))
    policy = Policy.from_meta(read_cell_run(tmp_path))
    assert policy.backend == "cpu" and policy.baseline_claims == ("weights_bitwise",)
    assert policy.repeat_dir == "b" and policy.run_id == "r1"


def test_extra_is_deliberate_per_model(tmp_path: Path) -> None:
    # the top level ignores keys newer writers add; the policy refuses a rule it does not know
    (tmp_path / "cell-run.json").write_text(json.dumps({**meta(), "a_newer_field": [1]}))
    assert read_cell_run(tmp_path)["a_newer_field"] == [1]
    refused(meta(baseline_claim=["weights_bitwise"]), tmp_path, "policy.baseline_claim")


wrong_types = st.one_of(st.booleans(), st.integers(), st.floats(allow_nan=False),
                        st.text(max_size=5), st.lists(st.integers(), max_size=2),
                        st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
pads = st.sampled_from([" ", "\t", "\n", "\u00a0", "  "])


@SETTINGS
@given(key=st.sampled_from(COUNTS), value=wrong_types)
def test_wrongly_typed_counts_never_pass(tmp_path: Path, key: str, value: Any) -> None:
    if type(value) is int and value >= 1:
        return  # a right value
    refused(meta(**{key: value}), tmp_path, f"policy.{key}")


@SETTINGS
@given(key=st.sampled_from(STRINGS), pad=pads, where=st.sampled_from(["left", "right", "both"]),
       value=st.sampled_from(["cpu", "cuda", "b", ""]))
def test_padded_or_empty_strings_never_pass(tmp_path: Path, key: str, pad: str, where: str,
                                            value: str) -> None:
    padded = (pad if where != "right" else "") + value + (pad if where != "left" else "")
    refused(meta(**{key: padded}), tmp_path, f"policy.{key}")
    refused({**meta(), "run_id": padded}, tmp_path, "run_id")
    refused({**meta(), "mode": f"{pad}strict"}, tmp_path, "mode")


@SETTINGS
@given(key=st.sampled_from([*STRINGS, "baseline_claims", "require_rollout_weight_audit",
                            "baseline_contract"]), value=wrong_types)
def test_wrongly_typed_policy_values_never_pass(tmp_path: Path, key: str, value: Any) -> None:
    if key == "backend" and value in ("cpu", "cuda", "rocm"):
        return
    if key == "repeat_dir" and isinstance(value, str) and value and value == value.strip():
        return
    if key == "require_rollout_weight_audit" and isinstance(value, bool):
        return
    if key == "baseline_claims" and value == []:
        return
    if key == "baseline_contract" and isinstance(value, dict):
        return  # (its keys are numeric's contract reader's, tested there)
    refused(meta(**{key: value}), tmp_path, f"policy.{key}")


@SETTINGS
@given(cut=st.integers(0, 400))
def test_truncated_or_empty_files_never_pass(tmp_path: Path, cut: int) -> None:
    text = json.dumps(meta())
    (tmp_path / "cell-run.json").write_text(text[:min(cut, len(text) - 1)])
    with pytest.raises(ValueError, match=r"cell-run\.json"):
        read_cell_run(tmp_path)


@pytest.mark.parametrize("data", [{}, [], None, "x", {"cell": {}, "run": {}}])
def test_empty_or_partial_objects_never_pass(tmp_path: Path, data: Any) -> None:
    (tmp_path / "cell-run.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"cell-run\.json"):
        read_cell_run(tmp_path)


@pytest.mark.parametrize(("key", "value"), [("warmup", "2"), ("env", {"A": 1}),
                                            ("preflight_blockers", [["only one"]]),
                                            ("cell", []), ("run", None)])
def test_wrong_top_level_values_name_their_key(tmp_path: Path, key: str, value: Any) -> None:
    refused({**meta(), key: value}, tmp_path, key)


@pytest.mark.parametrize(("policy", "key"), [({"backend": " cuda"}, "policy.backend"),
                                             ({"min_active_tokens": "5"},
                                              "policy.min_active_tokens"),
                                             ({"a_rule_from_the_future": True},
                                              "policy.a_rule_from_the_future")])
def test_a_bad_policy_is_the_cells_error_record_not_an_abort(tmp_path: Path,
                                                             policy: dict[str, Any],
                                                             key: str) -> None:
    k = CellKit(tmp_path)
    k.policy = {**k.policy, **policy}
    k.write()
    rec = k.analyze()
    assert rec["verdict"] == "error" and rec["failed"] is True
    assert any("cell-run.json" in r and key in r for r in rec["reasons"]), rec["reasons"]
