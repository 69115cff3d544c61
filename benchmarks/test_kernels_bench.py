"""R (RL-Kernel aligned) vs P (production) per module on the same inputs, and the R kernels alone.

Run: ``pytest benchmarks/ --benchmark-only``. Each module is timed for P and R on identical
inputs (one training micro-batch; the tiny preset on CPU, the qwen3-0.6b shape on CUDA); the R/P
time ratio per module is printed at the end of the session and stored in each benchmark's
``extra_info``. On a GPU, R is the Triton path (``kernels.r_backend``), and ``test_kernel``
times each R kernel against its library counterpart (the R matmul against ``torch.matmul``, i.e.
cuBLAS/hipBLASLt; R attention against SDPA) at the qwen3-0.6b shapes of a training micro-batch
(32 x 192 tokens) and of a 448-row decode step, printing achieved TFLOP/s and the ratio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling, r_backend
from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights
from pytest_rlkernel_matrix.workload.weights import AttnInputs

BATCH, SEQ = 4, 192
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PRESET = "qwen3-0.6b" if DEVICE.type == "cuda" else "tiny"
RESULTS: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module")
def setup() -> dict:
    cfg = PRESETS[PRESET]
    model = Qwen3(cfg, init_weights(cfg, 0, torch.bfloat16, DEVICE), SEQ)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, SEQ, cfg.hidden_size, generator=gen).to(DEVICE, torch.bfloat16)
    pos = torch.arange(SEQ, device=DEVICE)[None].expand(BATCH, SEQ)
    tgt = torch.randint(0, cfg.vocab_size, (BATCH * SEQ,), generator=gen).to(DEVICE)
    return {"model": model, "x": x, "pos": pos, "tgt": tgt}


def _call(setup: dict, module: str, impl: str) -> Callable[[], torch.Tensor]:
    m: Qwen3 = setup["model"]
    impls = {"attention": "rl_kernel", "ffn": "rl_kernel", "logp": "rl_kernel", module: impl}
    k = SideKernels.build("training", impls, torch.bfloat16,
                          Tiling.for_device(DEVICE, SEQ), m.cfg.rms_norm_eps, r_backend(DEVICE))
    x, pos, layer = setup["x"], setup["pos"], m.layers[0]
    if module == "attention":
        inp = AttnInputs(pos, m.rope_cos[pos], m.rope_sin[pos], None)
        return lambda: k.attention(x, layer, inp)
    if module == "ffn":
        return lambda: k.ffn(x, layer)
    h = x.reshape(-1, x.shape[-1])
    return lambda: m.selected_logprobs(k, h, setup["tgt"], 1.0)


@pytest.mark.parametrize("impl", ["production", "rl_kernel"])
@pytest.mark.parametrize("module", ["attention", "ffn", "logp"])
def test_module(benchmark, setup: dict, module: str, impl: str) -> None:
    call = _call(setup, module, impl)

    def fn() -> torch.Tensor:
        out = call()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return out

    with torch.inference_mode():
        benchmark.extra_info.update(module=module, implementation=impl, rows=BATCH * SEQ)
        benchmark(fn)
    RESULTS[(module, impl)] = benchmark.stats.stats.mean
    if (module, "production") in RESULTS and impl == "rl_kernel":
        benchmark.extra_info["r_over_p"] = RESULTS[(module, impl)] / RESULTS[(module, "production")]


# ---------------------------------------------------------------------------------------------
# The R kernels alone vs their library counterparts (GPU only).

KERNELS: dict[tuple[str, str], tuple[float, float]] = {}  # (case, impl) -> (seconds, flops)
REPS = 20  # calls per timed round: launch latency amortised, one sync per round
MM_SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024),
             "down": (1024, 3072), "lm_head": (151936, 1024)}
KERNEL_CASES = [f"matmul.{name}.m{m}" for m in (6144, 448) for name in MM_SHAPES] + [
    "attention.train.32x192", "attention.decode.448"]


def _kernel_call(case: str, impl: str) -> tuple[Callable[[], object], float]:
    from pytest_rlkernel_matrix.workload.kernels.r import triton_kernels as tk

    gen = torch.Generator().manual_seed(0)
    if case.startswith("matmul"):
        _, name, mtag = case.split(".")
        (n, k), m = MM_SHAPES[name], int(mtag[1:])
        a = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(DEVICE, torch.bfloat16)
        flops = 2.0 * m * n * k
        if impl == "rl_kernel":
            return lambda: tk.matmul(a, w, torch.bfloat16), flops
        return lambda: torch.matmul(a, w.t()), flops
    hq, hkv, d = 16, 8, 128
    if case == "attention.train.32x192":
        b, t, span = 32, 192, 192
        pos = torch.arange(t, device=DEVICE)[None].expand(b, t)
        flops = 4.0 * b * hq * d * t * (t + 1) / 2  # causal: QK^T and PV over visible keys
    else:
        b, t, span = 448, 1, 192
        pos = torch.full((b, 1), 170, device=DEVICE)
        flops = 4.0 * b * hq * d * 171
    q = torch.randn(b, t, hq, d, generator=gen).to(DEVICE, torch.bfloat16)
    kc = torch.randn(b, span, hkv, d, generator=gen).to(DEVICE, torch.bfloat16)
    vc = torch.randn(b, span, hkv, d, generator=gen).to(DEVICE, torch.bfloat16)
    if impl == "rl_kernel":
        return lambda: tk.attention(q, kc, vc, pos), flops
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    if t > 1:
        return lambda: torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, enable_gqa=True), flops
    mask = (torch.arange(span, device=DEVICE)[None, :] <= pos)[:, None, None, :]
    return lambda: torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=mask, enable_gqa=True), flops


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="kernel throughput: needs a GPU")
@pytest.mark.parametrize("impl", ["production", "rl_kernel"])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel(benchmark, case: str, impl: str) -> None:
    call, flops = _kernel_call(case, impl)

    def fn() -> None:
        for _ in range(REPS):
            call()
        torch.cuda.synchronize()

    with torch.inference_mode():
        fn()  # compile / autotune outside the timing
        benchmark.extra_info.update(case=case, implementation=impl, reps_per_round=REPS)
        benchmark(fn)
    sec = benchmark.stats.stats.median / REPS
    KERNELS[(case, impl)] = (sec, flops)
    benchmark.extra_info["tflops"] = flops / sec / 1e12


@pytest.fixture(scope="session", autouse=True)
def _print_ratio_table() -> Iterator[None]:
    yield
    if KERNELS:
        print(f"\nR kernels vs library (median of rounds of {REPS} calls; TFLOP/s achieved; "
              "ratio = library time / R time, >1 means R is faster):")
        for case in KERNEL_CASES:
            p, r = KERNELS.get((case, "production")), KERNELS.get((case, "rl_kernel"))
            if p and r:
                print(f"  {case:26s} lib {p[0] * 1e6:9.1f} us {p[1] / p[0] / 1e12:7.1f} TF/s   "
                      f"R {r[0] * 1e6:9.1f} us {r[1] / r[0] / 1e12:7.1f} TF/s   "
                      f"R/lib throughput {p[0] / r[0]:5.2f}")
    if not RESULTS:
        return
    print(f"\nR/P time ratio per module ({PRESET} shape, {DEVICE.type}, one micro-batch of "
          f"{BATCH}x{SEQ} tokens):")
    for module in ("attention", "ffn", "logp"):
        p, r = RESULTS.get((module, "production")), RESULTS.get((module, "rl_kernel"))
        if p and r:
            print(f"  {module:9s}  P {p * 1e3:8.3f} ms   R {r * 1e3:8.3f} ms   R/P {r / p:6.2f}")
