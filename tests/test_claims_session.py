"""The three reproducibility claims through a whole matrix session (issue 22): the baseline (and
chosen cells) run twice in separate processes, run-to-run judged, shown in the terminal and the
HTML; the nondeterministic drill fails the run-to-run claim only, by name, in strict mode."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

REPO = Path(__file__).resolve().parents[1]
CLAIMS = '["train_rollout_bitwise", "run_to_run_bitwise", "weights_bitwise"]'
pytestmark = pytest.mark.usefixtures("reuse_probe")


def _matrix(pytester: pytest.Pytester, repro: str = "", declare: bool = True) -> Path:
    """The repo's matrix.toml, one measured step per cell, a small 3-step run per cell, the
    three claims declared for the baseline (``declare``; else the repo's own declaration),
    plus ``repro`` ([reproducibility] lines)."""
    text = (REPO / "matrix.toml").read_text()
    text = re.sub(r"(?m)^repeats = \d+", "repeats = 1", text)
    text = re.sub(r"(?m)^warmup = \d+", "warmup = 0", text)
    cmd = '--preset "$RLK_REF_PRESET"\''
    assert text.count(cmd) == 1 and text.count("\n[runner]") == 1, "matrix.toml moved"
    text = text.replace(cmd, '--preset "$RLK_REF_PRESET" --num-prompts 4 --max-new-tokens 12 '
                        "--steps 3'")
    text, n = re.subn(r"(?m)^baseline_claims = .*$",
                      f"baseline_claims = {CLAIMS}" if declare else r"\g<0>", text)
    assert n == 1, "matrix.toml declares no baseline_claims"
    text = text.replace("\n[runner]", f"\n{repro}\n[runner]", 1)
    path = pytester.path / "matrix.toml"
    path.write_text(text)
    return path


def _run(pytester: pytest.Pytester, matrix: Path, root: Path,
         *args: str) -> tuple[pytest.RunResult, dict]:
    # in-process: no fresh interpreter needed (the cells are processes of their own)
    result = pytester.runpytest(f"--rlk-matrix={matrix}", f"--rlk-matrix-root={root}",
                                "-p", "no:cacheprovider", *args)
    return result, json.loads((root / "matrix-report.json").read_text())


def _cell(report: dict, module: str, case: str) -> dict:
    (cell,) = [c for c in report["cells"] if c["module"] == module and c["case"] == case]
    return cell


def _status(cell: dict) -> dict[str, str]:
    return {k: v["status"] for k, v in cell["claims"].items()}


def test_runs_twice_and_the_three_claims_hold(pytester: pytest.Pytester,
                                              tmp_path: Path) -> None:
    """[reproducibility] runs = 2 with a chosen cell besides the baseline, strict mode."""
    matrix = _matrix(pytester, '\n[reproducibility]\nruns = 2\ncells = ["baseline", '
                     '"attention[P/R]"]\n')
    root = tmp_path / "root"
    result, report = _run(pytester, matrix, root, "--rlk-mode=strict", "-k",
                          "attention and (RR or PR)")
    assert result.ret == 0, result.stdout.str()[-3000:]
    rr, pr = _cell(report, "attention", "R/R"), _cell(report, "attention", "P/R")
    assert rr["verdict"] == "valid" and rr["reasons"] == []
    assert _status(rr) == dict.fromkeys(rr["claims"], "holds")
    assert rr["claims"]["run_to_run_bitwise"]["detail"] == (
        "3 sidecar(s) and 3 weight version(s) byte-identical across 2 runs")
    assert [s["step"] for s in rr["steps"]["series"]] == [0, 1, 2]
    assert sorted(rr["steps"]["weight_chain"]) == ["0", "1", "2"]
    assert rr["steps"]["trend"]["conclusion"] == "flat"
    # the chosen P/R cell ran twice too: run-to-run is judged (its repeat was asked for); the
    # baseline's claims are not claimed for it (issue 53), so no red "fails": still valid
    assert pr["verdict"] == "valid"
    assert _status(pr) == {"train_rollout_bitwise": "not claimed", "run_to_run_bitwise": "holds",
                           "weights_bitwise": "not claimed"}
    assert pr["validity"]["reproducibility"]["valid"] is True
    for cell in (rr, pr):
        first = root / cell["artifact_dir"]
        assert (first.parent / f"{first.name}.repeat2" / "mismatch-sidecars").is_dir()
    assert len(report["cells"]) == 2  # the second runs are no cells of their own
    out = result.stdout.str()
    assert ("claims cpu attention R/R: train/rollout bitwise holds (3 steps, 0 of "
            in out), out[-3000:]
    assert "; run-to-run bitwise holds (3 sidecar(s) and 3 weight version(s) byte-identical " \
           "across 2 runs); weights bitwise holds (v0..v2, 3 versions); drift over steps: " \
           "flat (every step the same)" in out
    line = next(x for x in out.splitlines() if x.startswith("claims cpu attention P/R:"))
    assert "train/rollout bitwise not claimed (reproducibility claims are the all-R " in line
    assert "FAILS" not in line and "run-to-run bitwise holds" in line
    html = (root / "matrix-report.html").read_text()
    assert html.count('<svg class="steps"') == 2 and "reproducibility claims" in html
    assert "every step bitwise</p>" in html and "first non-bitwise step 0</title>" in html
    # rebuilt without its report (`rlk-matrix report`): the second runs are still no cells
    from pytest_rlkernel_matrix.report.reanalyze import reanalyze

    (root / "matrix-report.json").rename(tmp_path / "old.json")
    again = json.loads(reanalyze(root, jobs=1, use_cache=False, progress=False).read_text())
    assert sorted(c["artifact_dir"] for c in again["cells"]) == sorted(
        c["artifact_dir"] for c in report["cells"])
    assert sum(n.endswith("a run-to-run repeat, not read as a cell")
               for n in again["reanalysis_notes"]) == 2


@pytest.mark.parametrize("side", ["training", "rollout"])
def test_strict_baseline_fails_on_the_nondeterministic_drill(
        pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        side: str) -> None:
    """`pytest --rlk-mode=strict -m rlk_baseline`: the drill breaks run-to-run only, and the
    failure names that claim (report and terminal). Training: the three claims declared;
    rollout: the repo's matrix.toml as it is (run_to_run_bitwise not declared: a judged claim
    that fails fails the strict all-R cell all the same, issue 34)."""
    monkeypatch.setenv("RLK_REF_FAULT", f"nondeterministic:attention:{side}")
    monkeypatch.delenv("RLK_REF_FAULT_NONCE", raising=False)
    if side == "training":  # the matrix asks for two runs
        matrix, args = _matrix(pytester, "\n[reproducibility]\nruns = 2\n"), ()
    else:  # the option asks, the repo's own declaration
        matrix, args = _matrix(pytester, declare=False), ("--rlk-repeat-baseline",)
    label = "declared baseline claim" if side == "training" else "baseline claim (not declared)"
    result, report = _run(pytester, matrix, tmp_path / "root", "--rlk-mode=strict",
                          "-m", "rlk_baseline", *args)
    assert result.ret == 1
    first = 1 if side == "training" else 0  # gradients vary from the first update on
    for module in ("attention", "ffn", "logp"):  # one all-R run, named by every module
        cell = _cell(report, module, "R/R")
        assert cell["verdict"] == "contract_mismatch" and cell["failed"]
        assert _status(cell) == {"train_rollout_bitwise": "holds",
                                 "run_to_run_bitwise": "fails", "weights_bitwise": "holds"}
        assert cell["reasons"][0].startswith(
            f"{label} run_to_run_bitwise: fails (fails at step "
            f"{first}, rank 0, sample "), cell["reasons"]
        assert cell["fault_drill"]
    out = result.stdout.str()
    # the three R/R cells share one run: one header naming them, each reason printed once
    assert "cpu attention R/R, ffn R/R, logp R/R: contract_mismatch (FAILED)" in out
    reason = f"    {label} run_to_run_bitwise: fails (fails at step {first}"
    assert sum(x.startswith(reason) for x in out.splitlines()) == 1, out
    line = next(x for x in out.splitlines() if x.startswith("claims cpu "))
    assert line.startswith("claims cpu attention, ffn, logp R/R: train/rollout bitwise holds")
    assert f"run-to-run bitwise FAILS (at step {first}, rank 0, sample " in line
    assert "weights bitwise holds (v0..v2, 3 versions)" in line


def test_repeat_cells_must_name_cells_of_the_matrix(tmp_path: Path) -> None:
    text = (REPO / "matrix.toml").read_text() + '\n[reproducibility]\nruns = 2\n' \
        'cells = ["baseline", "attenton[P/R]"]\n'
    path = tmp_path / "matrix.toml"
    path.write_text(text)
    with pytest.raises(MatrixFileError) as err:
        load_matrix(path)
    msg = str(err.value)
    assert str(path) in msg and "reproducibility.cells" in msg and "'attenton[P/R]'" in msg
    path.write_text(text.replace("attenton", "attention"))
    chosen = load_matrix(path).reproducibility
    assert chosen.chooses(["attention[P/R]"], baseline=False)
    assert chosen.chooses(["ffn[R/R]"], baseline=True)
    assert not chosen.chooses(["ffn[P/R]"], baseline=False)


def test_claims_are_not_claimed_outside_the_baseline(tmp_path: Path) -> None:
    """Issue 53: P/R, R/P and P/P cells claim no train/rollout or weights bitwise-ness: their
    claims are `not claimed` (never a red 'fails'), the reproducibility judgement is neither
    valid nor invalid, and the HTML shows no 'reproducibility invalid' for them."""
    from cellkit import CellKit

    from pytest_rlkernel_matrix.judge.read.steps import read_reproducibility
    from pytest_rlkernel_matrix.judge.reproducibility.judge import judge_reproducibility
    from pytest_rlkernel_matrix.report.claims import claim_phrase
    from pytest_rlkernel_matrix.report.html_parts import _not_judged

    k = CellKit(tmp_path)
    k.write()
    rep = read_reproducibility(k.dir, None)
    _, base_claims, _ = judge_reproducibility(rep, baseline=True)
    other, claims, steps = judge_reproducibility(rep, baseline=False)
    assert {c["status"] for c in base_claims.values()} != {"not claimed"}
    assert {n: c["status"] for n, c in claims.items()} == dict.fromkeys(
        ("train_rollout_bitwise", "run_to_run_bitwise", "weights_bitwise"), "not claimed")
    assert other.valid is None and [f.severity for f in other.findings] == ["note"]
    assert steps  # the drift-over-steps data is still the cell's
    phrase = claim_phrase("train_rollout_bitwise", claims["train_rollout_bitwise"], {})
    assert phrase == ("train/rollout bitwise not claimed (reproducibility claims are the all-R "
                      "baseline's)")
    record = {"validity": {"reproducibility": {"valid": other.valid, "reasons": other.reasons}}}
    assert _not_judged(record) == [("reproducibility", "not claimed",
                                    "not claimed: reproducibility claims are the all-R "
                                    "baseline's")]
