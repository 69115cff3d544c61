"""Add the LM-head and runtime-identity files of a Qwen3 layer replay to the replay fixtures
(issue 50): `diagnostics/heads/{side}-pid4500-rank0-call0.pt`, `diagnostics/weights/{side}-
pid4500-rank0-head.json` and `diagnostics/identity/{side}-pid4500-rank0.json`, and make
`replay-head-diverged` (replay-equal with one rollout logit one ulp off).

    python tests/data/debugger/add_heads_identity.py

NOT written by upstream's writer (its head hooks need Megatron and vLLM models): built to the
schema upstream's reader `qwen3_report.analyze_head` / `analyze_replay` reads at 4d39c20
(`heads/*.pt`: `side`, `call`, `tensors` {head_input, logits} as [rows, features],
`metadata.stage_positions` / `feature_offsets` / `feature_sizes`; `weights/{side}-*-head.json`
beside `*-layer0.json`; `identity/*.json` with `side` and the token / mask / sampling identity,
whose `tokens` is the layers' `frozen_tokens_sha256`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
STEM = "pid4500-rank0"


def add(folder: Path, bump: bool = False) -> None:
    diag = folder / "diagnostics"
    layer = torch.load(diag / "layers" / f"rollout-{STEM}-layer0-call0.pt", weights_only=True)
    positions = layer["positions"].clone()
    g = torch.Generator().manual_seed(4)
    head_input = torch.randn(len(positions), 8, generator=g)
    logits = torch.randn(len(positions), 16, generator=g)
    for side in ("training", "rollout"):
        value = logits.clone()
        if bump and side == "rollout":
            value[2, 3] = torch.nextafter(value[2, 3], torch.tensor(1e9))
        (diag / "heads").mkdir(exist_ok=True)
        torch.save({"side": side, "call": 0, "rank": 0,
                    "tensors": {"head_input": head_input.clone(), "logits": value},
                    "metadata": {"stage_positions": {"head_input": positions.clone(),
                                                     "logits": positions.clone()},
                                 "feature_offsets": {"head_input": 0, "logits": 0},
                                 "feature_sizes": {"head_input": 8, "logits": 16}}},
                   diag / "heads" / f"{side}-{STEM}-call0.pt")
        (diag / "weights" / f"{side}-{STEM}-head.json").write_text(json.dumps(
            {"lm_head:0:0:(16, 8):torch.float32": "1" * 64}))
        (diag / "identity").mkdir(exist_ok=True)
        (diag / "identity" / f"{side}-{STEM}.json").write_text(json.dumps(
            {"side": side, "tokens": layer["frozen_tokens_sha256"], "mask": "2" * 64,
             "sampling": layer["sampling"]}, default=str))


if __name__ == "__main__":
    add(HERE / "replay-equal")
    add(HERE / "replay-diverged")
    target = HERE / "replay-head-diverged"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(HERE / "replay-equal", target)
    shutil.rmtree(target / "diagnostics" / "heads")
    add(target, bump=True)
