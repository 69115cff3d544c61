"""Performance at a glance in the HTML (issue 53): a table per module (R on side x phase:
answer, ratio, interval, plan) and an inline-SVG forest plot of every statement's interval
against the ±m equivalence band and 1, a drill session's plot visibly marked; checked in the
rendered markup and in a real browser (headless chromium) against the report's JSON."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from pytest_rlkernel_matrix.report.html import render_html, write_html

REPO = Path(__file__).resolve().parents[1]
# a real report of three processes per cell on an H200 (docs/examples), its statements as judged
EXAMPLE = REPO / "docs" / "examples" / "h200-perf-three-processes" / "perf-matrix-report.json"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRILL = {"env": "slow:ffn:rollout:1.5", "kinds": ["slow"], "applied_cells": ["h200 ffn R/R"],
         "text": "FAULT DRILL: RLK_REF_FAULT=slow:ffn:rollout:1.5: a planted fault"}


class Figures(HTMLParser):
    """The forest plot's statement rows (their data attributes) and the performance tables'
    rows, as a page (or a browser's DOM) holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.stmts: list[dict[str, str | None]] = []
        self.rows: list[list[str]] = []
        self.in_perf = False
        self.row: list[str] | None = None
        self.cell: list[str] | None = None
        self.forest_classes: list[str] = []
        self.texts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "g" and "stmt" in classes:
            self.stmts.append(a)
        if tag == "figure" and "forest" in classes:
            self.forest_classes = classes
        if tag == "table" and "perf" in classes:
            self.in_perf = True
        if self.in_perf and tag == "tr":
            self.row = []
        if self.row is not None and tag == "td":
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self.row is not None and self.cell is not None:
            self.row.append("".join(self.cell).strip())
            self.cell = None
        if tag == "tr" and self.row:
            self.rows.append(self.row)
            self.row = None
        if tag == "table":
            self.in_perf = False

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell.append(data)
        self.texts.append(data)


def _report(drill: bool) -> dict[str, Any]:
    report = json.loads(EXAMPLE.read_text())
    perf = report["performance"]
    perf["equivalence"], perf["equivalence_bounds"] = 0.05, [1 / 1.05, 1.05]
    perf["drill"] = copy.deepcopy(DRILL) if drill else None
    return report


def _statements(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for m in report["performance"]["modules"] for s in m["statements"]]


def _check(page: Figures, report: dict[str, Any]) -> None:
    stmts = _statements(report)
    assert stmts, "the example has statements"
    plotted = [s for s in stmts if s.get("ratio")]
    assert len(page.stmts) == len(plotted)
    for got, want in zip(page.stmts, plotted, strict=True):
        assert got["data-ratio"] == f"{want['ratio']:.3f}"
        if want.get("low") and want.get("high"):
            assert (got["data-low"], got["data-high"]) == (f"{want['low']:.3f}",
                                                           f"{want['high']:.3f}")
        assert got["data-kind"] == want["kind"]
    assert [r[:4] for r in page.rows] == [
        [s["side"], s["phase"].removesuffix("_wall_time").replace("_", " "), s["kind"],
         f"{s['ratio']:.3f}"] for s in stmts]
    for row, s in zip(page.rows, stmts, strict=True):
        if s.get("low") is not None:
            assert row[4] == f"[{s['low']:.3f}, {s['high']:.3f}]"


def test_table_and_forest_plot_carry_the_jsons_figures() -> None:
    report = _report(drill=False)
    html = render_html(report)
    page = Figures()
    page.feed(html)
    _check(page, report)
    assert 'class="band"' in html and "equivalence band [0.952, 1.050]" in html
    assert 'class="one"' in html and "forest-drill" not in page.forest_classes
    assert "http://" not in html.split('<svg class="forest"', 1)[1].split("</svg>", 1)[0] \
        .replace("http://www.w3.org", "")  # inline, nothing fetched


def test_a_drill_sessions_plot_is_marked() -> None:
    report = _report(drill=True)
    html = render_html(report)
    page = Figures()
    page.feed(html)
    assert "forest-drill" in page.forest_classes
    assert "FAULT DRILL: planted fault" in html and 'class="drill-frame"' in html


def test_statement_labels_are_escaped() -> None:
    report = _report(drill=False)
    report["performance"]["modules"][0]["module"] = "<script>x</script>"
    html = render_html(report)
    assert "<script>x</script>" not in html and "&lt;script&gt;x&lt;/script&gt;" in html


@pytest.mark.skipif(CHROMIUM is None,
                    reason="chromium not installed (Debian: apt-get install -y chromium)")
@pytest.mark.parametrize("drill", [False, True])
def test_the_browser_renders_the_table_and_plot(tmp_path: Path, drill: bool) -> None:
    assert CHROMIUM is not None
    report = _report(drill=drill)
    html = write_html(report, tmp_path / "matrix-report.html")
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", html.as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    page = Figures()
    page.feed(dom)
    _check(page, report)  # the figures in the browser's DOM are the JSON's
    assert ("forest-drill" in page.forest_classes) is drill
    png = tmp_path / "shot.png"
    subprocess.run([*flags, f"--screenshot={png}", "--window-size=1400,4000", html.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
