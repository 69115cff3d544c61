"""Shared helpers for the project's own tests.

Shared preflight probe
----------------------
Every matrix session runs a preflight whose interpreter probe (``_probe.py``: imports torch,
checks capabilities) costs ~4 s of CPU. A test that is *not about preflight* takes it from one
probe shared by the whole test run instead:

- ``make_matrix`` does this for you (every pytester test that writes a matrix file);
- any other test asks for the ``reuse_probe`` fixture (it sets ``RLK_REUSE_PROBE`` for the test,
  which in-process ``pytester.runpytest`` and ``runpytest_subprocess`` both see), or passes
  ``{"RLK_REUSE_PROBE": str(shared_probe)}`` in the env of its own ``subprocess.run``;
- a test about preflight marks itself ``@pytest.mark.fresh_probe``: ``make_matrix`` then leaves
  the variable unset and the session probes for real.

The reuse is never silent: ``preflight.json`` carries ``probe.reused`` (where from, when probed),
``matrix-report.json`` ``preflight.probe_reused``, and the session header says
``rlk: preflight probe REUSED``. The plugin honours the variable only when it is set.

Cheap subprocesses
------------------
Most of the suite's CPU goes to the processes it starts (pytest sessions, cells, the CLI), so:

- the fake framework's logprob sidecars (real ``torch.save`` files, keyed by cases, mode and
  scenario) are saved once per test run, up front, in-process for the common cells
  (``suite_env``); a cell then copies those bytes instead of importing torch (~3 s of CPU);
- where ``PYTHONDONTWRITEBYTECODE`` is set (it is on the CI box), every pytest session the suite
  starts would compile the plugin's ~150 modules again (pytest rewrites an installed plugin's
  asserts: ~1.7 s of CPU per session). For the run, the suite unsets it in its own environment
  and points ``PYTHONPYCACHEPREFIX`` at a temporary directory instead, removed at the end: the
  source tree still gets no bytecode. A ``PYTHONPYCACHEPREFIX`` you set yourself is kept.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# scipy (performance.factorial imports scipy.special lazily; tests compare it with scipy.stats)
# loads C extensions that, imported first inside an in-process `pytester.runpytest`, leave with
# that session's sys.modules snapshot and fail to load again ("cannot load module more than
# once per process"): both are imported here, up front.
import scipy.stats  # noqa: F401
import torch  # noqa: F401

# pytester's in-process runs restore sys.modules afterwards; numpy and torch cannot be imported
# twice in one process, so load the plugin's lazily imported modules once, here, up front.
import pytest_rlkernel_matrix.session  # noqa: F401
from pytest_rlkernel_matrix.machine.preflight import REUSE_PROBE_ENV, save_probe

pytest_plugins = ["pytester"]


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`pytest tests -n auto`: at least 4 workers. Most of this suite waits (pytester sessions in
    subprocesses, a cell's sleeps, the local Slurm's one-minute time limit), not computes:
    measured on the 2-core box, 2 workers took 330 s at ~50% CPU, 4 workers 233 s."""
    return max(4, os.cpu_count() or 1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (long multi-rank matrices)")
    parser.addoption("--run-slurm", action="store_true", default=False,
                     help="also run the tests marked slurm: they start a single-node Slurm on "
                          f"this host (root; stopped again at the end). Or set {SLURM_OPT_IN}=1")


# The local-Slurm tests (tests/test_slurm.py) start daemons and write system files
# (/etc/slurm/slurm.conf, a munge key): opt-in only, by --run-slurm or this variable.
SLURM_OPT_IN = "RLK_SLURM_TESTS"
# Set by the controlling pytest process (xdist workers inherit it): the folder where the worker
# that started the local Slurm leaves a note, so the controller stops it at the very end.
SLURM_SESSION_DIR = "RLK_SLURM_SESSION_DIR"


def slurm_opted_in(config: pytest.Config) -> bool:
    return bool(config.getoption("--run-slurm")) or os.environ.get(SLURM_OPT_IN, "") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slurm = pytest.mark.skip(
        reason=f"slurm: starts a local Slurm on this host; pass --run-slurm or {SLURM_OPT_IN}=1")
    slurm = slurm_opted_in(config)
    skip = pytest.mark.skip(reason="slow: pass --run-slow to run it")
    for item in items:
        if "slurm" in item.keywords and not slurm:
            item.add_marker(skip_slurm)
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip)


_PYCACHE = pytest.StashKey[str]()
_SLURM_NOTES = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    # The Ctrl-C tests need a session that takes Ctrl-C. A shell without job control starts its
    # background jobs with SIGINT ignored, and an ignored signal stays ignored in every process
    # started below; a handled one is the default again in each of them.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line(
        "markers", "fresh_probe: run the real preflight probe (make_matrix shares none)")
    # Before xdist starts its workers (pytest_sessionstart): they and every process they start
    # inherit the prefix. A worker finds it set and leaves it alone.
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        prefix = tempfile.mkdtemp(prefix="rlk-tests-pycache-")
        config.stash[_PYCACHE] = prefix
        os.environ.pop("PYTHONDONTWRITEBYTECODE")
        os.environ["PYTHONPYCACHEPREFIX"] = prefix
    if not os.environ.get("PYTEST_XDIST_WORKER") and slurm_opted_in(config):
        note_dir = tempfile.mkdtemp(prefix="rlk-slurm-session-")
        config.stash[_SLURM_NOTES] = note_dir
        os.environ[SLURM_SESSION_DIR] = note_dir


