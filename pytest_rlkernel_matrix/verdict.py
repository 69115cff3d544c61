"""From evidence to one verdict per cell, via four separate judgements.

- route: each side of each module ran the implementation the case requested, with no fallback;
- semantic: both sides saw comparable weights, samples, lengths and masks;
- numeric: the drift satisfies the contract the *backends declared* (no tolerance is invented
  here: with a production side involved there is no contract, the drift is reported only);
- performance: phase wall-clock is present and not contaminated (profiler, debug readback,
  checkpoint write, first compile) and the route is the requested one.

A process that exits 0 never makes a cell valid by itself, and a silent fallback is never
R evidence: R is proven by a readback, or disproven by the numeric contract.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pytest_rlkernel_matrix.cells import Cell
from pytest_rlkernel_matrix.evidence import SIDES, Evidence, Route
from pytest_rlkernel_matrix.matrix import ExpectedGap
from pytest_rlkernel_matrix.runner import RunResult

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


def _judge_route(cell: Cell, mode: str, ev: Evidence) -> tuple[Judgement, Judgement, list[str]]:
    """(route, mismatch, fallbacks): route problems that are fallbacks vs other mismatches."""
    route = Judgement()
    mismatch = Judgement()
    fallbacks: list[str] = []
    for fb in ev.fallbacks:
        fallbacks.append(f"{fb['module']} {fb['side']}: fallback recorded: {fb['reason']}")
    if not ev.readback_files:
        for line in ev.log.fallback_lines:
            fallbacks.append(f"run.log: {line}")
    for module in cell.cases.modules:
        for side in SIDES:
            letter = "P" if mode == "off" else cell.cases.side(module, side)
            want = IMPLEMENTATION[letter]
            got: Route | None = ev.routes[side].get(module)
            where = f"{module} {side}"
            if got is None:
                if letter == "R":
                    route.fail(f"{where}: R requested but no readback reports it: R route unproven")
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
            requested = cell.cases.of(module)
            if got.case_ids and requested not in got.case_ids and mode != "off":
                mismatch.fail(f"{where}: readback case_id {got.case_ids} != requested {requested}")
    for reason in fallbacks:
        route.fail(reason)
    return route, mismatch, fallbacks


def _judge_semantic(ev: Evidence) -> Judgement:
    sem = Judgement()
    for version, by_side in sorted(ev.weight_versions.items()):
        shas = set(by_side.values())
        if len(shas) > 1:
            shown = ", ".join(f"{who} {sha[:12]}" for who, sha in sorted(by_side.items()))
            sem.fail(f"weight version {version}: sides hold different weights ({shown})")
    if not ev.weight_versions:
        sem.reasons.append("no weight-audit files: weight version not verified")
    for problem in ev.sample_problems:
        sem.fail(f"samples not comparable: {problem}")
    return sem


def _declared_contract(ev: Evidence, mode: str, modules: Sequence[str]) -> dict[str, Any]:
    """The contract both sides declare for the whole logprob path, or kind 'none'."""
    if mode == "off":
        return {"kind": "none", "why": "mode off: native route, no RL-Kernel contract"}
    contracts: list[Any] = []
    for module in modules:
        for side in SIDES:
            r = ev.routes[side].get(module)
            if r is None or r.implementation != "rl_kernel":
                return {"kind": "none",
                        "why": f"{module} {side} is not RL-Kernel: drift is reported, not judged"}
            if len(r.contracts) != 1:
                return {"kind": "none", "why": f"{module} {side} declares no single contract"}
            contracts.append(r.contracts[0])
    first = contracts[0]
    if any(c != first for c in contracts):
        return {"kind": "none", "why": "sides/modules declare different contracts"}
    if first in ("bitwise", "exact"):
        return {"kind": "bitwise"}
    if isinstance(first, dict) and first.get("kind") == "tolerance":
        limit = first.get("max_abs_diff")
        if isinstance(limit, (int, float)):
            return {"kind": "tolerance", "max_abs_diff": float(limit)}
    return {"kind": "none", "why": f"unrecognised declared contract {first!r}"}


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


def _judge_numeric(ev: Evidence, mode: str, modules: Sequence[str],
                   ) -> tuple[Judgement, dict[str, Any], list[str]]:
    num = Judgement()
    errors: list[str] = []
    contract = _declared_contract(ev, mode, modules)
    m = ev.metrics
    if m is None:
        errors.append("no logprob evidence (no mismatch-sidecars/*.pt or train-data/*.pt)")
        num.valid = None
        return num, contract, errors
    if m.active_token_count == 0:
        errors.append("logprob evidence holds no active (mask=1) tokens")
        num.valid = None
        return num, contract, errors
    if m.nonfinite_count:
        errors.append(f"NaN/inf in {m.nonfinite_count} of {m.active_token_count} active logprobs")
        num.valid = None
        return num, contract, errors
    if contract["kind"] == "bitwise" and m.mismatch_count:
        num.fail(
            f"bitwise contract violated: {m.mismatch_count} of {m.active_token_count} active "
            f"tokens differ (max |dlogp| {m.logprob_abs_diff_max:.3g})"
        )
    elif contract["kind"] == "tolerance" and (
        (m.logprob_abs_diff_max or 0) > contract["max_abs_diff"]
    ):
        num.fail(
            f"declared tolerance max_abs_diff={contract['max_abs_diff']:g} exceeded: "
            f"max |dlogp| {m.logprob_abs_diff_max:.3g}"
        )
    elif contract["kind"] == "none":
        num.valid = None
        num.reasons.append(f"no contract: {contract['why']}")
    bv = ev.bitwise_validation
    if isinstance(bv, dict) and bv.get("passed") is False and contract["kind"] == "bitwise" and (
        m.mismatch_count == 0
    ):
        num.reasons.append("bitwise-validation.json says passed=false although sidecars match; "
                           f"validator said: {bv.get('error') or bv.get('readbacks', {})}")
    return num, contract, errors


def _judge_performance(ev: Evidence, env: Mapping[str, str], route_ok: bool, mode: str,
                       warmup: int) -> Judgement:
    perf = Judgement()
    medians, _ = ev.log.phases(warmup)
    missing = [k for k in ("rollout_wall_time", "training_wall_time", "step_wall_time")
               if medians.get(k) is None]
    if missing:
        perf.fail(f"no phase wall-clock in run.log for {', '.join(missing)}")
    for key, label in CONTAMINATING_ENV.items():
        if env.get(key, "0") not in ("", "0", "false"):
            perf.fail(f"contaminated: {label} ({key}={env[key]})")
    for label, line in ev.log.contamination.items():
        perf.fail(f"contaminated: {label}: {line[:160]}")
    if not route_ok:
        why = "auto-mode fallback" if mode == "auto" else "the requested route did not run"
        perf.fail(f"not usable for RL-Kernel performance conclusions: {why}")
    return perf


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
) -> Decision:
    """Judge one finished run (or one strict mode refused to start: `blockers` from preflight)."""
    route, mismatch, fallbacks = _judge_route(cell, mode, ev)
    semantic = _judge_semantic(ev)
    for reason in mismatch.reasons:
        semantic.fail(f"route: {reason}")
    numeric, contract, evidence_errors = _judge_numeric(ev, mode, cell.cases.modules)
    performance = _judge_performance(ev, env, route.valid is not False, mode, warmup)
    unsupported = _unsupported(cell, ev)
    not_started = run.exit_code is None and not run.launch_error and not run.timed_out
    if blockers and not_started:
        unsupported = [(cls, f"preflight: {why}; not started (strict fails closed)")
                       for cls, why in blockers] + unsupported

    run_errors: list[str] = []
    if run.launch_error:
        run_errors.append(run.launch_error)
    if run.timed_out:
        run_errors.append("timeout: no exit after the runner timeout; process group killed")
    elif run.exit_code not in (0, None):
        detail = "; ".join(f"{k}: {v}" for k, v in ev.log.errors.items())
        tail = (ev.log.traceback or "").strip().splitlines()[-1:] if ev.log.traceback else []
        run_errors.append(
            f"exit code {run.exit_code}" + (f" ({detail})" if detail else "")
            + (f"; last traceback line: {tail[0]}" if tail else "")
        )
    elif ev.log.errors:
        semantic.reasons.append(
            "run.log reports errors despite exit 0: "
            + "; ".join(f"{k}: {v}" for k, v in ev.log.errors.items())
        )
    evidence_errors += [f"unreadable artifact: {p}" for p in ev.problems]
    evidence_errors += [r for r in route.reasons if "route unproven" in r]

    reasons: list[str]
    unsupported_class = None
    if run.timed_out or run.launch_error or (run_errors and not unsupported and not fallbacks):
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
        verdict, reasons = "valid", []
    if verdict != "valid":
        extra = [r for r in numeric.reasons if r not in reasons and verdict != "contract_mismatch"]
        reasons += [f"also: {r}" for r in extra if not r.startswith("no contract")]

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
    )
