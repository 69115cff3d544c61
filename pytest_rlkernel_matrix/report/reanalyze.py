"""Re-read a finished matrix root and rewrite its report (`rlk-matrix report`).

Every record comes from `report.analyze_run` over the run directory's artifacts, the same path the
pytest session used, so a re-analysis reproduces `matrix-report.json` except for `created`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.report.matrix_report import REPORT_FILE, build_report
from pytest_rlkernel_matrix.report.record import (
    CELL_RUN_FILE,
    alias_record,
    analyze_run,
    cell_from_dict,
    error_record,
)
from pytest_rlkernel_matrix.spec.cells import Cases, Cell
from pytest_rlkernel_matrix.spec.terms import CASES, MODULES
from pytest_rlkernel_matrix.store.atomic import write_json_atomic
from pytest_rlkernel_matrix.store.redact import Scrubber
from pytest_rlkernel_matrix.store.safeio import MAX_REPORT_BYTES, Refused, read_text


def _gaps(matrix_file: str | None, hardware: str) -> tuple[Any, ...]:
    if not matrix_file or not Path(matrix_file).exists():
        return ()
    from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

    try:
        profile = load_matrix(Path(matrix_file)).hardware.get(hardware)
    except MatrixFileError:
        return ()
    return profile.expect_unsupported if profile else ()


def _read_old_report(path: Path, notes: list[str]) -> dict[str, Any]:
    if not path.exists() and not path.is_symlink():
        return {}
    try:  # through store: regular, under the root, bounded (a FIFO is refused, not waited on)
        old = json.loads(read_text(path, path.parent, MAX_REPORT_BYTES))
    except (OSError, ValueError, RecursionError, Refused) as exc:
        notes.append(f"{path.name} was unreadable ({type(exc).__name__}: {str(exc)[:200]}): "
                     "rebuilt from the cell directories")
        return {}
    if not isinstance(old, dict) or not isinstance(old.get("cells", []), list):
        notes.append(f"{path.name} was not a report object: rebuilt from the cell directories")
        return {}
    return old


def _cell_from_dir(run_dir: Path) -> Cell:
    """The cell a run directory names (`<hardware>/<module>-<case>`), for an unreadable record."""
    module, _, case = run_dir.name.rpartition("-")
    case = f"{case[:1]}/{case[1:]}".upper()
    if module not in MODULES or case not in CASES:
        module, case = run_dir.name, "?"
    cases = {m: (case if m == module else "R/R") for m in MODULES}
    return Cell(run_dir.parent.name, module, case,
                Cases(cases["attention"], cases["ffn"], cases["logp"]))


_SECOND_RUN = re.compile(r"^(?P<base>.+)\.(?P<kind>repeat|attempt)(?P<n>\d+)$")


def _cell_dirs(root: Path, notes: list[str]) -> list[Path]:
    """The run directories that are cells, for a root without a report: a run-to-run repeat
    (`<cell>.repeatN`) is the claims' evidence, not a cell; of a retried cell's attempts
    (`<cell>.attemptN`) the last one decides, as in the session."""
    by_base: dict[Path, list[tuple[int, Path]]] = {}
    for meta_path in sorted(root.glob(f"*/*/{CELL_RUN_FILE}")):
        d = meta_path.parent
        m = _SECOND_RUN.match(d.name)
        if m and m["kind"] == "repeat":
            notes.append(f"{d.relative_to(root)}: a run-to-run repeat, not read as a cell")
            continue
        base = d.with_name(m["base"]) if m else d
        by_base.setdefault(base, []).append((int(m["n"]) if m else 1, d))
    out = []
    for attempts in by_base.values():
        attempts.sort()
        out.append(attempts[-1][1])
        for _, d in attempts[:-1]:
            notes.append(f"{d.relative_to(root)}: an earlier attempt of "
                         f"{attempts[-1][1].relative_to(root)}, not read as a cell")
    return sorted(out)


@dataclass
class _Task:
    rel: str
    hardware: str
    cell: Cell
    mode: str
    record: dict[str, Any] | None = None
    key_inputs: dict[str, Any] | None = None  # a cache key to make before the analysis
    key: Any = None  # the key made so, as `cache.Key`'s fields (plain data across processes)


def default_jobs() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _analyze_task(root: Path, rel: str, gaps: tuple[Any, ...], cell: Cell, mode: str,
                  key_inputs: dict[str, Any] | None = None) -> tuple[dict[str, Any], Any]:
    """One cell's analysis (in a pool worker: one cell's samples in memory at a time), with
    Python's cycle collector paused: a full-size cell allocates millions of objects (the
    sidecars' lists, dicts and tuples) and frees nearly all of them by reference counting, so
    its 160-odd collections found about a hundred objects in cycles and cost 5% of the
    cell's CPU (measured, docs/benchmarks.md). Cycles made meanwhile are collected after.
    `key_inputs`: the cell's cache key (`cache.cache_key`) is made here first, before its
    files are read (a cell without a cache entry: the key only serves to store the record),
    in the worker instead of one after the other before the pool starts. (record, key)."""
    import gc

    from pytest_rlkernel_matrix.report import cache

    key = None  # (as plain data: the parent rebuilds the `cache.Key`)
    if key_inputs is not None:
        try:
            made = cache.cache_key(root / rel, key_inputs)
            key = (made.key, made.stamps, made.hashed_ns, made.hashed)
        except OSError:  # a directory the key cannot list: no entry stored, the analysis says
            key = None
    if not _PREFAULTED:
        _prefault_heap(root / rel)
    paused = gc.isenabled()
    gc.disable()
    try:
        return analyze_run(root / rel, gaps=gaps, cell=cell, mode=mode, artifact_dir=rel), key
    finally:
        if paused:
            gc.enable()


def _reuse_freed_memory() -> None:
    """glibc only (elsewhere nothing): keep the memory a cell's analysis frees for the next
    cell instead of handing it back to the kernel and faulting it in again. A cell's arrays
    are tens of MB each; page faults cost about 10 us each on the VMs measured
    (docs/benchmarks.md). Only this command's processes (`rlk-matrix report`) set it.
    Also: numpy's arrays without transparent huge pages (numpy asks for them on arrays of
    4 MiB and more, where the kernel leaves it to programs: `madvise` mode): on the VMs
    measured a huge page's fault cost more than the small pages it replaces (a full-size
    cell's first analysis in a process: 0.76 s of system time with them, 0.44 without; the
    same user time), and a cell's arrays live for one analysis. numpy's own switch
    (`NUMPY_MADVISE_HUGEPAGE=0` at import) does the same."""
    try:
        import numpy  # (every cell's analysis imports it)
    except ImportError:
        numpy = None
    switch = getattr(getattr(getattr(numpy, "_core", None), "multiarray", None),
                     "_set_madvise_hugepage", None)
    if callable(switch):
        switch(False)
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, ImportError):
        return
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MiB from the heap, reused
    mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap for reuse


_PREFAULTED: list[int] = []  # the bytes `_prefault_heap` asked for, once per process
_PREFAULT_CAP = 512 << 20


def _prefault_heap(run_dir: Path) -> None:
    """Linux 5.14+ with glibc only (elsewhere nothing), once per process, after
    `_reuse_freed_memory`: the heap grown by about what the first cell's analysis takes
    (2.5 x its sidecars' bytes, at most 512 MiB) and its pages made present by one
    `madvise(MADV_POPULATE_WRITE)`, then given back to malloc, which keeps them (the trim
    threshold) for the analysis. Faulting them in one by one cost about 4 us a page on the
    VMs measured, populating them about 2 (docs/benchmarks.md); later cells reuse the same
    memory either way."""
    want = 0
    for sub in ("mismatch-sidecars", "mismatch_sidecars"):
        try:
            with os.scandir(run_dir / sub) as it:
                want += sum(e.stat(follow_symlinks=False).st_size for e in it
                            if e.name.endswith(".pt"))
        except OSError:
            continue
    want = min(_PREFAULT_CAP, want * 5 // 2)
    _PREFAULTED.append(want)
    if want < 32 << 20:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        malloc, free, madvise, sbrk = libc.malloc, libc.free, libc.madvise, libc.sbrk
        malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        free.restype, free.argtypes = None, [ctypes.c_void_p]
        sbrk.restype, sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
        madvise.restype = ctypes.c_int
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError, ImportError):
        return
    low = sbrk(0)
    blocks = [malloc(16 << 20) for _ in range(want // (16 << 20))]  # (below the mmap
    high = sbrk(0)  # threshold `_reuse_freed_memory` sets: from the heap, one after another)
    for block in reversed(blocks):
        if block:
            free(block)
    if low and high and high > low:
        start = (low + 4095) & ~4095
        madvise(start, high - start, 23)  # MADV_POPULATE_WRITE (an older kernel: EINVAL)


def _one_thread() -> None:
    """A pool worker: one torch thread (workers x torch's default threads would oversubscribe
    the CPUs the pool is sized to; measured in docs/benchmarks.md), also where torch is only
    imported later (a `.pt` file the fast reader hands to `torch.load`); and freed memory
    kept for the next cell (`_reuse_freed_memory`)."""
    _reuse_freed_memory()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    else:
        os.environ["OMP_NUM_THREADS"] = "1"


def _run_tasks(root: Path, todo: list[_Task], gaps: dict[str, tuple[Any, ...]], jobs: int,
               done: Callable[[_Task], None]) -> None:
    if jobs <= 1 or len(todo) <= 1:
        if todo:
            _reuse_freed_memory()
        for task in todo:
            task.record, task.key = _analyze_task(root, task.rel, gaps[task.hardware],
                                                  task.cell, task.mode, task.key_inputs)
            done(task)
        return
    # fork: the workers start at once with this process's imports (the CLI runs no threads).
    # torch is not imported here: sidecars the `.pt` reader reads need none (numpy arrays,
    # `judge.read.ptread.load_arrays`); a worker imports it only for a file that needs torch.load.
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    import pytest_rlkernel_matrix.judge.decide

    # What every cell's analysis imports (numpy among them), imported once here before the
    # workers fork, instead of once in each worker.
    import pytest_rlkernel_matrix.judge.read.evidence
    import pytest_rlkernel_matrix.run.runner
    import pytest_rlkernel_matrix.spec.limits  # noqa: F401

    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=ctx,
                             initializer=_one_thread) as pool:
        futures = {pool.submit(_analyze_task, root, t.rel, gaps[t.hardware], t.cell, t.mode,
                               t.key_inputs): t for t in todo}
        for future in as_completed(futures):
            task = futures[future]
            try:
                task.record, task.key = future.result()
            except Exception as exc:  # a worker died (killed, out of memory): this cell errs
                task.record = error_record(task.cell, task.mode, "analysis failed in a worker "
                                           f"process: {type(exc).__name__}: {str(exc)[:300]}",
                                           task.rel)
            done(task)


def attach_comparisons(records: list[dict[str, Any]], root: Path,
                       baselines: Mapping[int, str] | None = None) -> None:
    """A re-analysis (`rlk-matrix report`): each factor cell's record gets the `factor` entry
    the session gave it, compared with its baseline cell's re-read record. `baselines` maps a
    record's index to the baseline cell id the old report named; otherwise the baseline is
    the first unmodified cell of the same hardware and cases (as the session chooses it).
    A baseline with no record is "not judged: baseline cell not run"."""
    cells: list[tuple[Cell, dict[str, Any]]] = []
    for rec in records:
        try:
            cells.append((cell_from_dict(rec), rec))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    by_id = {c.id: rec for c, rec in reversed(cells) if c.factor is None}
    layout = [c for c, _ in cells if c.factor is None]
    for i, rec in enumerate(records):
        f = rec.get("factor")
        if not isinstance(f, Mapping) or not f.get("name"):
            continue
        try:
            cell = cell_from_dict(rec)
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        base_id = (baselines or {}).get(i) or cell.baseline_cell(layout).id
        base = by_id.get(base_id) or {"verdict": "not_run",
                                      "reasons": [f"no record of {base_id} in the report"]}
        own = rec.get("artifact_dir")
        rel = base.get("artifact_dir")
        from pytest_rlkernel_matrix.judge.localise.factors import (
            factor_block,  # numpy: factor cells only
        )

        rec["factor"] = factor_block(rec, f, base_id, root / own if own else None,
                                     root / rel if rel else None, base)


NO_ENTRY = "no cache entry"  # cache.lookup's reason for a directory never cached (first report)


def reanalyze(root: Path, output: Path | None = None, *, jobs: int | None = None,
              use_cache: bool = True, log: Callable[[str], None] | None = None,
              progress: bool | None = None) -> Path:
    """Rewrite `<root>/matrix-report.json` (or `output`) from the artifacts under `root`.

    A corrupt `matrix-report.json` is rebuilt from the cell directories; a corrupt
    `cell-run.json` makes that cell an `error` record naming the file, never an exception.
    Cells are analysed in `jobs` processes (default: the CPUs of this process's affinity);
    a cell whose artifacts are unchanged since the last report comes from the analysis cache
    (`report/cache.py`) unless `use_cache` is false. `log` gets one line per cache miss and a
    summary; `progress` shows a bar (None: on a terminal, never in CI: `report.progress`).
    """
    from pytest_rlkernel_matrix.report import cache

    old_path = root / REPORT_FILE
    notes: list[str] = []
    old = _read_old_report(old_path, notes)
    matrix = old.get("matrix", {}) if isinstance(old.get("matrix"), dict) else {}
    tasks: dict[str, _Task] = {}
    gaps: dict[str, tuple[Any, ...]] = {}

    def task(rel: str, hardware: str, cell: Cell, mode: str) -> _Task:
        if hardware not in gaps:
            gaps[hardware] = tuple(_gaps(matrix.get("file"), hardware))
        return tasks.setdefault(rel, _Task(rel, hardware, cell, mode))

    plan: list[tuple[_Task | None, Cell | None, dict[str, Any]]] = []
    if old.get("cells"):
        for cell_data in old["cells"]:
            try:
                cell = cell_from_dict(cell_data)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                notes.append(f"{REPORT_FILE}: a cell entry is unusable ({exc!r}): dropped")
                continue
            rel = cell_data.get("artifact_dir")
            if not rel or not (root / rel / CELL_RUN_FILE).exists():
                plan.append((None, None, cell_data))  # not run / refused: nothing to re-read
                continue
            plan.append((task(rel, cell.hardware, cell, str(cell_data.get("mode"))), cell,
                         cell_data))
    else:
        for run_dir in _cell_dirs(root, notes):
            rel = str(run_dir.relative_to(root))
            plan.append((task(rel, run_dir.parent.name, _cell_from_dir(run_dir),
                              str(matrix.get("mode", "?"))), None, {}))
    keys: dict[str, cache.Key | None] = {}
    todo: list[_Task] = []
    first: list[str] = []
    scrub = Scrubber.from_env(os.environ).obj
    for t in tasks.values():
        if use_cache:
            # The cell and mode label only a record whose cell-run.json is unusable, which is
            # never cached (`done`): the key is the directory and the matrix file's gaps.
            inputs = {"artifact_dir": t.rel, "gaps": [repr(g) for g in gaps[t.hardware]]}
            hit, why, keys[t.rel] = cache.lookup(root, t.rel, inputs, defer=True)
            if keys[t.rel] is None:  # no entry: the key is made where the cell is read
                t.key_inputs = inputs
            if hit is not None:
                t.record = scrub(hit)
                continue
            if why == NO_ENTRY:
                first.append(t.rel)  # a first report: said once, as a count
            elif log is not None:
                log(f"cache: {t.rel}: read again: {why}")
        todo.append(t)
    if first and log is not None:
        log(f"cache: {len(first)} of {len(tasks)} run directories not cached yet ({NO_ENTRY}, "
            "as on a first report): read")
    bar = _bar(len(todo), progress)

    def done(t: _Task) -> None:
        reasons = (t.record or {}).get("reasons") or [""]
        key = keys.get(t.rel) or (None if t.key is None else cache.Key(*t.key))
        if use_cache and t.record is not None and key is not None and not str(
                reasons[0]).startswith(("cell-run.json: ", "analysis failed")):
            cache.store(root, t.rel, key, t.record)
        bar.update(t)

    try:
        _run_tasks(root, todo, gaps, jobs or default_jobs(), done)
    finally:
        bar.close()
    if log is not None and use_cache:
        log(f"cache: {len(tasks) - len(todo)} of {len(tasks)} run directories unchanged "
            f"(reused), {len(todo)} read")
    records: list[dict[str, Any]] = []
    baselines: dict[int, str] = {}  # record index -> the baseline cell the old report named
    for t, cell, cell_data in plan:
        old_factor = cell_data.get("factor")
        if isinstance(old_factor, dict) and isinstance(old_factor.get("baseline_cell"), str):
            baselines[len(records)] = old_factor["baseline_cell"]
        if t is None:
            records.append(cell_data)
        elif cell is None:
            records.append(t.record or {})
        else:
            record = alias_record(t.record or {}, cell)
            record["shared_with"] = cell_data.get("shared_with", [])
            records.append(record)
    attach_comparisons(records, root, baselines)
    expected = old.get("expected_cells", len(records))
    report = build_report(
        records, matrix=matrix, matrix_root=root.absolute(),  # as the session writes it
        preflight=old.get("preflight") if isinstance(old.get("preflight"), dict) else None,
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        expected_cells=expected if isinstance(expected, int) else len(records),
        interrupted=bool(old.get("interrupted", False)),
        memo=root / cache.CACHE_DIR if use_cache else None,
    )
    if isinstance(old.get("selection"), dict):  # a rerun's or a subset's selection stays
        from pytest_rlkernel_matrix.report.rerun import apply_selection

        apply_selection(report, old["selection"])
    if notes:
        report["reanalysis_notes"] = notes
    target = output or old_path
    from pytest_rlkernel_matrix.report.html import HTML_FILE, write_html

    pre = root / "preflight.json"
    try:
        pre_data = (json.loads(read_text(pre, root, MAX_REPORT_BYTES))
                    if pre.exists() or pre.is_symlink() else None)
    except (OSError, ValueError, RecursionError, Refused):
        pre_data = None
    html = target.with_name(HTML_FILE)
    rendering = _html_beside(report, html, pre_data)
    try:
        write_json_atomic(target, report)
    except BaseException:
        _html_done(rendering, None)
        raise
    if not _html_done(rendering, html):
        write_html(report, html, pre_data)
    return target


def _html_beside(report: dict[str, Any], html: Path, pre: Any) -> tuple[int, Path] | None:
    """Where this process may fork (POSIX, no other thread): the HTML page rendered by a
    child process into a file beside `html` while this process writes the JSON (each took
    a tenth of a second or two at 12 full-size cells); (child pid, its file), else None."""
    import threading

    if not hasattr(os, "fork") or threading.active_count() != 1:
        return None
    from pytest_rlkernel_matrix.report.html import write_html

    part = html.with_name(f".{html.name}.{os.getpid()}.rendered")
    try:
        pid = os.fork()
    except OSError:
        return None
    if pid == 0:  # the child: the page, written atomically under its own name, or status 1
        code = 1
        try:
            write_html(report, part, pre)
            code = 0
        finally:
            os._exit(code)
    return pid, part


def _html_done(rendering: tuple[int, Path] | None, html: Path | None) -> bool:
    """Wait for `_html_beside`'s child; move its page to `html` (None: discard it). False
    where there is no page (no child, or it failed: the caller renders it here, so its
    error, if any, is raised here)."""
    if rendering is None:
        return False
    pid, part = rendering
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        status = -1
    if html is not None and status == 0 and part.is_file():
        os.replace(part, html)
        return True
    part.unlink(missing_ok=True)
    return False



class _Bar:
    """A tqdm bar over the cells being read, on a terminal only (silent in CI logs)."""

    def __init__(self, total: int, show: bool) -> None:
        self._bar: Any = None
        if show and total:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="cell", desc="rlk-matrix report",
                             file=sys.stderr, dynamic_ncols=True, leave=False)

    def update(self, task: _Task) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(task.rel, refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _bar(total: int, progress: bool | None) -> _Bar:
    from pytest_rlkernel_matrix.report.progress import on_terminal

    return _Bar(total, progress if progress is not None else on_terminal(sys.stdout, sys.stderr))
