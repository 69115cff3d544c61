"""Multi-rank cells on CPU: the reference workload at tp=2 / cp=2 over gloo, read by the plugin.

Each cell is one command that starts 2 rank processes. The default set runs 2 small 2-rank cells
per topology; the whole 16-cell tp2 matrix (`examples/tp2.toml`) is marked `slow`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Not about preflight: these sessions take the test run's shared probe (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("reuse_probe")
SMALL = "--num-prompts 5 --max-new-tokens 24 --micro-batch-size 3"


def _matrix(tmp: Path, topology: str, modules: str, extra: str = "") -> Path:
    path = tmp / "matrix.toml"
    path.write_text(f"""
[matrix]
modules = {modules}
mode = "audit"

[runner]
command = '"$PYTHON_BIN" -m pytest_rlkernel_matrix.workload --preset tiny {SMALL} {extra}'
cwd = "{REPO}"
timeout = 900

[hardware.cpu]
backend = "cpu"
topology = {{ {topology} }}
""")
    return path


def _run(pytester: pytest.Pytester, matrix: Path, root: Path, *args: str,
         ) -> tuple[pytest.RunResult, dict]:
    # in-process: no fresh interpreter needed (the cells are processes of their own)
    result = pytester.runpytest(f"--rlk-matrix={matrix}", f"--rlk-matrix-root={root}",
                                "-p", "no:cacheprovider", *args)
    return result, json.loads((root / "matrix-report.json").read_text())


def _cell(report: dict, module: str, case: str) -> dict:
    (cell,) = [c for c in report["cells"] if c["module"] == module and c["case"] == case]
    return cell


def _response_tokens(run_dir: Path) -> tuple[int, int]:
    """(response tokens, samples) of the run, from rank 0's sidecar (what one replica holds)."""
    import torch

    sc = torch.load(run_dir / "mismatch-sidecars" / "rank00000.call00000000.pt",
                    weights_only=True)
    return sum(sc["response_lengths"]), len(sc["response_lengths"])


def test_tp2_rr_bitwise_comm_p_drifts_samples_counted_once(pytester: pytest.Pytester,
                                                            tmp_path: Path) -> None:
    matrix = _matrix(tmp_path, "tp = 2", '["attention", "ffn", "logp", "comm"]')
    result, report = _run(pytester, matrix, tmp_path / "root", "-k", "comm and (R/R or P/R)")
    assert result.ret == 0, result.stdout.str()[-3000:]
    rr, pr = _cell(report, "comm", "R/R"), _cell(report, "comm", "P/R")
    assert rr["verdict"] == "valid" and rr["contract"]["kind"] == "bitwise"
    assert rr["mismatch_count"] == 0 and rr["bitwise_mismatch_count"] == 0
    assert rr["sidecar_count"] == 2 and rr["rank_count"] == 2  # both ranks' sidecars read
    assert rr["routes"]["comm"]["training"]["processes"] == 2  # one readback per rank
    assert rr["routes"]["comm"]["training"]["implementation"] == "rl_kernel"
    tokens, samples = _response_tokens(tmp_path / "root" / "cpu" / "comm-rr")
    assert rr["active_token_count"] == tokens and rr["sample_count"] == samples == 5
    assert pr["mismatch_count"] > 0 and pr["actual_training_implementation"] == "production"
    env = (tmp_path / "root" / "cpu" / "comm-rr" / "matrix-case.env").read_text()
    assert "RL_KERNEL_MATRIX_TP=2" in env and "RL_KERNEL_COMM_CASE=R/R" in env


def test_cp2_zigzag_slices_count_each_token_once(pytester: pytest.Pytester,
                                                 tmp_path: Path) -> None:
    matrix = _matrix(tmp_path, "cp = 2", '["attention", "ffn", "logp"]')
    result, report = _run(pytester, matrix, tmp_path / "root", "-k", "attention and (R/R or P/P)")
    assert result.ret == 0, result.stdout.str()[-3000:]
    rr, pp = _cell(report, "attention", "R/R"), _cell(report, "attention", "P/P")
    assert rr["mismatch_count"] == 0 and rr["verdict"] == "valid"
    assert pp["mismatch_count"] > 0
    tokens, samples = _response_tokens(tmp_path / "root" / "cpu" / "attention-rr")
    assert rr["active_token_count"] == tokens and rr["sample_count"] == samples == 5
    import torch

    sc = torch.load(tmp_path / "root" / "cpu" / "attention-rr" / "mismatch-sidecars"
                    / "rank00001.call00000000.pt", weights_only=True)
    assert sc["context_parallel_size"] == 2
    held = sum(x.numel() for x in sc["train_log_probs"])
    assert 0 < held < tokens  # a zigzag slice, not the whole response


@pytest.mark.slow
def test_tp2cp2_token_count_equals_tp1(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """The same prompts at tp1/cp1 and at tp2 x cp2 (4 ranks): the same active-token count."""
    counts = {}
    for name, topo in (("one", "tp = 1"), ("grid", "tp = 2, cp = 2")):
        sub = tmp_path / name
        sub.mkdir()
        matrix = _matrix(sub, topo, '["attention", "ffn", "logp"]', "--ignore-eos")
        result, report = _run(pytester, matrix, sub / "root", "-k", "attention and R/R")
        assert result.ret == 0, result.stdout.str()[-3000:]
        cell = _cell(report, "attention", "R/R")
        assert cell["mismatch_count"] == 0
        counts[name] = (cell["active_token_count"], cell["sample_count"])
    assert counts["one"] == counts["grid"]


@pytest.mark.slow
def test_example_tp2_matrix(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """`pytest --rlk-matrix=examples/tp2.toml`: 16 cells, R/R bitwise, every P cell drifts."""
    result, report = _run(pytester, REPO / "examples" / "tp2.toml", tmp_path / "root")
    assert result.ret == 0
    assert report["summary"] == {"valid": 16}
    for module in ("attention", "ffn", "logp", "comm"):
        assert _cell(report, module, "R/R")["mismatch_count"] == 0
        for case in ("P/R", "R/P", "P/P"):
            assert _cell(report, module, case)["mismatch_count"] > 0, (module, case)
