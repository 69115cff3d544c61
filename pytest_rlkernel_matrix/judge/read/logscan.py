"""Read a cell's `run.log`: vime metric records, RL-Kernel route lines, errors, contamination.

One pass over the file, line by line (logs of real runs are large), in time linear in its size:
lines are read in binary chunks and capped at `MAX_LINE_BYTES` (the rest of an over-long line is
skipped and counted), every pattern is tried once per line with no `.*` that could rescan the line
from each start position, and a metric record is parsed at most once per line. Metric dicts are
parsed with `ast.literal_eval`, never `eval`. Only a regular file inside the cell directory is read.
"""

from __future__ import annotations

import ast
import math
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from pytest_rlkernel_matrix.judge.read.fallback import fallback_in_text
from pytest_rlkernel_matrix.store.safeio import MAX_LOG_BYTES, Refused, open_regular

MAX_LINE_BYTES = 256 * 1024
MAX_KEPT = 200  # route / unsupported / fallback lines kept (the rest counted)
_CHUNK = 1 << 20
# The record prefix only: the dict is the rest of the line (one literal_eval per line at most).
# The old pattern `(\{.*\})\s*$` with `search` rescanned the line from every prefix: quadratic.
_RECORD_RE = re.compile(r"\b(rollout|step|perf|eval)[ \t]+(\d+):[ \t]+\{")
_KV_RE = re.compile(r"(\w+)=(\S+)")
_ROUTE_TAG = "[RL-Kernel][route]"
_UNSUPPORTED_TAG = "[RL-Kernel][unsupported]"
_CONTAMINATION_TAG = "[RL-Kernel][contamination]"
_CONTRACT_RE = re.compile(r"contract_id=(\S+)")
# vime's evidence that native Megatron logp ran (it writes no readback record for it).
LOGP_MARKERS = ("linear_logp native active:", "rlkernel mismatch sidecar active: logp_case=")


# Python prints a non-finite float as `nan` / `inf` (`-inf`), a name `literal_eval` refuses:
# such a record is read with its value (then refused where it is judged, with a reason), never
# dropped as unparsed while the rest of the run's timings count.
_NONFINITE = {"nan": math.nan, "NaN": math.nan, "inf": math.inf, "Infinity": math.inf,
              "infinity": math.inf}


class _Names(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _NONFINITE:
            return ast.copy_location(ast.Constant(_NONFINITE[node.id]), node)
        return node


def literal(text: str) -> object:
    """`ast.literal_eval(text)`, with Python's `nan` / `inf` spellings read as floats; a record
    that names one of its keys twice is a `ValueError` (Python keeps the last value: a `nan`
    before a good one would be hidden)."""
    tree = ast.parse(text.lstrip(" \t"), mode="eval")
    body = tree.body
    if isinstance(body, ast.Dict):  # (the record's own keys: where its figures are)
        keys = [k.value for k in body.keys if isinstance(k, ast.Constant)]
        if len(keys) != len(set(keys)):
            raise ValueError("a key named twice in one record")
    try:
        return ast.literal_eval(tree)
    except ValueError:
        if not any(name in text for name in _NONFINITE):
            raise
    return ast.literal_eval(_Names().visit(tree))


@dataclass(frozen=True)
class Pattern:
    """`first` anywhere in a line and, if given, `then` somewhere after it.

    Two searches instead of `first.*then`: a `.*` under `search` restarts at every occurrence of
    `first` and rescans the rest of the line, which is quadratic on a long line.
    """

    first: re.Pattern[str]
    then: re.Pattern[str] | None = None

    def search(self, line: str) -> bool:
        m = self.first.search(line)
        if m is None:
            return False
        return self.then is None or self.then.search(line, m.end()) is not None


def _p(first: str, then: str | None = None, flags: int = 0) -> Pattern:
    return Pattern(re.compile(first, flags), None if then is None else re.compile(then, flags))


# (label, pattern): each label is counted once per log with its first matching line kept.
ERROR_PATTERNS: tuple[tuple[str, Pattern], ...] = (
    ("oom", _p(r"out of memory|OutOfMemoryError|hipErrorOutOfMemory", flags=re.IGNORECASE)),
    ("cuda_error", _p(r"CUDA error|cudaError|CUBLAS_STATUS|CUDNN_STATUS")),
    ("hip_error", _p(r"HIP error|hipError(?!OutOfMemory)")),
    ("nccl_error", _p(r"NCCL error|nccl(?:Internal|System|UnhandledCuda|Remote|InvalidUsage|"
                      r"InvalidArgument)Error|Watchdog caught collective operation timeout",
                      flags=re.IGNORECASE)),
    ("rccl_error", _p(r"RCCL error", flags=re.IGNORECASE)),
    ("nccl_warning", _p(r"[NR]CCL WARN", r"fail|error", flags=re.IGNORECASE)),
    ("http_error", _p(
        r"HTTPError|HTTP/\d(?:\.\d)? [45]\d\d|status[ _]code[=: ]+[45]\d\d|ConnectionRefusedError"
    )),
    ("build_failure", _p(r"ImportError|ModuleNotFoundError|OSError", r"rl_engine")),
    ("build_failure", _p(r"undefined symbol|extension (?:is )?unavailable|failed to build",
                         flags=re.IGNORECASE)),
)
# Labels that make a run an `error` even when it exited 0 and left readbacks (plus tracebacks).
FATAL_ERRORS = ("oom", "cuda_error", "hip_error", "nccl_error", "rccl_error")
CONTAMINATION_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("profiler", re.compile(r"torch\.profiler|nsys profile|Nsight Systems|ProfilerActivity")),
    ("first_compile", re.compile(r"torch\._dynamo|Compiling (?:a )?graph|cudagraph capture",
                                 re.IGNORECASE)),
)



