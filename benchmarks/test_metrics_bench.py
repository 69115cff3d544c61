"""Throughput of the drift metrics: `pytest benchmarks/test_metrics_bench.py --benchmark-only`.

Prints active tokens per second for 1,000,000 active tokens over 2,000 samples.
"""

from __future__ import annotations

import numpy as np
import pytest

from pytest_rlkernel_matrix.judge.read.metrics import Sample, compute

TOKENS = 1_000_000
SAMPLES = 2_000


@pytest.fixture(scope="module")
def samples() -> list[Sample]:
    rng = np.random.default_rng(0)
    per = TOKENS // SAMPLES
    out = []
    for i in range(SAMPLES):
        train = -rng.exponential(size=per + 8).astype(np.float32)
        roll = train + rng.normal(scale=1e-3, size=train.size).astype(np.float32)
        mask = np.ones(train.size, np.float32)
        mask[:8] = 0
        out.append(Sample(train, roll, mask, sample=i))
    return out


def test_metrics_throughput(benchmark: pytest.FixtureRequest, samples: list[Sample]) -> None:
    result = benchmark(compute, samples)
    assert result.active_token_count == TOKENS
    mean_s = benchmark.stats.stats.mean
    benchmark.extra_info["active_tokens_per_s"] = TOKENS / mean_s
    print(f"\nmetrics: {TOKENS:,} active tokens in {mean_s * 1e3:.1f} ms "
          f"= {TOKENS / mean_s / 1e6:.1f} M tokens/s")
