"""Per-operator probes (issue 21): the reference workload writes them, judge/localise/probe.py
localises.

Real subprocess runs of the reference workload (one short step), real probe files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_rlkernel_matrix.judge.localise.probe import (
    localise,
    probe_positions,
    read_probes,
    summary_line,
)
from pytest_rlkernel_matrix.report.html_parts import localisation_view

FAST = ["--steps", "1", "--num-prompts", "3", "--max-new-tokens", "6", "--max-prompt-len", "12"]


def _run(tmp: Path, cases: dict[str, str], extra: dict[str, str] | None = None,
         args: list[str] | None = None) -> Path:
    art = tmp / "run"
    art.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL", "RLK_REF"))}
    env.update({"RL_KERNEL_ARTIFACT_DIR": str(art), "RL_KERNEL_PROBE": "1",
                "RL_KERNEL_PROBE_POSITIONS": "0:0,0:2,1:1,2:3", "OMP_NUM_THREADS": "1"})
    env.update({f"RL_KERNEL_{m.upper()}_CASE": c for m, c in cases.items()})
    env.update(extra or {})
    proc = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.workload", *FAST,
                           *(args or [])], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return art


RR = {"attention": "R/R", "ffn": "R/R", "logp": "R/R"}


def test_rr_probe_every_operator_bitwise_and_vocab_kl_zero(tmp_path: Path) -> None:
    art = _run(tmp_path, RR)
    loc = localise(art / "probes", root=art)
    assert loc["status"] == "no_divergence", loc["reasons"]
    assert loc["reasons"] == []
    compared = [e for e in loc["operators"] if e["status"] == "compared"]
    assert len(compared) == 1 + 2 * 13 + 2  # tiny preset: 2 layers
    assert all(e["bitwise"] and e["max_abs"] == 0.0 for e in compared)
    assert loc["vocab"]["kl_rollout_train_mean"] == 0.0
    assert loc["vocab"]["kl_train_rollout_mean"] == 0.0
    assert loc["vocab"]["top1_agreement"] == 1.0
    assert loc["first_divergent"] is None
    assert summary_line(loc).startswith("no divergence")
    # the probed tokens' logprobs are the sampled ones the run reported
    for t in loc["tokens"]:
        assert t["probe_train_logprob"] == t["probe_rollout_logprob"]


def test_perturbation_drill_names_exactly_that_operator(tmp_path: Path) -> None:
    op = "model.layers.1.mlp.down_proj"
    art = _run(tmp_path, RR, {"RLK_REF_PERTURB": f"rollout:{op}"})
    loc = localise(art / "probes", root=art)
    first = loc["first_divergent"]
    assert first["operator"] == op and first["sides"] == ["rollout"] and first["layer"] == 1
    names = [e["name"] for e in loc["operators"]]
    before = loc["operators"][:names.index(op)]
    assert before and all(e["status"] == "compared" and e["bitwise"] for e in before)
    assert loc["status"] == "localised"
    assert f"first divergent {op} (rollout" in loc["summary"]
    assert loc["vocab"]["kl_rollout_train_mean"] > 0


def test_attention_pr_first_divergent_in_layer0_attention_training(tmp_path: Path) -> None:
    art = _run(tmp_path, {"attention": "P/R", "ffn": "R/R", "logp": "R/R"})
    loc = localise(art / "probes", root=art)
    first = loc["first_divergent"]
    assert first["layer"] == 0 and first["module"] == "attention"
    assert first["sides"] == ["training"] and "training P" in first["label"]
    assert loc["operators"][0]["name"] == "model.embed_tokens" and loc["operators"][0]["bitwise"]
    assert loc["per_layer"] and loc["growth"]["from_layer"] == 0
    view = localisation_view(loc)
    assert view is not None and view["chart"] is not None
    assert any(p["mark"] for p in view["chart"]["points"])
    from test_html import PREFLIGHT, sample_report

    from pytest_rlkernel_matrix.report.html import render_html

    report = sample_report()
    report["cells"][1]["localisation"] = loc
    page = render_html(report, PREFLIGHT)
    assert 'class="first-divergent"' in page and "per-layer max relative error" in page
    assert f"first divergent {first['operator']} (training P)" in page
    assert "full-vocabulary figures" in page


@pytest.mark.skipif(os.environ.get("RLK_SLOW") != "1" and (os.cpu_count() or 1) < 4,
                    reason="tp 2 on this machine is slow; RLK_SLOW=1 runs it")
def test_tp2_same_localisation_as_tp1(tmp_path: Path) -> None:
    op = "model.layers.0.self_attn.o_proj"
    one = _run(tmp_path / "tp1", RR, {"RLK_REF_PERTURB": f"training:{op}"})
    two = _run(tmp_path / "tp2", RR, {"RLK_REF_PERTURB": f"training:{op}"}, ["--tp", "2"])
    a, b = localise(one / "probes", root=one), localise(two / "probes", root=two)
    assert a["first_divergent"]["operator"] == b["first_divergent"]["operator"] == op
    assert a["first_divergent"]["sides"] == b["first_divergent"]["sides"] == ["training"]
    assert [e["name"] for e in a["operators"]] == [e["name"] for e in b["operators"]]


@pytest.mark.skipif(os.environ.get("RLK_SLOW") != "1" and (os.cpu_count() or 1) < 4,
                    reason="cp 2 on this machine is slow; RLK_SLOW=1 runs it")
def test_cp2_same_localisation_as_cp1(tmp_path: Path) -> None:
    """Context parallel: each CP rank probes the positions it holds (training) and every rank
    the whole rollout (replicas); together the same operators, tokens and first divergence."""
    import json

    op = "model.layers.0.self_attn.attn"  # the operator that reads every CP rank's keys
    one = _run(tmp_path / "cp1", RR, {"RLK_REF_PERTURB": f"training:{op}"})
    two = _run(tmp_path / "cp2", RR, {"RLK_REF_PERTURB": f"training:{op}"}, ["--cp", "2"])
    index = json.loads((two / "probes" / "index.json").read_text())
    assert index["context_parallel_size"] == 2
    assert sorted(index["files"]) == sorted(p.name for p in (two / "probes").glob("*.pt"))
    assert len(index["files"]) == 4  # two sides x two ranks
    a, b = localise(one / "probes", root=one), localise(two / "probes", root=two)
    assert b["reasons"] == [], b["reasons"]  # the CP ranks' rollout replicas agree
    assert a["first_divergent"]["operator"] == b["first_divergent"]["operator"] == op
    assert a["first_divergent"]["sides"] == b["first_divergent"]["sides"] == ["training"]
    assert [e["name"] for e in a["operators"]] == [e["name"] for e in b["operators"]]
    assert ([(t["sample"], t["position"]) for t in a["tokens"]]
            == [(t["sample"], t["position"]) for t in b["tokens"]])
    names = [e["name"] for e in b["operators"]]
    assert all(e["bitwise"] for e in b["operators"][:names.index(op)])


# -- readers: hardened ---------------------------------------------------------------------------


def _probe_file(path: Path, side: str, **over: object) -> None:
    data: dict[str, object] = {
        "schema_version": "rlk.operator_probe.v1", "side": side, "rank": 0,
        "operators": ["model.embed_tokens", "model.norm"],
        "tokens": [{"sample": 0, "token": 0, "position": 3, "token_id": 1}],
        "outputs": {"model.embed_tokens": torch.ones(1, 4), "model.norm": torch.ones(1, 4)},
        "log_softmax": torch.log_softmax(torch.zeros(1, 8), -1), "cases": {}}
    data.update(over)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)


class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pickle code ran",))


def test_reader_refuses_pickles_and_names_malformed_files(tmp_path: Path) -> None:
    d = tmp_path / "probes"
    _probe_file(d / "training.rank00000.pt", "training")
    torch.save({"x": Evil()}, d / "rollout.rank00000.pt")
    (d / "rollout.rank00001.pt").write_bytes(b"not a pickle")
    _probe_file(d / "training.rank00001.pt", "training",
                outputs={"model.norm": torch.ones(2, 4)})  # rows != tokens
    _probe_file(d / "training.rank00002.pt", "rollout")  # side differs from the name
    _probe_file(d / "weird.pt", "training")
    sides, problems = read_probes(d, tmp_path)
    text = "\n".join(problems)
    assert "rollout.rank00000.pt: unreadable" in text  # weights_only refused the class
    assert "rollout.rank00001.pt: unreadable" in text
    assert "training.rank00001.pt: malformed" in text and "training.rank00002.pt" in text
    assert "weird.pt" in text and "index.json is absent" in text
    assert set(sides) == {"training"}
    loc = localise(d, tmp_path)
    assert loc["status"] == "incomparable" and "rollout side" in loc["summary"]


def test_missing_operator_and_shape_difference_are_reasons(tmp_path: Path) -> None:
    d = tmp_path / "probes"
    _probe_file(d / "training.rank00000.pt", "training")
    _probe_file(d / "rollout.rank00000.pt", "rollout",
                outputs={"model.embed_tokens": torch.ones(1, 5)})
    loc = localise(d, tmp_path)
    by = {e["name"]: e for e in loc["operators"]}
    assert "shapes differ" in by["model.embed_tokens"]["reason"]
    assert by["model.norm"]["reason"] == "missing on the rollout side"
    assert loc["status"] == "incomparable"
    assert any("model.norm: missing" in r for r in loc["reasons"])


def test_symlinked_probe_leaving_the_cell_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.pt"
    _probe_file(outside, "rollout")
    cell = tmp_path / "cell"
    _probe_file(cell / "probes" / "training.rank00000.pt", "training")
    (cell / "probes" / "rollout.rank00000.pt").symlink_to(outside)
    _, problems = read_probes(cell / "probes", cell)
    assert any("symlink leaves the cell directory" in p for p in problems)


def test_probe_positions_first_mismatches_then_controls(tmp_path: Path) -> None:
    art = _run(tmp_path, {"attention": "P/R", "ffn": "R/R", "logp": "R/R"})
    chosen, about, problems = probe_positions(art, budget=4, controls=1)
    assert not problems
    assert len(chosen) == 4
    assert [a["kind"] for a in about].count("mismatch") >= 1
    assert all(a["sidecar_train_logprob"] != a["sidecar_rollout_logprob"]
               for a in about if a["kind"] == "mismatch")


def test_record_picks_the_latest_probe_localisation(tmp_path: Path) -> None:
    import json

    from pytest_rlkernel_matrix.report.record import _attach_localisation

    for name, op in (("probe", "a"), ("probe.2", "b"), ("probe.x", "c")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "localisation.json").write_text(json.dumps(
            {"summary": f"first divergent {op}", "first_divergent": {"operator": op}}))
    record: dict[str, object] = {}
    _attach_localisation(record, tmp_path)
    assert record["localisation"]["summary"] == "first divergent b"  # type: ignore[index]
    (tmp_path / "probe.2" / "localisation.json").write_text("[1, 2]")
    _attach_localisation(record, tmp_path)
    loc = record["localisation"]
    assert loc["status"] == "incomparable" and "unreadable" in loc["reasons"][0]  # type: ignore[index]


def test_matrix_probe_section(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

    base = ('[runner]\ncommand = "true"\n[hardware.cpu]\nbackend = "cpu"\n')
    (tmp_path / "m.toml").write_text(base + '[probe]\nwhen = "drift"\ntokens = 4\n')
    m = load_matrix(tmp_path / "m.toml")
    assert (m.probe.when, m.probe.tokens, m.probe.controls) == ("drift", 4, 2)
    assert load_matrix(_write(tmp_path / "d.toml", base)).probe.when == "never"
    with pytest.raises(MatrixFileError, match="probe"):
        load_matrix(_write(tmp_path / "bad.toml", base + '[probe]\nwhen = "always"\n'))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -- which cells a session probes: only completed runs that drifted ------------------------------


def _session_cell(root: Path, slug: str) -> dict:
    import json

    report = json.loads((root / "matrix-report.json").read_text())
    module, case = slug.split("-")
    return next(c for c in report["cells"] if c["module"] == module
                and c["case"].replace("/", "").lower() == case)


def test_timed_out_cell_gets_a_probe_note_not_a_probe_run(pytester: pytest.Pytester,
                                                         make_matrix, tmp_path: Path) -> None:
    # The fake writes drifting P/R sidecars, then stays alive past the timeout.
    make_matrix(env={"FAKE_BUSY_SECONDS": "600"}, timeout=3, modules='["attention"]')
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "--rlk-probe",
                                "-k", "attention and P/R")
    cell = _session_cell(root, "attention-pr")
    assert cell["verdict"] == "error" and cell["timed_out"] is True
    run_dir = root / "cpu" / "attention-pr"
    assert not list(run_dir.glob("probe*/")), "a probe run followed a timed-out cell"
    loc = cell["localisation"]
    assert loc["status"] == "not_run" and loc["first_divergent"] is None
    assert loc["summary"] == "no probe run: the cell's run timed out (its sidecars may be partial)"
    assert (run_dir / "probe-note.json").is_file()
    result.stdout.fnmatch_lines(["attention P/R: no probe run: the cell's run timed out*"])
    view = localisation_view(loc)
    assert view is not None and view["status"] == "not_run" and view["chart"] is None


def test_errored_cell_gets_a_note_and_a_completed_drifting_one_a_probe_run(
        pytester: pytest.Pytester, make_matrix, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    fake = Path(__file__).with_name("fake_framework.py")
    toml = make_matrix(modules='["attention"]')
    fails = toml.read_text().replace(f'command = ["{sys.executable}", "{fake}"]',
                                     f'command = ["sh", "-c", "{sys.executable} {fake}; exit 3"]')
    assert "exit 3" in fails
    toml.write_text(fails)
    bad = tmp_path / "bad"
    pytester.runpytest(f"--rlk-matrix-root={bad}", "--rlk-probe", "-k", "attention and P/R")
    cell = _session_cell(bad, "attention-pr")
    assert cell["verdict"] == "error" and cell["exit_code"] == 3
    assert cell["mismatch_count"] > 0  # it drifted, but its run did not complete
    assert not list((bad / "cpu" / "attention-pr").glob("probe*/"))
    assert cell["localisation"]["summary"] == "no probe run: the cell's run exited 3"
    from pytest_rlkernel_matrix.cli import main

    assert main(["probe", str(bad), "cpu/attention-pr"]) == 2  # afterwards: refused as well
    assert "no probe run of" in capsys.readouterr().err
    assert not list((bad / "cpu" / "attention-pr").glob("probe*/"))

    make_matrix(modules='["attention"]')
    good = tmp_path / "good"
    pytester.runpytest(f"--rlk-matrix-root={good}", "--rlk-probe",
                       "-k", "attention and (P/R or R/R)")
    drifted, clean = _session_cell(good, "attention-pr"), _session_cell(good, "attention-rr")
    assert drifted["mismatch_count"] > 0 and drifted["verdict"] not in ("error", "fallback")
    assert (good / "cpu" / "attention-pr" / "probe" / "cell-run.json").is_file()
    # the fake framework writes no probe files: the probe is incomparable, and says why
    assert drifted["localisation"]["status"] == "incomparable"
    assert "no probe of the training and rollout side" in drifted["localisation"]["summary"]
    assert clean["mismatch_count"] == 0 and "localisation" not in clean
    assert not list((good / "cpu" / "attention-rr").glob("probe*"))


def test_probe_plan() -> None:
    from pytest_rlkernel_matrix.judge.localise.probe import probe_plan

    done = {"exit_code": 0, "timed_out": False, "verdict": "valid", "mismatch_count": 3}
    assert probe_plan(done) == "probe"
    assert probe_plan({**done, "mismatch_count": 0, "bitwise_mismatch_count": 0}) is None
    assert probe_plan({**done, "verdict": "contract_mismatch"}) == "probe"
    assert "exited 1" in str(probe_plan({**done, "exit_code": 1}))
    assert "did not start" in str(probe_plan({**done, "exit_code": None}))
    assert "timed out" in str(probe_plan({**done, "timed_out": True, "exit_code": None}))
    fb = probe_plan({**done, "verdict": "fallback", "reasons": ["attention fell back to P"]})
    assert fb == "the cell is fallback (attention fell back to P)"
    assert "local launcher" in str(probe_plan(done, "slurm"))
    assert probe_plan({**done, "mismatch_count": 0}, "slurm") is None


# -- the GPU path (the lead runs these on the H200: `pytest -m gpu tests/test_probe.py`) ----------

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA/ROCm device")


def _gpu_run(tmp: Path, cases: dict[str, str], extra: dict[str, str] | None = None) -> Path:
    import json

    art = _run(tmp, cases, extra, ["--device", "cuda"])
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["decode_graphs"] is False  # a probed rollout decodes eagerly
    if any(c != "P/P" for c in cases.values()):
        assert manifest["r_backend"] == "triton", manifest["r_backend"]  # the Triton R kernels
    return art


@pytest.mark.gpu
@needs_cuda
def test_gpu_rr_probe_every_operator_bitwise(tmp_path: Path) -> None:
    art = _gpu_run(tmp_path, RR)
    loc = localise(art / "probes", root=art)
    assert loc["status"] == "no_divergence", loc["reasons"]
    assert loc["reasons"] == []
    compared = [e for e in loc["operators"] if e["status"] == "compared"]
    assert len(compared) == 1 + 2 * 13 + 2  # every operator of the format, tiny preset
    assert all(e["bitwise"] for e in compared)
    assert loc["vocab"]["kl_rollout_train_mean"] == 0.0 and loc["vocab"]["top1_agreement"] == 1.0


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("op", ["model.layers.1.mlp.down_proj",
                                "model.layers.0.self_attn.k_norm", "lm_head"])
def test_gpu_perturbation_drill_names_exactly_that_operator(tmp_path: Path, op: str) -> None:
    art = _gpu_run(tmp_path, RR, {"RLK_REF_PERTURB": f"rollout:{op}"})
    loc = localise(art / "probes", root=art)
    first = loc["first_divergent"]
    assert first["operator"] == op and first["sides"] == ["rollout"], loc["summary"]
    names = [e["name"] for e in loc["operators"]]
    assert all(e["status"] == "compared" and e["bitwise"]
               for e in loc["operators"][:names.index(op)])


@pytest.mark.gpu
@needs_cuda
def test_gpu_attention_pr_first_divergent_in_layer0_attention_training(tmp_path: Path) -> None:
    art = _gpu_run(tmp_path, {"attention": "P/R", "ffn": "R/R", "logp": "R/R"})
    loc = localise(art / "probes", root=art)
    first = loc["first_divergent"]
    assert first["layer"] == 0 and first["module"] == "attention" and first["sides"] == ["training"]
