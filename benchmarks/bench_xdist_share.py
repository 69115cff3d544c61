"""`pytest -n 2` against serial `pytest` on the default matrix, side by side.

    python benchmarks/bench_xdist_share.py [--rounds 1] [--workers 2] [--keep-threads]
                                           [-- <pytest args>]

Runs a fresh `pytest -p no:cacheprovider --rlk-matrix-root=<new root>` at the repo root, serial
and with `-n <workers>`, interleaved (serial, parallel, serial, parallel, ...), and prints each
run's wall time with the load average before and after it, its verdict counts, and the ratio
parallel / serial (of the summed wall times): below 1 means `-n` is faster. The CPU share
(`pytest_rlkernel_matrix.run.cpushare`) is what is measured: the cells get disjoint CPU slices and
`OMP_NUM_THREADS` = their share, so the thread variables are removed from the environment unless
`--keep-threads` (then a value you set wins, as in any session). Extra pytest arguments after
`--` (e.g. `-- -k attention` on a loaded box) go to both; `--quick` shrinks the workload per step
as `perf_agreement.py --quick` does (say so when quoting it). Exit 0 unless a run wrote no report.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run_once(label: str, root: Path, extra: list[str], keep_threads: bool,
             matrix: Path | None = None) -> dict[str, Any]:
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
            *([f"--rlk-matrix={matrix}"] if matrix else []), f"--rlk-matrix-root={root}", "-q",
            *extra]
    env = {k: v for k, v in os.environ.items()
           if k != "PYTEST_ADDOPTS" and (keep_threads or k not in THREAD_VARS)}
    load0, t0 = _load(), time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    path = root / "matrix-report.json"
    if not path.exists():
        raise SystemExit(f"{label}: no {path} (exit {proc.returncode})\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    cells = json.loads(path.read_text())["cells"]
    shares = sorted({json.dumps((c.get("cpu_share") or {}).get("cpus")) for c in cells})
    threads = sorted({str((c.get("cpu_share") or {}).get("threads")) for c in cells})
    return {"label": label, "argv": argv, "exit": proc.returncode, "wall": wall,
            "load_before": load0, "load_after": _load(),
            "verdicts": dict(Counter(c["verdict"] for c in cells)),
            "cpus": ", ".join(shares), "threads": ", ".join(threads)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1, help="serial+parallel pairs (interleaved)")
    ap.add_argument("--workers", type=int, default=2, help="-n for the parallel runs")
    ap.add_argument("--keep-threads", action="store_true",
                    help="keep OMP_NUM_THREADS / MKL_NUM_THREADS from the environment")
    ap.add_argument("--parallel-first", action="store_true",
                    help="start each round with the -n run (the load may drift during a round)")
    ap.add_argument("--quick", action="store_true", help="smaller workload per step")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="rlk-xdist-share-"))
    matrix = None
    if args.quick:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from perf_agreement import _matrix_file

        matrix = _matrix_file(True, work)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        pair = [("serial", work / f"serial{r}", args.pytest_args),
                (f"-n {args.workers}", work / f"parallel{r}",
                 ["-n", str(args.workers), *args.pytest_args])]
        for label, root, extra in (pair[::-1] if args.parallel_first else pair):
            runs.append(run_once(label, root, extra, args.keep_threads, matrix))
    print(f"bench_xdist_share: default matrix, serial vs -n {args.workers}, {args.rounds} "
          f"round(s) interleaved, {len(os.sched_getaffinity(0))} CPU(s) in the affinity mask"
          + ("" if args.keep_threads else ", thread variables removed")
          + (", --quick workload" if args.quick else ""))
    serial_argv = next(x["argv"] for x in runs if x["label"] == "serial")
    print(f"command: {shlex.join(serial_argv[2:])} [-n {args.workers}]\n")
    print("| run | exit | wall s | load before | load after | verdicts | cell CPUs | threads |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for x in runs:
        print(f"| {x['label']} | {x['exit']} | {x['wall']:.1f} | {x['load_before']} | "
              f"{x['load_after']} | {x['verdicts']} | {x['cpus']} | {x['threads']} |")
    serial = sum(x["wall"] for x in runs if x["label"] == "serial")
    parallel = sum(x["wall"] for x in runs if x["label"] != "serial")
    print(f"\nratio -n {args.workers} / serial (wall time): {parallel / serial:.2f} "
          f"({parallel:.1f} s / {serial:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
