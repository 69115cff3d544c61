"""A factor cell against its baseline cell: the same prompts and seed, one factor changed.

`compare_runs` reads both run directories (`evidence.read_evidence`) and reports, per pair of
samples (rank, sample index): were the sampled tokens the same, and on the positions both
rollouts reached with the same tokens, how many rollout (and training) logprobs differ. It also
carries each cell's own train/rollout drift, whether the two sides' weight audits agree, and
what the workload says the factor did (`manifest.json` `factors`). The words are made in
`report.attribution`; nothing here decides a verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.judge.read.evidence import Evidence, read_evidence
from pytest_rlkernel_matrix.judge.read.metrics import Sample

JUDGED_BASELINE = ("valid", "contract_mismatch")


def _drift(ev: Evidence) -> dict[str, Any] | None:
    m = ev.metrics
    if m is None:
        return None
    return {"mismatch_count": m.mismatch_count, "active_token_count": m.active_token_count,
            "logprob_abs_diff_max": m.logprob_abs_diff_max,
            "logprob_abs_diff_mean": m.logprob_abs_diff_mean}


def _weights_differ(ev: Evidence) -> bool | None:
    if not ev.weight_versions:
        return None
    return any(len(set(by.values())) > 1 for by in ev.weight_versions.values())


def _common_prefix(a: Sample, b: Sample) -> tuple[int, bool | None]:
    """Response positions both rollouts reached with the same tokens, and whether all tokens
    (prompt and response) are equal (None: a sidecar carries no tokens)."""
    n = min(a.rollout.size, b.rollout.size)
    if a.tokens is None or b.tokens is None:
        return (n if a.rollout.size == b.rollout.size else 0), None
    equal = a.tokens.shape == b.tokens.shape and bool(np.array_equal(a.tokens, b.tokens))
    ra, rb = a.tokens[a.tokens.size - a.rollout.size:], b.tokens[b.tokens.size - b.rollout.size:]
    pa, pb = a.tokens[:a.tokens.size - a.rollout.size], b.tokens[:b.tokens.size - b.rollout.size]
    if not np.array_equal(pa, pb):
        return 0, False
    diff = np.nonzero(ra[:n] != rb[:n])[0]
    # position j's logprob is of token j: comparable while tokens 0..j agree
    return (int(diff[0]) if diff.size else n), equal


def compare_samples(own: list[Sample], base: list[Sample]) -> dict[str, Any]:
    """Token and logprob differences between two runs' samples, paired by (step, rank, sample)
    (one sidecar per rank per step)."""
    by_key = {(s.call, s.rank, s.sample): s for s in base}
    own_keys = [(s.call, s.rank, s.sample) for s in own]
    duplicates = (len(own_keys) - len(set(own_keys))) + (len(base) - len(by_key))
    out: dict[str, Any] = {"samples": 0, "unpaired_samples": 0, "samples_tokens_differ": 0,
                           "compared_logprobs": 0, "rollout_logprobs_differ": 0,
                           "train_logprobs_differ": 0, "rollout_max_abs_diff": 0.0,
                           "samples_lengths_differ": 0, "tokens_known": True,
                           "duplicate_samples": duplicates}
    for s in own:
        b = by_key.get((s.call, s.rank, s.sample))
        if b is None:
            out["unpaired_samples"] += 1
            continue
        out["samples"] += 1
        n, equal = _common_prefix(s, b)
        if s.rollout.size != b.rollout.size:
            # different lengths are a difference: every position one response has and the
            # other lacks is a compared logprob that differs (never "0 of 0 differ")
            extra = abs(int(s.rollout.size) - int(b.rollout.size))
            out["samples_lengths_differ"] += 1
            out["compared_logprobs"] += extra
            out["rollout_logprobs_differ"] += extra
            out["train_logprobs_differ"] += extra
            out["rollout_max_abs_diff"] = float("inf")
            if equal is not False:
                out["samples_tokens_differ"] += 1
                equal = False
        if equal is None:
            out["tokens_known"] = False
        elif not equal:
            out["samples_tokens_differ"] += 1
        mask = (s.mask[:n] != 0) & (b.mask[:n] != 0)
        ra, rb = s.rollout[:n][mask], b.rollout[:n][mask]
        ta, tb = s.train[:n][mask], b.train[:n][mask]
        out["compared_logprobs"] += int(mask.sum())
        out["rollout_logprobs_differ"] += int(np.count_nonzero(ra != rb))
        out["train_logprobs_differ"] += int(np.count_nonzero(ta != tb))
        if ra.size:
            d = np.abs(ra.astype(np.float64) - rb.astype(np.float64))
            out["rollout_max_abs_diff"] = max(out["rollout_max_abs_diff"], float(np.max(d)))
    out["unpaired_samples"] += max(0, len(base) - out["samples"])
    out["tokens_equal"] = (out["samples_tokens_differ"] == 0 and out["tokens_known"]
                           and out["unpaired_samples"] == 0)
    if out["rollout_max_abs_diff"] == float("inf"):
        out["rollout_max_abs_diff"] = None  # (lengths differ: no finite figure; JSON-safe)
    return out


def compare_runs(own_dir: Path | None, base_dir: Path | None,
                 base_record: Mapping[str, Any]) -> dict[str, Any]:
    """The factor cell's comparison with its baseline cell (`judged` False says why not)."""
    verdict = base_record.get("verdict")
    out: dict[str, Any] = {"judged": False, "baseline_verdict": verdict,
                           "baseline_artifact_dir": base_record.get("artifact_dir")}
    if own_dir is None or base_dir is None or verdict not in JUDGED_BASELINE:
        why = "; ".join(str(r) for r in (base_record.get("reasons") or [])[:1])
        out["why"] = (f"not judged: baseline cell not run ({verdict}"
                      + (f": {why}" if why else "") + ")")
        return out
    try:
        one = own_dir.resolve() == base_dir.resolve()
    except (OSError, RuntimeError):
        one = True
    if one:
        out["why"] = ("not judged: the factor cell and its baseline cell name one run "
                      "directory: nothing independent to compare")
        return out
    same = not_independent(own_dir, base_dir)
    if same is not None:
        out["why"] = f"not judged: {same}"
        return out
    own, base = read_evidence(own_dir), read_evidence(base_dir)
    manifest = own.manifest or {}
    factors = manifest.get("factors")
    out.update(own_drift=_drift(own), baseline_drift=_drift(base),
               own_weights_differ=_weights_differ(own),
               baseline_weights_differ=_weights_differ(base),
               workload_factors=factors if isinstance(factors, dict) else None)
    broken = [f"{which}: {p}" for which, ev in (("factor cell", own), ("baseline cell", base))
              for p in ev.sample_problems + ev.problems]
    if broken:
        out["why"] = f"not judged: incomplete evidence ({'; '.join(broken[:2])[:300]})"
        return out
    if not own.samples or not base.samples:
        which = "factor" if not own.samples else "baseline"
        out["why"] = f"not judged: the {which} cell holds no logprob samples"
        return out
    own_s, base_s = own.samples, base.samples
    diverged = weights_diverge(own, base)
    if diverged is not None:
        # The rollout of step k holds weight version k (the reference workload's numbering):
        # from the first version the two runs' training sides exported differently, their
        # rollouts no longer share weights, so a difference there is not the factor's alone.
        if not diverged.isdigit():
            out["why"] = (f"not judged: the two cells' training weights differ at version "
                          f"{diverged} (not a step number: the steps to compare are unknown)")
            return out
        own_s = [x for x in own_s if x.call < int(diverged)]
        base_s = [x for x in base_s if x.call < int(diverged)]
        out["steps_compared"] = int(diverged)
        out["weights_diverge_at"] = diverged
        if not own_s or not base_s:
            out["why"] = (f"not judged: the two cells' training weights differ from version "
                          f"{diverged} on, and no earlier step is left to compare")
            return out
    figures = compare_samples(own_s, base_s)
    out.update(figures)
    if figures["duplicate_samples"]:
        out["why"] = (f"not judged: {figures['duplicate_samples']} sample(s) hold a (step, rank, "
                      "sample) key another sample holds: which one to compare is unknown")
    elif figures["samples"] == 0:
        out["why"] = ("not judged: no sample of the factor cell pairs with one of the baseline "
                      f"cell ((step, rank, sample) keys differ; {figures['unpaired_samples']} "
                      "unpaired)")
    elif figures["compared_logprobs"] == 0:
        out["why"] = ("not judged: nothing compared (no active logprob position both cells "
                      "reached with the same tokens)")
    else:
        out["judged"] = True
    return out


