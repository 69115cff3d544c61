"""The habits a pytest user relies on, with matrix cells (issue 47): failure-driven loops,
a plugin inert where nobody asked for it, JUnit without warnings, pytest's words in the short
summary, informational commands that write nothing, and reruns that compose.

Every test here runs on pytest 8 and 9 (`tox -e pytest8,pytest9`; `.ci/run` runs this file
under pytest 8 too), over the fake framework with the smallest matrix (the attention row).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import outcomes

# The attention row's four cells, in collection order; `A-RP_F-RR_L-RR` is R/P's run.
IDS = [f"matrix.toml::cpu::attention[{case}]" for case in ("R/R", "P/R", "R/P", "P/P")]
RP_CRASH = {"FAKE_SCENARIO": "crash", "FAKE_ONLY_WHEN": "A-RP_F-RR_L-RR"}


def _lastfailed(pytester: pytest.Pytester) -> dict[str, bool]:
    path = pytester.path / ".pytest_cache" / "v" / "cache" / "lastfailed"
    return json.loads(path.read_text()) if path.exists() else {}


# -- item 1: --lf / --ff / --sw ------------------------------------------------------------------


def test_failure_loops(pytester: pytest.Pytester, make_matrix, tmp_path: Path) -> None:
    make_matrix(modules='["attention"]', env=RP_CRASH)
    first = pytester.runpytest(f"--rlk-matrix-root={tmp_path / 'r1'}", "-p", "no:randomly")
    assert outcomes(first) == {"failed": 1, "passed": 3}
    assert _lastfailed(pytester) == {IDS[2]: True}

    # --lf: only the failed cell runs (pytest 9 once printed "1 known failures not in selected
    # tests" and ran all four)
    lf = pytester.runpytest("--lf", "-v", f"--rlk-matrix-root={tmp_path / 'r2'}")
    assert outcomes(lf) == {"failed": 1}, lf.stdout.str()
    lf.stdout.fnmatch_lines(["run-last-failure: rerun previous 1 failure*"])
    assert "not in selected tests" not in lf.stdout.str()

    # --ff: the failed cell first, then the others
    ff = pytester.runpytest("--ff", "-v", f"--rlk-matrix-root={tmp_path / 'r3'}")
    assert outcomes(ff) == {"failed": 1, "passed": 3}
    order = [ln.split(" ")[0] for ln in ff.outlines if ln.startswith("matrix.toml::")]
    assert order[0] == IDS[2], order

    # --sw: stops at the failing cell, and the next --sw run starts from it
    sw = pytester.runpytest("--sw", "-v", f"--rlk-matrix-root={tmp_path / 'r4'}")
    assert outcomes(sw) == {"failed": 1, "passed": 2}
    make_matrix(modules='["attention"]')  # the fault is fixed

    # a passing --lf run clears the last-failed cache; the next --lf has nothing to rerun
    fixed = pytester.runpytest("--lf", f"--rlk-matrix-root={tmp_path / 'r5'}")
    assert outcomes(fixed) == {"passed": 1}
    assert _lastfailed(pytester) == {}
    again = pytester.runpytest("--lf", "--co")
    again.stdout.fnmatch_lines(["run-last-failure: no previously failed tests, not deselecting*"])

    # --sw carries on from the cell that failed
    sw2 = pytester.runpytest("--sw", "-v", f"--rlk-matrix-root={tmp_path / 'r6'}")
    assert "previously failed test not found" not in sw2.stdout.str()
    sw2.stdout.fnmatch_lines(["stepwise: skipping 2 already passed items*"])
    assert outcomes(sw2) == {"passed": 2}
    assert [ln.split(" ")[0] for ln in sw2.outlines if ln.startswith("matrix.toml::")] == IDS[2:]


# -- item 2: inert where nobody asked ----------------------------------------------------------

CI_MATRIX = '[matrix]\npython = ["3.11", "3.12"]\nos = ["linux"]\n\n[env]\nCI = "1"\n'


def test_another_projects_matrix_toml_is_left_alone(pytester: pytest.Pytester) -> None:
    pytester.makefile(".toml", matrix=CI_MATRIX)
    pytester.makepyfile(test_c="def test_c():\n    assert True\n")
    # a subprocess: a new user's own pytest session
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    assert result.parseoutcomes() == {"passed": 1}
    text = "\n".join(ln for ln in result.outlines + result.errlines
                     if not ln.startswith(("plugins: ", "rootdir: ")))
    assert "rlk" not in text and "invalid matrix file" not in text, text
    assert not (pytester.path / "outputs").exists()
    # asked for by name (ini setting or option), the same file is the plugin's: its errors show
    named = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "rlk_matrix=matrix.toml")
    assert named.ret == pytest.ExitCode.USAGE_ERROR
    named.stderr.fnmatch_lines(["*matrix.toml: invalid matrix file*"])


def test_a_matrix_file_named_on_the_command_line_is_the_plugins(
        pytester: pytest.Pytester) -> None:
    """`pytest matrix.toml` names the file: a malformed one is reported as such, never passed
    over as another project's file ("not found")."""
    pytester.makefile(".toml", matrix='[runner\ncommand = "x"\n')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "matrix.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
    result.stderr.fnmatch_lines(["*matrix.toml: not valid TOML*"])


