"""pytest-xdist: workers run cells; the controller alone writes preflight.json and the report.

Workers must share the controller's matrix root, session token and hardware (a worker computing
its own UTC stamp would scatter a matrix over several roots), so they travel in `workerinput`.
"""

from __future__ import annotations

from typing import Any

from pytest_rlkernel_matrix.session import MatrixSession


class XdistIntegration:
    """Registered on the controller when xdist is active."""

    def __init__(self, session: MatrixSession) -> None:
        self.session = session

    def pytest_configure_node(self, node: Any) -> None:
        ms = self.session
        node.workerinput["rlk"] = {
            "root": str(ms.root),
            "token": ms.token,
            "hardware": list(ms.hardware),
            "created": ms.created,
            "fingerprints": dict(ms.fingerprints),
        }

    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        """The controller collects nothing itself: count the cells a worker selected."""
        self.session.expected_cells = max(self.session.expected_cells,
                                          sum(1 for i in ids if "::" in i and "[" in i))
