"""Issue 34 item 5: RL-Kernel's own record rules, platform by platform, on records with RL-Kernel
backend ids; the reference workload judged by the runtime policy it declares."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cellkit import CellKit

from pytest_rlkernel_matrix.judge.route.rules import (
    declared_policy,
    record_rules,
    triton_use,
    truthy_flag,
    upstream_findings,
)


def cuda_kit(tmp_path: Path, **kw: Any) -> CellKit:
    """A clean R/R cell on a CUDA profile (records report CUDA execution, no Triton)."""
    k = CellKit(tmp_path, policy={"baseline_contract": None, "min_samples_per_rank": 1,
                                  "min_active_tokens": 1, "backend": "cuda"}, **kw)
    k.write()
    for side in ("training", "rollout"):
        k.edit_readback(side, lambda d: [op["provenance"]["execution"].update(
            runtime_platform="cuda") for op in d["operators"].values()])
    return k


def test_a_clean_cuda_rr_cell_is_valid(tmp_path: Path) -> None:
    rec = cuda_kit(tmp_path).analyze()
    assert rec["verdict"] == "valid", rec["reasons"]


def test_triton_used_on_a_cuda_rlkernel_record_is_a_reason_naming_the_record(
        tmp_path: Path) -> None:
    """Upstream's CUDA validator (runtime_policy triton_allowed: false) fails this run."""
    k = cuda_kit(tmp_path)
    k.edit_readback("rollout", lambda d: [op["provenance"]["execution"].update(
        runtime_platform="cuda", triton_used=True) for op in d["operators"].values()])
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert any(r.startswith("route: attention rollout (vllm-rollout-107.json): record "
                            "'rlkernel.attention.deterministic.v1' uses Triton "
                            "(provenance.execution.triton_used=true)") for r in rec["reasons"]), \
        rec["reasons"]


@pytest.mark.parametrize("key", ["fallback_used", "used_fallback", "split_kv_fallback"])
def test_a_nested_truthy_fallback_key_is_a_fallback(tmp_path: Path, key: str) -> None:
    k = cuda_kit(tmp_path)
    k.edit_readback("training", lambda d: [op["provenance"]["execution"].update(
        {"runtime_platform": "cuda", key: "split"}) for op in d["operators"].values()])
    rec = k.analyze()
    assert rec["verdict"] == "fallback"
    assert any(f"provenance.execution.{key}='split': a fallback" in r for r in rec["reasons"])


def test_cuda_logp_must_be_the_strict_backend_and_report_cuda() -> None:
    rec = {"backend_id": "rlkernel.linear_logp.other.v1",
           "provenance": {"execution": {"runtime_platform": "rocm"}}}
    fb, bad = record_rules(rec, "logp", "cuda")
    assert fb == []
    assert bad == ["does not report CUDA execution (runtime_platform 'rocm')",
                   "logp backend 'rlkernel.linear_logp.other.v1' is not the strict "
                   "'rlkernel.linear_logp.bitwise.v1'"]


def test_rocm_rules() -> None:
    rec = {"backend_id": "rlkernel.attention.x", "provenance": {
        "platform": "hip", "reference_only": True, "attention_fallback": 1,
        "proj": "rlkernel.rocm.triton_det_gemm", "kv": "my_triton_kernel"}}
    fb, bad = record_rules(rec, "attention", "rocm")
    assert fb == ["says provenance.attention_fallback='1': a fallback (RL-Kernel's rule: any "
                  "truthy fallback key in a record)"]
    assert bad == ["says reference_only=True: a reference path, not the strict kernel",
                   "uses an unapproved Triton backend (kv='my_triton_kernel')"]
    _, bad = record_rules({"backend_id": "rlkernel.ffn.other", "provenance": {}}, "ffn", "rocm")
    assert "does not prove ROCm execution (no runtime_platform rocm/hip)" in bad
    assert any("is not the strict 'rlkernel.ffn.qwen3.deterministic.v1'" in b for b in bad)


