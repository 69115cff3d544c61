"""One matrix session as a pipeline: `plan` (a cell's directory, run id, environment, command,
CPU share or devices: pure values) -> `runner` (launch, wait, interrupt, sweep processes) ->
the judge (`report.record.analyze_run`, through `recorder`) -> `recorder` (cell-run.json, the
record, crash recovery, the report); `scheduler` (repeat, profile/probe, measured and auto runs)
sits beside the runner; `coordinator.MatrixSession` wires them for the pytest face.

May import: `store`, `spec`, `machine`, `run`, `judge`, `report`; never the pytest face
(`plugin`, `collect`, `integrations`, `cli`). Inside: plan < runner < recorder < scheduler <
coordinator (each imports only the ones before it).
"""

from pytest_rlkernel_matrix.session.coordinator import MatrixSession
from pytest_rlkernel_matrix.session.plan import default_root, utc_stamp
from pytest_rlkernel_matrix.session.recorder import PREFLIGHT_FILE, RECORD_CACHE

__all__ = ["PREFLIGHT_FILE", "RECORD_CACHE", "MatrixSession", "default_root", "utc_stamp"]
