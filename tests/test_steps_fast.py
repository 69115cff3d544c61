"""The per-step series from the cell's own merge equals the series of a merge per call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pytest_rlkernel_matrix.judge.read import evidence
from pytest_rlkernel_matrix.judge.read import steps as rsteps
from pytest_rlkernel_matrix.judge.read.metrics import compute, part_sums, pooled_figures
from pytest_rlkernel_matrix.judge.reproducibility import steps

SCHEMA = "rlkernel.vime_rocm_attention_mismatch_sidecar.v1"
TP, CP, SAMPLES, RESPONSE, PROMPT = 2, 2, 3, 40, 9


def _zigzag(total: int, cp_rank: int) -> torch.Tensor:
    base, chunk = total - RESPONSE - 1, -(-total // (2 * CP))
    keep = [torch.arange(max(c * chunk, base) - base, min((c + 1) * chunk, total - 1) - base)
            for c in (cp_rank, 2 * CP - 1 - cp_rank)]
    return torch.cat([k for k in keep if k.numel()])


def _write(root: Path, calls: int, *, dtype: torch.dtype = torch.float32,
           odd: dict[str, Any] | None = None) -> None:
    """Sidecars of tp 2 x cp 2: per call some drift, an exact step, NaN and overflow tokens,
    a sample without active tokens; `odd` bends one file (name, dtype, replica)."""
    side = root / "mismatch-sidecars"
    side.mkdir(parents=True)
    gen = torch.Generator().manual_seed(3)
    total = PROMPT + RESPONSE
    odd = odd or {}
    for call in range(calls):
        train = [-torch.rand(RESPONSE, generator=gen) * 5 for _ in range(SAMPLES)]
        roll = [t.clone() if call == 1 else t + 1e-3 * torch.randn(RESPONSE, generator=gen)
                for t in train]
        masks = [torch.ones(RESPONSE) for _ in range(SAMPLES)]
        masks[0][:7] = 0
        masks[2][:] = 0 if call == 2 else 1
        if call == 3:
            roll[1][5] = float("nan")
        if call == 4:
            roll[1][9] = -2000.0  # exp(delta) overflows: k3 not finite, the step has no mean
        for rank in range(TP * CP):
            keep = _zigzag(total, (rank // TP) % CP)
            t_dtype = odd.get("dtype", dtype) if (call, rank) == (0, 3) else dtype
            data = {"schema_version": SCHEMA, "rank": rank, "call_index": call,
                    "tensor_parallel_size": TP, "context_parallel_size": CP,
                    "train_log_probs": [t[keep].to(t_dtype) for t in train],
                    "rollout_log_probs": [r[keep].to(dtype) for r in roll],
                    "loss_masks": [m.clone() for m in masks],
                    "total_lengths": [total] * SAMPLES, "response_lengths": [RESPONSE] * SAMPLES}
            if odd.get("replica") and (call, rank) == (2, 1):
                data["rollout_log_probs"][0] = data["rollout_log_probs"][0] + 1.0
            name_call = odd.get("name_call", call) if (call, rank) == (1, 0) else call
            torch.save(data, side / f"rank{rank:05d}.call{name_call:08d}.pt")


def _series(root: Path) -> tuple[str, str, bool]:
    """(the series read inside one analysis, the series of a merge per call, fast path?)."""
    with evidence.pt_memo():
        ev = evidence.read_evidence(root)
        files = rsteps.sidecar_files(root, [])
        fast = evidence.step_inputs(root, files.values()) is not None
        inside = steps.Steps.of(rsteps.read_steps(root)).as_dict()
    alone = steps.Steps.of(rsteps.read_steps(root)).as_dict()
    assert ev.metrics is not None
    return json.dumps(inside, sort_keys=True), json.dumps(alone, sort_keys=True), fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_cell_s_merge_gives_the_series_a_merge_per_call_gives(tmp_path: Path,
                                                                  dtype: torch.dtype) -> None:
    _write(tmp_path, 6, dtype=dtype)
    inside, alone, fast = _series(tmp_path)
    assert fast and inside == alone
    series = json.loads(alone)["series"]
    assert [s["step"] for s in series] == list(range(6))
    assert series[1]["bitwise_mismatch_count"] == 0 and series[0]["bitwise_mismatch_count"] > 0
    assert series[3]["abs_diff_mean"] == 0.0 and series[4]["k3"] == 0.0  # NaN, overflow
    assert series[4]["abs_diff_max"] > 1000


@pytest.mark.parametrize("odd", [{"name_call": 9}, {"dtype": torch.float64}, {"replica": True}])
def test_cells_a_per_call_merge_would_read_otherwise_merge_per_call(tmp_path: Path,
                                                                    odd: dict[str, Any]) -> None:
    _write(tmp_path, 4, odd=odd)
    inside, alone, fast = _series(tmp_path)
    assert not fast and inside == alone


def test_pooled_figures_from_part_sums_are_the_figures_of_the_parts(tmp_path: Path) -> None:
    _write(tmp_path, 3)
    with evidence.pt_memo():
        ev = evidence.read_evidence(tmp_path)
    shards = []
    for path in sorted((tmp_path / "mismatch-sidecars").glob("*.pt")):
        shards += evidence.sidecar_shards(evidence._load_pt(path, tmp_path, [])[0], path.name)
    merged = evidence.merge(shards)
    want = compute(merged.samples, merged.parts)
    want.rank_count = TP * CP  # the evidence counts the ranks whose sidecars were read
    assert ev.metrics is not None and ev.metrics.as_dict() == want.as_dict()
    again = compute(merged.samples, sums=part_sums(merged.parts))
    again.rank_count = TP * CP
    assert again.as_dict() == want.as_dict()
    rng = np.random.default_rng(0)
    parts = [(rng.standard_normal(n).astype(np.float32), rng.standard_normal(n))
             for n in (0, 1, 7, 129, 1000)]
    got = pooled_figures(parts)
    assert got is not None and got[0] == 1137
    parts.append((np.array([np.inf]), np.array([0.0])))
    assert pooled_figures(parts) is None


def test_the_weight_chain_reads_what_the_evidence_parsed_and_the_rest_itself(
        tmp_path: Path) -> None:
    _write(tmp_path, 2)
    audit = tmp_path / "weight-audit"
    (audit / "rollout").mkdir(parents=True)
    for v in range(3):
        body = {"version": str(v), "scope": "all_exported_parameters", "sha256": f"{v:064x}",
                "tensor_count": 0, "tensors": {}}
        (audit / f"{v}.json").write_text(json.dumps(body))
        (audit / "rollout" / f"{v}.json").write_text(json.dumps(dict(
            body, scope="rollout_loaded_parameters")))
    # json.loads(bytes) reads these, a UTF-8 decode does not (or not the same way)
    (audit / "rollout" / "0.json").write_bytes(b"\xef\xbb\xbf" + (
        audit / "rollout" / "0.json").read_bytes())
    (audit / "2.json").write_text((audit / "2.json").read_text(), encoding="utf-16")
    (audit / "rollout" / "1.json").write_bytes(b"{not json")
    with evidence.pt_memo():
        evidence.read_evidence(tmp_path)
        assert len(evidence.parsed_audits(tmp_path)) == 3
        problems: list[str] = []
        inside = rsteps.weight_chain(tmp_path, problems)
    alone_problems: list[str] = []
    assert inside == rsteps.weight_chain(tmp_path, alone_problems)
    assert problems == alone_problems and len(problems) == 1
    assert inside["0"]["rollout"] == f"{0:064x}" and "training" in inside["2"]


def test_batched_part_sums_and_counts_are_those_of_one_part_and_one_sample_at_a_time() -> None:
    """`part_sums` over a batch's concatenation gives each part's sums bit for bit (NaN, inf,
    k3 overflow, empty parts, -0.0, batches cut anywhere); `compute(counts=...)` gives the
    samples' `sample_counts`."""
    from pytest_rlkernel_matrix.judge.read import metrics

    rng = np.random.default_rng(7)
    for trial in range(120):
        dtype = (np.float32, np.float64)[trial % 2]
        parts, samples = [], []
        for i in range(int(rng.integers(2, 40))):
            n = int(rng.choice([0, 1, 7, 8, 9, 128, 129, 1250, int(rng.integers(0, 3000))]))
            train = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 800.0])).astype(dtype)
            roll = (train + rng.standard_normal(n) * rng.choice([0.0, 1e-4, 400.0])).astype(dtype)
            if n and rng.random() < 0.15:
                train[int(rng.integers(n))] = rng.choice([np.nan, np.inf, -np.inf])
            if n and rng.random() < 0.1:
                train[:], roll[:] = 0.0, -0.0
            parts.append((train, roll))
            samples.append(metrics.Sample(train, roll, rng.random(n) < 0.7, sample=i))
        metrics._BATCH = int(rng.choice([1 << 18, 1000, 1]))
        try:
            got, want = metrics.part_sums(parts), metrics._part_sums_each(parts)
        finally:
            metrics._BATCH = 1 << 18
        assert repr(got) == repr(want)
        assert [None if g is None else np.array(g[1:]).tobytes() for g in got] == [
            None if w is None else np.array(w[1:]).tobytes() for w in want]
        counts: list[metrics.SampleCounts] = []
        metrics.compute(samples, counts=counts)
        assert repr(counts) == repr(metrics.sample_counts(samples))
