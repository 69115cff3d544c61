"""The analysis' imports (`judge/read/preload.py`): started by a session as its first cell launches,
joined (and the wait counted as the cell's `import_wait_s`) before the first analysis; never in a
session that runs no cell. Each session runs in its own process: this suite's process has torch
imported already (conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

# Written into the pytester project: what the session process had imported when each cell's
# environment was prepared (before its launch) and at the end, and what the thread imported.
SPY = '''
import json, sys
from pathlib import Path
from pytest_rlkernel_matrix.judge.read import preload

SEEN = []

def pytest_rlk_cell_env(config, cell, env):
    SEEN.append({"case": cell.case, "started": preload.started(),
                 "torch": "torch" in sys.modules, "numpy": "numpy" in sys.modules})

def pytest_sessionfinish(session):
    Path("preload.json").write_text(json.dumps({
        "seen": SEEN, "started": preload.started(), "imported": sorted(preload.imported),
        "failed": preload.failed, "torch": "torch" in sys.modules}))
'''


def _spy(pytester: pytest.Pytester) -> dict[str, Any]:
    return json.loads((pytester.path / "preload.json").read_text())


def test_the_first_cell_starts_the_imports_and_its_record_counts_the_wait(
        pytester: pytest.Pytester, make_matrix: Any, tmp_path: Path) -> None:
    make_matrix(modules='["attention"]')
    pytester.makeconftest(SPY)
    root = tmp_path / "root"
    result = pytester.runpytest_subprocess(f"--rlk-matrix-root={root}", "-p", "no:cacheprovider",
                                           "-k", "R/R or P/R")
    assert result.ret == 0, result.stdout.str()[-2000:]
    spy = _spy(pytester)
    first, second = spy["seen"]
    # Nothing heavy before the first launch; the thread started there imported numpy and the
    # judge (the analysis found them imported: the thread was joined before it read any `.pt`).
    assert first == {"case": "R/R", "started": False, "torch": False, "numpy": False}
    # ... and the analysis never needed torch (sidecars read as numpy arrays)
    assert second == {"case": "P/R", "started": True, "torch": False, "numpy": True}
    assert {"numpy", "pytest_rlkernel_matrix.judge.read.evidence"} <= set(spy["imported"])
    assert "torch" not in spy["imported"]
    assert spy["failed"] == {}
    cells = {c["case"]: c for c in json.loads((root / "matrix-report.json").read_text())["cells"]}
    assert {c["verdict"] for c in cells.values()} == {"valid"}  # the evidence (.pt) was read
    waits = {}
    for case, rec in cells.items():
        meta = json.loads((root / rec["artifact_dir"] / "cell-run.json").read_text())
        waits[case] = meta["overhead"]["import_wait_s"]
        assert rec["overhead"]["import_wait_s"] == pytest.approx(waits[case], abs=1e-6)
        named = sum(rec["overhead"][k] for k in ("env_s", "launch_wait_s", "record_write_s",
                                                 "import_wait_s", "evidence_s", "verdict_s",
                                                 "record_s"))
        assert rec["overhead_s"] == pytest.approx(named, abs=1e-5)  # the wait is overhead
    assert waits["R/R"] >= 0.0
    assert waits["P/R"] == 0.0  # joined once: later cells wait for nothing


@pytest.mark.parametrize("args", [["--rlk-plan"], ["--collect-only", "-q"]])
def test_a_session_that_runs_no_cell_never_starts_them(
        pytester: pytest.Pytester, make_matrix: Any, args: list[str]) -> None:
    make_matrix(modules='["attention"]')
    pytester.makeconftest(SPY)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    assert result.ret == 0, result.stdout.str()[-2000:]
    spy = _spy(pytester)
    assert spy == {"seen": [], "started": False, "imported": [], "failed": {}, "torch": False}
    assert not (pytester.path / "outputs").exists()
