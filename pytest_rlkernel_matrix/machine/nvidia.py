"""NVIDIA parsers: `nvidia-smi -L`, `nvidia-smi --query-gpu` and `nvidia-smi topo -m` text.

Pure functions over captured text (no subprocess here: `machine.preflight` runs the tools).
"""

from __future__ import annotations

import re
from typing import Any

from pytest_rlkernel_matrix.machine.text import _ANSI, _snake

_TOPO_DEVICE = re.compile(r"^(GPU\d+|NIC\d+|mlx\S+|CPU\d+)$")


def parse_nvidia_smi_L(text: str) -> list[dict[str, Any]]:
    """Parse ``nvidia-smi -L`` into ``[{index, name, uuid, mig: [...]}]``."""
    gpus: list[dict[str, Any]] = []
    gpu_re = re.compile(r"^\s*GPU\s+(\d+)\s*:\s*(.*?)\s*(?:\(\s*UUID\s*:\s*([^)\s]+)\s*\))?\s*$")
    mig_re = re.compile(r"^\s*MIG\s+(.*?)\s+Device\s+(\d+)\s*:\s*\(\s*UUID\s*:\s*([^)\s]+)\s*\)")
    for line in _ANSI.sub("", text).splitlines():
        if m := gpu_re.match(line):
            gpus.append({"index": int(m[1]), "name": m[2], "uuid": m[3], "mig": []})
        elif (m := mig_re.match(line)) and gpus:
            gpus[-1]["mig"].append({"profile": m[1].strip(), "index": int(m[2]), "uuid": m[3]})
    return gpus


def parse_nvidia_query(text: str) -> list[dict[str, Any]]:
    """Parse ``--query-gpu=name,memory.total,driver_version --format=csv,noheader``."""
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or parts[0].lower() == "name":
            continue
        mem = re.match(r"(\d+)\s*MiB", parts[1])
        rows.append(
            {
                "name": parts[0],
                "memory_total": parts[1],
                "memory_total_mib": int(mem[1]) if mem else None,
                "driver_version": parts[2],
            }
        )
    return rows


def _split_cells(line: str) -> list[str]:
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    return [c.strip() for c in re.split(r"\s{2,}", line)]


def parse_topo(text: str) -> dict[str, Any]:
    """Parse ``nvidia-smi topo -m``: device columns, per-row links/affinities, legends."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header: list[str] = []
    rows: list[dict[str, Any]] = []
    legend: dict[str, str] = {}
    nics: dict[str, str] = {}
    section = "matrix"
    device_re = _TOPO_DEVICE
    for line in lines:
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.lower().startswith("nic legend"):
            section = "nics"
            continue
        if stripped.lower().startswith("legend"):
            section = "legend"
            continue
        if section == "legend":
            if m := re.match(r"^(\S+)\s*=\s*(.+)$", stripped):
                legend[m[1]] = m[2].strip()
            continue
        if section == "nics":
            if m := re.match(r"^(\S+)\s*:\s*(\S+)", stripped):
                nics[m[1]] = m[2]
            continue
        cells = _split_cells(line)
        if not header and (line[:1].isspace() or cells[0] == "") and "GPU0" in stripped:
            header = [c for c in cells if c]
            continue
        if header and cells and device_re.match(cells[0]):
            rows.append(_topo_row(header, cells))
    devices = [c for c in header if device_re.match(c)]
    return {
        "columns": header,
        "devices": devices,
        "gpus": [d for d in devices if d.startswith("GPU")],
        "rows": rows,
        "legend": legend,
        "nics": nics,
    }


def _topo_row(header: list[str], cells: list[str]) -> dict[str, Any]:
    """One matrix row; extra empty cells in the affinity columns (double tabs) are dropped."""
    n_dev = sum(1 for c in header if _TOPO_DEVICE.match(c))
    row: dict[str, Any] = {
        "name": cells[0],
        "links": dict(zip(header[:n_dev], cells[1:], strict=False)),
    }
    rest_cols, rest = header[n_dev:], cells[1 + n_dev :]
    if len(rest) != len(rest_cols):
        rest = [c for c in rest if c]
    for col, value in zip(rest_cols, rest, strict=False):
        row[_snake(col)] = value or None
    for col in rest_cols[len(rest) :]:
        row[_snake(col)] = None
    return row
