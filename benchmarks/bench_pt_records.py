"""`.pt` reading is linear in records: `judge.read.ptread` against `torch.load(weights_only=True)`.

    python benchmarks/bench_pt_records.py [--counts 1000,10000,32000,100000] [--rounds 3]

For each count N, `torch.save` of a dict of N one-element float32 tensors (a probe file of N
operators is this shape: one tensor per operator) and of one dict holding a list of N ints
and N strings (N records' worth of pickle without tensors). Each file is read from bytes in
memory, the rounds interleaved: `ptread.load(arrays="numpy")` (what the analysis uses),
`ptread.load` (torch tensors) and `torch.load(BytesIO, weights_only=True)`. Printed: CPU
seconds of this process (the median of the rounds; CPU, not wall, so that a shared box's load
weighs less), microseconds per record, and the ratio to torch.load; the
per-record time staying flat from 1,000 to 100,000 records is the linearity. The load average
is printed with the figures (the box is shared).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _files(n: int) -> dict[str, bytes]:
    import torch

    out = {}
    for what, obj in (("tensors", {f"op{i}": torch.full((1,), float(i)) for i in range(n)}),
                      ("ints+strs", {"ints": list(range(n)), "strs": [f"s{i}" for i in range(n)]})):
        buf = io.BytesIO()
        torch.save(obj, buf)
        out[what] = buf.getvalue()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="1000,10000,32000,100000")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    from pytest_rlkernel_matrix.judge.read import ptread

    variants = {
        "ptread numpy": lambda raw: ptread.load(raw, "x.pt", arrays="numpy"),
        "ptread torch": lambda raw: ptread.load(raw, "x.pt"),
        "torch.load": lambda raw: torch.load(io.BytesIO(raw), weights_only=True),
    }
    print(f"load average {os.getloadavg()[0]:.1f} at the start; {len(os.sched_getaffinity(0))} "
          "CPUs")
    print("| file | records | MiB | " + " | ".join(f"{v} s (us/record)" for v in variants)
          + " | torch.load / ptread numpy |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in variants) + " | --- |")
    for n in (int(c) for c in args.counts.split(",")):
        for what, raw in _files(n).items():
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for name, read in variants.items():
                    start = time.process_time()
                    read(raw)
                    times[name].append(time.process_time() - start)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"| {what} | {n:,} | {len(raw) / 2**20:.1f} | " + " | ".join(
                f"{med[v]:.3f} ({med[v] / n * 1e6:.1f})" for v in variants)
                + f" | {med['torch.load'] / med['ptread numpy']:.1f}x |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
