"""Numeric validity: the active-token drift satisfies the contract the backends declared (or the
matrix file's baseline contract for all-R cells); no tolerance is invented here. A production
side anywhere has no contract: its drift is reported, not judged. A comparison that compared
nothing (no evidence, no active tokens, NaN) is "not judged", never a pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pytest_rlkernel_matrix.judge.findings import Judgement
from pytest_rlkernel_matrix.judge.read.evidence import SIDES, Evidence
from pytest_rlkernel_matrix.judge.read.metrics import bitwise_reason
from pytest_rlkernel_matrix.judge.read.policy import Policy
from pytest_rlkernel_matrix.judge.read.upstream import bitwise_validation_status
from pytest_rlkernel_matrix.spec.cells import Cell

BITWISE_WORDS = ("bitwise", "exact", "bitwise_equal", "bitwise-equal")



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



def judge_numeric(ev: Evidence, mode: str, cell: Cell | None = None,
                   policy: Policy | None = None) -> tuple[Judgement, dict[str, Any], list[str]]:
    num = Judgement(layer="numeric")
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
        num.not_judged()
        return num, contract, errors
    if m.active_token_count == 0:
        errors.append("logprob evidence holds no active (mask=1) tokens")
        num.not_judged()
        return num, contract, errors
    if m.nonfinite_count:
        errors.append(f"NaN/inf in {m.nonfinite_count} of {m.active_token_count} active logprobs")
        num.not_judged()
        return num, contract, errors
    if getattr(m, "positive_logprob_count", 0):
        errors.append(f"impossible logprobs: {m.positive_logprob_count} active logprob value(s) "
                      "above 0 (a log-probability is at most 0): not logprob evidence")
        num.not_judged()
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
                num.not_judged(msg)
        else:
            num.not_judged(f"no contract: {contract['why']}")
    return num, contract, errors



def factor_contract(cell: Cell) -> dict[str, Any] | None:
    """A factor cell whose factor may change the drift has no contract (None: judged as usual)."""
    f = cell.factor
    if f is None or f.expect == "invariant":
        return None
    return {"kind": "none", "sources": {}, "problems": [],
            "why": f"this cell varies {f.name}={f.variant} (expect {f.expect}): its "
                   "train/rollout drift is measured and attributed against the baseline "
                   "cell, not held to a contract"}
