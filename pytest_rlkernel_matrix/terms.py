"""The matrix vocabulary, importable without pydantic, numpy or torch."""

from __future__ import annotations

MODULES: tuple[str, ...] = ("attention", "ffn", "logp")
CASES: tuple[str, ...] = ("R/R", "P/R", "R/P", "P/P")
MODES: tuple[str, ...] = ("strict", "audit", "auto", "off")
LAYOUTS: tuple[str, ...] = ("pairwise", "reduced", "module-factorial", "full")
VERDICTS: tuple[str, ...] = (
    "valid", "unsupported", "fallback", "contract_mismatch", "incomparable", "error",
)
