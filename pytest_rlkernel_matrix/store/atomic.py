"""Atomic writes: strict JSON (no NaN/Infinity) and text via a temp file and `os.replace`.

Every report and record file goes through here, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def json_safe(value: Any, _depth: int = 0) -> Any:
    """`value` with every non-finite float replaced by None (strict JSON has no NaN/Infinity).

    numpy scalars become Python numbers first; what json cannot encode becomes its `str`.
    """
    if _depth > 200:
        return str(value)[:200]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v, _depth + 1) for v in value]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", 1) == 0:
        try:
            return json_safe(item(), _depth + 1)
        except (TypeError, ValueError):
            pass
    return str(value)


def file_mode() -> int:
    """The mode a plain `open(path, "w")` would give a new file: 0o666 less the umask.

    Read from /proc/self/status (Linux >= 4.7) so the process-wide umask is never changed;
    elsewhere `os.umask` is set and restored at once.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and `os.replace`, with the mode every other
    file gets (0644 under the usual umask 022; `mkstemp` alone would leave 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class _Unusual(Exception):
    """A value `dumps_indented` leaves to `json.dumps`."""


def dumps_indented(value: Any, indent: int = 2) -> str:
    """`json.dumps(value, indent=indent, allow_nan=False)`, the same text, made faster for
    values of JSON's own types (`json_safe`'s): json's C encoder writes no indented text, so
    `json.dumps` with an indent runs its pure-Python encoder, a generator per container (a
    2 MB matrix report took 0.3 s). Here each container is one loop that appends its items'
    text as that encoder writes them (strings by json's own C function); a value of any
    other type, or a float that is not finite, hands the whole value to `json.dumps`."""
    parts: list[str] = []
    append = parts.append
    string = json.encoder.encode_basestring_ascii  # type: ignore[attr-defined]
    finite = math.isfinite

    def scalar(v: Any) -> str | None:
        t = type(v)
        if t is str:
            return string(v)  # type: ignore[no-any-return]
        if v is None:
            return "null"
        if v is True:
            return "true"
        if v is False:
            return "false"
        if t is int:
            return int.__repr__(v)
        if t is float:
            if not finite(v):
                raise _Unusual
            return float.__repr__(v)
        if t is list or t is dict:
            return None
        raise _Unusual

    def put(v: Any, level: int) -> None:
        if not v:
            append("[]" if type(v) is list else "{}")
            return
        inner = "\n" + " " * (indent * (level + 1))
        sep = "," + inner
        if type(v) is list:
            append("[" + inner)
            for i, x in enumerate(v):
                if i:
                    append(sep)
                text = scalar(x)
                if text is None:
                    put(x, level + 1)
                else:
                    append(text)
            append("\n" + " " * (indent * level) + "]")
            return
        append("{" + inner)
        for i, (k, x) in enumerate(v.items()):
            if type(k) is not str:
                raise _Unusual
            append((sep if i else "") + string(k) + ": ")
            text = scalar(x)
            if text is None:
                put(x, level + 1)
            else:
                append(text)
        append("\n" + " " * (indent * level) + "}")

    try:
        text = scalar(value)
        if text is not None:
            return text
        put(value, 0)
    except (_Unusual, RecursionError):
        return json.dumps(value, indent=indent, sort_keys=False, allow_nan=False)
    return "".join(parts)


def write_json_atomic(path: Path, data: Any, *, indent: int | None = 2) -> None:
    """Write strict JSON (no NaN/Infinity: `json_safe`) atomically (`write_text_atomic`).
    ``indent=None``: compact, for files only this package reads back (json's C encoder)."""
    safe = json_safe(data)
    text = (json.dumps(safe, indent=None, sort_keys=False, allow_nan=False) if indent is None
            else dumps_indented(safe, indent))
    write_text_atomic(path, text + "\n")


def new_dir(parent: Path, name: str) -> Path:
    """``<parent>/<name>``, else ``<name>.2``, ``<name>.3``, ...: made here, never an existing
    one (a follow-up run's directory: artifacts are never overwritten)."""
    n = 1
    while True:
        cand = parent / (name if n == 1 else f"{name}.{n}")
        try:
            cand.mkdir()
            return cand
        except FileExistsError:
            n += 1
