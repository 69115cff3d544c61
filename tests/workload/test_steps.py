"""Real RL steps in the reference job and the three claims judged over them
(judge/reproducibility/steps.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_job import run_cell

from pytest_rlkernel_matrix.judge.read import steps as reading
from pytest_rlkernel_matrix.judge.reproducibility import steps as layer
from pytest_rlkernel_matrix.judge.reproducibility.steps import Claim, Steps, trend
from pytest_rlkernel_matrix.report.claims import claim_lines, steps_chart

STEPS = ["--num-prompts", "4", "--max-new-tokens", "10", "--micro-batch-size", "3"]


def read_steps(root: Path) -> Steps:
    """The series as read (judge/read/steps.py), with the layer's claims over it."""
    return Steps.of(reading.read_steps(root))


def compare_runs(first: Path, second: Path) -> Claim:
    return layer.compare_runs(reading.read_pair(first, second))


def judge_claims(root: Path, repeat_dir: str | None) -> tuple[dict, dict]:
    return layer.judge_claims(reading.read_reproducibility(root, repeat_dir))


def _run(tmp: Path, name: str, steps: int, fault: str | None = None,
         extra: list[str] | None = None) -> Path:
    proc, d = run_cell(tmp / name, mode="audit", fault=fault,
                       args=[*STEPS, "--steps", str(steps), *(extra or [])])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return d


def test_rr_every_step_bitwise_weights_per_version_and_run_to_run(tmp_path: Path) -> None:
    a, b = _run(tmp_path, "a", 3), _run(tmp_path, "b", 3)
    st = read_steps(a)
    assert [s["step"] for s in st.series] == [0, 1, 2]
    assert all(s["bitwise_mismatch_count"] == 0 and s["active_tokens"] for s in st.series)
    assert st.bitwise_claim().status == "holds"
    assert sorted(st.weights) == ["0", "1", "2"]  # a new weight_version per optimizer step
    assert len({v["training"] for v in st.weights.values()}) == 3
    assert st.weights_claim().status == "holds"
    assert compare_runs(a, b).status == "holds"
    # the session's path: the second run's exit-code decides whether it can be compared
    assert judge_claims(a, "b")[0]["run_to_run_bitwise"]["detail"].startswith(
        "the second run b exited without a readable exit-code")  # never finished
    (b / "exit-code").write_text("1\n")
    assert judge_claims(a, "b")[0]["run_to_run_bitwise"] == {
        "name": "run_to_run_bitwise", "status": "not judged", "detail": "the second run b "
        "exited 1", "text": "run_to_run_bitwise: not judged (the second run b exited 1)"}
    (b / "exit-code").write_text("0\n")
    assert judge_claims(a, "b")[0]["run_to_run_bitwise"]["status"] == "holds"
    assert judge_claims(a, "c")[0]["run_to_run_bitwise"]["detail"] == (
        "the second run c is missing")
    log = (a / "run.log") if (a / "run.log").exists() else None
    assert log is None or "step 2:" in log.read_text()


@pytest.mark.parametrize(("side", "first"), [("training", 1), ("rollout", 0)])
def test_nondeterministic_drill_fails_only_run_to_run(tmp_path: Path, side: str,
                                                      first: int) -> None:
    """Training: the gradients vary, so step 0's sidecar is the same and step 1's is not.
    Rollout: the sampler varies, so step 0 already differs; train and rollout stay bitwise."""
    fault = f"nondeterministic:attention:{side}"
    a, b = _run(tmp_path, "a", 3, fault), _run(tmp_path, "b", 3, fault)
    st = read_steps(a)
    assert st.bitwise_claim().status == "holds"
    assert st.weights_claim().status == "holds"
    r2r = compare_runs(a, b)
    assert r2r.status == "fails"
    assert r2r.detail.startswith(f"fails at step {first}, rank 0, sample "), r2r.detail
    assert json.loads((a / "manifest.json").read_text())["fault_drill"]["applied"] is True


def test_nondeterministic_drill_not_applied_off_the_r_path(tmp_path: Path) -> None:
    """attention P/P: the drill's module side runs production, so the drill does nothing."""
    fault = "nondeterministic:attention:rollout"
    runs = []
    for name in ("a", "b"):
        proc, d = run_cell(tmp_path / name, cases="P/P R/R R/R", mode="audit", fault=fault,
                           args=[*STEPS, "--steps", "2"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(d)
    assert json.loads((runs[0] / "manifest.json").read_text())["fault_drill"]["applied"] is False
    assert compare_runs(*runs).status == "holds"


def test_drift_growth_grows_and_names_first_step(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", 5, "drift_growth:attention:rollout")
    st = read_steps(a)
    claim = st.bitwise_claim()
    assert claim.status == "fails" and claim.detail.startswith("first non-bitwise step 1:")
    assert st.trend()["conclusion"] == "grows", st.trend()
    assert st.weights_claim().status == "holds"
    # what the terminal and the HTML make of it (report/claims.py)
    claims, steps = judge_claims(a, None)
    rec = {"claims": claims, "steps": steps, "baseline": True, "hardware": "cpu",
           "module": "attention", "case": "R/R", "artifact_dir": "cpu/attention-rr"}
    chart = steps_chart(rec)
    assert chart is not None and chart["first"] == 1
    assert [p["mark"] for p in chart["points"]] == [False, True, False, False, False]
    assert [p["cls"] for p in chart["points"]] == ["pt-ok"] + ["pt-bad"] * 4
    assert chart["trend"].startswith("drift over steps: grows (slope ")
    (line,) = claim_lines([rec])
    assert line.startswith("claims cpu attention R/R: train/rollout bitwise FAILS (first "
                           "non-bitwise step 1: ")
    assert "; run-to-run bitwise not judged (one run (set [reproducibility] runs = 2" in line
    assert "; weights bitwise holds (v0..v4, 5 versions); drift over steps: grows" in line


def test_lr_zero_keeps_one_weight_version(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", 3, extra=["--lr", "0"])
    st = read_steps(a)
    assert sorted(st.weights) == ["0"]
    assert len(st.series) == 3 and st.bitwise_claim().status == "holds"


def test_trend_rule() -> None:
    assert trend([0, 1, 2, 3, 4], [0.0] * 5)["conclusion"] == "flat"
    assert trend([0, 1, 2, 3, 4], [0.0, 1.0, 2.0, 3.0, 4.1])["conclusion"] == "grows"
    assert trend([0, 1], [0.0, 1.0])["conclusion"] == "no conclusion"
    assert trend([0, 1, 2, 3, 4, 5], [1.0, 3.0, 0.5, 2.9, 1.1, 2.0])["conclusion"] == \
        "no conclusion"


def test_adamw_is_torchs_update_bit_for_bit() -> None:
    """rl.AdamW (no torch.optim: its first param group imports torch._dynamo) against
    torch.optim.AdamW(foreach=False) over three steps: the same bits."""
    import torch

    from pytest_rlkernel_matrix.workload.training import rl

    g = torch.Generator().manual_seed(0)
    ours = [torch.randn(7, 5, generator=g), torch.randn(3, generator=g)]
    theirs = [p.clone() for p in ours]
    opt = rl.make_optimizer(ours, 1e-3)
    ref = torch.optim.AdamW(theirs, lr=1e-3, betas=rl.ADAM_BETAS, eps=rl.ADAM_EPS,
                            weight_decay=0.0, foreach=False, fused=False)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        for p, q, gr in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        ref.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, theirs, strict=True))
