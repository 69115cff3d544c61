"""pytest's own plugins, as a pytest user expects them to work with matrix cells (issue 47;
docs/en/pytest-habits.md): the informational commands (`--collect-only`, `--help`, ...) that
write nothing, `cacheprovider` (the root of each matrix file's last session, so a rerun says
which root it reran and combines with it), `junitxml` (verdicts as `<testsuite>` properties, valid
in xunit1 and xunit2) and the terminal's short summary (pytest's words, the verdict in the
message).

Imports nothing heavy at load; the report layer only inside the functions that need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_rlkernel_matrix.spec.terms import plural

if TYPE_CHECKING:
    from pytest_rlkernel_matrix.session import MatrixSession

# Commands that collect but run no cell (a dry session: writes nothing, takes no lock) ...
INFORMATIONAL = ("collectonly", "setupplan", "setuponly", "show_fixtures_per_test")
# ... and commands that need no cell at all (no matrix session, no preflight).
INFORMATIONAL_ONLY = ("help", "markers", "showfixtures", "version", "cacheshow")
ROOTS_CACHE = "rlk_matrix/roots"  # pytest cache: matrix file -> the root of its last session


def informs(config: pytest.Config) -> bool:
    """A command that collects but runs no cell: the session is dry (writes nothing)."""
    return any(config.getoption(name, False) for name in INFORMATIONAL)


def informs_only(config: pytest.Config) -> bool:
    """A command that needs no cell at all (`--help`, `--markers`, `--fixtures`, `--version`,
    `--cache-show`): no matrix session, no preflight."""
    return any(config.getoption(name, False) for name in INFORMATIONAL_ONLY)


def selection(config: pytest.Config, ms: MatrixSession) -> dict[str, Any]:
    """What this session selects of the whole matrix, and the root it reruns cells of (the last
    session's over this matrix file, from pytest's cache) when it selects a subset."""
    from pytest_rlkernel_matrix.spec.cells import expand, expand_factors

    opt = config.option
    by = [flag for flag, on in (("--lf", getattr(opt, "lf", False)),
                                ("--sw", getattr(opt, "stepwise", False))) if on]
    if getattr(opt, "keyword", ""):
        by.append(f"-k {opt.keyword}")
    if getattr(opt, "markexpr", ""):
        by.append(f"-m {opt.markexpr}")
    by += [f"--deselect {d}" for d in getattr(opt, "deselect", None) or []]
    by += [arg for arg in config.args if "::" in arg]
    maxfail = int(getattr(opt, "maxfail", 0) or 0)
    if maxfail:  # -x / --maxfail: the session may stop before the cells it selected
        by.append("-x" if maxfail == 1 else f"--maxfail {maxfail}")
    m = ms.matrix
    cells = [*expand(m.matrix, ms.hardware, ms.layout, ms.mode),
             *expand_factors(m.factors, m.matrix, ms.hardware)]
    cache = getattr(config, "cache", None)
    earlier = (cache.get(ROOTS_CACHE, {}) if cache is not None else {}).get(str(ms.matrix_path))
    return {"by": by, "matrix_cells": [f"{c.hardware}::{c.name}" for c in cells],
            "rerun_of": earlier if by and earlier and earlier != str(ms.root) else None}


def remember_root(config: pytest.Config, ms: MatrixSession) -> None:
    """This root, as the last session's of its matrix file (what the next rerun is a rerun of)."""
    cache = getattr(config, "cache", None)
    if cache is not None:
        roots = dict(cache.get(ROOTS_CACHE, {}))
        roots[str(ms.matrix_path)] = str(ms.root)
        cache.set(ROOTS_CACHE, roots)


def write_latest(ms: MatrixSession) -> Path | None:
    """A rerun's whole matrix: each cell's latest verdict across it and the roots it reran."""
    from pytest_rlkernel_matrix.report.merge import MergeError
    from pytest_rlkernel_matrix.report.rerun import LATEST_FILE, chain, latest
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    try:
        combined = latest(chain(ms.root))
    except MergeError:  # an earlier root gone or unreadable: this report still stands
        return None
    path = ms.root / LATEST_FILE
    write_json_atomic(path, combined)
    return path


def rerun_lines(ms: MatrixSession) -> list[str]:
    """The terminal's word on a rerun: of which root, what it reran, the whole matrix's file."""
    from pytest_rlkernel_matrix.report.rerun import LATEST_FILE

    if ms.selection is None or not ms.selection.get("rerun_of"):
        return []
    lines = [f"rerun of {ms.selection['rerun_of']}: {plural(len(ms.records), 'cell')} rerun "
             f"({', '.join(ms.selection['by']) or 'a subset'})"]
    if (ms.root / LATEST_FILE).is_file():
        lines.append(f"whole matrix, each cell's latest verdict: {ms.root / LATEST_FILE}")
    return lines


def junit_suite_property(config: pytest.Config, name: str, value: object) -> None:
    """A `<testsuite>` property of `--junitxml` (what `record_testsuite_property` writes: valid
    in xunit1 and xunit2), added on the controller, so it works under xdist too."""
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # pragma: no cover - pytest moved it: the verdicts stay in the failures
        return
    xml = config.stash.get(xml_key, None)
    if xml is not None:
        xml.add_global_property(name, value)


class SummaryWords:
    """Marks the time pytest writes its summaries (`summarizing`): there cells speak pytest's
    words (`FAILED <id> - fallback: ...`), elsewhere their verdicts (`-v`: `FALLBACK`)."""

    def __init__(self) -> None:
        self.summarizing = False

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self) -> Any:
        self.summarizing = True
        try:
            return (yield)
        finally:
            self.summarizing = False
