"""Run inside a batch job: the same preflight as the login node, on the node that runs the cell.

    python -m pytest_rlkernel_matrix.run.launchers.node OUT.json [--python PY] [--topology JSON]

Writes OUT.json (the preflight record with its `fingerprints`) atomically and raw command output
next to it; exits 0 even when tools are missing (they are recorded as missing).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlk-matrix-node-probe")
    parser.add_argument("out")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--topology", default=None, help="the profile's topology as JSON")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    from pytest_rlkernel_matrix.machine import preflight as pf
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    out = Path(args.out)
    raw = out.with_name(out.stem + "-raw")
    data = pf.collect_preflight(python=args.python, raw_dir=raw, timeout=args.timeout,
                                topology=json.loads(args.topology) if args.topology else None)
    data["node"] = socket.gethostname()
    write_json_atomic(out, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
