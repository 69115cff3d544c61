"""The generated inputs of the layer-replay golden differential (issue 50): run folders holding a
Qwen3 layer replay (`diagnostics/{layers,weights,heads,identity,errors}`, the fixtures of
`tests/data/debugger/replay-*`, whose layer files upstream's `save_layer` wrote) plus what
upstream's `analyze_replay` also reads beside it: a `manifest.json` naming the three module
cases, `readbacks/*.json` of both frameworks and the final `mismatch-sidecars/`. Each case edits
the equal run in one place: a layer one ulp off, an LM-head logit one ulp off, signed zero, NaN on
both sides, a bf16 side, a missing / differing identity, a failed capture, missing or differing
weight tiles, a missing layer, a missing head weight file, an extra training call, a differing
contract, a wrong layer count, the replay nested under `arms/r-r/`, and a foreign layer schema.

Pure torch, deterministic: `write(name, folder)` makes the run folder; `CASES` names them.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).resolve().parents[3] / "data" / "debugger"
STEM = "pid4500-rank0"
BACKENDS = {"attention": "rlkernel.attention.deterministic.v1",
            "ffn": "rlkernel.ffn.qwen3.deterministic.v1",
            "logp": "rlkernel.linear_logp.bitwise.v1"}
SIDECAR = "rlkernel.vime_rocm_attention_mismatch_sidecar.v1"


def _readback(framework: str, target: str) -> dict[str, Any]:
    return {"framework": framework, "target": target, "fallbacks": [],
            "plan": {"schema_version": "rlkernel.debug_matrix.v1",
                     "cases": {m: {"module": m, "case_id": "R/R"} for m in BACKENDS}},
            "installed_hooks": {m: f"{framework}.{m}" for m in BACKENDS},
            "operators": {m: {"framework": framework, "target": target, "module": m,
                              "case_id": "R/R", "implementation": "rl_kernel",
                              "backend_id": b, "call_count": 1, "execution_mode": "eager",
                              "provenance": {"interface": m, "fallback": False,
                                             "actual_backend": b,
                                             "execution": {"runtime_platform": "cuda"}}}
                          for m, b in BACKENDS.items()}}


def _base(run: Path, source: str = "replay-equal", under: str = "") -> Path:
    diag = run / under / "diagnostics"
    shutil.copytree(DATA / source / "diagnostics", diag)
    (run / "manifest.json").write_text(json.dumps({"environment": {
        f"RL_KERNEL_{m.upper()}_CASE": "R/R" for m in BACKENDS}}))
    (run / "readbacks").mkdir()
    for i, (fw, target) in enumerate((("megatron", "training"), ("vllm", "rollout"))):
        (run / "readbacks" / f"{fw}-{target}-{100 + i}.json").write_text(
            json.dumps(_readback(fw, target), indent=2, sort_keys=True))
    (run / "mismatch-sidecars").mkdir()
    logp = torch.tensor([-0.5, -1.25, -2.0, -0.75], dtype=torch.float32)
    torch.save({"schema_version": SIDECAR, "rank": 0, "call_index": 0,
                "tensor_parallel_size": 1, "context_parallel_size": 1,
                "train_log_probs": [logp.clone()], "rollout_log_probs": [logp.clone()],
                "loss_masks": [torch.ones(4, dtype=torch.int64)], "total_lengths": [6],
                "response_lengths": [4]},
               run / "mismatch-sidecars" / "rank00000.call00000000.pt")
    return diag


def _layer(diag: Path, side: str, layer: int) -> Path:
    return diag / "layers" / f"{side}-{STEM}-layer{layer}-call0.pt"


def _edit_layer(diag: Path, side: str, layer: int, fn: Callable[[dict[str, Any]], None]) -> None:
    path = _layer(diag, side, layer)
    rec = torch.load(path, weights_only=True)
    fn(rec)
    torch.save(rec, path)


def _set(stage: str, row: int, col: int, value: float) -> Callable[[dict[str, Any]], None]:
    def fn(rec: dict[str, Any]) -> None:
        rec["tensors"][stage][row, col] = value
    return fn


def _json(path: Path, fn: Callable[[dict[str, Any]], Any]) -> None:
    value = json.loads(path.read_text())
    fn(value)
    path.write_text(json.dumps(value, sort_keys=True))


def _signed_zero(d: Path) -> None:
    for side, v in (("training", 0.0), ("rollout", -0.0)):
        _edit_layer(d, side, 0, _set("attention_output", 1, 1, v))


def _nan_both(d: Path) -> None:
    for side in ("training", "rollout"):
        _edit_layer(d, side, 1, _set("mlp_output", 2, 0, float("nan")))


def _bf16_rollout(d: Path) -> None:
    def fn(rec: dict[str, Any]) -> None:
        rec["tensors"] = {k: v.to(torch.bfloat16) for k, v in rec["tensors"].items()}
    for layer in (0, 1):
        _edit_layer(d, "rollout", layer, fn)


def _failed_capture(d: Path) -> None:
    (d / "errors").mkdir()
    torch.save({"error": "RuntimeError: hook failed", "side": "rollout"},
               d / "errors" / f"rollout-{STEM}-layer1.pt")


def _extra_training_call(d: Path) -> None:
    rec = torch.load(_layer(d, "training", 1), weights_only=True)
    rec["call"] = 1
    rec["tensors"] = {k: v + 1.0 for k, v in rec["tensors"].items()}
    torch.save(rec, d / "layers" / f"training-{STEM}-layer1-call1.pt")


def _contract(d: Path) -> None:
    def fn(rec: dict[str, Any]) -> None:
        rec["metadata"]["contract"] = {**rec["metadata"]["contract"], "scale": 0.25}
    for layer in (0, 1):
        _edit_layer(d, "rollout", layer, fn)


def _expected_layers(d: Path) -> None:
    def fn(rec: dict[str, Any]) -> None:
        rec["metadata"]["expected_layers"] = 3
    for side in ("training", "rollout"):
        for layer in (0, 1):
            _edit_layer(d, side, layer, fn)


def _schema(d: Path) -> None:
    def fn(rec: dict[str, Any]) -> None:
        rec["schema_version"] = "rlkernel.layer_replay.v2"
    _edit_layer(d, "rollout", 0, fn)


EDITS: dict[str, Callable[[Path], None]] = {
    "equal": lambda d: None,
    "signed_zero_attention": _signed_zero,
    "nan_both_mlp": _nan_both,
    "bf16_rollout": _bf16_rollout,
    "rollout_identity_missing": lambda d: (d / "identity" / f"rollout-{STEM}.json").unlink(),
    "identity_differs": lambda d: _json(d / "identity" / f"rollout-{STEM}.json",
                                        lambda v: v.update(mask="0" * 64)),
    "failed_capture": _failed_capture,
    "weights_file_missing": lambda d: (d / "weights" / f"rollout-{STEM}-layer1.json").unlink(),
    "weights_differ": lambda d: _json(d / "weights" / f"rollout-{STEM}-layer0.json",
                                      lambda v: v.update({k: "f" * 64 for k in v})),
    "head_weights_missing": lambda d: (d / "weights" / f"rollout-{STEM}-head.json").unlink(),
    "rollout_layer_missing": lambda d: _layer(d, "rollout", 1).unlink(),
    "extra_training_call_ignored": _extra_training_call,
    "contract_differs": _contract,
    "expected_layers_wrong": _expected_layers,
    "foreign_layer_schema": _schema,
}
SOURCES = {"layer_one_ulp": "replay-diverged", "head_one_ulp": "replay-head-diverged"}
CASES = (*EDITS, *SOURCES, "nested_under_arms")


def write(name: str, run: Path) -> Path:
    """The run folder of case `name` at `run` (created)."""
    run.mkdir(parents=True)
    if name == "nested_under_arms":
        _base(run, under="arms/r-r")
    elif name in SOURCES:
        _base(run, SOURCES[name])
    else:
        EDITS[name](_base(run))
    return run
