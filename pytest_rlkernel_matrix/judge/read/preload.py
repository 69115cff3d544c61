"""The analysis' imports, started while the session's first cell runs.

The plugin never imports torch or numpy at load (installed, it must leave other projects'
pytest as it was), so the first analysis of a session paid the session process's imports
(`import torch`, seconds on a small CPU box, before the evidence read sidecars as numpy arrays)
inside its `evidence_s`. The session calls `start()` just before it launches (or waits for) a
cell's process: the first call starts one daemon thread that, `DELAY_S` later, imports what
reading evidence and deciding a verdict import (`MODULES`) while the cell's process runs; later
calls do nothing. Before it analyses a run the session calls `join()`, which returns the
seconds it waited for the thread (0.0 when it never ran or has finished): that wait is the
plugin's overhead of that cell (`import_wait_s`), never hidden. The imports compete for the
CPUs with the cell's processes while they run; docs/benchmarks.md shows what that costs.

Only a session that runs cells calls `start()`: collection (`--collect-only`), `--rlk-plan`,
`rlk-matrix report` and other projects' sessions never do. A failed import is left to the
analysis, which imports again and reports it as it always did (fail closed). Stdlib only at load.
"""

from __future__ import annotations

import importlib
import threading
import time

# No torch: the evidence reads sidecars as numpy arrays (`judge/read/ptread.load_arrays`) and
# imports
# torch only for a file that reader does not read, so preloading it would cost every session
# seconds of CPU its analysis does not use.
MODULES = (
    "numpy",
    "numpy.ma",
    "pytest_rlkernel_matrix.judge.read.evidence",
    "pytest_rlkernel_matrix.judge.decide",
    "pytest_rlkernel_matrix.judge.read.upstream",
)

# The thread waits this long (or until `join()`) before it imports: the session's own launch
# work (the contamination sampler's first sample of /proc, the cell's process started) then does
# not wait for the interpreter lock the imports hold for most of their run.
DELAY_S = 0.5

_lock = threading.Lock()
_thread: threading.Thread | None = None
_go = threading.Event()
imported: dict[str, float] = {}  # module -> seconds its import took in the thread
failed: dict[str, str] = {}  # module -> why its import failed (the analysis says it again)


def _run(delay: float) -> None:
    _go.wait(delay)
    for name in MODULES:
        t0 = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as exc:  # the analysis imports it again and says why
            failed[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        else:
            imported[name] = round(time.perf_counter() - t0, 6)


def start(delay: float = DELAY_S) -> bool:
    """Start the imports in a daemon thread, once per process, `delay` seconds from now (sooner
    if `join()` is called first); True if this call started it."""
    global _thread
    with _lock:
        if _thread is not None:
            return False
        _thread = threading.Thread(target=_run, args=(delay,), name="rlk-analysis-imports",
                                   daemon=True)
        _thread.start()
        return True


def started() -> bool:
    return _thread is not None


def join() -> float:
    """Wait for the imports to finish; the seconds waited (0.0: nothing to wait for)."""
    thread = _thread
    if thread is None or not thread.is_alive():
        return 0.0
    t0 = time.perf_counter()
    _go.set()  # no more delay: the analysis is waiting
    thread.join()
    return time.perf_counter() - t0
