"""pytest hooks and options: thin wiring around `session`, `collect`, `report`.

Loaded in every pytest session through the `pytest11` entry point, so it imports nothing heavy:
no torch, vllm or megatron; the matrix is only loaded when a matrix file is being collected.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_rlkernel_matrix import hooks
from pytest_rlkernel_matrix.collect import (
    CELL_KEY,
    RECORD_KEY,
    SESSION_KEY,
    MatrixFileNode,
    MatrixItem,
)
from pytest_rlkernel_matrix.hardware import asked, check_names, select_hardware
from pytest_rlkernel_matrix.integrations import pytest_core as core
from pytest_rlkernel_matrix.spec.cells import Cell
from pytest_rlkernel_matrix.spec.terms import LAYOUTS, MODES, plural

if TYPE_CHECKING:
    from pytest_rlkernel_matrix.session import MatrixSession
from pytest_rlkernel_matrix.collect import CellFailure, failure_text

PREFLIGHT_FILE = "preflight.json"

MARKERS = (
    "rlk_hardware(name): matrix cell on this hardware profile",
    "rlk_module(name): matrix cell varying this module (attention, ffn, logp)",
    "rlk_case(case): matrix cell of this training/rollout case, e.g. 'P/R'",
    "rlk_baseline: the aligned R/R baseline cell (all modules R/R)",
    "rlk_factor(name): factor cell varying this framework factor ([factors.<name>])",
    "rlk_verdict(word): added after a cell ran: valid, unsupported, fallback, ...",
)
LETTERS = {"valid": ".", "unsupported": "u", "fallback": "b", "contract_mismatch": "c",
           "incomparable": "i", "error": "e"}


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hooks)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rlkernel-matrix", "RL-Kernel train/rollout ablation matrix")
    group.addoption("--rlk-matrix", metavar="PATH", default=None,
                    help="matrix file to run (default: the rlk_matrix ini value, else "
                    "matrix.toml in the rootdir when it exists)")
    group.addoption("--rlk-hardware", metavar="NAME[,NAME]", default=None,
                    help="hardware profile(s) to run; default: the profile preflight detects")
    group.addoption("--rlk-mode", choices=MODES, default=None,
                    help="strict|audit|auto|off (default: [matrix] mode)")
    group.addoption("--rlk-layout", choices=LAYOUTS, default=None,
                    help="pairwise|reduced|module-factorial|full (default: [matrix] layout)")
    group.addoption("--rlk-matrix-root", metavar="DIR", default=None,
                    help="output directory (default: $MATRIX_ROOT or "
                    "outputs/rlkernel/ablation-matrix-$MATRIX_STAMP next to the matrix file)")
    group.addoption("--rlk-repeat-baseline", action="store_true", default=False,
                    help="run the all-R baseline twice (same seed, separate processes) and "
                    "judge the run_to_run_bitwise claim ([reproducibility] runs = 2)")
    group.addoption("--rlk-processes", metavar="N|auto", default=None,
                    help="processes per cell: the correctness run, then N-1 measured runs "
                    "interleaved across the cells, so timings support a statement (default: "
                    "[performance] processes, else 1); auto: a first stage of 3, then as many "
                    "as the statements need within --rlk-perf-budget")
    group.addoption("--rlk-perf-budget", metavar="MINUTES", type=float, default=None,
                    help="with --rlk-processes=auto: minutes the measured runs may take "
                    "(default: [performance] budget, 10)")
    group.addoption("--rlk-plan", action="store_true", default=False,
                    help="print each cell's env and command; run nothing")
    group.addoption("--rlk-probe", action="store_true", default=False,
                    help="after a drifting cell, a separate probe run of it localises the "
                    "drift to its first divergent operator (as [probe] when = \"drift\")")
    group.addoption("--rlk-profile", action="store_true", default=False,
                    help="after each cell, a separate profile run of it (torch.profiler, never "
                    "a measured run) says which module's kernels cost the time "
                    "(as [profile] when = \"always\")")
    # Default "": unset, the rootdir's matrix.toml is used only if it exists (a project without
    # one is left alone); a file named here or by --rlk-matrix must exist.
    parser.addini("rlk_matrix", "matrix file collected by default (default: matrix.toml in the "
                  "rootdir, when it exists)", default="")
    parser.addini("rlk_progress_interval", "seconds between progress lines of a running cell",
                  default="30")


DEFAULT_MATRIX = "matrix.toml"


def _matrix_path(config: pytest.Config) -> tuple[Path, bool]:
    """The matrix file of this session and whether `--rlk-matrix` named it."""
    option = config.getoption("rlk_matrix")
    if option:
        return Path(option).expanduser().resolve(), True
    return (config.rootpath / (_ini_matrix(config) or DEFAULT_MATRIX)).resolve(), False


def _ini_matrix(config: pytest.Config) -> str:
    """The `rlk_matrix` ini value ("" when no ini file or `-o` sets it)."""
    return str(config.getini("rlk_matrix") or "").strip()


def _no_matrix(config: pytest.Config, path: Path, explicit: bool) -> bool:
    """No matrix file named, and the default one absent or not an RL-Kernel matrix (another
    project's `matrix.toml`): a session that did not ask for this plugin."""
    if explicit or _ini_matrix(config) or _named(config, path):
        return False
    from pytest_rlkernel_matrix.spec.recognise import is_rlk_matrix

    return not path.is_file() or not is_rlk_matrix(path)


def _named(config: pytest.Config, path: Path) -> bool:
    """Did the command line name the matrix file itself (`pytest matrix.toml`)? Then it is the
    plugin's, errors and all: a malformed file is reported, never passed over as foreign."""
    here = config.invocation_params.dir
    return any(Path(here, str(a).split("::")[0]).resolve() == path.resolve()
               for a in config.invocation_params.args if not str(a).startswith("-"))


def _in_play(config: pytest.Config, path: Path) -> bool:
    """Will this session collect the matrix file? (an arg is the file or a folder above it)."""
    for arg in config.args:
        target = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if target == path or target in path.parents:
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    path, explicit = _matrix_path(config)
    if _no_matrix(config, path, explicit):
        return  # installed in an environment, not used by this project: add nothing
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    if explicit and config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args = [str(path)]
    elif explicit and not _in_play(config, path):
        config.args.append(str(path))
    if not _in_play(config, path) or core.informs_only(config):
        return
    # Heavy imports (pydantic, numpy) only in sessions that run a matrix.
    from pytest_rlkernel_matrix.session import MatrixSession, default_root
    from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

    try:
        matrix = load_matrix(path)
    except MatrixFileError as exc:
        raise pytest.UsageError(str(exc)) from None
    if config.getoption("rlk_repeat_baseline"):
        matrix = matrix.model_copy(update={
            "reproducibility": matrix.reproducibility.model_copy(update={"runs": 2})})
    from pytest_rlkernel_matrix.session.scheduler import performance_options

    matrix = performance_options(matrix, config.getoption("rlk_processes"),
                                 config.getoption("rlk_perf_budget"))
    if config.getoption("rlk_profile"):
        matrix = matrix.model_copy(update={
            "profile": matrix.profile.model_copy(update={"when": "always"})})
    plan = bool(config.getoption("rlk_plan"))
    # Commands that only inform (--collect-only, --rlk-plan, --setup-plan, --fixtures-per-test)
    # run no cell, so they write nothing either.
    dry = plan or core.informs(config)
    mode = config.getoption("rlk_mode") or matrix.matrix.mode
    layout = config.getoption("rlk_layout") or matrix.matrix.layout
    worker = getattr(config, "workerinput", None)
    if worker is not None and "rlk" in worker:
        shared = worker["rlk"]
        session = MatrixSession(matrix=matrix, matrix_path=path, root=Path(shared["root"]),
                                hardware=list(shared["hardware"]), mode=mode, layout=layout,
                                token=shared["token"], created=shared["created"])
        session.fingerprints = dict(shared["fingerprints"])
        session.started = float(shared.get("started") or session.started)
        session.probe = bool(config.getoption("rlk_probe"))
        session.devices = shared.get("devices")
        session.worker = shared.get("worker")
        slot = shared.get("cpu_slot")
        if slot:
            from pytest_rlkernel_matrix.run.cpushare import Slot

            session.cpu_slot = Slot(index=int(slot["index"]), count=int(slot["count"]),
                                    worker=session.worker, cpus=tuple(slot["cpus"]))
        pre = session.root / PREFLIGHT_FILE
        if pre.exists():  # the controller's, read through store (strict JSON, bounded)
            from pytest_rlkernel_matrix.store.safeio import read_json

            session.preflight = read_json(pre, session.root)
        else:
            session.preflight = {}
    else:
        from datetime import UTC, datetime

        now = datetime.now(UTC)  # one instant: the root's stamp and the run ids' stamp
        root = default_root(path, config.getoption("rlk_matrix_root"), os.environ, now)
        check_names(asked(config), matrix, path)  # what can be checked before the root
        undo: Callable[[], None] = lambda: None  # noqa: E731
        if not dry:
            # One session per matrix root, claimed before anything is written or probed.
            auto = not (config.getoption("rlk_matrix_root") or os.environ.get("MATRIX_ROOT")
                        or os.environ.get("MATRIX_STAMP"))
            from pytest_rlkernel_matrix.run.rootlock import RootError, claim_fresh, claim_session

            try:
                root, undo = (claim_fresh(root, config.add_cleanup, (PREFLIGHT_FILE,
                                                                     "matrix-report.json"))
                              if auto else (root, claim_session(root, config.add_cleanup)))
            except RootError as exc:
                raise pytest.UsageError(str(exc)) from None
        try:
            for name in (PREFLIGHT_FILE, "matrix-report.json", "matrix-report.html"):
                if not dry and (root / name).exists():
                    raise pytest.UsageError(
                        f"matrix root {root} already holds {name} from another session: "
                        "artifacts are never overwritten; pass a new --rlk-matrix-root or "
                        "MATRIX_STAMP"
                    )
            raw_dir = None if dry else root / "preflight-raw"
            if raw_dir is not None:
                raw_dir.mkdir(parents=True, exist_ok=True)
            hardware, data = select_hardware(config, matrix, path, plan, raw_dir)
            session = MatrixSession(matrix=matrix, matrix_path=path, root=root,
                                    hardware=hardware, mode=mode, layout=layout, plan=plan,
                                    plan_named=plan and bool(asked(config)),
                                    created=now.isoformat(timespec="seconds"),
                                    preflight=data, dry=dry,
                                    probe=bool(config.getoption("rlk_probe")))
            if data:
                from pytest_rlkernel_matrix.machine import preflight as pf

                hw_fp, build_fp = pf.fingerprint(data)
                session.fingerprints = {"hardware_fingerprint": hw_fp,
                                        "build_fingerprint": build_fp}
            if not dry:
                session.write_json(root / PREFLIGHT_FILE, data)
                session.selection = core.selection(config, session)
                session.forget_root = _forgetter(root, undo)
        except BaseException:
            undo()  # a usage error (or worse) before the session began leaves nothing behind
            raise
    config.stash[SESSION_KEY] = session
    if not session.dry:
        _take_signals(config, session, worker is None)
    if worker is None:
        session.progress = _progress_printer(config)
        session.progress_every = float(config.getini("rlk_progress_interval"))
    config.pluginmanager.register(MatrixHooks(config, session), "rlk-matrix-session")
    if config.pluginmanager.hasplugin("xdist"):
        from pytest_rlkernel_matrix.integrations import xdist

        config.pluginmanager.register(xdist.XdistIntegration(session), "rlk-xdist")
    from pytest_rlkernel_matrix.integrations import json_report, pytest_html

    pytest_html.install(config)
    json_report.install(config)


def _forgetter(root: Path, undo: Callable[[], None]) -> Callable[[], None]:
    """What a session that ran no cell leaves of its root: nothing (its preflight.json, which
    did not exist before it, then the root lock's own undo)."""

    def forget() -> None:
        with contextlib.suppress(OSError):
            (root / PREFLIGHT_FILE).unlink()
        undo()

    return forget


def _take_signals(config: pytest.Config, session: MatrixSession, controller: bool) -> None:
    """SIGTERM (a CI cancel) stops the session like Ctrl-C: KeyboardInterrupt, the running cell's
    processes killed and recorded, the report written. The controller also marks its
    environment so that its xdist workers can be told to stop (`MatrixSession.stop_everything`).
    """
    from pytest_rlkernel_matrix.run import procs

    procs.STOP.install()
    config.add_cleanup(procs.STOP.uninstall)
    if controller:
        previous = os.environ.get(procs.SESSION_VAR)
        os.environ[procs.SESSION_VAR] = session.token

        def restore() -> None:
            if previous is None:
                os.environ.pop(procs.SESSION_VAR, None)
            else:
                os.environ[procs.SESSION_VAR] = previous

        config.add_cleanup(restore)


def progress_line(cell_id: str, elapsed: float, line: str, width: int) -> str:
    """`[rlk] <cell>: <s> s, run.log: <last line>`, cut at a word boundary to `width`."""
    import textwrap

    tail = " ".join(line.split()) or "(empty)"
    source = "" if tail.startswith("slurm job ") else "run.log: "  # Slurm: the job's state
    head = f"[rlk] {cell_id}: {elapsed:.0f} s, {source}"
    room = max(width - len(head), 20)
    return head + textwrap.shorten(tail, width=room, placeholder=" ...")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto` on a GPU machine: floor(visible GPUs / gpus_per_cell) workers."""
    path, explicit = _matrix_path(config)
    if _no_matrix(config, path, explicit) or not path.exists() or not (
            explicit or _in_play(config, path)):
        return None
    from pytest_rlkernel_matrix.integrations.xdist import auto_num_workers

    return auto_num_workers(config, path)


def _progress_printer(config: pytest.Config) -> Any:
    """Elapsed time and the last `run.log` line of a long cell, on a line of its own."""

    def show(cell: Cell, elapsed: float, line: str) -> None:
        capman = config.pluginmanager.getplugin("capturemanager")
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is None:
            return
        writer = config.get_terminal_writer()
        text = progress_line(cell.id, elapsed, line, min(writer.fullwidth, 160) - 1)

        def write() -> None:
            # Never inside a row of progress dots: `-q` writes them without a file prefix,
            # so `write_line`'s own newline check does not see them.
            if writer.width_of_current_line:
                writer.line()
            # The line is ended here: pytest must neither end it again (a blank line) nor, at
            # the next result, start a new row with the file's name again (`matrix.toml` every
            # 30 s, issue 53); its dots go on in a row of their own after this line.
            where = getattr(reporter, "currentfspath", None)
            reporter.currentfspath = None
            reporter.write_line(text)
            reporter.currentfspath = where

        if capman is not None:
            with capman.global_and_fixture_disabled():
                write()
        else:
            write()

    return show


def _session(config: pytest.Config) -> MatrixSession | None:
    return config.stash.get(SESSION_KEY, None)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    session = _session(parent.config)
    if session is not None and file_path.resolve() == session.matrix_path:
        # Outside the rootdir pytest would give the file an empty node id (`::cpu::...`).
        nodeid = matrix_nodeid(parent.config, session.matrix_path)
        return MatrixFileNode.from_parent(parent, path=file_path, nodeid=nodeid)
    return None


def matrix_nodeid(config: pytest.Config, path: Path) -> str:
    """The matrix file's node id: its path relative to the rootdir (`../m.toml` outside it)."""
    try:
        rel = str(path.relative_to(config.rootpath))
    except ValueError:
        rel = os.path.relpath(path, config.rootpath)
    return rel.replace(os.sep, "/")


class MatrixHooks:
    """Hooks active only in sessions that collect a matrix file (registered per session)."""

    def __init__(self, config: pytest.Config, session: MatrixSession) -> None:
        self.config = config
        self.session = session
        self.is_worker = hasattr(config, "workerinput")
        self.planned: list[pytest.Item] = []
        self.progress: Any = None  # report.progress.SessionProgress, on a terminal only
        self.words = core.SummaryWords()
        config.pluginmanager.register(self.words, "rlk-matrix-summary-words")

    def pytest_report_header(self) -> list[str]:
        # a fault drill's session says so first (report/drill.py; issue 43)
        drill = os.environ.get("RLK_REF_FAULT", "").strip()
        top = [f"rlk: FAULT DRILL RLK_REF_FAULT={drill}: a planted fault, this session's "
               "timings and drifts are the drill's"] if drill else []
        probe = self.session.preflight.get("probe") or {}
        if probe.get("reused"):
            return [*top, f"rlk: preflight probe REUSED from {probe['reused']['from']} "
                    "(RLK_REUSE_PROBE), not run for this session"]
        if probe.get("reuse_refused"):
            return [*top, f"rlk: RLK_REUSE_PROBE not used: {probe['reuse_refused']}"]
        return top

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        ms = self.session
        cells = [item.stash[CELL_KEY] for item in items if isinstance(item, MatrixItem)]
        ms.set_selected(cells)
        if ms.plan:
            from pytest_rlkernel_matrix.plan import plan_text

            writer = self.config.get_terminal_writer()
            writer.line("")
            writer.line(f"# rlk plan: {plural(len(cells), 'cell')}, matrix root {ms.root}")
            writer.line(plan_text(ms, cells, ms.mode))
            # Planned, not deselected: they leave the run and the final line says so.
            self.planned = [i for i in items if isinstance(i, MatrixItem)]
            items[:] = [i for i in items if not isinstance(i, MatrixItem)]
        elif not self.is_worker and not ms.dry and ms.matrix.runner.launcher == "slurm":
            # Every selected cell is queued now; each item then waits for its own job.
            hook = self.config.hook.pytest_rlk_cell_env

            def env_hook(cell: Cell, env: dict[str, str]) -> None:
                hook(config=self.config, cell=cell, env=env)

            ms.submit_ahead(cells, ms.mode, env_hook)
        # The bar's line per cell only under -v, where pytest writes a line per item too: in
        # the default mode it would break pytest's row of dots (whose [ 25%] is the progress).
        verbose = self.config.get_verbosity() >= 1
        if not (ms.plan or self.is_worker or ms.dry) and cells and verbose:
            from pytest_rlkernel_matrix.report import progress

            if progress.on_terminal(sys.stdout, sys.stderr):
                self.progress = progress.SessionProgress(len(cells))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Any:
        report = yield
        if isinstance(item, MatrixItem) and report.when == "call":
            record = item.stash.get(RECORD_KEY, None)
            if record is not None:
                report.rlk_verdict = record["verdict"]
                report.rlk_record = record
                item.add_marker(pytest.mark.rlk_verdict(record["verdict"]))
                if report.skipped and isinstance(report.longrepr, tuple):
                    # `-rs` names the cell (`SKIPPED [1] matrix.toml::cpu::ffn[R/R]: ...`),
                    # not the line of this plugin that skipped it
                    report.longrepr = (f"{item.path}::{item.parent.name}::{item.name}", None,
                                       str(report.longrepr[2]))
        return report

    @pytest.hookimpl(trylast=True)  # the bar's line after pytest's own line of the item
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = getattr(report, "rlk_record", None)
        if record is None or self.is_worker:
            return
        self.session.add_record(report.nodeid, record)
        core.junit_suite_property(self.config, f"rlk_verdict:{report.nodeid}",
                                  record["verdict"])
        self.config.hook.pytest_rlk_cell_record(config=self.config, record=record)
        self.session.write_report()
        reporter = self.config.pluginmanager.getplugin("terminalreporter")
        if self.progress is not None and reporter is not None:
            reporter.write_line(self.progress.line(
                f"{record['hardware']} {record['module']} {record['case']}: {record['verdict']}"))

    def pytest_runtest_teardown(self, item: pytest.Item, nextitem: pytest.Item | None) -> None:
        """After this process's last item: the measured runs of the runs it started
        (`[performance] processes`), interleaved round by round (`session.scheduler`)."""
        ms = self.session
        ms.items_ran.add(item.nodeid)
        auto_worker = ms.matrix.performance.auto and self.is_worker
        if nextitem is None and (ms.ran or auto_worker) and not (ms.plan or ms.dry):
            ms.all_items = {i.nodeid for i in item.session.items}

            total = ms.matrix.performance.processes
            reporter = self.config.pluginmanager.getplugin("terminalreporter")
            say: Any = None
            if total > 1 and reporter is not None and not self.is_worker:
                capman = self.config.pluginmanager.getplugin("capturemanager")

                def _say(line: str) -> None:  # past the test's output capture, as it happens
                    if capman is None:
                        reporter.write_line(line)
                        return
                    with capman.global_and_fixture_disabled():
                        reporter.write_line(line)

                say = _say
                say(f"rlk: measured runs: processes 2-{total} of "
                    f"{plural(len(ms.ran), 'run')}, interleaved round by round")
            ms.run_measured(say)

    def pytest_report_teststatus(self, report: pytest.TestReport) -> Any:
        verdict = getattr(report, "rlk_verdict", None)
        if verdict is None or report.when != "call" or verdict == "not_run":
            return None
        if self.words.summarizing:
            # The short test summary says FAILED/PASSED as for any test (log scrapers, `-rf`,
            # `-rA`); the verdict leads the message: `FAILED <id> - fallback: <reason>`.
            return None
        # The category is pytest's own outcome (what the final line, pytest-json-report's
        # `outcome` and `summary`, and every consumer of the stats count): a cell that fails
        # the session is `failed`, one that does not is `passed`. The verdict stays visible as
        # the letter and the verbose word (and in the user properties and the json metadata).
        letter = LETTERS.get(verdict, "?")
        if report.failed:
            markup = {"red": True}
        else:
            markup = {"green": True} if verdict == "valid" else {"yellow": True}
        category = "failed" if report.failed else "passed"
        return category, letter.upper() if report.failed else letter, (verdict.upper(), markup)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        ms = self.session
        if ms.plan or self.is_worker or not ms.records:
            return
        from pytest_rlkernel_matrix.report.terminal import summary_lines
        from pytest_rlkernel_matrix.session.scheduler import stop_reason

        terminalreporter.section("rlk matrix")
        for line in summary_lines(list(ms.records.values()), ms.root,
                                  ms.auto_stop or stop_reason(ms.root), core.rerun_lines(ms)):
            terminalreporter.write_line(line)

    @pytest.hookimpl(tryfirst=True)  # before xdist tears its workers down
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        ms = self.session
        if self.is_worker:
            return
        if ms.plan and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
            session.exitstatus = pytest.ExitCode.OK
        if ms.plan and self.planned:
            # Reports (other plugins read every entry of the stats) of items that did not run.
            planned = [pytest.TestReport(nodeid=i.nodeid, location=i.location, keywords={},
                                         outcome="passed", longrepr=None, when="call")
                       for i in self.planned]
            self._count("cell planned" if len(planned) == 1 else "cells planned", planned)
        if ms.dry:
            return
        ms.interrupted = exitstatus == pytest.ExitCode.INTERRUPTED or bool(session.shouldstop)
        if ms.pending:  # queued cells no item waited for (-x, interrupt): cancel their jobs
            ms.launcher.cancel_all("the pytest session ended before their items ran")
        from pytest_rlkernel_matrix.run import procs

        with procs.STOP.cleaning_up():
            left = ms.stop_everything()
            if left:
                self.config.get_terminal_writer().line(
                    f"rlk: stopped {plural(len(left), 'process', 'processes')} left by cells: "
                    f"{', '.join(map(str, left[:20]))}")
            before = set(ms.records)
            ms.recover_records()
            if not ms.records and not ms.interrupted and ms.forget_root is not None:
                # No cell selected (a -k, -m or --lf that matches none): no report, no root,
                # and no later session records this one as the root it reran (issue 53).
                ms.forget_root()
                self.config.get_terminal_writer().line(
                    "rlk: no matrix cell selected"
                    + (f" ({', '.join(ms.selection['by'])})" if ms.selection
                       and ms.selection.get("by") else "")
                    + f": nothing run, no matrix root written ({ms.root} removed)")
                return
            ms.recorder.refresh()  # the measured runs ran after the items reported
            ms.write_report()
            if ms.selection is not None and ms.selection.get("rerun_of"):
                core.write_latest(ms)
        core.remember_root(self.config, ms)
        core.junit_suite_property(self.config, "rlk_matrix_report",
                                  ms.root / "matrix-report.json")
        self._count_recovered([ms.records[k] for k in ms.records if k not in before])

    def _count(self, key: str, entries: list[Any]) -> None:
        reporter = self.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None and entries:
            reporter.stats.setdefault(key, []).extend(entries)

    def _count_recovered(self, records: list[dict[str, Any]]) -> None:
        """Cells recorded at session end (interrupted, or a worker that died) never got a test
        report: count them as reports of their items, so that the final line and the short test
        summary agree with matrix-report.json."""
        ms = self.session
        file_id = matrix_nodeid(self.config, ms.matrix_path)
        for rec in records:
            name = f"{rec['module']}[{rec['case']}]"
            nodeid = f"{file_id}::{rec['hardware']}::{name}"
            failed = bool(rec.get("failed"))
            text = failure_text(rec, None, ", recorded at session end")
            report = pytest.TestReport(
                nodeid=nodeid, location=(file_id, 0, f"{rec['hardware']}::{name}"),
                keywords={}, outcome="failed" if failed else "passed",
                longrepr=CellFailure(text, str(ms.matrix_path)) if failed else None,
                when="call")
            report.rlk_verdict = rec["verdict"]  # type: ignore[attr-defined]
            verdict = str(rec["verdict"])
            self._count("skipped" if verdict == "not_run" else "failed" if failed else "passed",
                        [report])


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def rlk_cell(request: pytest.FixtureRequest) -> Cell:
    """The matrix cell this item runs (hardware, module, case, effective cases)."""
    return request.node.stash[CELL_KEY]


@pytest.fixture
def rlk_mode(request: pytest.FixtureRequest) -> str:
    """strict | audit | auto | off: `--rlk-mode`, else the matrix file's `[matrix] mode`."""
    return request.config.stash[SESSION_KEY].mode


@pytest.fixture(scope="session")
def rlk_preflight(request: pytest.FixtureRequest) -> dict[str, Any]:
    """This session's preflight fingerprint (also saved as `<matrix-root>/preflight.json`)."""
    return request.config.stash[SESSION_KEY].preflight


@pytest.fixture
def rlk_artifact_dir(request: pytest.FixtureRequest, rlk_cell: Cell) -> Path:
    """The cell's run directory; cells naming the same run share it. Never overwritten."""
    return request.config.stash[SESSION_KEY].planner.run_dir(rlk_cell)
