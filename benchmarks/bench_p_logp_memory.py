"""Peak memory of P's training log-probabilities: today's whole-micro-batch path vs chunked.

Runs forward + backward of the selected-token log-probability of ``--rows`` tokens over a
``--vocab``-wide LM head (bf16, hidden ``--hidden``), once as P did before issue 46 (the full
``[rows, vocab]`` logits and ``native.megatron_log_softmax`` under autograd) and once through
``workload/kernels/p/p_logp.py`` (chunks of ``--chunk`` rows), and prints each one's peak of live
tensor
memory above the inputs and the ratio, side by side. The peak is torch's own accounting: on CUDA
``torch.cuda.max_memory_allocated``; on CPU the allocation and free events of
``torch.profiler`` (``profile_memory=True``), summed in order. Also checks that the selected
log-probabilities are the same bits.

    python benchmarks/bench_p_logp_memory.py                       # CPU, a small size
    python benchmarks/bench_p_logp_memory.py --device cuda --rows 33792 --vocab 151936 \
        --hidden 1024                                              # qwen3-0.6b, 32 x 1,056
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from pytest_rlkernel_matrix.workload.kernels.p import native, p_logp


def unchunked(hn: torch.Tensor, w: torch.Tensor, t: torch.Tensor, temp: float) -> torch.Tensor:
    lp = native.megatron_log_softmax(torch.nn.functional.linear(hn, w), temp)
    return lp.gather(-1, t[:, None])[:, 0]


def cpu_peak(fn: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Peak bytes of live CPU tensors while ``fn`` runs, from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:  # nbytes: + on allocation, - on free
        live += e.nbytes()
        peak = max(peak, live)
    return peak, out


def cuda_peak(fn: Callable[[], torch.Tensor], dev: torch.device) -> tuple[int, torch.Tensor]:
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    out = fn()
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - base, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    hn0 = torch.randn(args.rows, args.hidden, generator=gen).to(torch.bfloat16).to(dev)
    w0 = (0.05 * torch.randn(args.vocab, args.hidden, generator=gen)).to(torch.bfloat16).to(dev)
    tgt = torch.randint(0, args.vocab, (args.rows,), generator=gen).to(dev)
    grad = torch.randn(args.rows, generator=gen).to(dev)
    results = {}
    for name, f in (("unchunked (P before)", unchunked),
                    (f"chunked, {args.chunk} rows", lambda h, w, t, T: p_logp.selected(
                        h, w, t, T, args.chunk))):
        hn, w = hn0.clone().requires_grad_(), w0.clone().requires_grad_()

        def step(f: Callable[..., torch.Tensor] = f, hn: torch.Tensor = hn,
                 w: torch.Tensor = w) -> torch.Tensor:
            lp = f(hn, w, tgt, 1.0)
            lp.backward(grad)
            return lp.detach()

        peak, lp = cuda_peak(step, dev) if dev.type == "cuda" else cpu_peak(step)
        results[name] = (peak, lp)
    (n0, (p0, lp0)), (n1, (p1, lp1)) = results.items()
    fp32 = args.rows * args.vocab * 4
    print(f"rows={args.rows} vocab={args.vocab} hidden={args.hidden} device={dev} "
          f"(one fp32 [rows, vocab] tensor: {fp32 / 2**20:.1f} MiB)")
    print(f"{'path':<28} {'peak MiB':>10} {'x fp32 [rows,vocab]':>20}")
    for n, p in ((n0, p0), (n1, p1)):
        print(f"{n:<28} {p / 2**20:>10.1f} {p / fp32:>20.2f}")
    print(f"chunked / unchunked peak: {p1 / p0:.3f}; selected logprobs bitwise equal: "
          f"{torch.equal(lp0, lp1)}")


if __name__ == "__main__":
    main()
