"""The session's rooms alone (issue 54): the plan (pure values: no directory, no file, no
process) and the recorder (records written, reused, refused and recovered after a crash from
what is on disk, without starting a process)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pytest_rlkernel_matrix.report.record import CELL_RUN_FILE
from pytest_rlkernel_matrix.run.cpushare import CELL_THREADS_VAR, THREAD_VARS, Slot
from pytest_rlkernel_matrix.run.runner import RunResult
from pytest_rlkernel_matrix.session.plan import Planner
from pytest_rlkernel_matrix.session.recorder import RECORD_CACHE, Recorder
from pytest_rlkernel_matrix.spec.cells import Cell, expand, expand_factors
from pytest_rlkernel_matrix.spec.matrix import load_matrix
from pytest_rlkernel_matrix.store.redact import Scrubber

TOKEN = "0123456789abcdef0123456789abcdef"
CREATED = "2026-12-06T05:00:00+00:00"


@pytest.fixture(autouse=True)
def _no_thread_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread variable in the environment (an xdist worker's) wins over the share."""
    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)


def _matrix(tmp_path: Path, extra: str = "") -> tuple[Path, object]:
    path = tmp_path / "matrix.toml"
    path.write_text('[matrix]\nmodules = ["attention", "ffn"]\n[runner]\n'
                    f'command = ["{sys.executable}", "job.py"]\nr_provider = "external"\n'
                    '[hardware.cpu]\nbackend = "cpu"\n' + extra)
    return path, load_matrix(path)


def _planner(tmp_path: Path, extra: str = "", **kw: object) -> Planner:
    path, m = _matrix(tmp_path, extra)
    return Planner(matrix=m, matrix_path=path, root=tmp_path / "root",  # type: ignore[arg-type]
                   layout="pairwise", mode="audit", token=TOKEN, created=CREATED,
                   cpu_slot=Slot(cpus=(0,)), **kw)  # type: ignore[arg-type]


def _cells(p: Planner) -> list[Cell]:
    return expand(p.matrix.matrix, ["cpu"], "pairwise", "audit")


# -- the plan: pure values ------------------------------------------------------------------------


def test_a_shared_run_lives_in_its_owners_directory_with_one_run_id(tmp_path: Path) -> None:
    p = _planner(tmp_path)
    cells = [c for c in _cells(p) if c.case == "R/R"]  # attention R/R and ffn R/R: one run
    canonical, expected = p.selected(cells)
    p.cells, p.canonical = cells, canonical
    a, b = cells
    assert a.run_key == b.run_key and expected == 2
    assert p.run_dir(a) == p.run_dir(b) == p.root / "cpu" / canonical[a.run_key].slug
    owner = canonical[a.run_key].slug
    assert p.run_id(a) == p.run_id(b) == f"cpu-{owner}-20261206T050000Z-01234567"
    assert p.run_id(a, p.run_dir(a).with_name("x.repeat2")).endswith("-repeat2")
    assert p.shared_with(a) == [b.id] and p.names(a) == [a.name, b.name, a.name]
    assert p.lock_path(a).parent == p.root / ".locks"


def test_a_factor_cell_brings_its_baseline_into_the_report_count(tmp_path: Path) -> None:
    p = _planner(tmp_path, '[factors.k]\nbaseline = "base"\ncases = ["R/R"]\n'
                           'variants = { a = { args = ["--k", "a b"] } }\n')
    factor = expand_factors(p.matrix.factors, p.matrix.matrix, ["cpu"])
    assert factor
    canonical, expected = p.selected(factor[:1])
    assert expected == 2 and len(canonical) == 2  # the factor cell and its (unselected) baseline
    assert p.command(factor[0])[-2:] == ["--k", "a b"]


def test_the_plan_is_values_only(tmp_path: Path) -> None:
    p = _planner(tmp_path, devices=["0"])
    cell = _cells(p)[0]
    plan = p.cell_plan(cell, "audit", p.run_dir(cell), run_id="rid.p2",
                       extra_env={"RLK_MATRIX_RUN_ROLE": "measured"})
    assert not p.root.exists()  # nothing created, written or started
    assert plan.env["RL_KERNEL_RUN_ID"] == plan.recorded["RL_KERNEL_RUN_ID"] == "rid.p2"
    assert plan.recorded["RLK_MATRIX_RUN_ROLE"] == "measured"
    assert plan.cwd == tmp_path and plan.label == f"cpu/{plan.run_dir.name}"
    assert plan.share.cpus == [0] and plan.env[CELL_THREADS_VAR] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in plan.env  # a CPU profile is never pinned to devices
    assert p.policy(cell)["backend"] == "cpu" and p.blockers(cell, "strict") == []


def test_a_hook_thread_variable_wins_over_the_share(tmp_path: Path) -> None:
    p = _planner(tmp_path)
    cell = _cells(p)[0]
    plan = p.cell_plan(cell, "audit", p.run_dir(cell))
    var = THREAD_VARS[0]
    hooked = plan.with_hook({var: "7", "EXTRA": "x"})
    assert hooked.env[var] == "7" and hooked.recorded["EXTRA"] == "x"
    assert CELL_THREADS_VAR not in hooked.env  # the share's variables go with it
    assert hooked.share is not plan.share and plan.env[var] == "1"  # the plan is unchanged
    assert plan.with_hook({"EXTRA": "x"}).env[var] == "1"


