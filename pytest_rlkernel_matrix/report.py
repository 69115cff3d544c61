"""Cell records and `matrix-report.json`: built from artifacts alone, written atomically.

`analyze_run` is the one analysis path: the pytest session and `rlk-matrix report` both call it
on a run directory (its `cell-run.json` plus the artifacts), so re-analysis reproduces a record.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.attribution import attribute
from pytest_rlkernel_matrix.cells import Cases, Cell
from pytest_rlkernel_matrix.evidence import SIDES, Evidence, read_evidence
from pytest_rlkernel_matrix.matrix import ExpectedGap
from pytest_rlkernel_matrix.runner import RunResult
from pytest_rlkernel_matrix.terms import ALL_MODULES
from pytest_rlkernel_matrix.verdict import Decision, contract_id, decide

REPORT_SCHEMA = "rlk-matrix.report.v1"
CELL_RUN_FILE = "cell-run.json"
REPORT_FILE = "matrix-report.json"
METRIC_FIELDS = (
    "active_token_count", "logprob_abs_diff_mean", "logprob_abs_diff_max",
    "logprob_abs_diff_p50", "logprob_abs_diff_p90", "logprob_abs_diff_p99", "mismatch_count",
    "bitwise_mismatch_count", "mismatch_fraction", "mismatch_kl", "mismatch_k3_kl",
    "sample_count", "rank_count", "nonfinite_count",
)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON via a temp file in the same directory and `os.replace`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=False, default=str)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cell_from_dict(data: Mapping[str, Any]) -> Cell:
    cases = data["cases"]
    return Cell(str(data["hardware"]), str(data["module"]), str(data["case"]),
                Cases(cases["attention"], cases["ffn"], cases["logp"], cases.get("comm", "")))


def cell_to_dict(cell: Cell) -> dict[str, Any]:
    return {"hardware": cell.hardware, "module": cell.module, "case": cell.case,
            "cases": cell.cases.as_dict()}


def _route_fields(cell: Cell, ev: Evidence) -> dict[str, Any]:
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
                impls.append(f"{prefix}{side_route['implementation']}")
                backends.append(prefix + ",".join(side_route["backend_ids"]))
        out[f"actual_{side}_implementation"] = ";".join(impls)
        out[f"{side}_backend_id"] = ";".join(backends)
    return out


def analyze_run(
    run_dir: Path,
    *,
    gaps: Sequence[ExpectedGap] = (),
    fingerprints: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One record for the run in `run_dir` (labelled with the cell that ran it)."""
    meta = json.loads((run_dir / CELL_RUN_FILE).read_text(encoding="utf-8"))
    cell = cell_from_dict(meta["cell"])
    run = RunResult(**meta["run"])
    mode = str(meta["mode"])
    ev = read_evidence(run_dir)
    decision = decide(cell, mode=mode, run=run, ev=ev, env=meta.get("env", {}), gaps=gaps,
                      warmup=int(meta.get("warmup", 0)),
                      blockers=[tuple(b) for b in meta.get("preflight_blockers", [])])
    return build_record(cell, meta, run, ev, decision, fingerprints or meta.get("fingerprints", {}))


