"""Where R's time goes by length, R against P, counted rather than timed (issue 46, item 1).

One process, the reference workload's own functions (``job.run_rollout``, ``job.run_training``
with the learning step's backward): for each new-token length, an all-R and an all-P step of
the ``--preset`` model under ``torch.profiler`` (``with_flops=True``). Printed per length and
side: the matrix-multiply FLOPs of the rollout and of the training phase (forward + backward),
split into attention's score/output products (``bmm`` on the torch R path, SDPA on P) and the
rest, the profiler's CPU time per phase, and the FLOPs per active token. FLOPs do not depend
on the machine's load, so on a busy CPU box they show what grows with length where timings are
noise; on a GPU (``--device cuda``) the same counts come with CUDA time.

    python benchmarks/profile_lengths.py                         # tiny, CPU, 16 / 64 / 256
    python benchmarks/profile_lengths.py --device cuda --preset qwen3-0.6b \
        --lengths 160:448,1024:128,4096:32
    python benchmarks/profile_lengths.py --attention-work       # R attention alone, seconds

``--attention-work`` counts only the torch R attention's products (``r_core_attention``'s
``bmm`` calls, their FLOPs) for one sequence per length: its training forward (prompt 32 +
the new tokens, causal) and its decode (one step per new token against a cache of capacity
``max_seq``), next to the causal attention's own FLOPs (``4 D Hq`` per visible query-key pair):
what R computes for the keys that exist and what it computes on top.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pytest_rlkernel_matrix.workload.job import run_rollout, run_training
from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling, r_backend
from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights
from pytest_rlkernel_matrix.workload.training import budget, rl

SIDES = {"R": "rl_kernel", "P": "production"}
ATTN_OPS = ("aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_efficient_attention",
            "aten::_scaled_dot_product_cudnn_attention", "aten::_efficient_attention_forward")


def one(side: str, preset: str, new: int, prompts: int, dev: torch.device) -> dict:
    cfg = PRESETS[preset]
    max_seq = -(-(32 + new) // 16) * 16
    w = init_weights(cfg, 1234, torch.bfloat16, dev)
    impl = {m: SIDES[side] for m in ("attention", "ffn", "logp")}
    tiling = Tiling.for_device(dev, max_seq)
    backend = r_backend(dev)
    ks = {s: SideKernels.build(s, impl, torch.bfloat16, tiling, cfg.rms_norm_eps, backend)
          for s in ("training", "rollout")}
    gen = torch.Generator().manual_seed(1)
    plens = torch.randint(8, 33, (prompts,), generator=gen).tolist()
    prompt = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).to(dev) for n in plens]
    est = budget.estimate(cfg, 2, prompts, max_seq, side == "R")
    mb = budget.choose(preset, est, prompts, max_seq, budget.device_memory(dev.type), None).size
    for p in w.values():
        p.requires_grad_(True)
    train, roll = Qwen3(cfg, w, max_seq), Qwen3(cfg, {n: t.detach() for n, t in w.items()},
                                                 max_seq)
    out: dict = {"side": side, "new": new, "micro_batch": mb}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts, with_flops=True) as prof:
        with torch.inference_mode(), record_function("phase.rollout"):
            ro = run_rollout(roll, ks["rollout"], prompt, [new] * prompts, 1.0, 0.95,
                             torch.Generator(device=dev).manual_seed(3), ignore_eos=True)
        active = sum(x.numel() for x in ro.logprobs)
        learn = rl.Learn(rl.grpo_advantages(rl.rewards(ro.tokens, ro.prompt_lengths)), active)
        with record_function("phase.training"):
            run_training(train, ks["training"], ro, mb, 1.0, list(range(prompts)), None, learn)
    # attribute every op to the phase range that encloses it
    events = prof.events()
    ranges = {e.name: e.time_range for e in events if e.name.startswith("phase.")}
    flops: dict[str, float] = defaultdict(float)
    for e in events:
        if not e.flops:
            continue
        for name, r in ranges.items():
            if r.start <= e.time_range.start <= r.end:
                kind = "attn" if e.name in ATTN_OPS else "other"
                flops[f"{name[6:]}.{kind}"] += e.flops
    out["active"] = active
    out["flops"] = dict(flops)
    out["cpu_s"] = {n[6:]: (r.end - r.start) / 1e6 for n, r in ranges.items()}
    return out


def attention_work(lengths: list[int]) -> None:
    from pytest_rlkernel_matrix.workload.kernels import side as kernels

    cfg = PRESETS["tiny"]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    count = [0]
    bmm = torch.bmm

    def counting(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        count[0] += 2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
        return bmm(a, b)

    print(f"torch R attention ({kernels.__file__}), tiny heads: MFLOP per sequence")
    print("| new tokens | max_seq | training: R / causal | decode: R / causal |")
    print("| --- | --- | --- | --- |")
    torch.bmm = counting  # type: ignore[assignment]
    try:
        for new in lengths:
            t = 32 + new
            max_seq = -(-t // 16) * 16
            tiling = kernels.Tiling.for_device(torch.device("cpu"), max_seq)
            q = torch.randn(1, t, hq, d)
            k = torch.randn(1, t, hkv, d).to(torch.bfloat16)
            count[0] = 0
            kernels.r_core_attention(q, torch.arange(t)[None], k, k, tiling)
            train = count[0]
            cache = torch.zeros(1, max_seq, hkv, d, dtype=torch.bfloat16)
            cache[:, :t] = k
            count[0] = 0
            for p in range(32, t):
                kernels.r_core_attention(q[:, p:p + 1], torch.tensor([[p]]), cache, cache,
                                         tiling)
            dec = count[0]
            causal_train = 4 * d * hq * t * (t + 1) // 2
            causal_dec = 4 * d * hq * sum(p + 1 for p in range(32, t))
            print(f"| {new} | {max_seq} | {train / 1e6:.1f} / {causal_train / 1e6:.1f} "
                  f"({train / causal_train:.2f}x) | {dec / 1e6:.1f} / {causal_dec / 1e6:.1f} "
                  f"({dec / causal_dec:.2f}x) |")
    finally:
        torch.bmm = bmm  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--lengths", default="16:8,64:8,256:4")
    ap.add_argument("--attention-work", action="store_true")
    args = ap.parse_args()
    if args.attention_work:
        attention_work([int(x.split(":")[0]) for x in args.lengths.split(",")] if args.lengths
                       != "16:8,64:8,256:4" else [16, 64, 256, 1024])
        return
    dev = torch.device(args.device)
    torch.manual_seed(0)
    rows = []
    for item in args.lengths.split(","):
        new, prompts = (int(x) for x in item.split(":"))
        for side in ("R", "P"):
            rows.append(one(side, args.preset, new, prompts, dev))
    print(f"{args.preset} on {dev}: matmul GFLOP per step (profiler counts), attention's "
          "score/output products apart; wall s of each phase under the profiler")
    print("| new tokens | side | micro-batch | active tokens | rollout attn | rollout other | "
          "training attn | training other | training MFLOP / active token | rollout s | "
          "training s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        f = r["flops"]
        tr = f.get("training.attn", 0) + f.get("training.other", 0)
        print(f"| {r['new']} | {r['side']} | {r['micro_batch']} | {r['active']} | "
              f"{f.get('rollout.attn', 0) / 1e9:.3f} | {f.get('rollout.other', 0) / 1e9:.3f} | "
              f"{f.get('training.attn', 0) / 1e9:.3f} | {f.get('training.other', 0) / 1e9:.3f} | "
              f"{tr / 1e6 / r['active']:.2f} | {r['cpu_s']['rollout']:.2f} | "
              f"{r['cpu_s']['training']:.2f} |")


if __name__ == "__main__":
    main()
