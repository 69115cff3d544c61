"""The plugin end to end: pytester sessions over the fake framework (real subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import outcomes as _outcomes

REQUIRED_FIELDS = (
    "requested_case", "actual_training_implementation", "actual_rollout_implementation",
    "training_backend_id", "rollout_backend_id", "contract_id", "build_fingerprint",
    "hardware_fingerprint", "fallbacks", "exit_code", "active_token_count",
    "logprob_abs_diff_mean", "logprob_abs_diff_max", "logprob_abs_diff_p50",
    "logprob_abs_diff_p90", "logprob_abs_diff_p99", "mismatch_count", "rollout_wall_time",
    "training_wall_time", "weight_sync_wall_time", "step_wall_time", "tokens_per_second",
    "peak_memory", "hardware", "module", "case", "cases", "verdict", "reasons", "run_id",
    "artifact_dir", "validity",
)


def _report(root: Path) -> dict:
    return json.loads((root / "matrix-report.json").read_text())


def _cell(report: dict, module: str, case: str) -> dict:
    (cell,) = [c for c in report["cells"] if c["module"] == module and c["case"] == case]
    return cell


def test_plugin_import_is_light() -> None:
    code = ("import sys, pytest_rlkernel_matrix.plugin as p; "
            "print(sorted(m for m in ('torch', 'vllm', 'megatron', 'numpy', 'pydantic') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_pairwise_collects_one_item_per_cell(pytester: pytest.Pytester, make_matrix) -> None:
    make_matrix()
    result = pytester.runpytest("--collect-only", "-q", "--rlk-hardware=cpu")
    assert not (pytester.path / "outputs").exists()  # collecting writes nothing
    lines = [ln for ln in result.outlines if ln.startswith("matrix.toml::")]
    assert len(lines) == 12
    assert "matrix.toml::cpu::attention[P/R]" in lines
    assert "matrix.toml::cpu::logp[R/R]" in lines


@pytest.mark.parametrize(
    ("args", "count"),
    [
        (["-k", "attention"], 4),
        (["-k", "attention and P/R"], 1),
        (["-k", "cpu and ffn and not R/R"], 3),
        (["-m", "rlk_baseline"], 3),
        (["-m", "rlk_module(name='ffn')"], 4),
        (["-m", "rlk_case(case='R/P')"], 3),
        (["--rlk-layout=reduced"], 6),
        (["--rlk-layout=module-factorial"], 8),
        (["--rlk-layout=full"], 64),
    ],
)
def test_selection(pytester: pytest.Pytester, make_matrix, args: list[str], count: int) -> None:
    make_matrix()
    result = pytester.runpytest("--rlk-plan", "--rlk-hardware=cpu", *args)
    assert result.ret == 0
    cells = "1 cell" if count == 1 else f"{count} cells"
    result.stdout.fnmatch_lines([f"# rlk plan: {cells}, matrix root *"])


def test_plan_prints_env_and_runs_nothing(pytester: pytest.Pytester, make_matrix,
                                          tmp_path: Path) -> None:
    make_matrix(hardware='[hardware.h100]\nbackend = "cuda"\nmatch = { device_name = "H100" }\n'
                'env = { CUDA_DEVICE_MAX_CONNECTIONS = "1", HF_TOKEN = "hunter2" }\n')
    root = tmp_path / "root"
    result = pytester.runpytest("--rlk-plan", "--rlk-hardware=h100", "-k", "attention",
                                f"--rlk-matrix-root={root}")
    assert result.ret == 0
    text = result.stdout.str()
    assert "RL_KERNEL_ATTENTION_CASE=P/R" in text
    assert "RL_KERNEL_FFN_CASE=R/R" in text
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in text
    assert "hunter2" not in text and "HF_TOKEN='<redacted>'" in text
    assert text.count("# h100/attention-") == 4
    assert not root.exists()


def test_plan_for_named_hardware_is_that_machines_plan(
        pytester: pytest.Pytester, make_matrix, tmp_path: Path, reuse_probe: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--rlk-plan --rlk-hardware=h100` copies nothing this machine decides into the H100's
    cells (this Python, this box's CPU share) and names what the H100 decides at run time; a
    value the profile sets is shown. Header and run ids carry one stamp. Without
    `--rlk-hardware` the plan is this machine's and shows its values."""
    import re

    make_matrix(hardware='[hardware.cpu]\nbackend = "cpu"\n[hardware.h100]\nbackend = "cuda"\n'
                'match = { device_name = "H100" }\n'
                'env = { PYTHON_BIN = "/opt/venv/bin/python3" }\n')
    monkeypatch.delenv("PYTHON_BIN", raising=False)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MATRIX_ROOT", "MATRIX_STAMP"):
        monkeypatch.delenv(var, raising=False)
    result = pytester.runpytest("--rlk-plan", "--rlk-hardware=h100", "-k", "attention")
    assert result.ret == 0
    text = result.stdout.str()
    for var in ("OMP_NUM_THREADS=", "MKL_NUM_THREADS=", "RLK_MATRIX_CPUS=", "RLK_MATRIX_THREADS="):
        assert var not in text, var
    assert text.count("PYTHON_BIN=/opt/venv/bin/python3") == 4  # the profile's own value
    assert text.count("# decided at run time on the h100 machine") == 1
    assert "#   PYTHON_BIN" not in text
    assert ("#   OMP_NUM_THREADS, MKL_NUM_THREADS, RLK_MATRIX_THREADS: the size of the cell's "
            "CPU share there") in text
    assert "#   RLK_MATRIX_CPUS: the cell's CPU list there" in text
    (stamp,) = re.findall(r"# rlk plan: 4 cells, matrix root \S*ablation-matrix-(\d{8}T\d{6}Z)",
                          text)
    ids = set(re.findall(r"RL_KERNEL_RUN_ID=h100-attention-[a-z]{2}-(\d{8}T\d{6}Z)-", text))
    assert ids == {stamp}
    # This machine's plan (preflight detects cpu): its Python and its CPU share.
    here = pytester.runpytest("--rlk-plan", "-k", "attention and R/R")
    assert here.ret == 0
    text = here.stdout.str()
    assert f"PYTHON_BIN={sys.executable}" in text and "RLK_MATRIX_CPUS=" in text
    assert "decided at run time" not in text
    (stamp,) = re.findall(r"ablation-matrix-(\d{8}T\d{6}Z)\n", text)
    assert set(re.findall(r"RL_KERNEL_RUN_ID=cpu-attention-rr-(\d{8}T\d{6}Z)-", text)) == {stamp}
    # Named, even when it is this machine's profile: what the run decides is named, not guessed.
    named = pytester.runpytest("--rlk-plan", "--rlk-hardware=cpu", "-k", "attention and R/R")
    assert named.ret == 0
    text = named.stdout.str()
    assert "PYTHON_BIN=" not in text and "RLK_MATRIX_CPUS=" not in text
    assert "#   PYTHON_BIN: the Python that runs pytest there, unless the environment sets" in text