def test_upstreams_helpers_as_it_reads_them() -> None:
    assert truthy_flag({"a": {"fallback": 0, "b": [{"used_fallback": ""}]}},
                       frozenset({"fallback", "used_fallback"})) is None
    assert truthy_flag([{"x": {"fallback": "yes"}}], frozenset({"fallback"})) == (
        "[0].x.fallback='yes'")
    assert triton_use({"a": "Triton-kernel"}) == "a='Triton-kernel'"
    assert triton_use({"uses_triton": False, "b": 3}) is None


def test_the_workload_is_judged_by_the_policy_it_declares() -> None:
    pol = {"backend_prefix": "rlk-ref.", "platform": "cuda", "triton_allowed": True}
    rec = {"backend_id": "rlk-ref.attention.deterministic.v1", "provenance": {
        "execution": {"runtime_platform": "cuda", "triton_used": True}}}
    entry = {"side": "rollout", "module": "attention", "source": "vllm-rollout-1.json",
             "record": rec}
    assert upstream_findings([entry], "cuda", [{"source": "x", "policy": pol}]) == ([], [])
    strict = dict(pol, triton_allowed=False)
    _, bad = upstream_findings([entry], "cuda", [{"source": "x", "policy": strict}])
    assert bad == ["attention rollout (vllm-rollout-1.json): record "
                   "'rlk-ref.attention.deterministic.v1' uses Triton "
                   "(provenance.execution.triton_used=true); the run's runtime policy allows "
                   "none"]
    # RL-Kernel's own ids, production ids and disagreeing policies cannot be declared
    for prefix in ("rlkernel.", "vllm.production.", ""):
        got, problems = declared_policy([{"source": "a", "policy": dict(pol,
                                                                        backend_prefix=prefix)}])
        assert got is None and problems
    got, problems = declared_policy([{"source": "a", "policy": pol},
                                     {"source": "b", "policy": dict(pol, platform="rocm")}])
    assert got is None and "different runtime policies" in problems[0]


def test_an_undeclared_own_backend_is_still_a_silent_fallback(tmp_path: Path) -> None:
    """Without a declared policy an R claim under another id is not R evidence."""
    k = cuda_kit(tmp_path)
    k.edit_readback("rollout", lambda d: [op.update(backend_id="rlk-ref." + m) for m, op in
                                          d["operators"].items()])
    rec = k.analyze()
    assert rec["verdict"] == "fallback"
    k.edit_readback("rollout", lambda d: [
        op.update(backend_id="rlk-ref." + m) or op["provenance"]["execution"].update(
            runtime_platform="cuda") or d.update(runtime_policy={
                "backend_prefix": "rlk-ref.", "platform": "cuda", "triton_allowed": True})
        for m, op in d["operators"].items()])
    k.edit_readback("training", lambda d: [op["provenance"]["execution"].update(
        runtime_platform="cuda") or d.update(runtime_policy={
            "backend_prefix": "rlk-ref.", "platform": "cuda", "triton_allowed": True})
        for op in d["operators"].values()])
    rec = k.analyze()
    assert rec["verdict"] == "valid", rec["reasons"]


def test_a_recorded_fallback_is_named_once(tmp_path: Path) -> None:
    """The readback's `fallbacks` entry and the record's own `fallback: true` are one fallback."""
    k = CellKit(tmp_path).write()

    def fell_back(d: dict[str, Any]) -> None:
        op = d["operators"]["attention"]
        op.update(implementation="production", backend_id="vllm.production.attention")
        op["provenance"]["fallback"] = True
        d["fallbacks"] = [{"module": "attention", "reason": "kernel raised"}]

    k.edit_readback("rollout", fell_back)
    rec = k.analyze()
    assert rec["verdict"] == "fallback"
    assert [r for r in rec["reasons"] if r.startswith("attention rollout")] == [
        "attention rollout: fallback recorded: kernel raised"], rec["reasons"]
