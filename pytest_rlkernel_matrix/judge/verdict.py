"""From evidence to one verdict per cell, via four separate judgements.

- route: each side of each module ran the implementation the case requested, with no fallback;
- semantic: both sides saw comparable weights, samples, lengths and masks;
- numeric: the drift satisfies the contract the *backends declared* (no tolerance is invented
  here: with a production side involved there is no contract, the drift is reported only);
- performance: phase wall-clock is present and not contaminated (profiler, debug readback,
  checkpoint write, first compile; measured host/device contention, see contamination.py), with
  enough measured steps and a spread under the declared limit (stats.py), and the route is the
  requested one.

A process that exits 0 never makes a cell valid by itself, and a silent fallback is never
R evidence: R is proven by a readback, or disproven by the numeric contract.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_rlkernel_matrix.judge.coverage import judge_ranks
from pytest_rlkernel_matrix.judge.crosscheck import (
    Exposure,
    hook_findings,
    log_route_fallbacks,
    runtime_exposure,
)
from pytest_rlkernel_matrix.judge.evidence import SIDES, Evidence, Route
from pytest_rlkernel_matrix.judge.factors import factor_contract, weight_reasons
from pytest_rlkernel_matrix.judge.metrics import bitwise_reason
from pytest_rlkernel_matrix.judge.stats import timing_noise
from pytest_rlkernel_matrix.judge.steps import CLAIMS, apply_declared, judge_claims
from pytest_rlkernel_matrix.judge.upstream import (
    bitwise_validation_status,
    is_rlkernel_backend,
    judge_weight_audit,
    native_logp_evidence,
)
from pytest_rlkernel_matrix.judge.upstream_rules import (
    declared_policy,
    own_backend,
    upstream_findings,
)
from pytest_rlkernel_matrix.run.contamination import judge as contamination_judge
from pytest_rlkernel_matrix.run.contamination import read_measurement
from pytest_rlkernel_matrix.run.runner import RunResult
from pytest_rlkernel_matrix.spec.cells import Cell
from pytest_rlkernel_matrix.spec.limits import Policy as PerformancePolicy
from pytest_rlkernel_matrix.spec.terms import plural

if TYPE_CHECKING:  # (annotations only: the matrix file's pydantic models load in 0.1 s)
    from pytest_rlkernel_matrix.spec.matrix import ExpectedGap

IMPLEMENTATION = {"P": "production", "R": "rl_kernel"}
UNSUPPORTED_CLASSES = (
    "platform_unsupported", "build_failure", "shape_unsupported",
    "communication_path_unsupported", "contract_unsatisfied",
)
_CAPABILITY_CLASS = {
    "registration": "platform_unsupported", "target": "platform_unsupported",
    "device": "platform_unsupported", "platform": "platform_unsupported",
    "build": "build_failure", "extension": "build_failure",
    "dtype": "shape_unsupported", "shape": "shape_unsupported",
    "topology": "communication_path_unsupported", "communication": "communication_path_unsupported",
    "alignment": "contract_unsatisfied", "observability": "contract_unsatisfied",
    "strict_observability": "contract_unsatisfied", "fallback_policy": "contract_unsatisfied",
    "contract": "contract_unsatisfied",
}
# Modes that fail a cell only for these verdicts; strict fails every non-valid cell.
LENIENT_FAILS = {"error", "incomparable"}
CONTAMINATING_ENV = {
    "RL_KERNEL_DEBUG_READBACK": "debug_readback", "RL_KERNEL_PROFILE": "profiler",
    "RL_KERNEL_SAVE_CHECKPOINT": "checkpoint_write", "VIME_PROFILE": "profiler",
}


BITWISE_WORDS = ("bitwise", "exact", "bitwise_equal", "bitwise-equal")
PLATFORMS = ("cpu", "cuda", "rocm")


@dataclass(frozen=True)
class Policy:
    """What the matrix file says about judging a cell, frozen into its `cell-run.json`.

    `baseline_contract` is the user's declaration for all-R cells (`{"kind": "bitwise"}` or
    `{"kind": "tolerance", "max_abs_diff": x}`), `backend` the hardware profile's backend and
    `run_id` the id the runner gave the run.
    """

    baseline_contract: Mapping[str, Any] | None = None
    min_samples_per_rank: int = 1
    min_active_tokens: int = 1
    backend: str | None = None
    run_id: str | None = None
    baseline_claims: tuple[str, ...] = ()
    repeat_dir: str | None = None  # the second run of this cell (run_to_run_bitwise)
    require_rollout_weight_audit: bool = False

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Policy:
        raw = meta.get("policy")
        raw = raw if isinstance(raw, Mapping) else {}
        contract = raw.get("baseline_contract")

        def count(key: str) -> int:
            value = raw.get(key, 1)
            return value if isinstance(value, int) and not isinstance(value, bool) else 1

        return cls(
            baseline_contract=contract if isinstance(contract, Mapping) else None,
            min_samples_per_rank=max(1, count("min_samples_per_rank")),
            min_active_tokens=max(1, count("min_active_tokens")),
            backend=raw.get("backend") if isinstance(raw.get("backend"), str) else None,
            run_id=str(meta["run_id"]) if meta.get("run_id") is not None else None,
            baseline_claims=tuple(c for c in raw.get("baseline_claims") or () if c in CLAIMS),
            repeat_dir=raw["repeat_dir"] if isinstance(raw.get("repeat_dir"), str) else None,
            require_rollout_weight_audit=raw.get("require_rollout_weight_audit") is True,
        )

    def as_dict(self) -> dict[str, Any]:
        return {"baseline_contract": None if self.baseline_contract is None
                else dict(self.baseline_contract),
                "min_samples_per_rank": self.min_samples_per_rank,
                "min_active_tokens": self.min_active_tokens, "backend": self.backend,
                "baseline_claims": list(self.baseline_claims), "repeat_dir": self.repeat_dir,
                "require_rollout_weight_audit": self.require_rollout_weight_audit}


@dataclass
class Judgement:
    """One of the four validity judgements: `valid` is None when it could not be judged."""

    valid: bool | None = True
    reasons: list[str] = field(default_factory=list)

    def fail(self, reason: str) -> None:
        self.valid = False
        self.reasons.append(reason)


@dataclass
class Decision:
    """A cell's verdict, why, and whether the session's mode fails it."""

    verdict: str
    reasons: list[str]
    failed: bool
    judgements: dict[str, Judgement]
    unsupported_class: str | None = None
    expected_gap: str | None = None
    contract: dict[str, Any] = field(default_factory=dict)
    performance_usable: bool = False
    claims: dict[str, dict[str, str]] = field(default_factory=dict)
    steps: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _classify_capability(entry: Mapping[str, Any]) -> tuple[str, str]:
    decisions = entry.get("capability_decisions") or []
    for d in decisions:
        if isinstance(d, dict) and (d.get("supported") is False or d.get("passed") is False):
            cap = str(d.get("capability", ""))
            cls = _CAPABILITY_CLASS.get(cap.lower(), "platform_unsupported")
            return cls, f"{cap}: {d.get('reason', 'not supported')}"
    return "platform_unsupported", str(entry.get("reason", "capability unsupported"))


def _unsupported(cell: Cell, ev: Evidence) -> list[tuple[str, str]]:
    """(class, reason) for every unsupported-capability report that concerns this cell."""
    found: list[tuple[str, str]] = []
    for entry in ev.capability:
        if str(entry.get("status", "")).lower() != "unsupported":
            continue
        cls, why = _classify_capability(entry)
        where = f"{entry.get('module', '')} {entry.get('side', '')}".strip()
        found.append((cls, f"{where}: {why}" if where else why))
    for line in ev.log.unsupported:
        cls = line.get("class", "platform_unsupported")
        if cls not in UNSUPPORTED_CLASSES:
            cls = "platform_unsupported"
        where = f"{line.get('module', '')} {line.get('side', '')}".strip()
        found.append((cls, f"{where}: {line.get('reason', '')}".strip(": ")))
    wants_r = any("R" in cell.cases.of(m) for m in cell.cases.modules)
    if wants_r and "build_failure" in ev.log.errors:
        found.append(("build_failure", ev.log.errors["build_failure"]))
    return found


def _real_backend(bid: str, impl: str, own: Mapping[str, Any] | None = None) -> bool:
    """An R backend is RL-Kernel's, or the run's own under its declared runtime policy."""
    low = bid.lower()
    if impl == "rl_kernel":
        return (is_rlkernel_backend(low) or own_backend(low, own)) and not low.endswith(
            ".unidentified")
    return not low.startswith("rlkernel.") and not own_backend(low, own)


def _judge_route(cell: Cell, mode: str, ev: Evidence, platform: str | None = None,
                 ) -> tuple[Judgement, Judgement, list[str]]:
    """(route, mismatch, fallbacks): route problems that are fallbacks vs other mismatches."""
    route = Judgement()
    mismatch = Judgement()
    fallbacks: list[str] = []
    own, _ = declared_policy(ev.runtime_policies)
    for fb in ev.fallbacks:
        fallbacks.append(f"{fb['module']} {fb['side']}: fallback recorded: {fb['reason']}")
    for module in cell.cases.modules:
        for side in SIDES:
            letter = "P" if mode == "off" else cell.cases.side(module, side)
            want = IMPLEMENTATION[letter]
            got: Route | None = ev.routes[side].get(module)
            where = f"{module} {side}"
            if got is None:
                if letter == "R":
                    route.fail(f"{where}: R requested but no readback reports it: R route unproven")
                elif module == "logp" and side == "training" and mode != "off" and (
                        native_logp_evidence(ev.log.logp_markers, cell.cases.of(module)) is None):
                    route.fail(f"{where}: native (production) logp has no readback record and "
                               "run.log has no native backend marker ('linear_logp native "
                               "active: ... contract_id=vime.native.linear_logp.v1' or "
                               "'rlkernel mismatch sidecar active: logp_case="
                               f"{cell.cases.of(module)}'): P route unproven")
                continue
            if got.fallback and not any(f.startswith(f"{module} {side}") for f in fallbacks):
                fallbacks.append(f"{where}: readback provenance says fallback=true")
            impl = got.implementation
            if impl != want:
                msg = f"{where}: requested {want} ({letter}), readback reports {impl}"
                if want == "rl_kernel" and impl == "production":
                    if not any(f.startswith(where) for f in fallbacks):
                        fallbacks.append(msg + " (fallback)")
                else:
                    mismatch.fail(msg)
            elif impl == "rl_kernel":
                fake = [b for b in got.backend_ids if not _real_backend(b, impl, own)]
                if not got.backend_ids:
                    fallbacks.append(f"{where}: claims rl_kernel but reports no backend_id: "
                                     "R not proven (fallback)")
                elif fake:
                    fallbacks.append(f"{where}: claims rl_kernel but backend_id {fake[0]!r} is "
                                     "not an RL-Kernel backend (silent fallback)")
                if got.call_count_missing and not got.call_counts:
                    route.fail(f"{where}: readback reports no call_count: R route unproven")
                elif got.call_count == 0:
                    fallbacks.append(f"{where}: claims rl_kernel but call_count is 0: the "
                                     "RL-Kernel operator never ran (fallback)")
            elif impl == "production":
                fake = [b for b in got.backend_ids if not _real_backend(b, impl, own)]
                if fake:
                    mismatch.fail(f"{where}: claims production but backend_id {fake[0]!r} is an "
                                  "RL-Kernel backend")
                if got.call_counts and got.call_count == 0:
                    mismatch.fail(f"{where}: production operator reports call_count 0: the "
                                  "module was not exercised")
            requested = cell.cases.of(module)
            if mode == "off":
                continue
            if got.case_id_missing:
                mismatch.fail(f"{where}: readback ({', '.join(got.sources[:2])}) carries no "
                              f"case_id: cannot tie it to the requested case {requested}")
            if got.case_ids and got.case_ids != [requested]:
                mismatch.fail(f"{where}: readback case_id {got.case_ids} != requested {requested}")
    unproven, contradictions = hook_findings(cell.cases.modules, cell.cases.side, mode,
                                             ev.routes, ev.hooks)
    log_fallbacks, log_mismatches = log_route_fallbacks(
        cell.cases.modules, cell.cases.side, mode, ev.log.fallback_lines, ev.log.routes,
        bool(ev.readback_files), fallbacks, own)
    fallbacks += log_fallbacks
    if mode != "off":  # upstream's record rules, platform by platform (judge/upstream_rules)
        rule_fallbacks, failures = upstream_findings(ev.operator_records, platform,
                                                     ev.runtime_policies)
        said = {" ".join(w.rstrip(":") for w in h.split()[:2]) for h in fallbacks}
        fallbacks += [f for f in rule_fallbacks if " ".join(f.split()[:2]) not in said]
        for reason in failures:
            mismatch.fail(reason)
    for reason in unproven:
        route.fail(reason)
    for reason in log_mismatches + contradictions:
        mismatch.fail(reason)
    for reason in fallbacks:
        route.fail(reason)
    return route, mismatch, fallbacks


def _judge_semantic(ev: Evidence, mode: str, policy: Policy,
                    cell: Cell | None = None) -> Judgement:
    sem = Judgement()
    reasons, notes = judge_weight_audit(ev.weight_audit, mode, policy.require_rollout_weight_audit)
    for failed, reason in weight_reasons(cell, reasons, ev.weight_audit):  # factor: expected
        sem.fail(reason) if failed else sem.reasons.append(reason)
    ev.weight_audit.notes = notes  # recorded with the audit, not reasons
    for problem in ev.sample_problems:
        sem.fail(f"samples not comparable: {problem}")
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
    for source, rid in sorted(ev.run_ids.items()):
        if policy.run_id is not None and rid != policy.run_id:
            sem.fail(f"run id {rid!r} in {source} is not this run's {policy.run_id!r}: "
                     "artifact from another run")
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
    """The step records' runtime token exposure against the sidecars (judge/crosscheck.py)."""
    m = ev.metrics
    return runtime_exposure(ev.log.records.get("step", []), ev.manifest,
                            None if m is None else m.active_token_count, ev.logprob_source,
                            None if m is None else m.sample_count)


