"""Read what vime's consistency audit leaves in a run (RL-Align/vime
`vime/utils/consistency_audit.py`, `consistency_metadata.py`, `dlogp_diagnostics.py`), when a
job writes it, and check its metadata as vime's audit checks it.

Where it is: vime's training batch carries the audit's records, and its debug dump
(`train-data/{rollout_id}.rank{rank}.pt`, `torch.save({"rollout_id", "rank", "rollout_data"})`)
holds them (vime's own reader `tools/consistency_drift_report.load_consistency_artifacts` looks in
the dump and its `rollout_data`): `consistency_replay_manifest` (or `replay_manifest`: the
samples, the five `batch_invariance_cases` per sample, `validation`, `mode`),
`consistency_result_cube` (or `result_cube`: `axes`, `metrics` with `runtime_fallback`,
`runtime_strict_failure`, `metadata_failure_count`), the per-sample `consistency_metadata`, the
`consistency_batch_layout_fingerprints` and `consistency_metadata_validation` (`warnings`,
`failures`). The `rlk_audit_*` metrics (`compute_dlogp_diagnostics` and the audit's bookkeeping)
come in vime's step records of run.log, under any logger prefix.

Semantic validity (the cell's semantic judgement, never a pass by default): every sample's
metadata must carry what `consistency_audit.AUDIT_REQUIRED_METADATA_FIELDS` names (session id,
batch layout fingerprint, position/cache fingerprint, quantization fingerprint, weight update
status `weight.pre_update`); failures the audit itself recorded, a runtime fallback or strict
failure in its cube, and a batch without metadata are reasons too. vime reports the missing
fields as warnings in `audit` mode; here they keep the cell from valid in every mode, since a
comparison whose preconditions are unknown is not judged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.store.safeio import listing

# consistency_audit.AUDIT_REQUIRED_METADATA_FIELDS at ad10c53
REQUIRED = (("sample.session_id", "session_id_missing"),
            ("batch_layout.fingerprint", "batch_layout_missing"),
            ("position_cache.fingerprint", "position_cache_metadata_missing"),
            ("quantization.fingerprint", "quantization_metadata_missing"),
            ("weight.pre_update", "weight_update_status_missing"))
AUDIT_KEYS = ("consistency_replay_manifest", "replay_manifest", "consistency_result_cube",
              "result_cube", "consistency_metadata", "consistency_metadata_validation")
REPLAY_CASES = ("same_sample_alone", "same_sample_mixed_batch", "padding_packing_variant",
                "active_token_density_variant", "dynamic_sampling_keep_drop_variant")
METRIC_PREFIX = "rlk_audit_"
MAX_DUMPS = 4096


def _plain(value: Any) -> Any:
    """torch tensors and numpy arrays as Python values (lists / numbers)."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _path(value: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def _records(value: Any) -> list[Mapping[str, Any] | None]:
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [value]
    if isinstance(value, list | tuple):
        return [v if isinstance(v, Mapping) else None for v in value]
    return []


def _first(*values: Any) -> Any:
    for v in values:
        if v not in (None, ""):
            return v
    return None


