"""Re-read a finished matrix root and rewrite its report (`rlk-matrix report`).

Every record comes from `report.analyze_run` over the run directory's artifacts, the same path the
pytest session used, so a re-analysis reproduces `matrix-report.json` except for `created`.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.report.matrix_report import REPORT_FILE, build_report
from pytest_rlkernel_matrix.report.record import (
    CELL_RUN_FILE,
    alias_record,
    analyze_run,
    cell_from_dict,
)
from pytest_rlkernel_matrix.spec.cells import Cases, Cell
from pytest_rlkernel_matrix.spec.terms import CASES, MODULES
from pytest_rlkernel_matrix.store.atomic import write_json_atomic


def _gaps(matrix_file: str | None, hardware: str) -> tuple[Any, ...]:
    if not matrix_file or not Path(matrix_file).exists():
        return ()
    from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

    try:
        profile = load_matrix(Path(matrix_file)).hardware.get(hardware)
    except MatrixFileError:
        return ()
    return profile.expect_unsupported if profile else ()


def _read_old_report(path: Path, notes: list[str]) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        notes.append(f"{path.name} was unreadable ({type(exc).__name__}: {str(exc)[:200]}): "
                     "rebuilt from the cell directories")
        return {}
    if not isinstance(old, dict) or not isinstance(old.get("cells", []), list):
        notes.append(f"{path.name} was not a report object: rebuilt from the cell directories")
        return {}
    return old


def _cell_from_dir(run_dir: Path) -> Cell:
    """The cell a run directory names (`<hardware>/<module>-<case>`), for an unreadable record."""
    module, _, case = run_dir.name.rpartition("-")
    case = f"{case[:1]}/{case[1:]}".upper()
    if module not in MODULES or case not in CASES:
        module, case = run_dir.name, "?"
    cases = {m: (case if m == module else "R/R") for m in MODULES}
    return Cell(run_dir.parent.name, module, case,
                Cases(cases["attention"], cases["ffn"], cases["logp"]))


def reanalyze(root: Path, output: Path | None = None) -> Path:
    """Rewrite `<root>/matrix-report.json` (or `output`) from the artifacts under `root`.

    A corrupt `matrix-report.json` is rebuilt from the cell directories; a corrupt
    `cell-run.json` makes that cell an `error` record naming the file, never an exception.
    """
    old_path = root / REPORT_FILE
    notes: list[str] = []
    old = _read_old_report(old_path, notes)
    matrix = old.get("matrix", {}) if isinstance(old.get("matrix"), dict) else {}
    cache: dict[str, dict[str, Any]] = {}

    def analyzed(rel: str, hardware: str, cell: Cell, mode: str) -> dict[str, Any]:
        if rel not in cache:
            cache[rel] = analyze_run(root / rel, gaps=_gaps(matrix.get("file"), hardware),
                                     cell=cell, mode=mode, artifact_dir=rel)
        return cache[rel]

    records: list[dict[str, Any]] = []
    if old.get("cells"):
        for cell_data in old["cells"]:
            try:
                cell = cell_from_dict(cell_data)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                notes.append(f"{REPORT_FILE}: a cell entry is unusable ({exc!r}): dropped")
                continue
            rel = cell_data.get("artifact_dir")
            if not rel or not (root / rel / CELL_RUN_FILE).exists():
                records.append(cell_data)  # not run / refused: nothing on disk to re-read
                continue
            record = alias_record(
                analyzed(rel, cell.hardware, cell, str(cell_data.get("mode"))), cell)
            record["shared_with"] = cell_data.get("shared_with", [])
            records.append(record)
    else:
        for meta_path in sorted(root.glob(f"*/*/{CELL_RUN_FILE}")):
            rel = str(meta_path.parent.relative_to(root))
            cell = _cell_from_dir(meta_path.parent)
            records.append(analyzed(rel, meta_path.parent.parent.name, cell,
                                    str(matrix.get("mode", "?"))))
    expected = old.get("expected_cells", len(records))
    report = build_report(
        records, matrix=matrix, matrix_root=root,
        preflight=old.get("preflight") if isinstance(old.get("preflight"), dict) else None,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        expected_cells=expected if isinstance(expected, int) else len(records),
        interrupted=bool(old.get("interrupted", False)),
    )
    if notes:
        report["reanalysis_notes"] = notes
    target = output or old_path
    write_json_atomic(target, report)
    from pytest_rlkernel_matrix.report.html import HTML_FILE, write_html

    pre = root / "preflight.json"
    try:
        pre_data = json.loads(pre.read_text()) if pre.exists() else None
    except (OSError, ValueError, RecursionError):
        pre_data = None
    write_html(report, target.with_name(HTML_FILE), pre_data)
    return target