def test_recognised_matrix_files() -> None:
    from pytest_rlkernel_matrix.spec.recognise import is_rlk_matrix

    root = Path(__file__).resolve().parents[1]
    for path in [root / "matrix.toml", root / "pytest_rlkernel_matrix/templates/matrix.toml",
                 *sorted((root / "examples").glob("*.toml"))]:
        assert is_rlk_matrix(path), path


def test_no_matrix_file_one_ordinary_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_c="def test_c():\n    assert True\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == 0 and outcomes(result) == {"passed": 1}
    assert not (pytester.path / "outputs").exists()


# -- item 3: JUnit without warnings, both families ---------------------------------------------


@pytest.mark.parametrize("family", ["xunit1", "xunit2"])
def test_junit_without_warnings(pytester: pytest.Pytester, make_matrix, tmp_path: Path,
                                family: str) -> None:
    import xml.etree.ElementTree as ET

    make_matrix(modules='["attention"]', env=RP_CRASH)
    xml = tmp_path / "junit.xml"
    # a subprocess: an in-process session warns that the plugin is imported already
    result = pytester.runpytest_subprocess(
        f"--rlk-matrix-root={tmp_path / 'root'}", "-k", "R/R or R/P",
                                f"--junitxml={xml}", "-o", f"junit_family={family}",
                                "-W", "error::pytest.PytestWarning", "-p", "no:cacheprovider")
    out = result.stdout.str()
    assert "record_property" not in out and "PytestWarning" not in out, out
    assert result.parseoutcomes() == {"passed": 1, "failed": 1, "deselected": 2}  # no warnings
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert (suite.get("failures"), suite.get("errors")) == ("1", "0")
    props = {p.get("name"): p.get("value") for p in suite.find("properties").iter("property")}
    assert props[f"rlk_verdict:{IDS[0]}"] == "valid" and props[f"rlk_verdict:{IDS[2]}"] == "error"
    assert props["rlk_matrix_report"] == str(tmp_path / "root" / "matrix-report.json")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["attention[R/P]"].find("failure").get("message").startswith("error: exit code 1")
    case_props = {c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")}
                  for c in suite.iter("testcase")}
    if family == "xunit1":  # <testcase> properties exist in xunit1 only
        assert case_props["attention[R/R]"]["rlk_verdict"] == "valid"
        assert case_props["attention[R/P]"]["rlk_verdict"] == "error"
    else:
        assert case_props == {"attention[R/R]": {}, "attention[R/P]": {}}


# -- item 4 (and 7's -rs): the short summary in pytest's words ---------------------------------


def test_short_summary_speaks_pytest(pytester: pytest.Pytester, make_matrix,
                                     tmp_path: Path) -> None:
    make_matrix(modules='["attention"]', mode="strict",
                env={"FAKE_SCENARIO": "recorded_fallback"})
    result = pytester.runpytest(f"--rlk-matrix-root={tmp_path / 'a'}", "-rA", "-v",
                                "-p", "no:cacheprovider")
    assert outcomes(result) == {"failed": 2, "passed": 2}
    # -v keeps the verdict as the word; the short summary uses pytest's
    assert any(ln.startswith(f"{IDS[1]} FALLBACK") for ln in result.outlines)
    summary = result.outlines[result.outlines.index(
        next(ln for ln in result.outlines if "short test summary info" in ln)) + 1:]
    failed = [ln for ln in summary if ln.startswith("FAILED ")]
    passed = [ln for ln in summary if ln.startswith("PASSED ")]
    assert [ln.split(" ")[1] for ln in failed] == IDS[:2]
    assert all(" - fallback: attention rollout: fall" in ln for ln in failed), failed
    assert [ln.split(" ")[1] for ln in passed] == IDS[2:]
    assert not [ln for ln in summary if ln.startswith(("ERROR", "FALLBACK", "VALID"))], summary
    assert len(failed) == outcomes(result)["failed"] and len(passed) == outcomes(result)["passed"]

    rf = pytester.runpytest(f"--rlk-matrix-root={tmp_path / 'b'}", "-rf", "-k", "P/R",
                            "-p", "no:cacheprovider")
    assert any(ln.startswith(f"FAILED {IDS[1]} - fallback: attention rollout")
               for ln in rf.outlines), rf.stdout.str()
    assert outcomes(rf) == {"failed": 1}

    off = pytester.runpytest(f"--rlk-matrix-root={tmp_path / 'c'}", "--rlk-mode=off", "-rs",
                             "-p", "no:cacheprovider")
    assert outcomes(off) == {"passed": 1, "skipped": 3}
    skips = [ln for ln in off.outlines if ln.startswith("SKIPPED ")]
    assert [ln.split(": not run in off mode")[0] for ln in skips] == [
        f"SKIPPED [1] {i}" for i in IDS[:3]], skips
    assert "collect.py" not in off.stdout.str()


