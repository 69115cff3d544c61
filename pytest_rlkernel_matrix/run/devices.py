"""Device sets: which GPUs a cell may use, and cells that shared one at the same time.

Each xdist worker owns a disjoint device set of `gpus_per_cell` devices (worker `gwN` gets
visible devices `[N*k, (N+1)*k)`), handed to its cells as `CUDA_VISIBLE_DEVICES` (NVIDIA) or
`HIP_VISIBLE_DEVICES` (ROCm; only that one: setting `ROCR_VISIBLE_DEVICES` to the same indices
as well would index twice). A cell whose run window overlapped another cell's on a shared
device is marked performance-contaminated (`mark_overlaps`). Nothing here imports xdist.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import pytest

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
