"""All-R against all-P at the lengths RL generates (issue 46): per phase, per length, side by side.

For each length (new tokens) the reference workload runs as a subprocess per side, all-R (every
module R/R) and all-P (every module P/P), ``--rounds`` times interleaved (R, P, R, P, ...: one
process each), ``--steps`` steps per process with the first excluded, the prompt count and the
micro-batch of each length as the issue's table has them (``--micro-batch-size`` left to the
job: ``workload/training/budget.py`` chooses it by tokens and memory; ``--mb`` forces one). It
prints the
issue's table: the all-R / all-P step, rollout (and both sides' rollout tokens/s) and training
ratios (medians over every measured step of every process; in brackets the smallest and largest
ratio of one process's median over another's), each side's peak memory, and the R/R
train/rollout mismatching tokens over the active tokens. Raw logs and a ``summary.json`` stay
under ``--out``; an existing directory is never overwritten.

On one H200 (the issue's sizes, qwen3-0.6b)::

    python benchmarks/bench_lengths.py --out /tmp/lengths --rounds 2 --steps 3

On a CPU (a small version: tiny preset, short lengths, the torch R path)::

    python benchmarks/bench_lengths.py --out /tmp/lengths-cpu --cpu

No timed assertion anywhere: the ratios are printed, targets (<= 1.10 at every length) are read
off the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_compare import parse_log  # benchmarks/ is not a package: the path above

ROOT = Path(__file__).resolve().parents[1]
# new tokens -> prompts (the table: 448 x 160, 128 x 1,024, 32 x 4,096)
GPU_LENGTHS = {160: 448, 1024: 128, 4096: 32}
CPU_LENGTHS = {16: 8, 64: 8, 256: 4}
SIDES = {"R": "R/R", "P": "P/P"}


def run_side(side: str, new: int, prompts: int, args: argparse.Namespace, out: Path) -> dict:
    art = out / f"{new}-{side}"
    if art.exists():
        raise SystemExit(f"{art} exists: an artifact directory is never overwritten")
    case = SIDES[side[0]]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL_", "RLK_REF_"))}
    env.update(RL_KERNEL_MODE="strict", RL_KERNEL_ARTIFACT_DIR=str(art),
               RL_KERNEL_RUN_ID=art.name, RL_KERNEL_ATTENTION_CASE=case,
               RL_KERNEL_FFN_CASE=case, RL_KERNEL_LOGP_CASE=case, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "pytest_rlkernel_matrix.workload", "--preset", args.preset,
           "--num-prompts", str(prompts), "--max-new-tokens", str(new),
           "--steps", str(args.steps), "--device", args.device]
    if args.mb:
        cmd += ["--micro-batch-size", str(args.mb)]
    if args.ignore_eos:
        cmd.append("--ignore-eos")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    art.mkdir(parents=True, exist_ok=True)
    (art / "run.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
        return {"side": side[0], "process": art.name, "new": new, "error": proc.returncode,
                "stderr": proc.stderr[-500:]}
    parsed = parse_log(proc.stdout)
    measured = parsed["steps"][1:] or parsed["steps"]
    manifest = json.loads((art / "manifest.json").read_text())
    mm = parsed["mismatch"]
    return {
        "side": side[0], "process": art.name, "new": new, "prompts": prompts,
        "wall_s": round(wall, 1), "micro_batch": manifest.get("micro_batch"),
        "step": [s["perf/step_time"] for s in measured],
        "rollout": [s["perf/rollout_time"] for s in measured],
        "train": [s["perf/train_time"] for s in measured],
        "rollout_tok_s": [s["perf/tokens_per_gpu_per_sec"] for s in measured],
        "peak_gib": max(s["perf/peak_memory_bytes"] for s in parsed["steps"]) / 2 ** 30,
        "mismatches": round(mm.get("train/train_current_rollout_logprob_mismatch_count", 0)
                            * prompts),
        "active": round(mm.get("train/train_current_rollout_logprob_numel", 0) * prompts),
    }


def ratio(procs: list[dict], key: str) -> tuple[float, float, float]:
    """Median R / median P over every measured step, and the spread of per-process medians."""
    r = [p for p in procs if p["side"] == "R"]
    q = [p for p in procs if p["side"] == "P"]
    med = statistics.median(v for p in r for v in p[key]) / statistics.median(
        v for p in q for v in p[key])
    rm = [statistics.median(p[key]) for p in r]
    pm = [statistics.median(p[key]) for p in q]
    return med, min(rm) / max(pm), max(rm) / min(pm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cpu", action="store_true", help="the small CPU version (tiny preset)")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--lengths", default=None,
                    help="new-token lengths and prompts, e.g. 160:448,1024:128,4096:32")
    ap.add_argument("--steps", type=int, default=3, help="per process; the first is excluded")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved processes per side")
    ap.add_argument("--mb", type=int, default=0, help="force a micro-batch (default: the job's)")
    ap.add_argument("--ignore-eos", action="store_true", help="every sample its drawn length")
    args = ap.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.cpu else "qwen3-0.6b")
    args.device = args.device or ("cpu" if args.cpu else "cuda")
    lengths = (dict((int(a), int(b)) for a, b in (x.split(":") for x in args.lengths.split(",")))
               if args.lengths else CPU_LENGTHS if args.cpu else GPU_LENGTHS)
    args.out.mkdir(parents=True, exist_ok=True)
    procs: list[dict] = []
    for new, prompts in lengths.items():
        for rnd in range(args.rounds):
            for side in ("R", "P"):
                procs.append(run_side(f"{side}{rnd + 1}", new, prompts, args, args.out))
                print(json.dumps({k: v for k, v in procs[-1].items()
                                  if k not in ("step", "rollout", "train", "rollout_tok_s")}),
                      flush=True)
    (args.out / "summary.json").write_text(json.dumps(procs, indent=2))
    print(f"\n{args.preset} on {args.device}, {args.rounds} processes per side interleaved, "
          f"{args.steps} steps each, the first excluded; R / P medians [per-process spread]")
    print("| new tokens (prompts, micro-batch) | all-R / all-P step | rollout (R vs P tokens/s) "
          "| training | peak memory R / P GiB | R/R mismatching / active tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for new, prompts in lengths.items():
        group = [p for p in procs if p["new"] == new]
        failed = [p for p in group if "error" in p]
        if failed:
            print(f"| {new} ({prompts}) | failed: " + "; ".join(
                f"{p['process']} exit {p['error']}" for p in failed) + " | | | | |")
            continue
        mb = group[0]["micro_batch"] or {}
        cells = []
        for key in ("step", "rollout", "train"):
            m, lo, hi = ratio(group, key)
            cells.append(f"{m:.2f} [{lo:.2f}, {hi:.2f}]")
        tok = {s: statistics.median(v for p in group if p["side"] == s
                                    for v in p["rollout_tok_s"]) for s in "RP"}
        peak = {s: max(p["peak_gib"] for p in group if p["side"] == s) for s in "RP"}
        rr = [p for p in group if p["side"] == "R"]
        print(f"| {new} ({prompts}, {mb.get('size')} by {mb.get('chosen_by')}) | {cells[0]} | "
              f"{cells[1]} ({tok['R']:,.0f} vs {tok['P']:,.0f}) | {cells[2]} | "
              f"{peak['R']:.1f} / {peak['P']:.1f} | "
              f"{sum(p['mismatches'] for p in rr)} / {sum(p['active'] for p in rr)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
