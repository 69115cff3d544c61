"""Issue 20 part B: evidence in RL-Kernel's own forms, judged as upstream writes it.

The fixtures are written here from the facts of RL-Kernel's writers (weight audits from training
rank 0 per exported version, `requested=`/`actual=` route lines, readbacks with `installed_hooks`
and no record for native Megatron logp plus vime's log marker, `bitwise-validation.json` of a
train-data dump without `log_probs`), not by the plugin's or the reference workload's writer.
Each case asserts the exact verdict and reason. The cell around them comes from tests/cellkit.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from cellkit import SIDES, CellKit

from pytest_rlkernel_matrix.judge.read.upstream import read_weight_audits

NATIVE = ("linear_logp native active: backend_id=vime.utils.ppo_utils."
          "calculate_log_probs_and_entropy contract_id=vime.native.linear_logp.v1 "
          "route=unconfigured device=cuda")
BACKENDS = {"attention": "rlkernel.attention.deterministic.v1",
            "ffn": "rlkernel.ffn.qwen3.deterministic.v1",
            "logp": "rlkernel.linear_logp.bitwise.v1"}


def audit(version: str, seed: int, scope: str = "all_exported_parameters") -> dict[str, Any]:
    """One audit as RL-Kernel's `record_weight_update` writes it (two bf16 tensors)."""
    tensors = {
        name: {"sha256": hashlib.sha256(f"{name}:{seed}".encode()).hexdigest(),
               "shape": shape, "dtype": "torch.bfloat16"}
        for name, shape in (("model.embed_tokens.weight", [128, 64]),
                            ("lm_head.weight", [128, 64]))}
    digest = hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest()
    return {"version": version, "scope": scope, "sha256": digest, "tensor_count": len(tensors),
            "tensors": tensors}


def write_audit(d: Path, rel: str, data: dict[str, Any]) -> None:
    path = d / "weight-audit" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")  # upstream: indent=2, insertion order


def upstream_cell(tmp_path: Path, *, versions: tuple[str, ...] = ("weight_v000001",
                                                                   "weight_v000002"),
                  rollout: bool = False, **kw: Any) -> CellKit:
    """A clean cell whose weight audit and route lines are upstream's (the kit's legacy audits
    and `implementation=` lines removed)."""
    k = CellKit(tmp_path, **kw).write()
    for old in (k.dir / "weight-audit").glob("v0.*.json"):
        old.unlink()
    for i, v in enumerate(versions):
        write_audit(k.dir, f"{v}.json", audit(v, i))
        if rollout:
            write_audit(k.dir, f"rollout/{v}.json", audit(v, i, "rollout_loaded_parameters"))
    lines = [ln for ln in (k.dir / "run.log").read_text().splitlines()
             if "[RL-Kernel][route]" not in ln]
    for side, fw in SIDES.items():
        for m in BACKENDS:
            impl = k.impl(m, side)
            actual = BACKENDS[m] if impl == "rl_kernel" else f"{fw}.production.{m}"
            lines.append(f"(MegatronTrainRayActor pid=77) [RL-Kernel][route] framework={fw} "
                         f"target={side} module={m} requested={impl} actual={actual} "
                         "fallback=false")
    (k.dir / "run.log").write_text("\n".join(lines) + "\n")
    return k


def reasons(rec: dict[str, Any]) -> list[str]:
    return rec["reasons"]


# ---------------------------------------------------------------------------------------------
# Weight audits.


def test_per_version_training_audits_are_valid_without_a_rollout_audit(tmp_path: Path) -> None:
    rec = upstream_cell(tmp_path).analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    wa = rec["weight_audit"]
    assert wa["format"] == "upstream" and wa["versions"] == ["weight_v000001", "weight_v000002"]
    assert wa["rollout_audited"] is False and wa["problems"] == []
    assert wa["tensor_counts"] == {"weight_v000001": 2, "weight_v000002": 2}
    note = ("weight audit: the rollout side is not audited by the framework (no "
            "weight-audit/rollout/ and no weight_version in a rollout readback)")
    assert wa["notes"] == [note] and rec["validity"]["semantic"] == {"valid": True,
                                                                     "reasons": []}
    assert rec["route_line_form"] == "upstream"


def test_rollout_audit_required_by_the_site(tmp_path: Path) -> None:
    k = upstream_cell(tmp_path, policy={"backend": "cpu", "require_rollout_weight_audit": True})
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert reasons(rec) == [
        "weight audit: the rollout side is not audited by the framework (no "
        "weight-audit/rollout/ and no weight_version in a rollout readback): [matrix] "
        "require_rollout_weight_audit = true"]


def test_rollout_audit_agrees_or_names_the_version(tmp_path: Path) -> None:
    k = upstream_cell(tmp_path, rollout=True)
    rec = k.analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["weight_audit"]["rollout_audited"] is True
    write_audit(k.dir, "rollout/weight_v000002.json", audit("weight_v000002", 9,
                                                            "rollout_loaded_parameters"))
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    want = (f"weight version weight_v000002: sides hold different weights (training "
            f"{audit('weight_v000002', 1)['sha256'][:12]}, rollout "
            f"{audit('weight_v000002', 9)['sha256'][:12]})")
    assert reasons(rec) == [want]


