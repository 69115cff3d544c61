"""Small helpers shared by the pytester-based tests (importable: tests/ is on sys.path)."""

from __future__ import annotations

import pytest


def outcomes(result: pytest.RunResult) -> dict[str, int]:
    """Summary-line counts without `deselected`/`warnings`; pytest's 'errors' read as 'error'.

    (A fresh editable install can add a harmless PytestAssertRewriteWarning to inner sessions.)
    """
    out = result.parseoutcomes()
    out.pop("deselected", None)
    out.pop("warnings", None)
    if "errors" in out:
        out["error"] = out.pop("errors")
    return out
