"""Reruns that compose: what a session selected out of the whole matrix, which earlier root it
reran, and the whole matrix with each cell's latest verdict (`rlk-matrix latest`).

A session that ran a subset of the matrix (`--lf`, `-k`, `-m`, node ids, `--sw`) writes a
report with `complete: false` and a `selection` block: the cells it ran (`reran`), why
(`by`: the options), the whole matrix's cell ids (`matrix_cells`) and `rerun_of`, the root of the
previous session over the same matrix file (from pytest's cache). `latest()` follows those links
back and keeps, per cell, the record of the newest report holding it, with `source` naming
where it came from (the reports are combined with `merge.merge_reports`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.report.matrix_report import (
    REPORT_FILE,
    cell_order,
    summarize,
    timing_counts,
)
from pytest_rlkernel_matrix.report.merge import MergeError, load_report, merge_reports

LATEST_FILE = "matrix-report.latest.json"


def record_tail(rec: Mapping[str, Any]) -> str:
    """A record's node id below the matrix file: `cpu::attention[R/R]`,
    `cpu::factor-<name>-<variant>-<case>` (as `spec.cells.Cell.name`)."""
    factor = rec.get("factor")
    if isinstance(factor, Mapping) and factor.get("name"):
        case = str(rec.get("case")).replace("/", "").lower()
        return f"{rec.get('hardware')}::factor-{factor['name']}-{factor.get('variant')}-{case}"
    return f"{rec.get('hardware')}::{rec.get('module')}[{rec.get('case')}]"


def apply_selection(report: dict[str, Any], selection: Mapping[str, Any]) -> None:
    """Add `selection` to a report (a session's, or `rlk-matrix report`'s rewrite keeping the
    old one's); a report missing any cell of the whole matrix is `complete: false` (a `-k`
    subset too), whatever the cells it selected."""
    whole = [str(c) for c in selection.get("matrix_cells") or []]
    ran = sorted({record_tail(r) for r in report["cells"]})
    missing = [c for c in whole if c not in set(ran)]
    report["selection"] = {**selection, "reran": ran, "missing": missing}
    if missing:
        report["complete"] = False


def _key(cell: Mapping[str, Any]) -> str:
    factor = cell.get("factor")
    tail = ""
    if isinstance(factor, Mapping):
        tail = f"|{factor.get('name')}={factor.get('variant')}"
    return f"{cell.get('hardware')}|{cell.get('module')}|{cell.get('case')}{tail}"


def report_path(where: Path) -> Path:
    return where / REPORT_FILE if where.is_dir() else where


def chain(start: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The report at `start` (a root or its matrix-report.json) and every earlier one its
    `selection.rerun_of` links reach, oldest first."""
    out: list[tuple[Path, dict[str, Any]]] = []
    seen: set[Path] = set()
    path: Path | None = report_path(start).resolve()
    while path is not None and path not in seen:
        seen.add(path)
        report = load_report(path)
        out.append((path, report))
        earlier = (report.get("selection") or {}).get("rerun_of")
        path = report_path(Path(earlier)).resolve() if earlier else None
    return out[::-1]


def session_kind(report: Mapping[str, Any]) -> dict[str, Any]:
    """What a session must share with another for their cells to be one matrix: the matrix
    (name, layout), the mode, whether it was a fault drill (and which) and the hardware."""
    matrix = report.get("matrix") if isinstance(report.get("matrix"), Mapping) else {}
    drill = report.get("drill") if isinstance(report.get("drill"), Mapping) else None
    hardware = matrix.get("hardware") if isinstance(matrix, Mapping) else None
    if not hardware:
        hardware = sorted({str(c.get("hardware")) for c in report.get("cells") or []
                           if isinstance(c, Mapping)})
    return {"matrix": matrix.get("name"), "layout": matrix.get("layout"),
            "mode": matrix.get("mode"),
            "drill": None if drill is None else (drill.get("env") or drill.get("kinds") or True),
            "hardware": sorted(str(h) for h in hardware) if isinstance(hardware, list)
            else hardware}