_ERRORISH = re.compile(r"error|exception|fatal|fail|traceback|no such file|not found|denied|"
                       r"abort|killed|usage:", re.IGNORECASE)
TAIL_LINES = 20


def _prefilter() -> re.Pattern[str]:
    """One alternation of every trigger below: a line matching none is skipped after one search
    (3-4x faster than trying each pattern; the full checks run only on candidate lines)."""
    parts = [_RECORD_RE.pattern, re.escape("[RL-Kernel]["), "(?i:fall)", "contract_id=",
             "Traceback", *(re.escape(m) for m in LOGP_MARKERS)]
    for _, pat in ERROR_PATTERNS:
        parts.append(f"(?i:{pat.first.pattern})" if pat.first.flags & re.IGNORECASE
                     else pat.first.pattern)
    for _, cpat in CONTAMINATION_PATTERNS:
        parts.append(f"(?i:{cpat.pattern})" if cpat.flags & re.IGNORECASE else cpat.pattern)
    return re.compile("|".join(f"(?:{x})" for x in parts))


_INTEREST = _prefilter()

PHASE_KEYS: dict[str, tuple[str, ...]] = {
    "rollout_wall_time": ("perf/rollout_time",),
    "training_wall_time": ("perf/train_time", "perf/actor_train_time"),
    "weight_sync_wall_time": ("perf/update_weights_time",),
    "step_wall_time": ("perf/step_time",),
    "tokens_per_second": (
        "perf/tokens_per_sec", "perf/actor_train_tok_per_s", "perf/tokens_per_gpu_per_sec",
    ),
    "peak_memory": ("perf/peak_memory_bytes", "perf/max_memory_allocated_bytes"),
    "debug_wall_time": ("perf/rlk_debug_time",),  # the reference job's debug work (accounting)
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
    logp_markers: list[str] = field(default_factory=list)  # native logp marker lines
    errors: dict[str, str] = field(default_factory=dict)
    traceback: str | None = None
    fallback_lines: list[str] = field(default_factory=list)
    lines: int = 0
    unparsed_records: int = 0
    unparsed_kinds: dict[str, int] = field(default_factory=dict)  # per record kind
    long_lines: int = 0
    dropped_lines: int = 0
    problems: list[str] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)  # the last non-empty lines

    @property
    def last_error(self) -> str | None:
        """The last line of the log's tail that reads like an error, else its last line."""
        for line in reversed(self.tail):
            if _ERRORISH.search(line):
                return line.strip()[:500]
        return self.tail[-1].strip()[:500] if self.tail else None

    @property
    def fatal(self) -> dict[str, str]:
        """Fatal patterns found (OOM, CUDA/HIP, NCCL/RCCL errors, a Python traceback)."""
        out = {k: v for k, v in self.errors.items() if k in FATAL_ERRORS}
        if self.traceback:
            out["traceback"] = self.traceback.strip().splitlines()[-1][:500]
        return out


def _kv(text: str) -> dict[str, str]:
    return dict(_KV_RE.findall(text))


