"""Open artifact files the way a reader of untrusted run directories must.

Only regular files are opened (a FIFO or device would block or never end), symlinks that resolve
outside the cell directory are refused, and every read is capped in bytes. Problems are raised as
`Refused` with a one-line reason the caller turns into a verdict reason. The standard library has
no "open regular file under root, capped" helper, so it is written here (a few lines of `os`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_PT_BYTES = 4 * 1024 * 1024 * 1024
MAX_LOG_BYTES = 8 * 1024 * 1024 * 1024
MAX_SMALL_BYTES = 4096


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


def open_regular(path: Path, root: Path, max_bytes: int) -> tuple[BinaryIO, int]:
    """(binary handle, size) of a regular file under `root` no larger than `max_bytes`."""
    real = inside(path, root)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(real, flags | getattr(os, "O_CLOEXEC", 0))
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
