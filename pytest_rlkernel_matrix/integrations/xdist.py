"""pytest-xdist: workers run cells; the controller alone writes preflight.json and the report.

Workers must share the controller's matrix root, session token and hardware (a worker computing
its own UTC stamp would scatter a matrix over several roots), so they travel in `workerinput`.

On GPU profiles each worker owns a disjoint device set of `gpus_per_cell` devices (default
tp*cp*pp; `run.devices` computes the sets and marks overlapping cells), and `-n auto` starts
`floor(visible GPUs / gpus_per_cell)` workers. This glue is told what it needs (the session, the
matrix file the plugin collects) and never imports the plugin; the session never imports it.

Workers own CPU sets the same way (`run.cpushare`): worker slot N of W gets slice N of the
session's CPU affinity mask, which its local cells run on with `OMP_NUM_THREADS` /
`MKL_NUM_THREADS` set to the slice's size (unless the user set them). A worker that replaces a
crashed one takes over the slot (CPU and GPU set) its predecessor left.
Without xdist nothing here runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_rlkernel_matrix.run.cpushare import session_cpus
from pytest_rlkernel_matrix.run.devices import (
    _gpu_count,
    auto_workers,
    devices_for_worker,
    visible_devices,
)

if TYPE_CHECKING:
    from pytest_rlkernel_matrix.session import MatrixSession


def auto_num_workers(config: pytest.Config, path: Path) -> int | None:
    """`pytest_xdist_auto_num_workers` for the matrix file `path` this session collects (the
    plugin decides that): None (xdist's CPU count) unless a GPU profile runs."""
    from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

    try:
        matrix = load_matrix(path)
    except MatrixFileError:
        return None  # pytest_configure reports it
    asked = config.getoption("rlk_hardware")
    names = [n.strip() for n in asked.split(",")] if asked else list(matrix.hardware)
    for backend in ("cuda", "rocm"):
        profiles = [matrix.hardware[n] for n in names
                    if n in matrix.hardware and matrix.hardware[n].backend == backend]
        count = _gpu_count(backend) if profiles else 0
        if count:
            return auto_workers(count, max(p.topology.devices_per_cell for p in profiles))
    return None


class XdistIntegration:
    """Registered on the controller when xdist is active."""

    def __init__(self, session: MatrixSession) -> None:
        self.session = session
        self.slots: dict[str, int] = {}  # worker id -> its slot (CPU slice and GPU set)
        self.cpus = session_cpus()

    def _slot(self, worker: str, count: int) -> int:
        """`gwN` takes slot N; a replacement worker (a new id) the lowest slot left free."""
        wanted = int(worker.removeprefix("gw")) if worker.removeprefix("gw").isdigit() else -1
        taken = set(self.slots.values())
        if not 0 <= wanted < count or wanted in taken:
            wanted = next(i for i in range(count + len(taken) + 1) if i not in taken)
        self.slots[worker] = wanted
        return wanted

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        self.slots.pop(str(getattr(node.gateway, "id", "")), None)

    def _device_plan(self) -> tuple[list[str], int] | None:
        ms = self.session
        gpu = [ms.matrix.hardware[h] for h in ms.hardware
               if ms.matrix.hardware[h].backend != "cpu"]
        if not gpu:
            return None
        backend = gpu[0].backend
        count = int((ms.preflight.get("gpu") or {}).get("count") or 0)
        devices = visible_devices(backend, os.environ, count)
        return devices, max(p.topology.devices_per_cell for p in gpu)

    def pytest_configure_node(self, node: Any) -> None:
        ms = self.session
        shared: dict[str, Any] = {
            "root": str(ms.root),
            "token": ms.token,
            "hardware": list(ms.hardware),
            "created": ms.created,
            "started": ms.started,  # the budget of --rlk-processes=auto runs from here
            "fingerprints": dict(ms.fingerprints),
            "devices": None,
            "worker": getattr(node.gateway, "id", None),
        }
        count = int(node.workerinput.get("workercount") or 1)
        index = self._slot(str(shared["worker"] or "gw0"), count)
        shared["cpu_slot"] = {"index": index, "count": count, "cpus": self.cpus}
        plan = None if ms.plan else self._device_plan()
        if plan is not None:
            devices, per_cell = plan
            shared["devices"] = devices_for_worker(devices, per_cell, index)
        node.workerinput["rlk"] = shared

    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        """The controller collects nothing itself: count the cells a worker selected."""
        self.session.expected_cells = max(self.session.expected_cells,
                                          sum(1 for i in ids if "::" in i and "[" in i))
