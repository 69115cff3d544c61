"""`rlk-matrix report` at the scale of RL-Kernel's 200-step runs: cold, warm, one changed cell.

    python benchmarks/bench_report_scale.py [--scale 1.0] [--root DIR] [--keep] [--jobs N]
    python benchmarks/bench_report_scale.py --vary --samples 16 --calls 100    # issue 35's root
    python benchmarks/bench_report_scale.py --root DIR --reuse --baseline OLD   # side by side

Builds `<root>/cpu/<module>-<case>/` for 3 modules x 4 cases laid out as RL-Kernel writes a
run with tp 2 x cp 2 (4 ranks, one data-parallel group): per rank and call one sidecar
`mismatch-sidecars/rank{rank:05d}.call{call:08d}.pt` (`schema_version` v1, 8 samples of a
2,560-token response, 2,500 of it under the loss mask; values CP-sliced zigzag, the full loss
mask stored; TP replicas equal), 200 calls per rank at `--scale 1` (800 sidecars, 4,000,000
active tokens per cell), one weight audit per version (`weight-audit/<version>.json` and
`weight-audit/rollout/<version>.json`, 64 tensors each), and the example CPU run's readbacks,
run.log, manifest and cell-run.json (its run id kept).
The readbacks get the `installed_hooks` the reference workload writes today (one entry per
module in `operators`; the example run predates that rule), so every cell reads `valid`: the
report walks the whole judge path. `--scale` multiplies the calls (0.05: 10 calls per rank).

Then, each in its own child process (peak RSS = the child's `ru_maxrss` and its pool workers'),
side by side: the sequential path without cache (`--no-cache --jobs 1`), a cold report (no
cache), a warm re-report (nothing changed) and a re-report after one cell's sidecar was
touched. Prints wall time, active tokens/s over the whole root, peak RSS and whether torch or
numpy was imported for each; with `--baseline OLD`, the same four runs of another version's
package first (`PYTHONPATH=OLD`), and the ratios of this checkout's walls to it.

`--vary`: RL-Kernel's real shape instead, every sample of every call its own prompt and
response length (500-2,500 response tokens), masked spans, run.log's steps and manifest.json's
batch written to agree with the sidecars (`_cell`, `_steps`); the seeds are fixed. After the
reports, every sidecar of the root is read in a fresh process by `torch.load(path,
weights_only=True)` and by `judge.read.ptread` (twice each, alternating), and the ratio printed;
`--profile` adds a sequential report under cProfile (where the time goes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "cpu" / "cpu"
MODULES = ("attention", "ffn", "logp")
CASES = ("R/R", "P/R", "R/P", "P/P")
TP, CP = 2, 2
CALLS = 200
SAMPLES = 8
RESPONSE = 2_560
MASKED = 60  # leading response tokens with loss mask 0
PROMPT = 512
AUDIT_TENSORS = 64
SCHEMA = "rlkernel.vime_rocm_attention_mismatch_sidecar.v1"


def _slug(module: str, case: str) -> str:
    return f"{module}-{case.replace('/', '').lower()}"


def _zigzag(total: int, response: int, cp_rank: int) -> Any:
    """The response offsets CP rank `cp_rank` stores, in order (RL-Kernel's zigzag at logit
    positions: chunks r and 2cp-1-r of ceil(total / 2cp), clipped to the response's logits)."""
    import numpy as np

    base, chunk = total - response - 1, -(-total // (2 * CP))
    pieces = [np.arange(max(c * chunk, base) - base, min((c + 1) * chunk, total - 1) - base)
              for c in (cp_rank, 2 * CP - 1 - cp_rank)]
    return np.concatenate([p for p in pieces if p.size])


def _audit(version: str, scope: str, seed: int) -> dict[str, Any]:
    import hashlib

    tensors = {f"model.layers.{i // 8}.w{i % 8}": {
        "sha256": hashlib.sha256(f"{seed}.{version}.{i}".encode()).hexdigest(),
        "shape": [256, 256], "dtype": "torch.bfloat16"} for i in range(AUDIT_TENSORS)}
    digest = hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest()
    return {"version": version, "scope": scope, "sha256": digest,
            "tensor_count": len(tensors), "tensors": tensors}


def _cell(dst: Path, module: str, case: str, seed: int, calls: int, vary: bool = False,
          samples: int = SAMPLES) -> list[int]:
    """One run directory's sidecars and weight audits. ``vary``: RL-Kernel's real shape, every
    sample of every call its own prompt (100-1,000 tokens) and response (500-2,500 tokens)
    length, and its loss mask zero on the first tokens and on one to three other spans (tool
    outputs, truncations); else `RESPONSE` tokens everywhere, the first `MASKED` masked."""
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    side = dst / "mismatch-sidecars"
    side.mkdir(parents=True)
    (dst / "weight-audit" / "rollout").mkdir(parents=True, exist_ok=True)
    actives = []
    for call in range(calls):
        active = 0
        if vary:
            responses = rng.integers(500, 2_501, samples).tolist()
            prompts = rng.integers(100, 1_001, samples).tolist()
        else:
            responses, prompts = [RESPONSE] * samples, [PROMPT] * samples
        full_t = [-torch.rand(n, generator=gen) * 5 for n in responses]
        full_r = [t.clone() if case == "R/R" else t + 1e-3 * torch.randn(t.numel(), generator=gen)
                  for t in full_t]
        masks = []
        for n in responses:
            mask = torch.ones(n)
            mask[:MASKED] = 0
            if vary:
                for _ in range(int(rng.integers(1, 4))):
                    lo = int(rng.integers(MASKED, n - 10))
                    mask[lo:lo + int(rng.integers(5, max(6, n // 8)))] = 0
            masks.append(mask)
            active += int(mask.sum())
        totals = [p + n for p, n in zip(prompts, responses, strict=True)]
        keeps = [[torch.from_numpy(_zigzag(tot, n, r)) for tot, n in zip(totals, responses,
                                                                         strict=True)]
                 for r in range(CP)]
        for rank in range(TP * CP):
            keep = keeps[(rank // TP) % CP]
            torch.save({
                "schema_version": SCHEMA, "rank": rank, "call_index": call,
                "tensor_parallel_size": TP, "context_parallel_size": CP,
                "train_log_probs": [t[k].clone() for t, k in zip(full_t, keep, strict=True)],
                "rollout_log_probs": [r[k].clone() for r, k in zip(full_r, keep, strict=True)],
                "loss_masks": [m.clone() for m in masks],  # the full mask (RL-Kernel)
                "total_lengths": totals, "response_lengths": responses,
            }, side / f"rank{rank:05d}.call{call:08d}.pt")
        version = str(call)
        train = _audit(version, "all_exported_parameters", seed)
        (dst / "weight-audit" / f"{version}.json").write_text(json.dumps(train))
        roll = dict(train, scope="rollout_loaded_parameters")
        (dst / "weight-audit" / "rollout" / f"{version}.json").write_text(json.dumps(roll))
        actives.append(active)
    return actives


_NUMBERED = re.compile(r"^(rollout|step|perf) (\d+): ")


def _steps(dst: Path, actives: list[int], samples: int) -> None:
    """run.log's `rollout/step/perf N` records and manifest.json's batch as the sidecars make
    them (one step per call, the example's records repeated): each step's per-sample
    `train_current_rollout_logprob_numel` x `global_batch_size` is that call's active tokens,
    `num_rollout` x `global_batch_size` the samples (the cross-checks RL-Kernel's validator
    makes: `judge/route/crosscheck.py`)."""
    lines = (dst / "run.log").read_text().splitlines()
    head = [ln for ln in lines if not _NUMBERED.match(ln)]
    by_step: dict[int, list[str]] = {}
    for ln in lines:
        if (m := _NUMBERED.match(ln)):
            by_step.setdefault(int(m.group(2)), []).append(ln)
    out = list(head)
    for call, active in enumerate(actives):
        for ln in by_step[call % len(by_step)]:
            ln = _NUMBERED.sub(lambda m, c=call: f"{m.group(1)} {c}: ", ln)
            if ln.startswith("step "):
                ln = re.sub(r"('train/train_current_rollout_logprob_numel': )[0-9.e+-]+",
                            lambda m, a=active: f"{m.group(1)}{a / samples!r}", ln)
            out.append(ln)
    (dst / "run.log").write_text("\n".join(out) + "\n")
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["num_rollout"] = len(actives)
    manifest["batching"]["global_batch_size"] = samples
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _readbacks(src: Path, dst: Path) -> None:
    """The example run's readbacks, as the reference workload writes them today
    (`workload.upstream.readback`): an `installed_hooks` entry for every module the process
    hooked, production ones too, except the native (production) training logp, which runs
    outside RL-Kernel and so has neither a hook nor a record. The example run predates both
    rules, which the judge enforces (`P route unproven`, `production logp unexpectedly entered
    provider readback`); nothing else is changed."""
    dst.mkdir(parents=True)
    for path in sorted(src.glob("*.json")):
        data = json.loads(path.read_text())
        ops = data.get("operators") or {}
        if data.get("target") == "training" and (ops.get("logp") or {}).get(
                "implementation") == "production":
            ops.pop("logp")
        data["installed_hooks"] = {m: f"pytest_rlkernel_matrix.workload.kernels.{m}" for m in ops}
        (dst / path.name).write_text(json.dumps(data, indent=2, sort_keys=True))


def example_files(src: Path, dst: Path, module: str, case: str) -> None:
    """The example run's readbacks (`_readbacks`), run.log, manifest, exit code and env file,
    with vime's marker for a native training logp in run.log (the example run predates it)."""
    _readbacks(src / "readbacks", dst / "readbacks")
    for name in ("run.log", "manifest.json", "exit-code", "matrix-case.env"):
        shutil.copy2(src / name, dst / name)
    if module == "logp" and case.startswith("P"):
        with (dst / "run.log").open("a") as log:
            log.write(f"rlkernel mismatch sidecar active: logp_case={case}\n")


def build_root(root: Path, scale: float, vary: bool = False, samples: int = SAMPLES,
               calls_per_rank: int = CALLS) -> int:
    """12 run directories under `root/cpu` (no matrix-report.json: the report globs them)."""
    calls = max(1, round(calls_per_rank * scale))
    active = 0
    for i, (module, case) in enumerate((m, c) for m in MODULES for c in CASES):
        slug = _slug(module, case)
        src = EXAMPLE / (slug if (EXAMPLE / slug).exists() else "attention-rr")
        dst = root / "cpu" / slug
        dst.mkdir(parents=True)
        example_files(src, dst, module, case)
        meta = json.loads((src / "cell-run.json").read_text())
        meta["cell"] = {"hardware": "cpu", "module": module, "case": case,
                        "cases": {m: case if m == module else "R/R" for m in MODULES}}
        meta["artifact_dir"] = f"cpu/{slug}"
        # the run id stays the copied run's: its manifest and readbacks name it
        (dst / "cell-run.json").write_text(json.dumps(meta, indent=2))
        actives = _cell(dst, module, case, seed=i, calls=calls, vary=vary, samples=samples)
        _steps(dst, actives, samples)
        active += sum(actives)
    return active


def measure(root: Path, args: list[str]) -> None:
    """Child: `rlk-matrix report <root> <args>` in this process; one JSON line of figures."""
    from pytest_rlkernel_matrix import cli

    start = time.perf_counter()
    rc = cli.main(["report", str(root), *args])
    wall = time.perf_counter() - start
    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    own, workers = me.ru_maxrss, kids.ru_maxrss
    cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    print(json.dumps({"rc": rc, "wall_s": wall, "cpu_s": cpu, "maxrss_kib": own,
                      "worker_maxrss_kib": workers, "package": str(Path(cli.__file__).parent),
                      "heavy_modules": sorted(m for m in ("torch", "numpy") if m in sys.modules)}))


def read_all(root: Path, reader: str) -> None:
    """Child: every sidecar under `root` read in this fresh process, by `torch.load(path,
    weights_only=True)` (what upstream's validator does) or by `judge.read.ptread` (the bytes
    through
    `store.safeio`, then `load_arrays`, what the analysis does; torch.load where it declines);
    torch or numpy imported inside the timing. One JSON line of figures."""
    start, cpu0 = time.perf_counter(), time.process_time()
    files = sorted(root.rglob("mismatch-sidecars/*.pt"))
    if reader == "torch.load":
        import torch

        for path in files:
            torch.load(path, map_location="cpu", weights_only=True)
        declined = 0
    else:
        from pytest_rlkernel_matrix.judge.read import ptread
        from pytest_rlkernel_matrix.store.safeio import read_bytes

        declined = sum(ptread.load_arrays(read_bytes(path, root, 2**31), path.name) is None
                       for path in files)
    print(json.dumps({"wall_s": time.perf_counter() - start,
                      "cpu_s": time.process_time() - cpu0, "files": len(files),
                      "declined": declined,
                      "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))


def profile(root: Path) -> None:
    """Child: a sequential report without cache under cProfile; the top of it, by own time and
    by cumulative time, as one JSON line ({"text": ...})."""
    import cProfile
    import io
    import pstats

    from pytest_rlkernel_matrix import cli

    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.runcall(cli.main, ["report", str(root), "--no-cache", "--jobs", "1"])
    wall = time.perf_counter() - start
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    text = re.sub(r"/\S*/(pytest_rlkernel_matrix|site-packages|python3\.\d+)/", r"\1/",
                  out.getvalue())
    print(json.dumps({"text": f"profile of a sequential report, no cache, under cProfile: "
                              f"{wall:.1f} s wall (the profiler's own cost included)\n{text}"}))


def _child(root: Path, args: list[str], package: Path | None = None,
           mode: str = "--measure") -> dict[str, Any]:
    cmd = [sys.executable, __file__, mode, str(root), "--", *args]
    env = dict(os.environ)
    if package is not None:  # another version's `pytest_rlkernel_matrix` first on the path
        env["PYTHONPATH"] = os.pathsep.join([str(package), *filter(None, [
            env.get("PYTHONPATH")])])
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} failed:\n{proc.stderr[-2000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - start
    res["cache_lines"] = [ln for ln in proc.stderr.splitlines() if ln.startswith("cache:")]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiplies the 200 calls per rank (default 1: 4M active tokens/cell)")
    ap.add_argument("--root", type=Path, default=None, help="matrix root to build (default: tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the root")
    ap.add_argument("--jobs", type=int, default=None, help="--jobs of the parallel runs")
    ap.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                    help="also measure the pytest_rlkernel_matrix package in DIR (e.g. `git "
                    "archive <rev> pytest_rlkernel_matrix | tar -x -C DIR`), first")
    ap.add_argument("--reuse", action="store_true",
                    help="measure the root given by --root as it is (no build)")
    ap.add_argument("--vary", action="store_true",
                    help="RL-Kernel's real shape: lengths that vary per sample and call "
                    "(500-2,500 response tokens), masked spans (see `_cell`)")
    ap.add_argument("--samples", type=int, default=SAMPLES, help="samples per call")
    ap.add_argument("--calls", type=int, default=CALLS, help="calls per rank at --scale 1")
    ap.add_argument("--profile", action="store_true",
                    help="also profile a sequential report (`--no-cache --jobs 1`, cProfile)")
    ap.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--read", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile-child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--build", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        measure(args.measure, args.rest)
        return 0
    if args.read:
        read_all(args.read, args.rest[0])
        return 0
    if args.profile_child:
        profile(args.profile_child)
        return 0
    if args.build:
        print(build_root(args.build, args.scale, args.vary, args.samples, args.calls))
        return 0
    root = args.root or Path(tempfile.mkdtemp(prefix="rlk-bench-scale-")) / "matrix"
    start = time.perf_counter()
    if not (args.reuse and args.root is not None and (root / "cpu").is_dir()):
        built = subprocess.run([sys.executable, __file__, "--build", str(root), "--scale",
                                str(args.scale), "--samples", str(args.samples), "--calls",
                                str(args.calls), *(["--vary"] if args.vary else [])],
                               check=True, capture_output=True, text=True)
        active = f"{int(built.stdout.split()[-1]):,} active tokens"
    else:
        active = "reused"
    files = list(root.rglob("*.pt"))
    disk = sum(p.stat().st_size for p in files)
    cpus = len(os.sched_getaffinity(0))
    print(f"root: 12 cells, tp {TP} x cp {CP}, {len(files) // 12 // (TP * CP)} calls per rank, "
          f"{args.samples} samples per call, "
          f"{'lengths varying per sample and call, masked spans' if args.vary else 'one length'}"
          f", {len(files):,} sidecars ({disk / 2**20:.0f} MiB), {active}, "
          f"{time.perf_counter() - start:.0f}s; {cpus} CPUs in this process's affinity; "
          f"load average {os.getloadavg()[0]:.1f}")
    jobs = [] if args.jobs is None else ["--jobs", str(args.jobs)]
    touched = root / "cpu" / "ffn-pr" / "mismatch-sidecars" / "rank00000.call00000000.pt"

    def runs(package: Path | None) -> list[tuple[str, dict[str, Any]]]:
        rows = [("sequential, no cache (--no-cache --jobs 1)",
                 _child(root, ["--no-cache", "--jobs", "1"], package))]
        shutil.rmtree(root / ".rlk-cache", ignore_errors=True)
        rows.append(("cold (parallel, empty cache)", _child(root, jobs, package)))
        rows.append(("warm (nothing changed)", _child(root, jobs, package)))
        st = touched.stat()
        os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        rows.append(("one changed cell (a sidecar touched)", _child(root, jobs, package)))
        return rows

    def reads() -> list[tuple[str, dict[str, Any]]]:
        """Every sidecar read in a fresh process, each reader twice, alternating."""
        return [(reader, _child(root, [reader], mode="--read"))
                for _ in range(2) for reader in ("torch.load", "ptread")]

    try:
        read_rows = reads()
        variants = ([("baseline", runs(args.baseline))] if args.baseline else []) + [
            ("this checkout", runs(None))]
        report = json.loads((root / "matrix-report.json").read_text())
        tokens = sum(int(c.get("active_token_count") or 0) for c in report["cells"])
        print(f"report: {report['summary']}, {tokens:,} active tokens in the report; load "
              f"average now {os.getloadavg()[0]:.1f}")
        if set(report["summary"]) != {"valid"}:
            print("WARNING: not every cell reads valid, so not every cell took the whole judge "
                  "path (a root built before the readbacks' installed_hooks fix? build it again)")
        print("| code | run | wall s | process s | CPU s (user+sys, with workers) | active "
              "tokens/s | peak RSS MiB (main / largest worker) | vs sequential | torch/numpy "
              "imported | cache |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for code, rows in variants:
            base = rows[0][1]["wall_s"]
            for name, r in rows:
                cache = r["cache_lines"][-1].removeprefix("cache: ") if r["cache_lines"] else "-"
                print(f"| {code} | {name} | {r['wall_s']:.2f} | {r['process_s']:.2f} | "
                      f"{r.get('cpu_s', float('nan')):.2f} | "
                      f"{tokens / r['wall_s'] / 1e6:.2f}M | {r['maxrss_kib'] / 1024:.0f} / "
                      f"{r['worker_maxrss_kib'] / 1024:.0f} | {base / r['wall_s']:.2f}x | "
                      f"{', '.join(r.get('heavy_modules') or []) or 'neither'} | {cache} |")
        print(f"\nevery sidecar read in a fresh process (imports included), side by side; load "
              f"average now {os.getloadavg()[0]:.1f}:")
        print("| reader | wall s | CPU s | files (declined) | active tokens/s | peak RSS MiB |")
        print("| --- | --- | --- | --- | --- | --- |")
        for reader, r in read_rows:
            print(f"| {reader} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {r['files']:,} "
                  f"({r['declined']}) | {tokens / r['wall_s'] / 1e6:.2f}M | "
                  f"{r['maxrss_kib'] / 1024:.0f} |")
        walls = {reader: min(r["wall_s"] for n, r in read_rows if n == reader)
                 for reader in ("torch.load", "ptread")}
        cold = next(r for name, r in variants[-1][1] if name.startswith("cold"))
        ratio = walls["torch.load"] / walls["ptread"]
        print(f"ratio torch.load / ptread (best walls): {ratio:.1f}x; a cold report of this "
              f"checkout took {cold['wall_s']:.2f} s: "
              f"{walls['torch.load'] / cold['wall_s']:.1f}x less than torch.load's reading alone")
        if args.profile:
            print(_child(root, [], mode="--profile-child")["text"])
        if args.baseline:
            for what in ("wall_s", "cpu_s"):
                print(f"| ratio this checkout / baseline ({what.removesuffix('_s')}) | "
                      + " | ".join(f"{name.split(' (')[0]}: {mine[what] / theirs[what]:.2f}"
                                   for (name, theirs), (_, mine) in zip(
                                       variants[0][1], variants[1][1], strict=True)) + " |")
    finally:
        if not args.keep and args.root is None:
            shutil.rmtree(root.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
