"""`matrix-report.json`: the session report over every cell's record, and its terminal table.

The records come from `report.record`; this module orders them, counts the verdicts,
groups the nodes' fingerprints and adds the attribution (`report.attribution`). Given a
`memo` directory (`rlk-matrix report`'s cache), the attribution of records equal to the last
report's comes from `<memo>/attribution.json` instead of its bootstrap (numpy is then not
imported): the entry is keyed by the sha256 of the records and of the attribution's sources.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix import __version__
from pytest_rlkernel_matrix.judge.localise.profile import terminal_lines as profile_lines
from pytest_rlkernel_matrix.judge.performance.accounting import table_cell as unattributed_cell
from pytest_rlkernel_matrix.judge.read.loss import loss_short
from pytest_rlkernel_matrix.spec.terms import ALL_MODULES, factor_scope, plural
from pytest_rlkernel_matrix.store.atomic import json_safe, write_json_atomic
from pytest_rlkernel_matrix.store.safeio import MAX_JSON_BYTES, Refused, ensure_dir, read_bytes

REPORT_SCHEMA = "rlk-matrix.report.v1"


REPORT_FILE = "matrix-report.json"


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


def summarize(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    counts = Counter(str(r.get("verdict")) for r in records)
    return dict(sorted(counts.items()))


def started(record: Mapping[str, Any]) -> bool:
    """False for a record whose run never started (strict refused it before launch: no exit
    code, no timeout); records without the key (summaries, tests) count as started."""
    return not ("exit_code" in record and record["exit_code"] is None
                and not record.get("timed_out"))


def timing_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The performance mark, apart from the verdict: of the cells whose run was judged (their
    record has `performance_usable`), how many have timings usable for a performance statement
    and how many were refused (noise, contamination, a route or a run that forbids timing)."""
    judged = [r for r in records if "performance_usable" in r and started(r)]
    usable = sum(1 for r in judged if r.get("performance_usable") is True)
    return {"usable": usable, "not_usable": len(judged) - usable}


VERDICT_WORDS = ("error", "incomparable", "contract_mismatch", "fallback", "unsupported",
                 "valid", "not_run")


def counts_text(summary: Mapping[str, Any], timings: Mapping[str, Any] | None) -> str:
    """'1 fallback, 11 valid (timings: 8 usable, 4 not usable)': the verdict (evidence) counts,
    then the performance mark's, which a `valid` verdict does not imply."""
    order = [v for v in VERDICT_WORDS if v in summary] + [v for v in summary
                                                        if v not in VERDICT_WORDS]
    text = ", ".join(f"{summary[v]} {v}" for v in order) or "no cells"
    if timings and (timings.get("usable") or timings.get("not_usable")):
        text += (f" (timings: {timings.get('usable', 0)} usable, "
                 f"{timings.get('not_usable', 0)} not usable)")
    return text


MEMO_FILE = "attribution.json"


def _attribution_key(ordered: Sequence[Mapping[str, Any]]) -> str:
    from pytest_rlkernel_matrix.report.cache import judge_code_digest

    # what `attribute` / `attribute_factors` compute with: the whole package's code (the cache's
    # digest, never a hand-kept list of modules)
    digest = hashlib.sha256(__version__.encode())
    digest.update(judge_code_digest().encode())
    try:  # records read from JSON (cache hits) dump as they are; others made JSON-safe first
        text = json.dumps(list(ordered), sort_keys=True)
    except (TypeError, ValueError):
        text = json.dumps(json_safe(list(ordered)), sort_keys=True)
    digest.update(text.encode())
    return digest.hexdigest()


def attributions(ordered: Sequence[Mapping[str, Any]],
                 memo: Path | None = None) -> tuple[Any, Any, Any]:
    """(attribution, factor attribution, performance statements) of the ordered records, as
    JSON values; from `<memo>/attribution.json` when its key (records and sources) is this
    one's."""
    key = entry = None
    if memo is not None:
        try:
            key = _attribution_key(ordered)
        except OSError:  # the sources are not plain files (a zipped install): no memo
            memo = None
    if memo is not None:
        with suppress(OSError, ValueError, RecursionError, Refused):
            entry = json.loads(read_bytes(memo / MEMO_FILE, memo.parent, MAX_JSON_BYTES))
        if isinstance(entry, dict) and entry.get("key") == key and {
                "attribution", "factor_attribution", "performance"} <= entry.keys():
            return entry["attribution"], entry["factor_attribution"], entry["performance"]
    from pytest_rlkernel_matrix.report.attribution import attribute, attribute_factors
    from pytest_rlkernel_matrix.report.perf import performance, said_by_module

    # JSON values either way, so a memo hit and a fresh computation are the same objects
    perf = performance(ordered)  # its sentences are the attribution's timing conclusions
    out = json.loads(json.dumps(json_safe({"attribution": attribute(ordered,
                                                                    said_by_module(perf)),
                                           "factor_attribution": attribute_factors(ordered),
                                           "performance": perf})))
    if memo is not None:
        with suppress(OSError, Refused):  # a read-only root just gets no memo
            ensure_dir(memo, memo.parent)  # a memo folder linked out of the root: no memo
            write_json_atomic(memo / MEMO_FILE, {"key": key, **out})
    return out["attribution"], out["factor_attribution"], out["performance"]


