"""Which well-kept reader for the zip container: stdlib `zipfile` or torch's own
`torch._C.PyTorchFileReader` (what torch.load reads with)?

    python benchmarks/bench_pt_container.py ROOT [--files 400] [--rounds 3]

ROOT is a matrix root (`bench_report_scale.py --vary --keep` builds one). Measured, the rounds
interleaved, CPU time of this process per file over the first `--files` sidecars (bytes in
memory): `ptread._records` (zipfile parses the directory, then torch's layout is enforced
field for field; the records are memoryviews of the bytes) and `PyTorchFileReader` (open the
bytes, `get_record` of data.pkl and every tensor record: copies, as torch.load takes them).
Then, in fresh processes (three each), the CPU cost of `import numpy` and of `import torch`,
which torch's reader needs in every process that reads (the report's workers). Printed with
the load average (a shared box).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _import_cpu(module: str) -> float:
    code = ("import resource, time; t = time.process_time(); import " + module +
            "; print(time.process_time() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.split()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--files", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    from pytest_rlkernel_matrix.judge.read import ptread

    files = sorted(args.root.rglob("mismatch-sidecars/*.pt"))[: args.files]
    raws = [p.read_bytes() for p in files]

    def torch_reader(raw: bytes) -> None:
        reader = torch._C.PyTorchFileReader(io.BytesIO(raw))
        for name in reader.get_all_records():
            if name == "data.pkl" or name.startswith("data/"):
                reader.get_record(name)

    variants = {"zipfile + torch's layout enforced (ptread._records)": ptread._records,
                "torch._C.PyTorchFileReader, every record": torch_reader}
    times: dict[str, list[float]] = {v: [] for v in variants}
    print(f"{len(raws)} sidecars of {args.root}; load average {os.getloadavg()[0]:.1f}")
    for _ in range(args.rounds):
        for name, read in variants.items():
            start = time.process_time()
            for raw in raws:
                read(raw)
            times[name].append((time.process_time() - start) / len(raws))
    print("| container reader | CPU us per file (median of rounds) |")
    print("| --- | --- |")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t) * 1e6:.0f} |")
    for module in ("numpy", "torch"):
        cpu = [_import_cpu(module) for _ in range(3)]
        print(f"import {module} in a fresh process: {statistics.median(cpu):.2f} s CPU "
              f"(median of 3: {', '.join(f'{c:.2f}' for c in cpu)})")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
