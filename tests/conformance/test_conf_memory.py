"""A clean R/R re-reads as `valid` where virtual memory is capped (issue 20, part A).

`store.safeio.read_bytes` once asked for `cap + 1` bytes (4 GiB for a `.pt`) on every read, so
under `ulimit -v 3 GiB` (or strict overcommit) a clean baseline re-read as `error` ("MemoryError").
Readers now allocate for the file's size; the cap still refuses larger files.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from upstream_layout import upstream_cell

from pytest_rlkernel_matrix.store.safeio import Refused, read_bytes

LIMIT = 3 << 30  # torch imports under 1 GiB on this machine (measured), so 3 GiB is the test


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def test_a_clean_root_rereads_valid_under_rlimit_as_3_gib(tmp_path: Path) -> None:
    root = tmp_path / "root"
    upstream_cell(root, clean=True)
    proc = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.cli", "report",
                           str(root)], preexec_fn=_capped, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (cell,) = json.loads((root / "matrix-report.json").read_text())["cells"]
    assert cell["verdict"] == "valid", cell["reasons"]
    assert (cell["active_token_count"], cell["mismatch_count"]) == (55, 0)


def test_the_cap_still_refuses_a_larger_file(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    path.write_bytes(b"x" * 100)
    assert read_bytes(path, tmp_path, 100) == b"x" * 100
    with pytest.raises(Refused, match=r"big.pt: 101 bytes exceeds the 100-byte cap"):
        path.write_bytes(b"x" * 101)
        read_bytes(path, tmp_path, 100)