def parse_contract(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(normalised contract, None) or (None, why it is not a usable contract)."""
    if isinstance(value, str):
        if value.strip().lower() in BITWISE_WORDS:
            return {"kind": "bitwise"}, None
        return None, f"unknown contract kind {value[:80]!r}"
    if isinstance(value, Mapping):
        kind = value.get("kind")
        if isinstance(kind, str) and kind.strip().lower() in BITWISE_WORDS:
            return {"kind": "bitwise"}, None
        if kind == "tolerance":
            limit = value.get("max_abs_diff")
            if isinstance(limit, bool) or not isinstance(limit, (int, float)):
                return None, f"tolerance contract without a numeric max_abs_diff ({limit!r})"
            if not math.isfinite(limit):
                return None, f"tolerance contract with a non-finite limit max_abs_diff={limit!r}"
            if limit < 0:
                return None, f"tolerance contract with a negative limit max_abs_diff={limit!r}"
            return {"kind": "tolerance", "max_abs_diff": float(limit)}, None
        return None, f"unknown contract kind {str(kind)[:80]!r}"
    return None, f"unknown contract kind {type(value).__name__} {str(value)[:80]!r}"


def _fmt_contract(c: Mapping[str, Any]) -> str:
    return "bitwise" if c["kind"] == "bitwise" else f"tolerance(max_abs_diff={c['max_abs_diff']:g})"


def is_all_r(cell: Cell) -> bool:
    return all(cell.cases.of(m) == "R/R" for m in cell.cases.modules)


def resolve_contract(cell: Cell, ev: Evidence, mode: str,
                     declared: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The cell's end-to-end selected-logprob contract, where it came from, and its problems.

    Only an all-R cell has one: a production side anywhere has no contract (drift reported).
    Sources: the logp provider's `arithmetic_contract` on both sides (RL-Kernel writes it there;
    attention/FFN operators usually carry none), module contracts where present, and the user's
    `[matrix] baseline_contract`. Disagreements, unknown kinds and bad limits are `problems`;
    the strictest usable contract is the one judged.
    """
    if mode == "off":
        return {"kind": "none", "why": "mode off: native route, no RL-Kernel contract",
                "sources": {}, "problems": []}
    if (exempt := factor_contract(cell)) is not None:
        return exempt
    if not is_all_r(cell):
        side_p = next(f"{m} {s}" for m in cell.cases.modules for s in SIDES
                      if cell.cases.side(m, s) == "P")
        return {"kind": "none", "why": f"{side_p} is production: drift is reported, not judged",
                "sources": {}, "problems": []}
    parsed: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    declared_by: dict[str, bool] = {}
    for module in ("logp", *[m for m in cell.cases.modules if m != "logp"]):
        for side in SIDES:
            r = ev.routes[side].get(module)
            where = f"{module} {side}"
            values = [c for c in (r.contracts if r else []) if c is not None]
            if module == "logp":
                declared_by[side] = bool(values)
            if not values:
                continue
            if len(values) > 1:
                problems.append(f"{where}: processes declare different contracts {values[:3]!r}")
            if module == "logp" and r is not None and r.contract_missing:
                problems.append(f"{where}: some processes declare no arithmetic_contract")
            for value in values:
                c, why = parse_contract(value)
                if why:
                    problems.append(f"{where}: {why}")
                elif c is not None:
                    parsed.setdefault(where, c)
    if declared_by and len(set(declared_by.values())) > 1:
        lacking = next(s for s, d in declared_by.items() if not d)
        problems.append(f"logp {lacking}: the logp provider declares no arithmetic_contract "
                        "while the other side declares one")
    versions = {s: (ev.routes[s]["logp"].contract_versions if "logp" in ev.routes[s] else [])
                for s in SIDES}
    # The family (`linear_logp` of `linear_logp:tp=2:cp=1:vocab=...`) must agree; the topology
    # parameters may differ between the sides (training and rollout often shard differently).
    families = {side: {v.split(":", 1)[0] for v in vs} for side, vs in versions.items()}
    if all(versions.values()) and families["training"] != families["rollout"]:
        problems.append(f"logp contract_version differs: training {versions['training']}, "
                        f"rollout {versions['rollout']}")
    if declared is not None:
        c, why = parse_contract(dict(declared))
        if why:
            problems.append(f"matrix.toml baseline_contract: {why}")
        elif c is not None:
            parsed["matrix.toml baseline_contract"] = c
    distinct = {_fmt_contract(c) for c in parsed.values()}
    if len(distinct) > 1:
        problems.append("conflicting contracts: " + ", ".join(
            f"{k} {_fmt_contract(c)}" for k, c in parsed.items()))
    sources = {k: _fmt_contract(c) for k, c in parsed.items()}
    for side in SIDES:
        if versions[side]:
            sources[f"contract_version {side}"] = ",".join(versions[side])
    if not parsed:
        return {"kind": "none", "sources": sources, "problems": problems,
                "why": "neither the logp provider nor matrix.toml (baseline_contract) declares "
                       "a contract for this all-R cell"}
    if any(c["kind"] == "bitwise" for c in parsed.values()):
        chosen: dict[str, Any] = {"kind": "bitwise"}
    else:
        chosen = {"kind": "tolerance",
                  "max_abs_diff": min(c["max_abs_diff"] for c in parsed.values())}
    return {**chosen, "sources": sources, "problems": problems}


def contract_id(ev: Evidence) -> str | None:
    ids: list[str] = []
    for side in SIDES:
        r = ev.routes[side].get("logp")
        for cid in r.contract_versions if r else []:
            if cid not in ids:
                ids.append(cid)
    for cid in ev.log.contract_ids:
        if cid not in ids:
            ids.append(cid)
    return ",".join(ids) or None


def _drift(m: Any) -> str:
    return (f"{m.mismatch_count} of {m.active_token_count} active tokens differ "
            f"(max |dlogp| {m.logprob_abs_diff_max or 0:.3g})")


def _judge_numeric(ev: Evidence, mode: str, cell: Cell | None = None,
                   policy: Policy | None = None) -> tuple[Judgement, dict[str, Any], list[str]]:
    num = Judgement()
    errors: list[str] = []
    policy = policy or Policy()
    if cell is None:
        contract: dict[str, Any] = {"kind": "none", "why": "no cell given", "sources": {},
                                    "problems": []}
    else:
        contract = resolve_contract(cell, ev, mode, policy.baseline_contract)
    all_r = cell is not None and is_all_r(cell) and mode != "off"
    for problem in contract["problems"]:
        num.fail(f"contract: {problem}")
    bv = ev.bitwise_validation
    status, detail = bitwise_validation_status(bv) if isinstance(bv, dict) else ("", "")
    if all_r and status == "failed":
        num.fail(f"bitwise-validation.json: passed={bv.get('passed')!r} (RL-Kernel's validator "
                 f"fails this all-R run): {detail}")
    m = ev.metrics
    if m is None:
        errors.append("no logprob evidence (no mismatch-sidecars/*.pt or train-data/*.pt)")
        num.valid = None if num.valid is not False else False
        return num, contract, errors
    if m.active_token_count == 0:
        errors.append("logprob evidence holds no active (mask=1) tokens")
        num.valid = None if num.valid is not False else False
        return num, contract, errors
    if m.nonfinite_count:
        errors.append(f"NaN/inf in {m.nonfinite_count} of {m.active_token_count} active logprobs")
        num.valid = None if num.valid is not False else False
        return num, contract, errors
    if contract["kind"] == "bitwise" and (why := bitwise_reason(m)):
        num.fail(f"bitwise contract violated: {why}")
    elif contract["kind"] == "tolerance" and (
        m.logprob_abs_diff_max is None or not math.isfinite(m.logprob_abs_diff_max)
        or m.logprob_abs_diff_max > contract["max_abs_diff"]
    ):
        num.fail(
            f"declared tolerance max_abs_diff={contract['max_abs_diff']:g} exceeded: "
            f"max |dlogp| {m.logprob_abs_diff_max or 0:.3g}"
        )
    elif contract["kind"] == "none":
        if all_r:
            msg = f"no contract: not judged: {contract['why']}; drift: {_drift(m)}"
            if mode == "strict":
                num.fail(msg + " (strict mode never passes an unjudged all-R cell)")
            else:
                num.valid = None if num.valid is not False else False
                num.reasons.append(msg)
        else:
            num.valid = None if num.valid is not False else False
            num.reasons.append(f"no contract: {contract['why']}")
    return num, contract, errors


def _judge_performance(ev: Evidence, env: Mapping[str, str], route_ok: bool, mode: str,
                       warmup: int, policy: PerformancePolicy) -> Judgement:
    perf = Judgement()
    medians, spread = ev.log.phases(warmup)
    missing = [k for k in ("rollout_wall_time", "training_wall_time", "step_wall_time")
               if medians.get(k) is None]
    if missing:
        perf.fail(f"no phase wall-clock in run.log for {', '.join(missing)}")
    for reason in timing_noise(spread, policy):
        perf.fail(reason)
    for reason in contamination_judge(read_measurement(ev.root), policy):
        perf.fail(reason)
    for key, label in CONTAMINATING_ENV.items():
        if env.get(key, "0") not in ("", "0", "false"):
            perf.fail(f"contaminated: {label} ({key}={env[key]})")
    for label, line in ev.log.contamination.items():
        perf.fail(f"contaminated: {label}: {line[:160]}")
    if not route_ok:
        why = "auto-mode fallback" if mode == "auto" else "the requested route did not run"
        perf.fail(f"not usable for RL-Kernel performance conclusions: {why}")
    return perf


def _exit_code_agrees(run: RunResult, ev: Evidence) -> list[str]:
    """`exit-code` (written by the runner) and cell-run.json must say the same."""
    text = ev.exit_code_file
    if text is None:
        return ["no exit-code file: the run's exit status is unverified"]
    if run.exit_code is None:
        ok = text in ("", "not-started")
    else:
        ok = text.lstrip("-").isdigit() and int(text) == run.exit_code
    if ok:
        return []
    return [f"exit-code file says {text[:40]!r} but cell-run.json says {run.exit_code!r}: "
            "the records disagree"]


def _gap(cell: Cell, gaps: Sequence[ExpectedGap]) -> ExpectedGap | None:
    for gap in gaps:
        if gap.module in ("*", cell.module) and gap.case in ("*", cell.case):
            return gap
    return None


def decide(
    cell: Cell,
    *,
    mode: str,
    run: RunResult,
    ev: Evidence,
    env: Mapping[str, str],
    gaps: Sequence[ExpectedGap] = (),
    warmup: int = 0,
    blockers: Sequence[tuple[str, str]] = (),
    policy: Policy | None = None,
    performance_policy: PerformancePolicy | None = None,
) -> Decision:
    """Judge one finished run (or one strict mode refused to start: `blockers` from preflight).

    `policy` and `performance_policy` are what the run was recorded with (its cell-run.json)."""
    policy = policy or Policy()
    route, mismatch, fallbacks = _judge_route(cell, mode, ev, policy.backend)
    semantic = _judge_semantic(ev, mode, policy, cell)
    for reason in getattr(ev, "vime_semantic", []):  # vime's audit metadata (issue 45)
        semantic.fail(reason)
    for reason in mismatch.reasons:
        semantic.fail(f"route: {reason}")
    numeric, contract, evidence_errors = _judge_numeric(ev, mode, cell, policy)
    performance = _judge_performance(ev, env, route.valid is not False, mode, warmup,
                                     performance_policy or PerformancePolicy())
    unsupported = _unsupported(cell, ev)
    not_started = (run.exit_code is None and not run.launch_error and not run.timed_out
                   and not run.interrupted)
    if blockers and not_started:
        unsupported = [(cls, f"preflight: {why}; not started (strict fails closed)")
                       for cls, why in blockers] + unsupported

    run_errors: list[str] = []
    if run.launch_error:
        run_errors.append(run.launch_error)
    if run.interrupted:
        run_errors.append("interrupted: the session was stopped (Ctrl-C or SIGTERM) while the "
                          "cell ran; its processes were killed")
    elif run.timed_out:
        run_errors.append("timeout: no exit after the runner timeout; process group killed")
    elif run.exit_code not in (0, None):
        detail = "; ".join(f"{k}: {v}" for k, v in ev.log.errors.items())
        tail = (ev.log.traceback or "").strip().splitlines()[-1:] if ev.log.traceback else []
        last = None if tail else ev.log.last_error
        run_errors.append(
            f"exit code {run.exit_code}" + (f" ({detail})" if detail else "")
            + (f"; last traceback line: {tail[0]}" if tail else "")
            + (f"; run.log: {last}" if last and last not in detail else "")
        )
    else:
        fatal = ev.log.fatal
        if fatal and not run.interrupted and run.exit_code == 0:
            evidence_errors.append(
                "run.log reports fatal errors despite exit 0: "
                + "; ".join(f"{k}: {v}" for k, v in fatal.items())
            )
        notes = {k: v for k, v in ev.log.errors.items() if k not in fatal}
        if notes:
            semantic.reasons.append(
                "run.log reports errors despite exit 0: "
                + "; ".join(f"{k}: {v}" for k, v in notes.items())
            )
    evidence_errors += _exit_code_agrees(run, ev)
    evidence_errors += [f"unreadable artifact: {p}" for p in ev.problems]
    evidence_errors += [r for r in route.reasons if "route unproven" in r]

    reasons: list[str]
    unsupported_class = None
    if (run.timed_out or run.interrupted or run.launch_error
            or (run_errors and not unsupported and not fallbacks)):
        verdict, reasons = "error", run_errors + evidence_errors
    elif unsupported:
        verdict, unsupported_class = "unsupported", unsupported[0][0]
        reasons = [f"{cls}: {why}" for cls, why in unsupported] + run_errors
    elif fallbacks:
        verdict = "fallback"
        reasons = fallbacks + run_errors + [f"preflight: {c}: {w}" for c, w in blockers]
    elif evidence_errors:
        verdict, reasons = "error", evidence_errors
    elif semantic.valid is False:
        verdict, reasons = "incomparable", list(semantic.reasons)
    elif numeric.valid is False:
        verdict, reasons = "contract_mismatch", list(numeric.reasons)
    else:
        verdict, reasons = "valid", [r for r in numeric.reasons if r.startswith("no contract: not")]
    claims, steps_data = judge_claims(ev.root, policy.repeat_dir)
    if cell is not None and is_all_r(cell):
        waived = ("train_rollout_bitwise",) if (contract or {}).get("kind") == "tolerance" else ()
        verdict, reasons = apply_declared(claims, policy.baseline_claims, mode, verdict, reasons,
                                          waived)
    if verdict != "valid":
        extra = [r for r in numeric.reasons if r not in reasons and verdict != "contract_mismatch"]
        reasons += [f"also: {r}" for r in extra
                    if not r.startswith("no contract") or r.startswith("no contract: not")]

    gap = _gap(cell, gaps)
    expected_gap: str | None = None
    if gap is not None:
        expected_gap = ("expected unsupported: " + (gap.reason or "declared in the profile")
                        if verdict == "unsupported"
                        else f"declared expected unsupported, but the cell is {verdict}")
    if mode == "strict":
        failed = verdict != "valid" and not (gap is not None and verdict == "unsupported")
    else:
        failed = verdict in LENIENT_FAILS
    return Decision(
        verdict=verdict,
        reasons=reasons,
        failed=failed,
        judgements={"route": route, "semantic": semantic, "numeric": numeric,
                    "performance": performance},
        unsupported_class=unsupported_class,
        expected_gap=expected_gap,
        contract=contract,
        performance_usable=performance.valid is True and verdict == "valid",
        claims=claims, steps=steps_data,
    )


