"""Where one rollout decode step's time goes on a GPU: the graph replay, the sampler, the host.

Builds a rollout side as ``profile_step.py`` does, prefills ``--batch`` prompts, captures the
decode graph of that bucket and then times, with CUDA events and no profiler, ``--iters`` of
each piece of a decode step: the graph replay, the sampler (``sample_top_p``), and the whole
step as ``run_rollout`` runs it (sample, the chosen logprobs' copy to the host, replay), with the
sampler's first round outside the graph and inside it (``DecodeRunner(top_p=...)``). Then one
profiled replay and one profiled sampler call print their kernels by device time::

    python benchmarks/profile_decode.py --case P/P
    python benchmarks/profile_decode.py --case R/R --top-p 1.0
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling, r_backend
from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights
from pytest_rlkernel_matrix.workload.rollout import sampling
from pytest_rlkernel_matrix.workload.rollout.graphs import DecodeRunner


def timed(fn: Callable[[], object], iters: int) -> float:
    """Milliseconds per call of ``fn`` (CUDA events around ``iters`` calls, after one)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernels(fn: Callable[[], object], top: int, title: str) -> None:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    total = sum(e.self_device_time_total for e in ka)
    print(f"\n{title}: {total / 1e3:.3f} ms of kernels, {sum(e.count for e in ka)} launches")
    print(ka.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70))


SWEEP = ((32, 4, 1, 1), (32, 4, 2, 1), (64, 4, 1, 1), (64, 4, 2, 1), (64, 8, 2, 1),
         (128, 4, 1, 1), (128, 8, 1, 1), (128, 8, 2, 1), (64, 4, 2, 2), (32, 2, 2, 1),
         (64, 2, 2, 1), (64, 4, 3, 1), (32, 4, 2, 2), (64, 4, 2, 4))


def attention_routes(q, kc, vc, pos) -> dict[str, Callable[[], torch.Tensor]]:
    """Flash varlen, R's Triton kernel and P's Triton grouped decode per configuration."""
    from pytest_rlkernel_matrix.workload.kernels.p import native, triton_decode
    from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels

    routes: dict[str, Callable[[], torch.Tensor]] = {
        "flash varlen": lambda: native.flash_decode(q, kc, vc, pos),
        "R triton (batch-invariant)": lambda: triton_kernels.attention(q[:, None], kc, vc, pos)}
    for c in SWEEP:
        routes[f"P triton {c}"] = lambda c=c: triton_decode.decode_attention(q, kc, vc, pos, c)
    return routes


