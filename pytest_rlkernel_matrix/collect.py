"""Collection: `matrix.toml` -> one collector per hardware -> one Function item per cell.

Items are real `pytest.Function`s calling `rlk_matrix_cell`, so fixtures (overridable in a
conftest), `user_properties`, `-k`, `-m` and other plugins work as on any test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pytest_rlkernel_matrix.report.terminal import failed_run_log
from pytest_rlkernel_matrix.spec.cells import Cell, expand, expand_factors

SESSION_KEY = pytest.StashKey["MatrixSession"]()
CELL_KEY = pytest.StashKey[Cell]()
RECORD_KEY = pytest.StashKey[dict[str, Any]]()


class CellFailed(Exception):
    """A cell whose verdict fails under the session's mode."""

    def __init__(self, record: dict[str, Any]) -> None:
        super().__init__(record["verdict"])
        self.record = record


def rlk_matrix_cell(
    request: pytest.FixtureRequest,
    rlk_cell: Cell,
    rlk_mode: str,
    rlk_preflight: dict[str, Any],
    rlk_artifact_dir: Any,
) -> None:
    """Run one matrix cell (or reuse the run it shares) and judge it under `rlk_mode`."""
    session = request.config.stash[SESSION_KEY]
    hook = request.config.hook.pytest_rlk_cell_env

    def env_hook(cell: Cell, env: dict[str, str]) -> None:
        hook(config=request.config, cell=cell, env=env)

    try:
        record = session.run_cell(rlk_cell, mode=rlk_mode, env_hook=env_hook)
    except OSError as exc:  # a read-only or full cell directory: said as such (issue 53)
        from pytest_rlkernel_matrix.report.record import os_error_record

        record = os_error_record(rlk_cell, rlk_mode, exc)
    except Exception as exc:  # one broken cell is an `error` record, never a lost session
        from pytest_rlkernel_matrix.report.record import internal_error_record

        record = internal_error_record(rlk_cell, rlk_mode, exc)
    request.node.stash[RECORD_KEY] = record
    if testcase_properties(request.config):
        request.node.user_properties.extend([("rlk_verdict", record["verdict"]),
                                             ("rlk_artifact_dir", record.get("artifact_dir"))])
    if record["verdict"] == "not_run":
        pytest.skip(record["reasons"][0])
    if record["failed"]:
        raise CellFailed(record)


def testcase_properties(config: pytest.Config) -> bool:
    """May a cell carry JUnit `<testcase>` properties? Only in the xunit1 (legacy) family:
    xunit2's schema has none, which is why pytest warns on `record_property` there. In xunit2
    the verdicts go to `<testsuite>` properties instead (`plugin.junit_suite_property`)."""
    try:
        family = str(config.getini("junit_family"))
    except ValueError:  # -p no:junitxml
        return False
    return family in ("xunit1", "legacy")


class MatrixItem(pytest.Function):
    """One (hardware, module, case) cell: `matrix.toml::<hardware>::<module>[<case>]`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _structured_id(self)

    def reportinfo(self) -> tuple[Any, int, str]:
        return self.path, 0, f"{self.parent.name}::{self.name}"

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        # pytest 9's Function.repr_failure takes no `style` (passing it was an INTERNALERROR
        # that ended the session with an empty report): accept it, never forward it.
        if isinstance(excinfo.value, CellFailed):
            text = failure_text(excinfo.value.record, self.config.stash[SESSION_KEY].root)
            return CellFailure(text, str(self.path))
        return super().repr_failure(excinfo)


def _structured_id(item: pytest.Item) -> None:
    """Give the item the structured node id pytest 9 reads back from its own node id string.

    pytest 9 keeps node ids as `NodeId(path, names, params)` and compares those, never strings.
    Every id it reads back from text (the `--lf`/`--ff`/`--nf` and `--sw` caches, reports
    from xdist workers) goes through `NodeId.parse`, which takes `[...]` for parametrization:
    `attention[R/R]` reads as names `(..., "attention")`, params `"R/R"`, the id pytest itself
    gives a function `attention` parametrized with id `R/R`. An item built from a plain name
    would keep `names=(..., "attention[R/R]")`, `params=None`, and never match its own cached
    id. pytest 8 compares the strings, which this leaves unchanged.
    """
    own = getattr(item, "_id", None)
    parse = getattr(type(own), "parse", None)
    if own is not None and callable(parse):
        item._id = parse(str(own))  # type: ignore[attr-defined]


class HardwareNode(pytest.Collector):
    """All cells of one hardware profile."""

    def collect(self) -> Iterator[MatrixItem]:
        session = self.config.stash[SESSION_KEY]
        m = session.matrix
        cells = expand(m.matrix, [self.name], session.layout, session.mode)
        for cell in cells + expand_factors(m.factors, m.matrix, [self.name]):
            item = MatrixItem.from_parent(self, name=cell.name, callobj=rlk_matrix_cell)
            item.stash[CELL_KEY] = cell
            item.add_marker(pytest.mark.rlk_hardware(cell.hardware, name=cell.hardware))
            item.add_marker(pytest.mark.rlk_module(cell.module, name=cell.module))
            item.add_marker(pytest.mark.rlk_case(cell.case, case=cell.case))
            if cell.factor is not None:
                f = cell.factor
                item.add_marker(pytest.mark.rlk_factor(f.name, name=f.name, variant=f.variant))
                item.extra_keyword_matches.update({f.name, f.variant})
            elif cell.is_baseline:
                item.add_marker(pytest.mark.rlk_baseline)
            item.extra_keyword_matches.update({cell.hardware, cell.module, cell.case,
                                               cell.case.replace("/", "")})
            yield item


class MatrixFileNode(pytest.File):
    """`matrix.toml`: one child per hardware profile in use."""

    def collect(self) -> Iterator[HardwareNode]:
        session = self.config.stash[SESSION_KEY]
        for name in session.hardware:
            yield HardwareNode.from_parent(self, name=name)


@dataclass(frozen=True)
class CellCrash:
    """Where and why, in the shape of pytest's `reprcrash` (its short summary and JUnit's
    `<failure message>` read `.message`)."""

    path: str
    lineno: int
    message: str


class CellFailure:
    """A failed cell's `longrepr`: its text, and the `<verdict>: <first reason>` line as the
    crash message (pytest 8 takes the short summary's message only from `reprcrash`)."""

    def __init__(self, text: str, path: str) -> None:
        self.text = text
        self.reprcrash = CellCrash(path, 0, text.split("\n", 1)[0])

    def toterminal(self, tw: Any) -> None:
        for line in self.text.split("\n"):
            tw.line(line)

    def __str__(self) -> str:
        return self.text


def failure_text(rec: dict[str, Any], root: Path | None, note: str = "") -> str:
    """A failed cell's report text. Its first line, `<verdict>: <first reason>`, is what pytest's
    short summary (`FAILED <id> - fallback: ...`) and JUnit's `<failure message>` show."""
    reasons = [str(r) for r in rec.get("reasons", [])]
    lines = [f"{rec['verdict']}: {reasons[0] if reasons else '(no reason recorded)'}",
             f"{rec['hardware']} {rec['module']} {rec['case']}: verdict {rec['verdict']} "
             f"(mode {rec.get('mode')}){note}"]
    lines += [f"  - {r}" for r in reasons]
    if rec.get("artifact_dir") and root is not None:
        lines.append(f"  artifacts: {root / rec['artifact_dir']}")
        log = failed_run_log(root, rec)
        if log is not None:
            lines.append(f"  run.log: {log}")
    return "\n".join(lines)

