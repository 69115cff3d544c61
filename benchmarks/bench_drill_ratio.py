"""The slow drill's true effect on the rollout phase, measured directly (issue 52). Not a test.

`RLK_REF_FAULT=slow:ffn:rollout:F` runs ffn's rollout-side kernels F times per call
(`workload/evidence/profiling.py`); ffn is only part of the rollout phase, so the phase's true
ratio is
``1 + (F - 1) * (ffn's share of the rollout phase)``, well below F. This script measures it:
the reference workload (preset tiny, CPU, the all-R cell: ffn R on the rollout side) run as
separate processes, interleaved factor by factor (round 1: every factor once, then round 2...),
each process's steady rollout-phase location (`judge.performance.steady`, warm-up step
dropped), and per factor the ratio of the geometric means over processes against F = 1, with a
95% t interval over processes (Welch). Run from the repo root:

    python benchmarks/bench_drill_ratio.py                       # factors 1 1.5 2 4 8, 5 rounds
    python benchmarks/bench_drill_ratio.py --rounds 3 --factors 1 1.5 4
    python benchmarks/bench_drill_ratio.py --device cuda         # on a GPU (docs/benchmarks.md)

Each process runs with one thread (`OMP_NUM_THREADS=1`, `RLK_MATRIX_THREADS=1`) unless
`--threads` says otherwise. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pytest_rlkernel_matrix.judge.performance.factorial import t_quantile  # noqa: E402
from pytest_rlkernel_matrix.judge.performance.phases import phases  # noqa: E402
from pytest_rlkernel_matrix.judge.performance.steady import steady  # noqa: E402
from pytest_rlkernel_matrix.judge.read.logscan import scan_log  # noqa: E402


def one(art: Path, factor: float, args: argparse.Namespace) -> dict[str, float]:
    """One process of the all-R cell with the drill at `factor` (1: none): its steady rollout
    and step locations (seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL", "RLK_REF"))}
    env.update(RL_KERNEL_ARTIFACT_DIR=str(art), RL_KERNEL_ATTENTION_CASE="R/R",
               RL_KERNEL_FFN_CASE="R/R", RL_KERNEL_LOGP_CASE="R/R",
               OMP_NUM_THREADS=str(args.threads), RLK_MATRIX_THREADS=str(args.threads),
               PYTHONPATH=str(REPO))
    if factor != 1.0:
        env["RLK_REF_FAULT"] = f"slow:ffn:rollout:{factor:g}"
    cmd = [sys.executable, "-m", "pytest_rlkernel_matrix.workload", "--preset", args.preset,
           "--device", args.device, "--steps", str(args.steps), *args.extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800,
                          cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-2000:])
    (art / "run.log").write_text(proc.stdout)
    log = scan_log(art / "run.log")
    out = {}
    for phase in ("rollout_wall_time", "step_wall_time"):
        _, spread = phases(log, 1)
        steps = (spread.get(phase) or {}).get("steps") or []
        out[phase] = steady(steps).location
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--factors", type=float, nargs="*", default=[1.0, 1.5, 2.0, 4.0, 8.0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="steps per process (1 warm-up)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("extra", nargs="*", help="more workload arguments (after --)")
    args = parser.parse_args()
    factors = sorted(set([1.0, *args.factors]))
    locs: dict[float, dict[str, list[float]]] = {f: {"rollout_wall_time": [],
                                                     "step_wall_time": []} for f in factors}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rlk-drill-") as tmp:
        for r in range(args.rounds):
            for f in factors:
                got = one(Path(tmp) / f"f{f:g}.r{r}", f, args)
                for k, v in got.items():
                    locs[f][k].append(v)
            print(f"round {r + 1}/{args.rounds} done ({time.time() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
    print(f"preset {args.preset}, device {args.device}, {args.threads} thread(s), "
          f"{args.rounds} processes per factor (interleaved), {args.steps} steps each (1 warm-up)")
    print("| factor | rollout phase s (geo mean) | true rollout ratio [95%] | step ratio [95%] |")
    print("|---|---|---|---|")
    base = locs[1.0]
    for f in factors:
        cells = []
        for phase in ("rollout_wall_time", "step_wall_time"):
            a, b = np.array(locs[f][phase]), np.array(base[phase])
            d = float(a.mean() - b.mean())
            va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
            se = math.sqrt(va + vb)
            df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1)) if se else 1
            half = float(t_quantile(0.975, df)) * se
            cells.append(f"{math.exp(d):.3f} [{math.exp(d - half):.3f}, {math.exp(d + half):.3f}]")
        print(f"| {f:g} | {math.exp(float(np.mean(locs[f]['rollout_wall_time']))):.3f} | "
              f"{cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
