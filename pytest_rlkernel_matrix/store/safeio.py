"""Open artifact files the way a reader of untrusted run directories must.

Only regular files are opened (a FIFO or device would block or never end), symlinks that resolve
outside the cell directory are refused, and every read is capped in bytes. Problems are raised as
`Refused` with a one-line reason the caller turns into a verdict reason. The standard library has
no "open regular file under root, capped" helper, so it is written here (a few lines of `os`).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_PT_BYTES = 4 * 1024 * 1024 * 1024
MAX_LOG_BYTES = 8 * 1024 * 1024 * 1024
MAX_SMALL_BYTES = 4096
MAX_REPORT_BYTES = 1024 * 1024 * 1024  # a matrix report (a few MB at full size)


class Refused(Exception):
    """An artifact that is not read: the message says why (and names the file)."""


def inside(path: Path, root: Path) -> Path:
    """`path` resolved; `Refused` if it (or a symlink on the way) leaves `root`."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # RuntimeError: symlink loop on older Pythons
        raise Refused(f"{path.name}: cannot resolve: {exc}") from None
    base = root.resolve()
    if real != base and not real.is_relative_to(base):
        raise Refused(f"{_rel(path, root)}: symlink leaves the cell directory (-> {real}): refused")
    return real


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return path.name


_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
          | getattr(os, "O_CLOEXEC", 0))
_PROC_FD = "/proc/self/fd/"


def _fd_path(fd: int) -> str | None:
    """The kernel's canonical path of an open descriptor (Linux `/proc`), or None."""
    try:
        real = os.readlink(f"{_PROC_FD}{fd}")
    except OSError:
        return None
    return real if real.startswith("/") and not real.endswith(" (deleted)") else None


def _open_inside(path: Path, root: Path) -> int | None:
    """A descriptor of `path` when it is plainly inside `root`, else None (the caller then
    takes `inside`'s way, which gives every refusal). The file is opened without following a
    final symlink, and the kernel's canonical path of what was opened must lie under the
    canonical path of `root` (both read back from `/proc/self/fd`): what `inside` accepts,
    for three system calls instead of resolving both paths component by component."""
    if not hasattr(os, "O_NOFOLLOW"):
        return None
    try:
        dfd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        base = _fd_path(dfd)
    finally:
        os.close(dfd)
    if base is None:
        return None
    try:
        fd = os.open(path, _FLAGS)
    except OSError:  # a final symlink (followed the slow way if it stays inside), or absent
        return None
    real = _fd_path(fd)
    if real is not None and (real == base or real.startswith(base.rstrip("/") + "/")):
        return fd
    os.close(fd)
    return None


def open_regular(path: Path, root: Path, max_bytes: int) -> tuple[BinaryIO, int]:
    """(binary handle, size) of a regular file under `root` no larger than `max_bytes`."""
    fd = _open_inside(path, root)
    if fd is None:
        real = inside(path, root)
        try:
            fd = os.open(real, _FLAGS)
        except OSError as exc:
            raise Refused(f"{_rel(path, root)}: cannot open: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{_rel(path, root)}: not a regular file: refused")
        if st.st_size > max_bytes:
            raise Refused(f"{_rel(path, root)}: {st.st_size} bytes exceeds the "
                          f"{max_bytes}-byte cap for this artifact: not read")
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: Path, root: Path, max_bytes: int) -> bytes:
    """The whole (capped) content of a regular file under `root`.

    Allocates for the file's size (fstat), not for the cap: a 4 GiB cap must not reserve 4 GiB
    per read where virtual memory is limited. One byte past the size is asked for, so a file
    that grew while read is seen; growth past the cap is refused."""
    handle, size = open_regular(path, root, max_bytes)
    with handle:
        data = handle.read(size + 1)
        if len(data) > size:  # grew since fstat: read the rest in pieces, still capped
            parts = [data]
            total = len(data)
            while total <= max_bytes and (more := handle.read(min(1 << 20,
                                                                  max_bytes + 1 - total))):
                parts.append(more)
                total += len(more)
            data = b"".join(parts)
    if len(data) > max_bytes:
        raise Refused(f"{_rel(path, root)}: grew past the {max_bytes}-byte cap while read")
    return data


def listing(directory: Path, pattern: str, root: Path, problems: list[str]) -> list[Path]:
    """Sorted matches of `pattern` in `directory`; entries leaving `root` become problems."""
    try:
        if not directory.is_dir():
            return []
        inside(directory, root)
        found = sorted(directory.glob(pattern))
    except Refused as exc:
        problems.append(str(exc))
        return []
    except OSError as exc:
        problems.append(f"{directory.name}: cannot list: {exc}")
        return []
    return found


def newest_followup(run_dir: Path, name: str, file: str, note: str) -> Path | None:
    """`file` of the newest follow-up run directory `<run_dir>/<name>`, `<name>.2`, ...
    (`store.atomic.new_dir` makes them), else the note saying why none was run, else None."""
    found = []
    for p in run_dir.glob(f"{name}*/{file}"):
        tail = p.parent.name.removeprefix(name).removeprefix(".")
        if tail == "" or tail.isdigit():
            found.append((int(tail or 1), p))
    if found:
        return max(found)[1]
    return run_dir / note if (run_dir / note).is_file() else None


