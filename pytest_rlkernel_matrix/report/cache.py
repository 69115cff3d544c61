"""The per-cell analysis cache of `rlk-matrix report`: `<root>/.rlk-cache/<cell dir>.json`.

An entry holds a cell's record and the key it was made under: the analysis version
(`record.ANALYSIS_VERSION`) and the plugin's version, the inputs of `analyze_run` that are not
files (cell, mode, artifact directory, the matrix file's expected gaps) and the identity of
every file under the run directory: path, type, size and `mtime_ns`, plus the sha256 of every
file that is not a `.pt` (the JSON, logs and env files; small). A record is reused only when the
whole key is equal; otherwise the entry is ignored with the reason (`lookup`) and the cell is read
again. Entries are written atomically (`store.atomic`). The record in an entry is already
scrubbed of secrets; a hit is scrubbed again with the current environment's secrets.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix import __version__
from pytest_rlkernel_matrix.report import record as _record
from pytest_rlkernel_matrix.store.atomic import write_json_atomic

CACHE_DIR = ".rlk-cache"
HASH_CAP = 256 * 2**20  # a non-.pt file larger than this is identified by size + mtime only


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_identity(run_dir: Path) -> dict[str, list[Any]]:
    """{relative path: [type, size, mtime_ns, sha256 or None]} of everything under `run_dir`."""
    out: dict[str, list[Any]] = {}
    for top, dirs, files in os.walk(run_dir):
        dirs.sort()
        base = Path(top)
        for name in sorted(dirs) + sorted(files):
            path = base / name
            st = path.lstat()
            rel = str(path.relative_to(run_dir))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ["link", os.readlink(path), st.st_mtime_ns, None]
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ["dir", 0, 0, None]
            else:
                digest = (None if name.endswith(".pt") or st.st_size > HASH_CAP
                          or not stat.S_ISREG(st.st_mode) else _sha256(path))
                out[rel] = ["file", st.st_size, st.st_mtime_ns, digest]
    return out


def cache_key(run_dir: Path, inputs: Mapping[str, Any]) -> dict[str, Any]:
    return {"analysis_version": _record.ANALYSIS_VERSION, "plugin_version": __version__,
            "inputs": json.loads(json.dumps(inputs, sort_keys=True, default=repr)),
            "files": file_identity(run_dir)}


def entry_path(root: Path, rel: str) -> Path:
    return root / CACHE_DIR / (rel.replace("/", "__") + ".json")


def _why(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    for field in ("analysis_version", "plugin_version"):
        if old.get(field) != new[field]:
            return f"{field.replace('_', ' ')} {old.get(field)} != {new[field]}"
    if old.get("inputs") != new["inputs"]:
        keys = sorted(k for k in new["inputs"] if (old.get("inputs") or {}).get(k)
                      != new["inputs"][k])
        return f"analysis inputs changed ({', '.join(keys) or 'their set'})"
    was, now = old.get("files") or {}, new["files"]
    for rel in sorted(set(was) | set(now)):
        if rel not in was:
            return f"{rel} is new"
        if rel not in now:
            return f"{rel} was removed"
        if was[rel] != now[rel]:
            what = [n for n, a, b in zip(("type", "size", "mtime_ns", "sha256"), was[rel],
                                         now[rel], strict=False) if a != b]
            return f"{rel} changed ({', '.join(what) or 'identity'})"
    return "key differs"


def lookup(root: Path, rel: str, key: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(cached record, "") on a hit, else (None, why the entry is not used)."""
    path = entry_path(root, rel)
    if not path.exists():
        return None, "no cache entry"
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"unreadable cache entry ({type(exc).__name__})"
    if not isinstance(entry, dict) or not isinstance(entry.get("record"), dict) \
            or not isinstance(entry.get("key"), dict):
        return None, "cache entry is not a record with its key"
    if entry["key"] != key:
        return None, _why(entry["key"], key)
    return entry["record"], ""


def store(root: Path, rel: str, key: Mapping[str, Any], record: Mapping[str, Any]) -> None:
    """Write the entry atomically; a root that cannot take it (read-only) just gets no cache."""
    with suppress(OSError):
        write_json_atomic(entry_path(root, rel), {"key": key, "record": record})
