"""The per-cell analysis cache of `rlk-matrix report`: `<root>/.rlk-cache/<cell dir>.json`.

An entry holds a cell's record and the key it was made under: the analysis version
(`record.ANALYSIS_VERSION`), the plugin's version and the judging code itself (`judge_code`: a
sha256 over the source of every module that decides, `JUDGING_CODE`; a record cached by one
judge is never served by another that judges differently, whatever its version says), the
policy the cell was recorded with (`cell-run.json`'s `policy`, also hashed as a file), the
inputs of `analyze_run` that are not files (cell, mode, artifact directory, the matrix file's
expected gaps) and the identity of every file under the run directory: path, type, size and
`mtime_ns`, plus the sha256 of every file that is not a `.pt` (the JSON, logs and env files;
small) and, for a file not hashed (a `.pt`, a large or non-regular file), its inode and
`ctime_ns`, which no rewrite can put back.
The key also holds the same identity of every other directory the cell's judgement reads
(`extra_dirs`: the repeat run `<run>.repeatN` of `run_to_run_bitwise`, and whatever a
provider registered with `register_extra_dirs` names). A record is reused only when the
whole key is equal; otherwise the entry is ignored with the reason (`lookup`) and the cell is read
again. Entries are written atomically (`store.atomic`). The record in an entry is already
scrubbed of secrets; a hit is scrubbed again with the current environment's secrets.

Hashing every small file is most of a warm re-report (a 200-step cell has 400 weight audits).
So an entry also keeps, outside its key, each hashed file's stamp (device, inode, `ctime_ns`)
and when the hashing began: the next key takes a file's sha256 from the entry instead of
reading the file only when type, size, `mtime_ns` and the stamp are all unchanged and the
file's `ctime_ns` lies at least `SETTLED_NS` before that hashing began. The kernel sets
`ctime` on every write and on every `utime`, and no program can set it back, so an equal stamp
means the file was not written since it was hashed; the margin covers the clock's coarse ticks
(a write in the same tick as the hash is hashed again, as git treats "racy" index entries).
Anything else (a copied root, a file touched or rewritten) is hashed again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import stat
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix import __version__
from pytest_rlkernel_matrix.report import record as _record
from pytest_rlkernel_matrix.store.atomic import write_json_atomic
from pytest_rlkernel_matrix.store.safeio import (
    MAX_JSON_BYTES,
    Refused,
    ensure_dir,
    read_bytes,
    read_json,
    sha256_file,
)

CACHE_DIR = ".rlk-cache"
HASH_CAP = 256 * 2**20  # a non-.pt file larger than this is identified by size + mtime only
SETTLED_NS = 2 * 10**9  # a stored hash is reused only for files unchanged this long before it


# What decides a cell's record: the whole package (every `.py` file of it, found, never
# listed by hand: a module added, moved or changed anywhere changes the key). The few modules
# that cannot change a record (the pytest face, the HTML) cost a cold re-report after an edit
# to them; a hand-kept list once left out `report/measured.py` and `store/safeio.py`.
JUDGING_CODE = (".",)


def code_digest(paths: list[Path]) -> str:
    """sha256 over every `.py` file under `paths` (files or folders): each file's path relative
    to its folder and its bytes, in sorted order."""
    digest = hashlib.sha256()
    for top in paths:
        files = [top] if top.is_file() else sorted(
            p for p in top.rglob("*.py") if "__pycache__" not in p.parts)
        for path in files:
            rel = path.name if path == top else path.relative_to(top).as_posix()
            digest.update(f"{top.name}/{rel}\0".encode())
            # the installed package's own source, not a file under a matrix root
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def judge_code_digest() -> str:
    """`code_digest` of this installation's judging code (`JUDGING_CODE`), once per process."""
    package = Path(__file__).resolve().parent.parent
    return code_digest([(package / rel).resolve() for rel in JUDGING_CODE])


