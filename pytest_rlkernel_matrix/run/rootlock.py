"""One session per matrix root: an exclusive `fcntl.flock` on `<root>/.rlk-session.lock`.

The session (the xdist controller, not its workers) takes the lock before preflight and holds it
until pytest exits; the kernel drops it when the process dies, so a killed session never leaves
a stale lock behind. The file keeps the holder's pid, host, start time and command line for the
error a second session gets. `rlk-matrix report` takes the same lock, so it never rewrites a
report under a running session. (`fcntl.flock`, stdlib: see `session` for why not `filelock`.)
The lock file is opened through `store.safeio.open_lock`: never through a link planted at its
path (`O_NOFOLLOW`), only a regular file with one link, inside the root; anything else is
`RootUnusable` naming it, and nothing outside the root is ever written.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from pytest_rlkernel_matrix.store.redact import Scrubber
from pytest_rlkernel_matrix.store.safeio import MAX_SMALL_BYTES, Refused, open_lock, read_bytes

LOCK_FILE = ".rlk-session.lock"


class RootError(Exception):
    """The matrix root cannot be claimed (the message names it and says why)."""


class RootBusy(RootError):
    """Another process holds the matrix root."""


class RootUnusable(RootError):
    """The matrix root is not a directory this process can write: a file, under a file,
    read-only, not permitted."""


def unusable(root: Path, exc: OSError) -> str:
    """Why `root` cannot hold a matrix run, naming the path at fault."""
    for path in (root, *root.parents):
        try:
            is_other = path.exists() and not path.is_dir()
        except OSError:
            is_other = False
        if is_other:
            where = "is" if path == root else f"lies under {path}, which is"
            return (f"matrix root {root} {where} a file, not a directory: pass a directory "
                    "as --rlk-matrix-root (or MATRIX_ROOT)")
    reason = exc.strerror or type(exc).__name__
    return (f"matrix root {root} cannot be written: {reason}: {exc.filename or root} "
            "(pass a writable directory as --rlk-matrix-root, or MATRIX_ROOT)")


@dataclass
class RootLock:
    path: Path
    handle: IO[str] | None

    def release(self) -> None:
        if self.handle is not None:
            try:
                fcntl.flock(self.handle, fcntl.LOCK_UN)
            finally:
                self.handle.close()
                self.handle = None


def holder(path: Path) -> str:
    """`pid N on HOST since TIME (command)` from a lock file, as far as it can be read."""
    try:
        data: Any = json.loads(read_bytes(path, path.parent, MAX_SMALL_BYTES) or b"{}")
    except (OSError, ValueError, Refused):
        data = {}
    if not isinstance(data, dict) or not data.get("pid"):
        return "holder unknown (the lock was taken a moment ago or its file is unreadable)"
    text = f"pid {data.get('pid')} on {data.get('host', '?')} since {data.get('started', '?')}"
    return text + (f" ({data['command']})" if data.get("command") else "")


def claim(root: Path, what: str = "pytest") -> RootLock:
    """Take `root`'s lock without waiting, or raise RootBusy naming the root and the holder
    (RootUnusable when the root is a file, under a file or not writable)."""
    path = root / LOCK_FILE
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = open_lock(path, root)
    except Refused as exc:  # a link, FIFO, device or hard link planted at the lock's path
        raise RootUnusable(f"matrix root {root}: {LOCK_FILE}: {exc}: remove it (the lock file "
                           "is never written through a link)") from None
    except OSError as exc:
        raise RootUnusable(unusable(root, exc)) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise RootBusy(
            f"matrix root {root} is in use by another session: {holder(path)}; one session per "
            "matrix root (wait for it, or pass another --rlk-matrix-root / MATRIX_STAMP)"
        ) from None
    info = {
        "pid": os.getpid(), "host": socket.gethostname(),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": Scrubber.from_env(os.environ, sys.argv).text(
            f"{what} {' '.join(sys.argv[1:])}"[:300]),
    }
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(info) + "\n")
    handle.flush()
    return RootLock(path, handle)


def claim_session(root: Path, add_cleanup: Callable[[Callable[[], None]], None]
                  ) -> Callable[[], None]:
    """Take `root`'s session lock for a pytest session (RootError naming the root when it is
    busy, a file, under a file or not writable; `add_cleanup` releases the lock at exit).
    Returns the undo for a session that stops before it begins: it removes only what this
    session created (its preflight-raw/, the lock file, the root and the parents it made, when
    left empty) and releases the lock."""
    import shutil

    made: list[Path] = []
    for folder in (root, *root.parents):
        if folder.exists() or folder.is_symlink():
            break
        made.append(folder)
    lock_file, raw = root / LOCK_FILE, root / "preflight-raw"
    fresh_lock, fresh_raw = not lock_file.exists(), not raw.exists()
    try:
        lock = claim(root)
    except RootError:
        _remove_empty(made)  # a root created before its lock file failed
        raise
    add_cleanup(lock.release)

    def undo() -> None:
        if fresh_raw and raw.is_dir():
            shutil.rmtree(raw, ignore_errors=True)
        if fresh_lock:  # removed while still held: no other session can have claimed it
            lock_file.unlink(missing_ok=True)
        lock.release()
        _remove_empty(made)

    return undo


def claim_fresh(root: Path, add_cleanup: Callable[[Callable[[], None]], None],
                used: Sequence[str]) -> tuple[Path, Callable[[], None]]:
    """The default root (`ablation-matrix-<stamp>`) or, when a session started in the same
    second holds it or used it (one of `used` is there), the first free `<stamp>-2`,
    `<stamp>-3`, ...: default roots never collide. Returns the root claimed and its undo."""
    for n in range(1, 100):
        candidate = root if n == 1 else root.with_name(f"{root.name}-{n}")
        if any((candidate / name).exists() for name in used):
            continue
        try:
            return candidate, claim_session(candidate, add_cleanup)
        except RootBusy:
            continue
    raise RootBusy(f"{root}: 99 sessions hold or used this default matrix root and its "
                   "numbered siblings; pass --rlk-matrix-root")


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break