def composable(reports: Sequence[tuple[Path, Mapping[str, Any]]],
               ) -> tuple[list[tuple[Path, Mapping[str, Any]]], list[str]]:
    """The newest report and the earlier ones (oldest first) that belong with it: going back
    from the newest, the chain stops at the first report of another matrix, mode, drill state
    or hardware (issue 53: a drill never merges into a non-drill view). The notes say where it
    stopped and why."""
    if not reports:
        return [], []
    want = session_kind(reports[-1][1])
    kept = [reports[-1]]
    notes: list[str] = []
    for path, report in reversed(reports[:-1]):
        kind = session_kind(report)
        differ = [k for k in want if kind[k] != want[k]]
        if differ:
            notes.append(f"not composed: {path} and the reports before it (its "
                         + ", ".join(f"{k} {kind[k]!r} vs {want[k]!r}" for k in differ) + ")")
            break
        kept.append((path, report))
    return kept[::-1], notes


def latest(reports: Sequence[tuple[Path, Mapping[str, Any]]],
           created: str | None = None) -> dict[str, Any]:
    """The whole matrix with each cell's latest verdict: `reports` oldest first; a cell in
    several keeps the newest one's record that ran it (a later `not_run` keeps the earlier
    verdict), its `source` indexing `sources`. Only the reports of the newest's kind
    (`composable`) are combined; `interrupted` and `drill` are the newest session's."""
    if not reports:
        raise MergeError("no report to combine")
    reports, notes = composable(reports)
    newest_report = reports[-1][1]
    if len(reports) == 1:
        path, only = reports[0]
        out = json.loads(json.dumps({**only, "sources": [{"file": str(path)}]}))
        for cell in out.get("cells") or []:
            if isinstance(cell, dict):
                cell.setdefault("from", only.get("matrix_root"))
        out["latest"] = {"note": "one session: nothing to compose", "missing": [],
                         "not_composed": notes, "kind": session_kind(only)}
        out["drill"] = only.get("drill")
        return out
    merged = merge_reports(reports, allow_duplicates=True, created=created)
    newest: dict[str, dict[str, Any]] = {}
    for cell in merged["cells"]:  # sorted by source: a later source overwrites
        earlier = newest.get(_key(cell))
        if (cell.get("verdict") == "not_run" and earlier is not None
                and earlier.get("verdict") != "not_run"):
            continue  # not run by the later session: the earlier verdict stands
        newest[_key(cell)] = cell
    cells = sorted(newest.values(), key=lambda c: (str(c["hardware"]), cell_order(c)))
    wanted: set[str] = set()
    for _, report in reports:
        wanted.update((report.get("selection") or {}).get("matrix_cells") or [])
    missing = sorted(wanted - {record_tail(c) for c in cells})
    for cell in cells:
        cell["from"] = merged["sources"][int(cell["source"])]["matrix_root"]
    interrupted = bool(newest_report.get("interrupted"))
    merged.update(
        cells=cells, summary=summarize(cells), timings=timing_counts(cells),
        complete=not missing and not interrupted,
        # the newest session's own state: an earlier session's interruption is its source's
        interrupted=interrupted, drill=newest_report.get("drill"),
        expected_cells=len(cells) + len(missing),
        latest={"note": "each cell's latest verdict: a cell in several reports keeps the newest "
                        "one's record that ran it; `source`/`from` say which session",
                "missing": missing, "not_composed": notes,
                "kind": session_kind(newest_report)},
    )
    for i, (_, report) in enumerate(reports):
        merged["sources"][i]["interrupted"] = bool(report.get("interrupted"))
    merged["matrix"]["name"] = "latest: " + str((reports[0][1].get("matrix") or {}).get("name"))
    merged["comparability"]["duplicates"] = []
    return merged


def render(report: Mapping[str, Any]) -> list[str]:
    """One line per cell: its latest verdict and the root it came from."""
    lines = []
    for cell in report["cells"]:
        lines.append(f"{record_tail(cell)}  {cell.get('verdict')}  from {cell.get('from')}")
    for tail in (report.get("latest") or {}).get("missing") or []:
        lines.append(f"{tail}  (no record in any report)")
    lines += [str(n) for n in (report.get("latest") or {}).get("not_composed") or []]
    drill = report.get("drill")
    if isinstance(drill, Mapping) and drill.get("text"):
        lines.insert(0, f"[{drill['text']}]")
    return lines