def _policy_of(run_dir: Path) -> Any:
    """The policy in the run's `cell-run.json` (None when absent or unreadable: the file's
    identity says the rest)."""
    with suppress(OSError, ValueError, UnicodeDecodeError, RecursionError, Refused):
        meta = read_json(run_dir / "cell-run.json", run_dir)
        return meta.get("policy") if isinstance(meta, dict) else None
    return None


def _sha256(path: str, root: Path, size: int = -1) -> str:
    """A regular file's sha256 through `store.safeio` (a file swapped for a FIFO or a link
    since it was listed is refused, never waited on); `Refused` otherwise."""
    if 0 <= size <= 1 << 20:  # one read (file_digest allocates a 256 KiB buffer per file)
        return hashlib.sha256(read_bytes(Path(path), root, HASH_CAP)).hexdigest()
    return sha256_file(Path(path), root, HASH_CAP)


@dataclass
class Key:
    """A cell's cache key (`key`, compared whole) and what lets the next key skip re-hashing
    (`stamps`, `hashed_ns`; stored beside the key, never part of it)."""

    key: dict[str, Any]
    stamps: dict[str, list[int]] = field(default_factory=dict)
    hashed_ns: int = 0
    hashed: int = 0  # small files read and hashed for this key (the others: stored hashes)


