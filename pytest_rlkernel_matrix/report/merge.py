"""`rlk-matrix merge`: reports from different hardware side by side in one report.

Cells are concatenated (each keeps its `hardware`), `summary` is recomputed, each source's
attribution (within one hardware, one build) is carried over unchanged. Nothing is ever divided
across sources: no speed or time ratio between different hardware, builds or topologies.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.report.matrix_report import (
    REPORT_SCHEMA,
    cell_order,
    summarize,
    timing_counts,
)

COMPARABILITY_NOTE = (
    "side by side only: each hardware's verdicts, |dlogp| and phase times are shown as measured "
    "on that hardware; no speed or time ratio is computed across different hardware, software "
    "builds (build fingerprint) or topologies. Within-hardware attribution is each source "
    "report's own, unchanged."
)


class MergeError(ValueError):
    """Inputs that cannot be merged (unreadable, wrong schema, duplicate cells)."""


CellKey = tuple[str, str, str]


def load_report(path: Path) -> dict[str, Any]:
    """A `matrix-report.json`, checked for the report schema."""
    from pytest_rlkernel_matrix.store.safeio import MAX_REPORT_BYTES, Refused, read_text

    try:  # through store: a regular file (a FIFO or a device is refused, never waited on)
        data = json.loads(read_text(path, path.parent, MAX_REPORT_BYTES))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, Refused) as exc:
        raise MergeError(f"{path}: unreadable report: {exc}") from exc
    if not isinstance(data, dict) or data.get("schema_version") != REPORT_SCHEMA:
        got = data.get("schema_version") if isinstance(data, dict) else type(data).__name__
        raise MergeError(f"{path}: not a {REPORT_SCHEMA} report (schema_version {got!r})")
    if not isinstance(data.get("cells"), list):
        raise MergeError(f"{path}: report has no cells list")
    return data


def cell_key(cell: Mapping[str, Any]) -> CellKey:
    return (str(cell.get("hardware")), str(cell.get("module")), str(cell.get("case")))


def _fingerprint(report: Mapping[str, Any], name: str) -> str | None:
    """The report's preflight fingerprint, else the one its cells agree on."""
    pre = report.get("preflight") or {}
    if isinstance(pre, Mapping) and pre.get(name):
        return str(pre[name])
    seen = {c.get(name) for c in report["cells"] if c.get(name)}
    return str(seen.pop()) if len(seen) == 1 else None


def _hardware(report: Mapping[str, Any]) -> list[str]:
    listed = (report.get("matrix") or {}).get("hardware") or []
    seen = [str(c.get("hardware")) for c in report["cells"]]
    return list(dict.fromkeys([*(str(h) for h in listed if str(h) in seen), *seen]))


def duplicates(reports: Sequence[tuple[Path, Mapping[str, Any]]]) -> list[str]:
    """One message per (hardware, module, case) found in more than one input."""
    where: dict[CellKey, list[str]] = {}
    for path, report in reports:
        for key in dict.fromkeys(cell_key(c) for c in report["cells"]):
            where.setdefault(key, []).append(str(path))
    return [f"({', '.join(k)}) in {' and '.join(files)}"
            for k, files in where.items() if len(files) > 1]


def _one(values: Iterable[Any], mixed: str = "mixed") -> Any:
    distinct = list(dict.fromkeys(v for v in values if v is not None))
    return distinct[0] if len(distinct) == 1 else (mixed if distinct else None)


def _union(lists: Iterable[Any]) -> list[str]:
    return list(dict.fromkeys(str(x) for lst in lists for x in (lst or [])))


def _rebase(artifact_dir: Any, source_root: Path, root: Path) -> Any:
    if not isinstance(artifact_dir, str) or not artifact_dir or Path(artifact_dir).is_absolute():
        return artifact_dir
    return Path(os.path.relpath(source_root / artifact_dir, root)).as_posix()


