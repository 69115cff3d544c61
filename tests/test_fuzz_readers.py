"""Property-based fuzzing of the readback and sidecar readers: any content is a reason, never an
exception out of `read_evidence`, and the judged record always encodes as strict JSON."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from cellkit import CellKit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_rlkernel_matrix.judge.read.evidence import read_evidence
from pytest_rlkernel_matrix.store.atomic import json_safe

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=20)
KEYS = ("framework", "target", "run_id", "fallbacks", "operators", "capability",
        "capability_decisions", "status")
OP_KEYS = ("implementation", "backend_id", "case_id", "call_count", "execution_mode",
           "provenance", "arithmetic_contract")


def _tensors() -> st.SearchStrategy[Any]:
    shapes = st.one_of(st.just(()), st.tuples(st.integers(0, 6)), st.tuples(st.integers(0, 3),
                                                                         st.integers(0, 3)))
    dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool])
    return st.builds(lambda shape, dtype: torch.zeros(shape, dtype=dtype), shapes, dtypes)


sidecar_values = st.one_of(scalars, _tensors(), st.lists(st.one_of(_tensors(), scalars),
                                                         max_size=4))
SIDECAR_KEYS = ("rank", "tensor_parallel_size", "context_parallel_size", "train_log_probs",
                "rollout_log_probs", "loss_masks", "total_lengths", "response_lengths",
                "tokens", "sample_indices", "schema", "run_id")


def _fresh() -> tuple[Path, CellKit]:
    tmp = Path(tempfile.mkdtemp(prefix="rlk-fuzz-"))
    return tmp, CellKit(tmp).write()


def _judge(k: CellKit) -> None:
    ev = read_evidence(k.dir)  # must not raise
    assert isinstance(ev.problems, list)
    rec = k.analyze()
    json.dumps(json_safe(rec), allow_nan=False)


@SETTINGS
@given(top=st.fixed_dictionaries({}, optional={k: json_values for k in KEYS}),
       op=st.fixed_dictionaries({}, optional={k: json_values for k in OP_KEYS}),
       raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_any_readback_is_read_or_reported(top: dict[str, Any], op: dict[str, Any],
                                          raw: bytes | None) -> None:
    tmp, k = _fresh()
    try:
        data = k.readback("rollout")
        data.update(top)
        if isinstance(data.get("operators"), dict) and "attention" in data["operators"]:
            data["operators"]["attention"] = {**data["operators"]["attention"], **op}
        path = k.dir / "readbacks" / "vllm-rollout-107.json"
        if raw is not None:
            path.write_bytes(raw)
        else:
            path.write_text(json.dumps(data))  # NaN/Infinity included: json.loads accepts them
        _judge(k)
    finally:
        shutil.rmtree(tmp)


@SETTINGS
@given(fields=st.fixed_dictionaries({}, optional={k: sidecar_values for k in SIDECAR_KEYS}))
def test_any_sidecar_is_read_or_reported(fields: dict[str, Any]) -> None:
    tmp, k = _fresh()
    try:
        data = k.sidecar()
        data.update(fields)
        k.write_sidecar(data)
        _judge(k)
    finally:
        shutil.rmtree(tmp)