def attention_sweep(cfg, b: int, cap: int, filled: int, iters: int, dev: torch.device,
                    gen: torch.Generator) -> None:
    """One layer's decode attention at this shape, each route against masked SDPA."""
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    hq = cfg.num_attention_heads
    kc = torch.randn(b, cap, hkv, d, device=dev, generator=gen).bfloat16()
    vc = torch.randn(b, cap, hkv, d, device=dev, generator=gen).bfloat16()
    q = torch.randn(b, hq, d, device=dev, generator=gen).bfloat16()
    ragged = torch.randint(39, 160, (b, 1), device=dev, generator=gen)
    for label, pos in ((f"every row at {filled} keys", torch.full((b, 1), filled - 1, device=dev)),
                       ("rows at 40..160 keys", ragged)):
        mask = torch.arange(cap, device=dev)[None, :] <= pos
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float().reshape(b, hkv, hq // hkv, d), kc.float().transpose(1, 2),
            vc.float().transpose(1, 2), attn_mask=mask[:, None, None, :]).reshape(b, hq, d)
        mb = int((pos + 1).sum()) * hkv * d * 2 * 2 / 1e6
        print(f"\ndecode attention, {b} rows, {label}: K and V read once are {mb:.0f} MB")
        for name, fn in attention_routes(q, kc, vc, pos).items():
            try:
                err = (fn().float().reshape(b, hq, d) - want).abs().max().item()
                ms = timed(fn, iters)
            except Exception as exc:  # a configuration the compiler refuses
                print(f"  {name}: failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            print(f"  {name}: {ms * 1e3:.1f} us, {mb / ms / 1e3:.2f} TB/s effective, "
                  f"max err {err:.3g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--case", default="P/P", choices=["R/R", "P/P"])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=448)
    ap.add_argument("--filled", type=int, default=100, help="keys in each row's cache")
    ap.add_argument("--max-seq", type=int, default=192)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--attn-sweep", action="store_true",
                    help="time P's decode attention routes and Triton configurations first")
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = PRESETS[args.preset]
    w = init_weights(cfg, 1234, torch.bfloat16, dev)
    impl = "rl_kernel" if args.case == "R/R" else "production"
    impls = dict.fromkeys(("attention", "ffn", "logp"), impl)
    k = SideKernels.build("rollout", impls, torch.bfloat16, Tiling.for_device(dev, args.max_seq),
                          cfg.rms_norm_eps, r_backend(dev))
    model = Qwen3(cfg, w, args.max_seq)
    b = args.batch
    gen = torch.Generator(device=dev).manual_seed(7)
    if args.attn_sweep:
        attention_sweep(cfg, b, args.max_seq, args.filled, args.iters, dev, gen)
    with torch.inference_mode():
        caches = model.new_cache(b)
        prompt = torch.randint(2, cfg.vocab_size, (b, args.filled), generator=gen, device=dev)
        pos = torch.arange(args.filled, device=dev)[None].expand(b, -1)
        model.hidden(k, prompt, pos, caches)
        u = torch.rand(b, generator=gen, device=dev)
        tok = torch.randint(2, cfg.vocab_size, (b,), generator=gen, device=dev)
        lengths = torch.full((b,), args.filled, device=dev)
        # the decode graph alone (the sampler after it), and with the sampler's first round
        plain = DecodeRunner(model, k, caches, 1.0, True)
        fused = DecodeRunner(model, k, [type(c)(c.k.clone(), c.v.clone()) for c in caches],
                             1.0, True, top_p=args.top_p)
        t0 = time.perf_counter()
        lp, _ = plain.step(tok, lengths, args.filled + 1)
        _, drawn = fused.step(tok, lengths, args.filled + 1, u)
        torch.cuda.synchronize()
        print(f"{args.case} batch {b}, {args.filled} keys per row: two captures + first steps "
              f"{time.perf_counter() - t0:.2f} s; execution_mode {plain.execution_mode}, "
              f"{fused.execution_mode}; {sampling.sampler_mode()}")
        assert drawn is not None
        same = torch.equal(sampling.finish(drawn, args.top_p, u),
                           sampling.sample_top_p(lp, args.top_p, u))
        print(f"fused first round + finish = sample_top_p after the plain graph: {same}; "
              f"rows left after round 0: {int((~drawn.ok).sum())} of {b}, after round 1: "
              f"{int((~drawn.done1).sum()) if drawn.done1 is not None else '-'}")

        def replay(r: DecodeRunner) -> Callable[[], None]:
            assert r.graph is not None
            return r.graph.replay

        def sample() -> None:
            sampling.sample_top_p(lp, args.top_p, u)

        def whole() -> None:  # run_rollout's step: sample, copy to the host, decode
            t = sampling.sample_top_p(lp, args.top_p, u)
            lp.gather(-1, t[:, None])[:, 0].float().cpu().tolist()
            t.tolist()
            plain.step(t, lengths, args.filled + 1)

        def whole_fused() -> None:
            flp, d = fused.out if fused.out is not None else (lp, None)
            assert d is not None
            t = sampling.finish(d, args.top_p, u)
            flp.gather(-1, t[:, None])[:, 0].float().cpu().tolist()
            t.tolist()
            fused.step(t, lengths, args.filled + 1, u)

        for name, fn in (("graph replay", replay(plain)), ("sampler", sample),
                         ("exp alone", lambda: lp.exp()),
                         ("whole step (sample, copy, replay)", whole),
                         ("graph replay with the sampler's first round", replay(fused)),
                         ("whole step, first round in the graph (finish, copy, replay)",
                          whole_fused)):
            print(f"{name}: {timed(fn, args.iters):.3f} ms")
        kernels(replay(plain), args.top, "one graph replay")
        kernels(sample, args.top, "one sampler call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