def test_rollout_readback_version_counts_as_rollout_evidence(tmp_path: Path) -> None:
    k = upstream_cell(tmp_path)
    k.edit_readback("rollout", lambda d: d.update(weight_version="weight_v000002"))
    rec = k.analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["weight_audit"]["rollout_versions"] == ["weight_v000002"]
    k.edit_readback("rollout", lambda d: d.update(weight_version="weight_v000007"))
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert reasons(rec) == ["weight version weight_v000007: a rollout readback reports a version "
                            "the training side never exported"]


@pytest.mark.parametrize(("break_it", "reason"), [
    ("gap", "weight audit chain: versions 1..3 lack [2]: the chain has gaps"),
    ("twice", "weight audit chain: versions ['1', 'weight_v000001'] are the same version 1 "
              "twice"),
    ("digest", "weight audit weight-audit/weight_v000002.json: sha256 "),
    ("count", "weight audit weight-audit/weight_v000002.json: tensor_count 3 != 2 tensors"),
    ("keys", "weight audit weight-audit/weight_v000002.json: missing key(s) scope, tensors"),
    ("name", "weight audit weight-audit/weight_v000002.json: version 'weight_v000009' does not "
             "match the file name 'weight_v000002'"),
])
def test_a_broken_audit_chain_is_a_reason(tmp_path: Path, break_it: str, reason: str) -> None:
    k = upstream_cell(tmp_path)
    d = k.dir
    v2 = audit("weight_v000002", 1)
    if break_it == "gap":
        (d / "weight-audit" / "weight_v000002.json").unlink()
        write_audit(d, "weight_v000003.json", audit("weight_v000003", 2))
    elif break_it == "twice":
        write_audit(d, "1.json", audit("1", 5))
    elif break_it == "digest":
        v2["tensors"]["lm_head.weight"]["sha256"] = "0" * 64  # altered after the digest
        write_audit(d, "weight_v000002.json", v2)
    elif break_it == "count":
        write_audit(d, "weight_v000002.json", {**v2, "tensor_count": 3})
    elif break_it == "keys":
        write_audit(d, "weight_v000002.json", {k_: v2[k_] for k_ in ("version", "sha256",
                                                                      "tensor_count")})
    elif break_it == "name":
        write_audit(d, "weight_v000002.json", {**v2, "version": "weight_v000009"})
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert len(reasons(rec)) == 1 and reasons(rec)[0].startswith(reason), reasons(rec)


def test_no_training_audit_is_still_a_reason(tmp_path: Path) -> None:
    k = upstream_cell(tmp_path, versions=())
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert reasons(rec) == ["no weight-audit files: weight version not verified (training rank 0 "
                            "writes weight-audit/<version>.json)"]


def test_reader_recomputes_the_digest_as_upstream_writes_it(tmp_path: Path) -> None:
    write_audit(tmp_path, "0.json", audit("0", 3))
    problems: list[str] = []
    wa = read_weight_audits(tmp_path, problems)
    assert problems == [] and wa.problems == [] and wa.training == {"0": audit("0", 3)["sha256"]}


# ---------------------------------------------------------------------------------------------
# Route lines.


def test_actual_production_backend_under_an_rl_kernel_readback_is_a_fallback(
        tmp_path: Path) -> None:
    k = upstream_cell(tmp_path)
    k.log("[RL-Kernel][route] framework=vllm target=rollout module=attention "
          "requested=rl_kernel actual=vllm.production.attention fallback=false")
    rec = k.analyze()
    assert rec["verdict"] == "fallback"
    assert reasons(rec) == ["attention rollout: run.log route line says "
                            "actual=vllm.production.attention although R was requested: not an "
                            "RL-Kernel backend (fallback)"]


def test_upstream_fallback_true_is_caught(tmp_path: Path) -> None:
    k = upstream_cell(tmp_path)
    line = ("[RL-Kernel][route] framework=megatron target=training module=ffn "
            "requested=rl_kernel actual=rlkernel.ffn.qwen3.deterministic.v1 fallback=true")
    k.log(line)
    rec = k.analyze()
    assert rec["verdict"] == "fallback"
    assert reasons(rec) == [f"run.log: {line}"]


def test_requested_differing_from_the_case_is_incomparable(tmp_path: Path) -> None:
    k = upstream_cell(tmp_path)
    k.log("[RL-Kernel][route] framework=megatron target=training module=ffn "
          "requested=production actual=rlkernel.ffn.qwen3.deterministic.v1 fallback=false")
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert reasons(rec) == ["route: ffn training: run.log route line says requested=production "
                            "but the case requests rl_kernel (R)"]


