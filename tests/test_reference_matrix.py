"""The default matrix on the built-in reference workload, read through the plugin (CPU, tiny)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Not about preflight: these sessions take the test run's shared probe (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("reuse_probe")


def _one_step_matrix(pytester: pytest.Pytester) -> Path:
    """The repo's matrix.toml with one measured step and no warm-up per cell.

    For tests whose assertions come from the evidence (routes, weights, capability lines,
    drift), not from timing statistics: a third of the workload's CPU time."""
    text = (REPO / "matrix.toml").read_text()
    quick = re.sub(r"(?m)^repeats = \d+", "repeats = 1", text)
    quick = re.sub(r"(?m)^warmup = \d+", "warmup = 0", quick)
    assert quick.count("repeats = 1") == 1 and quick.count("warmup = 0") == 1, "matrix.toml moved"
    path = pytester.path / "matrix.toml"
    path.write_text(quick)
    return path


def _run(pytester: pytest.Pytester, root: Path, *args: str,
         one_step: bool = False) -> tuple[pytest.RunResult, dict]:
    matrix = _one_step_matrix(pytester) if one_step else REPO / "matrix.toml"
    # In-process: the session needs no fresh interpreter (its cells are processes of their own)
    # and this one has torch loaded already (a subprocess session imports it again to read the
    # sidecars: ~4 s of CPU per session on the 2-core box).
    result = pytester.runpytest(f"--rlk-matrix={matrix}", f"--rlk-matrix-root={root}",
                                "-p", "no:cacheprovider", *args)
    return result, json.loads((root / "matrix-report.json").read_text())


def _cell(report: dict, module: str, case: str) -> dict:
    (cell,) = [c for c in report["cells"] if c["module"] == module and c["case"] == case]
    return cell


@pytest.mark.slow  # the default matrix: CI's main job runs it too; `-m slow --run-slow` asserts
def test_default_pairwise_matrix(pytester: pytest.Pytester, tmp_path: Path) -> None:
    # One step per cell: the assertions are about evidence and drift; the README's main job
    # (run by .ci/run) runs the same matrix with its repeats.
    result, report = _run(pytester, tmp_path / "root", one_step=True)
    assert result.ret == 0
    assert report["summary"] == {"valid": 12} and report["complete"]
    rr = _cell(report, "attention", "R/R")
    assert rr["mismatch_count"] == 0 and rr["bitwise_mismatch_count"] == 0
    assert rr["active_token_count"] >= 200  # tiny: 8 prompts x up to 48 tokens per step
    claims = {k: v["status"] for k, v in rr["claims"].items()}
    assert claims == {"train_rollout_bitwise": "holds", "weights_bitwise": "holds",
                      "run_to_run_bitwise": "not judged"}
    assert rr["contract"]["kind"] == "bitwise" and rr["reasons"] == []
    for module in ("attention", "ffn", "logp"):
        for case in ("P/R", "R/P", "P/P"):
            cell = _cell(report, module, case)
            assert cell["mismatch_count"] > 0, (module, case)
            assert cell["validity"]["numeric"]["valid"] is None  # P side: reported, not judged
        assert "drift from" in next(a["conclusion"] for a in report["attribution"]
                                    if a["module"] == module)
    attention_pr = _cell(report, "attention", "P/R")
    assert attention_pr["actual_training_implementation"] == "production"
    assert attention_pr["actual_rollout_implementation"] == "rl_kernel"
    assert attention_pr["step_wall_time"] and attention_pr["rollout_wall_time"]
    assert (tmp_path / "root" / "matrix-report.html").exists()


@pytest.mark.parametrize(
    ("fault", "verdict", "words"),
    [
        ("recorded_fallback:attention:rollout", "fallback", ("attention", "rollout", "fallback")),
        ("silent_fallback:ffn:training", "contract_mismatch", ("bitwise contract violated",)),
        ("corrupt_weight", "incomparable", ("weight version 0", "sides hold different weights")),
        ("unsupported:logp:rollout", "unsupported", ("logp", "rollout", "platform_unsupported")),
    ],
)
def test_fault_drills(pytester: pytest.Pytester, tmp_path: Path, fault: str, verdict: str,
                      words: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLK_REF_FAULT", fault)
    result, report = _run(pytester, tmp_path / "root", "-k", "attention and R/R",
                          "-o", "rlk_matrix=matrix.toml", one_step=True)
    cell = _cell(report, "attention", "R/R")
    assert cell["verdict"] == verdict, cell["reasons"]
    text = " ".join(cell["reasons"])
    for word in words:
        assert word in text, cell["reasons"]
    assert cell["fault_drill"]  # the drill is recorded as such in manifest.json
    assert result.ret == (1 if verdict == "incomparable" else 0)  # audit mode


def test_strict_mode_fails_closed_on_a_drill(pytester: pytest.Pytester, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLK_REF_FAULT", "unsupported:attention:rollout")
    result, report = _run(pytester, tmp_path / "root", "--rlk-mode=strict", "-m", "rlk_baseline",
                          one_step=True)
    assert result.ret == 1
    cell = _cell(report, "attention", "R/R")
    assert cell["verdict"] == "unsupported" and cell["exit_code"] == 4
    assert cell["unsupported_class"] == "platform_unsupported"


def test_attribution_points_at_a_silent_fallback(pytester: pytest.Pytester, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Rollout attention secretly runs P in every cell: R/R drifts exactly like attention R/P."""
    monkeypatch.setenv("RLK_REF_FAULT", "silent_fallback:attention:rollout")
    result, report = _run(pytester, tmp_path / "root", "-k", "attention or ffn and R/P",
                          one_step=True)
    assert result.ret == 0  # audit: recorded, not failed
    rr = _cell(report, "attention", "R/R")
    assert rr["verdict"] == "contract_mismatch"
    entry = next(a for a in report["attribution"] if a["module"] == "attention")
    assert entry["suspects"] == ["attention rollout"]
    assert "silent fallback" in entry["conclusion"]
