"""All-R vs all-P RL step, side by side in one command (the issue-14 table).

Runs the reference workload once per configuration (a subprocess each, same machine, same
settings), excludes the first step, and prints per configuration the median step, rollout,
training (forward, backward, AdamW) and rollout + training times over the remaining steps,
rollout tokens/s, the step-0 train/rollout
mismatch count over the active tokens, and the rollout's readback ``execution_mode``::

    python benchmarks/step_compare.py --out /tmp/cmp                 # qwen3-0.6b, 448 x 160
    python benchmarks/step_compare.py --out /tmp/cmp --preset tiny --num-prompts 8 \\
        --max-new-tokens 16 --steps 2                                # a CPU smoke run

Configurations: ``R`` (all modules R/R), ``P`` (all P/P), ``P-eager`` (all P/P with the decode
graphs off: the pre-graph P rollout), ``P-native`` (P's decode as vLLM runs it: the native
math of ``workload/kernels/p/native.py`` compiled by Inductor, ``P-compile``, and the decode
attention
over the keys in use, ``P-span``; each alone too), ``R-eager`` (R/R, graphs off), ``P-unfused`` and
``R-sort`` (``RLK_REF_FAST=0``: the sort-based top-p sampler and P's earlier unfused CUDA
paths), ``R-tiledbwd`` (``RLK_REF_R_BACKWARD=tiled``: R's loss forward and backward on the tiled
torch R path, the earlier method; ``R`` runs the loss on the Triton forward with the per-op
backward kernels of ``workload/kernels/r/triton_backward.py``), ``R-recompute``
(``RLK_REF_R_BACKWARD=recompute``: the per-op native torch recompute backward, the method
before). ``--rounds N`` runs the configurations N times interleaved (R, P, R, P, ...: one
process each) and reports the medians over every process's measured steps, each process's own
median, and the ratios' spread between processes. Raw logs stay under --out.

    python benchmarks/step_compare.py --out /tmp/cmp --configs R,P --rounds 2
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "R": ("R/R", {}),
    "P": ("P/P", {}),
    "P-eager": ("P/P", {"RLK_REF_DECODE_GRAPHS": "0"}),
    "R-eager": ("R/R", {"RLK_REF_DECODE_GRAPHS": "0"}),
    # P's decode before issue 24 item 6: eager native math, masked SDPA over the whole cache,
    # the eager sampler passes after the graph (the default since: Inductor-compiled math,
    # Triton grouped decode attention, the sampler's first rounds inside the graph)
    "P-earlier": ("P/P", {"RLK_REF_P_COMPILE": "0", "RLK_REF_P_DECODE_ATTN": "sdpa",
                          "RLK_REF_SAMPLER_COMPILE": "0", "RLK_REF_SAMPLER_IN_GRAPH": "0"}),
    # the default P of 2026-12-01 (flash varlen decode attention, the sampler after the graph)
    "P-flash-outside": ("P/P", {"RLK_REF_P_DECODE_ATTN": "flash",
                                "RLK_REF_SAMPLER_IN_GRAPH": "0"}),
    "R-outside": ("R/R", {"RLK_REF_SAMPLER_IN_GRAPH": "0"}),  # R, the sampler after the graph
    "P-sdpa": ("P/P", {"RLK_REF_P_DECODE_ATTN": "sdpa"}),  # masked SDPA decode attention
    "P-flash": ("P/P", {"RLK_REF_P_DECODE_ATTN": "flash"}),  # flash varlen (Triton since)
    "P-packed": ("P/P", {"RLK_REF_P_DECODE_ATTN": "flash-packed"}),  # heads packed per KV head
    "P-eagermath": ("P/P", {"RLK_REF_P_COMPILE": "0"}),  # native decode math not compiled
    "P-span": ("P/P", {"RLK_REF_P_DECODE_ATTN": "sdpa", "RLK_REF_DECODE_SPAN_UNIT": "32"}),
    "R-eagersampler": ("R/R", {"RLK_REF_SAMPLER_COMPILE": "0"}),  # the sampler's eager passes
    "P-unfused": ("P/P", {"RLK_REF_FAST": "0"}),  # sort-based sampler, unfused P CUDA paths
    "R-sort": ("R/R", {"RLK_REF_FAST": "0"}),  # the sort-based sampler under R
    # the earlier R backward: loss forward + backward on the tiled torch R path
    "R-tiledbwd": ("R/R", {"RLK_REF_R_BACKWARD": "tiled"}),
    "R-recompute": ("R/R", {"RLK_REF_R_BACKWARD": "recompute"}),  # the native recompute backward
}
ROOT = Path(__file__).resolve().parents[1]


def parse_log(text: str) -> dict:
    """Per-step perf dicts and the step-0 mismatch dict from the workload's stdout."""
    steps: dict[int, dict] = {}
    mismatch: dict = {}
    for line in text.splitlines():
        head, _, rest = line.partition(": ")
        if head.startswith("perf "):
            steps.setdefault(int(head.split()[1]), {}).update(ast.literal_eval(rest))
        elif head == "step 0":
            mismatch = ast.literal_eval(rest)
    return {"steps": [steps[k] for k in sorted(steps)], "mismatch": mismatch}


