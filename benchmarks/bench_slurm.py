"""The Slurm launcher's own overhead per cell, through a real Slurm (scripts/slurm-local.sh).

    python benchmarks/bench_slurm.py [--sessions 3] [--poll 1.0] [--limit 2.0]

Runs `pytest --rlk-matrix=<matrix>` with `launcher = "slurm"`, `max_concurrent = 1` and the
command `true` over the 10 runs of a pairwise 3-module matrix, `--sessions` times. Per cell it
takes, from the record the session wrote:

- `session_wall_s`: from just before `sbatch` to the moment the session saw the job finished
  and had its details (submit + scheduler dispatch + polling + `scontrol show job`);
- `job_wall_s`: what the batch script itself measured, from its marker (its first line) to after
  the command (this includes the node preflight, which is the job's work, not the session's).

- `item`: the pytest item's call duration (junit XML): waiting for its job, collecting it
  (reading the artifacts, analysis, writing `cell-run.json`).

overhead per cell = item - job_wall_s: everything the item spends that is not the job's own
script. With max_concurrent = 1 the next job is submitted as soon as the previous one is seen
finished, i.e. inside the previous item, so per-cell values shift a little between neighbours;
their mean equals (sum of items - sum of jobs) / cells exactly. Also printed: session_wall_s -
job_wall_s (submit + dispatch + polling alone). Prints the median, quartiles and a bootstrap 95%
interval of the median, and the machine's load; exits 1 if the median is above `--limit`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MATRIX = """[matrix]
name = "slurm-overhead"
layout = "pairwise"
mode = "audit"

[runner]
command = "true"
timeout = 600
launcher = "slurm"

[runner.slurm]
max_concurrent = 1
poll_interval = {poll}

[hardware.cpu]
backend = "cpu"
"""


def _session(matrix: Path, root: Path) -> list[dict[str, float]]:
    junit = root.with_suffix(".xml")
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
         f"--rlk-matrix={matrix}", f"--rlk-matrix-root={root}", "--rlk-hardware=cpu",
         f"--junitxml={junit}"],
        cwd=matrix.parent, capture_output=True, text=True, timeout=1800, check=False)
    import xml.etree.ElementTree as ET

    durations = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        durations[case.get("name", "")] = float(case.get("time", "0"))
    report = json.loads((root / "matrix-report.json").read_text())
    out: list[dict[str, float]] = []
    seen: set[str] = set()
    for cell in report["cells"]:
        sched = cell.get("scheduler") or {}
        if cell["artifact_dir"] in seen or "session_wall_s" not in sched:
            continue
        seen.add(cell["artifact_dir"])
        name = f"{cell['module']}[{cell['case']}]"
        out.append({"session": sched["session_wall_s"], "job": sched["job_wall_s"],
                    "item": durations.get(name, float("nan"))})
    return out


def _median_ci(values: list[float], n: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--limit", type=float, default=2.0)
    args = ap.parse_args()
    from pytest_rlkernel_matrix.run.launchers.slurm import slurm_available

    why = slurm_available()
    if why:
        print(f"no usable Slurm: {why} (start one with scripts/slurm-local.sh start)")
        return 2
    load_before = os.getloadavg()
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="rlk-bench-slurm-") as tmp:
        matrix = Path(tmp) / "matrix.toml"
        matrix.write_text(MATRIX.format(poll=args.poll))
        for i in range(args.sessions):
            rows += _session(matrix, Path(tmp) / f"root{i}")
    load_after = os.getloadavg()
    overhead = [r["session"] - r["job"] for r in rows]
    total = [r["item"] - r["job"] for r in rows if r["item"] == r["item"]]
    q = statistics.quantiles(total, n=4)
    lo, hi = _median_ci(total)
    print(f"cells: {len(rows)} ({args.sessions} sessions x 10 runs), poll_interval {args.poll} s")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} "
          f"({os.cpu_count()} CPUs)")
    print(f"submit+dispatch+poll (session - job): median {statistics.median(overhead):.3f} s, "
          f"min {min(overhead):.3f}, max {max(overhead):.3f}")
    print(f"mean (sum of items - sum of jobs) / cells: {statistics.fmean(total):.3f} s")
    print(f"job script itself (node preflight + command): median "
          f"{statistics.median(r['job'] for r in rows):.3f} s")
    print(f"overhead per cell (item - job): median {statistics.median(total):.3f} s "
          f"(IQR {q[0]:.3f}-{q[2]:.3f}, 95% CI of the median {lo:.3f}-{hi:.3f}), "
          f"limit {args.limit:g} s")
    return 0 if statistics.median(total) <= args.limit else 1


if __name__ == "__main__":
    raise SystemExit(main())
