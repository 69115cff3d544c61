"""Generate vime consistency-audit fixtures: tests/data/vime_audit/{complete,missing}/train-data/.

    python tests/data/vime_audit/make_fixtures.py

NOT written by vime's own code: running `vime.utils.consistency_audit.run_consistency_audit`
needs `consistency_metadata.py`, `dlogp_diagnostics.py` and `consistency_audit.py` (RL-Align/vime,
about 75,000 characters) assembled in a scratch folder, which this session did not do. The dumps
are built to the schema read from that code (RL-Align/vime at the commits the search tool
holds: consistency_audit.py @ad10c53, consistency_metadata.py @19a6162): vime's debug dump
`train-data/{rollout_id}.rank{rank}.pt` = `torch.save({"rollout_id", "rank", "rollout_data"})`,
whose `rollout_data` carries, besides `log_probs` / `rollout_log_probs` / `loss_masks`, the
training batch's `consistency_metadata` (one `build_rollout_consistency_metadata` record per
sample: `sample.session_id`, `batch_layout`, `position_cache.fingerprint`,
`quantization.fingerprint`, `weight.pre_update`, ...), `consistency_batch_layout_fingerprints`,
`consistency_metadata_validation` (`ConsistencyMetadataValidation.to_dict()`),
`consistency_replay_manifest` (`build_consistency_replay_manifest`, with the five
`batch_invariance_cases` per sample) and `consistency_result_cube`
(`build_consistency_result_cube`).

- `complete`: 3 samples, every field the audit requires present;
- `missing`: the same with sample 1's session id, sample 2's quantization fingerprint and every
  sample's weight update status missing, and the cube recording a runtime fallback.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CASES = ("same_sample_alone", "same_sample_mixed_batch", "padding_packing_variant",
         "active_token_density_variant", "dynamic_sampling_keep_drop_variant")


def _record(i: int) -> dict:
    return {
        "schema_version": 1,
        "sample": {"group_index": 0, "index": i, "rollout_id": 0, "session_id": f"s-{i}",
                   "status": "completed"},
        "tokens": {"total_token_count": 8, "response_length": 4,
                   "token_ids_fingerprint": f"sha256:{i:064x}",
                   "response_token_ids_fingerprint": f"sha256:{i + 10:064x}"},
        "active_mask": {"response_length": 4, "active_token_count": 4,
                        "mask_fingerprint": "sha256:" + "1" * 64, "zero_active_tokens": False},
        "tokenizer": {"fingerprint": "sha256:" + "2" * 64},
        "sampling": {"params_fingerprint": "sha256:" + "3" * 64,
                     "summary": {"temperature": 1.0, "top_p": 1.0}},
        "padding": {"side": "right"},
        "position_cache": {"fingerprint": "sha256:" + "4" * 64},
        "quantization": {"fingerprint": "sha256:" + "5" * 64, "summary": {"policy": "none"}},
        "parallel_placement": {"fingerprint": None, "summary": {}},
        "model": {"name": "Qwen3-8B"},
        "old_logp": {"source": "rollout_engine", "contract_id": "contract-v1", "num_values": 4,
                     "fingerprint": "sha256:" + "6" * 64},
        "weight": {"version": 1, "versions_fingerprint": None, "pre_update": True},
        "provenance": {"requested": {}, "actual": {"backend": "native"},
                       "requested_fingerprint": None, "actual_fingerprint": "sha256:" + "7" * 64,
                       "mismatches": {}, "undeclared_fallback": False},
        "batch_layout": {"fingerprint": f"sha256:{100 + i:064x}"},
        "dynamic_sampling": None,
        "fingerprint": f"sha256:{200 + i:064x}",
    }


def _batch(records: list[dict], fallback: bool) -> dict:
    n = len(records)
    cases = [{"sample_position": i, "sample_index": i, "rollout_id": 0, "case": c,
              "varied_axes": [], "expected": "..."} for i in range(n) for c in CASES]
    return {
        "log_probs": [torch.full((4,), -1.0) for _ in range(n)],
        "rollout_log_probs": [torch.full((4,), -1.0) for _ in range(n)],
        "loss_masks": [torch.ones(4, dtype=torch.int64) for _ in range(n)],
        "sample_indices": list(range(n)), "rollout_ids": [0] * n,
        "consistency_metadata": records,
        "consistency_batch_layout_fingerprints": [
            {"fingerprint": (r.get("batch_layout") or {}).get("fingerprint"),
             "active_mask_density": 1.0} for r in records],
        "consistency_metadata_validation": {"mode": "audit", "ok": True,
                                            "active_token_count": 4 * n,
                                            "zero_active_token_samples": [], "warnings": [],
                                            "failures": []},
        "consistency_replay_manifest": {
            "schema_version": 1, "metadata_schema_version": 1, "mode": "audit", "rank": 0,
            "sample_count": n, "samples": [{"sample_position": i} for i in range(n)],
            "batch_invariance_cases": cases, "validation": {}, "runtime_provenance": {},
            "runtime_provenance_fingerprint": None, "fingerprint": "sha256:" + "8" * 64},
        "consistency_result_cube": {
            "schema_version": 1, "mode": "audit", "rank": 0,
            "axes": {"batch_layout": None, "dtype": "bf16", "tp": 2, "cp": 2,
                     "logp_backend": "native"},
            "metrics": {"active_token_count": 4.0 * n, "max_abs_dlogp": 0.0,
                        "warning_count": 0.0, "metadata_warning_count": 0.0,
                        "metadata_failure_count": 0.0, "sample_count": float(n),
                        "runtime_fallback": 1.0 if fallback else 0.0,
                        "runtime_strict_failure": 0.0},
            "worst_token": None, "fingerprint": "sha256:" + "9" * 64},
    }


def _write(name: str, batch: dict) -> None:
    out = HERE / name / "train-data"
    if out.parent.exists():
        shutil.rmtree(out.parent)
    out.mkdir(parents=True)
    torch.save({"rollout_id": 0, "rank": 0, "rollout_data": batch}, out / "0.rank0.pt")


if __name__ == "__main__":
    records = [_record(i) for i in range(3)]
    _write("complete", _batch(records, fallback=False))
    broken = copy.deepcopy(records)
    broken[1]["sample"]["session_id"] = None
    broken[2]["quantization"]["fingerprint"] = None
    for r in broken:
        r["weight"]["pre_update"] = None
    _write("missing", _batch(broken, fallback=True))