def run_config(name: str, args: argparse.Namespace, out: Path, tag: str = "") -> dict:
    case, extra = CONFIGS[name]
    art = out / (tag or name)
    if art.exists():
        raise SystemExit(f"{art} exists: an artifact directory is never overwritten")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RL_KERNEL_", "RLK_REF_"))}
    env.update(RL_KERNEL_MODE="strict", RL_KERNEL_ARTIFACT_DIR=str(art),
               RL_KERNEL_RUN_ID=tag or name,
               RL_KERNEL_ATTENTION_CASE=case, RL_KERNEL_FFN_CASE=case,
               RL_KERNEL_LOGP_CASE=case, PYTHONPATH=str(ROOT), **extra)
    cmd = [sys.executable, "-m", "pytest_rlkernel_matrix.workload", "--preset", args.preset,
           "--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens),
           "--steps", str(args.steps)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    art.mkdir(parents=True, exist_ok=True)
    (art / "run.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{name}: workload exited {proc.returncode}")
    parsed = parse_log(proc.stdout)
    measured = parsed["steps"][1:] or parsed["steps"]  # first step excluded when there are more
    rb = [json.loads(f.read_text()) for f in (art / "readbacks").glob("*.json")]
    modes = {r["target"]: sorted({op["execution_mode"] for op in r["operators"].values()})
             for r in rb}
    triton = {r["target"]: sorted({op["provenance"]["execution"]["triton_used"]
                                   for op in r["operators"].values()}) for r in rb}
    manifest = json.loads((art / "manifest.json").read_text())
    learning = manifest.get("learning", {})

    def med(key: str) -> float:
        return statistics.median(s[key] for s in measured)

    def spread(key: str) -> list[float]:
        vals = [s[key] for s in measured]
        return [min(vals), max(vals)]

    mm = parsed["mismatch"]
    gbs = args.num_prompts  # vime's step records are per-sample means over the global batch

    def total(key: str) -> int | None:
        return None if key not in mm else round(mm[key] * gbs)
    return {
        "config": name, "process": tag or name, "case": case, "wall_s": round(wall, 1),
        "measured_steps": len(measured),
        "phases_s": statistics.median(s["perf/rollout_time"] + s["perf/train_time"]
                                      for s in measured),
        "samples": {k: [s[k] for s in measured] for k in (
            "perf/step_time", "perf/rollout_time", "perf/train_time")},
        "step_s": med("perf/step_time"), "step_range_s": spread("perf/step_time"),
        "rollout_s": med("perf/rollout_time"), "rollout_range_s": spread("perf/rollout_time"),
        "train_s": med("perf/train_time"), "train_range_s": spread("perf/train_time"),
        "rollout_tokens_per_s": med("perf/tokens_per_gpu_per_sec"),
        "peak_memory_gib": max(s["perf/peak_memory_bytes"] for s in measured) / 2**30,
        "mismatch_count": total("train/train_current_rollout_logprob_mismatch_count"),
        "active_tokens": total("train/train_current_rollout_logprob_numel"),
        "max_abs_diff": mm.get("train/train_current_rollout_logprob_max_abs_diff"),
        "execution_mode": modes, "triton_used": triton,
        "backward_method": learning.get("backward_method"),
        "first_step_s": parsed["steps"][0].get("perf/step_time") if parsed["steps"] else None,
        "p_decode": manifest.get("rollout_p_decode"),
        "sampler": manifest.get("rollout_sampler"),
    }


def _pool(procs: list[dict]) -> dict:
    """One configuration over its processes: medians over every measured step of every
    process; the mismatch count and the rest from the first process."""
    if len(procs) == 1:
        return procs[0]
    out = dict(procs[0])
    keys = {"step_s": "perf/step_time", "rollout_s": "perf/rollout_time",
            "train_s": "perf/train_time"}
    for k, src in keys.items():
        vals = [v for p in procs for v in p["samples"][src]]
        out[k] = statistics.median(vals)
        out[k.replace("_s", "_range_s")] = [min(vals), max(vals)]
    out["phases_s"] = statistics.median(
        r + t for p in procs for r, t in zip(p["samples"]["perf/rollout_time"],
                                             p["samples"]["perf/train_time"], strict=True))
    out["rollout_tokens_per_s"] = statistics.median(p["rollout_tokens_per_s"] for p in procs)
    out["process_medians"] = {p["process"]: {k: p[k] for k in (*keys, "phases_s")}
                              for p in procs}
    out["mismatch_counts"] = [p["mismatch_count"] for p in procs]
    return out


def _ratio_spread(procs: list[dict], a: str, b: str, key: str) -> tuple[float, float]:
    """The smallest and largest ratio of a process of ``a`` over one of ``b`` (per-process
    medians): the spread between processes."""
    xs = [p[key] for p in procs if p["config"] == a]
    ys = [p[key] for p in procs if p["config"] == b]
    return min(xs) / max(ys), max(xs) / min(ys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=448)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--configs", default="R,P,P-eager")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved processes per config")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        raise SystemExit(f"--configs: unknown {bad}; choose from {sorted(CONFIGS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rnd in range(args.rounds):
        for name in names:
            procs.append(run_config(name, args, args.out,
                                    f"{name}-r{rnd + 1}" if args.rounds > 1 else ""))
            print(json.dumps(procs[-1]), flush=True)
    rows = [_pool([p for p in procs if p["config"] == n]) for n in names]
    (args.out / "summary.json").write_text(json.dumps({"configs": rows, "processes": procs},
                                                      indent=2))
    by = {r["config"]: r for r in rows}
    print(f"\n{args.preset}, {args.num_prompts} prompts x {args.max_new_tokens} new tokens, "
          f"{args.steps} steps, first excluded (median [min, max] of the rest):")
    print("| config | step s | rollout s | training s | rollout + training s | rollout tok/s | "
          "mismatches / active tokens | rollout execution_mode |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['config']} ({r['case']}) | {r['step_s']:.3f} {r['step_range_s']} | "
              f"{r['rollout_s']:.3f} | {r['train_s']:.3f} | {r['phases_s']:.3f} | "
              f"{r['rollout_tokens_per_s']:.0f} | {r['mismatch_count']} / {r['active_tokens']} | "
              f"{r['execution_mode'].get('rollout')} |")
    if args.rounds > 1:
        print("\nper process (median of its measured steps):")
        for p in procs:
            print(f"  {p['process']}: step {p['step_s']:.3f}  rollout {p['rollout_s']:.3f}  "
                  f"training {p['train_s']:.3f}  rollout + training {p['phases_s']:.3f}")
    for r_name in ("R", "R-tiledbwd", "R-recompute"):
        if r_name in by and "P" in by:
            for key in ("step_s", "rollout_s", "train_s", "phases_s"):
                lo, hi = _ratio_spread(procs, r_name, "P", key)
                print(f"{r_name}/P {key}: {by[r_name][key] / by['P'][key]:.2f}x "
                      f"(between processes [{lo:.2f}, {hi:.2f}])")
    if "R" in by and "R-tiledbwd" in by:
        print(f"R-tiledbwd / R train_s: {by['R-tiledbwd']['train_s'] / by['R']['train_s']:.2f}x "
              f"(backward_method {by['R-tiledbwd']['backward_method']} vs "
              f"{by['R']['backward_method']})")
    if "P" in by and "P-eager" in by:
        print(f"P graphs / P eager rollout tokens/s: "
              f"{by['P']['rollout_tokens_per_s'] / by['P-eager']['rollout_tokens_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