# -- writes, appends and locks under a root ----------------------------------------------------
#
# A write opens its path without following a final symlink (`O_NOFOLLOW`: a link planted at the
# path is an error, never a file written elsewhere), without waiting (`O_NONBLOCK`: a FIFO
# planted there cannot hang the writer), then checks what it opened: a regular file whose
# kernel path lies under the root (a directory on the way that is a link out of the root is
# refused too). `Refused` names the path and why.

_WRITE = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def _checked(fd: int, path: Path, root: Path) -> int:
    """`fd` when it is a regular file under `root` (kernel path), else closed and `Refused`."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{_rel(path, root)}: not a regular file: refused")
        if st.st_nlink > 1:  # a hard link: the same file may lie outside the root
            raise Refused(f"{_rel(path, root)}: has {st.st_nlink} links (a hard link to a file "
                          "that may lie outside the root): not written")
        real = _fd_path(fd)
        base = str(root.resolve())
        if real is None:
            inside(path, root)
        elif not (real == base or real.startswith(base.rstrip("/") + "/")):
            raise Refused(f"{_rel(path, root)}: leaves the matrix root (-> {real}): refused")
        if hasattr(os, "O_NONBLOCK"):  # regular files never block; later reads need no flag
            os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_write(path: Path, root: Path, flags: int, mode: int | None) -> int:
    from pytest_rlkernel_matrix.store.atomic import file_mode

    try:
        fd = os.open(path, flags | _WRITE, file_mode() if mode is None else mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(f"{_rel(path, root)}: a symlink: not written through") from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader, opened without waiting
            raise Refused(f"{_rel(path, root)}: not a regular file: refused") from None
        raise
    return _checked(fd, path, root)


def open_append(path: Path, root: Path) -> BinaryIO:
    """`path` (under `root`) opened to append bytes, created when absent (module note)."""
    fd = _open_write(path, root, os.O_WRONLY | os.O_APPEND | os.O_CREAT, None)
    return os.fdopen(fd, "ab")


def open_lock(path: Path, root: Path) -> Any:
    """`path` (under `root`) opened read-write as text for a lock file, created when absent,
    never truncated on open and never through a link (module note)."""
    fd = _open_write(path, root, os.O_RDWR | os.O_CREAT, None)
    return os.fdopen(fd, "a+", encoding="utf-8")


def write_new_text(path: Path, text: str) -> None:
    """Create `path` with `text`; `FileExistsError` when anything (a link included) is there."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _WRITE, 0o666)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)


def write_text(path: Path, root: Path, text: str) -> None:
    """Replace `path` (under `root`) with `text` atomically (`store.atomic`), after checking
    that its folder lies under `root` (a folder linked out of the root is refused)."""
    from pytest_rlkernel_matrix.store.atomic import write_text_atomic

    ensure_dir(path.parent, root)
    write_text_atomic(path, text)


def ensure_dir(directory: Path, root: Path) -> Path:
    """`directory` (under `root`) made when absent; `Refused` when it, or the nearest folder of
    it that exists, leaves `root` (checked before anything is made, and after)."""
    for folder in (directory, *directory.parents):
        if folder.exists() or folder.is_symlink():
            if folder == root or root in folder.parents:
                inside(folder, root)
            break
    directory.mkdir(parents=True, exist_ok=True)
    return inside(directory, root)


def sha256_file(path: Path, root: Path, max_bytes: int) -> str:
    """The sha256 of a regular file under `root`, read in pieces (never whole in memory)."""
    import hashlib

    handle, _ = open_regular(path, root, max_bytes)
    with handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def read_text(path: Path, root: Path, max_bytes: int = MAX_JSON_BYTES) -> str:
    """`read_bytes` decoded as UTF-8 (`UnicodeDecodeError` is a `ValueError`)."""
    return read_bytes(path, root, max_bytes).decode("utf-8")


class Duplicate(ValueError):
    """A JSON object that names one key twice."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise Duplicate(f"duplicate key {key!r}: which one counts is not defined")
        out[key] = value
    return out


def _nonfinite_at(value: Any, where: str = "") -> str | None:
    """The path of the first float in `value` that is not finite (iterative)."""
    import math

    stack = [(where, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return f"{path or '(top level)'} = {item!r}"
        if isinstance(item, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
    return None


def loads_strict(text: str | bytes) -> Any:
    """JSON as RFC 8259 has it: a key twice in one object, `NaN`, `Infinity` and a number too
    large for a float (`1e999`) are `ValueError`s naming the key (json's defaults take the last
    key and read the others as floats)."""
    import json
    import math

    odd: list[bool] = []

    def number(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            odd.append(True)
        return value

    def constant(name: str) -> float:
        odd.append(True)
        return float(name.replace("Infinity", "inf"))

    data = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=constant,
                      parse_float=number)
    if odd and (at := _nonfinite_at(data)):
        raise ValueError(f"key {at}: not a finite number (refused)")
    return data


def read_json(path: Path, root: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A JSON file under `root`, read through `read_bytes` and parsed by `loads_strict`."""
    return loads_strict(read_bytes(path, root, max_bytes))
