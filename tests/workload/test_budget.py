"""The micro-batch by tokens and memory (workload/training/budget.py), and the error before any
work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pytest_rlkernel_matrix.workload import job
from pytest_rlkernel_matrix.workload.env import UsageError
from pytest_rlkernel_matrix.workload.model import PRESETS, init_weights
from pytest_rlkernel_matrix.workload.parallel import Grid
from pytest_rlkernel_matrix.workload.training import budget

QWEN = PRESETS["qwen3-0.6b"]
H200 = int(141e9 * budget.USABLE)


def _est(n: int, max_seq: int, r: bool = True) -> budget.Estimate:
    return budget.estimate(QWEN, 2, n, max_seq, r)


def test_param_count_is_the_models() -> None:
    for name in ("tiny", "small"):
        w = init_weights(PRESETS[name], 0, torch.bfloat16, torch.device("cpu"))
        assert budget.param_count(PRESETS[name]) == sum(t.numel() for t in w.values())


@pytest.mark.parametrize(("new", "prompts", "want"), [(160, 448, 44), (1024, 128, 8),
                                                      (4096, 32, 2)])
def test_default_follows_tokens_not_a_prompt_count(new: int, prompts: int, want: int) -> None:
    max_seq = -(-(32 + new) // 16) * 16
    for r in (True, False):
        c = budget.choose("qwen3-0.6b", _est(prompts, max_seq, r), prompts, max_seq, H200, None)
        assert (c.size, c.chosen_by) == (want, "tokens")
        assert c.tokens <= budget.MICRO_BATCH_TOKENS["qwen3-0.6b"]
        assert c.training_gib < c.memory_gib


def test_default_is_lowered_to_fit_and_capped_by_prompts() -> None:
    est = _est(128, 1056)
    small = est.fixed + 3 * 1056 * est.per_token + 1  # room for 3 sequences
    c = budget.choose("qwen3-0.6b", est, 128, 1056, max(small, est.rollout()), None)
    assert (c.size, c.chosen_by) == (3, "memory")
    assert budget.choose("qwen3-0.6b", _est(5, 192), 5, 192, H200, None).size == 5


def test_asked_size_that_does_not_fit_names_it_and_the_largest_that_does() -> None:
    est = _est(128, 1056)
    fits = (H200 - est.fixed) // (est.per_token * 1056)
    assert budget.choose("qwen3-0.6b", est, 128, 1056, H200, int(fits)).chosen_by == "argument"
    with pytest.raises(UsageError, match=rf"--micro-batch-size {fits + 1} does not fit.*"
                                         rf"at most {fits} fits"):
        budget.choose("qwen3-0.6b", est, 128, 1056, H200, int(fits) + 1)


def test_what_cannot_fit_at_all_is_named() -> None:
    with pytest.raises(UsageError, match=r"one sequence's training step.*--max-new-tokens"):
        budget.choose("qwen3-0.6b", _est(1, 40000), 1, 40000, H200, None)
    with pytest.raises(UsageError, match=r"KV cache.*--num-prompts"):
        budget.choose("qwen3-0.6b", _est(100000, 4128), 100000, 4128, H200, None)


def test_memory_env_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(budget.MEMORY_ENV, "2.5")
    assert budget.device_memory("cuda", 10 ** 12) == int(2.5 * budget.GIB)
    monkeypatch.setenv(budget.MEMORY_ENV, "lots")
    with pytest.raises(UsageError, match="RLK_REF_MEMORY_GIB='lots'"):
        budget.device_memory("cpu")


def test_job_chooses_the_same_for_every_route_and_records_why() -> None:
    args = job.parse_args(["--preset", "tiny", "--num-prompts", "8", "--max-new-tokens", "48"])
    c = job._micro_batch(args, torch.device("cpu"), torch.bfloat16, 8, 80, Grid())
    assert (c.size, c.chosen_by) == (4, "tokens")  # the tiny preset's default, as before
    assert set(c.manifest()) >= {"size", "chosen_by", "tokens_per_micro_batch", "memory_gib"}


def test_job_fails_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    for k in list(os.environ):
        if k.startswith(("RL_KERNEL_", "RLK_REF_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("RL_KERNEL_MODE", "strict")
    monkeypatch.setenv("RL_KERNEL_ARTIFACT_DIR", str(tmp_path))
    monkeypatch.setenv("RL_KERNEL_RUN_ID", "budget")
    for m in ("ATTENTION", "FFN", "LOGP"):
        monkeypatch.setenv(f"RL_KERNEL_{m}_CASE", "R/R")
    monkeypatch.setenv(budget.MEMORY_ENV, "0.001")
    assert job.main(["--device", "cpu", "--num-prompts", "4", "--max-new-tokens", "4000"]) == 2
    err = capsys.readouterr().err
    assert "[rlk-reference] error:" in err and "does not fit" in err
    assert "4 prompts x 4032 tokens" in err and "--max-new-tokens" in err
    assert not (tmp_path / "manifest.json").exists()  # nothing was started


def _cliff(side: str, above: int, rise: float = 2.8) -> budget.Cliff:
    return budget.Cliff("qwen3-0.6b", side, above, rise, "test device", "tests/workload")


def test_chooser_keeps_to_the_safe_side_of_a_measured_cliff_and_says_why() -> None:
    est = _est(448, 192)
    cliffs = (_cliff("P", 20000), _cliff("R", 6144))
    c = budget.choose("qwen3-0.6b", est, 448, 192, H200, None, cliffs)
    assert (c.size, c.chosen_by, c.tokens) == (32, "cliff", 6144)  # 44 x 192 = 8,448 > 6,144
    rec = c.manifest()
    assert [x["applied"] for x in rec["cliffs"]] == [False, True]
    assert not any(x["past_it"] for x in rec["cliffs"])
    assert "R's measured cliff at 6144 tokens" in rec["why"] and "8448 tokens" in rec["why"]
    for new, prompts in ((160, 448), (1024, 128), (4096, 32)):  # never past one, any length
        max_seq = -(-(32 + new) // 16) * 16
        for side in ("R", "P"):
            got = budget.choose("qwen3-0.6b", _est(prompts, max_seq), prompts, max_seq, H200,
                                None, (_cliff(side, 5000),))
            assert got.tokens <= 5000 or got.size == 1, (new, side, got)


def test_cliffs_of_other_presets_and_an_asked_size_past_one_are_recorded_not_applied() -> None:
    est = _est(448, 192)
    other = budget.Cliff("small", "R", 100, 3.0, "test device", "tests/workload")
    c = budget.choose("qwen3-0.6b", est, 448, 192, H200, None, (other,))
    assert (c.size, c.chosen_by, c.manifest()["cliffs"]) == (44, "tokens", [])
    asked = budget.choose("qwen3-0.6b", est, 448, 192, H200, 44, (_cliff("R", 6144),))
    assert (asked.size, asked.chosen_by) == (44, "argument")
    rec = asked.manifest()["cliffs"][0]
    assert (rec["applied"], rec["past_it"]) == (False, True)  # the user's size, said to be past
    with pytest.raises(ValueError, match="side R or P"):
        budget.Cliff("qwen3-0.6b", "Q", 100, 2.0, "d", "s")
    with pytest.raises(ValueError, match="rise > 1"):
        _cliff("R", 100, 0.9)


def test_no_cliff_is_recorded_for_the_current_kernels() -> None:
    """Issue 55's cliff was the weight gradients' unaligned token axis (fixed in
    triton_backward.matmul_bwd), not a token count: the table holds nothing measured since."""
    assert budget.CLIFFS == ()
    c = budget.choose("qwen3-0.6b", _est(448, 192), 448, 192, H200, None)
    assert c.manifest()["why"].startswith("8448 tokens per micro-batch for qwen3-0.6b")