# -- the recorder: no process ---------------------------------------------------------------------


def _recorder(tmp_path: Path) -> tuple[Recorder, list[Cell]]:
    p = _planner(tmp_path)
    cells = _cells(p)
    p.cells, p.canonical = cells, p.selected(cells)[0]
    p.root.mkdir()
    return Recorder(planner=p, hardware=["cpu"], scrubber=Scrubber()), cells


def _case_env(run_dir: Path, run_id: str) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "matrix-case.env").write_text(f"RL_KERNEL_RUN_ID={run_id}\n")


def test_recovery_after_a_crash_takes_what_the_disk_holds(tmp_path: Path) -> None:
    rec, cells = _recorder(tmp_path)
    p = rec.planner
    cached, dead, foreign, reported = [c for c in cells if p.canonical[c.run_key] is c][:4]
    # a run that wrote its record before the session died
    _case_env(p.run_dir(cached), p.own_run_id(cached.hardware, cached.slug))
    (p.run_dir(cached) / RECORD_CACHE).write_text(json.dumps(
        {"verdict": "valid", "run_key": cached.run_key, "hardware": "cpu",
         "module": cached.module, "case": cached.case, "token_seen": "secret-value"}))
    # a run whose worker died: matrix-case.env only
    _case_env(p.run_dir(dead), p.own_run_id(dead.hardware, dead.slug))
    # another session's run in the same root: not this session's to recover
    _case_env(p.run_dir(foreign), f"cpu-{foreign.slug}-20250101T000000Z-ffffffff")
    # a run whose item already reported
    _case_env(p.run_dir(reported), p.own_run_id(reported.hardware, reported.slug))
    rec.records["item"] = {"run_key": reported.run_key, "verdict": "valid"}
    rec.scrubber.add_env({"API_TOKEN": "secret-value"})
    rec.recover()
    assert set(rec.records) == {"item", cached.id, dead.id}
    assert rec.records[cached.id]["verdict"] == "valid"
    assert rec.records[cached.id]["token_seen"] != "secret-value"  # scrubbed on the way in
    assert rec.records[cached.id]["shared_with"] == p.shared_with(cached)
    assert rec.records[dead.id]["verdict"] == "error" and rec.records[dead.id]["failed"]
    assert not rec.all_recorded()  # the dead run still has no cell-record.json
    rec.recover()  # twice: nothing new, nothing lost
    assert set(rec.records) == {"item", cached.id, dead.id}


def test_recovery_never_waits_on_a_fifo(tmp_path: Path) -> None:
    rec, cells = _recorder(tmp_path)
    run_dir = rec.planner.run_dir(cells[0])
    run_dir.mkdir(parents=True)
    os.mkfifo(run_dir / "matrix-case.env")
    rec.recover()
    assert rec.records == {}


def test_a_finished_run_is_written_then_reused_and_another_sessions_refused(
        tmp_path: Path) -> None:
    rec, cells = _recorder(tmp_path)
    cell = cells[0]
    run_dir = rec.planner.run_dir(cell)
    assert rec.earlier(cell, "audit", run_dir) is None  # new: the caller runs it
    run_dir.mkdir(parents=True)
    result = RunResult(command=["x"], exit_code=0, timed_out=False, interrupted=False,
                       wall_time=1.0, started=CREATED, finished=CREATED)
    rec.timings[str(run_dir)] = {"env_s": 0.5}
    meta = rec.finish(cell, "audit", run_dir, result, {"RL_KERNEL_RUN_ID": "rid",
                                                        "API_KEY": "v"}, [], analyze=False)
    on_disk = json.loads((run_dir / CELL_RUN_FILE).read_text())
    assert on_disk["session"] == TOKEN and on_disk["run_id"] == "rid"
    assert on_disk["env"]["API_KEY"] != "v" and on_disk["overhead"]["env_s"] == 0.5
    assert meta["artifact_dir"] == f"cpu/{run_dir.name}" and str(run_dir) not in rec.timings
    (run_dir / RECORD_CACHE).write_text(json.dumps({"verdict": "valid", "module": "m"}))
    again = rec.earlier(cell, "audit", run_dir)
    assert again is not None and again["verdict"] == "valid"  # reused, labelled for the cell
    assert "shared_with" in again
    assert rec.earlier(cell, "strict", run_dir)["failed"]  # another mode: refused
    rec.update_meta(run_dir, session="another")
    refused = rec.earlier(cell, "audit", run_dir)
    assert refused is not None and refused["verdict"] == "error" and refused["failed"]
    other = rec.planner.run_dir(cells[1])
    other.mkdir(parents=True)
    (other / "leftover").write_text("x")  # not empty, no cell-run.json: never overwritten
    assert rec.earlier(cells[1], "audit", other)["failed"]


def test_a_record_that_is_not_strict_json_is_not_reused(tmp_path: Path) -> None:
    rec, cells = _recorder(tmp_path)
    run_dir = rec.planner.run_dir(cells[0])
    run_dir.mkdir(parents=True)
    (run_dir / CELL_RUN_FILE).write_text('{"session": "a", "session": "b"}')
    with pytest.raises(ValueError, match="duplicate key"):
        rec.earlier(cells[0], "audit", run_dir)
