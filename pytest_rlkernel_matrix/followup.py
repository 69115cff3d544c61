"""Follow-up runs of a finished cell: its profile run and its probe run.

Both are separate runs of the cell's command in their own directories under the cell's run
directory (the measured run is left as it is); neither is ever a measured run. The profile run
(``--rlk-profile``, ``[profile] when = "always"``; ``judge/profile.py``) says which module's
kernels cost the time; the probe run (``--rlk-probe``, ``[probe] when = "drift"``;
``judge/probe.py``) localises a drift to its first divergent operator. A cell that may not have
one gets a note saying why (``profile-note.json``, ``probe-note.json``). Owned by the session
layer: it calls back into the session (``MatrixSession``: its matrix, ``probe``, ``write_json``
and ``_analyze``) to analyse and cache the record again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_rlkernel_matrix.run.launchers.base import CellJob
    from pytest_rlkernel_matrix.spec.cells import Cell


def follow_up(session: Any, cell: Cell, run_dir: Path, job: CellJob,
              record: dict[str, Any], cache: str) -> dict[str, Any]:
    """The profile run, then the probe run of the cell's finished run; the record re-analysed
    (and cached as ``<run dir>/<cache>``) when either left something for it."""
    from pytest_rlkernel_matrix.judge.probe import probe_cell, probe_plan, write_probe_note
    from pytest_rlkernel_matrix.judge.profile import follow_profile

    matrix = session.matrix
    changed = follow_profile(matrix, run_dir, job, record, session.write_json)
    if session.probe or matrix.probe.when == "drift":
        plan = probe_plan(record, matrix.runner.launcher)
        if plan is not None and plan != "probe":
            write_probe_note(run_dir, plan, write=session.write_json)
            changed = True
        elif plan == "probe":
            probe_cell(run_dir, command=job.command, cwd=job.cwd, env=dict(job.env),
                       timeout=matrix.runner.timeout, budget=matrix.probe.tokens,
                       controls=matrix.probe.controls, write=session.write_json)
            changed = True
    if not changed:
        return record
    record = session._analyze(run_dir, cell)  # picks profile.json / localisation.json up
    session.write_json(run_dir / cache, record)
    return record