def build_report(
    records: Sequence[Mapping[str, Any]],
    *,
    matrix: Mapping[str, Any],
    matrix_root: Path,
    preflight: Mapping[str, Any] | None,
    created: str,
    expected_cells: int,
    interrupted: bool,
    memo: Path | None = None,
) -> dict[str, Any]:
    import os

    from pytest_rlkernel_matrix.report.drill import drill_of

    ordered = sorted(records, key=lambda r: (r["hardware"], cell_order(r)))
    attribution, factor_attribution, perf = attributions(ordered, memo)
    from pytest_rlkernel_matrix.report.measured import auto_stop

    # why --rlk-processes=auto stopped early, in the JSON and the HTML as in the terminal
    perf = {**perf, "auto_stop": auto_stop(matrix_root)}
    return {
        "schema_version": REPORT_SCHEMA,
        # a fault drill's report says so first (report/drill.py); None: no drill
        "drill": drill_of(ordered, os.environ),
        "created": created,
        "matrix": dict(matrix),
        "matrix_root": str(matrix_root),
        "complete": len(records) == expected_cells and not interrupted,
        "interrupted": interrupted,
        "expected_cells": expected_cells,
        "summary": summarize(records),
        "timings": timing_counts(records),
        "preflight": dict(preflight or {}),
        "node_fingerprints": node_fingerprint_groups(ordered),
        "attribution": attribution,
        "factor_attribution": factor_attribution,
        "performance": perf,
        "profile": profile_lines(ordered),  # profile runs: localisation, never a conclusion
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


def _bytes_note(r: Mapping[str, Any]) -> str:
    """` (bytes N)` when the byte count differs from the value count (+0.0/-0.0, NaN payloads)."""
    b = r.get("bitwise_mismatch_count")
    return f" (bytes {b})" if b is not None and b != r.get("mismatch_count", 0) else ""


def row_name(r: Mapping[str, Any]) -> str:
    """The module, or for a factor cell ``factor <name>=<variant>`` (as the HTML names it),
    with the module after it for a cell at one module's case (``... attention``)."""
    f = r.get("factor")
    if isinstance(f, Mapping) and f.get("name"):
        cases = r.get("cases")
        scope = factor_scope(str(r.get("case")), cases) if isinstance(cases, Mapping) else ""
        return f"factor {f['name']}={f.get('variant')}" + (f" {scope}" if scope else "")
    return str(r["module"])


def _route(value: Any) -> str:
    """A side's routes; ``attention=x;ffn=x;logp=x`` (a factor cell's) shortened to ``x``."""
    text = str(value or "-")
    parts = {p.partition("=")[2] for p in text.split(";")} if "=" in text else set()
    return parts.pop() if len(parts) == 1 and "" not in parts else text


UNFINISHED = ("interrupted", "timed out", "not started")


def route_shown(r: Mapping[str, Any], side: str) -> str:
    """The route that ran on `side` (the readback and the route lines together, `record.ran`),
    and the requested one beside it where they differ: ``production (requested rl_kernel)``."""
    actual = _route(r.get(f"actual_{side}_implementation"))
    if actual in UNFINISHED:
        return actual  # a run that did not finish: its state, never a side it did not run
    if actual == "unreported":
        actual = "not reported"
    wanted = r.get(f"requested_{side}_implementation")
    if wanted is None or actual == "-" or _route(wanted) == actual:
        return actual
    return f"{actual} (requested {_route(wanted)})"


def table(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The request's report template as a terminal table."""
    head = ("hardware", "module", "case", "training route", "rollout route", "fallback",
            "max|dlogp|", "IS ratio", "mismatch", "rollout", "train", "sync", "unattributed",
            "step", "verdict")
    rows = [head]
    for r in sorted(records, key=lambda r: (r["hardware"], cell_order(r))):
        rows.append((
            str(r["hardware"]), row_name(r), str(r["case"]),
            route_shown(r, "training"), route_shown(r, "rollout"),
            "yes" if r.get("fallbacks") else "no",
            _fmt_d(r.get("logprob_abs_diff_max")), loss_short(r.get("loss_impact")),
            "-" if r.get("active_token_count") is None else
            f"{r.get('mismatch_count', 0)}/{r.get('active_token_count')}"
            + _bytes_note(r),
            _fmt_s(r.get("rollout_wall_time")), _fmt_s(r.get("training_wall_time")),
            _fmt_s(r.get("weight_sync_wall_time")), unattributed_cell(r),
            _fmt_s(r.get("step_wall_time")), str(r["verdict"]),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def problem_groups(records: Sequence[Mapping[str, Any]], limit: int = 12
                   ) -> list[tuple[list[Mapping[str, Any]], str, list[str]]]:
    """The records that are neither `valid` nor `not_run`, one group per (hardware, verdict,
    failed or recorded), with each reason once: cells sharing a run (the R/R cells) or refused
    for the same session-wide reasons do not repeat them. A reason that applies to only some of
    the group's cells names them. Each group: its records, its header (e.g. ``cpu attention
    R/R, ffn R/R, logp R/R: error (FAILED)``) and its reason lines (at most `limit`)."""
    bad = sorted((r for r in records if r.get("verdict") not in ("valid", "not_run")),
                 key=lambda r: (r["hardware"], cell_order(r)))
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in bad:
        groups.setdefault((r["hardware"], r.get("verdict"), bool(r.get("failed"))), []).append(r)
    out = []
    for (hardware, verdict, failed), recs in groups.items():
        names = [f"{row_name(r)} {r['case']}" for r in recs]
        where: dict[str, list[str]] = {}
        for name, r in zip(names, recs, strict=True):
            for reason in r.get("reasons") or []:
                where.setdefault(str(reason), [])
                if name not in where[str(reason)]:
                    where[str(reason)].append(name)
        lines = [reason if len(cells) == len(names) else f"{reason} [{', '.join(cells)}]"
                 for reason, cells in where.items()]
        if len(lines) > limit:
            lines = [*lines[:limit], f"... {len(lines) - limit} more in matrix-report.json"]
        head = f"{hardware} {', '.join(names)}: {verdict} ({'FAILED' if failed else 'recorded'})"
        out.append((recs, head, lines))
    return out
