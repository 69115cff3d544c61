"""pytest-html and pytest-json-report integrations, over the fake framework (real subprocesses)."""

from __future__ import annotations

import html
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import outcomes as _outcomes

pytest.importorskip("pytest_html")
pytest.importorskip("pytest_jsonreport")

FALLBACK = {"FAKE_SCENARIO": "recorded_fallback", "FAKE_ONLY_WHEN": "A-PR_F-RR_L-RR"}
PLAIN_TEST = "def test_plain():\n    assert True\n"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _rows(text: str) -> list[list[str]]:
    """pytest-html 4.x keeps the table rows as HTML strings in an escaped JSON blob."""
    blob = text.split('data-jsonblob="', 1)[1].split('"', 1)[0]
    data = json.loads(html.unescape(blob))
    return [row for runs in data["tests"].values() for run in runs
            for row in [run["resultsTableRow"]]]


def test_pytest_html_verdict_columns(pytester: pytest.Pytester, make_matrix,
                                     tmp_path: Path) -> None:
    make_matrix(env=FALLBACK, modules='["attention", "ffn"]')
    pytester.makepyfile(test_plain=PLAIN_TEST)
    result = pytester.runpytest(f"--rlk-matrix-root={tmp_path / 'root'}", "-k",
                                "(attention and P/R) or plain", "--html=report.html",
                                "--self-contained-html")
    assert _outcomes(result) == {"passed": 2}
    text = (pytester.path / "report.html").read_text(encoding="utf-8")
    assert ">Verdict</th>" in text and ">max |dlogp|</th>" in text
    assert "RL-Kernel matrix verdicts: 1 fallback" in text
    rows = {row[1]: row for row in _rows(text)}
    matrix_row = next(r for k, r in rows.items() if "attention[P/R]" in k)
    plain_row = next(r for k, r in rows.items() if "test_plain" in k)
    assert matrix_row[2] == '<td class="col-rlk_verdict">fallback</td>'
    assert matrix_row[3] == '<td class="col-rlk_dlogp">1.00e-03</td>'
    assert plain_row[2:4] == ['<td class="col-rlk_verdict"></td>',
                              '<td class="col-rlk_dlogp"></td>']
    if CHROMIUM is not None:  # the page's own JS renders the rows: check the browser's DOM
        dom = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
             (pytester.path / "report.html").as_uri()],
            capture_output=True, text=True, timeout=120, check=True).stdout
        assert '<td class="col-rlk_verdict">fallback</td>' in dom


def test_json_report_metadata(pytester: pytest.Pytester, make_matrix, tmp_path: Path) -> None:
    make_matrix(env=FALLBACK, modules='["attention", "ffn"]')
    pytester.makepyfile(test_plain=PLAIN_TEST)
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "-k",
                                "(attention and P/R) or plain", "--json-report",
                                "--json-report-file=x.json")
    assert _outcomes(result) == {"passed": 2}
    data = json.loads((pytester.path / "x.json").read_text())
    tests = {t["nodeid"]: t for t in data["tests"]}
    (cell,) = [t for k, t in tests.items() if "attention[P/R]" in k]
    rlk = cell["metadata"]["rlk"]
    assert rlk["verdict"] == "fallback"
    assert (rlk["hardware"], rlk["module"], rlk["case"]) == ("cpu", "attention", "P/R")
    assert rlk["artifact_dir"] == "cpu/attention-pr"
    assert rlk["mismatch_count"] == rlk["active_token_count"] == 140
    assert rlk["logprob_abs_diff_max"] > 0 and rlk["step_wall_time"] == 3.25
    assert any("fallback recorded" in r for r in rlk["reasons"])
    (plain,) = [t for k, t in tests.items() if "test_plain" in k]
    assert "rlk" not in plain.get("metadata", {})
    assert data["rlk_matrix"]["summary"] == {"fallback": 1}
    assert Path(data["rlk_matrix"]["report"]) == root / "matrix-report.json"
    assert (root / "matrix-report.json").is_file()


