"""Log scanning stays linear: throughput of `scan_log` on a large run.log and on one long line.

Not a test (no thresholds): a script that prints measured numbers. Run from the repo root:

    python benchmarks/bench_logscan.py            # 200 MB run.log, 1 MB single line
    python benchmarks/bench_logscan.py --mb 50    # smaller, for a busy machine

It writes, under a temporary directory,
- `big.log`: `--mb` MB of realistic vime/RL-Kernel lines (INFO noise, route lines, metric records),
  scanned at half and full size: time(full) / time(half) near 2 means linear in the file size;
- `line.log`: one `--line-mb` MB line made of `perf 0: {` repeated (the line that took 7.6 s for
  288 KB before the record regex was made linear), plus one of `NCCL WARN ` repeated;
and prints MB/s per file with the median of `--repeats` runs and their min..max.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytest_rlkernel_matrix.judge.read.logscan import scan_log

LINES = (
    "[2026-01-01 00:00:00] INFO     model_runner.py:1234 Loading weights took 12.3 GB, 4.56 s\n",
    "[RL-Kernel][route] framework=vllm target=rollout module=attention case=R/R "
    "implementation=rl_kernel backend_id=rlkernel.attention.deterministic.v1 fallback=false\n",
    "rollout 3: {'rollout/response_lengths': [128, 256, 97, 311], "
    "'rollout/total_lengths': [400, 512, 380, 600]}\n",
    "perf 3: {'perf/step_time': 31.2, 'perf/train_time': 12.1, 'perf/update_weights_time': 2.0}\n",
    "step 3: {'train/train_rollout_logprob_abs_diff': 0.0, "
    "'train/train_current_rollout_logprob_numel': 123456}\n",
    "(RayWorker pid=1234) NCCL INFO Channel 00/32 : 0[0] -> 1[1] via P2P/CUMEM/read\n",
)


def write_big(path: Path, mb: float) -> int:
    block = "".join(LINES) * 200
    target = int(mb * 1e6)
    written = 0
    with path.open("w") as fh:
        while written < target:
            fh.write(block)
            written += len(block)
    return path.stat().st_size


def timed(path: Path, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scan_log(path)
        out.append(time.perf_counter() - t0)
    return out


def show(name: str, size: int, times: list[float]) -> float:
    med = statistics.median(times)
    print(f"{name:<28} {size / 1e6:9.1f} MB  {size / 1e6 / med:8.1f} MB/s  "
          f"median {med:7.3f} s  (min {min(times):.3f}, max {max(times):.3f}, n={len(times)})")
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="size of the big run.log in MB")
    ap.add_argument("--line-mb", type=float, default=1.0, help="size of the single line in MB")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        half = write_big(d / "half.log", args.mb / 2)
        full = write_big(d / "big.log", args.mb)
        t_half = show("run.log, half size", half, timed(d / "half.log", args.repeats))
        t_full = show("run.log, full size", full, timed(d / "big.log", args.repeats))
        print(f"time ratio full/half: {t_full / t_half:.2f} for a size ratio of "
              f"{full / half:.2f} (linear: equal)")
        n = int(args.line_mb * 1e6)
        for name, unit in (("one line of 'perf 0: {'", "perf 0: {"),
                           ("one line of 'NCCL WARN '", "NCCL WARN ")):
            p = d / "line.log"
            p.write_text(unit * (n // len(unit)) + "\n")
            show(name, p.stat().st_size, timed(p, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
