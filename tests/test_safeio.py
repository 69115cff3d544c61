"""`store.safeio`: the cheap containment check accepts exactly what the resolving one accepts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_rlkernel_matrix.store import safeio
from pytest_rlkernel_matrix.store.safeio import Refused, read_bytes


def _cell(tmp_path: Path) -> tuple[Path, Path]:
    cell = tmp_path / "root" / "cell"
    (cell / "sub").mkdir(parents=True)
    (cell / "sub" / "a.json").write_bytes(b"inside")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a.json").write_bytes(b"secret")
    return cell, outside


def test_plain_files_take_the_fast_path_and_read_whole(tmp_path: Path) -> None:
    cell, _ = _cell(tmp_path)
    fd = safeio._open_inside(cell / "sub" / "a.json", cell)
    if fd is None:
        pytest.skip("no /proc/self/fd here: the resolving path is the only one")
    os.close(fd)
    assert read_bytes(cell / "sub" / "a.json", cell, 64) == b"inside"


def test_a_directory_symlink_leaving_the_cell_is_refused(tmp_path: Path) -> None:
    cell, outside = _cell(tmp_path)
    (cell / "escape").symlink_to(outside, target_is_directory=True)
    assert safeio._open_inside(cell / "escape" / "a.json", cell) is None
    with pytest.raises(Refused, match=r"escape/a.json: symlink leaves the cell directory"):
        read_bytes(cell / "escape" / "a.json", cell, 64)


def test_a_file_symlink_leaving_the_cell_is_refused(tmp_path: Path) -> None:
    cell, outside = _cell(tmp_path)
    (cell / "sub" / "b.json").symlink_to(outside / "a.json")
    assert safeio._open_inside(cell / "sub" / "b.json", cell) is None
    with pytest.raises(Refused, match=r"sub/b.json: symlink leaves the cell directory"):
        read_bytes(cell / "sub" / "b.json", cell, 64)


def test_symlinks_that_stay_inside_are_followed(tmp_path: Path) -> None:
    cell, _ = _cell(tmp_path)
    (cell / "sub" / "b.json").symlink_to(cell / "sub" / "a.json")
    (cell / "alias").symlink_to(cell / "sub", target_is_directory=True)
    assert read_bytes(cell / "sub" / "b.json", cell, 64) == b"inside"
    assert read_bytes(cell / "alias" / "a.json", cell, 64) == b"inside"


def test_a_cell_reached_through_a_symlink_reads_its_files(tmp_path: Path) -> None:
    cell, _ = _cell(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(cell, target_is_directory=True)
    assert read_bytes(link / "sub" / "a.json", link, 64) == b"inside"
    # a sibling whose name starts with the cell's is outside it
    sibling = tmp_path / "root" / "cell2"
    sibling.mkdir()
    (sibling / "x.json").write_bytes(b"x")
    (cell / "sub" / "x.json").symlink_to(sibling / "x.json")
    with pytest.raises(Refused, match="symlink leaves the cell directory"):
        read_bytes(cell / "sub" / "x.json", cell, 64)


def test_missing_fifo_and_oversized_files_keep_their_reasons(tmp_path: Path) -> None:
    cell, _ = _cell(tmp_path)
    with pytest.raises(Refused, match=r"nope.json: cannot resolve"):
        read_bytes(cell / "nope.json", cell, 64)
    with pytest.raises(Refused, match=r"sub/a.json: 6 bytes exceeds the 5-byte cap"):
        read_bytes(cell / "sub" / "a.json", cell, 5)
    if hasattr(os, "mkfifo"):
        os.mkfifo(cell / "fifo")
        with pytest.raises(Refused, match=r"fifo: not a regular file: refused"):
            read_bytes(cell / "fifo", cell, 64)
