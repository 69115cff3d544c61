"""Is the documented CPU drill found, and is the no-drill session quiet? Sessions, counted.

Not a test (no thresholds; minutes per session): runs the documented command

    RLK_REF_FAULT=slow:ffn:rollout:<F> pytest --rlk-processes=auto --rlk-perf-budget=<B> -k ffn

`--sessions` times with the drill and as many times without (alternating, so a change of the
machine's load hits both alike), each in its own matrix root, and prints per session the ffn
rollout side's rollout-phase statement, whether the session stopped early and why, and the
session's wall time; then the counts: the drill **found** (that statement "slower" with an
interval above 1) and the no-drill session **quiet** (no "slower"/"faster" anywhere). Issue 52
asks for at least 9 of 10 each on a quiet 2-core box. Run from the repo root:

    python benchmarks/bench_drill_sessions.py                  # 10 + 10 sessions, F 1.5, 5 min
    python benchmarks/bench_drill_sessions.py --sessions 2 --factor 4 --budget 5
    python benchmarks/bench_drill_sessions.py --xdist 2        # the same under -n 2

On a busy box the sessions stop early (contamination) and count as neither found nor quiet:
that is the honest answer there, and the counts say so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def session(root: Path, drill: str | None, budget: float, xdist: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "RLK_REF_FAULT"}
    if drill:
        env["RLK_REF_FAULT"] = drill
    cmd = [sys.executable, "-m", "pytest", f"--rlk-matrix={REPO / 'matrix.toml'}",
           f"--rlk-matrix-root={root}", "--rlk-processes=auto",
           f"--rlk-perf-budget={budget:g}", "-p", "no:cacheprovider", "-q", "-k", "ffn"]
    if xdist:
        cmd += ["-n", str(xdist)]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    took = time.time() - t0
    stop = next((line for line in proc.stdout.splitlines()
                 if line.startswith("performance: auto stopped early")), None)
    try:
        report = json.loads((root / "matrix-report.json").read_text())
    except (OSError, ValueError):
        return {"took": took, "stop": stop, "rollout": None, "kinds": [], "rc": proc.returncode}
    entry = next((m for m in report["performance"]["modules"] if m["module"] == "ffn"), {})
    said = {(s["side"], s["phase"]): s for s in entry.get("statements") or []}
    rollout = said.get(("rollout", "rollout_wall_time"))
    return {"took": took, "stop": stop, "rollout": rollout, "rc": proc.returncode,
            "kinds": [s["kind"] for s in said.values()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--factor", type=float, default=1.5)
    parser.add_argument("--budget", type=float, default=5.0)
    parser.add_argument("--xdist", type=int, default=0, help="-n N (0: serial)")
    args = parser.parse_args()
    drill = f"slow:ffn:rollout:{args.factor:g}"
    found = quiet = 0
    print("| session | drill | rollout side, rollout phase | stopped early | s |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="rlk-drill-sessions-") as tmp:
        for i in range(args.sessions):
            for name, d in ((drill, drill), ("none", None)):
                r = session(Path(tmp) / f"{i}-{name.replace(':', '_')}", d, args.budget,
                            args.xdist)
                s = r["rollout"] or {}
                if d and s.get("kind") == "slower" and (s.get("low") or 0) > 1.0:
                    found += 1
                if not d and r["kinds"] and not {"slower", "faster"} & set(r["kinds"]):
                    quiet += 1
                print(f"| {i + 1} | {name} | {s.get('text', 'no report')} | "
                      f"{(r['stop'] or '').removeprefix('performance: auto stopped early: ')[:120]}"
                      f" | {r['took']:.0f} |", flush=True)
    print(f"\ndrill {drill} found in {found} of {args.sessions} sessions; no-drill quiet in "
          f"{quiet} of {args.sessions} (budget {args.budget:g} min, "
          f"{'-n ' + str(args.xdist) if args.xdist else 'serial'})")


if __name__ == "__main__":
    main()