def test_ci_reports_count_failed_cells_as_failed(pytester: pytest.Pytester, make_matrix,
                                                 tmp_path: Path) -> None:
    """A cell that fails the session (strict: a fallback) is `failed` for every consumer: the
    final line, pytest-json-report's `outcome` and `summary`, junit; one that does not fail it
    is `passed`. The verdict stays visible: the verbose word, the json metadata, the junit
    properties."""
    import xml.etree.ElementTree as ET

    make_matrix(env=FALLBACK, modules='["attention", "ffn"]')
    root = tmp_path / "root"
    result = pytester.runpytest("--rlk-mode=strict", f"--rlk-matrix-root={root}", "-v", "-k",
                                "attention and (R/R or P/R)", "--json-report",
                                "--json-report-file=x.json", "--junitxml=j.xml")
    assert result.ret == 1
    assert _outcomes(result) == {"passed": 1, "failed": 1}
    result.stdout.fnmatch_lines(["*attention?R/R?*VALID*", "*attention?P/R?*FALLBACK*",
                                 "verdicts: 1 fallback, 1 valid*"])
    data = json.loads((pytester.path / "x.json").read_text())
    assert data["summary"]["failed"] == 1 and data["summary"]["passed"] == 1, data["summary"]
    assert set(data["summary"]) <= {"failed", "passed", "total", "collected", "deselected"}
    by_verdict = {t["metadata"]["rlk"]["verdict"]: t for t in data["tests"]}
    assert by_verdict["fallback"]["outcome"] == "failed"
    assert by_verdict["fallback"]["metadata"]["rlk"]["failed"] is True
    assert by_verdict["valid"]["outcome"] == "passed"
    assert data["rlk_matrix"]["summary"] == {"fallback": 1, "valid": 1}
    suite = ET.parse(pytester.path / "j.xml").getroot().find("testsuite")
    assert suite is not None and (suite.get("failures"), suite.get("errors")) == ("1", "0")
    # xunit2 (the default family): no <testcase> properties (its schema has none); the
    # verdicts are <testsuite> properties, one per cell (issue 47)
    props = {p.get("name"): p.get("value") for p in suite.find("properties").iter("property")}
    failed = {case.get("name"): case.find("failure") is not None
              for case in suite.iter("testcase")}
    assert not [case for case in suite.iter("testcase") if case.find("properties") is not None]
    verdicts = {name.rsplit("::", 1)[1]: value for name, value in props.items()
                if name.startswith("rlk_verdict:")}
    assert verdicts == {"attention[R/R]": "valid", "attention[P/R]": "fallback"}
    assert failed == {"attention[R/R]": False, "attention[P/R]": True}
    # audit mode: the same fallback does not fail the session, so it is `passed` everywhere
    audit = pytester.runpytest("--rlk-mode=audit", f"--rlk-matrix-root={tmp_path / 'r2'}",
                               "-k", "attention and P/R", "--json-report",
                               "--json-report-file=y.json", "--junitxml=k.xml")
    assert audit.ret == 0 and _outcomes(audit) == {"passed": 1}
    data = json.loads((pytester.path / "y.json").read_text())
    assert data["summary"]["passed"] == 1 and "failed" not in data["summary"]
    assert data["tests"][0]["outcome"] == "passed"
    assert data["tests"][0]["metadata"]["rlk"]["verdict"] == "fallback"
    suite = ET.parse(pytester.path / "k.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "0"


def test_integrations_under_xdist(pytester: pytest.Pytester, make_matrix,
                                  tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    make_matrix(env=FALLBACK, modules='["attention", "ffn"]')
    root = tmp_path / "root"
    result = pytester.runpytest_subprocess(
        "-n", "2", f"--rlk-matrix-root={root}", "-k", "attention and (R/R or P/R)",
        "--json-report", "--json-report-file=x.json", "--html=report.html",
        "--self-contained-html")
    assert result.ret == 0, result.stdout.str()
    data = json.loads((pytester.path / "x.json").read_text())
    verdicts = sorted(t["metadata"]["rlk"]["verdict"] for t in data["tests"])
    assert verdicts == ["fallback", "valid"]
    assert data["rlk_matrix"]["summary"] == {"fallback": 1, "valid": 1}
    cells = sorted(row[2] for row in _rows((pytester.path / "report.html").read_text()))
    assert cells == ['<td class="col-rlk_verdict">fallback</td>',
                     '<td class="col-rlk_verdict">valid</td>']


def test_not_registered_without_the_options(pytester: pytest.Pytester, make_matrix) -> None:
    make_matrix()
    pytester.makeconftest(
        "def pytest_collection_finish(session):\n"
        "    pm = session.config.pluginmanager\n"
        "    print('RLK-PLUGINS', pm.has_plugin('rlk-pytest-html'),"
        " pm.has_plugin('rlk-json-report'))\n")
    result = pytester.runpytest("-s", "--rlk-plan", "--rlk-hardware=cpu")
    result.stdout.fnmatch_lines(["*RLK-PLUGINS False False*"])
