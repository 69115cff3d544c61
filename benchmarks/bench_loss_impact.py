"""What the importance-ratio figures (`judge.read.loss`, issue 45) cost `metrics.compute`.

    python benchmarks/bench_loss_impact.py [--tokens 2000000] [--repeat 5]

Side by side on the same samples (drifting: every token differs; bitwise: none does), best of
`--repeat` process-CPU times: `compute` as the judge calls it (the figures on) and `compute`
with `loss_impact` and `token_drift` replaced by no-ops (the figures off), with the ratio and
active tokens/s."""

from __future__ import annotations

import argparse
import time
from unittest import mock

import numpy as np

from pytest_rlkernel_matrix.judge.read import loss, metrics


def _samples(tokens: int, drift: bool) -> list[metrics.Sample]:
    rng = np.random.default_rng(0)
    out, made, i = [], 0, 0
    while made < tokens:
        n = int(rng.integers(500, 2500))
        roll = rng.normal(-2, 1, n).astype(np.float32)
        train = (roll + rng.normal(0, 0.05, n).astype(np.float32)) if drift else roll.copy()
        mask = np.ones(n, dtype=bool)
        mask[: n // 10] = False
        out.append(metrics.Sample(train, roll, mask, sample=i % 16, call=i // 16, rank=0))
        made += int(mask.sum())
        i += 1
    return out


def _best(samples: list[metrics.Sample], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.process_time()
        metrics.compute(samples)
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    print("| samples | active tokens | figures off CPU s | figures on CPU s | on / off | "
          "tokens/s on |")
    print("| --- | --- | --- | --- | --- | --- |")
    for drift in (True, False):
        samples = _samples(a.tokens, drift)
        n = metrics.compute(samples).active_token_count
        with mock.patch.object(loss, "loss_impact", lambda *_a, **_k: {}), \
                mock.patch.object(loss, "token_drift", lambda *_a, **_k: []):
            off = _best(samples, a.repeat)
        on = _best(samples, a.repeat)
        print(f"| {'drifting' if drift else 'bitwise'} | {n:,} | {off:.3f} | {on:.3f} | "
              f"{on / off:.2f}x | {n / on / 1e6:.2f}M |")


if __name__ == "__main__":
    main()