def _previous(entry: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(files, stamps, hashed_ns) of an entry, empty when any part is malformed."""
    if not isinstance(entry, Mapping) or not isinstance(entry.get("key"), Mapping):
        return {}, {}, 0
    files, stamps, when = entry["key"].get("files"), entry.get("stamps"), entry.get("hashed_ns")
    if not (isinstance(files, dict) and isinstance(stamps, dict) and type(when) is int):
        return {}, {}, 0
    return files, stamps, when


def file_identity(run_dir: Path, previous: Mapping[str, Any] | None = None,
                  ) -> tuple[dict[str, list[Any]], dict[str, list[int]], int]:
    """({relative path: [type, size, mtime_ns, sha256 or None]}, {relative path: stamp},
    files hashed) of everything under `run_dir` (symlinks listed, never followed); a small
    file's sha256 comes from `previous` (a cache entry) when its stamp proves it unwritten since
    it was hashed (module doc)."""
    out: dict[str, list[Any]] = {}
    stamps: dict[str, list[int]] = {}
    hashed = 0
    was, was_stamps, hashed_ns = _previous(previous)
    settled = hashed_ns - SETTLED_NS

    def walk(top: str, prefix: str) -> None:
        nonlocal hashed
        with os.scandir(top) as it:
            entries = sorted(it, key=lambda e: e.name)
        subdirs = []
        for entry in entries:
            rel = prefix + entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ["link", os.readlink(entry.path), st.st_mtime_ns, None]
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ["dir", 0, 0, None]
                subdirs.append(entry)
            elif (entry.name.endswith(".pt") or st.st_size > HASH_CAP
                  or not stat.S_ISREG(st.st_mode)):
                # not hashed: identified by what a rewrite cannot put back as well (a same-size
                # rewrite with its mtime restored, `cp -p` / `touch -r`, changes ctime; a
                # replacement file has another inode)
                out[rel] = [_kind(st.st_mode), st.st_size, st.st_mtime_ns, None, st.st_ino,
                            st.st_ctime_ns]
            else:
                stamp = [st.st_dev, st.st_ino, st.st_ctime_ns]
                old = was.get(rel)
                if (st.st_ctime_ns < settled and was_stamps.get(rel) == stamp
                        and isinstance(old, list) and len(old) == 4
                        and old[:3] == ["file", st.st_size, st.st_mtime_ns]
                        and isinstance(old[3], str)):
                    digest = old[3]
                else:
                    try:
                        digest = _sha256(entry.path, run_dir, st.st_size)
                    except Refused as exc:  # changed under the walk: keyed by why
                        digest = f"refused: {exc}"
                    hashed += 1
                out[rel] = ["file", st.st_size, st.st_mtime_ns, digest]
                stamps[rel] = stamp
        for entry in subdirs:
            walk(entry.path, f"{prefix}{entry.name}/")

    walk(str(run_dir), "")
    return out, stamps, hashed


def _kind(mode: int) -> str:
    return "file" if stat.S_ISREG(mode) else "fifo" if stat.S_ISFIFO(mode) else "special"


# -- directories a cell's judgement reads besides its own --------------------------------------
#
# A provider takes the cell's run directory and returns the other directories its analysis
# reads (each keyed like the cell's own: every file's identity). The repeat run of
# `run_to_run_bitwise` is one; a measured run kept beside the cell (performance attribution)
# registers its own provider with `register_extra_dirs`. A directory that does not exist is
# keyed as absent, so its appearance is a change too.

ExtraDirs = Callable[[Path], list[Path]]
_EXTRA_PROVIDERS: list[ExtraDirs] = []


def register_extra_dirs(provider: ExtraDirs) -> ExtraDirs:
    """Add a provider of directories a cell's judgement reads (usable as a decorator)."""
    if provider not in _EXTRA_PROVIDERS:
        _EXTRA_PROVIDERS.append(provider)
    return provider


@register_extra_dirs
def repeat_dirs(run_dir: Path) -> list[Path]:
    """The second runs (`<run>.repeatN`) beside the run, and the one its `cell-run.json` names
    (`policy.repeat_dir`, whatever it is called)."""
    out: list[Path] = []
    with suppress(OSError):
        out += sorted(p for p in run_dir.parent.glob(f"{run_dir.name}.repeat*")
                      if p.name[len(run_dir.name) + 7:].isdigit())
    with suppress(OSError, ValueError, UnicodeDecodeError, RecursionError, Refused):
        meta = read_json(run_dir / "cell-run.json", run_dir)
        named = (meta.get("policy") or {}).get("repeat_dir") if isinstance(meta, dict) else None
        if isinstance(named, str) and named and "/" not in named and named not in (".", ".."):
            out.append(run_dir.parent / named)
    return list(dict.fromkeys(out))


def extra_dirs(run_dir: Path) -> list[Path]:
    """Every directory the registered providers name for this run (in order, once each)."""
    found: list[Path] = []
    for provider in _EXTRA_PROVIDERS:
        found += [p for p in provider(run_dir) if p != run_dir]
    return list(dict.fromkeys(found))


def _dir_identity(path: Path, previous: Mapping[str, Any] | None) -> dict[str, Any]:
    """One extra directory's identity: absent, a link (its target and the target's files) or
    its files (`file_identity`)."""
    try:
        st = path.lstat()
    except OSError:
        return {"state": "absent"}
    out: dict[str, Any] = {"state": "dir" if stat.S_ISDIR(st.st_mode) else _kind(st.st_mode),
                           "ino": st.st_ino, "ctime_ns": st.st_ctime_ns}
    if stat.S_ISLNK(st.st_mode):
        out.update(state="link", target=os.readlink(path))
    try:
        if path.is_dir():
            out["files"] = file_identity(path, previous)[0]
    except OSError as exc:
        out["unreadable"] = type(exc).__name__
    return out


def cache_key(run_dir: Path, inputs: Mapping[str, Any],
              previous: Mapping[str, Any] | None = None) -> Key:
    hashed_ns = time.time_ns()
    files, stamps, hashed = file_identity(run_dir, previous)
    extra = {p.name if p.parent == run_dir.parent else str(p): _dir_identity(p, None)
             for p in extra_dirs(run_dir)}
    return Key({"analysis_version": _record.ANALYSIS_VERSION, "plugin_version": __version__,
                "judge_code": judge_code_digest(),
                "policy": json.loads(json.dumps(_policy_of(run_dir), sort_keys=True,
                                                default=repr)),
                "inputs": json.loads(json.dumps(inputs, sort_keys=True, default=repr)),
                "files": files, "extra_dirs": extra}, stamps, hashed_ns, hashed)


def entry_path(root: Path, rel: str) -> Path:
    return root / CACHE_DIR / (rel.replace("/", "__") + ".json")


def _why(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    for name in ("analysis_version", "plugin_version"):
        if old.get(name) != new[name]:
            return f"{name.replace('_', ' ')} {old.get(name)} != {new[name]}"
    if old.get("judge_code") != new["judge_code"]:
        return (f"judging code changed ({str(old.get('judge_code'))[:12]} != "
                f"{new['judge_code'][:12]})")
    if old.get("policy") != new["policy"]:
        return "the cell's policy (cell-run.json) changed"
    if old.get("inputs") != new["inputs"]:
        keys = sorted(k for k in new["inputs"] if (old.get("inputs") or {}).get(k)
                      != new["inputs"][k])
        return f"analysis inputs changed ({', '.join(keys) or 'their set'})"
    if old.get("extra_dirs") != new["extra_dirs"]:
        was_x, now_x = old.get("extra_dirs") or {}, new["extra_dirs"]
        names = sorted(n for n in set(was_x) | set(now_x) if was_x.get(n) != now_x.get(n))
        return f"a directory the judgement reads changed ({', '.join(names[:3]) or 'set'})"
    was, now = old.get("files") or {}, new["files"]
    for rel in sorted(set(was) | set(now)):
        if rel not in was:
            return f"{rel} is new"
        if rel not in now:
            return f"{rel} was removed"
        if was[rel] != now[rel]:
            what = [n for n, a, b in zip(("type", "size", "mtime_ns", "sha256", "inode",
                                          "ctime_ns"), was[rel], now[rel], strict=False)
                    if a != b]
            return f"{rel} changed ({', '.join(what) or 'identity'})"
    return "key differs"


def read_entry(root: Path, rel: str) -> tuple[dict[str, Any] | None, str]:
    """(the cell's cache entry, "") or (None, why there is no usable one)."""
    path = entry_path(root, rel)
    if not path.exists() and not path.is_symlink():
        return None, "no cache entry"
    try:
        entry = json.loads(read_bytes(path, root, MAX_JSON_BYTES))
    except Refused as exc:
        return None, f"unreadable cache entry ({exc})"
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"unreadable cache entry ({type(exc).__name__})"
    if not isinstance(entry, dict) or not isinstance(entry.get("record"), dict) \
            or not isinstance(entry.get("key"), dict):
        return None, "cache entry is not a record with its key"
    return entry, ""


def lookup(root: Path, rel: str, inputs: Mapping[str, Any], *, defer: bool = False,
           ) -> tuple[dict[str, Any] | None, str, Key | None]:
    """(cached record, "", key) on a hit, else (None, why the entry is not used, key): the key
    of `<root>/<rel>` as it is now, to store the record under after a miss. ``defer``: no
    key where there is no usable entry (None: a miss whatever the files are; the caller makes
    the key, `cache_key(root / rel, inputs)`, before it reads them)."""
    entry, why = read_entry(root, rel)
    if entry is None and defer:
        return None, why, None
    key = cache_key(root / rel, inputs, entry)
    if entry is None:
        return None, why, key
    if entry["key"] != key.key:
        return None, _why(entry["key"], key.key), key
    if key.hashed:  # files hashed again (new stamps, or too recent to trust): keep the stamps
        store(root, rel, key, entry["record"])
    return entry["record"], "", key


def store(root: Path, rel: str, key: Key, record: Mapping[str, Any]) -> None:
    """Write the entry atomically; a root that cannot take it (read-only) just gets no cache."""
    with suppress(OSError, Refused):
        path = entry_path(root, rel)
        ensure_dir(path.parent, root)  # a .rlk-cache linked out of the root is not written
        write_json_atomic(path, {"key": key.key, "stamps": key.stamps,
                                 "hashed_ns": key.hashed_ns, "record": record}, indent=None)
