"""Processes after a cell's first run: measured, run-to-run repeat, profile and probe runs.

Measured runs (`[performance] processes = N`, `--rlk-processes=N`): the first process of a cell is
its correctness run, judged as ever in its own test item. After this process's last item (a
serial session's, or each xdist worker's own), processes 2..N of every run it started run in
rounds, **interleaved**: round 2 runs each cell once in the order the items ran them (R/R, P/R,
R/P, P/P, ...), then round 3, so a change in the machine's state (clocks, another job, page
cache) hits every cell alike. Each goes into `<run>/measured.<k>` (never overwritten: an existing
directory is left alone and that process is not run) with its own run id (`<run id>.p<k>`) and
`RLK_MATRIX_RUN_ROLE=measured`, `RLK_MATRIX_PROCESS=<k>` in its environment. The cell's record is
then made again: `report.measured` reads the measured runs, drops those that fell back, changed
route or have unusable timings (with the reason) and gives the judge the steps per process.
The controller takes the new timing fields from each run's `cell-record.json` at session end
(`refresh`), since the items reported before the measured runs ran.

`--rlk-processes=auto` (`[performance] auto = true`), a **two-stage** procedure (Stein's): stage
one runs `AUTO_FIRST` processes per cell (interleaved as above) and measures the variance
components; from them `judge.performance.factorial.plan` says, per statement, about how many
processes per
cell would resolve it; stage two adds rounds up to the largest such number, once, fixed before
any of its processes ran, and stopped early only by the budget (`--rlk-perf-budget` minutes,
`[performance] budget`: the rounds that fit by the measured cost of a round). The statements
are then judged once, on every process, at the report's family-wise level: no interim look
decides anything, so no error is spent on looks. The steps per process are the workload's own
(this runner does not change them); the plan's S says how many would be cheaper.

**The budget is a promise** (issue 52): it runs from the session's start, so the correctness
runs, refused processes and both stages count; no process starts that the measured cost of a
process says would end past it (so the session ends within the budget plus about one
process). After stage one the session **stops early**, with the figures, when stage one shows
that the budget cannot resolve the statements: a cell's timings not usable, half or more of
the processes refused (contamination, noise), or no inconclusive statement's plan fits in the
budget; stage two otherwise runs up to the largest plan that fits.

**Under pytest-xdist** (`-n N`) each worker runs stage one on its own runs (on its own CPU share
or GPU set), writes what it ran to `<root>/.auto/stage1.<worker>.json` and waits (at most until
the budget's end) for every other worker's; stage two is planned **once** from every worker's
stage-one records, by the first worker there (`<root>/.auto/plan.json`, created exclusively;
the others read it), and each worker runs the plan's rounds on its own runs. The controller
judges the statements once over the whole 2x2 at session end, as in a serial session.

The `Scheduler` sits beside the runner: it runs these processes through the `CellRunner` and
records them through the `Recorder` it is given; the coordinator calls it and hands it the
session's state (what ran, when the session started), and it never reaches into the coordinator.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.report.measured import MEASURED_PREFIX, PROCESS_VAR, ROLE_VAR
from pytest_rlkernel_matrix.report.record import CELL_RUN_FILE
from pytest_rlkernel_matrix.run.launchers.base import CellJob, Outcome
from pytest_rlkernel_matrix.session.recorder import RECORD_CACHE, Recorder
from pytest_rlkernel_matrix.session.runner import CellRunner
from pytest_rlkernel_matrix.spec.cells import Cell
from pytest_rlkernel_matrix.store.atomic import write_json_atomic
from pytest_rlkernel_matrix.store.safeio import Refused, ensure_dir, read_bytes

AUTO_FIRST = 3  # stage one of --rlk-processes=auto: processes per cell
AUTO_MAX = 64


def performance_options(matrix: Any, processes: str | int | None, budget: float | None) -> Any:
    """`matrix` with --rlk-processes (N or auto) and --rlk-perf-budget applied."""
    import pytest

    perf = matrix.performance
    update: dict[str, Any] = {}
    if processes is not None:
        raw = str(processes).strip().lower()
        if raw == "auto":
            update.update(auto=True)
        else:
            try:
                n = int(raw)
            except ValueError:
                n = 0
            if not 1 <= n <= 64:
                raise pytest.UsageError(f"--rlk-processes={processes}: a number from 1 to 64, "
                                        "or auto")
            update.update(processes=n, auto=False)
    if budget is not None:
        if not 0 < budget <= 24 * 60:
            raise pytest.UsageError(f"--rlk-perf-budget={budget}: minutes, above 0 and at "
                                    "most 1440")
        update.update(budget=float(budget))
    if update.get("auto", perf.auto):
        update["processes"] = max(AUTO_FIRST, int(update.get("processes", perf.processes)))
    if not update:
        return matrix
    return matrix.model_copy(update={"performance": perf.model_copy(update=update)})


class OutOfBudget(Exception):
    """The next process would end past the budget."""


class Budget:
    """The session's budget (`--rlk-perf-budget`): a wall-clock deadline from the session's
    start, and the measured cost of a process (the session's processes so far, correctness runs
    included, from `first` processes started before this object)."""

    def __init__(self, started: float, minutes: float, first: int) -> None:
        import time

        self.started, self.seconds = started, minutes * 60.0
        self.deadline = started + self.seconds
        self.done = max(1, first)
        self.spent_before = max(0.0, time.time() - started)

    @property
    def per_process(self) -> float:
        import time

        return max(0.0, time.time() - self.started) / self.done

    def left(self) -> float:
        import time

        return self.deadline - time.time()

    def check(self) -> None:
        """Raise `OutOfBudget` when one more process would end past the deadline."""
        if self.per_process > self.left():
            raise OutOfBudget

    def used(self) -> float:
        import time

        return time.time() - self.started


def auto_target(records: list[dict[str, Any]], first: int, round_s: float,
                left_s: float) -> tuple[int, list[str]]:
    """Stage two's processes per cell: the most any inconclusive statement's plan asks for
    (at most `AUTO_MAX`), cut to the rounds that fit in `left_s` at `round_s` a round; and
    the stage-one statements (what the progress shows)."""
    target, said, _ = auto_plan(records, first, round_s, left_s)
    return target, said


def auto_plan(records: list[dict[str, Any]], first: int, round_s: float,
              left_s: float) -> tuple[int, list[str], str | None]:
    """`auto_target`, and why the session stops after stage one (None: it goes on, or has
    nothing left to resolve): stage one shows the budget cannot resolve the statements
    (timings not usable, half or more of the processes refused, or no inconclusive statement's
    plan fits in the budget). The target is then the stage-one processes; otherwise the
    largest plan that fits."""
    from pytest_rlkernel_matrix.report.perf import performance
    from pytest_rlkernel_matrix.report.perf_text import refusal_lines, refusals

    perf = performance(records)
    said = [s for m in perf["modules"] for s in m["statements"]]
    texts = [str(s["text"]) for s in said]
    fits = first + (int(left_s // round_s) if round_s > 0 else 0)
    causes = refusals(records)
    ran = sum(len((r.get("measured") or {}).get("runs") or []) for r in records)
    refused = sum(c["count"] for c in causes.values())
    figures = "; ".join(refusal_lines(causes, ran))
    if any(s.get("kind") == "not judged" for s in said) or (ran and 2 * refused >= ran):
        why = figures or next((str(s["why"]) for s in said if s.get("kind") == "not judged"),
                              "timings not usable")
        return first, texts, (f"stage 1 refused {refused} of {ran} processes ({why}); no "
                              "statement is possible on this machine now")
    open_ = [s for s in said if s.get("kind") == "inconclusive"]
    if not open_:
        return first, texts, None
    # at the steps the workload runs: auto adds processes, never steps
    wanted = sorted(int(s["resolve"].get("processes_at_measured_steps") or AUTO_MAX + 1)
                    for s in open_ if s.get("resolve"))
    fitting = [n for n in wanted if n <= min(fits, AUTO_MAX)]
    if not fitting:
        need = (f"the smallest plan asks {wanted[0]} processes per cell" if wanted else
                f"no plan of at most {AUTO_MAX} processes per cell resolves them")
        return first, texts, (f"{len(open_)} statement(s) inconclusive after stage 1 and "
                              f"{need}; the budget ({(left_s + 0.0) / 60:.1f} min left, "
                              f"{round_s:.0f} s a round) fits {fits}"
                              + (f"; {figures}" if figures else ""))
    return max(first, max(fitting)), texts, None


AUTO_DIR = ".auto"
PLAN_FILE = "plan.json"


def stop_reason(root: Path) -> str | None:
    """Why an auto session stopped early (the first reason any worker left), or None."""
    from pytest_rlkernel_matrix.report.measured import auto_stop

    return auto_stop(root)


Ran = tuple[Cell, str, Path, Any]  # (cell, mode, run directory, env hook) of a run started here


@dataclass
class Scheduler:
    """The processes after a cell's first run, through the runner and the recorder."""

    runner: CellRunner
    recorder: Recorder
    worker: str | None = None
    probe: bool = False
    auto_stop: str | None = None  # why --rlk-processes=auto stopped early (None: it did not)

    @property
    def matrix(self) -> Any:
        return self.runner.planner.matrix

    @property
    def root(self) -> Path:
        return self.runner.planner.root

    def _wanted(self, run_dir: Path) -> bool:
        """A run whose correctness record is `valid` gets measured runs (anything else: its
        timings never support a statement, and its record says why)."""
        try:
            record = self.recorder.cached(run_dir)
        except (OSError, ValueError, Refused):
            return False
        return isinstance(record, dict) and record.get("verdict") == "valid"

    def _round(self, runs: list[Ran], k: int, budget: Budget | None = None) -> int:
        """Process k of every run in `runs`, in order; how many ran. With a `budget`, a process
        that would end past it is not started (`OutOfBudget`)."""
        count = 0
        for cell, mode, run_dir, hook in runs:
            target = run_dir / f"{MEASURED_PREFIX}{k}"
            if target.exists():
                continue  # never overwrite; the analysis counts what is there
            if budget is not None:
                budget.check()
            meta = self.recorder.read_json(run_dir / CELL_RUN_FILE)
            plan = self.runner.planner.cell_plan(
                cell, mode, target, run_id=f"{meta['run_id']}.p{k}",
                extra_env={ROLE_VAR: "measured", PROCESS_VAR: str(k)})
            job, outcome = self.runner.run(plan, hook)
            self.recorder.finish(cell, mode, target, outcome.result, job.recorded, [], outcome,
                                 cpu_share=job.cpu_share, analyze=False)
            count += 1
            if budget is not None:
                budget.done += 1
            if outcome.result.interrupted:
                raise KeyboardInterrupt
        return count

    def run_measured(self, todo: list[Ran], started: float, items_ran: set[str],
                     all_items: set[str], say: Any = None) -> int:
        """Processes 2..N of every run in `todo` (those this process started), interleaved
        round by round; then each run's record again (with its measured runs). With
        `[performance] auto`, stage two's rounds after stage one's (`auto_plan`), within the
        budget (`Budget`); under xdist the plan is made once from every worker's stage one
        (`_shared_plan`). Returns how many measured runs ran; `auto_stop` says why auto
        stopped early."""
        perf = self.matrix.performance
        total = int(perf.processes)
        runs = [(c, m, d, h) for c, m, d, h in todo if self._wanted(d)]
        if total <= 1 or not todo or self.matrix.runner.launcher != "local":
            if perf.auto and self.worker is not None:  # the other workers wait for this one's
                self._shared_plan([], None, 0, lambda: 0.0, say, started, items_ran, all_items,
                                  plan=False)
            return 0  # a scheduler's node cannot be sampled: its timings are never usable
        count = 0
        budget = Budget(started, perf.budget, len(todo)) if perf.auto else None
        stop: str | None = None
        try:
            try:
                for k in range(2, total + 1):
                    count += self._round(runs, k, budget)
                    if say is not None and perf.auto:
                        say(f"rlk: auto stage 1: process {k} of {total} per cell "
                            f"({len(runs)} cells)")
            except OutOfBudget:
                assert budget is not None
                stop = (f"the budget ({perf.budget:g} min) did not hold stage 1: "
                        f"{budget.used():.0f} s used, a process costs about "
                        f"{budget.per_process:.0f} s")
            if perf.auto and budget is not None:
                count += self._stage_two(runs, total, budget, stop, say, started, items_ran,
                                         all_items)
        finally:  # stopped or not: each record with the measured runs that did run (and why not)
            for cell, _, run_dir, _ in runs:
                self.recorder.analyze(run_dir, cell)
        return count

    def _stage_two(self, runs: list[Ran], total: int, budget: Budget, stop: str | None,
                   say: Any, started: float, items_ran: set[str], all_items: set[str]) -> int:
        count = 0
        records = [self.recorder.analyze(d, c) for c, _, d, _ in runs]
        if stop:  # what stage one's processes that ran resolve, and the budget it needs
            from pytest_rlkernel_matrix.report.perf import budget_stop

            stop = budget_stop(records, total, self.matrix.performance.budget, budget.used(),
                               budget.per_process)
        round_s = budget.per_process * max(1, len(runs))
        if self.worker is not None:
            target, said, why = self._shared_plan(runs, stop, total, budget.left, say, started,
                                                  items_ran, all_items)
        else:
            target, said, why = (total, [], stop) if stop else auto_plan(
                records, total, round_s, budget.left())
        if say is not None:
            if why:
                say(f"rlk: auto: stopped after stage 1: {why}")
            elif target > total:
                say(f"rlk: auto: stage 1 gave {len(said)} statements; stage 2 runs "
                    f"processes {total + 1}-{target} per cell ({round_s:.0f} s a round, "
                    f"{budget.used():.0f} s of {budget.seconds:.0f} s used)")
            else:
                say("rlk: auto: stage 1 resolves what it can; no stage 2")
            for line in said:
                say(f"rlk:   {line}")
        self.auto_stop = why
        try:
            for k in range(total + 1, target + 1):
                count += self._round(runs, k, budget)
                if say is not None:
                    say(f"rlk: auto stage 2: process {k} of {target} per cell "
                        f"({budget.used():.0f} s of {budget.seconds:.0f} s)")
        except OutOfBudget:
            self.auto_stop = (f"stage 2 stopped at the budget ({budget.used():.0f} s of "
                              f"{budget.seconds:.0f} s; a process costs about "
                              f"{budget.per_process:.0f} s)")
            if say is not None:
                say(f"rlk: auto: {self.auto_stop}")
        self._note_stop(self.auto_stop)
        return count

    def _note_stop(self, why: str | None) -> None:
        """Leave why the auto session stopped where the controller finds it (`stop_reason`)."""
        if not why:
            return
        folder = self.root / AUTO_DIR
        ensure_dir(folder, self.root)
        write_json_atomic(folder / f"stop.{self.worker or 'main'}.json", {"why": why})

    def _load(self, path: Path) -> Any:
        try:
            return json.loads(read_bytes(path, self.root, 1 << 22))
        except (OSError, ValueError, Refused):
            return None

    def _shared_plan(self, runs: list[Ran], stop: str | None, first: int,
                     left: Callable[[], float], say: Any, started: float, items_ran: set[str],
                     all_items: set[str], plan: bool = True) -> tuple[int, list[str], str | None]:
        """Under xdist: write this worker's stage one, wait for every worker's (at most until
        the budget's end), then the plan made once from all of them (`<root>/.auto/plan.json`).
        `plan=False`: a worker with no run of its own only says what it ran."""
        root = self.root
        folder = root / AUTO_DIR
        ensure_dir(folder, root)
        me = str(self.worker)
        mine = {"worker": me, "runs": [str(d.relative_to(root)) for _, _, d, _ in runs],
                "stop": stop, "per_process_s": None, "items": sorted(items_ran),
                "round_s": None}
        if runs:
            mine["per_process_s"] = (time.time() - float(started)) / max(
                1, len(runs) * max(1, first))
        write_json_atomic(folder / f"stage1.{me}.json", mine)
        if not plan:
            return first, [], None
        expected = set(all_items)
        deadline = time.monotonic() + max(0.0, left())
        said_wait = False
        while True:
            stages = [x for x in (self._load(p) for p in sorted(folder.glob("stage1.*.json")))
                      if isinstance(x, dict)]
            covered = {i for x in stages for i in x.get("items") or []}
            if expected <= covered or time.monotonic() >= deadline:
                break
            if say is not None and not said_wait:
                say("rlk: auto: waiting for the other workers' stage 1")
                said_wait = True
            time.sleep(0.5)
        plan_path = folder / PLAN_FILE
        made = self._load(plan_path) if plan_path.exists() else None
        if not isinstance(made, dict):
            records: list[dict[str, Any]] = []
            for x in stages:
                for rel in x.get("runs") or []:
                    rec = self._load(root / rel / RECORD_CACHE)
                    if isinstance(rec, dict):
                        records.append(rec)
            per = [float(x["per_process_s"]) for x in stages
                   if isinstance(x.get("per_process_s"), (int, float))]
            # the workers run their rounds side by side: a round costs the largest worker's share
            share = max([len(x.get("runs") or []) for x in stages] or [1])
            round_s = (max(per) if per else 0.0) * max(1, share)
            stops = [str(x["stop"]) for x in stages if x.get("stop")]
            missing = sorted(expected - {i for x in stages for i in x.get("items") or []})
            if stops:
                target, said, why = first, [], stops[0]
            elif missing:
                target, said, why = first, [], (f"{len(missing)} item(s) of other workers had "
                                                "no stage 1 before the budget's end")
            else:
                target, said, why = auto_plan(records, first, round_s, left())  # after waiting
            made = {"target": target, "said": said, "why": why, "by": me,
                    "workers": len(stages), "records": len(records)}
            draft = folder / f"plan.{me}.json"
            write_json_atomic(draft, made)
            try:  # linked exclusively, whole: the first worker's plan is everyone's
                os.link(draft, plan_path)
            except FileExistsError:
                theirs = self._load(plan_path)
                made = theirs if isinstance(theirs, dict) else made
        return int(made.get("target") or first), list(made.get("said") or []), made.get("why")

    def requeue(self, cell: Cell, mode: str, run_dir: Path, env_hook: Any, outcome: Outcome,
                blockers: list[list[str]]) -> tuple[dict[str, Any], Outcome] | None:
        """A job the launcher says may run again (a node failed): once more, into
        `<run>.attempt2` (None when that exists: never overwritten); the first attempt's
        cell-run.json names it (`superseded_by`) and the attempt that decides gets the probe."""
        rec, retry_dir = self.recorder, run_dir.with_name(f"{run_dir.name}.attempt2")
        if retry_dir.exists():
            return None
        rec.update_meta(run_dir, superseded_by=rec.rel(retry_dir))
        job = self.runner.prepare(self.runner.planner.cell_plan(cell, mode, retry_dir), env_hook,
                                  attempt=2)
        first = {"artifact_dir": rec.rel(run_dir), **(outcome.scheduler or {})}
        outcome = self.runner.wait(cell, job)
        if outcome.scheduler is not None:
            outcome.scheduler["previous_attempts"] = [first]
        record = rec.finish(cell, mode, retry_dir, outcome.result, job.recorded, blockers,
                            outcome, cpu_share=job.cpu_share)
        if not outcome.result.interrupted:  # the attempt that decides gets the probe
            record = self.maybe_probe(cell, retry_dir, job, record)
        return record, outcome

    def repeat(self, cell: Cell, mode: str, run_dir: Path, env_hook: Any) -> dict | None:
        """`[reproducibility] runs = 2`: the same cell again, same seed, its own process and
        run directory (`<run>.repeat2`, never overwritten); the first run's record then judges
        run_to_run_bitwise against it."""
        again = run_dir.with_name(f"{run_dir.name}.repeat2")
        if again.exists():
            return None
        job, outcome = self.runner.run(self.runner.planner.cell_plan(cell, mode, again),
                                       env_hook)
        self.recorder.finish(cell, mode, again, outcome.result, job.recorded, [], outcome)
        meta = self.recorder.read_json(run_dir / CELL_RUN_FILE)
        self.recorder.update_meta(run_dir, policy={**meta.get("policy", {}),
                                                   "repeat_dir": again.name})
        record = self.recorder.analyze(run_dir, cell)
        if outcome.result.interrupted:
            raise KeyboardInterrupt
        return record

    def maybe_probe(self, cell: Cell, run_dir: Path, job: CellJob,
                    record: dict[str, Any]) -> dict[str, Any]:
        """The follow-up runs of a finished cell, each a separate run in its own directory under
        the cell's (the measured run is left as it is; neither is ever a measured run): its
        profile run (`--rlk-profile`, `[profile] when = "always"`; `judge/localise/profile.py`:
        which module's kernels cost the time), then its probe run (`--rlk-probe`, `[probe] when
        = "drift"`; `judge/localise/probe.py`: a drift's first divergent operator). A cell that
        may not have one gets a note saying why (`profile-note.json`, `probe-note.json`). The
        record is analysed again (and cached) when either left something for it."""
        from pytest_rlkernel_matrix.judge.localise.probe import (
            probe_cell,
            probe_plan,
            write_probe_note,
        )
        from pytest_rlkernel_matrix.judge.localise.profile import follow_profile

        matrix, write = self.matrix, self.recorder.write_json
        names = tuple(self.runner.planner.names(cell))
        changed = follow_profile(matrix, run_dir, job, record, write, names)
        if self.probe or matrix.probe.when == "drift":
            plan = probe_plan(record, matrix.runner.launcher)
            if plan is not None and plan != "probe":
                write_probe_note(run_dir, plan, write=write)
                changed = True
            elif plan == "probe":
                probe_cell(run_dir, command=job.command, cwd=job.cwd, env=dict(job.env),
                           timeout=matrix.runner.timeout, budget=matrix.probe.tokens,
                           controls=matrix.probe.controls, write=write)
                changed = True
        if not changed:
            return record
        return self.recorder.analyze(run_dir, cell)  # picks profile.json / localisation.json up
