"""Run the default matrix several times and check that performance conclusions never contradict.

    python benchmarks/perf_agreement.py [--runs 3] [--quick] [--threads N] [-- <pytest args>]

Each run is a fresh `pytest` at the repo root (the default `matrix.toml`, its own matrix root).
From each `matrix-report.json` it takes every attribution time ratio (`timing` entries: e.g.
"training time R/R / P/R" of each module) and its conclusion: `slower`, `faster` or withheld
(`no conclusion: noise`, with the reasons). Runs *agree* when no ratio is `slower` in one run and
`faster` in another; a withheld conclusion never contradicts. Prints a markdown report (for
docs/benchmarks.md) and exits 1 on a contradiction.

`--quick` runs the same matrix with a smaller workload per step (4 prompts, <= 40 new tokens)
so that three runs fit on a loaded 2-core machine; say so when quoting its output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
QUICK_ARGS = " --num-prompts 4 --max-new-tokens 40 --micro-batch-size 3"


def _matrix_file(quick: bool, workdir: Path) -> Path:
    path = REPO / "matrix.toml"
    if not quick:
        return path
    text = path.read_text()
    command = re.search(r"^command = '(.*)'$", text, re.MULTILINE)
    if command is None:
        raise SystemExit(f"{path}: no single-quoted [runner] command to shrink for --quick")
    text = text.replace(command.group(0), f"command = '{command.group(1)}{QUICK_ARGS}'")
    out = workdir / "matrix.toml"
    out.write_text(text)
    return out


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run_once(i: int, matrix: Path, workdir: Path, extra: list[str],
             threads: int | None) -> dict[str, Any]:
    root = workdir / f"run{i}"
    argv = [sys.executable, "-m", "pytest", f"--rlk-matrix={matrix}", f"--rlk-matrix-root={root}",
            "-p", "no:cacheprovider", "-q", *extra]
    load0 = _loadavg()
    t0 = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False, env=env)
    wall = time.monotonic() - t0
    report_path = root / "matrix-report.json"
    if not report_path.exists():
        raise SystemExit(f"run {i}: no {report_path} (exit {proc.returncode})\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    report = json.loads(report_path.read_text())
    return {"i": i, "argv": argv, "exit": proc.returncode, "wall": wall, "load_before": load0,
            "load_after": _loadavg(), "report": report}


def conclusions(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for entry in report.get("attribution", []):
        for r in entry.get("timing", []):
            out[f"{entry['hardware']} {entry['module']}: {r['label']}"] = r
    return out


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    if r["ratio"] is None:
        return "withheld (no figures)"
    ci = "" if r["low"] is None else f" [{r['low']:.2f}, {r['high']:.2f}]"
    word = r["conclusion"] if r["conclusion"] in ("slower", "faster") else "withheld"
    return f"{r['ratio']:.2f}{ci} {word}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smaller workload per step")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS for the cells (default: torch's choice)")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    ap.add_argument("--reuse", type=Path, default=None,
                    help="analyse the run*/matrix-report.json of an earlier work directory")
    args = ap.parse_args(argv)
    if args.reuse is not None:
        runs = [{"i": i + 1, "argv": ["", "", f"(reused {p.parent})"], "exit": "?",
                 "wall": float("nan"), "load_before": "?", "load_after": "?",
                 "report": json.loads(p.read_text())}
                for i, p in enumerate(sorted(args.reuse.glob("run*/matrix-report.json")))]
    else:
        workdir = Path(tempfile.mkdtemp(prefix="rlk-perf-agreement-"))
        matrix = _matrix_file(args.quick, workdir)
        runs = [run_once(i + 1, matrix, workdir, args.pytest_args, args.threads)
                for i in range(args.runs)]

    lines = [f"perf_agreement: {len(runs)} runs of the default matrix"
             + (" (--quick workload)" if args.quick else "")
             + (f", OMP_NUM_THREADS={args.threads}" if args.threads else "")
             + f" on {os.cpu_count()} CPUs",
             f"command: {shlex.join(runs[0]['argv'][2:])}", "",
             "| run | exit | wall s | load before | load after | verdicts | usable timings |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        cells = r["report"]["cells"]
        usable = sum(1 for c in cells if c.get("performance_usable"))
        lines.append(f"| {r['i']} | {r['exit']} | {r['wall']:.0f} | {r['load_before']} | "
                     f"{r['load_after']} | {r['report']['summary']} | {usable}/{len(cells)} |")
    per_run = [conclusions(r["report"]) for r in runs]
    keys = sorted({k for c in per_run for k in c})
    lines += ["", "| ratio | " + " | ".join(f"run {r['i']}" for r in runs) + " | agreement |",
              "| --- | " + " | ".join("---" for _ in runs) + " | --- |"]
    contradictions = naive_contradictions = 0
    for key in keys:
        naive = {("slower" if g["low"] > 1 else "faster") for c in per_run
                 if (g := c.get(key)) and g["low"] is not None
                 and (g["low"] > 1 or g["high"] < 1)}
        naive_contradictions += len(naive) > 1
        got = [c.get(key) for c in per_run]
        words = {g["conclusion"] for g in got if g and g["conclusion"] in ("slower", "faster")}
        state = "CONTRADICTION" if len(words) > 1 else (
            f"agree: {words.pop()}" if words else "withheld")
        contradictions += state == "CONTRADICTION"
        lines.append(f"| {key} | " + " | ".join(_cell(g) for g in got) + f" | {state} |")
    reasons: dict[str, int] = {}
    for c in per_run:
        for r in c.values():
            for why in r["reasons"]:
                short = re.sub(r"\d+(\.\d+)?", "N", why)[:110]
                reasons[short] = reasons.get(short, 0) + 1
    lines += ["", "withheld because (count over runs and ratios):"]
    lines += [f"- {n} x {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:8]]
    lines += ["", f"contradictions: {contradictions}; drift summaries identical across runs: "
              f"{len({json.dumps(r['report']['summary']) for r in runs}) == 1}",
              "contradictions had the interval alone decided (contamination and spread ignored): "
              f"{naive_contradictions}"]
    print("\n".join(lines))
    return 1 if contradictions else 0


if __name__ == "__main__":
    sys.exit(main())