def _run_identity(run_dir: Path) -> tuple[str | None, str | None, str | None]:
    """(run id, sha256 of run.log, why the run id is unknown) of a run directory, read
    through `store.safeio` (regular files under the run, bounded)."""
    from pytest_rlkernel_matrix.store.safeio import MAX_LOG_BYTES, Refused, read_json, sha256_file

    rid: str | None = None
    why: str | None = None
    try:
        meta = read_json(run_dir / "cell-run.json", run_dir)
        got = meta.get("run_id") if isinstance(meta, dict) else None
        rid = got if isinstance(got, str) and got else None
        why = None if rid else "its cell-run.json names no run_id"
    except (OSError, ValueError, RecursionError, Refused) as exc:
        why = f"its cell-run.json is unreadable ({str(exc)[:120]})"
    try:
        log: str | None = sha256_file(run_dir / "run.log", run_dir, MAX_LOG_BYTES)
    except (OSError, Refused):
        log = None
    return rid, log, why


def not_independent(own_dir: Path, base_dir: Path) -> str | None:
    """Why the factor cell's run and its baseline cell's are not shown to be two processes
    (None: they are): a run id missing, or the same run id or the same run.log bytes (a copy
    of a run compared with itself would be called invariant)."""
    own_id, own_log, own_why = _run_identity(own_dir)
    base_id, base_log, base_why = _run_identity(base_dir)
    if own_why or base_why:
        which = "the factor cell" if own_why else "the baseline cell"
        return (f"identity: {which}'s run cannot be told apart from the other: "
                f"{own_why or base_why}")
    if own_id == base_id:
        return (f"identity: the factor cell and its baseline cell hold the same run "
                f"({own_id}): a copy, nothing independent to compare")
    if own_log is not None and own_log == base_log:
        return ("identity: the factor cell's run.log is byte for byte its baseline cell's: a "
                "copy of one run, nothing independent to compare")
    return None


def weights_diverge(own: Evidence, base: Evidence) -> str | None:
    """The first weight version (in version order) whose training-side digest differs between
    the two runs, or None when every version both exported is the same."""
    def key(v: str) -> tuple[int, int | str]:
        return (0, int(v)) if v.isdigit() else (1, v)

    for version in sorted(set(own.weight_versions) & set(base.weight_versions), key=key):
        a = own.weight_versions[version].get("training")
        b = base.weight_versions[version].get("training")
        if a and b and a != b:
            return version
    return None


def factor_block(record: Mapping[str, Any], factor: Mapping[str, Any], base_id: str,
                 own_dir: Path | None, base_dir: Path | None,
                 base_record: Mapping[str, Any]) -> dict[str, Any]:
    """The record's `factor` entry: the variant, its baseline cell and their comparison."""
    return {**(record.get("factor") or factor), "baseline_cell": base_id,
            "comparison": compare_runs(own_dir, base_dir, base_record)}

