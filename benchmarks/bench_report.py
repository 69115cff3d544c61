"""Time and memory of `rlk-matrix report` on a synthetic 12-cell matrix root.

    python benchmarks/bench_report.py [--root DIR] [--keep] [--tracemalloc]

Builds `<root>/cpu/<module>-<case>/` for 3 modules x 4 cases: the example CPU run's readbacks,
weight audit, run.log and manifest, a `cell-run.json`, and 2 RL-Kernel mismatch sidecars of 500
samples x 1,000 active fp32 tokens (1,000,000 active tokens per cell). Then runs the CLI's report
command in a child process (per-cell `analyze_run` time, wall time, peak RSS from
`getrusage(RUSAGE_CHILDREN)`); with `--tracemalloc`, again under tracemalloc for the Python/numpy
allocation peak (about 4-5x slower, so not by default).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_report_scale import example_files

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "cpu" / "cpu"
MODULES = ("attention", "ffn", "logp")
CASES = ("R/R", "P/R", "R/P", "P/P")
SIDECARS = 2
SAMPLES = 500
ACTIVE = 1_000
PROMPT_MASKED = 8  # leading response tokens with loss mask 0
TOKENS_PER_CELL = SIDECARS * SAMPLES * ACTIVE


def _slug(module: str, case: str) -> str:
    return f"{module}-{case.replace('/', '').lower()}"


def _cases(module: str, case: str) -> dict[str, str]:
    return {m: case if m == module else "R/R" for m in MODULES}


def _sidecars(out: Path, case: str, seed: int) -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    length = ACTIVE + PROMPT_MASKED
    for rank in range(SIDECARS):
        train, roll, masks = [], [], []
        for _ in range(SAMPLES):
            t = -torch.rand(length, generator=gen) * 5
            r = t.clone() if case == "R/R" else t + 1e-3 * torch.randn(length, generator=gen)
            m = torch.ones(length)
            m[:PROMPT_MASKED] = 0
            train.append(t)
            roll.append(r)
            masks.append(m)
        torch.save({
            "schema": "rlkernel.vime_rocm_attention_mismatch_sidecar.v1", "rank": rank,
            "call_index": 0, "tensor_parallel_size": 1, "context_parallel_size": 1,
            "train_log_probs": train, "rollout_log_probs": roll, "loss_masks": masks,
            "total_lengths": [length + 64] * SAMPLES, "response_lengths": [length] * SAMPLES,
        }, out / f"rank{rank:05d}.call{0:08d}.pt")


def build_root(root: Path) -> None:
    """12 run directories under `root/cpu`, no matrix-report.json (the report globs them)."""
    for i, (module, case) in enumerate((m, c) for m in MODULES for c in CASES):
        slug = _slug(module, case)
        src = EXAMPLE / (slug if (EXAMPLE / slug).exists() else "attention-rr")
        dst = root / "cpu" / slug
        dst.mkdir(parents=True)
        shutil.copytree(src / "weight-audit", dst / "weight-audit")
        example_files(src, dst, module, case)  # readbacks as the workload writes them today
        meta = json.loads((src / "cell-run.json").read_text())
        meta["cell"] = {"hardware": "cpu", "module": module, "case": case,
                        "cases": _cases(module, case)}
        meta["artifact_dir"] = f"cpu/{slug}"
        meta["run_id"] = f"cpu-{slug}-bench"
        (dst / "cell-run.json").write_text(json.dumps(meta, indent=2))
        _sidecars(dst / "mismatch-sidecars", case, seed=i)


def child(root: Path, trace: bool) -> None:
    """Run `rlk-matrix report <root>` in this process; print timings as one JSON line."""
    import tracemalloc

    import pytest_rlkernel_matrix.report.reanalyze as rea
    from pytest_rlkernel_matrix import cli

    import_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    per_cell: list[float] = []
    inner = rea.analyze_run

    def timed(*args: Any, **kwargs: Any) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            per_cell.append(time.perf_counter() - start)

    rea.analyze_run = timed  # type: ignore[assignment]
    if trace:
        tracemalloc.start()
    start = time.perf_counter()
    # the sequential, uncached path (one process, every cell read): per-cell times are taken
    # here, which a process pool would hide; bench_report_scale.py measures the pool and cache
    rc = cli.main(["report", str(root), "--jobs", "1", "--no-cache"])
    wall = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] if trace else None
    print(json.dumps({"rc": rc, "wall_s": wall, "per_cell_s": per_cell,
                      "import_maxrss_kib": import_rss, "tracemalloc_peak_bytes": peak,
                      "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def _run_child(root: Path, trace: bool) -> tuple[dict[str, Any], float]:
    cmd = [sys.executable, __file__, "--child", str(root)] + (["--trace"] if trace else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    total = time.perf_counter() - start
    return json.loads(proc.stdout.strip().splitlines()[-1]), total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None, help="matrix root to build (default: tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic root")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="also run under tracemalloc (Python/numpy allocation peak; slow)")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--build", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.trace)
        return 0
    if args.build:
        build_root(args.build)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return 0
    root = args.root or Path(tempfile.mkdtemp(prefix="rlk-bench-report-")) / "matrix"
    start = time.perf_counter()
    # Built in its own process: a child's ru_maxrss starts at its parent's RSS when it is
    # spawned, so this process stays small (no torch) for the measured child.
    built = subprocess.run([sys.executable, __file__, "--build", str(root)], check=True,
                           capture_output=True, text=True)
    build_rss = int(built.stdout.split()[-1])
    disk = sum(p.stat().st_size for p in root.rglob("*.pt"))
    print(f"built {root}: 12 cells x {TOKENS_PER_CELL:,} active tokens "
          f"({SIDECARS} sidecars x {SAMPLES} samples), {disk / 2**20:.0f} MiB of sidecars, "
          f"{time.perf_counter() - start:.1f}s")
    try:
        res, total = _run_child(root, trace=False)
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux; max of all
        report = json.loads((root / "matrix-report.json").read_text())
        tokens = sum(int(c.get("active_token_count") or 0) for c in report["cells"])
        cells = res["per_cell_s"]
        print(f"rlk-matrix report: rc {res['rc']}, {len(report['cells'])} cells "
              f"{report['summary']}, {tokens:,} active tokens")
        print(f"  wall (report command, in process): {res['wall_s']:.2f}s; "
              f"child process incl. interpreter + imports: {total:.2f}s")
        print(f"  per cell analyze_run: mean {sum(cells) / len(cells):.3f}s, "
              f"min {min(cells):.3f}s, max {max(cells):.3f}s; rest of the report "
              f"(report + HTML write): {res['wall_s'] - sum(cells):.2f}s")
        print(f"  throughput: {tokens / res['wall_s'] / 1e6:.2f} M active tokens/s")
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(f"  peak RSS of the report process: {res['maxrss_kib'] / 1024:.0f} MiB "
              f"({res['import_maxrss_kib'] / 1024:.0f} MiB after the plugin imports, before "
              f"torch); RUSAGE_CHILDREN (max of it and the builder, {build_rss / 1024:.0f} MiB): "
              f"{rss / 1024:.0f} MiB; this parent: {own / 1024:.0f} MiB")
        if args.tracemalloc:
            traced, _ = _run_child(root, trace=True)
            print(f"  tracemalloc peak (Python + numpy allocations; torch tensors are not "
                  f"traced): {traced['tracemalloc_peak_bytes'] / 2**20:.0f} MiB "
                  f"(that run: {traced['wall_s']:.2f}s)")
    finally:
        if not args.keep and args.root is None:
            shutil.rmtree(root.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
