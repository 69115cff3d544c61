"""One cell's record: the one place a record is made, from artifacts alone.

`analyze_run` is the one analysis path: the pytest session and `rlk-matrix report` both call it
on a run directory (its `cell-run.json` plus the artifacts), so re-analysis reproduces a record.
It reads the run result and the evidence, asks the judge layer for the decision and builds the
record from (cell, run result, evidence, decision) in `build_record`. Records of cells without
an analysable run are made here too: not run (`off_mode_record`), refused (`refusal_record`),
interrupted (`interrupted_record`) and errors (`error_record`, `internal_error_record`).
The session report over all records is `report.matrix_report`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_rlkernel_matrix.spec.cells import Cases, Cell, FactorPoint
from pytest_rlkernel_matrix.spec.terms import ALL_MODULES
from pytest_rlkernel_matrix.store.redact import Scrubber

if TYPE_CHECKING:  # the readers and the judge (numpy, pydantic) load only when a cell is read
    from pytest_rlkernel_matrix.judge.decide import Decision
    from pytest_rlkernel_matrix.judge.read.evidence import Evidence
    from pytest_rlkernel_matrix.run.runner import RunResult
    from pytest_rlkernel_matrix.spec.matrix import ExpectedGap

CELL_RUN_FILE = "cell-run.json"
# The analysis of the same artifacts gives other records when this changes: bump it with any
# change to the readers, the verdict or the record (it invalidates `rlk-matrix report`'s cache).
ANALYSIS_VERSION = 6  # 2: sidecars read as RL-Kernel reads them (issue 20); 3: stale weight
# notes; 4: runtime exposure and hooks cross-checked, per-cell .pt memo (issues 20, 24);
# 5: the route that ran, from the readback and the route lines (`ran`, issue 32);
# nothing compared is not judged, (rank, call) coverage, strict claims (issue 34)
# 5: measured runs (`<run>/measured.<k>`, report.measured) and the owned share (issue 33)
# 6: the judge by validity layers, allow-list route rules, bounded reading (issue 44); the cache
# also keys on the judging code's digest (report/cache.py), so a bump is no longer required there
# 6 also: importance-ratio figures (loss_impact), debugger and vime audit evidence (issue 45)
SIDES = ("training", "rollout")  # judge.read.evidence.SIDES (not imported: it loads numpy)
MISMATCH_KL_LABEL = "k1 = mean(rollout - train), RL-Kernel's mismatch_kl; sign not meaningful"
METRIC_FIELDS = (
    "active_token_count", "logprob_abs_diff_mean", "logprob_abs_diff_max",
    "logprob_abs_diff_p50", "logprob_abs_diff_p90", "logprob_abs_diff_p99", "mismatch_count",
    "bitwise_mismatch_count", "mismatch_fraction", "mismatch_kl", "mismatch_k3_kl",
    "train_rollout_logprob_abs_diff", "sample_count", "rank_count", "nonfinite_count",
)


def cell_from_dict(data: Mapping[str, Any]) -> Cell:
    cases = data["cases"]
    factor = data.get("factor")
    return Cell(str(data["hardware"]), str(data["module"]), str(data["case"]),
                Cases(cases["attention"], cases["ffn"], cases["logp"], cases.get("comm", "")),
                FactorPoint.from_dict(factor) if isinstance(factor, Mapping) else None)


def cell_to_dict(cell: Cell) -> dict[str, Any]:
    out = {"hardware": cell.hardware, "module": cell.module, "case": cell.case,
           "cases": cell.cases.as_dict()}
    if cell.factor is not None:
        out["factor"] = cell.factor.as_dict()
    return out


def _route_lines(ev: Evidence, module: str, side: str) -> tuple[list[str], list[str]]:
    """(implementations, `actual=` backends) the run.log route lines give for one side of one
    module: `rl_kernel` for an RL-Kernel backend, one under the run's declared runtime policy (its
    own R) or `implementation=rl_kernel`, else `production`."""
    from pytest_rlkernel_matrix.judge.read.upstream import side_of
    from pytest_rlkernel_matrix.judge.route.crosscheck import is_rlkernel_backend
    from pytest_rlkernel_matrix.judge.route.rules import declared_policy, own_backend

    own, _ = declared_policy(ev.runtime_policies)  # a run's own R backends, as the verdict reads
    impls: list[str] = []
    actual: list[str] = []
    for line in ev.log.routes:
        if line.get("module") != module or side_of(line.get("framework"),
                                                    line.get("target")) != side:
            continue
        if line.get("actual"):
            actual.append(str(line["actual"])[:120])
            backend = str(line["actual"])
            impls.append("rl_kernel" if is_rlkernel_backend(backend) or own_backend(backend, own)
                         else "production")
        elif line.get("implementation"):
            impls.append("rl_kernel" if line["implementation"] == "rl_kernel" else "production")
    return list(dict.fromkeys(impls)), list(dict.fromkeys(actual))


def ran(wanted: str, reported: Sequence[str | None]) -> str | None:
    """The route that ran, from what the readback and the route lines report: their one answer,
    or where they disagree the one that is not the request (a production route anywhere on an R
    side is a fallback, never R evidence); None when nothing reports it."""
    found = list(dict.fromkeys(r for r in reported if r))
    if len(found) <= 1:
        return found[0] if found else None
    if "mixed" in found:
        return "mixed"
    other = [r for r in found if r != wanted]
    return other[0] if len(other) == 1 else "mixed"


def _route_fields(cell: Cell, ev: Evidence) -> dict[str, Any]:
    from pytest_rlkernel_matrix.judge.route.crosscheck import native_logp_evidence

    routes: dict[str, Any] = {}
    for module in cell.cases.modules:
        entry: dict[str, Any] = {"requested": cell.cases.of(module)}
        for side in SIDES:
            r = ev.routes[side].get(module)
            entry[side] = None if r is None else {
                "implementation": r.implementation, "backend_ids": r.backend_ids,
                "call_count": r.call_count, "processes": r.processes, "fallback": r.fallback,
                "runtime_platforms": r.runtime_platforms, "execution_modes": r.execution_modes,
                "contract": r.contracts[0] if len(r.contracts) == 1 else (r.contracts or None),
            }
            marker = (native_logp_evidence(ev.log.logp_markers, cell.cases.of(module))
                      if module == "logp" and side == "training" and r is None else None)
            if marker is not None:  # native Megatron logp writes no record: its log marker
                bid = (marker.split("backend_id=", 1)[1].split()[0] if "backend_id=" in marker
                       else "vime.native.linear_logp")
                entry[side] = {"implementation": "production", "backend_ids": [bid],
                               "call_count": None, "processes": 0, "fallback": False,
                               "runtime_platforms": [], "execution_modes": [],
                               "contract": None, "evidence": "run.log marker"}
            wanted = "rl_kernel" if cell.cases.side(module, side) == "R" else "production"
            line_impls, line_actual = _route_lines(ev, module, side)
            got = ran(wanted, [entry[side]["implementation"] if entry[side] else None,
                               *line_impls])
            if got is not None:
                if entry[side] is None:  # only the route line tells
                    entry[side] = {"implementation": None, "backend_ids": line_actual,
                                   "call_count": None, "processes": 0, "fallback": False,
                                   "runtime_platforms": [], "execution_modes": [],
                                   "contract": None, "evidence": "run.log route line"}
                entry[side].update(ran=got, wanted=wanted, route_line=line_actual or None)
        routes[module] = entry
    out: dict[str, Any] = {"routes": routes}
    focus = [cell.module] if cell.module in ALL_MODULES else list(cell.cases.modules)
    for side in SIDES:
        impls, backends = [], []
        for module in focus:
            side_route = routes[module][side]
            prefix = "" if len(focus) == 1 else f"{module}="
            if side_route is None:
                impls.append(f"{prefix}unreported")
                backends.append(f"{prefix}unreported")
            else:
                impls.append(f"{prefix}{side_route.get('ran') or side_route['implementation']}")
                backends.append(prefix + ",".join(side_route["backend_ids"]))
        out[f"actual_{side}_implementation"] = ";".join(impls)
        out[f"requested_{side}_implementation"] = ";".join(
            f"{'' if len(focus) == 1 else f'{m}='}"
            f"{'rl_kernel' if cell.cases.side(m, side) == 'R' else 'production'}" for m in focus)
        out[f"{side}_backend_id"] = ";".join(backends)
    return out


def unfinished_word(run: Any) -> str | None:
    """`interrupted` / `timed out` / `not started` for a run that did not finish, else None."""
    if getattr(run, "interrupted", False):
        return "interrupted"
    if getattr(run, "timed_out", False):
        return "timed out"
    if getattr(run, "launch_error", None):
        return "not started"
    return None


def unfinished_routes(fields: dict[str, Any], run: Any) -> dict[str, Any]:
    """Routes as they ran (issue 53): a run that did not finish shows its state on both sides
    (`interrupted`), never a side it did not run to the end (its partial log could read as a
    fallback). What it reported before it stopped stays in `routes`, marked `unfinished`."""
    word = unfinished_word(run)
    if word is None:
        return fields
    for side in SIDES:
        fields[f"actual_{side}_implementation"] = word
    for entry in fields.get("routes", {}).values():
        entry["unfinished"] = word
    return fields


def conformance_fields(cell: Cell, ev: Evidence) -> dict[str, Any]:
    """What the record says about RL-Kernel's own artifact forms (docs/en/conformance.md)."""
    from pytest_rlkernel_matrix.judge.read.upstream import bitwise_validation_status, route_form
    from pytest_rlkernel_matrix.judge.route.crosscheck import native_logp_evidence
    from pytest_rlkernel_matrix.judge.semantic.judge import exposure_of

    bv = ev.bitwise_validation
    status, detail = bitwise_validation_status(bv) if isinstance(bv, dict) else (None, "")
    return {
        "weight_audit": ev.weight_audit.as_dict(),
        "route_line_form": route_form(ev.log.routes),
        "installed_hooks": ev.hooks,
        "runtime_exposure": exposure_of(ev).as_dict(),
        "native_logp_marker": native_logp_evidence(ev.log.logp_markers, cell.cases.of("logp")),
        "offline_comparison": None if status is None else {"status": status, "detail": detail},
    }


