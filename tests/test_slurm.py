"""The Slurm launcher against a real Slurm: Debian's slurm-wlm + munge, started on this host by
`scripts/slurm-local.sh start` (once per test session) and stopped again by
`scripts/slurm-local.sh stop` when the session ends (tests/conftest.py), which also removes every
file and folder `start` created (slurm.conf, the munge key, state and log folders).

Opt-in: the tests marked `slurm` start daemons and write system files, so they run only with
`--run-slurm` or `RLK_SLURM_TESTS=1` (README, docs/en/ci.md; .ci/run opts in). Opted in, they
skip, saying exactly why, where Slurm is not installed or its daemons cannot start (no root, a
sandbox). A Slurm that already answers (a site's own) is used as is and never stopped."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_rlkernel_matrix.run.launchers.slurm import MARKER_FILE, slurm_available

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm-local.sh"
WORKLOAD = ('"$PYTHON_BIN" -m pytest_rlkernel_matrix.workload --preset tiny --num-prompts 2 '
            "--max-new-tokens 4")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A usable local Slurm: started by the repo's script if it is not answering yet."""
    if slurm_available() is None:
        return  # a cluster that answers already: not ours, left as it is
    if shutil.which("sinfo") is None or shutil.which("slurmctld", path="/usr/sbin") is None:
        pytest.skip("Slurm is not installed here (no sinfo/slurmctld): install Debian's "
                    "slurm-wlm and munge (`apt-get install -y slurm-wlm munge`; .ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root to start (slurmd runs jobs as their user)")
    lock = tmp_path_factory.getbasetemp().parent / "rlk-slurm-start.lock"
    with lock.open("a") as fh:  # xdist workers: one starts the cluster, the others wait
        fcntl.flock(fh, fcntl.LOCK_EX)
        if slurm_available() is not None:
            notes = os.environ.get("RLK_SLURM_SESSION_DIR")
            if not notes:
                pytest.skip("no RLK_SLURM_SESSION_DIR: the local Slurm is started only by a test "
                            "session that stops it again (tests/conftest.py)")
            # written before `start`: a start that fails half-way is still undone at the end
            Path(notes, "started").write_text(str(os.getpid()))
            proc = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True,
                                  timeout=180, check=False)
            if proc.returncode != 0:
                pytest.skip("the local Slurm cluster cannot start here: "
                            + (proc.stderr or proc.stdout).strip()[-400:])
    why = slurm_available()
    if why is not None:
        pytest.skip(f"the local Slurm cluster does not answer: {why}")


def _matrix(path: Path, command: str, *, launcher: str, slurm: str = "",
            cases: str = '["R/R", "P/R", "R/P", "P/P"]',
            modules: str = '["attention", "ffn", "logp"]', timeout: float = 600) -> Path:
    table = f"\n[runner.slurm]\n{slurm}\n" if launcher == "slurm" else ""
    path.write_text(
        f'[matrix]\nname = "slurm-test"\nmodules = {modules}\ncases = {cases}\n'
        f'layout = "pairwise"\nmode = "audit"\n\n'
        f"[runner]\ncommand = '{command}'\ntimeout = {timeout}\nlauncher = \"{launcher}\"\n"
        f"{table}\n"
        '[hardware.cpu]\nbackend = "cpu"\n'
    )
    return path


def _pytest(matrix: Path, root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
            f"--rlk-matrix={matrix}", f"--rlk-matrix-root={root}", "--rlk-hardware=cpu",
            "-o", "rlk_progress_interval=5", "-q", *extra]


def _run(matrix: Path, root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_pytest(matrix, root, *extra), capture_output=True, text=True,
                          cwd=matrix.parent, timeout=900, check=False)


def _report(root: Path) -> dict[str, Any]:
    return json.loads((root / "matrix-report.json").read_text())


def _verdicts(report: dict[str, Any]) -> dict[tuple[str, str], str]:
    return {(c["module"], c["case"]): c["verdict"] for c in report["cells"]}


def test_plan_prints_each_cells_batch_script(tmp_path: Path) -> None:
    matrix = _matrix(tmp_path / "m.toml", "true", launcher="slurm",
                     slurm='partition = "gpu"\ntime = "00:10:00"', cases='["R/R", "P/R"]',
                     modules='["attention"]')
    proc = _run(matrix, tmp_path / "root", "--rlk-plan")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("#!/bin/bash") == 2
    assert "#SBATCH --partition=gpu" in proc.stdout and "#SBATCH --time=00:10:00" in proc.stdout
    assert "export RL_KERNEL_ATTENTION_CASE=P/R" in proc.stdout
    assert not (tmp_path / "root").exists()


