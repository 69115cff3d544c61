"""The reference RL step: weight sync, rollout (prefill + decode), training recompute, artifacts.

One process = one matrix cell, configured by the RL-Kernel environment contract (see
``docs/artifact-format.md``). Rollout behaves like vLLM (per-prompt prefill, token-by-token
decode against a KV cache with a shrinking batch, seeded temperature/top-p sampling, reporting
the sampled tokens' logprobs); training behaves like Megatron (full-sequence forwards over
differently packed, padded micro-batches, loss mask on response tokens).

Multi-rank (``--tp``/``--cp``, or ``RL_KERNEL_MATRIX_TP``/``RL_KERNEL_MATRIX_CP`` from the
plugin): one command starts ``tp * cp`` rank processes (see ``parallel.py``). Training is a
TP x CP grid (Megatron: column/row-parallel projections, zigzag context parallelism with the
keys/values all-gathered for attention, vocab-parallel logp); rollout is vLLM-style TP over the
same TP group and is replicated across CP ranks (rollout engines have no CP). Every rank writes
its own readbacks and ``mismatch-sidecars/rank{rank:05d}.call00000000.pt``: TP replicas hold the
same samples, CP ranks hold zigzag slices of each response at logit positions (RL-Kernel's layout).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor
from torch.profiler import record_function

from pytest_rlkernel_matrix.workload.env import (
    RUN_DEFAULTS,
    SIDES,
    Env,
    FaultDrill,
    UsageError,
    backward_mode,
    intra_op_threads,
    resolve_route,
)
from pytest_rlkernel_matrix.workload.evidence.artifacts import (
    Rollout,
    emit_step,
    write_json,
    write_probes,
    write_sidecar,
)
from pytest_rlkernel_matrix.workload.evidence.probe import PERTURB_FACTOR, ProbeRequest
from pytest_rlkernel_matrix.workload.evidence.profiling import (
    STEP_TIMING,
    ProfileRequest,
    instrument,
)
from pytest_rlkernel_matrix.workload.evidence.upstream import (
    manifest_fields,
    native_training_logp,
    readback,
    route_lines,
    write_readbacks,
    write_weight_audits,
)
from pytest_rlkernel_matrix.workload.factors import Factors, processed_selected
from pytest_rlkernel_matrix.workload.kernels.p import native
from pytest_rlkernel_matrix.workload.kernels.r.autograd import BACKWARD_METHODS
from pytest_rlkernel_matrix.workload.kernels.side import (
    MODULES,
    SideKernels,
    Tiling,
    r_backend,
    runtime_platform,
)
from pytest_rlkernel_matrix.workload.model import (
    PRESETS,
    ModelConfig,
    Qwen3,
    checkpoint_fingerprint,
    init_weights,
    load_checkpoint,
    shard_weights,
)
from pytest_rlkernel_matrix.workload.parallel import (
    Grid,
    LaunchError,
    init_grid,
    is_rank_process,
    launch,
    shutdown,
    zigzag_index,
)
from pytest_rlkernel_matrix.workload.rollout import graphs as graphs_mod
from pytest_rlkernel_matrix.workload.rollout.graphs import DecodeRunner
from pytest_rlkernel_matrix.workload.rollout.sampling import (
    FAST_PATHS,
    finish,
    sample_top_p,
    sampler_mode,
)
from pytest_rlkernel_matrix.workload.training import budget, rl

__all__ = ["Rollout", "native_training_logp", "readback", "run_rollout", "run_training",
           "write_json", "write_readbacks", "write_sidecar"]

EXIT_USAGE, EXIT_FALLBACK, EXIT_UNSUPPORTED = 2, 3, 4


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# The RL step.


def run_rollout(model: Qwen3, k: SideKernels, prompts: list[Tensor], max_new: list[int],
                temperature: float, top_p: float, gen: torch.Generator,
                graphs: bool = False, ignore_eos: bool = False, noise: Tensor | None = None,
                processed: bool = False) -> Rollout:
    """vLLM-style generation: per-prompt prefill, then batched decode that shrinks.

    ``graphs``: decode steps replay CUDA/HIP graphs at fixed batch buckets (``graphs.py``).
    Under TP every rank samples from the same gathered logprobs with the same seed, so every
    rank holds the same tokens (vLLM samples once and broadcasts; the result is the same).
    ``noise [n, max_new]``: the sampling uniforms (default: drawn from ``gen``); ``processed``:
    report logprobs after top-p renormalization (``factors.py``)."""
    dev = prompts[0].device
    if noise is None:
        noise = torch.rand((len(prompts), max(max_new)), generator=gen, device=gen.device)
    noise = noise.to(dev)
    step_i = 0
    eos = -1 if ignore_eos else model.cfg.eos_token_id
    lengths = torch.tensor([p.numel() for p in prompts], device=dev)
    width = int(lengths.max())
    batch = torch.zeros(len(prompts), width, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):  # right-padded batched prefill (causal: padding is inert)
        batch[i, :p.numel()] = p
    caches = model.new_cache(len(prompts))
    pos = torch.arange(width, device=dev)[None].expand(len(prompts), width)
    tap = k.tap if k.tap is not None and k.tap.recording else None
    if tap is not None:  # probe: name the rows (sample, position) of each forward
        tap.rows([(i, j) if j < p.numel() else None for i, p in enumerate(prompts)
                  for j in range(width)])
    hp = model.hidden(k, batch, pos, caches)
    h = hp[torch.arange(len(prompts), device=dev), lengths - 1]
    if tap is not None:
        tap.rows([(i, p.numel() - 1) for i, p in enumerate(prompts)])
        graphs = False  # the probe copies rows out on the host: eager decode
    span_unit = graphs_mod.SPAN_UNIT if k.attention.implementation == "production" else 0
    runner = (DecodeRunner(model, k, caches, temperature, True, span_unit, top_p) if graphs
              else None)
    out_tok: list[list[int]] = [[] for _ in prompts]
    out_lp: list[list[float]] = [[] for _ in prompts]  # fp32 values, exact as Python floats
    active = torch.arange(len(prompts), device=dev)
    lp = model.logprobs(k, h, temperature)
    drawn = None  # the sampler's first round, taken inside the decode graph (graphs.py)
    while True:
        with record_function("rlk.sample"):
            u = noise[active, step_i]
            tok = sample_top_p(lp, top_p, u) if drawn is None else finish(drawn, top_p, u)
            chosen = (processed_selected(lp, tok, top_p) if processed
                      else lp.gather(-1, tok[:, None])[:, 0])
            sel = chosen.float().cpu().tolist()
            step_i += 1
        done = []
        for i, t, s in zip(active.tolist(), tok.tolist(), sel, strict=True):
            out_tok[i].append(t)
            out_lp[i].append(s)
            done.append(t == eos or len(out_tok[i]) >= max_new[i])
        keep = torch.tensor([not d for d in done], device=dev)
        if not bool(keep.any()):
            break
        if not bool(keep.all()):  # finished sequences leave the batch; their cache is freed
            rows = keep.nonzero()[:, 0]
            active, tok, lengths = active[rows], tok[rows], lengths[rows]
            if runner is None:
                caches = [c.select(rows) for c in caches]
            else:
                runner.keep(rows)
        if tap is not None:
            tap.rows(list(zip(active.tolist(), lengths.tolist(), strict=True)))
        with record_function("rlk.decode"):
            if runner is None:
                h = model.hidden(k, tok[:, None], lengths[:, None], caches)[:, 0]
                lp = model.logprobs(k, h, temperature)
            else:
                lp, drawn = runner.step(tok, lengths, width + step_i, noise[active, step_i])
        lengths = lengths + 1
    return Rollout([torch.cat([p, torch.tensor(t, device=dev)])
                    for p, t in zip(prompts, out_tok, strict=True)],
                   [p.numel() for p in prompts],
                   [torch.tensor(x, dtype=torch.float32) for x in out_lp],
                   runner.execution_mode if runner else "eager",
                   runner.fallback_reason if runner else "")


def run_training(model: Qwen3, k: SideKernels, ro: Rollout, micro_batch: int, temperature: float,
                 order: list[int], grid: Grid | None = None,
                 learn: rl.Learn | None = None) -> list[Tensor]:
    """Megatron-style recompute: padded micro-batches in ``order``, full-sequence forwards.

    Context parallel: each micro-batch is padded to a multiple of ``2*cp`` and split zigzag;
    attention all-gathers keys/values across the CP group, and the per-position logprobs are
    all-gathered back (copies) so every rank can cut its RL-Kernel sidecar slice.

    ``learn``: each micro-batch's GRPO loss (``rl.pg_loss``) is back-propagated right after its
    forward (gradients accumulate in the weights' ``.grad``)."""
    grid = grid or Grid()
    result: list[Tensor] = [torch.empty(0)] * len(ro.tokens)
    for s in range(0, len(order), micro_batch):
        if learn is None:
            with torch.no_grad():
                lp = _mb_logprobs(model, k, ro, order[s:s + micro_batch], temperature, grid)
        else:
            lp = _mb_learn(model, k, ro, order[s:s + micro_batch], temperature, grid, learn)
        for r, i in enumerate(order[s:s + micro_batch]):
            p, n = ro.prompt_lengths[i], ro.tokens[i].numel()
            result[i] = lp[r, p - 1:n - 1].float().cpu()
    return result


def _mb_learn(model: Qwen3, k: SideKernels, ro: Rollout, mb: list[int], temperature: float,
              grid: Grid, learn: rl.Learn) -> Tensor:
    """One micro-batch's forward with autograd, its loss and backward; the logprobs returned
    are the training side's own forward (on the Triton R path: the Triton forward itself, its
    backward ``autograd.py``'s recompute; a separate no-grad forward when the loss runs on
    other kernels, ``RLK_REF_R_BACKWARD=tiled``)."""
    gk = learn.grad_kernels or k
    if gk is not k:
        with torch.no_grad():
            reported = _mb_logprobs(model, k, ro, mb, temperature, grid)
    k.clear_cache(), gk.clear_cache()  # derived weights carry this micro-batch's graph
    with torch.enable_grad(), rl.deterministic(ro.tokens[0].device):
        lp = _mb_logprobs(model, gk, ro, mb, temperature, grid)
        mask = torch.zeros_like(lp)
        for r, i in enumerate(mb):
            mask[r, ro.prompt_lengths[i] - 1:ro.tokens[i].numel() - 1] = 1.0
        adv = torch.tensor([learn.advantages[i] for i in mb], dtype=torch.float32,
                           device=lp.device)
        loss = rl.pg_loss(lp.float(), mask, adv, learn.n_active)
        loss.backward()
    gk.clear_cache()
    learn.loss += float(loss.detach())
    return reported if gk is not k else lp.detach()


def _mb_logprobs(model: Qwen3, k: SideKernels, ro: Rollout, mb: list[int], temperature: float,
                 grid: Grid) -> Tensor:
    """Selected-token logprobs ``[len(mb), T]`` of one padded micro-batch."""
    dev = ro.tokens[0].device
    cp = grid.cp
    t = max(ro.tokens[i].numel() for i in mb)
    t = -(-t // (2 * cp)) * (2 * cp) if cp > 1 else t
    toks = torch.zeros(len(mb), t, dtype=torch.long, device=dev)
    for r, i in enumerate(mb):
        toks[r, :ro.tokens[i].numel()] = ro.tokens[i]
    targets = torch.cat([toks[:, 1:], toks[:, :1] * 0], dim=1)
    if k.tap is not None and k.tap.recording:
        cols = (zigzag_index(t, cp, grid.cp_rank, dev) if cp > 1
                else torch.arange(t, device=dev)).tolist()
        k.tap.rows([(i, j) if j < ro.tokens[i].numel() else None for i in mb for j in cols])
    if cp > 1:
        return _cp_selected_logprobs(model, k, toks, targets, temperature, grid)
    pos = torch.arange(t, device=dev)[None].expand(len(mb), t)
    h = model.hidden(k, toks, pos, None)
    return model.selected_logprobs(k, h.reshape(-1, h.shape[-1]), targets.reshape(-1),
                                   temperature).reshape(len(mb), t)


def _cp_selected_logprobs(model: Qwen3, k: SideKernels, toks: Tensor, targets: Tensor,
                          temperature: float, grid: Grid) -> Tensor:
    """This CP rank's zigzag positions forward, logprobs of every position gathered back."""
    b, t = toks.shape
    dev = toks.device
    where = [zigzag_index(t, grid.cp, r, dev) for r in range(grid.cp)]
    mine = where[grid.cp_rank]

    def place(local: Tensor) -> Tensor:
        full = local.new_empty(b, t, *local.shape[2:])
        for r, part in enumerate(grid.cp_group.gather(local)):
            full[:, where[r]] = part
        return full

    def kv_gather(kl: Tensor, vl: Tensor) -> tuple[Tensor, Tensor]:
        return place(kl), place(vl)

    h = model.hidden(k, toks[:, mine], mine[None].expand(b, -1), None,
                     kv_gather=kv_gather)
    lp = model.selected_logprobs(k, h.reshape(-1, h.shape[-1]), targets[:, mine].reshape(-1),
                                 temperature).reshape(b, -1)
    return place(lp)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pytest_rlkernel_matrix.workload",
                                 description=__doc__)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--checkpoint", default=None, help="HF dir: config.json + *.safetensors")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--min-prompt-len", type=int, default=8)
    ap.add_argument("--max-prompt-len", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--micro-batch-size", type=int, default=None,
                    help="samples per training micro-batch (default: chosen by tokens and "
                    "memory, workload/training/budget.py; a size that cannot fit is an error "
                    "up front)")
    ap.add_argument("--tp", type=int, default=None,
                    help="tensor-parallel size (default: RL_KERNEL_MATRIX_TP from the plugin, "
                    "else 1)")
    ap.add_argument("--cp", type=int, default=None,
                    help="context-parallel size of the training side (default: "
                    "RL_KERNEL_MATRIX_CP from the plugin, else 1)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="generate exactly the drawn number of tokens (vLLM's ignore_eos)")
    ap.add_argument("--lr", type=float, default=1e-3,
                    help="AdamW learning rate; 0 keeps the weights (one weight version) and "
                    "still runs the backward")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps to run (default: RL_KERNEL_MATRIX_WARMUP + "
                    "RL_KERNEL_MATRIX_REPEATS from the plugin, else 1)")
    args = ap.parse_args(argv)
    for axis in ("tp", "cp"):
        if getattr(args, axis) is None:
            raw = os.environ.get(f"RL_KERNEL_MATRIX_{axis.upper()}", "").strip() or "1"
            if not raw.isdigit() or int(raw) < 1:
                raise UsageError(f"RL_KERNEL_MATRIX_{axis.upper()}={raw!r}: expected an int >= 1")
            setattr(args, axis, int(raw))
        elif getattr(args, axis) < 1:
            raise UsageError(f"--{axis} must be >= 1")
    if args.steps is None:
        e = os.environ
        args.steps = int(e.get("RL_KERNEL_MATRIX_WARMUP", "0") or 0) + int(
            e.get("RL_KERNEL_MATRIX_REPEATS", "1") or 1)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one matrix cell; returns the process exit code."""
    t_start = time.perf_counter()
    try:
        args = parse_args(argv)
        env = Env.from_environ()
        drill = FaultDrill.from_env()
        Factors.from_env()  # a bad factor value is a usage error before anything starts
        backward_mode()  # so is a bad RLK_REF_R_BACKWARD
        if "comm" in env.modules and args.tp < 2:
            raise UsageError(f"RL_KERNEL_COMM_CASE={env.cases['comm']} needs tensor parallelism "
                             f"(tp >= 2; got tp={args.tp}): with one TP rank there is no "
                             "reduction for the comm module to vary")
    except UsageError as exc:
        print(f"[rlk-reference] error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    world = args.tp * args.cp
    if world > 1 and not is_rank_process():
        return launch(sys.argv[1:] if argv is None else argv, world)
    return run_cell(args, env, drill, t_start)


def run_cell(args: argparse.Namespace, env: Env, drill: FaultDrill | None, t_start: float) -> int:
    """Everything after argument/env parsing, in this rank's process group."""
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    world = args.tp * args.cp
    if device.type == "cuda" and world > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.device_count() <= local:
            print(f"[RL-Kernel][unsupported] module=comm side=training "
                  f"class=communication_path_unsupported reason=tp*cp={world} ranks need one "
                  f"GPU each; this process sees {torch.cuda.device_count()}", flush=True)
            return EXIT_UNSUPPORTED
        device = torch.device("cuda", local)
    rl.prepare_deterministic(device)
    threads = intra_op_threads(os.environ, world)
    if threads is not None:
        torch.set_num_threads(threads)
        # inter-op threads follow the same share (issue 52: a default pool of one thread per
        # core on a 1-CPU share made single steps 5-8x slower); only settable before any
        # inter-op work, so a second call (an in-process caller) keeps what is set
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)
    try:
        grid = init_grid(args.tp, args.cp, device)
    except LaunchError as exc:
        print(f"[RL-Kernel][unsupported] module=comm side=training "
              f"class=communication_path_unsupported reason={exc}", flush=True)
        return EXIT_UNSUPPORTED
    try:
        return _run(args, env, drill, t_start, device, grid)
    finally:
        shutdown(grid)


def _micro_batch(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 n_prompts: int, max_seq: int, grid: Grid) -> budget.Choice:
    """``budget.choose`` with the larger of the R and P estimates, so that every cell of a
    matrix trains the same micro-batches whatever its routes."""
    cfg = (ModelConfig.from_hf(json.loads((Path(args.checkpoint) / "config.json").read_text()))
           if args.checkpoint else PRESETS[args.preset])
    size = torch.empty((), dtype=dtype).element_size()
    r, p = (budget.estimate(cfg, size, n_prompts, max_seq, side, grid.tp, grid.cp)
            for side in (True, False))
    est = budget.Estimate(max(r.fixed, p.fixed), r.kv_cache, max(r.per_token, p.per_token))
    total = (torch.cuda.get_device_properties(device).total_memory
             if device.type == "cuda" else None)
    memory = budget.device_memory(device.type, total)
    if device.type == "cpu":  # the ranks of one machine share its memory
        memory //= grid.world
    return budget.choose(args.preset, est, n_prompts, max_seq, memory, args.micro_batch_size)


def _run(args: argparse.Namespace, env: Env, drill: FaultDrill | None, t_start: float,
         device: torch.device, grid: Grid) -> int:
    lead = grid.rank == 0  # prints the metrics lines, writes the manifest and the weight audit
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    platform = runtime_platform(device)
    defaults = RUN_DEFAULTS.get(args.preset, RUN_DEFAULTS["tiny"])
    n_prompts = args.num_prompts or defaults[0]
    max_new_tokens = args.max_new_tokens or defaults[1]
    unit = math.lcm(16, 2 * grid.cp)  # key span: also a whole number of zigzag chunk pairs
    max_seq = -(-(args.max_prompt_len + max_new_tokens) // unit) * unit
    try:  # the micro-batch by tokens and memory; a size that cannot fit stops here (budget.py)
        choice = _micro_batch(args, device, dtype, n_prompts, max_seq, grid)
    except UsageError as exc:
        print(f"[rlk-reference] error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    micro_batch = choice.size
    for d in (env.readback_dir, env.sidecar_dir, env.weight_audit_dir):
        d.mkdir(parents=True, exist_ok=True)

    if args.checkpoint:
        cfg, train_w = load_checkpoint(args.checkpoint, dtype, device)
        ckpt = {"path": str(Path(args.checkpoint).resolve()),
                "fingerprint": checkpoint_fingerprint(args.checkpoint),
                "fingerprint_method": "sha256(config.json + sorted *.safetensors name/size/bytes)"}
    else:
        cfg = PRESETS[args.preset]
        train_w = init_weights(cfg, args.seed, dtype, device)
        ckpt = {"path": None, "fingerprint": f"seeded-init:{args.preset}:{args.seed}",
                "fingerprint_method": "deterministic init from seed"}

    routes = {s: resolve_route(env, s, drill, platform) for s in SIDES}
    factors = Factors.from_env()
    tiling = Tiling.for_device(device, max_seq)
    # One rank: the batch-invariant Triton kernels and decode graphs on a GPU. Several ranks: the
    # torch R path (Triton kernels compute unsharded outputs) and eager decode (no collectives
    # inside captured graphs); both recorded in the manifest and readbacks.
    backend = r_backend(device) if grid.world == 1 else "torch"
    graphs = (device.type == "cuda" and grid.world == 1
              and os.environ.get("RLK_REF_DECODE_GRAPHS", "1") != "0")
    # Without `comm` in the matrix the TP reduction follows RL_KERNEL_ALIGNED: the launcher's
    # aligned framework settings use the deterministic fixed-order reduction, unaligned ones the
    # native all-reduce. It is then not a module of the matrix and writes no operator readback.
    comm_default = "rl_kernel" if env.aligned and env.mode != "off" else "production"
    impls = {s: {"comm": comm_default, **routes[s].actual} for s in SIDES}
    try:
        probe = ProbeRequest.from_env(env.artifact_dir, cfg.num_hidden_layers)
        profile = ProfileRequest.from_env(env.artifact_dir)
    except UsageError as exc:
        print(f"[rlk-reference] error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    graphs = graphs and not profile.enabled  # a profile run decodes eagerly: modules in ranges
    kernels = {s: SideKernels.build(s, impls[s], dtype, tiling, cfg.rms_norm_eps,
                                    backend, tp=grid.tp_group, tap=probe.tap(s, grid.tp_group))
               for s in SIDES}
    modes = {s: "eager" for s in SIDES}
    upstream = manifest_fields(env.cases, steps=args.steps, global_batch_size=n_prompts,
                               tp=grid.tp, cp=grid.cp, world=grid.world)
    manifest = {
        "schema_version": "rlk-reference.manifest.v1", "run_id": env.run_id, "mode": env.mode,
        "cases": env.cases, "preset": args.preset, "dtype": args.dtype, "device": str(device),
        "runtime_platform": platform, "seed": args.seed, "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sampling": {"temperature": args.temperature, "top_p": args.top_p,
                     "num_prompts": n_prompts, "max_new_tokens": max_new_tokens,
                     "prompt_len": [args.min_prompt_len, args.max_prompt_len],
                     "eos_token_id": cfg.eos_token_id},
        "micro_batch_size": micro_batch, "micro_batch": choice.manifest(),
        "max_seq_len": max_seq, "steps": args.steps,
        "factors": factors.as_dict(),
        "tiling": asdict(tiling), "model": asdict(cfg), "checkpoint": ckpt,
        "r_backend": backend, "decode_graphs": graphs and not probe.enabled,
        "fast_paths": FAST_PATHS,
        "probe": {"enabled": probe.enabled, "budget": probe.budget,
                  "positions": [list(p) for p in probe.positions],
                  "directory": str(probe.directory) if probe.enabled else None,
                  "perturb": None if probe.perturb is None else {
                      "side": probe.perturb[0], "module_path": probe.perturb[1],
                      "factor": PERTURB_FACTOR}},
        "fault_drill": None if drill is None else {
            **asdict(drill),
            "applied": drill.kind == "corrupt_weight" or (
                env.mode != "off" and drill.module in env.modules
                and env.requested(drill.module, drill.side) == "rl_kernel")},
        "routes": {s: {"requested": routes[s].requested, "actual": routes[s].actual,
                       "claimed": routes[s].claimed} for s in SIDES},
        **{k: v for k, v in upstream.items() if k != "topology"},
        "topology": {"tp": grid.tp, "cp": grid.cp, "world_size": grid.world,
                     "collective_backend": grid.backend, "rank_layout": "tp + tp * cp_rank",
                     "rollout": {"tp": grid.tp, "cp": 1, "replicas": grid.cp},
                     "tp_reduction": {s: impls[s]["comm"] if grid.tp > 1 else None
                                      for s in SIDES},
                     "ignore_eos": args.ignore_eos},
    }
    manifest["topology"].update(upstream["topology"])  # the counts RL-Kernel's validator reads
    manifest["timing"], manifest["profile"] = STEP_TIMING, profile.manifest()
    instrument(kernels, profile, drill, bool(manifest["fault_drill"]
                                             and manifest["fault_drill"]["applied"]))
    if lead:
        write_json(env.artifact_dir / "manifest.json", manifest)
    if not lead:  # the other ranks stay quiet on the shared log (errors still go to stderr)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    if probe.perturb:
        print(f"[rlk-reference][perturb] side={probe.perturb[0]} module={probe.perturb[1]} "
              f"factor=1+2^-7")
    if drill:
        print(f"[rlk-reference][fault-drill] kind={drill.kind} module={drill.module} "
              f"side={drill.side} applied={str(manifest['fault_drill']['applied']).lower()}")
    if env.mode == "off":
        print("[RL-Kernel] mode=off: native route")
    elif env.route_report:
        print("\n".join(route_lines(env, routes, {s: kernels[s].framework for s in SIDES},
                                     platform)))
    for s in SIDES:
        for m, why in routes[s].unsupported.items():
            print(f"[RL-Kernel][unsupported] module={m} side={s} class=platform_unsupported "
                  f"reason={why}")
    if env.mode == "strict" and any(routes[s].unsupported for s in SIDES):
        write_readbacks(env, routes, kernels, platform, grid=grid)
        print("[RL-Kernel] error: strict mode: requested rl_kernel backend unsupported on this "
              "platform; failing closed before the step", file=sys.stderr)
        return EXIT_UNSUPPORTED
    train_lp_uses_r = routes["training"].actual["logp"] == "rl_kernel"
    vocab_pad = -(-cfg.vocab_size // 128) * 128
    contract = (f"linear_logp:tp={grid.tp}:cp={grid.cp}:vocab={vocab_pad}" if train_lp_uses_r
                else "vime.native.linear_logp.v1")
    print(f"[rlk-reference] selected-logprob contract_id={contract}")

    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    plens = torch.randint(args.min_prompt_len, args.max_prompt_len + 1, (n_prompts,),
                          generator=gen).tolist()
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).to(device) for n in plens]
    max_new = torch.randint(max(1, max_new_tokens * 2 // 3), max_new_tokens + 1, (n_prompts,),
                            generator=gen).tolist()
    order = torch.randperm(n_prompts, generator=gen).tolist()
    train_model = Qwen3(cfg, shard_weights(cfg, train_w, grid.tp, grid.tp_rank), max_seq)
    wanted = [(i, j) for i, j in (probe.positions or [(i, 0) for i in range(min(
        probe.budget, n_prompts))]) if i < n_prompts]
    for s in SIDES:
        tap = kernels[s].tap
        if tap is not None:
            tap.wanted = {(i, plens[i] + j - 1) for i, j in wanted}

    learning = grid.world == 1  # multi-rank: forward only (no distributed backward here)
    params = [train_w[n] for n in sorted(train_w)]
    opt = None
    if learning:
        for p in params:
            p.requires_grad_(True)
        opt = rl.make_optimizer(params, args.lr) if args.lr > 0 else None
    grad_kernels = kernels["training"]
    triton_train = any(kernels["training"].module(m).uses_triton for m in MODULES)
    bwd = backward_mode() if triton_train else "own"
    if learning and bwd == "tiled":  # the earlier method, kept for comparisons
        grad_kernels = SideKernels.build("training", impls["training"], dtype, tiling,
                                         cfg.rms_norm_eps, "torch", tp=grid.tp_group)
    manifest["learning"] = {
        "backward": ("torch autograd through the training forward" if learning else
                     "not run: the reference workload has no distributed backward (world > 1)"),
        "backward_kernels": BACKWARD_METHODS.get(bwd, "training side's own"),
        "backward_method": bwd if learning else None,
        "optimizer": (f"AdamW(lr={args.lr}, betas={rl.ADAM_BETAS}, eps={rl.ADAM_EPS}, "
                      "weight_decay=0; torch's foreach=False update, rl.AdamW)" if opt else
                      "none (lr = 0: weights kept)" if learning else "none"),
        "loss": f"GRPO policy gradient, groups of {rl.GROUP}, reward = even-token fraction",
        "deterministic_algorithms": device.type == "cuda"}
    nonce = rl.drill_nonce(drill, manifest["fault_drill"])
    version, audited = 0, -1
    # Megatron's --manual-gc: no cyclic collection inside a timed phase (one landed in the same
    # step of every run and read as timing noise), one collection between steps instead
    gc_auto = gc.isenabled()
    gc.collect()
    gc.disable()
    for step in range(args.steps):
        if drill and drill.kind == "drift_growth":
            kernels[drill.side].module(drill.module).drift = step * rl.DRIFT_STEP
        profile.step(step, device)
        sync(device)
        t0 = time.perf_counter()
        profile.phase("weight_sync")
        rollout_w = factors.sync_weights({n: t.detach() for n, t in train_w.items()})
        if drill and drill.kind == "corrupt_weight":
            w = rollout_w["model.layers.0.mlp.down_proj.weight"]
            w.view(-1)[0] = w.view(-1)[0] * 1.5 + 0.01
        kernels["rollout"].clear_cache()
        # the rollout engine loads the synced weights: part of the weight sync
        rollout_model = Qwen3(cfg, shard_weights(cfg, rollout_w, grid.tp, grid.tp_rank),
                              max_seq)
        sync(device)
        t_sync = time.perf_counter() - t0
        # Debug work a real RL step would not do, off the step clock (perf/rlk_debug_time;
        # the manifest's "timing" says so): the per-version weight-audit hashing
        t_debug = time.perf_counter()
        profile.phase("debug")
        if version != audited and lead:  # training rank 0: one audit per exported version
            write_weight_audits(env.weight_audit_dir, str(version), train_w, rollout_w)
        audited = version
        t_debug = time.perf_counter() - t_debug
        samp_gen = torch.Generator(device=device).manual_seed(
            rl.sampling_seed(args.seed, step, drill, nonce))
        profile.phase("rollout")
        t1 = time.perf_counter()
        with torch.inference_mode():
            ro = factors.rollout(run_rollout, rollout_model, kernels["rollout"], prompts,
                                 max_new, args.temperature, args.top_p, samp_gen, graphs,
                                 args.ignore_eos)
        if step == 0 or ro.execution_mode == "eager":  # graphs only if every step had them
            modes["rollout"] = ro.execution_mode
        if step == 0 and grid.rank == 0:
            print("\n".join(factors.lines()))
            print(f"[rlk-reference] rollout decode execution_mode={ro.execution_mode} "
                  f"r_backend={backend}" + (f" reason={ro.fallback_reason}"
                                            if ro.fallback_reason else ""))
        sync(device)
        t_roll = time.perf_counter() - t1
        profile.phase("training")
        t2 = time.perf_counter()
        resp = [x.numel() for x in ro.logprobs]
        active = sum(resp)
        rew = rl.rewards(ro.tokens, ro.prompt_lengths)
        learn = rl.Learn(rl.grpo_advantages(rew), active, grad_kernels) if learning else None
        train_lp = run_training(train_model, kernels["training"], ro, micro_batch,
                                args.temperature, order, grid, learn)
        rl.perturb_gradients(train_w, drill, nonce)
        if opt is not None:
            with rl.deterministic(device):
                opt.step()
            version += 1
        for p in params:
            p.grad = None
        kernels["training"].clear_cache()
        sync(device)
        t_train = time.perf_counter() - t2
        t_step = time.perf_counter() - t0 - t_debug
        profile.phase(None)
        profile.counted()
        if device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(device))
        else:
            peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        emit_step(env, step, ro, train_lp, grid, max_new, t_roll=t_roll, t_train=t_train,
                  t_step=t_step, t_sync=t_sync, peak=peak, world=grid.world, t_debug=t_debug,
                  rollout_extra={"rollout/raw_reward": sum(rew) / len(rew)},
                  step_extra={"train/pg_loss": learn.loss} if learn else None)
        if step == 0 and probe.enabled:
            write_probes(probe, kernels, ro, train_lp, wanted, grid, manifest)
        sys.stdout.flush()
        gc.collect()  # between steps: outside every timed phase
    if gc_auto:
        gc.enable()
    manifest["gc"] = "manual: one collection between steps, none inside them"
    profile.finish(grid.rank)
    manifest["profile"] = profile.manifest()
    write_readbacks(env, routes, kernels, platform, modes, grid)
    manifest["wall_time_s"] = round(time.perf_counter() - t_start, 3)
    manifest["rollout_p_decode"] = native.decode_mode()  # native.py: compiled or eager, why
    manifest["rollout_sampler"] = sampler_mode()  # sampling.py: its passes compiled or eager
    if lead:
        write_json(env.artifact_dir / "manifest.json", manifest)
    if env.mode == "strict" and any(routes[s].fallbacks for s in SIDES):
        print("[RL-Kernel] error: strict mode: fallback to the native path recorded "
              f"({[f for s in SIDES for f in routes[s].fallbacks]}); failing the run",
              file=sys.stderr)
        return EXIT_FALLBACK
    return 0