def test_hardware_not_on_this_machine_is_a_usage_error(pytester: pytest.Pytester,
                                                       make_matrix) -> None:
    make_matrix(hardware='[hardware.cpu]\nbackend = "cpu"\n[hardware.h100]\nbackend = "cuda"\n'
                'match = { device_name = "H100" }\n')
    result = pytester.runpytest("--rlk-hardware=h100")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--rlk-hardware=h100: this machine is detected as cpu*"])
    result = pytester.runpytest("--rlk-hardware=mi999", "--rlk-plan")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--rlk-hardware names mi999*"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[matrix]\nlayot = "full"\n[runner]\ncommand = "x"\n[hardware.cpu]\nbackend = "cpu"\n',
         "matrix.layot: unknown key"),
        ('[runner]\ncommand = "x"\ntimeout = -1\n[hardware.cpu]\nbackend = "cpu"\n',
         "runner.timeout: Input should be greater than 0"),
        ('[matrix]\ncases = ["P/R", "X/Y"]\n[runner]\ncommand = "x"\n[hardware.cpu]\n'
         'backend = "cpu"\n', "matrix.cases: 'X/Y' is not a case"),
        ('[runner]\ncommand = "x"\n[hardware.h100]\nbackend = "nvidia"\n',
         "hardware.h100.backend: Input should be 'cuda', 'rocm' or 'cpu'"),
        ('[matrix]\ncases = ["P/R"]\n[runner]\ncommand = "x"\n[hardware.cpu]\nbackend = "cpu"\n',
         "cases must include 'R/R'"),
        ('[hardware.cpu]\nbackend = "cpu"\n', "runner: required key is missing"),
        ("[matrix\n", "not valid TOML"),
    ],
)
def test_bad_matrix_file_is_a_one_paragraph_usage_error(
    pytester: pytest.Pytester, text: str, expected: str
) -> None:
    path = pytester.makefile(".toml", matrix=text)
    # A file that is not TOML is not recognised as a matrix file unless named (issue 47)
    result = pytester.runpytest(*(["--rlk-matrix=matrix.toml"] if "TOML" in expected else []))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert str(path) in err
    assert expected in err
    assert "Traceback" not in err + result.stdout.str()


