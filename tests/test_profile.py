"""Issue 33 items 3-5: the fully accounted step, profile runs and the slow drill.

Real subprocess runs of the reference workload under torch.profiler, real chrome traces; no
assertion on wall-clock ratios (the box is shared): the slow drill is checked by what the profile
records (calls and kernel sums per side, phase and module)."""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_rlkernel_matrix.judge.localise import profile as pf
from pytest_rlkernel_matrix.judge.performance import accounting
from pytest_rlkernel_matrix.judge.performance.phases import phases
from pytest_rlkernel_matrix.judge.read.logscan import PHASE_KEYS, scan_log
from pytest_rlkernel_matrix.workload.env import FaultDrill, UsageError

REPO = Path(__file__).resolve().parents[1]
FAST = ["--steps", "2", "--num-prompts", "4", "--max-new-tokens", "16"]


# -- accounting ---------------------------------------------------------------------------------

def test_unattributed_series_from_vime_style_split_perf_records() -> None:
    perf = [(0, {"perf/rollout_time": 2.0}),
            (0, {"perf/step_time": 10.0, "perf/train_time": 3.0, "perf/actor_train_time": 2.5,
                 "perf/update_weights_time": 0.5}),
            (1, {"perf/rollout_time": 2.5}),
            (1, {"perf/step_time": 9.0, "perf/train_time": 3.5,
                 "perf/update_weights_time": 0.5}),
            (2, {"perf/rollout_time": 1.0})]  # no training record: not accounted
    assert accounting.unattributed_series(perf, PHASE_KEYS) == [4.5, 2.5]
    # no weight sync reported anywhere: no accounting at all (never a guess)
    no_sync = [(s, {k: v for k, v in r.items() if k != "perf/update_weights_time"})
               for s, r in perf]
    assert accounting.unattributed_series(no_sync, PHASE_KEYS) == []


def test_log_phases_carry_unattributed_median_and_share(tmp_path: Path) -> None:
    lines = []
    for step, step_time in enumerate((10.0, 9.8, 10.2)):
        lines.append(f"perf {step}: {{'perf/rollout_time': 3.0}}")
        lines.append(f"perf {step}: {{'perf/step_time': {step_time}, 'perf/train_time': 2.0, "
                     f"'perf/update_weights_time': 1.0, 'perf/rlk_debug_time': 0.25}}")
    (tmp_path / "run.log").write_text("\n".join(lines) + "\n")
    medians, spread = phases(scan_log(tmp_path / "run.log"), warmup=1)
    assert medians["unattributed_wall_time"] == pytest.approx(4.0)
    assert medians["unattributed_share"] == pytest.approx(0.4)
    assert medians["debug_wall_time"] == 0.25
    assert spread["unattributed_wall_time"]["steps"] == pytest.approx([3.8, 4.2])
    rec = {"step_wall_time": 10.0, "unattributed_wall_time": 4.0}
    note = accounting.unattributed_note({"R/R": rec, "R/P": {**rec, "step_wall_time": 20.0}})
    assert note is not None and "above 10%" in note and "R/R 4 s (40%)" in note
    assert "R/P 4 s (20%)" in note
    small = {"step_wall_time": 10.0, "unattributed_wall_time": 0.5}
    assert accounting.unattributed_note({"R/R": small, "P/R": small}) is None
    assert accounting.table_cell(rec) == "4 (40%)"


def test_attribution_statement_names_a_large_unattributed_share() -> None:
    from pytest_rlkernel_matrix.report.attribution import attribute

    cells = []
    for case in ("R/R", "P/R", "R/P", "P/P"):
        cells.append({"hardware": "cpu", "module": "ffn", "case": case, "verdict": "valid",
                      "mismatch_count": 0, "performance_usable": True,
                      "step_wall_time": 10.0, "rollout_wall_time": 3.0,
                      "training_wall_time": 2.0, "weight_sync_wall_time": 1.0,
                      "unattributed_wall_time": 4.0})
    (entry,) = attribute(cells)
    assert "unattributed step time above 10%" in entry["conclusion"]
    assert entry["unattributed"].startswith("unattributed step time")