@pytest.mark.slurm
@pytest.mark.slow  # a whole pairwise matrix twice (~95 s); the other Slurm tests stay quick
def test_pairwise_tiny_matrix_same_verdicts_as_local(tmp_path: Path, slurm_cluster: None) -> None:
    # One module's 2x2 keeps this test short; examples/slurm.toml runs all three (docs/ci.md).
    one = '["attention"]'
    local = _run(_matrix(tmp_path / "local.toml", WORKLOAD, launcher="local", modules=one),
                 tmp_path / "local")
    slurm_root = tmp_path / "slurm"
    slurm = _run(_matrix(tmp_path / "slurm.toml", WORKLOAD, launcher="slurm", modules=one,
                         slurm="max_concurrent = 2\npoll_interval = 0.5"), slurm_root)
    assert (tmp_path / "local" / "matrix-report.json").exists(), local.stdout + local.stderr
    assert slurm_root.joinpath("matrix-report.json").exists(), slurm.stdout + slurm.stderr
    want, got = _report(tmp_path / "local"), _report(slurm_root)
    assert len(got["cells"]) == 4 and got["complete"]
    assert _verdicts(got) == _verdicts(want)
    assert set(_verdicts(got).values()) == {"valid"}, slurm.stdout
    assert slurm.returncode == local.returncode == 0
    # every run is its own job; records carry job id, node, and the node's fingerprints
    runs = {c["artifact_dir"]: c for c in got["cells"]}
    assert len(runs) == 4
    jobs = {c["scheduler"]["job_id"] for c in runs.values()}
    assert len(jobs) == 4
    for cell in runs.values():
        sched = cell["scheduler"]
        assert sched["state"] == "COMPLETED" and sched["nodes"] and sched["marker_host"]
        assert (slurm_root / cell["artifact_dir"] / "node-preflight.json").exists()
        assert (slurm_root / cell["artifact_dir"] / "exit-code").read_text() == "0\n"
        # same host and interpreter as the login node here, so the same fingerprints
        assert cell["hardware_fingerprint"] == want["cells"][0]["hardware_fingerprint"]
        assert cell["build_fingerprint"] == want["cells"][0]["build_fingerprint"]
    assert got["node_fingerprints"]["flags"] == []
    # two jobs at once: some job started before an earlier-submitted one ended
    spans = sorted((c["scheduler"]["start"], c["scheduler"]["end"]) for c in runs.values())
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans)), spans
    assert "slurm job " in slurm.stdout and ("PENDING" in slurm.stdout
                                             or "RUNNING" in slurm.stdout)
    # re-attach: the report command re-reads the Slurm-run root to the same verdicts
    subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.cli", "report",
                    str(slurm_root), "--output", str(tmp_path / "again.json")],
                   check=True, capture_output=True, timeout=300)
    again = json.loads((tmp_path / "again.json").read_text())
    assert _verdicts(again) == _verdicts(got)
    assert {c["scheduler"]["job_id"] for c in again["cells"]} == jobs


def _wait_for(path: Path, proc: subprocess.Popen[str], limit: float = 180.0) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


@pytest.mark.slurm
def test_job_cancelled_from_outside_is_error_cancelled(tmp_path: Path,
                                                        slurm_cluster: None) -> None:
    matrix = _matrix(tmp_path / "m.toml", "sleep 120", launcher="slurm", cases='["R/R"]',
                     modules='["attention"]', slurm="poll_interval = 0.5")
    root = tmp_path / "root"
    proc = subprocess.Popen(_pytest(matrix, root), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    marker = root / "cpu" / "attention-rr" / MARKER_FILE
    _wait_for(marker, proc)
    job_id = marker.read_text().split()[0]
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    out, _ = proc.communicate(timeout=120)
    cell = _report(root)["cells"][0]
    assert cell["verdict"] == "error", out
    assert cell["reasons"][0].startswith(f"CANCELLED: Slurm job {job_id}"), cell["reasons"]
    assert cell["scheduler"]["state"] == "CANCELLED" and proc.returncode == 1


@pytest.mark.slurm
@pytest.mark.slow  # 60-90 s of waiting for Slurm: .ci/run runs it on its own (--run-slow)
def test_job_past_its_slurm_time_limit_is_error_timeout(tmp_path: Path,
                                                         slurm_cluster: None) -> None:
    # Slurm counts limits in whole minutes and checks them every 30 s: about 60-90 s here.
    matrix = _matrix(tmp_path / "m.toml", "sleep 300", launcher="slurm", cases='["R/R"]',
                     modules='["attention"]', slurm='time = "00:00:05"\npoll_interval = 1')
    proc = _run(matrix, tmp_path / "root")
    cell = _report(tmp_path / "root")["cells"][0]
    assert cell["verdict"] == "error", proc.stdout
    assert cell["reasons"][0].startswith("TIMEOUT: Slurm job"), cell["reasons"]
    assert "time limit" in cell["reasons"][0] and cell["scheduler"]["state"] == "TIMEOUT"
    assert proc.returncode == 1