def merge_reports(
    reports: Sequence[tuple[Path, Mapping[str, Any]]],
    *,
    allow_duplicates: bool = False,
    created: str | None = None,
) -> dict[str, Any]:
    """One `rlk-matrix.report.v1` report holding every input's cells, side by side.

    The merged `matrix_root` is the common directory of the input reports; each cell's relative
    `artifact_dir` is rebased onto it (the original stays in `source_artifact_dir`) and `source`
    indexes `sources`.
    """
    if len(reports) < 2:
        raise MergeError("merge needs at least two reports")
    dups = duplicates(reports)
    if dups and not allow_duplicates:
        raise MergeError("duplicate cells across inputs (pass --allow-duplicates to keep both): "
                         + "; ".join(dups))
    roots = [path.resolve().parent for path, _ in reports]
    root = Path(os.path.commonpath([str(r) for r in roots]))
    sources: list[dict[str, Any]] = []
    cells: list[dict[str, Any]] = []
    attribution: list[Any] = []
    for i, ((path, report), src_root) in enumerate(zip(reports, roots, strict=True)):
        matrix = report.get("matrix") or {}
        sources.append({
            "file": str(path), "matrix_name": matrix.get("name"),
            "matrix_root": report.get("matrix_root"), "created": report.get("created"),
            "hardware": _hardware(report),
            "hardware_fingerprint": _fingerprint(report, "hardware_fingerprint"),
            "build_fingerprint": _fingerprint(report, "build_fingerprint"),
            "layout": matrix.get("layout"), "mode": matrix.get("mode"),
            "cells": len(report["cells"]), "summary": report.get("summary"),
            "complete": report.get("complete"),
        })
        for cell in report["cells"]:
            out = dict(cell)
            out["source"] = i
            if cell.get("artifact_dir"):
                out["source_artifact_dir"] = cell["artifact_dir"]
                out["artifact_dir"] = _rebase(cell["artifact_dir"], src_root, root)
            cells.append(out)
        for entry in report.get("attribution") or []:
            attribution.append({**entry, "source": i} if isinstance(entry, Mapping) else entry)
    matrices = [r.get("matrix") or {} for _, r in reports]
    hw_fps = [s["hardware_fingerprint"] for s in sources]
    build_fps = [s["build_fingerprint"] for s in sources]
    cells.sort(key=lambda c: (c["source"], c["hardware"], cell_order(c)))
    return {
        "schema_version": REPORT_SCHEMA,
        "created": created or datetime.now(UTC).isoformat(timespec="seconds"),
        "matrix": {
            "name": "merged: " + " + ".join(str(m.get("name") or "?") for m in matrices),
            "file": None, "merged": True,
            "layout": _one(m.get("layout") for m in matrices),
            "mode": _one(m.get("mode") for m in matrices),
            "hardware": _union(s["hardware"] for s in sources),
            "modules": _union(m.get("modules") for m in matrices),
            "cases": _union(m.get("cases") for m in matrices),
            "fixed_case": _one(m.get("fixed_case") for m in matrices),
        },
        "matrix_root": str(root),
        "complete": all(bool(r.get("complete")) for _, r in reports),
        "interrupted": any(bool(r.get("interrupted")) for _, r in reports),
        "expected_cells": sum(int(r.get("expected_cells") or len(r["cells"])) for _, r in reports),
        "summary": summarize(cells),
        "timings": timing_counts(cells),
        "preflight": {
            "file": None,
            "hardware_fingerprint": _one(hw_fps, "several: " + ", ".join(map(str, hw_fps))),
            "build_fingerprint": _one(build_fps, "several: " + ", ".join(map(str, build_fps))),
        },
        "comparability": {
            "note": COMPARABILITY_NOTE,
            "ratios_across_sources": False,
            "same_hardware_fingerprint": len(set(hw_fps)) == 1 and None not in hw_fps,
            "same_build_fingerprint": len(set(build_fps)) == 1 and None not in build_fps,
            "duplicates": dups,
        },
        "sources": sources,
        "attribution": attribution,
        "cells": cells,
    }


def _fmt_d(value: Any) -> str:
    return "-" if value is None else (f"{float(value):.2e}" if value else "0")


def _fmt_s(value: Any) -> str:
    return "-" if value is None else f"{float(value):.2f}s"


def _groups(report: Mapping[str, Any]) -> dict[tuple[int, str], str]:
    """Column group label per (source, hardware): the hardware, plus `[n]` when ambiguous."""
    pairs = list(dict.fromkeys((int(c.get("source", 0)), str(c["hardware"]))
                               for c in report["cells"]))
    count: dict[str, int] = {}
    for _, hw in pairs:
        count[hw] = count.get(hw, 0) + 1
    return {(s, hw): hw if count[hw] == 1 else f"{hw}[{s + 1}]" for s, hw in pairs}


def merged_table(report: Mapping[str, Any]) -> list[str]:
    """Rows module x case; per hardware: verdict, max |dlogp|, step time. No ratios."""
    groups = _groups(report)
    by: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
    order: dict[tuple[str, str], tuple[int, str, int]] = {}
    for c in report["cells"]:
        row = (str(c["module"]), str(c["case"]))
        by.setdefault(row, {})[groups[(int(c.get("source", 0)), str(c["hardware"]))]] = c
        order.setdefault(row, cell_order(c))
    labels = list(dict.fromkeys(groups.values()))
    head = ["module", "case"]
    for label in labels:
        head += [f"{label} verdict", f"{label} max|dlogp|", f"{label} step"]
    rows = [head]
    for row in sorted(by, key=lambda r: order[r]):
        line = list(row)
        for label in labels:
            c = by[row].get(label)
            line += ["-", "-", "-"] if c is None else [
                str(c.get("verdict")), _fmt_d(c.get("logprob_abs_diff_max")),
                _fmt_s(c.get("step_wall_time"))]
        rows.append(line)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def render(report: Mapping[str, Any]) -> list[str]:
    """Sources, the side-by-side table and the comparability line."""
    lines = ["sources:"]
    for i, s in enumerate(report["sources"], 1):
        lines.append(f"  [{i}] {s['file']}: {s['matrix_name']}, hardware "
                     f"{', '.join(s['hardware']) or '-'}, hardware fingerprint "
                     f"{s['hardware_fingerprint']}, build fingerprint {s['build_fingerprint']}")
    lines += ["", *merged_table(report), "",
              f"comparability: {report['comparability']['note']}"]
    if report["comparability"]["duplicates"]:
        lines.append("duplicates kept (--allow-duplicates): "
                     + "; ".join(report["comparability"]["duplicates"]))
    return lines