# -- the slow drill's parsing ---------------------------------------------------------------------

@pytest.mark.parametrize("raw", ["slow:ffn:rollout", "slow:ffn:rollout:0.5", "slow:ffn:rollout:x",
                                 "slow:ffn:rollout:nan", "silent_fallback:ffn:rollout:2"])
def test_bad_slow_drills_are_usage_errors(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLK_REF_FAULT", raw)
    with pytest.raises(UsageError, match="RLK_REF_FAULT"):
        FaultDrill.from_env()


def test_slow_drill_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLK_REF_FAULT", "slow:ffn:rollout:1.5")
    assert FaultDrill.from_env() == FaultDrill("slow", "ffn", "rollout", 1.5)


# -- the chrome-trace reader ----------------------------------------------------------------------

def _x(name: str, cat: str, ts: float, dur: float, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": args}


def test_cpu_trace_self_time_by_side_phase_module_and_backward_by_sequence() -> None:
    events = [
        _x("rlk.phase.training", "user_annotation", 0, 100),
        _x("rlk.training.ffn", "user_annotation", 1, 30),
        _x("aten::linear", "cpu_op", 2, 20, **{"Sequence number": 7}),
        _x("aten::mm", "cpu_op", 3, 15),  # child: linear's self time is 5
        _x("aten::silu", "cpu_op", 25, 4),
        _x("aten::add", "cpu_op", 40, 6),  # training phase, no module: other
        _x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 50, 30,
           **{"Sequence number": 7}),
        _x("aten::mm", "cpu_op", 51, 25),  # backward of ffn's op: ffn
        {"ph": "M", "name": "process_name"},  # metadata: ignored
    ]
    got = pf.bucket_events(events)
    assert got["unit"] == "CPU operator self time" and got["annotated"]
    ffn = got["times"]["training"]["training"]["ffn"]
    assert ffn["aten::mm"] == [15.0, 25.0] and ffn["aten::linear"] == [5.0]
    assert ffn["aten::silu"] == [4.0]
    assert ffn["autograd::engine::evaluate_function: MmBackward0"] == [5.0]
    assert got["times"]["unknown"]["training"]["other"]["aten::add"] == [6.0]


def test_summary_counts_calls_times_the_median_call(tmp_path: Path) -> None:
    """A preempted call (a loaded CPU) does not read as kernel time: calls x median call."""
    d = tmp_path / "profile"
    d.mkdir()
    events = [_x("rlk.phase.rollout", "user_annotation", 0, 100_000),
              _x("rlk.rollout.ffn", "user_annotation", 1, 90_000)]
    events += [_x("aten::mm", "cpu_op", 10 + 10_000 * i, 50 if i != 3 else 5_000)
               for i in range(5)]
    with gzip.open(d / "trace.rank00000.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    ffn = pf.summarise(d, steps=2)["buckets"]["rollout"]["rollout"]["ffn"]
    assert ffn["calls_per_step"] == 2.5
    assert ffn["ms_per_step"] == pytest.approx(5 * 0.05 / 2)
    assert ffn["sum_ms_per_step"] == pytest.approx((4 * 0.05 + 5.0) / 2)


def test_gpu_trace_kernels_follow_their_launch_and_foreign_traces_bucket_by_name(
        tmp_path: Path) -> None:
    events = [
        _x("rlk.phase.rollout", "user_annotation", 0, 100),
        _x("rlk.rollout.attention", "user_annotation", 1, 10),
        _x("cudaLaunchKernel", "cuda_runtime", 2, 1, correlation=11),
        {**_x("flash_fwd_kernel", "kernel", 5, 40, correlation=11), "tid": 7},
        _x("cudaLaunchKernel", "cuda_runtime", 20, 1, correlation=12),
        {**_x("ncclDevKernel_AllGather", "kernel", 50, 8, correlation=12), "tid": 7},
    ]
    got = pf.bucket_events(events)
    assert got["unit"] == "GPU kernel time"
    assert got["times"]["rollout"]["rollout"]["attention"]["flash_fwd_kernel"] == [40.0]
    # launched in the rollout phase outside any module range of an annotated trace: other
    assert got["times"]["unknown"]["rollout"]["other"]["ncclDevKernel_AllGather"] == [8.0]
    # a framework's own trace (no rlk ranges): by kernel name, the side from the file name
    foreign = [{**_x(n, "kernel", i * 10, 5, correlation=i), "tid": 7}
               for i, n in enumerate(("ncclKernel_ReduceScatter", "fmha_cutlass",
                                      "sm90_gemm_bf16", "log_softmax_kernel"))]
    d = tmp_path / "profile"
    d.mkdir()
    with gzip.open(d / "vllm_worker0.pt.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": foreign}, f)
    (d / "junk.pt.trace.json").write_text("{not json")
    s = pf.summarise(d, steps=1)
    got2 = s["buckets"]["rollout"]["unknown"]
    assert {m: got2[m]["calls_per_step"] for m in got2} == {
        "comm": 1, "attention": 1, "other": 1, "logp": 1}
    assert s["problems"] and "junk.pt.trace.json: unreadable" in s["problems"][0]
    assert s["note"].startswith("kernel sums for localisation, not step time")


# -- the workload: accounting in the manifest, profile runs, the slow drill ----------------------

def _run(art: Path, cases: str, *, fault: str | None = None, profile: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL", "RLK_REF"))}
    att, ffn, logp = cases.split()
    env.update(RL_KERNEL_ARTIFACT_DIR=str(art), RL_KERNEL_ATTENTION_CASE=att,
               RL_KERNEL_FFN_CASE=ffn, RL_KERNEL_LOGP_CASE=logp, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO))
    if profile:
        env.update(RL_KERNEL_PROFILE="1", RL_KERNEL_PROFILE_SKIP="1")
    if fault:
        env["RLK_REF_FAULT"] = fault
    proc = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.workload", *FAST],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (art / "run.log").write_text(proc.stdout)
    return json.loads((art / "manifest.json").read_text())


def test_slow_drill_shows_in_the_profile_as_ffn_rollout_kernels(tmp_path: Path) -> None:
    slow = _run(tmp_path / "rr-slow", "R/R R/R R/R", fault="slow:ffn:rollout:1.5")
    plain = _run(tmp_path / "rr", "R/R R/R R/R")
    rp = _run(tmp_path / "rp-slow", "R/R R/P R/R", fault="slow:ffn:rollout:1.5")
    assert slow["fault_drill"]["applied"] is True and slow["fault_drill"]["factor"] == 1.5
    assert rp["fault_drill"]["applied"] is False  # rollout ffn runs P there: no drill
    for m in (slow, plain):
        assert m["profile"]["enabled"] and m["profile"]["profiled_steps"] == 1
        assert m["profile"]["excluded_from_performance"] is True
        assert "weight_audit" in m["timing"]["debug_work"]
    s = {k: pf.summarise(tmp_path / k / "profile", 1)
         for k in ("rr-slow", "rr", "rp-slow")}
    calls = {k: {(side, m): v["calls_per_step"]
                 for side in ("training", "rollout")
                 for m, v in v_["buckets"][side][side].items()}
             for k, v_ in s.items()}
    # every rollout ffn call runs its kernels 1.5 times; nothing else changes
    ratio = calls["rr-slow"][("rollout", "ffn")] / calls["rr"][("rollout", "ffn")]
    assert 1.45 <= ratio <= 1.55, ratio
    for key in calls["rr"]:
        if key != ("rollout", "ffn"):
            assert calls["rr-slow"][key] == calls["rr"][key], key
    # R (drilled) vs P on the rollout side of the ffn row: the statement names ffn's kernels
    recs = [{"hardware": "cpu", "module": "ffn", "case": "R/R", "profile": s["rr-slow"]},
            {"hardware": "cpu", "module": "ffn", "case": "R/P", "profile": s["rp-slow"]}]
    no_pair, line = pf.statements(recs)  # R/R and R/P differ on the rollout side only
    assert no_pair.startswith("cpu ffn profile, training side: no pair of profiled cells")
    assert line.startswith("cpu ffn profile, rollout phase, R/R vs R/P")
    # (whether R's drilled ffn is slower than P's native one depends on the two kernels' speed)
    assert re.search(r"ffn, rollout side: R [+-]\d+\.\d+ ms/step over P \(.*aten::", line)
    assert "kernel sums for localisation, not step time" in line
    # against the same cell without the drill: the difference is ffn's, on the rollout side
    # (kernel times of two runs on a shared box: relative, against the biggest other bucket)
    diff = {d["module"]: d for d in pf.difference(s["rr-slow"], s["rr"], "rollout", "rollout")}
    ffn, att = diff["ffn"], diff["attention"]
    assert ffn["delta_ms"] > 0 and ffn["kernels"][0]["delta_ms"] > 0, ffn
    assert ffn["r_ms"] / ffn["p_ms"] > att["r_ms"] / att["p_ms"], diff


def test_step_is_fully_accounted_in_a_measured_run(tmp_path: Path) -> None:
    manifest = _run(tmp_path / "m", "R/R R/R R/R", profile=False)
    assert manifest["profile"]["enabled"] is False and manifest["timing"]["debug_work"]
    medians, _ = phases(scan_log(tmp_path / "m" / "run.log"))
    # the weight audit is off the step clock and named; what is left in no phase is tiny
    assert medians["debug_wall_time"] is not None and medians["debug_wall_time"] > 0
    assert medians["unattributed_share"] is not None
    assert medians["unattributed_share"] < accounting.UNATTRIBUTED_LIMIT
    assert not (tmp_path / "m" / "profile").exists()


# -- through the plugin ---------------------------------------------------------------------------

def _ffn_matrix(pytester: pytest.Pytester) -> Path:
    text = (REPO / "matrix.toml").read_text()
    quick = re.sub(r"(?m)^repeats = \d+", "repeats = 1", text)
    quick = re.sub(r"(?m)^warmup = \d+", "warmup = 0", quick)
    path = pytester.path / "matrix.toml"
    path.write_text(quick)
    return path


@pytest.mark.usefixtures("reuse_probe")
def test_rlk_profile_runs_separate_profile_runs(pytester: pytest.Pytester, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix={_ffn_matrix(pytester)}",
                                f"--rlk-matrix-root={root}", "--rlk-profile", "-p",
                                "no:cacheprovider", "-k", "ffn and (R/R or R/P)")
    assert result.ret == 0, result.stdout.str()
    report = json.loads((root / "matrix-report.json").read_text())
    by_case = {c["case"]: c for c in report["cells"] if c["module"] == "ffn"}
    for case in ("R/R", "R/P"):
        c = by_case[case]
        prof = c["profile"]
        assert prof["profile_run"] == "profile" and prof["excluded_from_performance"]
        assert prof["buckets"]["rollout"]["rollout"]["ffn"]["calls_per_step"] > 0
        run = root / c["artifact_dir"]
        meta = json.loads((run / "profile" / "cell-run.json").read_text())
        assert meta["excluded_from_performance"] is True and meta["run"]["exit_code"] == 0
        # the measured run itself ran without the profiler
        measured = json.loads((run / "manifest.json").read_text())
        assert measured["profile"]["enabled"] is False
        assert c["unattributed_wall_time"] is not None
    out = result.stdout.str()
    assert "ffn profile, rollout phase, R/R vs R/P" in out
    assert "kernel sums for localisation, not step time" in out
    assert any("R/R vs R/P" in line for line in report["profile"])
    html = (root / "matrix-report.html").read_text()
    assert "Profile runs (kernel sums for localisation, not step time)" in html


# The documented drill, slow:ffn:rollout:1.5, makes R's ffn kernels 1.5 times as long on the
# rollout side; on this CPU that moves the rollout phase by a few percent, on a shared 2-core box
# about the size of the step noise between processes.
DRILL = "slow:ffn:rollout:1.5"


@pytest.mark.slow
def test_drill_end_to_end_names_ffn_rollout(pytester: pytest.Pytester, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented drill on the real reference workload with the defaults (no thread pinning,
    the declared noise gate), `--rlk-processes=auto --rlk-perf-budget=4 --rlk-profile -k ffn`:
    the report says it is a drill; the rollout side's rollout-phase statement is "slower" with
    an interval that holds the ratio of the cells' measured rollout times, or, where this box
    cannot resolve it within the budget, "inconclusive" with how many processes would (or "not
    judged" with the noise that refused the timings): never "faster". The profile names ffn's
    rollout kernels."""
    monkeypatch.setenv("RLK_REF_FAULT", DRILL)
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix={REPO / 'matrix.toml'}",
                                f"--rlk-matrix-root={root}", "--rlk-processes=auto",
                                "--rlk-perf-budget=4", "--rlk-profile", "-p",
                                "no:cacheprovider", "-k", "ffn")
    assert result.ret == 0, result.stdout.str()
    out = result.stdout.str()
    assert f"rlk: FAULT DRILL RLK_REF_FAULT={DRILL}" in out
    if "did not hold stage 1" in out or "auto: stopped after stage 1" in out:
        # the budget is a promise (issue 52): a busy box stops early and says why
        assert "performance: auto stopped early:" in out, out
        pytest.xfail("this box stopped the session early: " + next(
            line for line in out.splitlines() if "auto stopped early" in line))
    assert "rlk: auto stage 1: process 3 of 3 per cell" in out
    assert "ffn, rollout side: R " in out  # the profile: ffn's rollout kernels
    report = json.loads((root / "matrix-report.json").read_text())
    assert report["drill"]["env"] == DRILL
    entry = next(m for m in report["performance"]["modules"] if m["module"] == "ffn")
    assert entry["line"].startswith("[FAULT DRILL: ")
    said = {(s["side"], s["phase"]): s for s in entry["statements"]}
    rollout = said[("rollout", "rollout_wall_time")]
    assert rollout["kind"] != "faster", rollout
    if rollout["kind"] == "slower":
        assert rollout["low"] > 1.0
        cells = entry["cells"]
        really = math.sqrt(cells["R/R"]["rollout_wall_time"]["median"]
                           * cells["P/R"]["rollout_wall_time"]["median"]
                           / cells["R/P"]["rollout_wall_time"]["median"]
                           / cells["P/P"]["rollout_wall_time"]["median"])
        assert rollout["low"] <= really <= rollout["high"], (really, rollout)
    elif rollout["kind"] == "inconclusive":
        assert rollout["resolve"] or rollout["why"], rollout
        pytest.xfail(f"this box did not resolve the drill within the budget: {rollout['text']}")
    elif rollout["kind"] == "not judged":
        pytest.xfail(f"this box's timings were refused: {rollout['text']}")
    else:  # "no difference within ±5%": true when the drill moves the phase by less than 5%
        assert rollout["high"] <= 1.05, rollout


def test_table_and_html_show_the_unattributed_share() -> None:
    from pytest_rlkernel_matrix.cli import markdown_table
    from pytest_rlkernel_matrix.report.html_parts import phases_view
    from pytest_rlkernel_matrix.report.matrix_report import table

    rec = {"hardware": "cpu", "module": "ffn", "case": "R/R", "verdict": "valid",
           "rollout_wall_time": 3.0, "training_wall_time": 2.0, "weight_sync_wall_time": 1.0,
           "unattributed_wall_time": 4.0, "unattributed_share": 0.4, "step_wall_time": 10.0,
           "phase_spread": {"unattributed_wall_time": {"n": 5, "min": 3.5, "max": 4.5}}}
    lines = markdown_table({"cells": [rec]})
    assert "unattributed s (share)" in lines[0] and "| 4 (40%) |" in lines[2]
    assert "4 (40%)" in "\n".join(table([rec]))
    view = phases_view(rec)
    assert view is not None
    (row,) = [r for r in view["rows"] if r["label"] == "unattributed"]
    assert "40% of the step, in no phase" in row["bar"]["title"]
    assert row["bar"]["text"].endswith("(40%)")


def test_a_framework_jobs_own_traces_are_read(pytester: pytest.Pytester, make_matrix,
                                              tmp_path: Path) -> None:
    """A vime-style job writes its engines' torch.profiler traces under $RL_KERNEL_PROFILE_DIR
    (no rlk ranges): bucketed by kernel name, the side from the file name."""
    make_matrix(modules='["attention"]')
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "--rlk-profile", "-p",
                                "no:cacheprovider", "-k", "attention and (R/R or R/P)")
    assert result.ret == 0, result.stdout.str()
    report = json.loads((root / "matrix-report.json").read_text())
    cells = {c["case"]: c for c in report["cells"]}
    rr = cells["R/R"]["profile"]
    assert rr["unit"] == "GPU kernel time" and not rr["problems"]
    roll = rr["buckets"]["rollout"]["unknown"]
    assert roll["attention"]["calls_per_step"] == 5 and roll["comm"]["calls_per_step"] == 2
    assert roll["other"]["top"][0]["name"] == "sm90_xmma_gemm_bf16"
    out = result.stdout.str()
    assert ("attention profile, every phase (no phase ranges), R/R vs R/P (GPU kernel time"
            in out)
    assert "attention, rollout side: R +0.50 ms/step over P (1.50 vs 1.00 ms/step; " \
           "flash_fwd_kernel +0.50)" in out


def test_profile_section_and_a_refused_profile_run(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

    base = (REPO / "matrix.toml").read_text(encoding="utf-8")

    def matrix_toml(extra: str) -> str:  # tests/conftest.py's name is ambiguous under xdist
        return base + "\n" + extra
    good = tmp_path / "good.toml"
    good.write_text(matrix_toml(extra='[profile]\nwhen = "always"\nsteps = 3\n'))
    m = load_matrix(good)
    assert (m.profile.when, m.profile.skip, m.profile.steps) == ("always", 1, 3)
    bad = tmp_path / "bad.toml"
    bad.write_text(matrix_toml(extra='[profile]\nwhen = "drift"\n'))
    with pytest.raises(MatrixFileError, match=r"(?s)bad\.toml.*profile\.when"):
        load_matrix(bad)
    # a cell whose run did not complete: no profile run, a note the record carries
    run = tmp_path / "run"
    run.mkdir()
    assert pf.profile_plan({"exit_code": 3}) == "the cell's run exited 3"
    assert pf.follow_profile(m, run, None, {"exit_code": 3, "verdict": "error"})
    assert not list(run.glob("profile*/"))
    record: dict = {}
    pf.attach_profile(record, run)
    assert record["profile"]["problems"] == ["no profile run: the cell's run exited 3"]
    assert record["profile"]["profile_run"] is None
    assert pf.terminal_lines([record]) == [
        "profile: no profile run: the cell's run exited 3",
        f"profile figures are {pf.PROFILE_NOTE}"]


def test_profile_lines_name_kernels_short() -> None:
    """A CUDA kernel's C++ name (thousands of characters of template arguments, seen on the
    H200) is shortened in the lines; the record keeps it whole."""
    from pytest_rlkernel_matrix.judge.localise.profile import short_kernel

    long = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl<"
            "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>"
            "(at::TensorIteratorBase&)::{lambda(int)#1}>(int, at::native::x<y>)")
    assert short_kernel(long) == "at::native::elementwise_kernel<...>(int, at::native::x<...>)"
    assert short_kernel("aten::mm") == "aten::mm" and short_kernel("a->b") == "a->b"
    assert len(short_kernel("k" * 200)) == 60


def test_profile_cells_choose_runs_and_compare_cells_differing_in_one_side(
        tmp_path: Path) -> None:
    """`[profile] cells`: only the chosen cells get a profile run; a side is compared only
    between two profiled cells that differ on that side alone."""
    from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

    base = (REPO / "matrix.toml").read_text(encoding="utf-8")
    good = tmp_path / "good.toml"
    good.write_text(base + '\n[profile]\nwhen = "always"\ncells = ["ffn[R/R]", "ffn[P/P]"]\n')
    m = load_matrix(good)
    assert m.profile.chooses(("ffn[R/R]",)) and not m.profile.chooses(("ffn[P/R]",))
    run = tmp_path / "run"
    run.mkdir()
    assert not pf.follow_profile(m, run, None, {"exit_code": 0}, names=("ffn[R/P]",))
    assert not list(run.iterdir())  # not chosen: no run, no note
    assert m.profile.chooses(("ffn[P/P]",))
    bad = tmp_path / "bad.toml"
    bad.write_text(base + '\n[profile]\ncells = ["ffn[X/Y]"]\n')
    with pytest.raises(MatrixFileError, match=r"profile\.cells: 'ffn\[X/Y\]' is no cell"):
        load_matrix(bad)

    def prof(side_ms: dict[str, float]) -> dict:
        return {"unit": "GPU kernel time", "buckets": {side: {side: {"ffn": {
            "ms_per_step": ms, "calls_per_step": 1.0, "top": [{"name": "k", "ms_per_step": ms}],
            "kernels": {"k": ms}}}} for side, ms in side_ms.items()}}
    recs = [{"hardware": "h", "module": "ffn", "case": "R/R", "rollout_wall_time": 1.2,
             "profile": prof({"training": 2.0, "rollout": 3.0})},
            {"hardware": "h", "module": "ffn", "case": "P/P",
             "profile": prof({"training": 1.5, "rollout": 3.5})}]
    # R/R and P/P differ on both sides: no side's difference is read from them (issue 43)
    lines = pf.statements(recs)
    assert lines == [
        "h ffn profile, training side: no pair of profiled cells differs only on the training "
        "side (profiled: P/P, R/R; profile R/R and P/R or R/P and P/P)",
        "h ffn profile, rollout side: no pair of profiled cells differs only on the rollout "
        "side (profiled: P/P, R/R; profile R/R and R/P or P/R and P/P)"]
    # R/P profiled too: the rollout side from R/R vs R/P, the training side from R/P vs P/P,
    # each beside the measured phase difference of the same two cells
    recs.append({"hardware": "h", "module": "ffn", "case": "R/P", "rollout_wall_time": 1.0,
                 "profile": prof({"training": 2.5, "rollout": 2.0})})
    lines = pf.statements(recs)
    assert [x.split(" (")[0] for x in lines] == ["h ffn profile, training phase, R/P vs P/P",
                                                 "h ffn profile, rollout phase, R/R vs R/P"]
    assert "ffn, training side: R +1.00 ms/step over P" in lines[0]
    assert "ffn, rollout side: R +1.00 ms/step over P" in lines[1]
    assert lines[1].endswith("; measured rollout phase R/R / R/P 1.20x (the cells' medians; the "
                             "performance statements judge it)")
    assert "measured training phase: not timed in both cells" in lines[0]
