"""The generated inputs of the vime golden differential (issue 50): vime debug dumps
`train-data/{rollout_id}.rank{rank}.pt` (vime's `save_debug_train_data`: `torch.save({"rollout_id",
"rank", "rollout_data"})`), systematically: equal, one ulp, signed zero, NaN (active and inactive),
drift, bf16, masks, zero-active samples, length and count mismatches, missing metadata fields,
metadata for fewer samples than the batch, and a fallback in each place vime records one.

Pure torch, deterministic: `write(name, folder)` makes the dump; `CASES` names them. Both the
upstream runner (`run_upstream.py`, needs vime's code) and the test
(`tests/test_golden_upstream.py`,
does not) build the inputs from here, so the golden verdicts are of exactly these bytes.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

LENGTHS = (6, 9, 5)  # response tokens per sample


def record(i: int, **over: Any) -> dict[str, Any]:
    """One sample's `build_rollout_consistency_metadata` record, every field vime's audit and
    comparison require present (`over`: dotted paths to replace, None deletes the value)."""
    rec: dict[str, Any] = {
        "schema_version": 1,
        "sample": {"group_index": 0, "index": i, "rollout_id": 0, "session_id": f"s-{i}",
                   "status": "completed"},
        "tokens": {"total_token_count": 12, "response_length": LENGTHS[i % 3],
                   "token_ids_fingerprint": f"sha256:{i:064x}",
                   "response_token_ids_fingerprint": f"sha256:{i + 10:064x}"},
        "active_mask": {"response_length": LENGTHS[i % 3], "active_token_count": 4,
                        "mask_fingerprint": "sha256:" + "1" * 64, "zero_active_tokens": False},
        "tokenizer": {"fingerprint": "sha256:" + "2" * 64},
        "sampling": {"params_fingerprint": "sha256:" + "3" * 64, "summary": {"top_p": 1.0}},
        "padding": {"side": "right"},
        "position_cache": {"fingerprint": "sha256:" + "4" * 64},
        "quantization": {"fingerprint": "sha256:" + "5" * 64, "summary": {"policy": "none"}},
        "parallel_placement": {"fingerprint": None, "summary": {}},
        "model": {"name": "Qwen3-8B"},
        "old_logp": {"source": "rollout_engine", "contract_id": "linear_logp:tp=1:cp=1:vocab=8",
                     "num_values": LENGTHS[i % 3], "fingerprint": "sha256:" + "6" * 64},
        "weight": {"version": 1, "versions_fingerprint": None, "pre_update": True},
        "provenance": {"requested": {"backend": "rl_kernel"}, "actual": {"backend": "rl_kernel"},
                       "requested_fingerprint": "sha256:" + "8" * 64,
                       "actual_fingerprint": "sha256:" + "7" * 64,
                       "mismatches": {}, "undeclared_fallback": False},
        "batch_layout": {"fingerprint": f"sha256:{100 + i:064x}"},
        "dynamic_sampling": None,
        "fingerprint": f"sha256:{200 + i:064x}",
    }
    for path, value in over.items():
        *head, last = path.split(".")
        node = rec
        for part in head:
            node = node[part]
        node[last] = value
    return rec


def _base(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(50)
    train = [-torch.rand(n, generator=g) * 3 for n in LENGTHS]
    masks = [torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 1][:n], dtype=torch.int64) for n in LENGTHS]
    rollout = [t.clone() for t in train]
    for r, m in zip(rollout, masks, strict=True):  # inactive tokens differ: masks must matter
        r[m == 0] += 0.5
    return {"log_probs": [t.to(dtype) for t in train],
            "rollout_log_probs": [r.to(dtype) for r in rollout], "loss_masks": masks}


def _audit(rd: dict[str, Any], records: list[dict[str, Any]] | None = None,
           **extra: Any) -> dict[str, Any]:
    n = len(rd["log_probs"])
    records = [record(i) for i in range(n)] if records is None else records
    rd.update({
        "consistency_metadata": records,
        "consistency_batch_layout_fingerprints": [
            {"fingerprint": (r.get("batch_layout") or {}).get("fingerprint")} for r in records],
        "consistency_replay_manifest": {
            "schema_version": 1, "mode": "audit", "sample_count": n,
            "samples": [{"sample_index": i, "rollout_id": 0} for i in range(n)],
            "batch_invariance_cases": [], "validation": {"warnings": [], "failures": []},
            "fingerprint": "sha256:" + "9" * 64},
    })
    rd.update(extra)
    return rd


def _set(t: torch.Tensor, at: int, value: float) -> torch.Tensor:
    t = t.clone()
    t[at] = value
    return t


def build(name: str) -> dict[str, Any]:
    """The dump's dict for case `name`."""
    rd = _base()
    if name == "equal_active_inactive_differ":
        pass
    elif name == "one_ulp_active":
        t = rd["log_probs"][0]
        rd["log_probs"][0] = _set(t, 2, float(torch.nextafter(t[2], torch.tensor(0.0))))
    elif name == "one_ulp_inactive":
        t = rd["log_probs"][0]
        rd["log_probs"][0] = _set(t, 0, float(torch.nextafter(t[0], torch.tensor(0.0))))
    elif name == "signed_zero_active":
        rd["log_probs"][1] = _set(rd["log_probs"][1], 3, 0.0)
        rd["rollout_log_probs"][1] = _set(rd["rollout_log_probs"][1], 3, -0.0)
    elif name == "nan_active":
        rd["log_probs"][2] = _set(rd["log_probs"][2], 1, float("nan"))
    elif name == "nan_both_active":
        rd["log_probs"][2] = _set(rd["log_probs"][2], 1, float("nan"))
        rd["rollout_log_probs"][2] = _set(rd["rollout_log_probs"][2], 1, float("nan"))
    elif name == "nan_inactive":
        rd["log_probs"][2] = _set(rd["log_probs"][2], 0, float("nan"))
    elif name == "inf_active":
        rd["log_probs"][0] = _set(rd["log_probs"][0], 1, float("-inf"))
    elif name == "drift":
        g = torch.Generator().manual_seed(7)
        rd["rollout_log_probs"] = [r + torch.randn(r.numel(), generator=g) * 0.2
                                   for r in rd["rollout_log_probs"]]
    elif name == "bf16_equal":
        rd = _base(torch.bfloat16)
    elif name == "bf16_vs_fp32":
        rd["log_probs"] = [t.to(torch.bfloat16) for t in rd["log_probs"]]
    elif name == "float_masks":
        rd["loss_masks"] = [m.to(torch.float32) for m in rd["loss_masks"]]
    elif name == "no_masks":
        del rd["loss_masks"]
    elif name == "zero_active_sample":
        rd["loss_masks"][1] = torch.zeros_like(rd["loss_masks"][1])
    elif name == "mask_length_mismatch":
        rd["loss_masks"][0] = rd["loss_masks"][0][:-1]
    elif name == "mask_count_mismatch":
        rd["loss_masks"] = rd["loss_masks"][:2]
    elif name == "audit_complete":
        _audit(rd)
    elif name == "audit_missing_contract_id":
        _audit(rd, [record(0), record(1, **{"old_logp.contract_id": None}), record(2)])
    elif name == "audit_missing_session_id":
        _audit(rd, [record(0, **{"sample.session_id": None}), record(1), record(2)])
    elif name == "audit_missing_tokenizer":
        _audit(rd, [record(0), record(1), record(2, **{"tokenizer.fingerprint": ""})])
    elif name == "audit_metadata_for_fewer_samples":
        _audit(rd, [record(0), record(1)])
    elif name == "audit_provenance_mismatch":
        _audit(rd, [record(0, **{"provenance.mismatches": {"backend": {
            "requested": "rl_kernel", "actual": "native"}}}), record(1), record(2)])
    elif name == "fallback_manifest_runtime_provenance":
        _audit(rd)
        rd["consistency_replay_manifest"]["runtime_provenance"] = {
            "requested_backend": "rl_kernel", "actual_backend": "native", "fallback": True}
    elif name == "fallback_dump_runtime_provenance":
        _audit(rd, consistency_runtime_provenance={"actual_backend": "native", "fallback": True})
    elif name == "strict_failure_runtime_provenance":
        _audit(rd, runtime_provenance={"actual_backend": "rl_kernel", "strict_failure": True})
    elif name == "fallback_validation_warning":
        _audit(rd, consistency_metadata_validation={
            "mode": "audit", "ok": True, "warnings": [{
                "code": "undeclared_runtime_fallback", "severity": "warning",
                "message": "Actual provenance reports fallback that was not declared in "
                           "requested provenance.", "sample_index": 0, "rollout_id": 0,
                "field": "provenance.undeclared_fallback"}], "failures": []})
        rd["consistency_replay_manifest"]["validation"] = copy.deepcopy(
            rd["consistency_metadata_validation"])
    elif name == "fallback_sample_undeclared":
        _audit(rd, [record(0), record(1, **{"provenance.actual": {"backend": "native",
                                                                   "fallback": True},
                                            "provenance.undeclared_fallback": True}),
                    record(2)])
    elif name == "fallback_sample_declared":
        _audit(rd, [record(0), record(1, **{
            "provenance.requested": {"backend": "rl_kernel", "fallback": True},
            "provenance.actual": {"backend": "native", "fallback": True},
            "provenance.undeclared_fallback": False}), record(2)])
    elif name == "fallback_result_cube":
        _audit(rd, consistency_result_cube={
            "schema_version": 1, "mode": "audit", "axes": {},
            "metrics": {"max_abs_dlogp": 0.0, "warning_count": 0.0, "runtime_fallback": True,
                        "runtime_strict_failure": False}})
    elif name == "metadata_failure_recorded":
        _audit(rd, consistency_metadata_validation={
            "mode": "strict", "ok": False, "warnings": [], "failures": [{
                "code": "token_ids_missing", "severity": "error", "message": "missing",
                "sample_index": 0, "rollout_id": 0, "field": "tokens"}]})
        rd["consistency_replay_manifest"]["validation"] = copy.deepcopy(
            rd["consistency_metadata_validation"])
    else:
        raise KeyError(name)
    return {"rollout_id": 0, "rank": 0, "rollout_data": rd}


CASES = ("equal_active_inactive_differ", "one_ulp_active", "one_ulp_inactive",
         "signed_zero_active", "nan_active", "nan_both_active", "nan_inactive", "inf_active",
         "drift", "bf16_equal", "bf16_vs_fp32", "float_masks", "no_masks", "zero_active_sample",
         "mask_length_mismatch", "mask_count_mismatch", "audit_complete",
         "audit_missing_contract_id", "audit_missing_session_id", "audit_missing_tokenizer",
         "audit_metadata_for_fewer_samples", "audit_provenance_mismatch",
         "fallback_manifest_runtime_provenance", "fallback_dump_runtime_provenance",
         "strict_failure_runtime_provenance", "fallback_validation_warning",
         "fallback_sample_undeclared", "fallback_sample_declared", "fallback_result_cube",
         "metadata_failure_recorded")


def write(name: str, folder: Path) -> Path:
    """`folder/train-data/0.rank0.pt` for case `name` (the folder is a run directory)."""
    path = folder / "train-data" / "0.rank0.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(build(name), path)
    return path
