"""Unit tests of the Slurm launcher's pure parts: batch-script rendering, the schema, and parsing
of captured sbatch/squeue/scontrol/sacct output (captured from Slurm 22.05 on Debian 12). The
feature itself is tested against a real Slurm in `test_slurm.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_rlkernel_matrix.report.attribution import attribute
from pytest_rlkernel_matrix.report.matrix_report import node_fingerprint_groups
from pytest_rlkernel_matrix.run.launchers.base import CellJob
from pytest_rlkernel_matrix.run.launchers.slurm import (
    MARKER_FILE,
    SlurmError,
    base_state,
    info_from_scontrol,
    parse_sacct,
    parse_sbatch,
    parse_scontrol,
    parse_squeue,
    render_script,
    scheduler_reason,
    seconds,
    time_limit,
)
from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, SlurmSection, load_matrix

SCONTROL_TIMEOUT = (
    "JobId=3 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 "
    "Nice=0 Account=(null) QOS=(null) JobState=TIMEOUT Reason=TimeLimit Dependency=(null) "
    "Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15 RunTime=00:01:25 TimeLimit=00:01:00 "
    "TimeMin=N/A SubmitTime=2026-11-30T03:12:52 EligibleTime=2026-11-30T03:12:52 "
    "AccrueTime=2026-11-30T03:12:52 StartTime=2026-11-30T03:12:52 EndTime=2026-11-30T03:14:17 "
    "Deadline=N/A Partition=debug AllocNode:Sid=vm:1234 ReqNodeList=(null) ExcNodeList=(null) "
    "NodeList=vm BatchHost=vm NumNodes=1 NumCPUs=1 TRES=cpu=1,node=1,billing=1 "
    "Socks/Node=* ReqB:S:C:T=0:0:*:* Command=(null) WorkDir=/tmp/a dir with spaces "
    "StdErr=/tmp/slt/o3 StdIn=/dev/null StdOut=/tmp/slt/o3 Power="
)


def _job(tmp_path: Path, **kw: object) -> CellJob:
    data: dict[str, object] = dict(
        key="cpu|R/R|R/R|R/R", label="cpu/attention-rr", command='echo "hi $X" && exit 3',
        cwd=tmp_path, env={}, recorded={"RL_KERNEL_MODE": "audit", "HF_TOKEN": "s3cret",
                                        "PYTHON_BIN": "/venv/bin/python"},
        run_dir=tmp_path / "cpu" / "attention-rr", timeout=125.0)
    data.update(kw)
    return CellJob(**data)  # type: ignore[arg-type]


def test_batch_script_options_marker_env_and_command(tmp_path: Path) -> None:
    section = SlurmSection(partition="gpu", gpus_per_node=8, cpus_per_task=16, account="acc",
                           qos="high", constraint="h100", extra_args=("--exclusive",))
    script = render_script(section, _job(tmp_path), python="/venv/bin/python",
                           topology={"tp": 2, "cp": 2})
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    opts = [ln.removeprefix("#SBATCH ") for ln in lines if ln.startswith("#SBATCH ")]
    run_dir = tmp_path / "cpu" / "attention-rr"
    assert opts == [
        "--job-name=rlk-cpu-attention-rr", f"--output={run_dir}/slurm-%j.out",
        f"--chdir={tmp_path}", "--no-requeue", "--nodes=1", "--time=5",
        "--partition=gpu", "--gpus-per-node=8", "--cpus-per-task=16", "--account=acc",
        "--qos=high", "--constraint=h100", "--exclusive"]
    body = [ln for ln in lines if not ln.startswith("#")]
    # the marker is the first thing the job does; the command runs last, logged to run.log
    assert MARKER_FILE in body[2]
    assert next(i for i, ln in enumerate(body) if "run.log" in ln) > 2
    assert "export RL_KERNEL_MODE=audit" in lines
    assert "s3cret" not in script and "# HF_TOKEN: from the submitting environment" in script
    assert "pytest_rlkernel_matrix.run.launchers.node" in script and '"tp": 2' in script
    assert """bash -c 'echo "hi $X" && exit 3' >> "$RLK_RUN_DIR/run.log" 2>&1""" in script
    assert 'printf "%s\\n" "$code" > "$RLK_RUN_DIR/exit-code"' in script


def test_batch_script_argv_command_and_gres(tmp_path: Path) -> None:
    script = render_script(SlurmSection(gres="gpu:mi300x:8", time="00:00:05"),
                           _job(tmp_path, command=["python", "-c", "print('a b')"]),
                           python="py")
    assert "#SBATCH --gres=gpu:mi300x:8" in script and "#SBATCH --time=00:00:05" in script
    assert """python -c 'print('"'"'a b'"'"')' >> "$RLK_RUN_DIR/run.log\"""" in script


