"""`--rlk-plan`: what each selected run would execute, run nothing.

Per run: the launcher's rendering (the env contract and the command, or Slurm's batch script).
Without `--rlk-hardware` the plan is this machine's, as preflight detected it: its Python and its
CPU share are the values a run here would get. With `--rlk-hardware=<profile>` the plan is that
profile's machine's, which may not be this one: the values a session decides on the machine it
runs on (`PYTHON_BIN`, the CPU share's thread and CPU variables) are not copied from this machine;
a comment names them and says where they come from, unless the matrix file sets them (a
profile's `env`, `[runner.env]`, a factor variant's env), in which case they are shown as set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pytest_rlkernel_matrix.run.cpushare import CELL_CPUS_VAR, CELL_THREADS_VAR, THREAD_VARS
from pytest_rlkernel_matrix.run.launchers.base import CellJob
from pytest_rlkernel_matrix.spec.cells import Cell

if TYPE_CHECKING:
    from pytest_rlkernel_matrix.session import MatrixSession

# Decided by the session on the machine that runs the cell (what `--rlk-plan` cannot know there).
AT_RUN_TIME = {
    "PYTHON_BIN": "the Python that runs pytest there, unless the environment sets PYTHON_BIN",
    **{var: "the size of the cell's CPU share there" for var in (*THREAD_VARS, CELL_THREADS_VAR)},
    CELL_CPUS_VAR: "the cell's CPU list there",
}


def at_run_time(ms: MatrixSession, cell: Cell, recorded: dict[str, str]) -> list[str]:
    """Drop from `recorded` the values this machine decided that the named machine decides at
    run time; return their names. A value the matrix file sets stays."""
    profile = ms.matrix.hardware[cell.hardware]
    declared = {*profile.env, *ms.matrix.runner.env,
                *(cell.factor.env if cell.factor is not None else ())}
    later = [var for var in AT_RUN_TIME if var in recorded and var not in declared]
    for var in later:
        del recorded[var]
    return later


def run_time_note(hardware: str, names: Sequence[str]) -> list[str]:
    if not names:
        return []
    lines = [f"# decided at run time on the {hardware} machine (not copied from this one):"]
    by_why: dict[str, list[str]] = {}
    for var in names:
        by_why.setdefault(AT_RUN_TIME[var], []).append(var)
    lines += [f"#   {', '.join(vs)}: {why}" for why, vs in by_why.items()]
    return lines


def plan_text(ms: MatrixSession, cells: Sequence[Cell], mode: str) -> str:
    """Per run: what the launcher would run (env contract + command, or the batch script)."""
    out: list[str] = []
    seen: set[str] = set()
    noted: set[tuple[str, ...]] = set()  # each hardware's run-time note once
    listed = {c.run_key for c in cells}
    planner = ms.planner  # the cells' plans (`session.plan`): pure values
    baselines = [b for b in (planner.factor_baseline(c) for c in cells if c.factor is not None)
                 if b.run_key not in listed]
    for cell in [*cells, *baselines]:
        if cell.run_key in seen:
            continue
        seen.add(cell.run_key)
        command = planner.command(cell)
        names = [c.id for c in cells if c.run_key == cell.run_key] or [
            f"{cell.id} (baseline of factor cells, not selected itself)"]
        run_dir = planner.run_dir(cell)
        _, recorded = planner.environment(cell, mode, run_dir, base={})
        # Under Slurm this machine submits: its PYTHON_BIN is the one the jobs get.
        elsewhere = ms.plan_named and ms.matrix.runner.launcher == "local"
        later = at_run_time(ms, cell, recorded) if elsewhere else []
        owner = ms.canonical.get(cell.run_key, cell)
        job = CellJob(key=cell.run_key, label=f"{owner.hardware}/{run_dir.name}",
                      command=command if isinstance(command, str) else list(command),
                      cwd=planner.command_cwd(), env=recorded, recorded=recorded,
                      run_dir=run_dir, timeout=ms.matrix.runner.timeout)
        out.append(f"# {', '.join(names)}  (mode {mode})")
        if (owner.hardware, *later) not in noted:
            noted.add((owner.hardware, *later))
            out += run_time_note(owner.hardware, later)
        out.append(ms.launcher.render(job))
        out.append("")
    if ms.matrix.performance.processes > 1:
        n = ms.matrix.performance.processes
        out.append(f"# then process{'es 2-' if n > 2 else ' '}{n} of each valid run "
                   "as measured runs (<run>/measured.<k>, RLK_MATRIX_RUN_ROLE=measured), "
                   "interleaved round by round after the last item")
    return ms.scrubber.text("\n".join(out))
