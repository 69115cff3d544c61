"""R (RL-Kernel aligned) vs P (production) per module on the same inputs.

Run: ``pytest benchmarks/ --benchmark-only``. Each module is timed for P and R on identical
inputs (one training micro-batch; the tiny preset on CPU, the qwen3-0.6b shape on CUDA); the R/P
time ratio per module is printed at the end of the session and stored in each benchmark's
``extra_info``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from pytest_rlkernel_matrix.workload.kernels import SideKernels, Tiling
from pytest_rlkernel_matrix.workload.model import PRESETS, AttnInputs, Qwen3, init_weights

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
                          Tiling.for_device(DEVICE, SEQ), m.cfg.rms_norm_eps)
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


@pytest.fixture(scope="session", autouse=True)
def _print_ratio_table() -> Iterator[None]:
    yield
    if not RESULTS:
        return
    print(f"\nR/P time ratio per module ({PRESET} shape, {DEVICE.type}, one micro-batch of "
          f"{BATCH}x{SEQ} tokens):")
    for module in ("attention", "ffn", "logp"):
        p, r = RESULTS.get((module, "production")), RESULTS.get((module, "rl_kernel"))
        if p and r:
            print(f"  {module:9s}  P {p * 1e3:8.3f} ms   R {r * 1e3:8.3f} ms   R/P {r / p:6.2f}")