def test_full_pairwise_run_report_and_dedup(pytester: pytest.Pytester, make_matrix,
                                            tmp_path: Path) -> None:
    make_matrix(env={"HF_TOKEN": "hunter2", "WANDB_API_KEY": "k-123"})
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "-p", "no:randomly")
    assert result.ret == 0
    assert _outcomes(result) == {"passed": 12}
    report = _report(root)
    assert report["complete"] is True and report["summary"] == {"valid": 12}
    assert report["schema_version"] == "rlk-matrix.report.v1"
    assert len(report["cells"]) == 12
    for cell in report["cells"]:
        missing = [f for f in REQUIRED_FIELDS if f not in cell]
        assert not missing, (cell["module"], cell["case"], missing)
        assert set(cell["validity"]) == {"route", "semantic", "numeric", "performance",
                                         "reproducibility"}
    # R/R of every module is one run, in one directory, reported three times.
    baselines = [c for c in report["cells"] if c["case"] == "R/R"]
    assert {c["artifact_dir"] for c in baselines} == {"cpu/attention-rr"}
    assert {c["run_id"] for c in baselines} == {baselines[0]["run_id"]}
    assert not (root / "cpu" / "ffn-rr").exists()
    assert sorted(_cell(report, "ffn", "R/R")["shared_with"]) == ["cpu/attention-rr",
                                                                  "cpu/logp-rr"]
    assert len({c["run_id"] for c in report["cells"]}) == 10
    rr = _cell(report, "attention", "R/R")
    assert rr["mismatch_count"] == 0 and rr["contract"]["kind"] == "bitwise"
    pr = _cell(report, "attention", "P/R")
    assert pr["mismatch_count"] > 0 and pr["actual_training_implementation"] == "production"
    assert pr["actual_rollout_implementation"] == "rl_kernel"
    assert pr["validity"]["numeric"]["valid"] is None  # no contract with a P side: not judged
    # Artifacts per cell; secrets never written.
    cell_dir = root / "cpu" / "attention-pr"
    for name in ("matrix-case.env", "run.log", "exit-code", "readbacks", "mismatch-sidecars"):
        assert (cell_dir / name).exists(), name
    env_text = (cell_dir / "matrix-case.env").read_text()
    assert "RL_KERNEL_ATTENTION_CASE=P/R" in env_text
    assert "HF_TOKEN='<redacted>'" in env_text and "WANDB_API_KEY='<redacted>'" in env_text
    for path in root.rglob("*"):
        if path.is_file() and path.suffix != ".pt":
            assert "hunter2" not in path.read_text(errors="replace"), path
    assert (root / "preflight.json").exists()
    assert "rlk matrix" in result.stdout.str()


@pytest.mark.parametrize(
    ("scenario", "case", "verdict", "reason"),
    [
        ("clean", "R/R", "valid", None),
        ("silent_fallback", "R/R", "contract_mismatch", "bitwise contract violated"),
        ("contract_mismatch", "R/R", "contract_mismatch", "bitwise contract violated"),
        ("recorded_fallback", "R/R", "fallback", "attention rollout: fallback recorded"),
        ("unsupported", "R/R", "unsupported", "platform_unsupported: attention rollout"),
        ("build_failure", "R/R", "unsupported", "build_failure"),
        ("stale_weight", "R/R", "incomparable", "weight version 0: sides hold different weights"),
        ("crash", "R/R", "error", "exit code 1"),
        ("nan", "P/R", "error", "NaN/inf"),
        ("missing_readback", "R/R", "error", "R route unproven"),
    ],
)
def test_planted_faults_get_their_verdict(
    pytester: pytest.Pytester, make_matrix, tmp_path: Path, scenario: str, case: str,
    verdict: str, reason: str | None,
) -> None:
    make_matrix(env={"FAKE_SCENARIO": scenario}, modules='["attention"]')
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "-k", f"attention and {case}")
    cell = _cell(_report(root), "attention", case)
    assert cell["verdict"] == verdict, cell["reasons"]
    if reason:
        assert any(reason in r for r in cell["reasons"]), cell["reasons"]
    assert _outcomes(result) == {"failed" if verdict in ("error", "incomparable") else "passed": 1}
    # audit mode fails only error/incomparable
    assert (result.ret != 0) == (verdict in ("error", "incomparable"))


