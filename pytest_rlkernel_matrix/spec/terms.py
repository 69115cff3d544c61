"""The matrix vocabulary, importable without pydantic, numpy or torch."""

from __future__ import annotations

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
