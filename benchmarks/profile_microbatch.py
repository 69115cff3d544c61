"""Training cost per token against the micro-batch size, R against P, per kernel (issue 55, GPU).

The reference job's own training (``job.run_training`` with the learning step's backward) on a
synthetic rollout of the job's lengths (prompts of 8..32 tokens, each sample's new tokens drawn
from 2/3 of ``new`` to ``new`` as ``job.main`` draws them; ``--fixed-lengths``: all ``new``),
one process, both sides:

- **sweep**: for each length and micro-batch size, the training of the first sequences (about
  ``--tokens`` padded tokens, whole micro-batches; one micro-batch first as a warm-up so that
  compilation is not counted), timed with CUDA synchronisation: ms per 1,000 padded tokens,
  the peak of allocated memory, and the caching allocator's retries and device allocations
  (``torch.cuda.memory_stats``: a step near the memory limit frees and re-allocates);
- **kernels** (``--kernels 160:32,44``): the same run under ``torch.profiler`` at two sizes,
  each kernel's device time per 1,000 tokens side by side: the kernel whose cost per token
  grows with the micro-batch is the cliff.

``--unpadded-dw`` runs R's weight gradients as before issue 55 (``g^T`` and ``A^T`` with the
micro-batch's token count as their row length, unpadded): the cliff's "before", in the same
process and on the same machine as the "after".

::

    python benchmarks/profile_microbatch.py --out /tmp/mb             # the issue's lengths
    python benchmarks/profile_microbatch.py --device cpu --preset tiny --lengths 16:8 \
        --sizes 16:1,2,4 --kernels 16:1,4 --out /tmp/mb-cpu          # a CPU smoke run

Nothing here asserts a timing; the tables are read off.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pytest_rlkernel_matrix.workload.evidence.artifacts import Rollout
from pytest_rlkernel_matrix.workload.job import run_training
from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling, r_backend
from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights
from pytest_rlkernel_matrix.workload.training import rl

SIDES = {"R": "rl_kernel", "P": "production"}
DEFAULT_SIZES = "160:4,8,16,24,32,36,40,44,48,64;1024:1,2,4,6,8,10,12;4096:1,2,3"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def rollout(cfg, new: int, n: int, dev: torch.device, fixed: bool, seed: int = 1) -> Rollout:
    """The job's lengths (``job.main``): prompts of 8..32 tokens, each sample's new tokens drawn
    from ``2 new / 3 .. new`` (``fixed``: every sample ``new``). A micro-batch is padded to its
    longest sample, so its token count ``samples x length`` is any number."""
    gen = torch.Generator().manual_seed(seed)
    plens = torch.randint(8, 33, (n,), generator=gen).tolist()
    news = ([new] * n if fixed else
            torch.randint(max(1, new * 2 // 3), new + 1, (n,), generator=gen).tolist())
    toks = [torch.randint(2, cfg.vocab_size, (p + k,), generator=gen).to(dev)
            for p, k in zip(plens, news, strict=True)]
    return Rollout(toks, plens, [torch.zeros(k) for k in news])


def train(model: Qwen3, ks: SideKernels, ro: Rollout, mb: int, idx: list[int]) -> None:
    """``job.run_training`` with the learning step's backward over samples ``idx``."""
    sub = Rollout([ro.tokens[i] for i in idx], [ro.prompt_lengths[i] for i in idx],
                  [ro.logprobs[i] for i in idx])
    active = sum(x.numel() for x in sub.logprobs)
    learn = rl.Learn(rl.grpo_advantages(rl.rewards(sub.tokens, sub.prompt_lengths)), active)
    run_training(model, ks, sub, mb, 1.0, list(range(len(idx))), None, learn)
    for p in model.weights.values():
        p.grad = None


