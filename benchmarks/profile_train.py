"""Where the training time goes, R against P: forward and backward per module, kernel level (GPU).

One micro-batch at the workload's training shape (qwen3-0.6b, 32 sequences x 192 tokens: the
step's micro-batch of ``job.run_training``), each module's training kernels (``SideKernels``
for training, as the learning step runs them, under ``rl.deterministic``), P and R side by side:

- per module (one attention block, one FFN block, the logp head) and for the whole model
  (embedding, 28 layers, logp): the median forward (autograd on) and backward time over
  ``--reps`` repetitions, CUDA events, and the R/P ratio;
- per module and phase, the top kernels by device time (torch.profiler, one repetition);
- the estimate for one step's training side: ``28 x (attention + ffn) + logp`` per micro-batch
  times the step's micro-batches, against the whole-model figure.

::

    python benchmarks/profile_train.py                        # R (the default backward) vs P
    python benchmarks/profile_train.py --impls production,rl_kernel,rl_kernel:recompute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pytest_rlkernel_matrix.workload.env import BACKWARD_ENV, backward_mode
from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling, r_backend
from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights
from pytest_rlkernel_matrix.workload.training import rl
from pytest_rlkernel_matrix.workload.weights import AttnInputs


def _once(fn: Callable[[], object]) -> float:
    """ms of one run of ``fn``: CUDA events on a GPU, the host clock after a sync elsewhere."""
    if not torch.cuda.is_available():  # a CPU smoke run (--device cpu)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _time(fn: Callable[[], object], reps: int) -> float:
    """Median ms of ``fn`` over ``reps`` runs, a warm-up first."""
    fn()
    return statistics.median(_once(fn) for _ in range(reps))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _kernels(fn: Callable[[], object], top: int) -> list[tuple[str, int, float]]:
    """(kernel name, calls, total device ms) of one run of ``fn``, the ``top`` heaviest."""
    _sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        _sync()
    kind = DeviceType.CUDA if torch.cuda.is_available() else DeviceType.CPU
    rows = [(e.key, e.count, (e.self_device_time_total if kind == DeviceType.CUDA
                              else e.self_cpu_time_total) / 1e3) for e in prof.key_averages()
            if e.device_type == kind and (e.self_device_time_total or e.self_cpu_time_total) > 0]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    return [("(all kernels)", sum(r[1] for r in rows), total), *rows[:top]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=192)
    ap.add_argument("--micro-batches", type=int, default=14, help="per step (448 / 32)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=7)
    ap.add_argument("--impls", default="production,rl_kernel",
                    help="production, rl_kernel, rl_kernel:<RLK_REF_R_BACKWARD mode>")
    ap.add_argument("--json", default="")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (tiny preset)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    rl.prepare_deterministic(dev)
    cfg = PRESETS[args.preset]
    dt = torch.bfloat16
    w = init_weights(cfg, 1234, dt, dev)
    for p in w.values():
        p.requires_grad_(True)
    model = Qwen3(cfg, w, args.seq)
    lw = model.layers[0]
    b, t, h = args.batch, args.seq, cfg.hidden_size
    gen = torch.Generator(device=dev).manual_seed(7)
    x = (torch.randn(b, t, h, generator=gen, device=dev) * 0.5).to(dt).requires_grad_(True)
    toks = torch.randint(2, cfg.vocab_size, (b, t), generator=gen, device=dev)
    targets = torch.randint(2, cfg.vocab_size, (b * t,), generator=gen, device=dev)
    pos = torch.arange(t, device=dev)[None].expand(b, t)
    inp = AttnInputs(pos, model.rope_cos[pos], model.rope_sin[pos], None, 0, None)
    print(f"{args.preset}: micro-batch {b} x {t} = {b * t} rows, bf16, "
          f"R backward (default) {backward_mode()!r}, r_backend {r_backend(dev)}; "
          f"{torch.cuda.get_device_name(0) if dev.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}")
    results: dict[str, dict] = {}
    for name in [s.strip() for s in args.impls.split(",") if s.strip()]:
        impl, _, mode = name.partition(":")  # rl_kernel:recompute: that R backward
        if mode:
            os.environ[BACKWARD_ENV] = mode
        else:
            os.environ.pop(BACKWARD_ENV, None)
        ks = SideKernels.build("training", dict.fromkeys(("attention", "ffn", "logp"), impl), dt,
                               Tiling.for_device(dev, t), cfg.rms_norm_eps, r_backend(dev))
        cases: dict[str, Callable[[], Tensor]] = {
            "attention": lambda ks=ks: ks.attention(x, lw, inp),
            "ffn": lambda ks=ks: ks.ffn(x, lw),
            "logp": lambda ks=ks: model.selected_logprobs(ks, x.reshape(-1, h), targets, 1.0),
            "model": lambda ks=ks: model.selected_logprobs(
                ks, model.hidden(ks, toks, pos, None).reshape(-1, h), targets, 1.0),
        }
        for mod, f in cases.items():
            ks.clear_cache()
            with torch.enable_grad(), rl.deterministic(dev):
                g = torch.randn(f().shape, generator=gen, device=dev) * 1e-3
                box: list[Tensor] = []

                def fwd(f: Callable[[], Tensor] = f, ks: SideKernels = ks,
                        box: list[Tensor] = box) -> None:
                    ks.clear_cache()
                    box[:] = [f()]

                def bwd(box: list[Tensor] = box, g: Tensor = g) -> None:
                    out = box.pop()
                    out.backward(g.to(out.dtype))

                fwd_ms = _time(fwd, args.reps)
                box.clear()
                ts = []
                for _ in range(args.reps + 1):
                    fwd()
                    _sync()
                    ts.append(_once(bwd))
                    for p in [*w.values(), x]:
                        p.grad = None
                bwd_ms = statistics.median(ts[1:])
                fwd()
                kf = _kernels(lambda box=box: (box.clear(), fwd()), args.top)
                kb = _kernels(bwd, args.top)
                for p in [*w.values(), x]:
                    p.grad = None
            results.setdefault(mod, {})[name] = {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
                                                  "fwd_kernels": kf, "bwd_kernels": kb}
            print(f"{name:11s} {mod:9s} fwd {fwd_ms:8.3f} ms  bwd {bwd_ms:8.3f} ms", flush=True)
    _report(results, cfg.num_hidden_layers, args.micro_batches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _report(res: dict[str, dict], layers: int, mbs: int) -> None:
    impls = list(next(iter(res.values())))
    print("\n| module | phase | " + " | ".join(f"{i} ms" for i in impls) + " | R/P |")
    print("| --- | --- |" + " --- |" * (len(impls) + 1))
    for mod, by in res.items():
        for ph in ("fwd", "bwd"):
            vals = [by[i][f"{ph}_ms"] for i in impls]
            ratio = (f"{by['rl_kernel'][f'{ph}_ms'] / by['production'][f'{ph}_ms']:.2f}x"
                     if {"rl_kernel", "production"} <= set(by) else "")
            print(f"| {mod} | {ph} | " + " | ".join(f"{v:.3f}" for v in vals) + f" | {ratio} |")
    for i in impls:
        est = sum(layers * (res[m][i]["fwd_ms"] + res[m][i]["bwd_ms"])
                  for m in ("attention", "ffn")) + res["logp"][i]["fwd_ms"] + \
            res["logp"][i]["bwd_ms"]
        whole = res["model"][i]["fwd_ms"] + res["model"][i]["bwd_ms"]
        print(f"{i}: per micro-batch, modules {layers} x (attn + ffn) + logp = {est:.1f} ms, "
              f"whole model fwd+bwd {whole:.1f} ms; x {mbs} micro-batches = "
              f"{whole * mbs / 1e3:.2f} s")
    for mod, by in res.items():
        if mod == "model":
            continue
        for i in impls:
            for ph in ("fwd", "bwd"):
                print(f"\n{i} {mod} {ph}: kernel, calls, device ms")
                for name, n, ms in by[i][f"{ph}_kernels"]:
                    print(f"  {ms:8.3f} {n:5d}  {name[:90]}")


if __name__ == "__main__":
    raise SystemExit(main())
