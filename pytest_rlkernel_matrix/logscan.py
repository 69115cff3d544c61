"""Read a cell's `run.log`: vime metric records, RL-Kernel route lines, errors, contamination.

One pass over the file, line by line (logs of real runs are large). Metric dicts are parsed with
`ast.literal_eval`, never `eval`.
"""

from __future__ import annotations

import ast
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

_RECORD_RE = re.compile(r"\b(rollout|step|perf|eval)\s+(\d+):\s+(\{.*\})\s*$")
_KV_RE = re.compile(r"(\w+)=(\S+)")
_ROUTE_TAG = "[RL-Kernel][route]"
_UNSUPPORTED_TAG = "[RL-Kernel][unsupported]"
_CONTAMINATION_TAG = "[RL-Kernel][contamination]"
_CONTRACT_RE = re.compile(r"contract_id=(\S+)")

# (label, pattern): each label is counted once per log with its first matching line kept.
ERROR_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("oom", re.compile(r"out of memory|OutOfMemoryError|hipErrorOutOfMemory", re.IGNORECASE)),
    ("cuda_error", re.compile(r"CUDA error|cudaError|CUBLAS_STATUS|CUDNN_STATUS")),
    ("hip_error", re.compile(r"HIP error|hipError(?!OutOfMemory)")),
    ("nccl_error", re.compile(r"NCCL error|nccl\w*Error|NCCL WARN.*(?:fail|error)", re.IGNORECASE)),
    ("rccl_error", re.compile(r"RCCL error|RCCL WARN.*(?:fail|error)", re.IGNORECASE)),
    ("http_error", re.compile(
        r"HTTPError|HTTP/\d(?:\.\d)? [45]\d\d|status[ _]code[=: ]+[45]\d\d|ConnectionRefusedError"
    )),
    ("build_failure", re.compile(
        r"(?:ImportError|ModuleNotFoundError|OSError).*rl_engine|undefined symbol|"
        r"extension (?:is )?unavailable|failed to build", re.IGNORECASE
    )),
)
CONTAMINATION_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("profiler", re.compile(r"torch\.profiler|nsys profile|Nsight Systems|ProfilerActivity")),
    ("first_compile", re.compile(r"torch\._dynamo|Compiling (?:a )?graph|cudagraph capture",
                                 re.IGNORECASE)),
)

PHASE_KEYS: dict[str, tuple[str, ...]] = {
    "rollout_wall_time": ("perf/rollout_time",),
    "training_wall_time": ("perf/train_time", "perf/actor_train_time"),
    "weight_sync_wall_time": ("perf/update_weights_time",),
    "step_wall_time": ("perf/step_time",),
    "tokens_per_second": (
        "perf/tokens_per_sec", "perf/actor_train_tok_per_s", "perf/tokens_per_gpu_per_sec",
    ),
    "peak_memory": ("perf/peak_memory_bytes", "perf/max_memory_allocated_bytes"),
}


@dataclass
class LogScan:
    """Everything `run.log` says about a run."""

    present: bool = False
    records: dict[str, list[tuple[int, dict[str, object]]]] = field(default_factory=dict)
    routes: list[dict[str, str]] = field(default_factory=list)
    unsupported: list[dict[str, str]] = field(default_factory=list)
    contamination: dict[str, str] = field(default_factory=dict)
    contract_ids: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    traceback: str | None = None
    fallback_lines: list[str] = field(default_factory=list)
    lines: int = 0
    unparsed_records: int = 0

    def phase_series(self) -> dict[str, list[float]]:
        """Per phase, the value of each `perf` record that has it, in step order."""
        out: dict[str, list[float]] = {}
        perf = sorted(self.records.get("perf", []), key=lambda r: r[0])
        for name, keys in PHASE_KEYS.items():
            # The first key (in priority order) that any record carries; never a mix of keys.
            for key in keys:
                values = [
                    float(v) for _, rec in perf
                    if isinstance(v := rec.get(key), (int, float)) and not isinstance(v, bool)
                ]
                if values:
                    out[name] = values
                    break
        return out

    def phases(self, warmup: int = 0) -> tuple[dict[str, float | None], dict[str, object]]:
        """Median per phase over the measured steps (the first `warmup` dropped) + spread."""
        series = self.phase_series()
        medians: dict[str, float | None] = dict.fromkeys(PHASE_KEYS)
        spread: dict[str, object] = {}
        for name, values in series.items():
            measured = values[warmup:] if len(values) > warmup else values
            if name == "peak_memory":
                medians[name] = max(values)
                continue
            medians[name] = med = statistics.median(measured)
            spread[name] = {
                "n": len(measured), "min": min(measured), "max": max(measured),
                "relative_spread": (max(measured) - min(measured)) / med if med > 0 else None,
                "warmup_dropped": len(values) - len(measured),
                "steps": measured,  # every measured step, for intervals (stats.py)
            }
        return medians, spread


def _kv(text: str) -> dict[str, str]:
    return dict(_KV_RE.findall(text))


def scan_log(path: Path, max_tail: int = 40) -> LogScan:
    """Scan `run.log`; a missing file gives `present=False`, never an exception."""
    scan = LogScan()
    try:
        handle = path.open("r", encoding="utf-8", errors="replace")
    except OSError:
        return scan
    scan.present = True
    tb: list[str] | None = None
    with handle:
        for raw in handle:
            line = raw.rstrip("\n")
            scan.lines += 1
            if tb is not None:
                tb.append(line)
                if line and not line.startswith((" ", "\t")) and not line.startswith("Traceback"):
                    scan.traceback = "\n".join(tb[-max_tail:])
                    tb = None
            if line.startswith("Traceback (most recent call last)"):
                tb = [line]
            m = _RECORD_RE.search(line)
            if m:
                try:
                    value = ast.literal_eval(m.group(3))
                except (ValueError, SyntaxError, MemoryError, RecursionError):
                    scan.unparsed_records += 1
                else:
                    if isinstance(value, dict):
                        scan.records.setdefault(m.group(1), []).append((int(m.group(2)), value))
            if _ROUTE_TAG in line:
                route = _kv(line.split(_ROUTE_TAG, 1)[1])
                scan.routes.append(route)
            if _UNSUPPORTED_TAG in line:
                rest = line.split(_UNSUPPORTED_TAG, 1)[1]
                entry = _kv(rest)
                reason = rest.split("reason=", 1)[1].strip() if "reason=" in rest else rest.strip()
                entry["reason"] = reason
                scan.unsupported.append(entry)
            if _CONTAMINATION_TAG in line:
                for key, value in _kv(line.split(_CONTAMINATION_TAG, 1)[1]).items():
                    if value not in ("0", "false", "False"):
                        scan.contamination[key] = line.strip()
            if "fallback=true" in line.lower() or "fallback=1" in line:
                scan.fallback_lines.append(line.strip()[:500])
            for cid in _CONTRACT_RE.findall(line):
                if cid not in scan.contract_ids:
                    scan.contract_ids.append(cid)
            for label, pattern in ERROR_PATTERNS:
                if label not in scan.errors and pattern.search(line):
                    scan.errors[label] = line.strip()[:500]
            for label, pattern in CONTAMINATION_PATTERNS:
                if label not in scan.contamination and pattern.search(line):
                    scan.contamination[label] = line.strip()[:500]
    if tb is not None:
        scan.traceback = "\n".join(tb[-max_tail:])
    return scan
