"""What the reference job writes in RL-Kernel's and vime's own forms (docs/artifact-format.md):
per-version weight audits, route lines, the native logp marker, vime's `step`/`rollout`/`perf`
records and the manifest fields RL-Kernel's run validator reads.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

TRAINING_SCOPE = "all_exported_parameters"
ROLLOUT_SCOPE = "rollout_loaded_parameters"
NATIVE_LOGP_BACKEND = "vime.utils.ppo_utils.calculate_log_probs_and_entropy"
NATIVE_LOGP_CONTRACT = "vime.native.linear_logp.v1"


def weight_audit(weights: Mapping[str, Tensor], version: str, scope: str) -> dict[str, Any]:
    """One version's audit: per tensor sha256 of its bytes (uint8 view), shape and dtype, and
    the sha256 of `json.dumps(tensors, sort_keys=True)` (RL-Kernel's weight audit)."""
    tensors: dict[str, dict[str, Any]] = {}
    for name, t in weights.items():
        c = t.detach().contiguous().cpu()
        tensors[name] = {"sha256": hashlib.sha256(c.view(torch.uint8).numpy()).hexdigest(),
                         "shape": list(c.shape), "dtype": str(c.dtype)}
    if not tensors:
        raise RuntimeError(f"no tensors to audit for weight version {version}")
    digest = hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest()
    return {"version": version, "scope": scope, "sha256": digest,
            "tensor_count": len(tensors), "tensors": tensors}


def write_weight_audits(audit_dir: Path, version: str, exported: Mapping[str, Tensor],
                        loaded: Mapping[str, Tensor]) -> None:
    """`<dir>/<version>.json` (what training exported; call on training rank 0 only) and
    `<dir>/rollout/<version>.json` (what the rollout engine loaded), each written atomically."""
    for path, weights, scope in ((audit_dir / f"{version}.json", exported, TRAINING_SCOPE),
                                 (audit_dir / "rollout" / f"{version}.json", loaded,
                                  ROLLOUT_SCOPE)):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(weight_audit(weights, version, scope), indent=2) + "\n")
        os.replace(tmp, path)


def route_line(framework: str, target: str, module: str, requested: str, actual: str,
               fallback: bool) -> str:
    """RL-Kernel's route line (`requested` is `production` or `rl_kernel`)."""
    return (f"[RL-Kernel][route] framework={framework} target={target} module={module} "
            f"requested={requested} actual={actual} fallback={str(fallback).lower()}")


def native_logp_marker(device: str) -> str:
    """vime's line for native Megatron logp (which writes no readback record)."""
    return (f"linear_logp native active: backend_id={NATIVE_LOGP_BACKEND} "
            f"contract_id={NATIVE_LOGP_CONTRACT} route=unconfigured device={device}")


def sidecar_marker(logp_case: str) -> str:
    return f"rlkernel mismatch sidecar active: logp_case={logp_case}"


def step_record(train_lp: Sequence[Tensor], rollout_lp: Sequence[Tensor]) -> dict[str, float]:
    """vime's `step N` logprob metrics: per-sample values, averaged over the step's samples
    (a total is the value times the global batch size)."""
    n = len(train_lp)
    mis = absd = mx = numel = 0.0
    for a, b in zip(train_lp, rollout_lp, strict=True):
        d = (a.float() - b.float()).abs()
        mis += float(torch.ne(a, b).sum())
        absd += float(d.mean()) if d.numel() else 0.0
        mx += float(d.max()) if d.numel() else 0.0
        numel += a.numel()
    return {"train/train_rollout_logprob_abs_diff": absd / n,
            "train/train_current_rollout_logprob_mismatch_count": mis / n,
            "train/train_current_rollout_logprob_max_abs_diff": mx / n,
            "train/train_current_rollout_logprob_numel": numel / n}


def rollout_record(total_lengths: Sequence[int], response_lengths: Sequence[int],
                   truncated: int) -> dict[str, float]:
    """vime's `rollout N` record: per-sample means, numbers not lists."""
    n = len(response_lengths)
    return {"rollout/response_lengths": sum(response_lengths) / n,
            "rollout/total_lengths": sum(total_lengths) / n,
            "rollout/truncated_ratio": truncated / n}


def manifest_fields(cases: Mapping[str, str], *, steps: int, global_batch_size: int, tp: int,
                    cp: int, world: int) -> dict[str, Any]:
    """The fields of RL-Kernel's run manifest that apply to this job (`arm`, `num_rollout`,
    `batching`, topology counts, `algorithm`); its 8-GPU command-line facts do not apply."""
    return {
        "arm": {"attention_case": cases["attention"], "ffn_case": cases["ffn"],
                "logp_case": cases["logp"], "group": "rlk-reference",
                "framework_use_rollout_logprobs": False},
        "num_rollout": steps,
        "batching": {"global_batch_size": global_batch_size},
        "algorithm": {"advantage_estimator": "none (logprob consistency step)",
                      "require_updates": False},
        "topology": {"gpus": world, "actor_gpus": world, "rollout_gpus": world,
                              "pp": 1, "colocate": True, "offload_rollout": False,
                              "offload_train": False, "tp": tp, "cp": cp,
                              "rollout_tp": tp, "rollout_cp": 1, "rollout_gpus_per_engine": tp,
                              "rollout_engines": world // tp},
    }