def read_cell_run(run_dir: Path) -> dict[str, Any]:
    """`cell-run.json` as a dict; `ValueError` naming the file and key when it is unusable."""
    from pytest_rlkernel_matrix.store.safeio import Refused, read_json

    path = run_dir / CELL_RUN_FILE
    try:  # (strict JSON: a key twice, NaN or Infinity is refused)
        meta = read_json(path, run_dir)
    except (Refused, OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: unreadable: {type(exc).__name__}: {str(exc)[:200]}") from None
    from pytest_rlkernel_matrix.judge.read.cellrun import validated

    validated(meta, path)  # (pydantic: every key the judge reads, typed; a wrong one names it)
    return meta


def identity_problem(asked: Cell | None, ran: Cell) -> str | None:
    """Why the run in a directory is not the cell asked for (None: it is, or none was asked):
    its `cell-run.json` names another cell (id or cases); the directory is never judged as
    the cell asked for."""
    if asked is None:
        return None
    if ran.id != asked.id or ran.cases.as_dict() != asked.cases.as_dict():
        return (f"identity: cell-run.json is the run of {ran.id} ({ran.name}), not of the cell "
                f"asked for, {asked.id} ({asked.name}): not judged as {asked.name}")
    return None


def error_record(cell: Cell, mode: str, reason: str, artifact_dir: str | None) -> dict[str, Any]:
    """A cell whose run directory cannot be analysed: `error`, failed, with the reason."""
    record = not_run_record(cell, mode, reason, "error")
    record.update(failed=True, artifact_dir=artifact_dir)
    return record


def analyze_run(
    run_dir: Path,
    *,
    gaps: Sequence[ExpectedGap] = (),
    fingerprints: Mapping[str, str] | None = None,
    cell: Cell | None = None,
    mode: str | None = None,
    artifact_dir: str | None = None,
    scrubber: Scrubber | None = None,
) -> dict[str, Any]:
    """One record for the run in `run_dir` (labelled with the cell that ran it).

    Never raises for bad artifacts: an unusable `cell-run.json` (or an analysis failure) is an
    `error` record for `cell` (the caller's, since the file cannot say) with the reason.
    Every string in it is scrubbed of secret values (`redact`): the session passes the scrubber
    that knows the cell's secrets; without one, the secrets of this process's environment.
    """
    from pytest_rlkernel_matrix.judge.decide import decide
    from pytest_rlkernel_matrix.judge.localise.debugger import debugger_evidence
    from pytest_rlkernel_matrix.judge.localise.profile import attach_profile
    from pytest_rlkernel_matrix.judge.read.evidence import pt_memo, read_evidence
    from pytest_rlkernel_matrix.judge.read.policy import Policy
    from pytest_rlkernel_matrix.judge.read.steps import read_reproducibility
    from pytest_rlkernel_matrix.run.runner import RunResult
    from pytest_rlkernel_matrix.spec.limits import Policy as PerformancePolicy

    scrub = (scrubber or Scrubber.from_env(os.environ)).obj
    try:
        meta = read_cell_run(run_dir)
        run_cell = cell_from_dict(meta["cell"])
        run = RunResult(**meta["run"])
    except (ValueError, TypeError, KeyError) as exc:
        if cell is None:
            raise
        return scrub(error_record(cell, mode or "?", f"cell-run.json: {exc}", artifact_dir))
    foreign = identity_problem(cell, run_cell)
    if foreign is not None and cell is not None:
        return scrub(error_record(cell, mode or str(meta["mode"]), foreign, artifact_dir))
    try:
        t0 = time.perf_counter()
        with pt_memo():  # the evidence and the per-step claims read each `.pt` file once
            ev = read_evidence(run_dir)
            policy = Policy.from_meta(meta)  # (the layers take typed objects; decide reads none)
            ev.reproducibility = read_reproducibility(run_dir, policy.repeat_dir)
            # RL-Kernel's debugger bundles: first divergence and upstream's report cross-checked;
            # their problems keep the cell from valid like any evidence's (issue 45)
            debugger_evidence(ev)
            t1 = time.perf_counter()
            decision = decide(run_cell, mode=str(meta["mode"]), run=run, ev=ev,
                              env=meta.get("env") if isinstance(meta.get("env"), dict) else {},
                              gaps=gaps, warmup=int(meta.get("warmup", 0) or 0),
                              blockers=[tuple(b) for b in meta.get("preflight_blockers") or []],
                              policy=policy,
                              performance_policy=PerformancePolicy.from_mapping(
                                  meta.get("performance_policy")))
        # The run's own fingerprints (a Slurm job's node) come first; `fingerprints` fills the
        # gap for runs recorded without them.
        fps = meta.get("fingerprints") or ({} if meta.get("scheduler") else fingerprints) or {}
        t2 = time.perf_counter()
        record = build_record(run_cell, meta, run, ev, decision, fps)
        record.update(overhead_fields(meta, run, {"evidence_s": t1 - t0, "verdict_s": t2 - t1,
                                                  "record_s": time.perf_counter() - t2}))
        scheduler = meta.get("scheduler")
        if isinstance(scheduler, dict):
            _judge_node(record, run_cell, scheduler, fps)
        _attach_localisation(record, run_dir)
        from pytest_rlkernel_matrix.report.measured import attach

        attach(record, run_dir, lambda d: analyze_run(
            d, gaps=gaps, fingerprints=fingerprints, cell=run_cell, mode=mode,
            artifact_dir=f"{artifact_dir or meta.get('artifact_dir')}/{d.name}",
            scrubber=scrubber))
        attach_profile(record, run_dir)
        return scrub(record)
    except Exception as exc:  # a bug or a shape no reader foresaw: this cell is an error
        return scrub(error_record(cell or run_cell, str(meta["mode"]),
                                  f"analysis failed: {type(exc).__name__}: {str(exc)[:300]}",
                                  meta.get("artifact_dir") or artifact_dir))


def _attach_localisation(record: dict[str, Any], run_dir: Path) -> None:
    """The latest probe run's ``localisation.json`` (``judge/localise/probe.py``), if the cell has
    one;
    else its ``probe-note.json`` (probing was asked for, but the run timed out or errored)."""
    from pytest_rlkernel_matrix.store.safeio import Refused, newest_followup, read_bytes

    path = newest_followup(run_dir, "probe", "localisation.json", "probe-note.json")
    if path is None:
        return
    try:
        loc = json.loads(read_bytes(path, run_dir, 16 * 1024 * 1024))
        if not isinstance(loc, dict) or not isinstance(loc.get("summary"), str):
            raise ValueError("not a localisation object")
    except (Refused, ValueError, UnicodeDecodeError) as exc:
        loc = {"status": "incomparable", "first_divergent": None,
               "reasons": [f"{path.relative_to(run_dir)}: unreadable: {exc}"],
               "summary": f"probe incomparable: {path.name} unreadable"}
    record["localisation"] = loc


def overhead_fields(meta: Mapping[str, Any], run: RunResult,
                    analysis: Mapping[str, float]) -> dict[str, Any]:
    """`overhead_s`: seconds the plugin spent on the cell outside the cell's own processes.

    The session's part comes from `cell-run.json`'s `overhead` (making the run directory and
    environment, launch + contamination sampling + waiting slack beyond the process's wall
    time, writing cell-run.json); the analysis' part (reading the evidence, the verdict,
    building the record) is measured by the analysis that made this record (a re-analysis
    measures its own). Writing `cell-record.json` afterwards is not counted.
    """
    session = meta.get("overhead") if isinstance(meta.get("overhead"), dict) else {}
    parts = {k: float(v) for k, v in session.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
    parts.update(analysis)
    parts = {k: round(max(0.0, v), 6) for k, v in parts.items()}
    total = round(sum(parts.values()), 6)
    wall = float(run.wall_time or 0.0) + total
    return {"overhead_s": total,
            "overhead": {**parts, "process_wall_s": run.wall_time, "cell_wall_s": round(wall, 6),
                         "fraction": round(total / wall, 6) if wall > 0 else None,
                         "session_measured": bool(session)}}


def _judge_node(record: dict[str, Any], cell: Cell, scheduler: Mapping[str, Any],
                fingerprints: Mapping[str, str]) -> None:
    """A job's node must be fingerprinted and be the hardware the cell names (fail closed)."""
    record["scheduler"] = dict(scheduler)
    problems: list[str] = []
    ran = scheduler.get("state") in ("COMPLETED", "FAILED")
    if ran and not (fingerprints.get("hardware_fingerprint")
                    and fingerprints.get("build_fingerprint")):
        problems.append(
            f"node preflight missing: Slurm job {scheduler.get('job_id')} on "
            f"{scheduler.get('nodes') or '?'} left no readable node-preflight.json (see "
            "node-preflight.log); the node's hardware and build are unknown")
    node_hw = scheduler.get("node_hardware", cell.hardware)
    if ran and "node_hardware" in scheduler and node_hw != cell.hardware:
        problems.append(
            f"node hardware: Slurm job {scheduler.get('job_id')} ran on "
            f"{scheduler.get('nodes') or '?'}, detected as "
            f"{node_hw or 'no profile of the matrix'}, not {cell.hardware}")
    if problems:
        record["reasons"] = problems + list(record.get("reasons") or [])
        if record["verdict"] in ("valid", "contract_mismatch", "incomparable"):
            record["verdict"] = "error"
        record["failed"] = record["failed"] or record["verdict"] == "error"
        record["performance_usable"] = False


def build_record(
    cell: Cell,
    meta: Mapping[str, Any],
    run: RunResult,
    ev: Evidence,
    decision: Decision,
    fingerprints: Mapping[str, str],
) -> dict[str, Any]:
    from pytest_rlkernel_matrix.judge.numeric.judge import contract_id
    from pytest_rlkernel_matrix.judge.performance.phases import phases as phases_of
    from pytest_rlkernel_matrix.judge.performance.phases import step_account
    from pytest_rlkernel_matrix.judge.read.metrics import FIGURE_CONVENTION
    from pytest_rlkernel_matrix.spec.limits import Policy as PerformancePolicy

    metrics = ev.metrics.as_dict() if ev.metrics else {}
    phases, spread = phases_of(ev.log, int(meta.get("warmup", 0)))
    # One account of the cell's time: the phase columns and the step are one step's (the median
    # one), so they add up; without a complete step the columns stay per-phase medians and the
    # record says they are no account (`step_account` null).
    account = step_account(ev.log, int(meta.get("warmup", 0)))
    phases = {**phases, **(account or {"step_account": None})}
    record: dict[str, Any] = {
        "hardware": cell.hardware,
        "module": cell.module,
        "case": cell.case,
        "requested_case": cell.cases.of(cell.module) if cell.module in ALL_MODULES else cell.case,
        "cases": cell.cases.as_dict(),
        "baseline": cell.is_baseline,
        "factor": None if cell.factor is None else cell.factor.as_dict(),
        "run_key": cell.run_key,
        "run_id": meta.get("run_id"),
        "artifact_dir": meta.get("artifact_dir"),
        "shared_with": [],
        "mode": meta.get("mode"),
        "verdict": decision.verdict,
        "reasons": decision.reasons,
        "failed": decision.failed,
        "unsupported_class": decision.unsupported_class,
        "expected_gap": decision.expected_gap,
        "validity": {k: {"valid": j.valid, "reasons": j.reasons}
                     for k, j in decision.judgements.items()},
        "performance_usable": decision.performance_usable,
        **unfinished_routes(_route_fields(cell, ev), run),
        "contract_id": contract_id(ev),
        "contract": decision.contract,
        "contract_judged": decision.contract.get("kind") in ("bitwise", "tolerance"),
        "build_fingerprint": fingerprints.get("build_fingerprint"),
        "hardware_fingerprint": fingerprints.get("hardware_fingerprint"),
        "fallbacks": ev.fallbacks + [
            {"source": "run.log", "line": line} for line in ev.log.fallback_lines
        ],
        "exit_code": run.exit_code,
        "timed_out": run.timed_out,
        "scheduler": meta.get("scheduler"),
        "process_wall_time": run.wall_time,
        "devices": meta.get("devices"),
        "worker": meta.get("worker"),
        "cpu_share": meta.get("cpu_share"),
        "window": meta.get("window"),
        **{k: metrics.get(k) for k in METRIC_FIELDS},
        "mismatch_kl_estimator": MISMATCH_KL_LABEL if metrics.get("mismatch_kl") is not None
        else None,
        "figure_convention": FIGURE_CONVENTION if metrics else None,
        **phases,
        "phase_spread": spread,
        "logprob_source": ev.logprob_source,
        "readbacks": ev.readback_files,
        "sidecar_count": len(ev.sidecar_files),
        "sidecar_schema": ev.sidecar_schema,
        "weight_versions": ev.weight_versions,
        "claims": decision.claims,
        "steps": decision.steps,
        **conformance_fields(cell, ev),
        "capability": ev.capability,
        "log_errors": ev.log.errors,
        "contamination": ev.log.contamination,
        "contamination_measured": ev.contamination,
        "performance_policy": PerformancePolicy.from_mapping(
            meta.get("performance_policy")).as_dict(),
        "fault_drill": (ev.manifest or {}).get("fault_drill"),
        "worst_tokens": metrics.get("worst_tokens", []),
        "first_mismatch": metrics.get("first_mismatch", []),
        "first_mismatch_summary": metrics.get("first_mismatch_summary", {}),
        "dlogp_histogram": metrics.get("histogram", {}),
        "loss_impact": metrics.get("loss_impact") or None,  # judge.read.loss (issue 45)
        "debugger": getattr(ev, "debugger", None) or None,  # judge.localise.debugger (45)
        "vime_audit": getattr(ev, "vime_audit", None),  # judge.read.vime_audit (45)
    }
    return record


def alias_record(record: Mapping[str, Any], cell: Cell) -> dict[str, Any]:
    """The same run reported under another (module, case) that names it."""
    out = dict(record)
    requested = cell.cases.of(cell.module) if cell.module in ALL_MODULES else cell.case
    out.update(module=cell.module, case=cell.case, requested_case=requested)
    out.update(_alias_routes(record, cell))
    return out


def _alias_routes(record: Mapping[str, Any], cell: Cell) -> dict[str, Any]:
    routes = record.get("routes") or {}
    if cell.module not in ALL_MODULES or cell.module not in routes:
        return {}
    out: dict[str, Any] = {}
    unfinished = routes[cell.module].get("unfinished")  # a run that did not finish: its state
    for side in SIDES:
        r = routes[cell.module].get(side)
        out[f"actual_{side}_implementation"] = unfinished or (
            (r.get("ran") or r["implementation"]) if r else "unreported")
        out[f"requested_{side}_implementation"] = (
            "rl_kernel" if cell.cases.side(cell.module, side) == "R" else "production")
        out[f"{side}_backend_id"] = ",".join(r["backend_ids"]) if r else "unreported"
    return out


def not_run_record(cell: Cell, mode: str, reason: str, verdict: str) -> dict[str, Any]:
    return {
        "hardware": cell.hardware, "module": cell.module, "case": cell.case,
        "requested_case": cell.cases.of(cell.module) if cell.module in ALL_MODULES else cell.case,
        "cases": cell.cases.as_dict(), "baseline": cell.is_baseline, "run_key": cell.run_key,
        "mode": mode, "verdict": verdict, "reasons": [reason], "failed": False,
        "artifact_dir": None, "run_id": None,
        "factor": None if cell.factor is None else cell.factor.as_dict(),
    }


# -- records of cells with no analysable run (made here, never in the session) -------------------

OFF_MODE_REASON = "not run in off mode: RL-Kernel is disabled, only P/P cells run"


def off_mode_record(cell: Cell, mode: str) -> dict[str, Any]:
    """A cell mode `off` does not run (it needs RL-Kernel): `not_run`, not failed."""
    return not_run_record(cell, mode, OFF_MODE_REASON, "not_run")


def refusal_record(cell: Cell, mode: str, run_dir: Path) -> dict[str, Any]:
    """A run directory that already holds another run's artifacts: `error`, failed, untouched."""
    record = not_run_record(
        cell, mode,
        f"artifact directory {run_dir} is not empty: refusing to overwrite another run's "
        "artifacts (choose a new --rlk-matrix-root or MATRIX_STAMP)",
        "error",
    )
    record["failed"] = True
    return record


def interrupted_record(cell: Cell, mode: str, artifact_dir: str, run_id: str) -> dict[str, Any]:
    """A run the session stopped before it was recorded (its processes were killed): `error`."""
    record = not_run_record(
        cell, mode, "interrupted: the session stopped before this cell's run "
        "was recorded (its processes were killed)", "error")
    record.update(artifact_dir=artifact_dir, failed=True, run_id=run_id,
                  actual_training_implementation="interrupted",
                  actual_rollout_implementation="interrupted")
    return record


def os_error_record(cell: Cell, mode: str, exc: OSError) -> dict[str, Any]:
    """A cell whose run directory (or a file in it) could not be written or read: `error`,
    failed, naming the path and the system's reason (a read-only cell directory is the matrix
    root's permissions, not the plugin's internal error)."""
    where = exc.filename or "its run directory"
    if exc.filename2:
        where = f"{where} -> {exc.filename2}"
    record = not_run_record(
        cell, mode, f"cannot use the cell's files: {where}: {exc.strerror or exc} "
        f"({type(exc).__name__}); check the matrix root's permissions and free space", "error")
    record["failed"] = True
    return record


def internal_error_record(cell: Cell, mode: str, exc: BaseException) -> dict[str, Any]:
    """A cell whose run raised inside the plugin: `error`, failed, the session goes on."""
    record = not_run_record(cell, mode,
                            f"internal error: {type(exc).__name__}: {str(exc)[:500]}", "error")
    record["failed"] = True
    return record


