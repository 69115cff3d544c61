"""Run RL-Kernel's own debugger over the generated bundles (`cases.py`) and write its verdicts to
`verdicts.json` (issue 50). Needs RL-Kernel's code; never run by the tests.

    UPSTREAM=/work/scratch/i50/rlk python tests/golden/upstream/debugger/run_upstream.py

`UPSTREAM` is a scratch folder OUTSIDE this checkout holding `rl_engine/alignment/debug/core.py`
and `evidence.py` of RL-Align/RL-Kernel at 82fd031 (README.md: how it was assembled).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cases  # noqa: E402

UPSTREAM = Path(os.environ["UPSTREAM"]).resolve()
if HERE.parents[3] == UPSTREAM or HERE.parents[3] in UPSTREAM.parents:
    raise SystemExit("UPSTREAM must be outside the checkout")
sys.path.insert(0, str(UPSTREAM))
from rl_engine.alignment.debug.evidence import Capture, analyze_bundle  # noqa: E402

COMMITS = {"RL-Align/RL-Kernel rl_engine/alignment/debug/core.py": "82fd031",
           "RL-Align/RL-Kernel rl_engine/alignment/debug/evidence.py": "82fd031"}


def _same_as_upstream_writer(name: str, folder: Path) -> None:
    """The generator's records are what upstream's `Capture.record` saves (same dicts)."""
    theirs = folder / "upstream-writer"
    Capture.prepare(theirs, cases.BOUNDARIES, scope="tests: golden differential")
    writers: dict[tuple[str, int], Capture] = {}
    for side, rank, rec in cases.plan(name):
        w = writers.setdefault((side, rank), Capture(theirs, side, rec["identity"], rank=rank))
        w.record(rec["boundary"], rec["tensors"]["value"],
                 positions=rec["metadata"]["stage_positions"]["value"].tolist(),
                 offset=rec["metadata"]["feature_offsets"]["value"], contracts=rec["contracts"],
                 route=rec["route"])
    mine = cases.write(name, folder / "generator")
    for path in sorted((theirs / "captures").glob("*.pt")):
        a = torch.load(path, weights_only=True)
        b = torch.load(mine / "captures" / path.name, weights_only=True)
        assert repr(a) == repr(b), (name, path.name)


def verdict(name: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = cases.write(name, Path(tmp) / "bundle")
        try:
            report = analyze_bundle(folder)
        except Exception as exc:  # upstream refusing to read is its verdict
            return {"status": "raised", "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    first = report["first_divergence"] or {}
    return {"status": report["status"], "errors": report["errors"],
            "first_divergence": {k: first.get(k) for k in ("boundary", "position", "reason",
                                                           "bitwise_mismatches")} or None}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("equal", "replica_agreement", "feature_gap"):
            _same_as_upstream_writer(name, Path(tmp) / name)
    out = {"generated_by": "tests/golden/upstream/debugger/run_upstream.py", "upstream": COMMITS,
           "torch": torch.__version__, "cases": {n: verdict(n) for n in cases.CASES}}
    (HERE / "verdicts.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{len(out['cases'])} cases -> {HERE / 'verdicts.json'}")


if __name__ == "__main__":
    main()
