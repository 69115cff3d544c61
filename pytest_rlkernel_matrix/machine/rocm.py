"""ROCm parsers: `rocminfo` and `rocm-smi` text, and the preflight's `rocm` section.

gfx archs are only ever taken from what the runtime reports, never inferred from a product
name. Pure functions over captured text (`machine.preflight` runs the tools).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from pytest_rlkernel_matrix.machine.text import _ANSI, _snake

_GFX = re.compile(r"\b(gfx[0-9a-f]{3,4})\b", re.IGNORECASE)


_KV = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 _().#/-]*?)\s*:\s*(.*?)\s*$")


def parse_rocminfo(text: str) -> dict[str, Any]:
    """Parse ``rocminfo`` into runtime versions and agents ``[{name, marketing_name, ...}]``."""
    result: dict[str, Any] = {"runtime_version": None, "rock_module_version": None, "agents": []}
    if m := re.search(r"ROCk module(?: version)?\s+(\S+)\s+is loaded", text):
        result["rock_module_version"] = m[1]
    blocks: list[list[str]] = []
    preamble: list[str] = []
    for line in _ANSI.sub("", text).splitlines():
        if re.match(r"^\s*Agent\s+\d+\s*$", line):
            blocks.append([])
        elif blocks:
            blocks[-1].append(line)
        else:
            preamble.append(line)
    for line in preamble:
        if (m := _KV.match(line)) and m[1] == "Runtime Version":
            result["runtime_version"] = m[2]
    for number, block in enumerate(blocks, start=1):
        fields: dict[str, str] = {}
        isa: list[str] = []
        in_isa = False
        for line in block:
            m = _KV.match(line)
            if not m:
                continue
            key, value = m[1].strip(), m[2].strip()
            if key == "ISA Info":
                in_isa = True
                continue
            if in_isa and key == "Name":
                isa.append(value)
                continue
            fields.setdefault(key, value)
        result["agents"].append(_agent(number, fields, isa))
    return result


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    m = re.match(r"\s*(\d+)", value)
    return int(m[1]) if m else None


def _agent(number: int, fields: Mapping[str, str], isa: list[str]) -> dict[str, Any]:
    name = fields.get("Name", "")
    gfx = name if re.fullmatch(r"gfx[0-9a-f]+", name) else None
    if gfx is None:
        for entry in isa:
            if m := _GFX.search(entry):
                gfx = m[1].lower()
                break
    device_type = fields.get("Device Type") or None
    return {
        "agent": number,
        "name": name or None,
        "marketing_name": fields.get("Marketing Name") or None,
        "vendor_name": fields.get("Vendor Name") or None,
        "device_type": device_type.upper() if device_type else None,
        "compute_units": _int_or_none(fields.get("Compute Unit")),
        "uuid": fields.get("Uuid") or None,
        "node": _int_or_none(fields.get("Node")),
        "chip_id": fields.get("Chip ID") or None,
        "gfx_arch": gfx if device_type and device_type.upper() == "GPU" else None,
        "isa": isa,
    }


def parse_rocm_smi(text: str) -> dict[str, Any]:
    """Parse ``rocm-smi`` (concise table) and its ``GPU[i] : key: value`` info form."""
    devices: dict[int, dict[str, Any]] = {}
    driver: str | None = None
    header: list[tuple[str, int]] = []
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    kv_re = re.compile(r"^\s*(?:GPU|card)\[?(\d+)\]?\s*:\s*([^:]+?)\s*:\s*(.*?)\s*$")
    for line in lines:
        stripped = line.strip()
        if not stripped or set(stripped) <= {"=", "-", "+", "|", " "}:
            continue
        if m := re.match(r"^\s*Driver version\s*:\s*(.+?)\s*$", line, re.IGNORECASE):
            driver = m[1]
            continue
        if m := kv_re.match(line):
            devices.setdefault(int(m[1]), {"index": int(m[1])})[_snake(m[2])] = m[3]
            continue
        if re.match(r"^\s*(Device|GPU)\s{2,}", line) and not header:
            header = _table_header(line)
            continue
        if header and re.match(r"^\s*\d+\s", line):
            row = _table_row(line, header)
            index = _int_or_none(row.pop(header[0][0], None))
            if index is not None:
                devices.setdefault(index, {"index": index}).update(row)
    for dev in devices.values():
        dev.setdefault("vram_total_bytes", _int_or_none(dev.get("vram_total_memory_b")))
        dev.setdefault("product", dev.get("card_series") or dev.get("card_model"))
        gfx = dev.get("gfx_version")
        dev["gfx_arch"] = gfx.lower() if isinstance(gfx, str) and _GFX.fullmatch(gfx) else None
    ordered = [devices[k] for k in sorted(devices)]
    if driver is None:
        driver = next((d["driver_version"] for d in ordered if d.get("driver_version")), None)
    return {"driver": driver, "devices": ordered}


def _table_header(line: str) -> list[tuple[str, int]]:
    """Column names (``VRAM%`` -> ``vram_pct``) with their start offsets."""
    cols = re.finditer(r"\S+(?: \(\S+\))?", line)
    return [(_snake(m.group(0).replace("%", " pct")), m.start()) for m in cols]


def _table_row(line: str, header: list[tuple[str, int]]) -> dict[str, str]:
    """Slice a table row by header offsets; falls back to whitespace tokens if misaligned."""
    row: dict[str, str] = {}
    aligned = all(start == 0 or line[start - 1 : start] in (" ", "") for _, start in header[1:])
    if aligned:
        for n, (name, start) in enumerate(header):
            end = header[n + 1][1] if n + 1 < len(header) else len(line)
            row[name] = line[start:end].strip()
        return row
    tokens = line.split()
    for (name, _), token in zip(header, tokens, strict=False):
        row[name] = token
    return row


def _arch_base(arch: str) -> str:
    return arch.split(":", 1)[0].strip().lower()


def _split_archs(value: str) -> list[str]:
    return [_arch_base(a) for a in re.split(r"[;,\s]+", value) if a.strip()]


def build_rocm_section(
    rocminfo: Mapping[str, Any] | None,
    smi: Mapping[str, Any] | None,
    torch_devices: Iterable[Mapping[str, Any]],
    pytorch_rocm_arch: str | None,
    ext_offload_archs: Iterable[str] = (),
) -> dict[str, Any]:
    """ROCm facts plus build-vs-runtime gfx arch mismatches (reported, never papered over)."""
    agents = list((rocminfo or {}).get("agents", []))
    gpu_agents = [a for a in agents if a.get("device_type") == "GPU"]
    runtime = {a["gfx_arch"] for a in gpu_agents if a.get("gfx_arch")}
    smi_devices = list((smi or {}).get("devices", []))
    runtime |= {d["gfx_arch"] for d in smi_devices if d.get("gfx_arch")}
    runtime |= {_arch_base(d["gcnArchName"]) for d in torch_devices if d.get("gcnArchName")}
    archs = sorted(runtime)
    build = _split_archs(pytorch_rocm_arch) if pytorch_rocm_arch else None
    ext = sorted(set(ext_offload_archs))
    return {
        "available": bool(gpu_agents or smi_devices),
        "runtime_version": (rocminfo or {}).get("runtime_version"),
        "rock_module_version": (rocminfo or {}).get("rock_module_version"),
        "agents": agents,
        "gpu_agents": len(gpu_agents),
        "smi": dict(smi) if smi else None,
        "driver": (smi or {}).get("driver") or (rocminfo or {}).get("rock_module_version"),
        "runtime_gfx_archs": archs,
        "pytorch_rocm_arch": pytorch_rocm_arch,
        "build_arch_mismatch": (
            [a for a in archs if a not in build] if build is not None and archs else None
        ),
        "ext_offload_archs": ext,
        "ext_arch_mismatch": [a for a in archs if a not in ext] if ext and archs else None,
    }
