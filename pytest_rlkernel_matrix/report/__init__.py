"""What a matrix root reports: one cell's record (`record`) with its measured runs
(`measured`), the session report `matrix-report.json` (`matrix_report`), attribution and the
performance statements (`attribution`, `perf`), the HTML page and its template (`html`,
`html_parts`, `templates/`), merge, compare and re-analysis.

May import: `store`, `spec`, `machine`, `run`, `judge`; never the session or the pytest face.
`pytest_rlkernel_matrix.report` was a module before 0.2; its names (`analyze_run`,
`write_json_atomic`, `build_report`, ...) still resolve here for one release, with a
`DeprecationWarning` naming their new home. Importing the package itself stays light.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# old name -> the module that owns it now
_MOVED = {
    "CELL_RUN_FILE": "pytest_rlkernel_matrix.report.record",
    "METRIC_FIELDS": "pytest_rlkernel_matrix.report.record",
    "cell_from_dict": "pytest_rlkernel_matrix.report.record",
    "cell_to_dict": "pytest_rlkernel_matrix.report.record",
    "read_cell_run": "pytest_rlkernel_matrix.report.record",
    "error_record": "pytest_rlkernel_matrix.report.record",
    "analyze_run": "pytest_rlkernel_matrix.report.record",
    "build_record": "pytest_rlkernel_matrix.report.record",
    "alias_record": "pytest_rlkernel_matrix.report.record",
    "not_run_record": "pytest_rlkernel_matrix.report.record",
    "REPORT_SCHEMA": "pytest_rlkernel_matrix.report.matrix_report",
    "REPORT_FILE": "pytest_rlkernel_matrix.report.matrix_report",
    "node_fingerprint_groups": "pytest_rlkernel_matrix.report.matrix_report",
    "summarize": "pytest_rlkernel_matrix.report.matrix_report",
    "build_report": "pytest_rlkernel_matrix.report.matrix_report",
    "cell_order": "pytest_rlkernel_matrix.report.matrix_report",
    "table": "pytest_rlkernel_matrix.report.matrix_report",
    "json_safe": "pytest_rlkernel_matrix.store.atomic",
    "file_mode": "pytest_rlkernel_matrix.store.atomic",
    "write_text_atomic": "pytest_rlkernel_matrix.store.atomic",
    "write_json_atomic": "pytest_rlkernel_matrix.store.atomic",
}


def __getattr__(name: str) -> Any:
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"pytest_rlkernel_matrix.report.{name} moved to {home}.{name}; the old "
                  "path goes away in the next release", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)
