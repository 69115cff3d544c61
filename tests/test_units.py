"""Unit tests of the pure pieces: cells, metrics, log scanning, schema, runner env."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pytest_rlkernel_matrix.judge.performance.phases import phases
from pytest_rlkernel_matrix.judge.read.logscan import scan_log
from pytest_rlkernel_matrix.judge.read.metrics import Sample, compute
from pytest_rlkernel_matrix.run.runner import render_case_env
from pytest_rlkernel_matrix.spec.cells import Cases, expand
from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, MatrixSection, load_matrix

REPO = Path(__file__).resolve().parents[1]


def test_layouts() -> None:
    section = MatrixSection()
    pairwise = expand(section, ["cpu"])
    assert [c.name for c in pairwise[:4]] == [
        "attention[R/R]", "attention[P/R]", "attention[R/P]", "attention[P/P]"]
    assert pairwise[1].cases == Cases("P/R", "R/R", "R/R")
    assert len({c.run_key for c in pairwise}) == 10
    assert len(expand(section, ["cpu"], "reduced")) == 6
    factorial = expand(section, ["cpu"], "module-factorial")
    assert {c.case for c in factorial} == {f"M{a}{b}{c}" for a in "01" for b in "01" for c in "01"}
    m100 = next(c for c in factorial if c.case == "M100")
    assert m100.cases == Cases("R/R", "P/P", "P/P")
    full = expand(section, ["cpu", "h100"], "full")
    assert len(full) == 128 and len({c.run_key for c in full}) == 128
    off = expand(section, ["cpu"], "pairwise", mode="off")
    assert {c.cases for c in off if c.case == "P/P"} == {Cases("P/P", "P/P", "P/P")}


def test_case_parsing_follows_rl_kernel() -> None:
    assert MatrixSection(cases=[" r/r", "p/r"]).cases == ("R/R", "P/R")


def _s(train: list[float], roll: list[float], mask: list[int], i: int = 0) -> Sample:
    return Sample(np.array(train, np.float32), np.array(roll, np.float32),
                  np.array(mask, np.float32), sample=i)


def test_metrics_masked_signed_zero_and_bitwise() -> None:
    m = compute([_s([-0.0, -1.0, -2.0, -9.0], [0.0, -1.0, -2.5, -1.0], [1, 1, 1, 0])])
    assert m.active_token_count == 3
    assert m.mismatch_count == 1            # -0.0 == +0.0 for torch.ne / numpy !=
    assert m.bitwise_mismatch_count == 2    # ... but not bytewise
    assert m.logprob_abs_diff_max == pytest.approx(0.5)
    assert m.worst_tokens[0]["position"] == 2
    assert m.first_mismatch == [{"sample": 0, "rank": 0, "position": 2, "active_tokens": 3}]


def test_metrics_percentiles_and_nan() -> None:
    rng = np.random.default_rng(0)
    t = rng.normal(size=1000).astype(np.float32)
    d = np.linspace(0, 1, 1000).astype(np.float32)
    m = compute([_s(t.tolist(), (t + d).tolist(), [1] * 1000)])
    assert m.logprob_abs_diff_p50 == pytest.approx(0.5, abs=0.01)
    assert m.logprob_abs_diff_p99 == pytest.approx(0.99, abs=0.01)
    bad = compute([_s([float("nan"), -1.0], [-1.0, -1.0], [1, 1])])
    assert bad.nonfinite_count == 1 and bad.mismatch_count == 1


def test_log10_histogram_is_numpys_on_sorted_values() -> None:
    """The histogram of log10 |delta| taken from the sorted values (`log10_histogram`) gives
    numpy's edges and counts: ties, values on the edges, one value, tiny and huge ranges."""
    from pytest_rlkernel_matrix.judge.read.metrics import log10_histogram

    rng = np.random.default_rng(5)
    edge_case = 10.0 ** np.histogram_bin_edges(np.log10([1e-6, 1.0]), bins=20)
    cases = [np.array([3e-4]), np.full(7, 2.5e-3), edge_case, np.array([1e-300, 1e300]),
             np.nextafter(1.0, 2.0) ** np.arange(40), np.round(rng.random(5000), 2) + 1e-9]
    cases += [np.abs(rng.standard_normal(int(rng.integers(2, 3000))) * 10.0 ** rng.integers(-8, 2))
              for _ in range(60)]
    for values in cases:
        values = np.sort(values[values > 0])
        counts, edges = log10_histogram(values)
        want_counts, want_edges = np.histogram(np.log10(values), bins=20)
        assert edges.tobytes() == want_edges.tobytes()
        assert counts.tolist() == want_counts.tolist(), values[:5]


