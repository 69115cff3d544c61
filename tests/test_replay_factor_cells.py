"""vime's batch-invariance replay cases judged per module and side (issue 45): a factor's cases may
name one module's case (`attention[R/P]`: that module at R/P, the others at the fixed R/R), and
each such cell is compared with that module cell, in the existing factors' words. The matrix run
is the reference workload on the CPU (tiny preset, 4 prompts x up to 12 tokens, one variant)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from pytest_rlkernel_matrix.spec.cells import expand, expand_factors
from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

pytestmark = pytest.mark.usefixtures("reuse_probe")

BASE = f'''[matrix]
name = "replay-factor-test"
layout = "reduced"
mode = "audit"

[runner]
command = ["{sys.executable}", "-m", "pytest_rlkernel_matrix.workload", "--dtype", "float32",
           "--num-prompts", "4", "--max-new-tokens", "12"]
timeout = 300

[hardware.cpu]
backend = "cpu"
env = {{ RLK_REF_PRESET = "tiny", OMP_NUM_THREADS = "1" }}
'''

SIDES = ["attention[P/R]", "attention[R/P]", "ffn[P/R]", "ffn[R/P]", "logp[P/R]", "logp[R/P]"]
REPLAY = f'''
[factors.batch_invariance]
baseline = "none"
cases = {json.dumps(["R/R", *SIDES])}
variants = {{ alone = {{ env = {{ RLK_REF_BATCH_INVARIANCE = "same_sample_alone" }} }} }}
'''


def _load(tmp_path: Path, text: str) -> object:
    path = tmp_path / "matrix.toml"
    path.write_text(BASE + text)
    return load_matrix(path)


def test_module_cases_expand_to_module_scoped_cells(tmp_path: Path) -> None:
    m = _load(tmp_path, REPLAY.replace('"attention[P/R]"', '" Attention[p/r] "'))
    layout = expand(m.matrix, ["cpu"])
    cells = expand_factors(m.factors, m.matrix, ["cpu"])
    assert [c.slug for c in cells] == ["factor-batch_invariance-alone-rr", *(
        "factor-batch_invariance-alone-" + s.replace("[", "-").replace("/", "").rstrip("]").lower()
        for s in SIDES)]
    rp = cells[2]
    assert (rp.scope, rp.case, rp.cases.as_dict()) == (
        "attention", "R/P", {"attention": "R/P", "ffn": "R/R", "logp": "R/R"})
    # its baseline is the module cell a pairwise layout names (the reduced layout lacks it)
    base = rp.baseline_cell(layout)
    assert (base.name, base.slug, base.cases) == ("attention[R/P]", "attention-rp", rp.cases)
    assert cells[0].scope == "" and cells[0].baseline_cell(layout).name == "attention[R/R]"


@pytest.mark.parametrize(("cases", "needle"), [
    ('["comm[R/P]"]', "'comm' is not in matrix.modules"),
    ('["router[R/P]"]', "'router' is not a module"),
    ('["ffn[R/R]"]', "the other modules are at R/R already (matrix.fixed_case): write 'R/R'"),
    ('["ffn[R/X]"]', "is not a case"),
])
def test_bad_module_cases_name_file_and_key(tmp_path: Path, cases: str, needle: str) -> None:
    text = REPLAY.replace(f"cases = {json.dumps(['R/R', *SIDES])}", f"cases = {cases}")
    with pytest.raises(MatrixFileError, match=re.escape(needle)) as err:
        _load(tmp_path, text)
    assert "matrix.toml" in str(err.value) and "factors" in str(err.value)


def test_replay_case_per_module_and_side_on_cpu(pytester: pytest.Pytester,
                                                tmp_path: Path) -> None:
    path = pytester.makefile(".toml", matrix=BASE + REPLAY)
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix={path}", f"--rlk-matrix-root={root}",
                                "-p", "no:cacheprovider", "-m", "rlk_factor")
    report = json.loads((root / "matrix-report.json").read_text())
    assert result.ret == 0, result.stdout.str()[-3000:]
    assert report["expected_cells"] == 14  # 7 factor cells + R/R + the 6 module cells
    cells = {c["artifact_dir"].split("/")[-1]: c for c in report["cells"]}
    assert {f"{m}-{c}" for m in ("attention", "ffn", "logp") for c in ("pr", "rp")} <= set(cells)
    [entry] = report["factor_attribution"]
    assert entry["cases"] == ["R/R", *(s.replace("[", " ").rstrip("]") for s in SIDES)]
    words = entry["conclusion"]

    def comparison(slug: str) -> dict:
        cell = cells[f"factor-batch_invariance-alone-{slug}"]
        assert cell["verdict"] == "valid", cell.get("reasons")
        return cell["factor"]["comparison"]

    # R/R, and the training side of each module (its rollout stays R): bitwise invariant
    for slug, label in (("rr", "R/R"), ("attention-pr", "attention P/R"),
                        ("ffn-pr", "ffn P/R"), ("logp-pr", "logp P/R")):
        c = comparison(slug)
        n = c["compared_logprobs"]
        assert n > 0 and c["rollout_logprobs_differ"] == 0 and c["unpaired_samples"] == 0
        assert (f"{label} is invariant to batch_invariance (alone vs none: 0 of {n} logprobs "
                "differ)") in words
    # the rollout side of each module on P: whatever this CPU's BLAS does, said in the same words
    for module in ("attention", "ffn", "logp"):
        c = comparison(f"{module}-rp")
        k, n = c["rollout_logprobs_differ"], c["compared_logprobs"]
        said = (f"{module} R/P is not ({k} of {n}" if k or not c["tokens_equal"] else
                f"{module} R/P is invariant to batch_invariance (alone vs none: 0 of {n}")
        assert said in words, words
    assert words.startswith("batch_invariance alone: R/R is invariant to batch_invariance")
    out = result.stdout.str()  # the terminal: the same line, and module-scoped factor rows
    assert f"cpu {words}" in out
    assert re.search(r"^cpu +factor batch_invariance=alone attention +R/P +rl_kernel +"
                     r"attention=production;ffn=rl_kernel;logp=rl_kernel ", out, re.M), out[-3000:]
    html = (root / "matrix-report.html").read_text()
    assert "factor batch_invariance=alone ffn" in html
    assert "ffn R/P" in html and "logp P/R is invariant to batch_invariance" in html
    # `rlk-matrix report <root>` re-reads both runs of each cell: the same lines and baselines
    from pytest_rlkernel_matrix import cli

    again = tmp_path / "again.json"
    assert cli.main(["report", str(root), "--output", str(again), "--jobs", "1"]) == 0
    after = json.loads(again.read_text())
    assert after["factor_attribution"] == report["factor_attribution"]
    assert {c["factor"]["baseline_cell"] for c in after["cells"] if c.get("factor")} == {
        "cpu/attention-rr", *(f"cpu/{m}-{s}" for m in ("attention", "ffn", "logp")
                              for s in ("pr", "rp"))}


def test_module_scoped_factor_cells_are_known_by_name(tmp_path: Path) -> None:
    name = "factor-batch_invariance-alone-logp-rp"
    m = _load(tmp_path, REPLAY + f'\n[profile]\ncells = ["{name}"]\n')
    assert name in {c.name for c in expand_factors(m.factors, m.matrix, ["cpu"])}
    with pytest.raises(MatrixFileError, match="is no cell of this matrix"):
        _load(tmp_path, REPLAY + '\n[profile]\ncells = ["factor-batch_invariance-alone-rp"]\n')