def _scopes(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    out = [data]
    for key in ("rollout_data", "data", "payload"):
        if isinstance(data.get(key), Mapping):
            out.append(data[key])
    return out


def check_batch(batch: Mapping[str, Any], where: str) -> list[str]:
    """vime's metadata validation of one batch, as semantic reasons naming `where`."""
    reasons: list[str] = []
    records = _records(batch.get("consistency_metadata"))
    layouts = _records(batch.get("consistency_batch_layout_fingerprints"))
    if not records:
        reasons.append(f"vime consistency audit ({where}): consistency_metadata_missing: the "
                       "batch carries no per-sample consistency metadata")
    missing: dict[tuple[str, str], list[int]] = {}
    for i, record in enumerate(records):
        if record is None:
            missing.setdefault(("consistency_metadata", "consistency_metadata_missing"),
                               []).append(i)
            continue
        layout = layouts[i] if i < len(layouts) and layouts[i] is not None else {}
        for field, code in REQUIRED:
            value = _first(layout.get("fingerprint") if field == "batch_layout.fingerprint"
                           else None, _path(record, field))
            if value is None:
                missing.setdefault((field, code), []).append(i)
    for (field, code), rows in missing.items():
        shown = ", ".join(str(r) for r in rows[:6]) + (" ..." if len(rows) > 6 else "")
        reasons.append(f"vime consistency audit ({where}): {code}: {field} missing for "
                       f"{len(rows)} of {len(records)} samples (positions {shown})")
    validation = batch.get("consistency_metadata_validation")
    if isinstance(validation, Mapping):
        for issue in _records(validation.get("failures"))[:8]:
            if issue is not None:
                reasons.append(f"vime consistency audit ({where}): metadata failure "
                               f"{issue.get('code')}: {str(issue.get('message') or '')[:160]}")
    cube = _first(batch.get("consistency_result_cube"), batch.get("result_cube"))
    metrics = cube.get("metrics") if isinstance(cube, Mapping) else None
    if isinstance(metrics, Mapping):
        if metrics.get("runtime_fallback"):
            reasons.append(f"vime consistency audit ({where}): its result cube records a "
                           "linear_logp runtime fallback")
        if metrics.get("runtime_strict_failure"):
            reasons.append(f"vime consistency audit ({where}): its result cube records a "
                           "linear_logp runtime strict failure")
    return reasons


def _summary(batch: Mapping[str, Any]) -> dict[str, Any]:
    manifest = _first(batch.get("consistency_replay_manifest"), batch.get("replay_manifest"))
    cube = _first(batch.get("consistency_result_cube"), batch.get("result_cube"))
    out: dict[str, Any] = {}
    if isinstance(manifest, Mapping):
        cases = Counter(str(c.get("case")) for c in _records(manifest.get("batch_invariance_cases"))
                        if c is not None)
        out["replay_manifest"] = {
            "mode": manifest.get("mode"), "sample_count": manifest.get("sample_count"),
            "fingerprint": manifest.get("fingerprint"),
            "batch_invariance_cases": {c: cases.get(c, 0) for c in REPLAY_CASES},
            "other_cases": sorted(c for c in cases if c not in REPLAY_CASES)}
    if isinstance(cube, Mapping):
        out["result_cube"] = {"axes": _plain(cube.get("axes")),
                              "metrics": _plain(cube.get("metrics")),
                              "worst_token": _plain(cube.get("worst_token"))}
    return out


def audit_metrics(step_records: Any) -> dict[str, dict[str, float]]:
    """The `rlk_audit_*` figures of run.log's step records: step -> {name: value}."""
    out: dict[str, dict[str, float]] = {}
    for step, record in step_records or []:
        if not isinstance(record, Mapping):
            continue
        got = {str(k).rsplit("/", 1)[-1]: float(v) for k, v in record.items()
               if METRIC_PREFIX in str(k) and isinstance(v, int | float)
               and not isinstance(v, bool)}
        if got:
            out[str(step)] = got
    return out


def read_vime_audit(root: Path, step_records: Any, load: Any,
                    problems: list[str]) -> tuple[dict[str, Any] | None, list[str]]:
    """(what vime's audit left in `root`, or None when it left nothing; semantic reasons).
    `load(path, root, problems)`: the evidence's `.pt` loader ((dict, sha256) or None)."""
    dumps = listing(root / "train-data", "*.pt", root, problems)[:MAX_DUMPS]
    files: dict[str, Any] = {}
    reasons: list[str] = []
    for path in dumps:
        loaded = load(path, root, problems)
        if loaded is None:
            continue
        data = loaded[0]
        for scope in _scopes(data):
            if any(k in scope for k in AUDIT_KEYS):
                where = f"train-data/{path.name}"
                batch = {k: _plain(scope.get(k)) for k in
                         (*AUDIT_KEYS, "consistency_batch_layout_fingerprints")}
                files[where] = _summary(batch)
                reasons.extend(check_batch(batch, where))
                break
    metrics = audit_metrics(step_records)
    if not files and not metrics:
        return None, []
    out = {"files": files, "rlk_audit_metrics": metrics,
           "source": "vime consistency audit (consistency_audit.py @ad10c53)"}
    if metrics and not files:
        out["note"] = ("run.log has rlk_audit_* metrics but no dump holds the audit's "
                       "manifest or metadata: the metadata validation could not be checked")
    return out, reasons


def read_vime(ev: Any, load: Any) -> None:
    """`evidence.read_evidence`'s hook (after run.log is scanned): `ev.vime_audit` and the
    semantic reasons `ev.vime_semantic`; `load`: the evidence's `.pt` loader (`_load_pt`).
    Never raises for a bad file."""
    try:
        ev.vime_audit, ev.vime_semantic = read_vime_audit(
            ev.root, ev.log.records.get("step"), load, ev.problems)
    except Exception as exc:  # a reader bug or an unforeseen shape: fail closed, go on
        ev.problems.append(f"vime audit: {type(exc).__name__}: {str(exc)[:200]}")