def build_record(
    cell: Cell,
    meta: Mapping[str, Any],
    run: RunResult,
    ev: Evidence,
    decision: Decision,
    fingerprints: Mapping[str, str],
) -> dict[str, Any]:
    metrics = ev.metrics.as_dict() if ev.metrics else {}
    phases, spread = ev.log.phases(int(meta.get("warmup", 0)))
    record: dict[str, Any] = {
        "hardware": cell.hardware,
        "module": cell.module,
        "case": cell.case,
        "requested_case": cell.cases.of(cell.module) if cell.module in ALL_MODULES else cell.case,
        "cases": cell.cases.as_dict(),
        "baseline": cell.is_baseline,
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
        **_route_fields(cell, ev),
        "contract_id": contract_id(ev),
        "contract": decision.contract,
        "build_fingerprint": fingerprints.get("build_fingerprint"),
        "hardware_fingerprint": fingerprints.get("hardware_fingerprint"),
        "fallbacks": ev.fallbacks + [
            {"source": "run.log", "line": line} for line in ev.log.fallback_lines
        ],
        "exit_code": run.exit_code,
        "timed_out": run.timed_out,
        "process_wall_time": run.wall_time,
        "devices": meta.get("devices"),
        "worker": meta.get("worker"),
        "window": meta.get("window"),
        **{k: metrics.get(k) for k in METRIC_FIELDS},
        **phases,
        "phase_spread": spread,
        "logprob_source": ev.logprob_source,
        "readbacks": ev.readback_files,
        "sidecar_count": len(ev.sidecar_files),
        "sidecar_schema": ev.sidecar_schema,
        "weight_versions": ev.weight_versions,
        "capability": ev.capability,
        "log_errors": ev.log.errors,
        "contamination": ev.log.contamination,
        "fault_drill": (ev.manifest or {}).get("fault_drill"),
        "worst_tokens": metrics.get("worst_tokens", []),
        "first_mismatch": metrics.get("first_mismatch", []),
        "first_mismatch_summary": metrics.get("first_mismatch_summary", {}),
        "dlogp_histogram": metrics.get("histogram", {}),
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
    for side in SIDES:
        r = routes[cell.module].get(side)
        out[f"actual_{side}_implementation"] = r["implementation"] if r else "unreported"
        out[f"{side}_backend_id"] = ",".join(r["backend_ids"]) if r else "unreported"
    return out


def not_run_record(cell: Cell, mode: str, reason: str, verdict: str) -> dict[str, Any]:
    return {
        "hardware": cell.hardware, "module": cell.module, "case": cell.case,
        "requested_case": cell.cases.of(cell.module) if cell.module in ALL_MODULES else cell.case,
        "cases": cell.cases.as_dict(), "baseline": cell.is_baseline, "run_key": cell.run_key,
        "mode": mode, "verdict": verdict, "reasons": [reason], "failed": False,
        "artifact_dir": None, "run_id": None,
    }


def summarize(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    counts = Counter(str(r.get("verdict")) for r in records)
    return dict(sorted(counts.items()))


def build_report(
    records: Sequence[Mapping[str, Any]],
    *,
    matrix: Mapping[str, Any],
    matrix_root: Path,
    preflight: Mapping[str, Any] | None,
    created: str,
    expected_cells: int,
    interrupted: bool,
) -> dict[str, Any]:
    ordered = sorted(records, key=lambda r: (r["hardware"], cell_order(r)))
    return {
        "schema_version": REPORT_SCHEMA,
        "created": created,
        "matrix": dict(matrix),
        "matrix_root": str(matrix_root),
        "complete": len(records) == expected_cells and not interrupted,
        "interrupted": interrupted,
        "expected_cells": expected_cells,
        "summary": summarize(records),
        "preflight": dict(preflight or {}),
        "attribution": attribute(ordered),
        "cells": ordered,
    }


def cell_order(record: Mapping[str, Any]) -> tuple[int, str, int]:
    """Sort key within one hardware: modules in matrix order, then R/R, P/R, R/P, P/P."""
    module_rank = ALL_MODULES.index(record["module"]) if record["module"] in ALL_MODULES else 9
    case_rank = ("R/R", "P/R", "R/P", "P/P").index(record["case"]) if record["case"] in (
        "R/R", "P/R", "R/P", "P/P") else 9
    return (module_rank, str(record["case"]) if case_rank == 9 else "", case_rank)


def _fmt_s(value: Any) -> str:
    return "-" if value is None else f"{float(value):.2f}s"


def _fmt_d(value: Any) -> str:
    return "-" if value is None else (f"{float(value):.2e}" if value else "0")


def table(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The request's report template as a terminal table."""
    head = ("hardware", "module", "case", "training route", "rollout route", "fallback",
            "max|dlogp|", "mismatch", "rollout", "train", "sync", "step", "verdict")
    rows = [head]
    for r in sorted(records, key=lambda r: (r["hardware"], cell_order(r))):
        rows.append((
            str(r["hardware"]), str(r["module"]), str(r["case"]),
            str(r.get("actual_training_implementation") or "-"),
            str(r.get("actual_rollout_implementation") or "-"),
            "yes" if r.get("fallbacks") else "no",
            _fmt_d(r.get("logprob_abs_diff_max")),
            "-" if r.get("active_token_count") is None else
            f"{r.get('mismatch_count', 0)}/{r.get('active_token_count')}",
            _fmt_s(r.get("rollout_wall_time")), _fmt_s(r.get("training_wall_time")),
            _fmt_s(r.get("weight_sync_wall_time")), _fmt_s(r.get("step_wall_time")),
            str(r["verdict"]),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]