def test_hang_past_timeout_kills_the_process_group(pytester: pytest.Pytester, make_matrix,
                                                   tmp_path: Path) -> None:
    make_matrix(env={"FAKE_SCENARIO": "hang"}, timeout=3, modules='["attention"]')
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "attention and R/R")
    cell = _cell(_report(root), "attention", "R/R")
    assert cell["verdict"] == "error" and cell["timed_out"] is True
    assert any("timeout" in r for r in cell["reasons"])
    log = (root / "cpu" / "attention-rr" / "run.log").read_text()
    assert "timeout after 3 s: killed process group" in log
    assert result.ret == 1
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "time.sleep(600)" not in ps


def test_strict_baseline_gate(pytester: pytest.Pytester, make_matrix, tmp_path: Path) -> None:
    make_matrix()
    ok = pytester.runpytest("--rlk-mode=strict", "-m", "rlk_baseline",
                            f"--rlk-matrix-root={tmp_path / 'a'}")
    assert ok.ret == 0 and _outcomes(ok) == {"passed": 3}
    make_matrix(env={"FAKE_SCENARIO": "silent_fallback"})
    bad = pytester.runpytest("--rlk-mode=strict", "-m", "rlk_baseline",
                             f"--rlk-matrix-root={tmp_path / 'b'}")
    assert bad.ret == 1
    assert _outcomes(bad)["failed"] == 3
    bad.stdout.fnmatch_lines(["cpu attention R/R, ffn R/R, logp R/R: contract_mismatch (FAILED)",
                              "    bitwise contract violated: 140 of 140 active tokens differ*"])
    # the same fault in audit mode is recorded but does not fail the session
    audit = pytester.runpytest("--rlk-mode=audit", "-m", "rlk_baseline",
                               f"--rlk-matrix-root={tmp_path / 'c'}")
    assert audit.ret == 0
    # an all-R baseline with no contract from any source is never passed by strict
    make_matrix(env={"FAKE_SCENARIO": "no_contract"})
    unjudged = pytester.runpytest("--rlk-mode=strict", "-m", "rlk_baseline",
                                  f"--rlk-matrix-root={tmp_path / 'd'}")
    assert unjudged.ret == 1 and _outcomes(unjudged)["failed"] == 3
    unjudged.stdout.fnmatch_lines(["    no contract: not judged: neither the logp provider nor "
                                   "matrix.toml (baseline_contract) declares*"])


def test_off_mode_runs_only_native_cells(pytester: pytest.Pytester, make_matrix,
                                         tmp_path: Path) -> None:
    make_matrix(modules='["attention", "ffn"]')
    root = tmp_path / "root"
    result = pytester.runpytest("--rlk-mode=off", f"--rlk-matrix-root={root}")
    assert result.ret == 0
    assert _outcomes(result) == {"passed": 2, "skipped": 6}
    assert [p.name for p in (root / "cpu").iterdir()] == ["attention-pp"]  # one native run
    report = _report(root)
    pp = _cell(report, "attention", "P/P")
    assert pp["verdict"] == "valid" and pp["mismatch_count"] > 0
    assert pp["contract_id"] == "vime.native.linear_logp.v1"
    assert _cell(report, "attention", "R/R")["verdict"] == "not_run"
    # the other cells were not run: said so, not "cells ran on nodes that differ"
    result.stdout.fnmatch_lines(["cpu attention: *; no performance conclusion (R/R is not_run; "
                                 "P/R is not_run; R/P is not_run)"])
    assert "nodes that differ" not in result.stdout.str()


