"""Cell records and `matrix-report.json`: built from artifacts alone, written atomically.

`analyze_run` is the one analysis path: the pytest session and `rlk-matrix report` both call it
on a run directory (its `cell-run.json` plus the artifacts), so re-analysis reproduces a record.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.attribution import attribute
from pytest_rlkernel_matrix.cells import Cases, Cell
from pytest_rlkernel_matrix.contamination import read_measurement
from pytest_rlkernel_matrix.evidence import SIDES, Evidence, read_evidence
from pytest_rlkernel_matrix.matrix import ExpectedGap
from pytest_rlkernel_matrix.redact import Scrubber
from pytest_rlkernel_matrix.runner import RunResult
from pytest_rlkernel_matrix.stats import Policy as PerformancePolicy
from pytest_rlkernel_matrix.terms import ALL_MODULES, plural
from pytest_rlkernel_matrix.verdict import Decision, Policy, contract_id, decide

REPORT_SCHEMA = "rlk-matrix.report.v1"
CELL_RUN_FILE = "cell-run.json"
REPORT_FILE = "matrix-report.json"
METRIC_FIELDS = (
    "active_token_count", "logprob_abs_diff_mean", "logprob_abs_diff_max",
    "logprob_abs_diff_p50", "logprob_abs_diff_p90", "logprob_abs_diff_p99", "mismatch_count",
    "bitwise_mismatch_count", "mismatch_fraction", "mismatch_kl", "mismatch_k3_kl",
    "sample_count", "rank_count", "nonfinite_count",
)


def json_safe(value: Any, _depth: int = 0) -> Any:
    """`value` with every non-finite float replaced by None (strict JSON has no NaN/Infinity).

    numpy scalars become Python numbers first; what json cannot encode becomes its `str`.
    """
    if _depth > 200:
        return str(value)[:200]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v, _depth + 1) for v in value]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 1) == 0:
        try:
            return json_safe(item(), _depth + 1)
        except (TypeError, ValueError):
            pass
    return str(value)



def file_mode() -> int:
    """The mode a plain `open(path, "w")` would give a new file: 0o666 less the umask.

    Read from /proc/self/status (Linux >= 4.7) so the process-wide umask is never changed;
    elsewhere `os.umask` is set and restored at once.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and `os.replace`, with the mode every other
    file gets (0644 under the usual umask 022; `mkstemp` alone would leave 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    """Write strict JSON (no NaN/Infinity: `json_safe`) atomically (`write_text_atomic`)."""
    text = json.dumps(json_safe(data), indent=2, sort_keys=False, allow_nan=False)
    write_text_atomic(path, text + "\n")


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


def read_cell_run(run_dir: Path) -> dict[str, Any]:
    """`cell-run.json` as a dict; `ValueError` naming the file and key when it is unusable."""
    from pytest_rlkernel_matrix.safeio import MAX_JSON_BYTES, Refused, read_bytes

    path = run_dir / CELL_RUN_FILE
    try:
        meta = json.loads(read_bytes(path, run_dir, MAX_JSON_BYTES).decode("utf-8"))
    except (Refused, OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: unreadable: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object")
    for key, kind in (("cell", dict), ("run", dict), ("mode", str)):
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"{path}: key {key!r} missing or not a {kind.__name__}")
    return meta


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
    scrub = (scrubber or Scrubber.from_env(os.environ)).obj
    try:
        meta = read_cell_run(run_dir)
        run_cell = cell_from_dict(meta["cell"])
        run = RunResult(**meta["run"])
    except (ValueError, TypeError, KeyError) as exc:
        if cell is None:
            raise
        return scrub(error_record(cell, mode or "?", f"cell-run.json: {exc}", artifact_dir))
    try:
        ev = read_evidence(run_dir)
        decision = decide(run_cell, mode=str(meta["mode"]), run=run, ev=ev,
                          env=meta.get("env") if isinstance(meta.get("env"), dict) else {},
                          gaps=gaps, warmup=int(meta.get("warmup", 0) or 0),
                          blockers=[tuple(b) for b in meta.get("preflight_blockers") or []],
                          policy=Policy.from_meta(meta),
                          performance_policy=PerformancePolicy.from_mapping(
                              meta.get("performance_policy")))
        # The run's own fingerprints (a Slurm job's node) come first; `fingerprints` fills the
        # gap for runs recorded without them.
        fps = meta.get("fingerprints") or ({} if meta.get("scheduler") else fingerprints) or {}
        record = build_record(run_cell, meta, run, ev, decision, fps)
        scheduler = meta.get("scheduler")
        if isinstance(scheduler, dict):
            _judge_node(record, run_cell, scheduler, fps)
        return scrub(record)
    except Exception as exc:  # a bug or a shape no reader foresaw: this cell is an error
        return scrub(error_record(cell or run_cell, str(meta["mode"]),
                                  f"analysis failed: {type(exc).__name__}: {str(exc)[:300]}",
                                  meta.get("artifact_dir") or artifact_dir))


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


def node_fingerprint_groups(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per hardware profile: which cells ran under which (hardware, build) fingerprint pair, and
    a flag per profile whose cells ran on nodes that differ (times across them are refused)."""
    groups: dict[str, dict[tuple[Any, Any], dict[str, Any]]] = {}
    for r in records:
        if r.get("verdict") == "not_run" or not r.get("artifact_dir"):
            continue
        key = (r.get("hardware_fingerprint"), r.get("build_fingerprint"))
        entry = groups.setdefault(str(r["hardware"]), {}).setdefault(
            key, {"hardware_fingerprint": key[0], "build_fingerprint": key[1], "nodes": [],
                  "cells": []})
        nodes = (r.get("scheduler") or {}).get("nodes")
        if nodes and nodes not in entry["nodes"]:
            entry["nodes"].append(nodes)
        entry["cells"].append(f"{r['module']} {r['case']}")
    out: dict[str, Any] = {"flags": [], "groups": {}}
    for hardware, by_fp in sorted(groups.items()):
        out["groups"][hardware] = list(by_fp.values())
        if len(by_fp) > 1:
            parts = [f"hardware {g['hardware_fingerprint']} / build {g['build_fingerprint']} "
                     f"on {', '.join(g['nodes']) or '?'} ({plural(len(g['cells']), 'cell')})"
                     for g in by_fp.values()]
            out["flags"].append(
                f"{hardware}: cells ran on nodes with different fingerprints: "
                + "; ".join(parts) + "; performance comparisons across them are refused")
    return out


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
        "contamination_measured": read_measurement(ev.root),
        "performance_policy": PerformancePolicy.from_mapping(
            meta.get("performance_policy")).as_dict(),
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
        "node_fingerprints": node_fingerprint_groups(ordered),
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
