"""Hook specifications this plugin adds (implement them in a conftest.py or plugin)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.hookspec
def pytest_rlk_cell_env(config: pytest.Config, cell: Any, env: dict[str, str]) -> None:
    """Adjust the environment of one cell's process before it starts (runs where the cell runs).

    ``cell`` is a `pytest_rlkernel_matrix.spec.cells.Cell`; mutate ``env`` in place. Values you
    add are recorded in ``matrix-case.env`` (secret-looking names redacted).
    """


@pytest.hookspec
def pytest_rlk_cell_record(config: pytest.Config, record: dict[str, Any]) -> None:
    """Called on the controller (never on an xdist worker) when one cell's record arrives.

    ``record`` is the cell's entry of ``matrix-report.json``; treat it as read-only.
    """
