"""Sidecars laid out as RL-Kernel writes them, judged (issue 20, part A).

The fixture is built here with `torch.save`, from RL-Kernel's writer as described in
/work/notes/upstream20.md section 1 (`tis_metrics._write_sidecar`): tp 2 x cp 2 (4 ranks, Megatron
order: `cp_rank = (rank // tp) % cp`), 2 calls x 2 samples, every rank writes (TP replicas hold
the same values), logprobs CP-sliced zigzag at logit positions `[prompt-1, total-1)`, loss masks
full length. 63 response tokens, 8 masked, so 55 active; 25 of them mismatch (rollout = train +
2**-k). RL-Kernel's own `compare_train_rollout_logps` reads this design as element_count 55,
mismatch_count 25, max_abs_diff 0.0625, mismatch_kl 0.009197443181818182, mismatch_k3_kl
0.0001709769012618878 (measured, upstream20.md section 8). Nothing here uses the plugin's writer
(upstream_layout.py builds the files).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from upstream_layout import SCHEMA, independent_figures, upstream_cell

SIDECAR = "unreadable artifact: sidecar mismatch-sidecars/"


def test_tp2_cp2_sidecars_read_55_active_25_mismatching_with_upstreams_figures(
        tmp_path: Path) -> None:
    rec = upstream_cell(tmp_path).analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert rec["reasons"] == ["bitwise contract violated: 25 of 55 active tokens differ by "
                              "value, 25 in bytes (max |dlogp| 0.0625)"]
    assert (rec["active_token_count"], rec["mismatch_count"], rec["bitwise_mismatch_count"],
            rec["sample_count"], rec["rank_count"], rec["sidecar_count"]) == (55, 25, 25, 4, 4, 8)
    want = independent_figures()
    for key, value in want.items():
        assert rec[key] == value, key  # to the last digit
    assert rec["logprob_abs_diff_mean"] == rec["train_rollout_logprob_abs_diff"]
    # RL-Kernel's own validator on this design (upstream20.md section 8), to the last digit
    assert rec["mismatch_kl"] == 0.009197443181818182
    assert rec["mismatch_k3_kl"] == 0.0001709769012618878
    assert rec["logprob_abs_diff_max"] == 0.0625
    assert rec["mismatch_kl"] > 0  # mean(rollout - train): rollout = train + 2**-k
    assert rec["figure_convention"].startswith("RL-Kernel: delta = train - rollout")
    assert rec["sidecar_schema"] == [SCHEMA]


def test_clean_tp2_cp2_r_r_is_valid_with_every_active_token(tmp_path: Path) -> None:
    rec = upstream_cell(tmp_path, clean=True).analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["reasons"] == []
    assert (rec["active_token_count"], rec["mismatch_count"],
            rec["bitwise_mismatch_count"], rec["sample_count"]) == (55, 0, 0, 4)
    assert rec["mismatch_kl"] == 0.0 and rec["mismatch_k3_kl"] == 0.0


def test_plus_and_minus_zero_break_a_bitwise_r_r(tmp_path: Path) -> None:
    rec = upstream_cell(tmp_path, negzero=True).analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert rec["reasons"] == ["bitwise contract violated: 1 of 55 active tokens differ in bytes "
                              "(0 by value: +0.0/-0.0 or a dtype change; max |dlogp| 0)"]
    assert (rec["active_token_count"], rec["mismatch_count"],
            rec["bitwise_mismatch_count"]) == (55, 0, 1)


def test_a_disagreeing_tp_replica_is_named(tmp_path: Path) -> None:
    rec = upstream_cell(tmp_path, clean=True, replica=True).analyze()
    assert rec["verdict"] == "incomparable"
    assert rec["reasons"] == [
        "samples not comparable: TP replica rank 1 disagrees with rank 0 on call 1, sample 0 "
        "(DP rank 0, CP rank 0): train_log_probs differ (mismatch-sidecars/"
        "rank00001.call00000001.pt vs mismatch-sidecars/rank00000.call00000001.pt)"]
    assert (rec["active_token_count"], rec["mismatch_count"]) == (55, 0)  # rank 0's copy counts


def test_a_missing_cp_shard_is_named(tmp_path: Path) -> None:
    rec = upstream_cell(tmp_path, drop=((2, 1), (3, 1))).analyze()
    assert rec["verdict"] == "incomparable"
    assert rec["reasons"] == [
        f"samples not comparable: call 1, sample {i} (DP rank 0): missing CP shard(s) from cp "
        "rank(s) [1] (got [0] of 0..1)" for i in (0, 1)] + [
        f"sidecar of rank {r}, call 1 is missing (rank0000{r}.call00000001.pt; every rank "
        "writes one per call)" for r in (2, 3)] + [
        "also: bitwise contract violated: 13 of 31 active tokens differ by value, 13 in bytes "
        "(max |dlogp| 0.0625)"]
    want = independent_figures(skip=((2, 1),))
    assert (rec["active_token_count"], rec["mismatch_count"]) == (31, 13)  # RL-Kernel: 31/13
    assert want["active_token_count"] == 31 and want["mismatch_count"] == 13
    assert rec["mismatch_kl"] == want["mismatch_kl"]


@pytest.mark.parametrize(("schema", "why"), [
    (("schema_version", "rlkernel.vime_rocm_attention_mismatch_sidecar.v2"),
     "schema_version is 'rlkernel.vime_rocm_attention_mismatch_sidecar.v2', not "
     f"'{SCHEMA}'"),
    (("schema", "someone.else.v1"), "no schema_version key (RL-Kernel's validator refuses the "
     "older key schema: 'someone.else.v1')"),
    # the older key with the right value: RL-Kernel's validator refuses it (issue 50's golden
    # data, tests/golden/upstream/sidecars: `legacy_schema_key`), so does the plugin
    (("schema", SCHEMA), "no schema_version key (RL-Kernel's validator refuses the older key "
     f"schema: '{SCHEMA}')"),
    (("format", SCHEMA), f"no schema_version key (expected '{SCHEMA}')"),
])
def test_an_unknown_schema_is_refused_naming_file_and_key(tmp_path: Path, schema: tuple[str, str],
                                                          why: str) -> None:
    rec = upstream_cell(tmp_path, clean=True, schema=schema).analyze()
    assert rec["verdict"] == "error"
    assert rec["reasons"] == ["logprob evidence holds no active (mask=1) tokens"] + [
        f"{SIDECAR}rank{r:05d}.call{c:08d}.pt: refused: {why}" for r in range(4) for c in (0, 1)]


def test_figures_follow_upstreams_sign_and_estimators() -> None:
    import math

    import numpy as np

    from pytest_rlkernel_matrix.judge.read.metrics import Sample, compute

    train = np.array([-1.0, -2.0, -3.0], dtype=np.float32)
    roll = np.array([-1.5, -2.0, -2.75], dtype=np.float32)  # delta = train - rollout
    m = compute([Sample(train, roll, np.array([1, 1, 0]), sample=0)])
    # active: delta = [0.5, 0.0] (the masked -0.25 does not count)
    assert (m.active_token_count, m.mismatch_count, m.bitwise_mismatch_count) == (2, 1, 1)
    assert m.mismatch_kl == -0.25  # mean(rollout - train)
    assert m.train_rollout_logprob_abs_diff == m.logprob_abs_diff_mean == 0.25
    assert m.mismatch_k3_kl == ((math.exp(0.5) - 0.5 - 1.0) + 0.0) / 2


def test_train_and_rollout_of_different_dtypes_are_not_compared(tmp_path: Path) -> None:
    """RL-Kernel's validator refuses a sample whose train and rollout log-probs differ in dtype
    (issue 50's golden data: `bf16_vs_fp32_same_values`); values are never widened here."""
    import torch

    k = upstream_cell(tmp_path, clean=True)
    for path in sorted((k.dir / "mismatch-sidecars").glob("*.call00000000.pt")):
        data = torch.load(path, weights_only=True)
        data["rollout_log_probs"][0] = data["rollout_log_probs"][0].to(torch.bfloat16)
        path.unlink()
        k.write_sidecar(data, path.name)
    rec = k.analyze()
    assert rec["verdict"] == "incomparable", rec["reasons"]
    dtype = [r for r in rec["reasons"] if "train/rollout dtype mismatch" in r]
    assert dtype and all(r.startswith("samples not comparable: call 0, sample 0 (rank ")
                         and "train_log_probs float32, rollout_log_probs bfloat16" in r
                         for r in dtype), rec["reasons"]
