"""pytest-xdist: workers run cells; the controller alone writes preflight.json and the report.

Workers must share the controller's matrix root, session token and hardware (a worker computing
its own UTC stamp would scatter a matrix over several roots), so they travel in `workerinput`.

On GPU profiles each worker owns a disjoint device set of `gpus_per_cell` devices (default
tp*cp*pp): worker `gwN` gets visible devices `[N*k, (N+1)*k)`, handed to its cells as
`CUDA_VISIBLE_DEVICES` (NVIDIA) or `HIP_VISIBLE_DEVICES` (ROCm; only that one: setting
`ROCR_VISIBLE_DEVICES` to the same indices as well would index twice). `-n auto` starts
`floor(visible GPUs / gpus_per_cell)` workers. A cell whose run window overlapped another
cell's on a shared device is marked performance-contaminated (`mark_overlaps`).

Workers own CPU sets the same way (`cpushare`): worker slot N of W gets slice N of the session's
CPU affinity mask, which its local cells run on with `OMP_NUM_THREADS` / `MKL_NUM_THREADS` set to
the slice's size (unless the user set them). A worker that replaces a crashed one takes over the
slot (CPU and GPU set) its predecessor left.
Without xdist nothing here runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import pytest

from pytest_rlkernel_matrix.cpushare import session_cpus
from pytest_rlkernel_matrix.session import MatrixSession

DEVICE_VARS = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}


def device_env(backend: str, devices: Sequence[str]) -> dict[str, str]:
    """The visibility variable a cell of `backend` gets for its device set."""
    var = DEVICE_VARS.get(backend)
    return {var: ",".join(devices)} if var else {}


def visible_devices(backend: str, env: Mapping[str, str], count: int) -> list[str]:
    """Device ids this process may hand out: the visibility variable if set, else 0..count-1."""
    for var in ((DEVICE_VARS[backend], "ROCR_VISIBLE_DEVICES") if backend == "rocm"
                else (DEVICE_VARS.get(backend, ""),)):
        raw = env.get(var, "") if var else ""
        if raw.strip():
            return [d.strip() for d in raw.split(",") if d.strip()]
    return [str(i) for i in range(count)]


def devices_for_worker(devices: Sequence[str], per_cell: int, index: int) -> list[str]:
    """Worker `index`'s disjoint slice; an error when the machine has too few devices."""
    chosen = list(devices[index * per_cell:(index + 1) * per_cell])
    if len(chosen) < per_cell:
        raise pytest.UsageError(
            f"xdist worker gw{index} needs {per_cell} GPU(s) per cell (gpus_per_cell / "
            f"tp*cp*pp), but only {len(devices)} are visible ({','.join(devices) or 'none'}): "
            f"run at most {len(devices) // per_cell} workers (-n auto does this)")
    return chosen


def auto_workers(visible: int, per_cell: int) -> int:
    """`-n auto` on a GPU machine: as many cells at once as disjoint device sets fit."""
    return max(1, visible // max(1, per_cell))


def _gpu_count(backend: str) -> int:
    """Visible GPUs without importing torch: the visibility variable, else the vendor tool."""
    listed = visible_devices(backend, os.environ, 0)
    if listed:
        return len(listed)
    tool = {"cuda": ["nvidia-smi", "-L"], "rocm": ["rocm-smi", "--showid"]}.get(backend)
    if not tool or shutil.which(tool[0]) is None:
        return 0
    try:
        out = subprocess.run(tool, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    if backend == "cuda":
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    return len({line.split()[0] for line in out.splitlines() if line.startswith("GPU[")})


def auto_num_workers(config: pytest.Config) -> int | None:
    """`pytest_xdist_auto_num_workers`: None (xdist's CPU count) unless a GPU profile runs."""
    from pytest_rlkernel_matrix.plugin import _in_play, _matrix_path

    path, explicit = _matrix_path(config)
    if not path.exists() or not (explicit or _in_play(config, path)):
        return None
    from pytest_rlkernel_matrix.matrix import MatrixFileError, load_matrix

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


def mark_overlaps(records: MutableMapping[str, dict[str, Any]]) -> None:
    """Performance-contaminate every pair of cells whose run windows overlapped on a device.

    Records sharing a run (same run_key) are one process, not an overlap."""
    runs: dict[str, dict[str, Any]] = {}
    for rec in records.values():
        if rec.get("devices") and rec.get("window") and None not in rec["window"]:
            runs.setdefault(str(rec.get("run_key")), rec)
    hits: dict[str, list[str]] = {}
    items = sorted(runs.items())
    for i, (key_a, a) in enumerate(items):
        for key_b, b in items[i + 1:]:
            shared = sorted(set(a["devices"]) & set(b["devices"]))
            if shared and a["window"][0] < b["window"][1] and b["window"][0] < a["window"][1]:
                hits.setdefault(key_a, []).append(f"{b.get('run_key')} on device(s) {shared}")
                hits.setdefault(key_b, []).append(f"{a.get('run_key')} on device(s) {shared}")
    for rec in records.values():
        for other in hits.get(str(rec.get("run_key")), []):
            reason = f"contaminated: overlapped cell {other}"
            perf = rec.setdefault("validity", {}).setdefault("performance", {})
            if reason not in perf.setdefault("reasons", []):
                perf["reasons"].append(reason)
            perf["valid"] = False
            rec["performance_usable"] = False


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
