"""pytest-json-report: per-cell `rlk` metadata on each matrix test, `rlk_matrix` on the report.

Registered only with `--json-report`. Metadata is computed where the item runs (xdist workers
included; pytest-json-report relays it); `rlk_matrix` is added on the controller.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_rlkernel_matrix.collect import RECORD_KEY, SESSION_KEY

FIELDS = ("verdict", "failed", "performance_usable", "hardware", "module", "case", "reasons",
          "artifact_dir",
          "logprob_abs_diff_max", "mismatch_count", "active_token_count", "step_wall_time")


def cell_metadata(record: dict[str, Any]) -> dict[str, Any]:
    """The JSON-report view of one cell record."""
    return {k: record.get(k) for k in FIELDS}


class JsonReportIntegration:
    """pytest-json-report hook implementations."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_json_runtest_metadata(self, item: pytest.Item, call: pytest.CallInfo[Any]
                                     ) -> dict[str, Any] | None:
        if call.when != "call":
            return None
        record = item.stash.get(RECORD_KEY, None)
        return None if record is None else {"rlk": cell_metadata(record)}

    def pytest_json_modifyreport(self, json_report: dict[str, Any]) -> None:
        session = self.config.stash.get(SESSION_KEY, None)
        if session is None or getattr(session, "plan", False):
            return
        from pytest_rlkernel_matrix.report.html import HTML_FILE
        from pytest_rlkernel_matrix.report.matrix_report import (
            REPORT_FILE,
            summarize,
            timing_counts,
        )

        info = {"summary": summarize(session.records.values()),
                "timings": timing_counts(session.records.values()),
                "report": str(session.root / REPORT_FILE), "matrix_root": str(session.root)}
        html = session.root / HTML_FILE
        if html.exists():
            info["html"] = str(html)
        json_report["rlk_matrix"] = info


def install(config: pytest.Config) -> None:
    """Register the integration when pytest-json-report is writing a report."""
    if config.getoption("json_report", None):
        config.pluginmanager.register(JsonReportIntegration(config), "rlk-json-report")
