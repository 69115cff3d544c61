"""What the reference jobs write in RL-Kernel's and vime's own forms (docs/artifact-format.md):
readbacks (a hook and a record for every module a side runs, production included, none for
native Megatron logp), per-version weight audits, route lines, the native logp marker, vime's
`step`/`rollout`/`perf` records and the manifest fields RL-Kernel's run validator reads.
Shared by the built-in workload (`job.py`) and the engines job (`engines/job.py`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pytest_rlkernel_matrix.workload.env import SIDES, Env, Route
from pytest_rlkernel_matrix.workload.kernels.r.identity import (
    R_BACKEND_IDS,
    R_BACKEND_PREFIX,
    R_CONTRACT_VERSION,
)
from pytest_rlkernel_matrix.workload.kernels.side import SideKernels
from pytest_rlkernel_matrix.workload.parallel import Grid

TRAINING_SCOPE = "all_exported_parameters"
ROLLOUT_SCOPE = "rollout_loaded_parameters"
NATIVE_LOGP_BACKEND = "vime.utils.ppo_utils.calculate_log_probs_and_entropy"
NATIVE_LOGP_CONTRACT = "vime.native.linear_logp.v1"


def write_json(path: Path, obj: object) -> None:
    """Atomic JSON write: temp file in the same directory, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Readbacks (RL-Kernel's `FrameworkOperatorIntegration`).


def readback(env: Env, route: Route, kernels: SideKernels, platform: str,
             execution_mode: str = "eager", grid: Grid | None = None) -> dict:
    """The RL-Kernel readback dict for one side (``rlkernel.debug_matrix.v1`` plan)."""
    fw = kernels.framework
    grid = grid or Grid()
    plan = {m: {"module": m, "case_id": env.cases[m],
                "training_implementation": env.requested(m, "training"),
                "rollout_implementation": env.requested(m, "rollout")} for m in env.modules}
    operators = {}
    native = native_training_logp(env, route)
    for m in env.modules:
        if m in native:  # native Megatron logp runs outside RL-Kernel: no record, no hook
            continue
        impl = route.claimed[m]
        prov: dict[str, object] = {
            "interface": f"pytest_rlkernel_matrix.workload.kernels.{m}",
            "operator": f"qwen3.{m}", "fallback": any(f["module"] == m for f in route.fallbacks),
            "execution": {"runtime_platform": platform,
                          "triton_used": kernels.module(m).uses_triton,
                          "tp_world_size": grid.tp,
                          "cp_world_size": grid.cp if route.side == "training" else 1,
                          "rank": grid.rank,
                          "collective_backend": grid.backend}}
        if impl == "rl_kernel":
            prov.update(contract_version=R_CONTRACT_VERSION, arithmetic_contract="bitwise",
                        actual_backend=R_BACKEND_IDS[m])
        operators[m] = {
            "framework": fw, "target": route.side, "module": m, "case_id": env.cases[m],
            "implementation": impl,
            "backend_id": R_BACKEND_IDS[m] if impl == "rl_kernel" else f"{fw}.production.{m}",
            "call_count": kernels.module(m).call_count, "execution_mode": execution_mode,
            "provenance": prov}
    decisions = [{"capability": "device", "requested": platform, "supported": False,
                  "passed": False, "reason": why} for why in route.unsupported.values()]
    return {
        "framework": fw, "target": route.side, "pid": os.getpid(), "run_id": env.run_id,
        "mode": env.mode, "runtime_policy": runtime_policy(platform),
        "plan": {"schema_version": "rlkernel.debug_matrix.v1", "cases": plan},
        "installed_hooks": {m: f"pytest_rlkernel_matrix.workload.kernels.{m}"
                            for m in env.modules if m not in native},
        "fallbacks": route.fallbacks,
        "profile_calls": {m: kernels.module(m).call_count for m in env.modules},
        "operators": operators,
        "capability": {"status": "unsupported" if decisions else "resolved",
                       "capability_decisions": decisions},
    }


def runtime_policy(platform: str) -> dict[str, object]:
    """What the workload's own R is (not RL-Kernel's): its backend ids' prefix, the platform
    its records report, and Triton, which its GPU R path uses by design."""
    return {"schema_version": "rlk.runtime_policy.v1",
            "owner": "pytest-rlkernel-matrix reference workload",
            "backend_prefix": R_BACKEND_PREFIX, "platform": platform,
            "triton_allowed": platform in ("cuda", "rocm")}


def native_training_logp(env: Env, route: Route) -> set[str]:
    """`{"logp"}` when this side is training and its logp is the native (P) one."""
    if route.side == "training" and route.requested.get("logp") == "production":
        return {"logp"}
    return set()


def write_readbacks(env: Env, routes: dict[str, Route], kernels: dict[str, SideKernels],
                    platform: str, modes: dict[str, str] | None = None,
                    grid: Grid | None = None,
                    patch: Callable[[dict, str], dict] | None = None) -> None:
    """One file per process and side, as RL-Kernel writes them (every rank its own);
    `patch(readback, side)` lets a job name its own extension points."""
    if env.mode == "off":
        return
    for side in SIDES:
        k = kernels[side]
        rb = readback(env, routes[side], k, platform, (modes or {}).get(side, "eager"), grid)
        write_json(env.readback_dir / f"{k.framework}-{side}-{os.getpid()}.json",
                   patch(rb, side) if patch else rb)




# ---------------------------------------------------------------------------------------------
# Weight audits, route lines, markers, vime's records, the manifest.


def _tensor_audit(t: Tensor) -> dict[str, Any]:
    c = t.detach().contiguous().cpu()
    return {"sha256": hashlib.sha256(c.view(torch.uint8).numpy()).hexdigest(),
            "shape": list(c.shape), "dtype": str(c.dtype)}


def weight_audit(weights: Mapping[str, Tensor], version: str, scope: str) -> dict[str, Any]:
    """One version's audit: per tensor sha256 of its bytes (uint8 view), shape and dtype, and
    the sha256 of `json.dumps(tensors, sort_keys=True)` (RL-Kernel's weight audit). The tensors
    are hashed in threads (hashlib and the device copy release the GIL): 752M parameters took
    3.7-4.2 s per step in one thread on the H200 box, debug time every process pays."""
    workers = min(8, os.cpu_count() or 1, max(1, len(weights)))
    with ThreadPoolExecutor(workers) as pool:
        tensors = dict(zip(weights, pool.map(_tensor_audit, weights.values()), strict=True))
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


def route_lines(env: Env, routes: Mapping[str, Route], frameworks: Mapping[str, str],
                platform: str) -> list[str]:
    """Both sides' route lines (one per module, RL-Kernel's form), and vime's marker in place of
    the line for native Megatron logp (which RL-Kernel never routes)."""
    out: list[str] = []
    for s in SIDES:
        r, fw = routes[s], frameworks[s]
        for m in env.modules:
            if m in native_training_logp(env, r):
                out.append(native_logp_marker(platform))
                continue
            impl = r.claimed[m]
            bid = R_BACKEND_IDS[m] if impl == "rl_kernel" else f"{fw}.production.{m}"
            fb = any(f["module"] == m for f in r.fallbacks)
            out.append(route_line(fw, s, m, r.requested[m], bid, fb))
    return out


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


def step_lines(step: int, total_lengths: Sequence[int], train_lp: Sequence[Tensor],
               rollout_lp: Sequence[Tensor], max_new: Sequence[int], *, t_roll: float,
               t_train: float, t_step: float, t_sync: float, peak: int, world: int = 1,
               rollout_extra: Mapping[str, float] | None = None,
               step_extra: Mapping[str, float] | None = None,
               t_debug: float | None = None) -> list[str]:
    """One step's vime lines: `rollout N`, `step N` (per-sample means) and the two `perf N`.

    ``t_debug``: the job's own debug work of the step (weight-audit hashing), kept out of
    `perf/step_time` and reported as `perf/rlk_debug_time` (our key; upstream's readers ignore
    keys they do not know)."""
    resp = [int(x.numel()) for x in rollout_lp]
    active = sum(resp)
    truncated = sum(int(n == cap) for n, cap in zip(resp, max_new, strict=True))
    perf_train = {
        "perf/step_time": round(t_step, 6), "perf/train_time": round(t_train, 6),
        "perf/actor_train_time": round(t_train, 6), "perf/update_weights_time": round(t_sync, 6),
        "perf/actor_train_tok_per_s": round(active / t_train, 3),
        "perf/tokens_per_sec": round(active / t_step, 3), "perf/peak_memory_bytes": peak}
    if t_debug is not None:
        perf_train["perf/rlk_debug_time"] = round(t_debug, 6)
    return [
        f"rollout {step}: " + repr({**rollout_record(total_lengths, resp, truncated),
                                    **(rollout_extra or {})}),
        f"step {step}: " + repr({**step_record(train_lp, rollout_lp), **(step_extra or {})}),
        f"perf {step}: " + repr({"perf/rollout_time": round(t_roll, 6),
                                 "perf/tokens_per_gpu_per_sec": round(active / t_roll / world,
                                                                      3)}),
        f"perf {step}: " + repr(perf_train)]


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
