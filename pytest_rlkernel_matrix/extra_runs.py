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

Functions of the session (`session.MatrixSession`, passed in as `ms`; never imported here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.report.measured import FIELDS, MEASURED_PREFIX, PROCESS_VAR, ROLE_VAR
from pytest_rlkernel_matrix.report.record import CELL_RUN_FILE
from pytest_rlkernel_matrix.store.atomic import write_json_atomic

RECORD_CACHE = "cell-record.json"


def _wanted(run_dir: Path) -> bool:
    """A run whose correctness record is `valid` gets measured runs (anything else: its timings
    never support a statement, and its record says why)."""
    try:
        record = json.loads((run_dir / RECORD_CACHE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("verdict") == "valid"


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


def _round(ms: Any, runs: list[Any], k: int) -> int:
    """Process k of every run in `runs`, in order; how many ran."""
    count = 0
    for cell, mode, run_dir, hook in runs:
        target = run_dir / f"{MEASURED_PREFIX}{k}"
        if target.exists():
            continue  # never overwrite; the analysis counts what is there
        meta = json.loads((run_dir / CELL_RUN_FILE).read_text(encoding="utf-8"))
        job = ms._prepare(cell, mode, target, hook, run_id=f"{meta['run_id']}.p{k}",
                          extra_env={ROLE_VAR: "measured", PROCESS_VAR: str(k)})
        outcome = ms._wait(cell, job)
        ms._finish(cell, mode, target, outcome.result, job.recorded, [], outcome,
                   cpu_share=job.cpu_share, analyze=False)
        count += 1
        if outcome.result.interrupted:
            raise KeyboardInterrupt
    return count


def auto_target(records: list[dict[str, Any]], first: int, round_s: float,
                left_s: float) -> tuple[int, list[str]]:
    """Stage two's processes per cell: the most any inconclusive statement's plan asks for
    (at most `AUTO_MAX`), cut to the rounds that fit in `left_s` at `round_s` a round; and
    the stage-one statements (what the progress shows)."""
    from pytest_rlkernel_matrix.report.perf import performance

    perf = performance(records)
    said = [s for m in perf["modules"] for s in m["statements"]]
    wanted = [int(s["resolve"]["processes"]) for s in said
              if s.get("kind") == "inconclusive" and s.get("resolve")]
    unresolvable = [s for s in said if s.get("kind") == "inconclusive" and not s.get("resolve")]
    target = max([first, *wanted]) if wanted else (AUTO_MAX if unresolvable else first)
    fits = first + (int(left_s // round_s) if round_s > 0 else 0)
    return max(first, min(target, AUTO_MAX, fits)), [str(s["text"]) for s in said]


def run_measured(ms: Any, say: Any = None) -> int:
    """Processes 2..N of every run this process started, interleaved round by round; then each
    run's record again (with its measured runs). With `[performance] auto`, stage two's
    rounds after stage one's (`auto_target`). Returns how many measured runs ran."""
    import time

    perf = ms.matrix.performance
    total = int(perf.processes)
    todo, ms.ran = list(ms.ran), []
    if total <= 1 or not todo or ms.matrix.runner.launcher != "local":
        return 0  # a scheduler's node cannot be sampled: its timings are never usable
    runs = [(c, m, d, h) for c, m, d, h in todo if _wanted(d)]
    count = 0
    start = time.monotonic()
    try:
        for k in range(2, total + 1):
            count += _round(ms, runs, k)
            if say is not None and perf.auto:
                say(f"rlk: auto stage 1: process {k} of {total} per cell "
                    f"({len(runs)} cells)")
        if perf.auto and runs:
            records = [ms._analyze(d, c) for c, _, d, _ in runs]
            round_s = (time.monotonic() - start) / max(1, total - 1)
            left = perf.budget * 60.0 - (time.monotonic() - start) - round_s  # + round 1
            target, said = auto_target(records, total, round_s, left)
            if say is not None:
                say(f"rlk: auto: stage 1 gave {len(said)} statements; stage 2 runs processes "
                    f"{total + 1}-{target} per cell ({round_s:.0f} s a round, budget "
                    f"{perf.budget:g} min)" if target > total else
                    "rlk: auto: stage 1 resolves what it can; no stage 2")
                for line in said:
                    say(f"rlk:   {line}")
            for k in range(total + 1, target + 1):
                count += _round(ms, runs, k)
                if say is not None:
                    say(f"rlk: auto stage 2: process {k} of {target} per cell "
                        f"({time.monotonic() - start:.0f} s of {perf.budget * 60:.0f} s)")
    finally:  # stopped or not: each record with the measured runs that did run (and why not)
        for cell, _, run_dir, _ in runs:
            ms.write_json(run_dir / RECORD_CACHE, ms._analyze(run_dir, cell))
    return count


def refresh(ms: Any) -> int:
    """Controller, at session end: each record whose run got measured runs after its item
    reported takes the timing fields of its run's `cell-record.json`. Returns how many did."""
    done = 0
    for record in ms.records.values():
        policy = record.get("performance_policy") or {}
        if int(policy.get("processes") or 1) <= 1 or not record.get("artifact_dir"):
            continue
        try:
            fresh = json.loads((ms.root / record["artifact_dir"] / RECORD_CACHE).read_text(
                encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(fresh, dict) and fresh.get("measured"):
            for key in FIELDS:
                if key in fresh:
                    record[key] = fresh[key]
            done += 1
    return done


def repeat(ms: Any, cell: Any, mode: str, run_dir: Path, env_hook: Any) -> dict | None:
    """`[reproducibility] runs = 2`: the same cell again, same seed, its own process and
    run directory (`<run>.repeat2`, never overwritten); the first run's record then judges
    run_to_run_bitwise against it."""
    again = run_dir.with_name(f"{run_dir.name}.repeat2")
    if again.exists():
        return None
    job = ms._prepare(cell, mode, again, env_hook)
    outcome = ms._wait(cell, job)
    ms._finish(cell, mode, again, outcome.result, job.recorded, [], outcome)
    meta_path = run_dir / CELL_RUN_FILE
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    meta["policy"] = {**meta.get("policy", {}), "repeat_dir": again.name}
    write_json_atomic(meta_path, meta)
    record: dict[str, Any] = ms._analyze(run_dir, cell)
    ms.write_json(run_dir / RECORD_CACHE, record)
    if outcome.result.interrupted:
        raise KeyboardInterrupt
    return record


def maybe_probe(ms: Any, cell: Any, run_dir: Path, job: Any,
                record: dict[str, Any]) -> dict[str, Any]:
    """The follow-up runs of a finished cell, each a separate run in its own directory under the
    cell's (the measured run is left as it is; neither is ever a measured run): its profile run
    (`--rlk-profile`, `[profile] when = "always"`; `judge/localise/profile.py`: which module's
    kernels
    cost the time), then its probe run (`--rlk-probe`, `[probe] when = "drift"`;
    `judge/localise/probe.py`: a drift's first divergent operator). A cell that may not have one
    gets a
    note saying why (`profile-note.json`, `probe-note.json`). The record is analysed again (and
    cached) when either left something for it."""
    from pytest_rlkernel_matrix.judge.localise.probe import probe_cell, probe_plan, write_probe_note
    from pytest_rlkernel_matrix.judge.localise.profile import follow_profile

    matrix = ms.matrix
    names = (*(c.name for c in ms.cells if c.run_key == cell.run_key), cell.name)
    changed = follow_profile(matrix, run_dir, job, record, ms.write_json, names)
    if ms.probe or matrix.probe.when == "drift":
        plan = probe_plan(record, matrix.runner.launcher)
        if plan is not None and plan != "probe":
            write_probe_note(run_dir, plan, write=ms.write_json)
            changed = True
        elif plan == "probe":
            probe_cell(run_dir, command=job.command, cwd=job.cwd, env=dict(job.env),
                       timeout=matrix.runner.timeout, budget=matrix.probe.tokens,
                       controls=matrix.probe.controls, write=ms.write_json)
            changed = True
    if not changed:
        return record
    record = ms._analyze(run_dir, cell)  # picks profile.json / localisation.json up
    ms.write_json(run_dir / RECORD_CACHE, record)
    return record