def test_default_time_limit_covers_the_runner_timeout() -> None:
    assert time_limit(SlurmSection(), 1800) == "32"
    assert time_limit(SlurmSection(), 1) == "3"
    assert time_limit(SlurmSection(time="1-00:00:00"), 1) == "1-00:00:00"


def test_parse_sbatch() -> None:
    assert parse_sbatch("12\n") == "12"
    assert parse_sbatch("4711;cluster-a\n") == "4711"
    with pytest.raises(SlurmError, match="no job id"):
        parse_sbatch("sbatch: error: Batch job submission failed: Invalid account\n")


def test_parse_squeue_states_all() -> None:
    text = "2|CANCELLED|vm|None\n1|COMPLETED|vm|None\n4|FAILED|vm|NonZeroExitCode\n" \
           "7|PENDING||Resources\n"
    jobs = parse_squeue(text)
    assert jobs["2"].state == "CANCELLED" and jobs["2"].reason == ""
    assert jobs["4"].reason == "NonZeroExitCode" and jobs["4"].terminal
    assert jobs["7"].state == "PENDING" and not jobs["7"].terminal and jobs["7"].nodes == ""


def test_parse_scontrol_one_line_with_spaces_in_values() -> None:
    fields = parse_scontrol(SCONTROL_TIMEOUT)
    assert fields["WorkDir"] == "/tmp/a dir with spaces"
    assert fields["Socks/Node"] == "*" and fields["ReqB:S:C:T"] == "0:0:*:*"
    info = info_from_scontrol(fields)
    assert (info.job_id, info.state, info.reason, info.exit_code, info.nodes) == (
        "3", "TIMEOUT", "TimeLimit", "0:15", "vm")
    assert seconds(info.run_time) == 85.0


def test_parse_sacct() -> None:
    text = ("10|CANCELLED by 0|0:15|node[01-02]|2026-11-30T03:12:52|2026-11-30T03:13:00|"
            "00:00:08|None\n10.batch|CANCELLED|0:15|node01|x|y|00:00:08|None\n"
            "11|NODE_FAIL|1:0|node03|2026-11-30T03:12:52|Unknown|00:01:00|NodeFail\n")
    jobs = parse_sacct(text)
    assert set(jobs) == {"10", "11"}
    assert jobs["10"].state == "CANCELLED" and jobs["10"].nodes == "node[01-02]"
    assert jobs["11"].end == "" and jobs["11"].reason == "NodeFail"


@pytest.mark.parametrize("state", ["TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
                                   "CANCELLED", "BOOT_FAIL", "DEADLINE"])
def test_abnormal_states_are_reasons(state: str) -> None:
    info = info_from_scontrol(parse_scontrol(
        SCONTROL_TIMEOUT.replace("JobState=TIMEOUT", f"JobState={state}")))
    reason = scheduler_reason(info)
    assert reason is not None and reason.startswith(f"{state}: Slurm job 3 on vm")


def test_completed_and_failed_are_judged_from_the_exit_code() -> None:
    for state in ("COMPLETED", "FAILED"):
        assert scheduler_reason(info_from_scontrol({"JobId": "1", "JobState": state})) is None
    assert base_state("COMPLETING+") == "COMPLETING"


def _matrix(tmp_path: Path, runner_extra: str) -> Path:
    path = tmp_path / "m.toml"
    path.write_text(f'[runner]\ncommand = "true"\n{runner_extra}\n'
                    '[hardware.cpu]\nbackend = "cpu"\n')
    return path