def test_xdist_writes_one_complete_report(pytester: pytest.Pytester, make_matrix,
                                          tmp_path: Path) -> None:
    make_matrix()
    root = tmp_path / "root"
    result = pytester.runpytest_subprocess("-n", "2", f"--rlk-matrix-root={root}")
    assert result.ret == 0
    report = _report(root)
    assert report["complete"] is True and len(report["cells"]) == 12
    assert len({c["run_id"] for c in report["cells"]}) == 10
    assert len(list((root / "cpu").iterdir())) == 10


def test_artifacts_are_never_overwritten(pytester: pytest.Pytester, make_matrix,
                                         tmp_path: Path) -> None:
    make_matrix(modules='["attention"]')
    root = tmp_path / "root"
    first = pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R")
    assert first.ret == 0
    again = pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R")
    assert again.ret == pytest.ExitCode.USAGE_ERROR
    again.stderr.fnmatch_lines(["*already holds preflight.json*never overwritten*"])
    other = tmp_path / "other"
    (other / "cpu" / "attention-pr").mkdir(parents=True)
    (other / "cpu" / "attention-pr" / "run.log").write_text("somebody else's run\n")
    third = pytester.runpytest(f"--rlk-matrix-root={other}", "-k", "P/R")
    cell = _cell(_report(other), "attention", "P/R")
    assert cell["verdict"] == "error" and "refusing to overwrite" in cell["reasons"][0]
    assert (other / "cpu" / "attention-pr" / "run.log").read_text() == "somebody else's run\n"
    assert third.ret == 1


