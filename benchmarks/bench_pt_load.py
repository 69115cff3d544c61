"""Per-file cost of reading RL-Kernel sidecars: `torch.load(weights_only=True)` variants.

    python benchmarks/bench_pt_load.py ROOT [--files 200] [--baseline OLD]

ROOT is a matrix root (e.g. one `bench_report_scale.py --keep` built); the first `--files`
sidecars of `cpu/ffn-pr/mismatch-sidecars/` are read, all bytes in memory first, five rounds,
interleaved. Printed per variant: CPU ms per file (best and median of the rounds, process time,
so the load of a shared box weighs less than in wall time) and the ratio to the first variant:

- `torch.load(BytesIO(bytes), weights_only=True)`: what `judge.read.ptread.read_pt` falls back to
(the
  bytes are the ones `store.safeio` read and checked);
- `torch.load(path, weights_only=True)` and `torch.load(path, weights_only=True, mmap=True)`;
- `judge.read.ptread.load(bytes)`: the restricted fast path alone (C unpickler, allowlisted globals
  answered by our own objects, the subset proof), and `judge.read.evidence.read_pt(bytes)`: what the
  analysis calls (the fast path, `torch.load(weights_only=True)` where it says `Unsupported`);
  the script first checks that both give what `torch.load(weights_only=True)` gives for every
  file (dtype, shape, stride, storage offset, bytes) and prints how many files the fast path read;
- with `--baseline OLD` (a directory holding an older `pytest_rlkernel_matrix` whose
  `judge/ptfile.py` exists), that restricted reader's `load_plain(bytes)`, for the record.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _raw(t: Any) -> bytes:
    """The bytes of a tensor's whole storage."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy().tobytes()


def _same(a: Any, b: Any) -> bool:
    if hasattr(b, "untyped_storage"):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
                and a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
                and _raw(a) == _raw(b))
    if isinstance(b, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--baseline", type=Path, default=None, metavar="OLD")
    args = ap.parse_args()
    import torch

    files = sorted((args.root / "cpu" / "ffn-pr" / "mismatch-sidecars").glob("*.pt"))
    files = files[:args.files]
    raws = [f.read_bytes() for f in files]
    variants: dict[str, Callable[[Path, bytes], Any]] = {
        "torch.load(BytesIO(bytes), weights_only=True)": lambda f, r: torch.load(
            io.BytesIO(r), map_location="cpu", weights_only=True),
        "torch.load(path, weights_only=True)": lambda f, r: torch.load(
            f, map_location="cpu", weights_only=True),
        "torch.load(path, weights_only=True, mmap=True)": lambda f, r: torch.load(
            f, map_location="cpu", weights_only=True, mmap=True),
    }
    from pytest_rlkernel_matrix.judge.read import ptread
    from pytest_rlkernel_matrix.judge.read.evidence import read_pt

    variants["ptread.load(bytes) (fast path alone)"] = lambda f, r: ptread.load(r, f.name)
    variants["judge.read.evidence.read_pt(bytes) (fast path, torch.load fallback)"] = (
        lambda f, r: read_pt(r, torch, f.name))
    for f, r in zip(files, raws, strict=True):
        want = torch.load(io.BytesIO(r), map_location="cpu", weights_only=True)
        if not _same(read_pt(r, torch, f.name), want):
            raise SystemExit(f"{f}: read_pt differs from torch.load(weights_only=True)")
    print(f"read_pt == torch.load(weights_only=True) on all {len(files)} files; read by "
          f"{ptread.COUNTS}")
    if args.baseline is not None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(  # the old package's file, stdlib only
            "old_ptfile", args.baseline / "pytest_rlkernel_matrix" / "judge" / "ptfile.py")
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        variants["old judge/ptfile.py load_plain(bytes) (removed)"] = (
            lambda f, r: old.load_plain(r))
    tensors = sum(len(v) for v in torch.load(files[0], weights_only=True).values()
                  if isinstance(v, list) and v and hasattr(v[0], "numel"))
    print(f"{len(files)} sidecars of {len(raws[0]):,} bytes, {tensors} tensors each; "
          f"torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}")
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(5):
        for name, fn in variants.items():
            start = time.process_time()
            for f, r in zip(files, raws, strict=True):
                fn(f, r)
            times[name].append((time.process_time() - start) / len(files) * 1e3)
    first = min(next(iter(times.values())))
    print("| reader | CPU ms per file, best | median | vs the first |")
    print("| --- | --- | --- | --- |")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.2f} | {statistics.median(ts):.2f} | "
              f"{min(ts) / first:.2f}x |")
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
