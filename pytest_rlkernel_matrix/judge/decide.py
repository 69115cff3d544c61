"""A cell's verdict from the five validity layers' findings (the most severe wins).

The layers (route, semantic, numeric, performance, reproducibility) each own their rules and
return typed findings (`findings.Judgement` of `findings.Finding`); this module only runs them
and combines what they found with the run's outcome, in this order of severity:

1. error: the run did not finish (timeout, interruption, launch error), or exited non-zero with
   nothing that explains it;
2. unsupported: a capability report or preflight says the cell cannot run here;
3. fallback: a fallback anywhere (route findings that are fallbacks);
4. error: evidence that cannot be trusted (unreadable artifacts, unproven routes, records that
   disagree, nothing compared);
5. incomparable: a semantic (or route mismatch) finding;
6. contract_mismatch: a numeric finding;
7. valid: nothing above, and the numeric contract judged. Declared claims
   (reproducibility) then hold the verdict to them.

A process that exits 0 never makes a cell valid by itself, and a silent fallback is never
R evidence. Nothing here reads a file: the layers read through `read/`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_rlkernel_matrix.judge.findings import Finding, Judgement
from pytest_rlkernel_matrix.judge.numeric.judge import is_all_r, judge_numeric
from pytest_rlkernel_matrix.judge.performance.judge import judge_performance
from pytest_rlkernel_matrix.judge.read.evidence import Evidence
from pytest_rlkernel_matrix.judge.read.policy import Policy
from pytest_rlkernel_matrix.judge.reproducibility.judge import judge_reproducibility
from pytest_rlkernel_matrix.judge.reproducibility.steps import apply_declared
from pytest_rlkernel_matrix.judge.route.judge import judge_route
from pytest_rlkernel_matrix.judge.semantic.judge import judge_semantic
from pytest_rlkernel_matrix.run.runner import RunResult
from pytest_rlkernel_matrix.spec.cells import Cell
from pytest_rlkernel_matrix.spec.limits import Policy as PerformancePolicy

if TYPE_CHECKING:  # (annotations only: the matrix file's pydantic models load in 0.1 s)
    from pytest_rlkernel_matrix.spec.matrix import ExpectedGap

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

LENIENT_FAILS = {"error", "incomparable"}



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
    findings: list[Finding] = field(default_factory=list)  # every layer's, typed

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
    route, mismatch, fallbacks = judge_route(cell, mode, ev, policy.backend)
    semantic = judge_semantic(ev, mode, policy, cell)
    for reason in mismatch.reasons:
        semantic.fail(f"route: {reason}")
    numeric, contract, evidence_errors = judge_numeric(ev, mode, cell, policy)
    performance = judge_performance(ev, env, route.valid is not False, mode, warmup,
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
    # A route mismatch (a record against RL-Kernel's rules, a case or hook contradiction) is the
    # route layer's finding too; the verdict takes it from the semantic judgement ("route: ..."
    # above: incomparable), so it is added after the lines that read the route's own reasons.
    for reason in mismatch.reasons:
        route.fail(reason)

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
    reproducibility, claims, steps_data = judge_reproducibility(
        ev.reproducibility, baseline=cell is None or is_all_r(cell))
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
    judgements = {"route": route, "semantic": semantic, "numeric": numeric,
                  "performance": performance, "reproducibility": reproducibility}
    findings = [Finding("run", "fail", r, "cell-run.json") for r in run_errors]
    findings += [Finding("capability", "fail", f"{cls}: {why}", "capability")
                 for cls, why in unsupported]
    findings += [Finding("evidence", "fail", r) for r in evidence_errors]
    findings += [f for j in judgements.values() for f in j.findings]
    return Decision(
        verdict=verdict,
        reasons=reasons,
        failed=failed,
        judgements=judgements,
        findings=findings,
        unsupported_class=unsupported_class,
        expected_gap=expected_gap,
        contract=contract,
        performance_usable=performance.valid is True and verdict == "valid",
        claims=claims, steps=steps_data,
    )
