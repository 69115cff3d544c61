"""pytest-html: a Verdict and a max |dlogp| column, and a one-line verdict summary.

Registered on the controller only, and only when pytest-html writes a report (`--html`).
Rows other than matrix call-phase reports get empty cells, so the table stays rectangular.
"""

from __future__ import annotations

from collections import Counter
from html import escape
from typing import Any

import pytest

VERDICT_ORDER = ("valid", "fallback", "unsupported", "contract_mismatch", "incomparable",
                 "error", "not_run")


def _fmt_d(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return ""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return escape(str(value))
    return "0" if v == 0 else f"{v:.2e}"


class PytestHtmlIntegration:
    """pytest-html hook implementations (4.x signatures)."""

    def __init__(self) -> None:
        self.verdicts: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        verdict = getattr(report, "rlk_verdict", None)
        if verdict is not None and report.when == "call":
            self.verdicts[report.nodeid] = str(verdict)

    def pytest_html_results_table_header(self, cells: list[str]) -> None:
        cells.insert(2, '<th class="sortable" data-column-type="rlk_verdict">Verdict</th>')
        cells.insert(3, '<th class="sortable" data-column-type="rlk_dlogp">max |dlogp|</th>')

    def pytest_html_results_table_row(self, report: Any, cells: list[str]) -> None:
        verdict = getattr(report, "rlk_verdict", None) if report.when == "call" else None
        record = getattr(report, "rlk_record", None) if verdict is not None else None
        dlogp = _fmt_d(record.get("logprob_abs_diff_max")) if isinstance(record, dict) else ""
        cells.insert(2, f'<td class="col-rlk_verdict">{escape(str(verdict or ""))}</td>')
        cells.insert(3, f'<td class="col-rlk_dlogp">{dlogp}</td>')

    def pytest_html_results_summary(self, prefix: list[str], summary: list[str],
                                    postfix: list[str]) -> None:
        if not self.verdicts:
            return
        counts = Counter(self.verdicts.values())
        order = [v for v in VERDICT_ORDER if v in counts] + sorted(set(counts) - set(VERDICT_ORDER))
        line = ", ".join(f"{counts[v]} {v}" for v in order)
        prefix.append(f"<p>RL-Kernel matrix verdicts: {escape(line)}</p>")


def install(config: pytest.Config) -> None:
    """Register the integration when pytest-html writes a report in this (controller) process."""
    if (config.pluginmanager.hasplugin("html") and config.getoption("htmlpath", None)
            and not hasattr(config, "workerinput")):
        config.pluginmanager.register(PytestHtmlIntegration(), "rlk-pytest-html")