def test_matrix_root_from_env_and_other_cwd(pytester: pytest.Pytester, make_matrix,
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    path = make_matrix(modules='["attention"]')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("MATRIX_STAMP", "20260830")
    monkeypatch.delenv("MATRIX_ROOT", raising=False)
    result = pytester.runpytest_subprocess(f"--rlk-matrix={path}", "-k", "R/R")
    assert result.ret == 0, result.stdout.str()
    root = path.parent / "outputs" / "rlkernel" / "ablation-matrix-20260830"
    assert _report(root)["summary"] == {"valid": 1}


def test_conftest_fixture_override_and_record_property(pytester: pytest.Pytester, make_matrix,
                                                       tmp_path: Path) -> None:
    make_matrix(env={"FAKE_SCENARIO": "recorded_fallback"}, modules='["attention"]')
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture
        def rlk_mode():
            return "strict"

        def pytest_rlk_cell_env(config, cell, env):
            env["SITE_MARKER"] = cell.slug
        """
    )
    root = tmp_path / "root"
    xml = tmp_path / "junit.xml"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R", f"--junitxml={xml}",
                                "-o", "junit_family=xunit1")
    assert result.ret == 1  # strict (from the conftest fixture) fails the fallback
    assert _cell(_report(root), "attention", "R/R")["mode"] == "strict"
    assert "SITE_MARKER=attention-rr" in (root / "cpu/attention-rr/matrix-case.env").read_text()
    assert 'name="rlk_verdict" value="fallback"' in xml.read_text()


def test_interrupt_still_writes_the_report(pytester: pytest.Pytester, make_matrix,
                                           tmp_path: Path) -> None:
    script = tmp_path / "interrupt.sh"
    script.write_text("#!/bin/sh\nkill -INT $PPID\nsleep 30\n")
    script.chmod(0o755)
    pytester.makefile(".toml", matrix=(
        f'[matrix]\nmodules = ["attention"]\n[runner]\ncommand = ["{script}"]\ntimeout = 60\n'
        '[hardware.cpu]\nbackend = "cpu"\n'))
    root = tmp_path / "root"
    result = pytester.runpytest_subprocess(f"--rlk-matrix-root={root}")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    report = _report(root)
    assert report["interrupted"] is True and report["complete"] is False


def test_every_cell_of_a_crashing_matrix_is_reported(pytester: pytest.Pytester, make_matrix,
                                                     tmp_path: Path) -> None:
    make_matrix(env={"FAKE_SCENARIO": "crash", "FAKE_ONLY_WHEN": "A-PR_F-RR_L-RR"},
                modules='["attention"]')
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}")
    assert _outcomes(result) == {"passed": 3, "failed": 1}
    report = _report(root)
    assert report["complete"] is True
    err = _cell(report, "attention", "P/R")
    assert "CUDA error" in " ".join(err["reasons"])
    assert os.path.exists(root / err["artifact_dir"] / "run.log")


def test_report_command_reproduces_the_report(pytester: pytest.Pytester, make_matrix,
                                              tmp_path: Path) -> None:
    make_matrix(env={"FAKE_SCENARIO": "recorded_fallback", "FAKE_ONLY_WHEN": "A-PR_F-RR_L-RR"})
    root = tmp_path / "root"
    pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "attention or ffn")
    out = tmp_path / "again.json"
    done = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.cli", "report",
                           str(root), "--output", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    # one line like pytest's summary, not a Python dict
    assert done.stdout.splitlines() == [
        f"1 fallback, 7 valid (timings: 0 usable, 8 not usable) in 8 of 8 cells (incomplete): "
        f"{out}"]  # -k selected 8 of the matrix's 12 cells (issue 47)
    before, after = _report(root), json.loads(out.read_text())
    before.pop("created"), after.pop("created")
    for cell in before["cells"] + after["cells"]:  # the plugin's own time: each analysis its own
        cell.pop("overhead_s"), cell.pop("overhead")
    assert before == after
    assert before["summary"] == {"fallback": 1, "valid": 7}


def test_progress_lines_for_a_long_cell(pytester: pytest.Pytester, make_matrix,
                                        tmp_path: Path) -> None:
    # Only the second cell is slow: its progress lines come after the first cell's dot.
    make_matrix(env={"FAKE_SCENARIO": "slow", "FAKE_ONLY_WHEN": "A-PR_F-RR_L-RR"},
                modules='["attention"]')
    for verbosity in ("-q", "-v"):
        result = pytester.runpytest(f"--rlk-matrix-root={tmp_path / verbosity}", "-k",
                                    "R/R or P/R", "-o", "rlk_progress_interval=1", verbosity,
                                    "-p", "no:randomly")
        assert result.ret == 0
        result.stdout.fnmatch_lines(["[[]rlk[]] cpu/attention-pr: * s, run.log: rollout *"])
        lines = result.stdout.lines
        # each on a line of its own, never after a progress dot or a test id
        assert all(ln.startswith("[rlk] ") for ln in lines if "[rlk]" in ln), lines
        # no blank line around them, and the file's name is not printed again after each one
        # (issue 53: `matrix.toml` with blank lines every 30 s)
        at = [i for i, ln in enumerate(lines) if ln.startswith("[rlk] cpu/attention-pr")]
        assert at and all(lines[i - 1].strip() and lines[i + 1].strip() for i in at), lines
        if verbosity == "-q":
            assert sum(ln.startswith("matrix.toml") for ln in lines) <= 1, lines


def test_progress_line_is_cut_at_a_word_boundary() -> None:
    from pytest_rlkernel_matrix.plugin import progress_line

    text = progress_line("cpu/attention-rr", 31.4, "rollout 3: " + "wordy " * 40, 80)
    assert len(text) <= 80 and text.endswith("wordy ...")
    assert text.startswith("[rlk] cpu/attention-rr: 31 s, run.log: rollout 3: wordy")
    assert progress_line("c", 1, "  ", 80) == "[rlk] c: 1 s, run.log: (empty)"


def test_profiler_contaminates_performance_only(pytester: pytest.Pytester, make_matrix,
                                                tmp_path: Path) -> None:
    make_matrix(env={"FAKE_SCENARIO": "profiler"}, modules='["attention"]')
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R")
    cell = _cell(_report(root), "attention", "R/R")
    assert result.ret == 0 and cell["verdict"] == "valid"
    assert cell["validity"]["performance"]["valid"] is False
    assert cell["performance_usable"] is False
    assert "profiler" in " ".join(cell["validity"]["performance"]["reasons"])


@pytest.mark.fresh_probe
def test_strict_fails_fast_when_preflight_finds_no_r_backend(
    pytester: pytest.Pytester, make_matrix, tmp_path: Path, shared_probe: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No rl_engine here: strict refuses the R cells before launch; P/P still runs."""
    make_matrix(r_provider="rl_engine", modules='["attention"]')
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "--rlk-mode=strict")
    assert result.ret == 1
    report = _report(root)
    pre = json.loads((root / "preflight.json").read_text())
    assert pre["capabilities"]["capabilities"]["r_backend.attention"]["status"] == "unavailable"
    assert "reused" not in pre["probe"]  # fresh_probe: this session ran its own probe
    rr = _cell(report, "attention", "R/R")
    assert rr["verdict"] == "unsupported" and rr["exit_code"] is None
    assert rr["unsupported_class"] == "platform_unsupported"
    assert any("not started (strict fails closed)" in r for r in rr["reasons"])
    cell_dir = root / "cpu" / "attention-rr"
    assert (cell_dir / "exit-code").read_text().strip() == "not-started"
    assert (cell_dir / "matrix-case.env").exists()
    assert json.loads((cell_dir / "capability-decision.json").read_text())["blockers"]
    assert not (cell_dir / "run.log").exists()  # the job never started
    # cells refused for the same reasons are one group: every reason printed once
    summary = result.stdout.str().split("= rlk matrix =", 1)[1].split("matrix report:", 1)[0]
    reasons = [line for line in summary.splitlines() if line.startswith("    ")]
    assert reasons and len(reasons) == len(set(reasons)), summary
    # attention P/P still needs R for ffn and logp (fixed at R/R): refused too
    assert _cell(report, "attention", "P/P")["verdict"] == "unsupported"
    # off mode needs no RL-Kernel at all: the native baseline runs (the sessions below take the
    # shared probe: the same interpreter, probed once; the session above ran its own)
    monkeypatch.setenv("RLK_REUSE_PROBE", str(shared_probe))
    off = pytester.runpytest(f"--rlk-matrix-root={tmp_path / 'off'}", "--rlk-mode=off")
    assert off.ret == 0
    assert _cell(_report(tmp_path / "off"), "attention", "P/P")["verdict"] == "valid"
    # audit runs what is available; the evidence decides
    audit = pytester.runpytest(f"--rlk-matrix-root={tmp_path / 'audit'}", "--rlk-mode=audit",
                               "-k", "R/R")
    assert audit.ret == 0
    assert _cell(_report(tmp_path / "audit"), "attention", "R/R")["verdict"] == "valid"


