"""Route validity: each side of each module ran the implementation the case requested, under
the backend ids that implementation allows, with no fallback (readbacks, hooks, route lines and
RL-Kernel's own record rules, `rules`).

Allow-lists: R is proven only by a record of an RL-Kernel backend id (or the run's own under
its declared runtime policy) with calls; a missing record, a missing call count or backend id,
an unknown id and any truthy fallback are reasons, never a pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_rlkernel_matrix.judge.findings import Judgement
from pytest_rlkernel_matrix.judge.read.evidence import SIDES, Evidence, Route
from pytest_rlkernel_matrix.judge.route.crosscheck import (
    hook_findings,
    is_rlkernel_backend,
    log_route_fallbacks,
    native_logp_evidence,
)
from pytest_rlkernel_matrix.judge.route.rules import declared_policy, own_backend, upstream_findings
from pytest_rlkernel_matrix.spec.cells import Cell

IMPLEMENTATION = {"P": "production", "R": "rl_kernel"}



def _real_backend(bid: str, impl: str, own: Mapping[str, Any] | None = None) -> bool:
    """An R backend is RL-Kernel's as RL-Kernel writes it, or the run's own under its declared
    runtime policy; a P backend is neither, whatever its padding or case."""
    norm = bid.strip().casefold()
    if impl == "rl_kernel":
        return is_rlkernel_backend(bid) or (own_backend(bid, own)
                                            and not norm.endswith(".unidentified"))
    return not norm.startswith("rlkernel.") and not own_backend(bid, own)


def _line_reports(ev: Evidence, module: str, side: str) -> bool:
    """A run.log route line names this side of this module (its contradictions are
    `log_route_fallbacks`' to find)."""
    from pytest_rlkernel_matrix.judge.read.upstream import side_of

    return any(line.get("module") == module and (line.get("actual") or line.get("implementation"))
               and side_of(line.get("framework"), line.get("target")) == side
               for line in ev.log.routes)


def judge_route(cell: Cell, mode: str, ev: Evidence, platform: str | None = None,
                 ) -> tuple[Judgement, Judgement, list[str]]:
    """(route, mismatch, fallbacks): route problems that are fallbacks vs other mismatches."""
    route = Judgement(layer="route")
    mismatch = Judgement(layer="route")
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
                elif not (module == "logp" and side == "training") and not _line_reports(
                        ev, module, side):
                    # Nothing reports this side: its route is not judged, never a pass (issue
                    # 53). `off` says what it expected: RL-Kernel disabled, production.
                    expect = ("off mode expects production (RL-Kernel disabled)" if mode == "off"
                              else "P (production) requested")
                    route.not_judged(f"{where}: {expect}, but no readback or route line "
                                     "reports this side: route not reported, not judged")
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
    if mode != "off":  # upstream's record rules, platform by platform (route/rules.py)
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
