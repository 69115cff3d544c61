"""Re-read a finished matrix root and rewrite its report (`rlk-matrix report`).

Every record comes from `report.analyze_run` over the run directory's artifacts, the same path the
pytest session used, so a re-analysis reproduces `matrix-report.json` except for `created`.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.report import (
    CELL_RUN_FILE,
    REPORT_FILE,
    alias_record,
    analyze_run,
    build_report,
    cell_from_dict,
    write_json_atomic,
)


def _gaps(matrix_file: str | None, hardware: str) -> tuple[Any, ...]:
    if not matrix_file or not Path(matrix_file).exists():
        return ()
    from pytest_rlkernel_matrix.matrix import MatrixFileError, load_matrix

    try:
        profile = load_matrix(Path(matrix_file)).hardware.get(hardware)
    except MatrixFileError:
        return ()
    return profile.expect_unsupported if profile else ()


def reanalyze(root: Path, output: Path | None = None) -> Path:
    """Rewrite `<root>/matrix-report.json` (or `output`) from the artifacts under `root`."""
    old_path = root / REPORT_FILE
    old: dict[str, Any] = json.loads(old_path.read_text()) if old_path.exists() else {}
    matrix = old.get("matrix", {})
    cache: dict[str, dict[str, Any]] = {}

    def analyzed(rel: str, hardware: str) -> dict[str, Any]:
        if rel not in cache:
            cache[rel] = analyze_run(root / rel, gaps=_gaps(matrix.get("file"), hardware))
        return cache[rel]

    records: list[dict[str, Any]] = []
    if old.get("cells"):
        for cell_data in old["cells"]:
            rel = cell_data.get("artifact_dir")
            if not rel or not (root / rel / CELL_RUN_FILE).exists():
                records.append(cell_data)  # not run / refused: nothing on disk to re-read
                continue
            record = alias_record(analyzed(rel, cell_data["hardware"]), cell_from_dict(cell_data))
            record["shared_with"] = cell_data.get("shared_with", [])
            records.append(record)
    else:
        for meta_path in sorted(root.glob(f"*/*/{CELL_RUN_FILE}")):
            rel = str(meta_path.parent.relative_to(root))
            records.append(analyzed(rel, meta_path.parent.parent.name))
    report = build_report(
        records, matrix=matrix, matrix_root=root, preflight=old.get("preflight"),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        expected_cells=int(old.get("expected_cells", len(records))),
        interrupted=bool(old.get("interrupted", False)),
    )
    target = output or old_path
    write_json_atomic(target, report)
    from pytest_rlkernel_matrix.html import HTML_FILE, write_html

    pre = root / "preflight.json"
    write_html(report, target.with_name(HTML_FILE),
               json.loads(pre.read_text()) if pre.exists() else None)
    return target
