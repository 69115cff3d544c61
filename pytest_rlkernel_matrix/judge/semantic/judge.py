"""Semantic validity: both sides saw comparable things (weights, samples, lengths, masks, ranks,
calls, tokens), enough of them, from this run, on the declared platform.

Allow-lists: a weight audit, a sample, a rank, a run id and a runtime platform pass only when
they positively agree with what the cell declares; a missing fact the rule needs fails closed.
"""

from __future__ import annotations

from pytest_rlkernel_matrix.judge.findings import Judgement
from pytest_rlkernel_matrix.judge.read.evidence import SIDES, Evidence
from pytest_rlkernel_matrix.judge.read.policy import PLATFORMS, Policy
from pytest_rlkernel_matrix.judge.semantic.coverage import judge_ranks
from pytest_rlkernel_matrix.judge.semantic.exposure import Exposure, runtime_exposure
from pytest_rlkernel_matrix.judge.semantic.weights import judge_weight_audit, weight_reasons
from pytest_rlkernel_matrix.spec.cells import Cell
from pytest_rlkernel_matrix.spec.terms import plural


def judge_semantic(ev: Evidence, mode: str, policy: Policy,
                    cell: Cell | None = None) -> Judgement:
    sem = Judgement(layer="semantic")
    reasons, notes = judge_weight_audit(ev.weight_audit, mode, policy.require_rollout_weight_audit)
    for failed, reason in weight_reasons(cell, reasons, ev.weight_audit):  # factor: expected
        sem.fail(reason) if failed else sem.note(reason)
    ev.weight_audit.notes = notes  # recorded with the audit, not reasons
    for problem in ev.sample_problems:
        sem.fail(f"samples not comparable: {problem}")
    for reason in ev.vime_semantic:  # vime's consistency metadata (read.vime_audit)
        sem.fail(reason)
    for reason in exposure_of(ev).reasons:
        sem.fail(reason)
    judge_ranks(ev, sem.fail)
    m = ev.metrics
    if m is not None and m.active_token_count and m.active_token_count < policy.min_active_tokens:
        sem.fail(f"coverage: {m.active_token_count} active tokens, below min_active_tokens="
                 f"{policy.min_active_tokens} (matrix.toml)")
    for rank, n in sorted(ev.samples_per_rank.items()):
        if n < policy.min_samples_per_rank:
            sem.fail(f"coverage: rank {rank} holds {plural(n, 'logprob sample')}, below "
                     f"min_samples_per_rank={policy.min_samples_per_rank} (matrix.toml)")
    if policy.run_id is None and mode != "off":
        sem.fail("identity: cell-run.json names no run_id: whether the artifacts "
                 + (f"({', '.join(sorted(ev.run_ids)[:3])}) " if ev.run_ids else "")
                 + "belong to this run cannot be checked (fails closed)")
    for source, rid in sorted(ev.run_ids.items()):
        if policy.run_id is not None and rid != policy.run_id:
            sem.fail(f"run id {rid!r} in {source} is not this run's {policy.run_id!r}: "
                     "artifact from another run")
    if policy.backend not in PLATFORMS and mode != "off":
        sem.fail("the cell's platform is unknown: cell-run.json "
                 + ("has no policy.backend" if policy.backend is None else
                    f"policy.backend {policy.backend!r} is not one of {', '.join(PLATFORMS)}")
                 + ": the runtime-platform rules cannot be evaluated (fails closed)")
    if policy.backend in PLATFORMS:
        seen: dict[str, str] = {}
        for side in SIDES:
            for module, r in ev.routes[side].items():
                for p in r.runtime_platforms:
                    seen.setdefault(p, f"{module} {side} readback")
        man = (ev.manifest or {}).get("runtime_platform")
        if isinstance(man, str):
            seen.setdefault(man, "manifest.json")
        for platform, where in sorted(seen.items()):
            if platform.lower() != policy.backend:
                sem.fail(f"runtime platform {platform!r} ({where}) does not match the hardware "
                         f"profile's backend {policy.backend!r}")
    return sem


def exposure_of(ev: Evidence) -> Exposure:
    """The step records' runtime token exposure against the sidecars (semantic/exposure.py)."""
    m = ev.metrics
    return runtime_exposure(ev.log.records.get("step", []), ev.manifest,
                            None if m is None else m.active_token_count, ev.logprob_source,
                            None if m is None else m.sample_count)
