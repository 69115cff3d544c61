"""The generated inputs of the debugger golden differential (issue 50): RL-Kernel capture bundles
(`capture-manifest.json` + `captures/{side}-rank{r}-call{k}.pt`), each record the dict upstream's
`Capture.record` saves at 82fd031 (`run_upstream.py` checks that upstream's writer gives the same
dicts), over systematic inputs: equal, one ulp, signed zero, NaN, Inf, bf16 / fp16 on both
sides, bf16 against fp32, shards of mixed dtype, a replica disagreement, a feature gap, a
missing shard, differing identities, missing or differing contracts, a wrong width, an
interrupted capture (a lock without its file).

Pure torch, deterministic: `write(name, folder)` makes the bundle; `CASES` names them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SCHEMA = "rlkernel.capture.v1"
POSITIONS = [0, 1, 2, 3]
BOUNDARIES = [
    {"id": "layer0.attention.output", "module": "attention", "stage": "attention_output",
     "layer": 0, "positions": POSITIONS, "width": 8, "contracts": ["scale"]},
    {"id": "layer0.ffn.output", "module": "ffn", "stage": "mlp_output", "layer": 0,
     "positions": POSITIONS, "width": 8, "contracts": [], "inputs": ["layer0.attention.output"]},
    {"id": "logp", "module": "logp", "stage": "logp", "layer": None, "positions": POSITIONS,
     "width": 8, "contracts": [], "inputs": ["layer0.ffn.output"]},
]
IDENTITY = {"weights": "w" * 8, "tokens": "t" * 8, "positions": "p" * 8, "mask": "m" * 8,
            "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1}}
CASES = ("equal", "one_ulp_ffn", "signed_zero_attention", "nan_both_logp", "inf_rollout_logp",
         "bf16_both", "fp16_both", "bf16_one_ulp", "bf16_nan", "bf16_vs_fp32", "fp16_vs_bf16",
         "mixed_shard_dtype", "replica_disagreement", "replica_agreement", "feature_gap",
         "missing_shard", "identity_differs", "contract_missing", "contract_differs",
         "width_differs", "lock_without_capture")


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(45)
    return {b["id"]: torch.randn(4, 8, generator=g, dtype=torch.float32) for b in BOUNDARIES}


def record(side: str, boundary: str, value: torch.Tensor, offset: int,
           identity: dict[str, Any] | None = None, contracts: dict[str, Any] | None = None,
           width: int = 8) -> dict[str, Any]:
    """The dict `Capture(...).record` saves."""
    return {"schema_version": SCHEMA, "boundary": boundary, "side": side,
            "identity": dict(identity or IDENTITY), "contracts": dict(contracts or {}),
            "route": f"{side}.rlkernel", "tensors": {"value": value.contiguous()},
            "metadata": {"stage_positions": {"value": torch.tensor(POSITIONS)},
                         "feature_offsets": {"value": offset},
                         "feature_sizes": {"value": width}}}


def plan(name: str) -> list[tuple[str, int, dict[str, Any]]]:
    """(side, rank, record) in the order each side's worker records them."""
    values = _values()
    out: list[tuple[str, int, dict[str, Any]]] = []
    for side in ("training", "rollout"):
        for rank in (0, 1):
            for b in BOUNDARIES:
                full = values[b["id"]].clone()
                bid = b["id"]
                if side == "rollout":
                    if name == "one_ulp_ffn" and bid == "layer0.ffn.output":
                        full[2, 5] = torch.nextafter(full[2, 5], torch.tensor(1e9))
                    if name == "signed_zero_attention" and bid == "layer0.attention.output":
                        full[1, 1] = -0.0
                    if name == "inf_rollout_logp" and bid == "logp":
                        full[0, 0] = float("inf")
                if name == "signed_zero_attention" and side == "training" and (
                        bid == "layer0.attention.output"):
                    full[1, 1] = 0.0
                if name == "nan_both_logp" and bid == "logp":
                    full[3, 2] = float("nan")
                dtype = {"bf16_both": torch.bfloat16, "fp16_both": torch.float16,
                         "bf16_one_ulp": torch.bfloat16, "bf16_nan": torch.bfloat16}.get(name)
                if name == "bf16_vs_fp32" and side == "training":
                    dtype = torch.bfloat16
                if name == "fp16_vs_bf16":
                    dtype = torch.float16 if side == "training" else torch.bfloat16
                if name == "mixed_shard_dtype" and side == "training" and rank == 0:
                    dtype = torch.bfloat16
                if dtype is not None:
                    full = full.to(dtype)
                if name == "bf16_one_ulp" and side == "rollout" and bid == "logp":
                    full[2, 6] = torch.nextafter(full[2, 6], torch.tensor(1e9, dtype=dtype))
                if name == "bf16_nan" and bid == "logp":
                    full[1, 2] = float("nan")
                offset = 4 * rank
                piece = full[:, offset:offset + 4]
                identity = dict(IDENTITY)
                if name == "identity_differs" and side == "rollout":
                    identity["tokens"] = "u" * 8
                contracts = {"scale": 0.125} if bid == "layer0.attention.output" else {}
                if name == "contract_missing" and side == "rollout":
                    contracts = {}
                if name == "contract_differs" and side == "rollout" and contracts:
                    contracts = {"scale": 0.25}
                width = 8
                if name == "width_differs" and side == "rollout" and bid == "logp":
                    width = 9
                if name == "feature_gap" and side == "rollout" and rank == 1 and bid == "logp":
                    offset = 5
                    piece = full[:, 5:8]
                if name == "missing_shard" and side == "rollout" and rank == 1 and (
                        bid == "layer0.ffn.output"):
                    continue
                out.append((side, rank, record(side, bid, piece, offset, identity, contracts,
                                               width)))
            if name in ("replica_disagreement", "replica_agreement") and rank == 0:
                # a third training worker replicating rank 0's ffn piece (TP replica)
                rep = values["layer0.ffn.output"].clone()[:, 0:4]
                if name == "replica_disagreement" and side == "training":
                    rep[0, 0] = torch.nextafter(rep[0, 0], torch.tensor(1e9))
                out.append((side, 2, record(side, "layer0.ffn.output", rep, 0)))
    return out


def write(name: str, folder: Path) -> Path:
    """The bundle of case `name` in `folder` (created)."""
    folder.mkdir(parents=True)
    (folder / "capture-manifest.json").write_text(json.dumps(
        {"schema_version": SCHEMA, "scope": "tests: golden differential",
         "boundaries": BOUNDARIES}, indent=2))
    captures = folder / "captures"
    captures.mkdir()
    calls: dict[tuple[str, int], int] = {}
    for side, rank, rec in plan(name):
        call = calls.get((side, rank), 0)
        calls[(side, rank)] = call + 1
        stem = f"{side}-rank{rank}-call{call}"
        (captures / f"{stem}.lock").touch()
        torch.save(rec, captures / f"{stem}.pt")
    if name == "lock_without_capture":
        (captures / "rollout-rank1-call9.lock").touch()
    return folder