def test_legacy_implementation_lines_are_read_and_recorded_as_legacy(tmp_path: Path) -> None:
    k = CellKit(tmp_path).write()  # the kit prints `implementation=` lines
    rec = k.analyze()
    assert rec["verdict"] == "valid" and rec["route_line_form"] == "legacy"
    assert rec["weight_audit"]["format"] == "legacy"
    k.log("[RL-Kernel][route] framework=vllm target=rollout module=ffn case=R/R "
          "implementation=production fallback=false")
    rec = k.analyze()
    assert rec["verdict"] == "fallback"
    assert reasons(rec) == ["ffn rollout: run.log route line says implementation=production "
                            "although R was requested (fallback)"]


# ---------------------------------------------------------------------------------------------
# Readbacks: installed_hooks, production records, native Megatron logp.


def _native_logp(k: CellKit) -> None:
    """The training readback as RL-Kernel writes it when Megatron's logp is native: hooks and
    records for attention/FFN (production included), no hook and no record for logp."""
    def edit(d: dict[str, Any]) -> None:
        d["operators"].pop("logp")
        d["installed_hooks"] = {"attention": "vime.patches.attention,rl_engine.attention",
                                "ffn": "vime.patches.ffn"}
    k.edit_readback("training", edit)


def test_native_logp_marker_is_evidence_for_the_training_side(tmp_path: Path) -> None:
    k = upstream_cell(tmp_path, module="logp", case="P/R")
    _native_logp(k)
    lines = [ln for ln in (k.dir / "run.log").read_text().splitlines()
             if "target=training module=logp" not in ln]
    (k.dir / "run.log").write_text("\n".join([*lines, f"[time] ppo_utils.py:88 - {NATIVE}"])
                                   + "\n")
    rec = k.analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["native_logp_marker"] == NATIVE
    assert rec["actual_training_implementation"] == "production"
    assert rec["training_backend_id"] == "vime.utils.ppo_utils.calculate_log_probs_and_entropy"
    assert rec["installed_hooks"]["training"] == {
        "attention": "vime.patches.attention,rl_engine.attention", "ffn": "vime.patches.ffn"}


def test_sidecar_marker_of_the_same_case_is_evidence_too(tmp_path: Path) -> None:
    k = upstream_cell(tmp_path, module="logp", case="P/R")
    _native_logp(k)
    k.log("INFO tis_metrics.py:41 - rlkernel mismatch sidecar active: logp_case=P/R")
    rec = k.analyze()
    assert rec["verdict"] == "valid", rec["reasons"]


def test_native_logp_without_record_or_marker_is_a_reason(tmp_path: Path) -> None:
    k = upstream_cell(tmp_path, module="logp", case="P/R")
    _native_logp(k)
    k.log("INFO tis_metrics.py:41 - rlkernel mismatch sidecar active: logp_case=R/R")  # another
    rec = k.analyze()
    assert rec["verdict"] == "error"
    assert reasons(rec) == [
        "logp training: native (production) logp has no readback record and run.log has no "
        "native backend marker ('linear_logp native active: ... "
        "contract_id=vime.native.linear_logp.v1' or 'rlkernel mismatch sidecar active: "
        "logp_case=P/R'): P route unproven"]


# ---------------------------------------------------------------------------------------------
# bitwise-validation.json.


def _bitwise(errors: list[str], mismatch: int | None, passed_readbacks: bool = True,
             ) -> dict[str, Any]:
    return {"schema_version": "rlkernel.vime_cuda_bitwise_validation.v1", "passed": False,
            "runtime_policy": {"platform": "cuda", "triton_allowed": False},
            "readbacks": {"passed": passed_readbacks, "errors": []},
            "train_rollout_logp": {"passed": False, "torch_equal": False,
                                   "mismatch_count": mismatch, "max_abs_diff": None,
                                   "sample_count": 0, "element_count": 0, "errors": errors,
                                   "artifacts": []}}


def test_bitwise_validation_without_log_probs_is_unavailable_not_a_failure(
        tmp_path: Path) -> None:
    k = upstream_cell(tmp_path)
    k.write_json("bitwise-validation.json", _bitwise([
        "train-data/rollout_0.rank0.pt rollout_data lacks list log_probs/rollout_log_probs",
        "no comparable train/rollout samples were found"], 0))
    rec = k.analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["mismatch_count"] == 0 and rec["contract"]["kind"] == "bitwise"
    assert rec["offline_comparison"]["status"] == "unavailable"


def test_bitwise_validation_real_failure_stays_a_reason(tmp_path: Path) -> None:
    k = upstream_cell(tmp_path)
    data = _bitwise([], 3)
    data["train_rollout_logp"]["max_abs_diff"] = 0.0625
    k.write_json("bitwise-validation.json", data)
    rec = k.analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert rec["offline_comparison"]["status"] == "failed"
    assert len(reasons(rec)) == 1
    assert reasons(rec)[0].startswith("bitwise-validation.json: passed=False (RL-Kernel's "
                                      "validator fails this all-R run): {")
    k.write_json("bitwise-validation.json", _bitwise([
        "no comparable train/rollout samples were found"], 0, passed_readbacks=False))
    rec = k.analyze()  # readback errors are a real failure even with nothing to compare
    assert rec["verdict"] == "contract_mismatch"
    assert rec["offline_comparison"]["status"] == "failed"