def test_metrics_worst_tokens_and_first_mismatches_are_each_samples_own() -> None:
    """Worst tokens and first mismatches name each sample's own response positions (masked
    tokens skipped), taken one sample at a time: samples of several sizes, masks and ranks,
    empty ones and ones without a mismatch included."""
    rng = np.random.default_rng(9)
    samples = []
    for i in range(40):
        n = int(rng.integers(0, 60))
        train = rng.standard_normal(n).astype(np.float32)
        roll = train.copy()
        hit = rng.random(n) < rng.choice([0.0, 0.05, 0.5])
        roll[hit] += rng.random(int(hit.sum())).astype(np.float32)
        samples.append(Sample(train, roll, (rng.random(n) < 0.7).astype(np.float32), sample=i,
                              rank=int(rng.integers(0, 3)), call=i // 7))
    m = compute(samples)
    want = []
    for s in samples:
        where = np.flatnonzero(s.mask)
        diff = np.flatnonzero(s.train[where] != s.rollout[where])
        if diff.size:
            want.append({"sample": s.sample, "rank": s.rank, "position": int(where[diff[0]]),
                         "active_tokens": int(where.size)})
    want.sort(key=lambda f: (f["position"], f["rank"], f["sample"]))
    assert m.first_mismatch == want[:32] and want
    assert m.first_mismatch_summary["samples_with_mismatch"] == len(want)
    assert m.first_mismatch_summary["position_median"] == float(
        np.median([f["position"] for f in want]))
    for entry in m.worst_tokens:
        s = samples[int(entry["sample"])]  # type: ignore[call-overload]
        pos = int(entry["position"])  # type: ignore[call-overload]
        assert s.mask[pos] and entry["abs_diff"] == abs(float(s.train[pos]) - float(s.rollout[pos]))
    scores = sorted((abs(float(s.train[p]) - float(s.rollout[p])) for s in samples
                     for p in np.flatnonzero(s.mask)), reverse=True)
    assert [e["abs_diff"] for e in m.worst_tokens] == [x for x in scores[:10] if x > 0]


def test_logscan(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text(
        "INFO rollout 0: {'rollout/response_lengths': [3, 4]}\n"
        "perf 0: {'perf/rollout_time': 2.0, 'perf/tokens_per_gpu_per_sec': 10.0}\n"
        "perf 0: {'perf/step_time': 5.0, 'perf/train_time': 1.0, 'perf/update_weights_time': 0.5}\n"
        "perf 1: {'perf/step_time': 4.0, 'perf/train_time': 2.0}\n"
        "perf 2: {'perf/step_time': 6.0, 'perf/train_time': 3.0}\n"
        "[RL-Kernel][route] framework=vllm target=rollout module=ffn implementation=production "
        "fallback=true\n"
        "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        "NCCL error in: ProcessGroupNCCL.cpp\n"
        "perf 3: {'perf/step_time': __import__('os')}\n"
    )
    scan = scan_log(log)
    medians, spread = phases(scan, warmup=1)
    assert medians["step_wall_time"] == 5.0          # median of steps 1..2 after warm-up drop
    assert spread["step_wall_time"]["warmup_dropped"] == 1
    assert medians["rollout_wall_time"] == 2.0
    assert scan.routes[0]["module"] == "ffn" and scan.fallback_lines
    assert set(scan.errors) >= {"oom", "nccl_error"}
    assert scan.traceback
    assert scan.traceback.endswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert scan.unparsed_records == 1                 # never eval'd
    assert not scan_log(tmp_path / "missing.log").present


def test_default_matrix_file_is_valid() -> None:
    matrix = load_matrix(REPO / "matrix.toml")
    assert set(matrix.hardware) >= {"cpu", "h100", "h200", "mi300x", "mi330x"}
    assert matrix.hardware["mi330x"].match.marketing_name == "MI330X"
    assert matrix.hardware["mi330x"].match.gfx_arch is None  # never guessed from the name


def test_missing_matrix_file(tmp_path: Path) -> None:
    with pytest.raises(MatrixFileError, match="cannot read matrix file"):
        load_matrix(tmp_path / "nope.toml")


def test_case_env_redacts_secrets(tmp_path: Path) -> None:
    text = render_case_env({"HF_TOKEN": "s3cret", "DB_PASSWORD": "pw", "RL_KERNEL_MODE": "strict"},
                           "bash run.sh", tmp_path)
    assert "s3cret" not in text and "pw'" not in text
    assert "export RL_KERNEL_MODE=strict" in text and "export HF_TOKEN='<redacted>'" in text


def test_sidecar_tp_replicas_are_read_and_cp_masks_are_sliced_at_logit_positions() -> None:
    import torch

    from pytest_rlkernel_matrix.judge.read.sidecars import SIDECAR_SCHEMA, merge, read_sidecar

    # total 10, response 8: prompt 2, logit positions [1, 9), chunks of 3 positions
    full_mask = [torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])]
    base = {"schema_version": SIDECAR_SCHEMA, "call_index": 0, "tensor_parallel_size": 2,
            "context_parallel_size": 2, "total_lengths": [10], "response_lengths": [8],
            "loss_masks": full_mask}
    # rank 2 = TP rank 0 of CP rank 1: logit chunks [3, 6) and [6, 9) -> offsets 2..7
    lp = [torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])]
    _, (sh,) = read_sidecar({**base, "rank": 2, "train_log_probs": lp,
                             "rollout_log_probs": lp}, "r2")
    assert sh.offsets.tolist() == [2, 3, 4, 5, 6, 7]
    assert sh.mask.tolist() == [True, True, True, True, True, False]
    # rank 0 = CP rank 0: logit chunk [1, 3) (chunk 3 is past total - 1) -> offsets 0, 1
    lp0 = [torch.tensor([-7.0, -8.0])]
    _, (s0,) = read_sidecar({**base, "rank": 0, "train_log_probs": lp0,
                             "rollout_log_probs": lp0}, "r0")
    assert s0.offsets.tolist() == [0, 1] and s0.mask.tolist() == [False, True]
    # rank 1: TP replica of rank 0, read and compared; an identical one adds nothing
    _, (s1,) = read_sidecar({**base, "rank": 1, "train_log_probs": lp0,
                             "rollout_log_probs": lp0}, "r1")
    merged = merge([s0, s1, sh])
    assert not merged.problems and int(merged.samples[0].mask.sum()) == 6
    assert merged.samples[0].train.tolist() == [-7.0, -8.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
