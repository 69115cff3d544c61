"""The matrix vocabulary, importable without pydantic, numpy or torch."""

from __future__ import annotations

import re
from collections.abc import Mapping

MODULES: tuple[str, ...] = ("attention", "ffn", "logp")  # the seed's matrix
# Optional modules, enabled in `[matrix] modules`: `comm` (the TP activation reduction) is this
# project's extension of the seed's three-module matrix and needs tensor parallelism.
OPTIONAL_MODULES: tuple[str, ...] = ("comm",)
ALL_MODULES: tuple[str, ...] = (*MODULES, *OPTIONAL_MODULES)
CASES: tuple[str, ...] = ("R/R", "P/R", "R/P", "P/P")
MODES: tuple[str, ...] = ("strict", "audit", "auto", "off")
LAYOUTS: tuple[str, ...] = ("pairwise", "reduced", "module-factorial", "full")
VERDICTS: tuple[str, ...] = (
    "valid", "unsupported", "fallback", "contract_mismatch", "incomparable", "error",
)


def plural(count: int, noun: str, many: str | None = None) -> str:
    """`1 cell`, `2 cells`, `0 cells`; `many` for irregular plurals (`process`, `processes`)."""
    return f"{count} {noun if count == 1 else many or noun + 's'}"


_SCOPED_CASE = re.compile(r"^([a-z]+)\[([PR]/[PR])\]$")


def factor_case_parts(case: str) -> tuple[str, str]:
    """(module, case) of a normalized factor case: ('', 'P/P') or ('attention', 'R/P')."""
    m = _SCOPED_CASE.match(case)
    return (m.group(1), m.group(2)) if m else ("", case)


def factor_scope(case: str, cases: Mapping[str, str]) -> str:
    """The one module at `case` while the others are not, else "" (a factor cell's scope)."""
    at = [m for m, c in cases.items() if c == case]
    return at[0] if len(at) == 1 and len(cases) > 1 else ""
