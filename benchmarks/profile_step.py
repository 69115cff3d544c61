"""Where one RL step's time goes, per configuration (torch.profiler, GPU).

Builds the workload as ``job.run_cell`` does (same preset, prompts and sampling settings), runs
one step as warm-up, then profiles a second rollout and training recompute and prints the top
operators/kernels by device time and the host ranges ``rlk.sample`` / ``rlk.decode``::

    python benchmarks/profile_step.py --case R/R     # all modules R (Triton on a GPU)
    python benchmarks/profile_step.py --case P/P
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pytest_rlkernel_matrix.workload.job import run_rollout, run_training
from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling, r_backend
from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--case", default="R/R", choices=["R/R", "P/P"])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=448)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--micro-batch-size", type=int, default=32)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = PRESETS[args.preset]
    w = init_weights(cfg, 1234, torch.bfloat16, dev)
    max_seq = -(-(32 + args.max_new_tokens) // 16) * 16
    impl = "rl_kernel" if args.case == "R/R" else "production"
    impls = dict.fromkeys(("attention", "ffn", "logp"), impl)
    ks = {s: SideKernels.build(s, impls, torch.bfloat16, Tiling.for_device(dev, max_seq),
                               cfg.rms_norm_eps, r_backend(dev)) for s in ("training", "rollout")}
    gen = torch.Generator().manual_seed(1235)
    n = args.num_prompts
    plens = torch.randint(8, 33, (n,), generator=gen).tolist()
    prompts = [torch.randint(2, cfg.vocab_size, (p,), generator=gen).to(dev) for p in plens]
    max_new = torch.randint(max(1, args.max_new_tokens * 2 // 3), args.max_new_tokens + 1, (n,),
                            generator=gen).tolist()
    order = torch.randperm(n, generator=gen).tolist()
    train_model, roll_model = Qwen3(cfg, w, max_seq), Qwen3(cfg, w, max_seq)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        with torch.inference_mode(), record_function("rlk.rollout"):
            ro = run_rollout(roll_model, ks["rollout"], prompts, max_new, 1.0, 0.95,
                             torch.Generator(device=dev).manual_seed(1236), not args.no_graphs)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        with torch.inference_mode(), record_function("rlk.training"):
            run_training(train_model, ks["training"], ro, args.micro_batch_size, 1.0, order)
        torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t1

    print(f"{args.case} warm-up step: rollout {step()[0]:.3f} s")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        roll, train = step()
    print(f"{args.case} profiled step: rollout {roll:.3f} s, training {train:.3f} s "
          f"(profiler overhead included)")
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
    for name in ("rlk.rollout", "rlk.sample", "rlk.decode", "rlk.training"):
        for e in ka:
            if e.key == name:
                print(f"range {name}: host {e.cpu_time_total / 1e6:.3f} s over {e.count} calls, "
                      f"device {e.device_time_total / 1e6:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
