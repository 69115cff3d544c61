"""What a new user meets first: other projects left alone, usage errors that name the path and
leave nothing behind, a terminal that says where to look (issue 18, items 1, 5, 6, 8)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ORDINARY = "def test_ordinary():\n    assert 1 + 1 == 2\n"
INI_FILES = {
    "none": None,
    "pytest.ini": ("pytest.ini", "[pytest]\naddopts = -p no:cacheprovider\n"),
    "tox.ini": ("tox.ini", "[tox]\nenvlist = py\n\n[pytest]\nxfail_strict = true\n"),
    "pyproject": ("pyproject.toml", "[project]\nname = \"other\"\nversion = \"0\"\n\n"
                  "[tool.pytest.ini_options]\nxfail_strict = true\n"),
}
THIRD_PARTY = {".pytest_cache", ".benchmarks", "__pycache__", ".hypothesis"}


def _entries(path: Path) -> set[str]:
    # runpytest_subprocess keeps its own basetemp (runpytest-N) and stdout/stderr files there
    return {str(p.relative_to(path)) for p in path.rglob("*")
            if not THIRD_PARTY.intersection(p.relative_to(path).parts)
            and not p.relative_to(path).parts[0].startswith(("runpytest-", "stdout", "stderr"))}


# -- item 1: an installed plugin does no harm ------------------------------------------------------


@pytest.mark.parametrize("ini", list(INI_FILES))
def test_a_project_without_a_matrix_file_is_left_alone(pytester: pytest.Pytester,
                                                       ini: str) -> None:
    pytester.makepyfile(test_other=ORDINARY)
    if INI_FILES[ini] is not None:
        name, text = INI_FILES[ini]  # type: ignore[misc]
        (pytester.path / name).write_text(text)
    before = _entries(pytester.path)
    # every ini file with a plain `pytest`; the other invocations once (each is a subprocess)
    for args in ([], ["."], ["--co", "-q"]) if ini == "none" else ([],):
        # a subprocess: a new user's own pytest, not one inside this session's imports
        result = pytester.runpytest_subprocess(*args)
        assert result.ret == pytest.ExitCode.OK, (args, result.stdout.str(), result.stderr.str())
        text = "\n".join(line for line in result.outlines + result.errlines
                         if not line.startswith(("plugins: ", "rootdir: ")))
        assert "rlk" not in text and "matrix" not in text, (args, text)
        if "--co" in args:
            result.stdout.fnmatch_lines(["*test_other.py::test_ordinary*", "*1 test collected*"])
        else:
            assert result.parseoutcomes() == {"passed": 1}
    assert _entries(pytester.path) == before  # nothing written
    if ini == "none":
        markers = pytester.runpytest_subprocess("--markers")
        assert markers.ret == 0 and "rlk_" not in markers.stdout.str()


def test_a_named_matrix_file_that_is_missing_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_other=ORDINARY)
    result = pytester.runpytest("--rlk-matrix=nope.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{pytester.path / 'nope.toml'}: cannot read matrix file*"])
    pytester.makeini("[pytest]\nrlk_matrix = m.toml\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{pytester.path / 'm.toml'}: cannot read matrix file*"])


@pytest.mark.slow
def test_wheel_installed_plugin_leaves_other_projects_alone(tmp_path: Path) -> None:
    """The built wheel in a fresh venv (its dependencies from the index: slow)."""
    repo = Path(__file__).resolve().parents[1]
    wheels, venv, project = tmp_path / "wheels", tmp_path / "venv", tmp_path / "other"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels),
                    str(repo)], check=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    (wheel,) = wheels.glob("pytest_rlkernel_matrix-*.whl")
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True)
    project.mkdir()
    (project / "test_other.py").write_text(ORDINARY)
    (project / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    helptext = subprocess.run([str(python), "-m", "pytest", "--help"], cwd=project,
                              capture_output=True, text=True, env=env)
    assert "--rlk-matrix" in helptext.stdout, helptext.stderr  # loaded by its entry point
    for args in ([], ["."], ["--co", "-q"]):
        out = subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", *args],
                             cwd=project, capture_output=True, text=True, env=env)
        assert out.returncode == 0, (args, out.stdout, out.stderr)
        text = [line for line in (out.stdout + out.stderr).splitlines()
                if not line.startswith(("plugins: ", "rootdir: "))]
        assert not any("rlk" in line or "matrix" in line for line in text), text
    assert {p.name for p in project.iterdir()} - THIRD_PARTY == {"pytest.ini", "test_other.py"}


# -- item 5: bad matrix roots ---------------------------------------------------------------------


def _usage_error(result: pytest.RunResult, *patterns: str) -> None:
    text = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, text
    assert "INTERNALERROR" not in text, text
    result.stderr.fnmatch_lines(list(patterns))


def test_a_root_that_is_a_file_is_a_usage_error(pytester: pytest.Pytester, make_matrix,
                                                tmp_path: Path) -> None:
    make_matrix(modules='["attention"]')
    afile = tmp_path / "afile"
    afile.write_text("x")
    _usage_error(pytester.runpytest(f"--rlk-matrix-root={afile}", "-k", "R/R"),
                 f"ERROR: matrix root {afile} is a file, not a directory*")
    under = afile / "root"
    _usage_error(pytester.runpytest(f"--rlk-matrix-root={under}", "-k", "R/R"),
                 f"ERROR: matrix root {under} lies under {afile}, which is a file*")
    assert afile.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0o555 directory regardless")
def test_a_read_only_root_is_a_usage_error(pytester: pytest.Pytester, make_matrix,
                                           tmp_path: Path) -> None:
    make_matrix(modules='["attention"]')
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o555)
    try:
        _usage_error(pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R"),
                     f"ERROR: matrix root {root} cannot be written: Permission denied: "
                     f"{root / '.rlk-session.lock'}*")
    finally:
        root.chmod(0o755)
    assert list(root.iterdir()) == []


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux sysfs")
def test_a_root_nobody_can_write_is_a_usage_error(pytester: pytest.Pytester, make_matrix) -> None:
    """sysfs refuses new files even to root: a read-only root where chmod cannot make one."""
    make_matrix(modules='["attention"]')
    root = Path("/sys/kernel")
    _usage_error(pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R"),
                 f"ERROR: matrix root {root} cannot be written: *: {root / '.rlk-session.lock'}*")


# -- item 6: a usage error leaves nothing behind --------------------------------------------------

TWO = '[hardware.cpu]\nbackend = "cpu"\n[hardware.h100]\nbackend = "cuda"\n' \
      'match = { device_name = "H100" }\n'


@pytest.mark.parametrize("hardware, message", [
    ("nonexistent", "*--rlk-hardware names nonexistent*"),
    ("h100", "*--rlk-hardware=h100: this machine is detected as cpu*"),
])
def test_a_usage_error_leaves_nothing_behind(pytester: pytest.Pytester, make_matrix,
                                             tmp_path: Path, hardware: str, message: str) -> None:
    make_matrix(hardware=TWO)
    new = tmp_path / "made" / "by" / "us"
    _usage_error(pytester.runpytest(f"--rlk-matrix-root={new}", f"--rlk-hardware={hardware}"),
                 message)
    assert not (tmp_path / "made").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    _usage_error(pytester.runpytest(f"--rlk-matrix-root={kept}", f"--rlk-hardware={hardware}"),
                 message)
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    # the default root (next to the matrix file) is not left behind either
    _usage_error(pytester.runpytest(f"--rlk-hardware={hardware}"), message)
    assert not (pytester.path / "outputs").exists()


# -- item 8: say where to look --------------------------------------------------------------------


def _shell_matrix(path: Path, command: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('[matrix]\nmodules = ["attention"]\n'
                    f"[runner]\ncommand = {json.dumps(command)}\ntimeout = 30\n"
                    '[hardware.cpu]\nbackend = "cpu"\n')
    return path


def test_a_failing_cell_shows_its_last_error_line_and_where_the_log_is(
        pytester: pytest.Pytester, reuse_probe: Path, tmp_path: Path) -> None:
    _shell_matrix(pytester.path / "matrix.toml",
                  'echo starting; echo "train.py: error: unrecognized arguments: --fo" >&2; '
                  "echo cleaning up; exit 2")
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R")
    (cell,) = json.loads((root / "matrix-report.json").read_text())["cells"]
    assert cell["verdict"] == "error"
    assert cell["reasons"][0] == ("exit code 2; run.log: train.py: error: unrecognized "
                                  "arguments: --fo"), cell["reasons"]
    log = root / "cpu" / "attention-rr" / "run.log"
    result.stdout.fnmatch_lines([
        "*exit code 2; run.log: train.py: error: unrecognized arguments: --fo",
        f"  run.log: {log}",  # in the failure's own section
        f"    run.log: {log}",  # in the rlk matrix summary
        f"matrix report: {root / 'matrix-report.json'}",
        f"matrix report (HTML): {root / 'matrix-report.html'}",
    ])


def test_node_ids_keep_a_matrix_file_outside_the_rootdir(pytester: pytest.Pytester,
                                                         reuse_probe: Path,
                                                         tmp_path: Path) -> None:
    matrix = _shell_matrix(tmp_path / "elsewhere" / "m.toml", "exit 0")
    rel = os.path.relpath(matrix, pytester.path)
    result = pytester.runpytest(f"--rlk-matrix={matrix}", "--co", "-q")
    assert result.ret == 0
    assert f"{rel}::cpu::attention[R/R]" in result.outlines, result.outlines
    result = pytester.runpytest(f"--rlk-matrix={matrix}", "--rlk-matrix-root",
                                str(tmp_path / "root"), "-k", "R/R", "-p", "no:xdist")
    lines = result.outlines
    assert any(line.startswith(f"{rel} ") for line in lines), lines  # the progress line
    assert not any(line.startswith(". ") for line in lines), lines


def test_plan_ends_with_the_cells_it_planned(pytester: pytest.Pytester,
                                                     make_matrix) -> None:
    make_matrix(modules='["attention"]')
    result = pytester.runpytest("--rlk-plan", "--rlk-hardware=cpu")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["# rlk plan: 4 cells, matrix root *", "* 4 cells planned in *"])
    assert not any("deselected" in line for line in result.outlines[-3:]), result.outlines[-3:]
    result = pytester.runpytest("--rlk-plan", "--rlk-hardware=cpu", "-k", "R/R")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["# rlk plan: 1 cell, matrix root *",
                                 "*3 deselected, *1 cell planned in *"])


def test_counts_read_in_the_singular(pytester: pytest.Pytester, tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.cli import summary_line
    from pytest_rlkernel_matrix.spec.terms import plural

    assert plural(1, "cell") == "1 cell" and plural(0, "cell") == "0 cells"
    assert plural(2, "process", "processes") == "2 processes"
    report = {"summary": {"valid": 1}, "cells": [{}], "expected_cells": 1, "complete": True}
    assert summary_line(report, tmp_path) == f"1 valid in 1 of 1 cell (complete): {tmp_path}"
    pytester.makefile(".toml", matrix='[matrix]\nmodules = ["attention"]\nbogus = 1\n'
                      '[runner]\ncommand = ["true"]\n[hardware.cpu]\nbackend = "cpu"\n')
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*matrix.toml: invalid matrix file (1 problem):"])