@pytest.mark.parametrize(("extra", "message"), [
    ('launcher = "slurm"\n[runner.slurm]\ntime = "soon"', "runner.slurm.time: not a Slurm time"),
    ('launcher = "slurm"\n[runner.slurm]\nextra_args = ["--output=x"]',
     "runner.slurm.extra_args: --output is set by the launcher"),
    ('launcher = "slurm"\n[runner.slurm]\ngpus_per_node = 8\ngres = "gpu:8"',
     "runner.slurm: give gpus_per_node or gres, not both"),
    ('launcher = "slurm"\n[runner.slurm]\nrequeue_on = ["TIMEOUT"]', "runner.slurm.requeue_on[0]"),
    ('launcher = "slurm"\n[runner.slurm]\nmax_concurrent = 0', "runner.slurm.max_concurrent"),
    ('launcher = "slurm"\n[runner.slurm]\nparition = "gpu"', "runner.slurm.parition: unknown key"),
    ('[runner.slurm]\nnodes = 2', 'launcher is "local"'),
    ('launcher = "pbs"', "runner.launcher"),
])
def test_schema_errors_name_file_and_key(tmp_path: Path, extra: str, message: str) -> None:
    path = _matrix(tmp_path, extra)
    with pytest.raises(MatrixFileError) as err:
        load_matrix(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_schema_defaults(tmp_path: Path) -> None:
    m = load_matrix(_matrix(tmp_path, 'launcher = "slurm"'))
    assert m.runner.slurm == SlurmSection() and m.runner.slurm.max_concurrent == 1
    assert load_matrix(_matrix(tmp_path, "")).runner.launcher == "local"


def test_example_matrix_is_valid() -> None:
    m = load_matrix(Path(__file__).resolve().parents[1] / "examples" / "slurm.toml")
    assert m.runner.launcher == "slurm" and m.runner.slurm is not None
    assert m.runner.slurm.max_concurrent == 2


def _rec(case: str, hw_fp: str, nodes: str) -> dict[str, object]:
    return {"hardware": "h100", "module": "attention", "case": case, "verdict": "valid",
            "artifact_dir": f"h100/{case}", "hardware_fingerprint": hw_fp,
            "build_fingerprint": "b1", "scheduler": {"nodes": nodes},
            "performance_usable": True, "mismatch_count": 0, "step_wall_time": 1.0}


def test_cells_on_differing_nodes_are_flagged_and_timings_refused() -> None:
    recs = [_rec("R/R", "h1", "n1"), _rec("P/R", "h1", "n1"), _rec("R/P", "h2", "n7"),
            _rec("P/P", "h1", "n1")]
    groups = node_fingerprint_groups(recs)
    assert len(groups["groups"]["h100"]) == 2
    assert groups["flags"] and "n7" in groups["flags"][0] and "refused" in groups["flags"][0]
    entry = attribute(recs)[0]
    assert "no performance conclusion (cells ran on nodes that differ)" in entry["conclusion"]
    assert any("different hardware/build fingerprints" in r for r in entry["refused"])
    same = [_rec(c, "h1", "n1") for c in ("R/R", "P/R", "R/P", "P/P")]
    assert node_fingerprint_groups(same)["flags"] == []


class _RequeueOnce:
    """A launcher whose first job reports NODE_FAIL (nothing run) and whose second runs the
    command for real through the local launcher: the session's requeue bookkeeping under test."""

    name = "fake-slurm"

    def __init__(self) -> None:
        from pytest_rlkernel_matrix.run.launchers.local import LocalLauncher

        self.local = LocalLauncher()
        self.jobs: list[Path] = []

    def start(self, job: CellJob) -> None:
        return None

    def wait(self, job: CellJob) -> object:
        from pytest_rlkernel_matrix.run.launchers.base import Outcome
        from pytest_rlkernel_matrix.run.runner import RunResult

        self.jobs.append(job.run_dir)
        fps = {"hardware_fingerprint": "hw1", "build_fingerprint": "b1"}
        if job.attempt == 1:
            (job.run_dir / "exit-code").write_text("\n")
            result = RunResult(command=job.command, exit_code=None, timed_out=False,
                               interrupted=False, wall_time=0.0, started="t0", finished="t1",
                               launch_error="NODE_FAIL: Slurm job 1 on n1 lost its node")
            return Outcome(result=result, fingerprints=fps,
                           scheduler={"job_id": "1", "state": "NODE_FAIL", "nodes": "n1"})
        out = self.local.wait(job)
        out.scheduler = {"job_id": "2", "state": "COMPLETED", "nodes": "n2"}
        out.fingerprints = fps
        return out

    def cancel_all(self, why: str) -> list[str]:
        return []

    def render(self, job: CellJob) -> str:
        return ""

    def retryable(self, outcome: object) -> bool:
        return (getattr(outcome, "scheduler", None) or {}).get("state") == "NODE_FAIL"


def test_requeue_runs_once_more_into_a_fresh_directory(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.session import MatrixSession
    from pytest_rlkernel_matrix.spec.cells import expand

    fake = Path(__file__).with_name("fake_framework.py")
    path = tmp_path / "matrix.toml"
    path.write_text(f'[matrix]\nmodules = ["attention", "ffn"]\n[runner]\n'
                    f'command = ["{sys.executable}", "{fake}"]\nr_provider = "external"\n'
                    '[hardware.cpu]\nbackend = "cpu"\n')
    m = load_matrix(path)
    cells = [c for c in expand(m.matrix, ["cpu"], "pairwise", "audit") if c.case == "R/R"]
    ms = MatrixSession(matrix=m, matrix_path=path, root=tmp_path / "root", hardware=["cpu"],
                       mode="audit", layout="pairwise")
    ms.set_selected(cells)
    launcher = _RequeueOnce()
    ms._launcher = launcher  # type: ignore[assignment]
    first = ms.run_cell(cells[0], mode="audit")
    shared = ms.run_cell(cells[1], mode="audit")  # same run key: reuses the second attempt
    run_dir = ms.root / "cpu" / "attention-rr"
    assert launcher.jobs == [run_dir, run_dir.with_name("attention-rr.attempt2")]
    assert first["verdict"] == "valid" and first["artifact_dir"] == "cpu/attention-rr.attempt2"
    assert first["scheduler"]["previous_attempts"][0]["state"] == "NODE_FAIL"
    assert first["scheduler"]["previous_attempts"][0]["artifact_dir"] == "cpu/attention-rr"
    meta = json.loads((run_dir / "cell-run.json").read_text())
    assert meta["superseded_by"] == "cpu/attention-rr.attempt2"
    assert meta["run"]["launch_error"].startswith("NODE_FAIL")  # the first attempt is kept
    assert shared["artifact_dir"] == first["artifact_dir"] and shared["module"] == "ffn"


def test_requeued_drifting_cell_still_gets_its_probe_run(tmp_path: Path) -> None:
    """--rlk-probe after a requeue: the attempt that decides (``.attempt2``) gets the probe run
    (the fake framework writes no probe files, so its localisation is `incomparable`, saying
    so); the superseded first attempt gets none."""
    from pytest_rlkernel_matrix.session import MatrixSession
    from pytest_rlkernel_matrix.spec.cells import expand

    fake = Path(__file__).with_name("fake_framework.py")
    path = tmp_path / "matrix.toml"
    path.write_text(f'[matrix]\nmodules = ["attention", "ffn"]\n[runner]\n'
                    f'command = ["{sys.executable}", "{fake}"]\nr_provider = "external"\n'
                    '[hardware.cpu]\nbackend = "cpu"\n')
    m = load_matrix(path)
    cell = next(c for c in expand(m.matrix, ["cpu"], "pairwise", "audit")
                if c.case == "P/R" and c.module == "attention")
    ms = MatrixSession(matrix=m, matrix_path=path, root=tmp_path / "root", hardware=["cpu"],
                       mode="audit", layout="pairwise")
    ms.set_selected([cell])
    ms.probe = True
    ms._launcher = _RequeueOnce()  # type: ignore[assignment]
    rec = ms.run_cell(cell, mode="audit")
    first = ms.root / "cpu" / "attention-pr"
    second = first.with_name("attention-pr.attempt2")
    assert rec["artifact_dir"] == "cpu/attention-pr.attempt2" and rec["mismatch_count"] > 0
    assert (second / "probe" / "localisation.json").is_file()
    meta = json.loads((second / "probe" / "cell-run.json").read_text())
    assert meta["probe"] is True and meta["excluded_from_performance"] is True
    assert rec["localisation"]["probe_run"] == "probe"
    assert rec["localisation"]["status"] == "incomparable"  # no probe files: said, not skipped
    assert not (first / "probe").exists() and not (first / "probe-note.json").exists()


def test_local_slurm_config_gets_the_real_cpu_count_whatever_omp_says(tmp_path: Path) -> None:
    """`slurm-local.sh config` prints the slurm.conf `start` writes, without root or daemons.
    `nproc` honours OMP_NUM_THREADS (tests/conftest.py sets 1); the node must not shrink to it."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "slurm-local.sh"
    conf = tmp_path / "slurm.conf"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_THREAD_LIMIT": "1",
           "SLURM_CONF": str(conf), "RLK_SLURM_STATE": str(tmp_path / "state")}
    env.pop("RLK_SLURM_CPUS", None)
    done = subprocess.run(["bash", str(script), "config"], env=env, capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    nodes = [line.split() for line in done.stdout.splitlines() if line.startswith("NodeName=")]
    assert len(nodes) == 1, done.stdout
    fields = dict(item.split("=", 1) for item in nodes[0])
    assert fields["CPUs"] == str(len(os.sched_getaffinity(0)))
    assert f"StateSaveLocation={tmp_path / 'state'}/ctld" in done.stdout
    assert not conf.exists() and not (tmp_path / "state").exists()  # `config` writes nothing

    override = subprocess.run(["bash", str(script), "config"], capture_output=True, text=True,
                              env={**env, "RLK_SLURM_CPUS": "7"}, timeout=30, check=False)
    assert "CPUs=7 " in override.stdout
    bad = subprocess.run(["bash", str(script), "config"], capture_output=True, text=True,
                         env={**env, "RLK_SLURM_CPUS": "two"}, timeout=30, check=False)
    assert bad.returncode != 0 and "RLK_SLURM_CPUS" in bad.stderr and not bad.stdout.strip()