def _stop_local_slurm(note_dir: str) -> None:
    """The controller, at the very end: a local Slurm some worker started (its note says so) is
    stopped by the script that started it, which also removes what it created."""
    note = Path(note_dir) / "started"
    try:
        if note.exists():
            script = Path(__file__).resolve().parents[1] / "scripts" / "slurm-local.sh"
            proc = subprocess.run([str(script), "stop"], capture_output=True, text=True,
                                  timeout=120, check=False)
            if proc.returncode != 0:
                sys.stderr.write("rlk tests: stopping the local Slurm failed: "
                                 + (proc.stderr or proc.stdout)[-400:] + "\n")
    finally:
        os.environ.pop(SLURM_SESSION_DIR, None)
        shutil.rmtree(note_dir, ignore_errors=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    note_dir = config.stash.get(_SLURM_NOTES, None)
    if note_dir is not None:
        _stop_local_slurm(note_dir)
    prefix = config.stash.get(_PYCACHE, None)
    if prefix is not None:
        os.environ.pop("PYTHONPYCACHEPREFIX", None)
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        shutil.rmtree(prefix, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real interpreter probe for the whole test run (xdist workers share it, file-locked)."""
    from filelock import FileLock

    # Under xdist every worker has its own basetemp; their common parent is per test run.
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / "rlk-shared-probe.json"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            save_probe(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def suite_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`FAKE_SIDECAR_CACHE` for the whole run: fake_framework.py saves each distinct logprob
    sidecar once (a real torch.save) and copies it afterwards instead of importing torch."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "fake-sidecars"
    _warm_fake_sidecars(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FAKE_SIDECAR_CACHE", str(path))
        # Under `-n auto` every worker already keeps a core busy: cells (the reference workload)
        # get one intra-op thread each instead of oversubscribing the cores (OpenMP spin-waits
        # then burn CPU for nothing). An OMP_NUM_THREADS you set yourself is kept.
        if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
            mp.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        yield path


def _warm_fake_sidecars(cache: Path) -> None:
    """Save the sidecars of the pairwise cells (every mode, every scenario that shapes the
    logprobs) into the cache, in this process (torch is loaded here already): ~0.5 s once per
    test run instead of ~3 s per fake cell whose combination ran first. Other combinations are
    still saved by the first fake cell that needs them."""
    import fake_framework as fake
    from filelock import FileLock

    cache.mkdir(parents=True, exist_ok=True)
    done = cache / ".warm"
    with FileLock(str(cache) + ".lock"):
        if done.exists():
            return
        target = cache / ".warm-target.pt"
        for module in fake.MODULES:
            for case in ("R/R", "P/R", "R/P", "P/P"):
                cases = {m: (case if m == module else "R/R") for m in fake.MODULES}
                for mode in ("audit", "strict", "auto", "off"):
                    for scenario in ("clean", "silent_fallback", "contract_mismatch", "nan"):
                        fake._sidecar(target, cases, mode, scenario, 8, str(cache))
        off = dict.fromkeys(fake.MODULES, "P/P")
        fake._sidecar(target, off, "off", "clean", 8, str(cache))
        target.unlink()
        done.write_text("")


@pytest.fixture
def reuse_probe(shared_probe: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Matrix sessions started by this test reuse `shared_probe` (RLK_REUSE_PROBE)."""
    monkeypatch.setenv(REUSE_PROBE_ENV, str(shared_probe))
    yield shared_probe

FAKE = Path(__file__).with_name("fake_framework.py")


def matrix_toml(
    *, mode: str = "audit", layout: str = "pairwise", env: dict[str, str] | None = None,
    timeout: float = 60, extra: str = "", modules: str = '["attention", "ffn", "logp"]',
    hardware: str = '[hardware.cpu]\nbackend = "cpu"\n', r_provider: str = "external",
) -> str:
    env_line = ", ".join(f'{k} = "{v}"' for k, v in (env or {}).items())
    return (
        f'[matrix]\nname = "test"\nmodules = {modules}\nmode = "{mode}"\nlayout = "{layout}"\n'
        f"{extra}\n"
        f'[runner]\ncommand = ["{sys.executable}", "{FAKE}"]\ntimeout = {timeout}\n'
        f'r_provider = "{r_provider}"\n'
        f"env = {{ {env_line} }}\n\n{hardware}"
    )


@pytest.fixture
def make_matrix(pytester: pytest.Pytester, request: pytest.FixtureRequest) -> Callable[..., Path]:
    """Write `matrix.toml` for the fake framework into the pytester directory.

    Sessions in the test reuse the shared probe unless the test is marked `fresh_probe`."""
    if request.node.get_closest_marker("fresh_probe") is None:
        request.getfixturevalue("reuse_probe")

    def make(**kwargs: object) -> Path:
        return pytester.makefile(".toml", matrix=matrix_toml(**kwargs))  # type: ignore[arg-type]

    return make
