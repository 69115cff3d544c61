"""Sweep of fixed matmul configurations at the qwen3-0.6b shapes (GPU): what the R matmul could
reach against cuBLAS, and whether each configuration keeps rows bitwise across M.

    python benchmarks/matmul_configs.py

Each configuration is fixed for every M (batch invariance needs that); the sweep only asks which
single configuration to fix. Times: ``triton.testing.do_bench`` medians (ms), bf16 in and out.
"""

from __future__ import annotations

import torch
import triton

from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels as tk

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024),
          "down": (1024, 3072), "lm_head": (151936, 1024)}
CONFIGS = {
    "128x128x64 w8 s3 (first version)": tk.MatmulConfig(128, 128, 64, 8, 8, 3),
    "128x256x64 w8 s3": tk.MatmulConfig(128, 256, 64, 8, 8, 3),
    "128x128x64 w4 s4 (fixed now)": tk.MatmulConfig(128, 128, 64, 8, 4, 4),
    "64x128x64 w4 s4": tk.MatmulConfig(64, 128, 64, 8, 4, 4),
}


def main() -> int:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    rows = []
    for m in (6144, 448):
        for name, (n, k) in SHAPES.items():
            a = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
            w = (torch.randn(n, k, generator=g) * 0.05).to(dev, torch.bfloat16)
            flops = 2.0 * m * n * k
            lib = triton.testing.do_bench(lambda a=a, w=w: torch.matmul(a, w.t()),
                                          return_mode="median")
            line = [f"{name}.m{m}", f"{flops / lib / 1e9:6.0f}"]
            for cfg in CONFIGS.values():
                t = triton.testing.do_bench(
                    lambda a=a, w=w, cfg=cfg: tk.matmul(a, w, torch.bfloat16, cfg),
                    return_mode="median")
                line.append(f"{flops / t / 1e9:6.0f} ({lib / t:4.2f})")
            rows.append(line)
    print("TFLOP/s (R/cuBLAS throughput) per fixed configuration; cuBLAS = torch.matmul")
    print("| shape | cuBLAS | " + " | ".join(CONFIGS) + " |")
    print("|" + " --- |" * (2 + len(CONFIGS)))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    a = torch.randn(300, 1024, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(4096, 1024, generator=g) * 0.05).to(dev, torch.bfloat16)
    for label, cfg in CONFIGS.items():
        full = tk.matmul(a, w, torch.float32, cfg)
        ok = all(torch.equal(tk.matmul(a[s:s + m], w, torch.float32, cfg), full[s:s + m])
                 for m in (1, 2, 3, 17, 64, 129) for s in (0, 7, 100))
        print(f"rows bitwise across M and offset, {label}: {ok}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
