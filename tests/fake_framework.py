"""Test-only stand-in for an RL-Kernel + vime launcher: obeys the env contract and writes
RL-Kernel-format artifacts, with one planted fault chosen by `FAKE_SCENARIO`.

Scenarios: clean (default), silent_fallback, recorded_fallback, unsupported, contract_mismatch,
stale_weight, crash, hang, nan, missing_readback, build_failure, no_perf, profiler, slow,
no_contract (no operator declares an arithmetic_contract).
`FAKE_STEP_TIMES` / `FAKE_BUSY_SECONDS`: measured step times to print and seconds to stay alive;
`FAKE_SLOW=<module>:<side>:<factor>` plants a slowdown of that side's phase where the module runs
R there, `FAKE_JITTER=<j>` varies each phase time by up to +-j (per process and step);
`FAKE_MEASURED_SCENARIO`: the scenario of measured runs (`RLK_MATRIX_RUN_ROLE=measured`).
`FAKE_ONLY_WHEN=<cases key>` (e.g. `A-RR_F-RR_L-RR`) plants the fault in that run only.
A P side adds a deterministic drift to that side's logprobs, so P cells drift and R/R does not.

The logprob sidecar is a real `torch.save` file. Its content depends only on (cases, mode,
scenario, sample count), so with `FAKE_SIDECAR_CACHE=<dir>` (set for the whole test run by
tests/conftest.py) the first run of a combination saves it there and later runs copy those bytes
instead of importing torch again (~1.5 s of CPU per cell on the 2-core box).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODULES = ("attention", "ffn", "logp")
BACKENDS = {
    "attention": "rlkernel.attention.deterministic.v1",
    "ffn": "rlkernel.ffn.qwen3.deterministic.v1",
    "logp": "rlkernel.linear_logp.bitwise.v1",
}
SIDES = {"training": "megatron", "rollout": "vllm"}


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _sidecar(target: Path, cases: dict[str, str], mode: str, scenario: str, n_samples: int,
             cache: str | None) -> None:
    """Write the rank-0 logprob sidecar (a real torch.save file), from the cache when it fits."""
    shaping = scenario if scenario in ("silent_fallback", "contract_mismatch", "nan") else "clean"
    key = hashlib.sha256(json.dumps([cases, mode, shaping, n_samples, "v1"],
                                    sort_keys=True).encode()).hexdigest()[:24]
    cached = Path(cache) / f"{key}.pt" if cache else None
    if cached is not None and cached.is_file():
        shutil.copyfile(cached, target)
        return
    import torch

    gen = torch.Generator().manual_seed(1234)
    train_lp, roll_lp, masks, totals, resp = [], [], [], [], []
    for i in range(n_samples):
        r = 16 + i
        base = -torch.rand(r, generator=gen, dtype=torch.float32) * 5
        t, ro = base.clone(), base.clone()
        for j, m in enumerate(MODULES):
            if cases[m][0] == "P" or mode == "off":
                t = t + (1e-3 * (j + 1)) * torch.sin(torch.arange(r, dtype=torch.float32) + i)
            if cases[m][2] == "P" or mode == "off":
                ro = ro + (2e-3 * (j + 1)) * torch.cos(torch.arange(r, dtype=torch.float32) + i)
        if scenario in ("silent_fallback", "contract_mismatch"):
            ro = ro + 1e-4
        if scenario == "nan" and i == 0:
            t[3] = float("nan")
        mask = torch.ones(r, dtype=torch.float32)
        mask[:2] = 0
        train_lp.append(t)
        roll_lp.append(ro)
        masks.append(mask)
        totals.append(r + 10)
        resp.append(r)

    torch.save({
        "schema_version": "rlkernel.vime_rocm_attention_mismatch_sidecar.v1", "rank": 0,
        "call_index": 0,
        "tensor_parallel_size": 1, "context_parallel_size": 1, "train_log_probs": train_lp,
        "rollout_log_probs": roll_lp, "loss_masks": masks, "total_lengths": totals,
        "response_lengths": resp,
    }, target)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
        shutil.copyfile(target, tmp)
        os.replace(tmp, cached)


def _audit(version: str, scope: str, content: str) -> dict[str, object]:
    tensors = {name: {"sha256": hashlib.sha256(f"{name}:{content}".encode()).hexdigest(),
                      "shape": [64, 64], "dtype": "torch.bfloat16"}
               for name in ("model.embed_tokens.weight", "lm_head.weight")}
    digest = hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest()
    return {"version": version, "scope": scope, "sha256": digest,
            "tensor_count": len(tensors), "tensors": tensors}


def _traces(where: Path, cases: dict[str, str]) -> None:
    """vLLM's and Megatron's torch.profiler chrome traces (no rlk ranges, GPU kernels only):
    R attention on a side takes 300 us a call there, P 200 us."""
    import gzip

    where.mkdir(parents=True, exist_ok=True)
    for side, name, letter in (("rollout", "vllm_worker0", 1), ("training", "megatron_rank0", 0)):
        attn = 300.0 if cases["attention"].split("/")[letter] == "R" else 200.0
        kernels = [("flash_fwd_kernel", attn)] * 10 + [("sm90_xmma_gemm_bf16", 500.0)] * 10 + [
            ("ncclDevKernel_AllReduce_Sum_bf16", 50.0)] * 4
        events = [{"ph": "X", "cat": "kernel", "name": k, "pid": 0, "tid": 7,
                   "ts": 1000.0 * i, "dur": d, "args": {"correlation": i}}
                  for i, (k, d) in enumerate(kernels)]
        with gzip.open(where / f"{name}.{side}.pt.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": events}, f)


def main() -> int:
    env = os.environ
    art = Path(env["RL_KERNEL_ARTIFACT_DIR"])
    mode = env.get("RL_KERNEL_MODE", "strict")
    cases = {m: env.get(f"RL_KERNEL_{m.upper()}_CASE", "P/P").strip().upper() for m in MODULES}
    key = "_".join(f"{m[0].upper()}-{cases[m].replace('/', '')}" for m in MODULES)
    only = env.get("FAKE_ONLY_WHEN")
    scenario = env.get("FAKE_SCENARIO", "clean") if (not only or only == key) else "clean"
    if env.get("RLK_MATRIX_RUN_ROLE") == "measured" and env.get("FAKE_MEASURED_SCENARIO"):
        scenario = env["FAKE_MEASURED_SCENARIO"] if (not only or only == key) else "clean"
    print(f"fake framework: run {env.get('RL_KERNEL_RUN_ID')} cases {key} scenario {scenario}")

    if scenario == "crash":
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    if scenario == "hang":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        time.sleep(600)
    if scenario == "slow":
        for i in range(5):
            print(f"rollout {i}: {{'rollout/response_lengths': 1.0}}", flush=True)
            time.sleep(0.6)
    if scenario == "build_failure":
        print("ImportError: cannot import name '_C' from 'rl_engine' (extension unavailable)")
        return 5

    sidecars = Path(env.get("RL_KERNEL_MISMATCH_SIDECAR_DIR", art / "mismatch-sidecars"))
    sidecars.mkdir(parents=True, exist_ok=True)
    _sidecar(sidecars / "rank00000.call00000000.pt", cases, mode, scenario,
             int(env.get("FAKE_SAMPLES", "8")), env.get("FAKE_SIDECAR_CACHE"))

    # RL-Kernel's weight audit: one file per exported version from training rank 0, plus the
    # rollout side's record of what it loaded (stale_weight: an older copy).
    audit = Path(env.get("RL_KERNEL_WEIGHT_AUDIT_DIR", art / "weight-audit"))
    _write(audit / "0.json", _audit("0", "all_exported_parameters", "fresh"))
    _write(audit / "rollout" / "0.json", _audit(
        "0", "rollout_loaded_parameters", "stale" if scenario == "stale_weight" else "fresh"))

    readbacks = Path(env.get("RL_KERNEL_READBACK_DIR", art / "readbacks"))
    exit_code = 0
    if mode != "off":
        for side, fw in SIDES.items():
            if scenario == "missing_readback" and side == "rollout":
                continue
            operators, fallbacks, hooks = {}, [], {}
            capability = None
            for m in MODULES:
                letter = cases[m][0] if side == "training" else cases[m][2]
                if m == "logp" and side == "training" and letter == "P":
                    # native Megatron logp: no hook, no record, vime's marker line instead
                    print("linear_logp native active: backend_id=vime.utils.ppo_utils."
                          "calculate_log_probs_and_entropy contract_id=vime.native."
                          "linear_logp.v1 route=unconfigured device=cpu")
                    continue
                hooks[m] = f"fake.hooks.{m}"
                impl = "rl_kernel" if letter == "R" else "production"
                fb = False
                if m == "attention" and side == "rollout" and letter == "R":
                    if scenario == "recorded_fallback":
                        impl, fb = "production", True
                        fallbacks.append({"module": m, "reason": "vllm attention backend lacks "
                                          "deterministic kernel for this head_dim"})
                    if scenario == "unsupported":
                        capability = {"status": "unsupported", "capability_decisions": [
                            {"capability": "device", "requested": "rocm", "supported": False,
                             "passed": False, "reason": "no ROCm build of this backend"}]}
                        print("[RL-Kernel][unsupported] module=attention side=rollout "
                              "class=platform_unsupported reason=no ROCm build of this backend")
                        exit_code = 4 if mode == "strict" else 0
                backend = BACKENDS[m] if impl == "rl_kernel" else f"{fw}.production.{m}"
                prov: dict[str, object] = {
                    "interface": "fake", "operator": m, "fallback": fb,
                    "execution": {"runtime_platform": "cpu", "tp_world_size": 1,
                                  "cp_world_size": 1},
                }
                if impl == "rl_kernel" and scenario != "no_contract":
                    prov["arithmetic_contract"] = "bitwise"
                    prov["contract_version"] = "fake.bitwise.v1"
                operators[m] = {"framework": fw, "target": side, "module": m,
                                "case_id": cases[m], "implementation": impl,
                                "backend_id": backend, "call_count": 7,
                                "execution_mode": "eager", "provenance": prov}
                requested = "rl_kernel" if letter == "R" else "production"
                print(f"[RL-Kernel][route] framework={fw} target={side} module={m} "
                      f"requested={requested} actual={backend} "
                      f"fallback={'true' if fb else 'false'}")
            data: dict[str, object] = {
                "framework": fw, "target": side,
                "plan": {"schema_version": "rlkernel.debug_matrix.v1", "cases": {}},
                "installed_hooks": hooks, "fallbacks": fallbacks, "profile_calls": {},
                "operators": operators,
            }
            if capability:
                data["capability"] = capability
            _write(readbacks / f"{fw}-{side}-{os.getpid()}.json", data)
    else:
        print("contract_id=vime.native.linear_logp.v1")

    if scenario == "profiler":
        print("[RL-Kernel][contamination] profiler=1")
    if env.get("RL_KERNEL_PROFILE") == "1":  # a profile run: the engines' own torch traces
        _traces(Path(env["RL_KERNEL_PROFILE_DIR"]), cases)
    if scenario != "no_perf":
        # FAKE_STEP_TIMES="1.0,2.5,...": one perf record per step with that step time (rollout
        # 46%, training 38% of it); FAKE_BUSY_SECONDS keeps the process alive that long.
        # FAKE_SLOW=<module>:<side>:<factor>: the phase of that side takes <factor> times as
        # long wherever that module runs R on that side (vime-style perf lines only, as the
        # drill RLK_REF_FAULT=slow:... does for real kernels); FAKE_JITTER=<j>: each phase time
        # times a uniform (1 +- j) drawn per process and step (real between-process variation).
        times = [float(t) for t in env.get("FAKE_STEP_TIMES", "3.25").split(",") if t.strip()]
        slow = {"rollout": 1.0, "training": 1.0}
        if env.get("FAKE_SLOW"):
            module, side, factor = env["FAKE_SLOW"].split(":")
            if cases[module][0 if side == "training" else 2] == "R":
                slow[side] = float(factor)
        import random

        rng = random.Random(f"{os.getpid()}-{time.time_ns()}")
        jitter = float(env.get("FAKE_JITTER", "0"))
        for i, t in enumerate(times):
            def jit() -> float:
                return 1.0 + rng.uniform(-jitter, jitter)
            rollout = t * 1.5 / 3.25 * slow["rollout"] * jit()
            train = t * 1.25 / 3.25 * slow["training"] * jit()
            step = t if not (env.get("FAKE_SLOW") or jitter) else rollout + train + 0.5
            print(f"perf {i}: {{'perf/rollout_time': {rollout!r}, "
                  "'perf/tokens_per_gpu_per_sec': 1000.0}")
            print(f"perf {i}: {{'perf/step_time': {step!r}, 'perf/train_time': {train!r}, "
                  "'perf/update_weights_time': 0.5, 'perf/tokens_per_sec': 800.0, "
                  "'perf/peak_memory_bytes': 1048576}")
    time.sleep(float(env.get("FAKE_BUSY_SECONDS", "0")))
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
