"""Cells that run side by side share the CPUs (`cpushare`): disjoint affinity slices per xdist
worker, thread variables set to the share unless the user set them, all recorded.

tests/conftest.py sets OMP_NUM_THREADS=1 for the suite under xdist: the share paths below run
their sessions with the thread variables removed, the user paths set their own value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_rlkernel_matrix.run.cpushare import (
    THREAD_VARS,
    Slot,
    cpu_list,
    cpus_for_slot,
    plan_share,
    session_cpus,
)
from pytest_rlkernel_matrix.workload.job import intra_op_threads

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"),
                                reason="needs CPU affinity (Linux)")

# The cell: reads its own affinity and thread variables, then becomes the fake framework.
PROBE = """\
import json, os, sys
from pathlib import Path
out = Path(os.environ["RL_KERNEL_ARTIFACT_DIR"]) / "cell-cpus.json"
out.write_text(json.dumps({"cpus": sorted(os.sched_getaffinity(0)),
                           "env": {k: os.environ.get(k) for k in
                                   ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RLK_MATRIX_THREADS")}}))
os.execv(sys.executable, [sys.executable, sys.argv[1]])
"""


def _env(**set_: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in THREAD_VARS and not k.startswith("PYTEST_XDIST")}
    env.pop("PYTEST_ADDOPTS", None)
    env.update(set_)
    return env


def _session(pytester: pytest.Pytester, make_matrix: Callable[..., Path], root: Path,
             *args: str, env: dict[str, str], cpus: set[int] | None = None,
             runner_env: dict[str, str] | None = None) -> dict[str, dict]:
    """Run a matrix session in a real subprocess (under `cpus` as its affinity mask)."""
    path = make_matrix(modules='["attention"]', env=runner_env or {})
    probe = pytester.path / "probe.py"
    probe.write_text(PROBE)
    fake = Path(__file__).with_name("fake_framework.py")
    text = path.read_text().replace(f'command = ["{sys.executable}", "{fake}"]',
                                    f'command = ["{sys.executable}", "{probe}", "{fake}"]')
    path.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--rlk-matrix-root={root}",
         "-q", *args], cwd=pytester.path, env=env, capture_output=True, text=True, timeout=300,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((root / "matrix-report.json").read_text())
    out = {}
    for rec in report["cells"]:
        run_dir = root / rec["artifact_dir"]
        out[rec["run_key"]] = {
            "record": rec, "seen": json.loads((run_dir / "cell-cpus.json").read_text()),
            "case_env": (run_dir / "matrix-case.env").read_text()}
    return out


def test_slices_are_disjoint_and_cover_the_mask() -> None:
    cpus = [0, 1, 2, 3, 4]
    slices = [cpus_for_slot(cpus, i, 2) for i in range(2)]
    assert slices == [[0, 1, 2], [3, 4]]
    assert [cpus_for_slot([4, 6], i, 2) for i in range(2)] == [[4], [6]]
    assert [cpus_for_slot([0, 1], i, 4) for i in range(4)] == [[0], [1], [0], [1]]
    assert cpus_for_slot([0, 1, 2], 0, 1) == [0, 1, 2]
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_user_thread_variables_win_and_slurm_is_left_alone() -> None:
    slot = Slot(index=1, count=2, worker="gw1", cpus=(0, 1, 2, 3))
    share = plan_share(slot, launcher="local", inherited={}, profile_env={},
                       runner_env={})
    assert (share.cpus, share.threads, share.source) == ([2, 3], 2, "xdist worker 2 of 2 (gw1)")
    assert share.env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                         "RLK_MATRIX_THREADS": "2", "RLK_MATRIX_CPUS": "2-3"}
    user = plan_share(slot, launcher="local", inherited={}, profile_env={},
                      runner_env={"MKL_NUM_THREADS": "3"})
    assert (user.source, user.threads, user.env) == ("user", 3, {})
    assert user.user_set == {"MKL_NUM_THREADS": "matrix.toml [runner.env]"}
    assert user.cpus == [2, 3]  # the affinity slice still holds
    hooked = share.with_hook({"OMP_NUM_THREADS": "5"})
    assert (hooked.source, hooked.threads, hooked.user_set) == (
        "user", 5, {"OMP_NUM_THREADS": "pytest_rlk_cell_env"})
    slurm = plan_share(slot, launcher="slurm", inherited={}, profile_env={}, runner_env={})
    assert (slurm.cpus, slurm.threads, slurm.env, slurm.source) == (None, None, {}, "slurm")
    assert "Slurm" in slurm.share or "slurm" in slurm.share


def test_workload_threads_follow_the_share() -> None:
    assert intra_op_threads({"RLK_MATRIX_THREADS": "4", "OMP_NUM_THREADS": "4"}, 2) == 2
    assert intra_op_threads({"OMP_NUM_THREADS": "3"}, 2) == 3  # the user's, per process
    assert intra_op_threads({}, 1) == len(os.sched_getaffinity(0))
    assert intra_op_threads({"OMP_NUM_THREADS": "x"}, 1) is None


def test_replacement_worker_takes_the_free_slot() -> None:
    from pytest_rlkernel_matrix.integrations.xdist import XdistIntegration

    xd = XdistIntegration.__new__(XdistIntegration)
    xd.slots = {}
    assert [xd._slot("gw0", 2), xd._slot("gw1", 2)] == [0, 1]

    class Node:
        class gateway:
            id = "gw0"

    xd.pytest_testnodedown(Node(), None)
    assert xd._slot("gw2", 2) == 0


@pytest.mark.skipif(len(session_cpus()) < 2, reason="needs 2 CPUs in the affinity mask")
def test_two_concurrent_cells_get_disjoint_cpus(pytester: pytest.Pytester, make_matrix,
                                                tmp_path: Path) -> None:
    pytest.importorskip("xdist")
    mask = session_cpus()
    cells = _session(pytester, make_matrix, tmp_path / "root", "-n", "2",
                     env=_env(FAKE_BUSY_SECONDS="1"))
    workers: dict[str, set[int]] = {}
    for c in cells.values():
        share, seen = c["record"]["cpu_share"], c["seen"]
        n = len(share["cpus"])
        assert seen["cpus"] == share["cpus"]  # the cell ran on the slice it was given
        assert share["threads"] == n and share["user_set"] == {}
        assert seen["env"] == {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n),
                               "RLK_MATRIX_THREADS": str(n)}
        assert share["source"].startswith("xdist worker ") and share["source"].endswith(
            f" of 2 ({c['record']['worker']})")
        assert share["affinity"] == f"applied (cpus {cpu_list(share['cpus'])})"
        assert f"export OMP_NUM_THREADS={n}\n" in c["case_env"]
        assert f"export RLK_MATRIX_CPUS={cpu_list(share['cpus'])}\n" in c["case_env"]
        assert f"# cpu share: cpus {cpu_list(share['cpus'])} (xdist worker" in c["case_env"]
        workers.setdefault(c["record"]["worker"], set()).update(share["cpus"])
    assert len(workers) == 2, workers
    a, b = workers.values()
    assert not a & b and a | b == set(mask)


@pytest.mark.skipif(len(session_cpus()) < 2, reason="needs 2 CPUs in the affinity mask")
def test_serial_cell_gets_the_whole_affinity_mask(pytester: pytest.Pytester, make_matrix,
                                                  tmp_path: Path) -> None:
    mask = session_cpus()
    narrowed = {mask[-1]}  # the session's mask, not os.cpu_count()
    cells = _session(pytester, make_matrix, tmp_path / "one", "-k", "R/R", env=_env(),
                     cpus=narrowed)
    (cell,) = cells.values()
    share = cell["record"]["cpu_share"]
    assert share["cpus"] == cell["seen"]["cpus"] == [mask[-1]]
    assert share["threads"] == 1 and cell["seen"]["env"]["OMP_NUM_THREADS"] == "1"
    assert share["source"] == "serial: the session's whole CPU affinity mask"
    cells = _session(pytester, make_matrix, tmp_path / "all", "-k", "R/R", env=_env())
    (cell,) = cells.values()
    assert cell["record"]["cpu_share"]["cpus"] == cell["seen"]["cpus"] == mask
    assert cell["seen"]["env"]["RLK_MATRIX_THREADS"] == str(len(mask))


def test_user_omp_num_threads_wins_and_is_recorded(pytester: pytest.Pytester, make_matrix,
                                                   tmp_path: Path) -> None:
    # As the suite itself does (tests/conftest.py): the user's OMP_NUM_THREADS is kept.
    cells = _session(pytester, make_matrix, tmp_path / "root", "-k", "R/R",
                     env=_env(OMP_NUM_THREADS="3"), runner_env={"MKL_NUM_THREADS": "2"})
    (cell,) = cells.values()
    share = cell["record"]["cpu_share"]
    assert share["source"] == "user" and share["threads"] == 3
    assert share["user_set"] == {"OMP_NUM_THREADS": "the environment",
                                 "MKL_NUM_THREADS": "matrix.toml [runner.env]"}
    assert cell["seen"]["env"] == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "2",
                                   "RLK_MATRIX_THREADS": None}
    assert "export OMP_NUM_THREADS=3\n" in cell["case_env"]
    assert "export MKL_NUM_THREADS=2\n" in cell["case_env"]
    assert "RLK_MATRIX_THREADS" not in cell["case_env"]
    assert "set by the user (MKL_NUM_THREADS from matrix.toml [runner.env], OMP_NUM_THREADS " \
           "from the environment)" in cell["case_env"]


def test_a_hooks_thread_variable_wins(pytester: pytest.Pytester, make_matrix,
                                      tmp_path: Path) -> None:
    pytester.makeconftest("def pytest_rlk_cell_env(config, cell, env):\n"
                          "    env['OMP_NUM_THREADS'] = '4'\n")
    cells = _session(pytester, make_matrix, tmp_path / "root", "-k", "R/R", env=_env())
    (cell,) = cells.values()
    share = cell["record"]["cpu_share"]
    assert (share["source"], share["threads"]) == ("user", 4)
    assert share["user_set"] == {"OMP_NUM_THREADS": "pytest_rlk_cell_env"}
    # The share's own variables are gone: the workload would otherwise prefer them.
    assert cell["seen"]["env"] == {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": None,
                                   "RLK_MATRIX_THREADS": None}
    assert "RLK_MATRIX_THREADS" not in cell["case_env"]