def _lines(handle: BinaryIO, limit: int, scan: LogScan) -> Iterator[str]:
    """Decoded lines, each cut at `limit` bytes (the rest skipped), at most MAX_LOG_BYTES read.

    `readline(limit)` runs in C and never holds more than `limit` bytes of one line.
    """
    total = 0
    readline = handle.readline
    while True:
        raw = readline(limit)
        if not raw:
            return
        total += len(raw)
        if len(raw) == limit and not raw.endswith(b"\n"):
            scan.long_lines += 1
            while True:  # skip the rest of the over-long line
                rest = readline(_CHUNK)
                total += len(rest)
                if not rest or rest.endswith(b"\n"):
                    break
        if total > MAX_LOG_BYTES:
            scan.problems.append(f"run.log: longer than {MAX_LOG_BYTES} bytes: the rest is not "
                                 "scanned")
            return
        yield raw.rstrip(b"\n").decode("utf-8", "replace")


def _keep(items: list[object], value: object, scan: LogScan) -> None:
    if len(items) < MAX_KEPT:
        items.append(value)
    else:
        scan.dropped_lines += 1


def scan_log(path: Path, max_tail: int = 40, *, root: Path | None = None,
             max_line: int = MAX_LINE_BYTES) -> LogScan:
    """Scan `run.log`; a missing file gives `present=False`, a refused one a problem."""
    scan = LogScan()
    if not path.exists() and not path.is_symlink():
        return scan
    try:
        handle, _ = open_regular(path, root or path.parent, MAX_LOG_BYTES)
    except Refused as exc:
        scan.problems.append(str(exc))
        return scan
    scan.present = True
    tb: deque[str] | None = None
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with handle:
        for line in _lines(handle, max_line, scan):
            line = line.rstrip("\r")
            scan.lines += 1
            if line.strip():
                tail.append(line)
            if tb is not None:
                tb.append(line)
                if line and not line.startswith((" ", "\t")) and not line.startswith("Traceback"):
                    scan.traceback = "\n".join(tb)
                    tb = None
            if not _INTEREST.search(line):
                continue
            if line.startswith("Traceback (most recent call last)"):
                tb = deque([line], maxlen=max_tail)
            m = _RECORD_RE.search(line)
            if m:
                text = line[m.end() - 1:].rstrip()
                value: object = None
                if text.endswith("}"):
                    try:
                        value = literal(text)
                    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                        value = None
                if isinstance(value, dict):
                    scan.records.setdefault(m.group(1), []).append((int(m.group(2)), value))
                else:
                    scan.unparsed_records += 1
                    scan.unparsed_kinds[m.group(1)] = scan.unparsed_kinds.get(m.group(1), 0) + 1
            if _ROUTE_TAG in line:
                _keep(scan.routes, _kv(line.split(_ROUTE_TAG, 1)[1]), scan)  # type: ignore[arg-type]
            if _UNSUPPORTED_TAG in line:
                rest = line.split(_UNSUPPORTED_TAG, 1)[1]
                entry = _kv(rest)
                reason = rest.split("reason=", 1)[1].strip() if "reason=" in rest else rest.strip()
                entry["reason"] = reason[:500]
                _keep(scan.unsupported, entry, scan)  # type: ignore[arg-type]
            if _CONTAMINATION_TAG in line:
                for key, value in _kv(line.split(_CONTAMINATION_TAG, 1)[1]).items():
                    if value not in ("0", "false", "False"):
                        scan.contamination[key] = line.strip()[:500]
            if fallback_in_text(line):
                _keep(scan.fallback_lines, line.strip()[:500], scan)  # type: ignore[arg-type]
            if any(marker in line for marker in LOGP_MARKERS):
                _keep(scan.logp_markers, line.strip()[:500], scan)  # type: ignore[arg-type]
            if "contract_id=" in line:
                for cid in _CONTRACT_RE.findall(line):
                    if cid not in scan.contract_ids and len(scan.contract_ids) < MAX_KEPT:
                        scan.contract_ids.append(cid[:200])
            for label, pattern in ERROR_PATTERNS:
                if label not in scan.errors and pattern.search(line):
                    scan.errors[label] = line.strip()[:500]
            for label, cpattern in CONTAMINATION_PATTERNS:
                if label not in scan.contamination and cpattern.search(line):
                    scan.contamination[label] = line.strip()[:500]
    if tb is not None:
        scan.traceback = "\n".join(tb)
    scan.tail = list(tail)
    return scan
