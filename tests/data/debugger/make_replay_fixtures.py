"""Generate the Qwen3 layer-replay fixtures under tests/data/debugger/replay-*/diagnostics/.

    UPSTREAM=/tmp/upstream-scratch python tests/data/debugger/make_replay_fixtures.py

UPSTREAM is a scratch folder OUTSIDE this repository holding RL-Kernel's
`rl_engine/alignment/debug/core.py` and, from `qwen3_runtime.py` at 82fd031, its module state,
`frozen_batch` and `save_layer` (the writer of `diagnostics/layers/*.pt`,
``rlkernel.layer_replay.v1``). The layer hooks that fill `tensors` and `metadata` need Megatron and
vLLM models, which do not run here: this script builds `tensors` and `metadata` to the schema read
from `install_layers` / `canonical_tensors` (stage tensors [rows, features]; `stage_positions`,
`feature_offsets`, `feature_sizes`, `tp_rank`, `tp_size`, `cp_rank`, `cp_size`, `contract`,
`expected_layers`) and hands them to upstream's `save_layer`, which writes the files. The weight
tiles `diagnostics/weights/{side}-pid{p}-rank{r}-layer{L}.json` are written as `install_layers`
writes them (`json.dumps(tiles, sort_keys=True)`), with made-up digests equal on both sides.
Upstream's `analyze_replay` also needs LM-head, endpoint and route files: it is not run, and no
upstream report is written for these fixtures.

- `replay-equal`: 2 layers, TP 1, both sides bit-equal;
- `replay-diverged`: the rollout's layer 1 `mlp_output` differs by one ulp at position 3 (and so
  does its `output`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.environ["UPSTREAM"])
from rl_engine.alignment.debug import qwen3_runtime as q

HERE = Path(__file__).resolve().parent
TOKENS = [11, 12, 13, 14, 15, 16]
PROMPT = 2
POSITIONS = list(range(len(TOKENS) - 1))  # the rows both sides own (logit positions)
STAGES = ("input", "attention_output", "mlp_output", "output")
LAYERS = 2
CONTRACT = {"scale": 0.125, "q_norm_eps": 1e-6, "k_norm_eps": 1e-6, "attention_dropout": 0.0}


def _scenario(name: str, diverge: bool) -> None:
    out = HERE / name / "diagnostics"
    if out.parent.exists():
        shutil.rmtree(out.parent)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        frozen = Path(tmp) / "frozen-replay.json"
        frozen.write_text(json.dumps({"tokens": TOKENS, "prompt_length": PROMPT,
                                      "mask": [1] * (len(TOKENS) - PROMPT),
                                      "sampling": {"temperature": 1.0, "top_p": 1.0,
                                                   "top_k": -1}}))
        os.environ["RL_KERNEL_ALIGNMENT_REPLAY"] = str(frozen)
        os.environ["RL_KERNEL_ALIGNMENT_DIAGNOSTICS_DIR"] = str(out)
        q._BATCH = None
        q._CALLS.clear()
        g = torch.Generator().manual_seed(4545)
        values = {(layer, stage): torch.randn(len(POSITIONS), 8, generator=g)
                  for layer in range(LAYERS) for stage in STAGES}
        for side in ("training", "rollout"):
            q._ROWS[side] = torch.tensor(POSITIONS)
            for layer in range(LAYERS):
                tensors = {s: values[layer, s].clone() for s in STAGES}
                if diverge and side == "rollout" and layer == 1:
                    for s in ("mlp_output", "output"):
                        tensors[s][3, 2] = torch.nextafter(tensors[s][3, 2],
                                                           torch.tensor(float("inf")))
                metadata = {
                    "side": side, "capture_mode": "eager_observational",
                    "expected_layers": LAYERS, "contract": dict(CONTRACT),
                    "stage_positions": {s: torch.tensor(POSITIONS) for s in STAGES},
                    "feature_offsets": {}, "feature_sizes": {s: 8 for s in STAGES},
                    "tp_rank": 0, "tp_size": 1, "cp_rank": 0, "cp_size": 1, "head_dim": 4,
                    "total_heads": 2, "total_kv_heads": 1,
                }
                q.save_layer(side, layer, tensors, metadata=metadata)
                tiles = {"q:0:0:(8, 8):torch.float32": f"{layer:064x}"}
                weights = out / "weights" / f"{side}-pid{os.getpid()}-rank0-layer{layer}.json"
                weights.parent.mkdir(exist_ok=True)
                weights.write_text(json.dumps(tiles, sort_keys=True), encoding="utf-8")
    # stable names: the writer's pid differs from run to run
    for path in sorted(out.rglob(f"*-pid{os.getpid()}-*")):
        path.rename(path.with_name(path.name.replace(f"-pid{os.getpid()}-", "-pid4500-")))
    print(name, sorted(p.name for p in (out / "layers").iterdir()))


if __name__ == "__main__":
    _scenario("replay-equal", diverge=False)
    _scenario("replay-diverged", diverge=True)
