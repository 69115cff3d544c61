"""Generate the debugger fixtures under tests/data/debugger/ with RL-Kernel's own writer.

    UPSTREAM=/tmp/upstream-scratch python tests/data/debugger/make_fixtures.py

UPSTREAM is a scratch folder OUTSIDE this repository holding `rl_engine/alignment/debug/core.py`
and `evidence.py` as they are at RL-Align/RL-Kernel 82fd031 (read with the search tool's file
reader at that commit; the debugger is on a branch commit, not on main). Their code never enters
this repository: this script only calls it. It writes, per bundle, what upstream writes:
`capture-manifest.json` (`Capture.prepare`), `captures/{side}-rank{r}-call{k}.pt`
(`Capture(...).record`, two TP shards a side, feature offsets 0 and 4 of width 8) and
`diagnostic-report.json` (`analyze_bundle`'s report, `rlkernel.diagnostic_report.v2`, dumped as
JSON; its `first-divergence.pt` is deleted: the plugin does not read it). Bundles:

- `equal`: every boundary bit-equal on both sides;
- `diverged`: the rollout side's ffn boundary (layer 0, mlp_output) differs by one ulp at
  position 2, its inputs equal;
- `signed-zero`: the rollout's attention output holds -0.0 where training has +0.0 (a
  difference by upstream's rule);
- `nonfinite`: a NaN on both sides at the logp boundary (never a pass: not comparable);
- `partial`: the rollout's rank 1 shard of the ffn boundary is missing (feature coverage).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.environ["UPSTREAM"])
from rl_engine.alignment.debug.evidence import Capture, analyze_bundle

HERE = Path(__file__).resolve().parent
POSITIONS = [0, 1, 2, 3]
BOUNDARIES = [
    {"id": "layer0.attention.output", "module": "attention", "stage": "attention_output",
     "layer": 0, "positions": POSITIONS, "width": 8, "contracts": ["scale"]},
    {"id": "layer0.ffn.output", "module": "ffn", "stage": "mlp_output", "layer": 0,
     "positions": POSITIONS, "width": 8, "contracts": [],
     "inputs": ["layer0.attention.output"]},
    {"id": "logp", "module": "logp", "stage": "logp", "layer": None, "positions": POSITIONS,
     "width": 8, "contracts": [], "inputs": ["layer0.ffn.output"]},
]
IDENTITY = {"weights": "w" * 8, "tokens": "t" * 8, "positions": "p" * 8, "mask": "m" * 8,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1}}


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(45)
    return {b["id"]: torch.randn(4, 8, generator=g, dtype=torch.float32) for b in BOUNDARIES}


def _bundle(name: str, tweak) -> None:
    out = HERE / name
    if out.exists():
        shutil.rmtree(out)
    Capture.prepare(out, BOUNDARIES, scope="tests: two TP shards, one layer, logp")
    base = _values()
    for side in ("training", "rollout"):
        for rank in (0, 1):
            cap = Capture(out, side, IDENTITY, rank=rank)
            for b in BOUNDARIES:
                value = base[b["id"]].clone()
                value = tweak(side, b["id"], value)
                shard = value[:, 4 * rank: 4 * rank + 4].contiguous()
                if tweak(side, b["id"], None, rank=rank) == "skip":
                    continue
                contracts = {"scale": 0.125} if b["contracts"] else {}
                cap.record(b["id"], shard, positions=POSITIONS, offset=4 * rank,
                           contracts=contracts, route=f"{side}.rlkernel.{b['module']}")
    try:
        report = analyze_bundle(out)
    except ValueError as exc:  # upstream raises for a foreign record: no report then
        report = {"raised": str(exc)}
    (out / "first-divergence.pt").unlink(missing_ok=True)
    for lock in (out / "captures").glob("*.lock"):
        lock.unlink()  # (upstream's reservations; a lock without its .pt is a partial capture)
    (out / "diagnostic-report.json").write_text(json.dumps(report, indent=2, default=str))
    print(name, report.get("status"), (report.get("first_divergence") or {}).get("boundary"))


def equal(side, boundary, value, rank=None):
    return value


def diverged(side, boundary, value, rank=None):
    if value is not None and side == "rollout" and boundary == "layer0.ffn.output":
        value[2, 5] = torch.nextafter(value[2, 5], torch.tensor(float("inf")))
    return value


def signed_zero(side, boundary, value, rank=None):
    if value is not None and boundary == "layer0.attention.output":
        value[1, 1] = 0.0 if side == "training" else -0.0
    return value


def nonfinite(side, boundary, value, rank=None):
    if value is not None and boundary == "logp":
        value[0, 0] = float("nan")
    return value


def partial(side, boundary, value, rank=None):
    if value is None:
        return "skip" if (side, boundary, rank) == ("rollout", "layer0.ffn.output", 1) else None
    return value


if __name__ == "__main__":
    for name, tweak in (("equal", equal), ("diverged", diverged), ("signed-zero", signed_zero),
                        ("nonfinite", nonfinite), ("partial", partial)):
        _bundle(name, tweak)