# -- item 5: informational commands write nothing; default roots never collide -----------------


@pytest.mark.parametrize("args", [["--co", "-q"], ["--collect-only"], ["--rlk-plan"],
                                  ["--setup-plan"], ["--fixtures-per-test"], ["--help"],
                                  ["--markers"], ["--fixtures"], ["--version"]])
def test_informational_commands_write_nothing(pytester: pytest.Pytester, make_matrix,
                                              args: list[str]) -> None:
    make_matrix(modules='["attention"]')
    result = pytester.runpytest("-p", "no:cacheprovider", *args)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    written = sorted(str(p.relative_to(pytester.path)) for p in pytester.path.rglob("*")
                     if p.name != "matrix.toml" and ".benchmarks" not in p.parts)
    assert written == [], written
    text = result.stdout.str()
    if args[0] in ("--help", "--markers", "--fixtures", "--version"):
        # no matrix session at all: no preflight probe, no header line
        assert "preflight probe" not in text, text
    if args[0] == "--markers":
        assert "@pytest.mark.rlk_case(case)" in text
    if args[0] in ("--co", "--collect-only", "--fixtures-per-test"):
        assert IDS[0] in text or "attention[R/R]" in text, text


def test_two_sessions_started_together_get_their_own_roots(
        pytester: pytest.Pytester, make_matrix, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys
    from datetime import UTC, datetime, timedelta

    from pytest_rlkernel_matrix.session import utc_stamp

    make_matrix(modules='["attention"]')
    base = pytester.path / "outputs" / "rlkernel"
    # Roots that earlier sessions used for each second of the next two minutes: whatever second
    # the two sessions start in, both must step past the used one, and past each other.
    now = datetime.now(UTC)
    used = [base / f"ablation-matrix-{utc_stamp(now + timedelta(seconds=s))}"
            for s in range(-2, 120)]
    for root in used:
        root.mkdir(parents=True, exist_ok=True)
        (root / "preflight.json").write_text("{}")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MATRIX_ROOT", "MATRIX_STAMP", "PYTEST_ADDOPTS")}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-k", "R/R"]
    procs = [subprocess.Popen(cmd, cwd=pytester.path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    roots = {r.parent for r in base.glob("*/matrix-report.json")}
    assert len(roots) == 2, (sorted(roots), outs)
    assert all("-" in r.name.rsplit("Z", 1)[1] for r in roots), roots  # <stamp>-2, -3, ...
    assert all(sorted(p.name for p in r.iterdir()) == ["preflight.json"] for r in used)


# -- item 6: reruns compose ----------------------------------------------------------------------


def test_a_rerun_composes_with_its_first_run(pytester: pytest.Pytester, make_matrix,
                                             tmp_path: Path) -> None:
    import subprocess
    import sys

    make_matrix(modules='["attention"]', env=RP_CRASH)
    first, rerun, subset = tmp_path / "first", tmp_path / "rerun", tmp_path / "subset"
    pytester.runpytest(f"--rlk-matrix-root={first}")
    one = json.loads((first / "matrix-report.json").read_text())
    assert one["complete"] is True and one["summary"] == {"error": 1, "valid": 3}
    assert "selection" in one and one["selection"]["rerun_of"] is None

    make_matrix(modules='["attention"]')  # fixed: --lf reruns the failed cell
    result = pytester.runpytest("--lf", f"--rlk-matrix-root={rerun}")
    assert outcomes(result) == {"passed": 1}
    two = json.loads((rerun / "matrix-report.json").read_text())
    sel = two["selection"]
    assert two["complete"] is False and sel["by"] == ["--lf"]
    assert sel["rerun_of"] == str(first) and sel["reran"] == ["cpu::attention[R/P]"]
    assert sel["missing"] == ["cpu::attention[R/R]", "cpu::attention[P/R]", "cpu::attention[P/P]"]
    result.stdout.fnmatch_lines([f"rerun of {first}: 1 cell rerun (--lf)",
                                 "whole matrix, each cell's latest verdict: *latest.json"])
    # the rerun's own combined report, and the command that gives the same
    whole = json.loads((rerun / "matrix-report.latest.json").read_text())
    verdicts = {(c["case"], c["verdict"], c["from"]) for c in whole["cells"]}
    assert verdicts == {("R/R", "valid", str(first)), ("P/R", "valid", str(first)),
                        ("R/P", "valid", str(rerun)), ("P/P", "valid", str(first))}
    assert whole["complete"] is True and whole["summary"] == {"valid": 4}
    cli = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.cli", "latest",
                          str(rerun), "-o", str(tmp_path / "whole.json")],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert f"cpu::attention[R/P]  valid  from {rerun}" in cli.stdout
    assert f"cpu::attention[R/R]  valid  from {first}" in cli.stdout
    assert json.loads((tmp_path / "whole.json").read_text())["summary"] == {"valid": 4}

    # a -k subset is not the whole matrix
    pytester.runpytest("-k", "R/R", f"--rlk-matrix-root={subset}")
    three = json.loads((subset / "matrix-report.json").read_text())
    assert three["complete"] is False and three["selection"]["by"] == ["-k R/R"]
    assert three["selection"]["rerun_of"] == str(rerun)

    # a -k that selects no cell writes no root, and is never the root a later session reran
    # (issue 53); -x is part of what a session selected by
    nothing = tmp_path / "nothing"
    empty = pytester.runpytest("-k", "no-such-cell", f"--rlk-matrix-root={nothing}")
    assert not nothing.exists(), sorted(nothing.rglob("*"))
    empty.stdout.fnmatch_lines(["rlk: no matrix cell selected (-k no-such-cell): nothing run, "
                                "no matrix root written*"])
    stop_first = tmp_path / "stop-first"
    pytester.runpytest("-x", "-k", "P/P", f"--rlk-matrix-root={stop_first}")
    four = json.loads((stop_first / "matrix-report.json").read_text())
    assert four["selection"]["by"] == ["-k P/P", "-x"]
    assert four["selection"]["rerun_of"] == str(subset)  # not the empty session's root


# -- item 7: the progress bar and pytest's dots ----------------------------------------------------


def test_progress_bar_keeps_pytests_row_of_dots(pytester: pytest.Pytester, make_matrix,
                                                tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_rlkernel_matrix.report import progress

    monkeypatch.setattr(progress, "on_terminal", lambda *a, **k: True)  # as on a terminal
    make_matrix(modules='["attention"]')
    quiet = pytester.runpytest(f"--rlk-matrix-root={tmp_path / 'a'}", "-p", "no:cacheprovider")
    assert outcomes(quiet) == {"passed": 4}
    rows = [ln for ln in quiet.outlines if ln.startswith("matrix.toml")]
    assert len(rows) == 1 and rows[0].startswith("matrix.toml ....") and "[100%]" in rows[0]
    assert not [ln for ln in quiet.outlines if ln.startswith("rlk cells")]
    verbose = pytester.runpytest(f"--rlk-matrix-root={tmp_path / 'b'}", "-v",
                                 "-p", "no:cacheprovider")
    lines = verbose.outlines
    items = [i for i, ln in enumerate(lines) if ln.startswith("matrix.toml::")]
    bars = [i for i, ln in enumerate(lines) if ln.startswith("rlk cells")]
    assert len(items) == 4 and len(bars) == 4, lines
    assert all(lines[i].rstrip().endswith("%]") for i in items), lines  # whole item lines
    assert [b - 1 for b in bars] == items  # each bar line right after its item's line


def test_option_group_is_the_one_the_readme_names(pytester: pytest.Pytester) -> None:
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (title,) = re.findall(r'`pytest --help` lists them under "([^"]+)"', readme)
    result = pytester.runpytest("--help")
    lines = result.outlines
    head = lines.index(f"{title}:")
    assert lines[head + 1].lstrip().startswith("--rlk-matrix"), lines[head:head + 3]


def test_docs_show_final_lines_pytest_prints() -> None:
    """Every final line the docs quote counts pytest's outcomes, never a verdict."""
    import re

    root = Path(__file__).resolve().parents[1]
    words = {"failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warning",
             "warnings", "error", "errors", "cell planned", "cells planned", "subtests passed",
             "subtests failed", "rerun"}
    final = re.compile(r"^=+ (.*) in [0-9.]+s(?: \([0-9:]+\))? =+$")
    bad = []
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = final.match(line)
            if m and any(part.strip().split(" ", 1)[1] not in words
                         for part in m.group(1).split(",")):
                bad.append(f"{path.relative_to(root)}:{n}: {line}")
    assert bad == []