def measure(model: Qwen3, ks: SideKernels, ro: Rollout, mb: int, tokens: int,
            dev: torch.device) -> dict:
    t = max(x.numel() for x in ro.tokens)
    n = min(len(ro.tokens), max(mb, -(-max(1, tokens // t) // mb) * mb))
    idx = list(range(n))
    train(model, ks, ro, mb, idx[:2 * mb])  # warm-up: compiles this size's kernels
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
    t0 = time.perf_counter()
    train(model, ks, ro, mb, idx)
    _sync(dev)
    sec = time.perf_counter() - t0
    padded = sum(max(ro.tokens[i].numel() for i in idx[s:s + mb]) * len(idx[s:s + mb])
                 for s in range(0, n, mb))
    out = {"mb": mb, "sequences": n, "padded_tokens": padded, "s": sec,
           "ms_per_1k_tokens": sec * 1e6 / padded}
    if dev.type == "cuda":
        st = torch.cuda.memory_stats()
        out.update(peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30,
                   reserved_gib=torch.cuda.max_memory_reserved() / 2 ** 30,
                   alloc_retries=st.get("num_alloc_retries", 0) - before.get(
                       "num_alloc_retries", 0),
                   device_allocs=st.get("num_device_alloc", 0) - before.get(
                       "num_device_alloc", 0),
                   device_frees=st.get("num_device_free", 0) - before.get("num_device_free", 0))
    return out


def kernel_times(model: Qwen3, ks: SideKernels, ro: Rollout, mb: int, tokens: int,
                 dev: torch.device) -> tuple[dict[str, float], int]:
    """Device ms per kernel name over one measured training run, and its padded tokens."""
    t = max(x.numel() for x in ro.tokens)
    n = min(len(ro.tokens), max(mb, -(-max(1, tokens // t) // mb) * mb))
    idx = list(range(n))
    train(model, ks, ro, mb, idx[:mb])
    _sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        train(model, ks, ro, mb, idx)
        _sync(dev)
    kind = DeviceType.CUDA if dev.type == "cuda" else DeviceType.CPU
    by: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type == kind:
            us = e.self_device_time_total if kind == DeviceType.CUDA else e.self_cpu_time_total
            if us > 0:
                by[e.key] += us / 1e3
    padded = sum(max(ro.tokens[i].numel() for i in idx[s:s + mb]) * len(idx[s:s + mb])
                 for s in range(0, n, mb))
    return dict(by), padded


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lengths", default="160:448,1024:128,4096:32")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="new:mb,mb;new:mb,...")
    ap.add_argument("--kernels", default="160:32,44", help="new:mb_a,mb_b;... (profiled)")
    ap.add_argument("--sides", default="R,P")
    ap.add_argument("--tokens", type=int, default=25000, help="padded tokens per measurement")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--r-chunk", type=int, default=0,
                    help="probe: rows per LM-head logits chunk of the Triton R path")
    ap.add_argument("--fixed-lengths", action="store_true",
                    help="every sample its full new tokens (default: the job's 2/3..1 draw)")
    ap.add_argument("--no-fill", action="store_true",
                    help="probe: torch.utils.deterministic.fill_uninitialized_memory off")
    ap.add_argument("--unpadded-dw", action="store_true",
                    help="probe: R's weight gradients as before issue 55 (unpadded tokens axis)")
    args = ap.parse_args()
    if args.unpadded_dw:
        from pytest_rlkernel_matrix.workload.kernels.r import triton_backward

        triton_backward.tokens_last = lambda x, unit: x.t().contiguous()
    if args.r_chunk:
        from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels

        triton_kernels._ROW_CHUNK = args.r_chunk
    if args.no_fill:
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    rl.prepare_deterministic(dev)
    cfg = PRESETS[args.preset]
    dt = torch.bfloat16
    lengths = dict(tuple(int(v) for v in x.split(":")) for x in args.lengths.split(","))
    sizes = {int(k): [int(v) for v in vs.split(",")] for k, vs in
             (x.split(":") for x in args.sizes.split(";") if x)}
    prof = {int(k): [int(v) for v in vs.split(",")] for k, vs in
            (x.split(":") for x in args.kernels.split(";") if x)}
    w = init_weights(cfg, 1234, dt, dev)
    for p in w.values():
        p.requires_grad_(True)
    print(f"{args.preset}, {torch.cuda.get_device_name(0) if dev.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}, r_backend {r_backend(dev)}", flush=True)
    rows: list[dict] = []
    kern: dict = {}
    for new, prompts in lengths.items():
        ro = rollout(cfg, new, prompts, dev, args.fixed_lengths)
        max_seq = max(x.numel() for x in ro.tokens)
        model = Qwen3(cfg, w, -(-max_seq // 16) * 16)
        for side in args.sides.split(","):
            impl = dict.fromkeys(("attention", "ffn", "logp"), SIDES[side])
            ks = SideKernels.build("training", impl, dt, Tiling.for_device(dev, max_seq),
                                   cfg.rms_norm_eps, r_backend(dev))
            for mb in sizes.get(new, []):
                if mb > prompts:
                    continue
                try:
                    r = measure(model, ks, ro, mb, args.tokens, dev)
                except torch.OutOfMemoryError as exc:
                    r = {"mb": mb, "error": f"OOM: {str(exc)[:80]}"}
                    torch.cuda.empty_cache()
                r.update(side=side, new=new)
                rows.append(r)
                print(json.dumps(r), flush=True)
            for mb in prof.get(new, []):
                by, padded = kernel_times(model, ks, ro, mb, args.tokens, dev)
                kern[f"{new}-{side}-{mb}"] = {"padded": padded, "ms": by}
    (args.out / "sweep.json").write_text(json.dumps(rows, indent=1))
    (args.out / "kernels.json").write_text(json.dumps(kern, indent=1))
    print("\n| new tokens | micro-batch | R ms / 1k tokens | P ms / 1k tokens | R/P | "
          "R peak GiB | R alloc retries | P peak GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for new in lengths:
        for mb in sizes.get(new, []):
            got = {r["side"]: r for r in rows if r["new"] == new and r["mb"] == mb}
            if not got:
                continue
            rr, pp = got.get("R", {}), got.get("P", {})
            rv, pv = rr.get("ms_per_1k_tokens"), pp.get("ms_per_1k_tokens")
            print(f"| {new} | {mb} | {(rv and f'{rv:.1f}') or rr.get('error', '-')} | "
                  f"{(pv and f'{pv:.1f}') or pp.get('error', '-')} | "
                  f"{(rv and pv and f'{rv / pv:.2f}') or '-'} | "
                  f"{rr.get('peak_gib', 0):.1f} | {rr.get('alloc_retries', '-')} | "
                  f"{pp.get('peak_gib', 0):.1f} |")
    for new, mbs in prof.items():
        for side in args.sides.split(","):
            keys = [f"{new}-{side}-{mb}" for mb in mbs if f"{new}-{side}-{mb}" in kern]
            if len(keys) < 2:
                continue
            a, b = kern[keys[0]], kern[keys[-1]]
            pa = {k: v * 1e3 / a["padded"] for k, v in a["ms"].items()}
            pb = {k: v * 1e3 / b["padded"] for k, v in b["ms"].items()}
            names = sorted(set(pa) | set(pb), key=lambda k: -max(pa.get(k, 0), pb.get(k, 0)))
            print(f"\n{side} at {new} new tokens, device ms per 1k padded tokens: micro-batch "
                  f"{mbs[0]} -> {mbs[-1]} (all kernels {sum(pa.values()):.2f} -> "
                  f"{sum(pb.values()):.2f})")
            for k in names[:args.top]:
                x, y = pa.get(k, 0), pb.get(k, 0)
                print(f"  {x:8.3f} {y:8.3f} {y / x if x else float('inf'):6.2f}x  {k[:88]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