@pytest.mark.parametrize(("scenario", "verdict", "failed", "note"), [
    ("unsupported", "unsupported", False, "expected unsupported: no ROCm build yet"),
    ("clean", "valid", False, "declared expected unsupported, but the cell is valid"),
])
def test_expected_gaps_work_like_xfail(pytester: pytest.Pytester, make_matrix, tmp_path: Path,
                                       scenario: str, verdict: str, failed: bool,
                                       note: str) -> None:
    make_matrix(env={"FAKE_SCENARIO": scenario}, modules='["attention"]', hardware=(
        '[hardware.cpu]\nbackend = "cpu"\n[[hardware.cpu.expect_unsupported]]\n'
        'module = "attention"\ncase = "R/R"\nreason = "no ROCm build yet"\n'))
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "--rlk-mode=strict", "-k", "R/R")
    cell = _cell(_report(root), "attention", "R/R")
    assert cell["verdict"] == verdict and cell["failed"] is failed
    assert cell["expected_gap"] == note
    assert result.ret == 0


def test_report_carries_the_capability_report(pytester: pytest.Pytester, make_matrix,
                                              tmp_path: Path) -> None:
    make_matrix(modules='["attention"]')
    root = tmp_path / "root"
    pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R")
    caps = _report(root)["preflight"]["capabilities"]
    assert caps["r_provider"] == "external"
    assert set(caps["summary"]) == {"verified", "unavailable", "untested"}


def test_shared_probe_reuse_is_recorded(pytester: pytest.Pytester, make_matrix,
                                        tmp_path: Path, shared_probe: Path) -> None:
    """The test suite's shared probe (RLK_REUSE_PROBE) is never taken for a fresh one."""
    make_matrix(modules='["attention"]')
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "-k", "R/R")
    result.stdout.fnmatch_lines(["rlk: preflight probe REUSED from *rlk-shared-probe.json*"])
    pre = json.loads((root / "preflight.json").read_text())
    assert pre["probe"]["reused"]["from"] == str(shared_probe)
    assert pre["probe"]["reused"]["probed_at"]
    assert pre["probe"]["status"] == "ok" and pre["probe"]["torch"]["version"]
    assert _report(root)["preflight"]["probe_reused"]["from"] == str(shared_probe)
    assert "REUSED from" in (root / "matrix-report.html").read_text()
