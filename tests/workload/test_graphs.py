"""Decode-graph bookkeeping that needs no GPU (the graphed rollout itself: test_triton_kernels)."""

from __future__ import annotations

import pytest
import torch

from pytest_rlkernel_matrix.workload.rollout.graphs import bucket_sizes, graph_mode_name


def test_bucket_sizes_largest_first_powers_of_two_down_to_16() -> None:
    assert bucket_sizes(448) == [448, 256, 128, 64, 32, 16]
    assert bucket_sizes(256) == [256, 128, 64, 32, 16]
    assert bucket_sizes(16) == [16]
    assert bucket_sizes(5) == [5]


def test_graph_mode_name_is_rl_kernels_spelling() -> None:
    expected = "compiled_hip_graph" if torch.version.hip else "compiled_cuda_graph"
    assert graph_mode_name() == expected


def test_runner_rollout_with_the_samplers_first_round_is_the_plain_rollout() -> None:
    """The decode runner (eager on the CPU: the code a graph captures) takes the sampler's
    first round with the step's log-probs, over its shrinking batch buckets (40, 32, 16: rows
    that finished stay in a bucket until the next one fits). Its rollout is the plain
    rollout bit for bit on the R path: the same tokens, the same log-probs."""
    from pytest_rlkernel_matrix.workload.job import run_rollout
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling
    from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights

    cfg = PRESETS["tiny"]
    w = init_weights(cfg, 3, torch.float32, torch.device("cpu"))
    k = SideKernels.build("rollout", dict.fromkeys(("attention", "ffn", "logp"), "rl_kernel"),
                          torch.float32, Tiling.for_device(torch.device("cpu"), 64),
                          cfg.rms_norm_eps)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg.vocab_size, (int(n),), generator=gen)
               for n in torch.randint(4, 12, (40,), generator=gen)]
    max_new = torch.randint(3, 30, (40,), generator=gen).tolist()
    rolls = [run_rollout(Qwen3(cfg, w, 64), k, prompts, max_new, 1.0, 0.9,
                         torch.Generator().manual_seed(2), graphs, ignore_eos=True)
             for graphs in (False, True)]
    for a, b in zip(rolls[0].tokens, rolls[1].tokens, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(rolls[0].logprobs, rolls[1].logprobs, strict=True):
        assert torch.equal(a, b)
    assert rolls[1].execution_mode == "eager" and rolls[1].fallback_reason == "no graphs on cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_sampler_rounds_inside_the_graph_change_no_token() -> None:
    """R on the GPU (batch-invariant Triton kernels): eager decode, graphs with the sampler
    after them, and graphs holding its rounds 0-1 give the same tokens and log-probs, bit for
    bit, over shrinking buckets; the manifest line says where the rounds ran."""
    from pytest_rlkernel_matrix.workload.job import run_rollout
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels, Tiling
    from pytest_rlkernel_matrix.workload.model import PRESETS, Qwen3, init_weights
    from pytest_rlkernel_matrix.workload.rollout import graphs, sampling

    dev = torch.device("cuda")
    cfg = PRESETS["small"]
    w = init_weights(cfg, 0, torch.bfloat16, dev)
    k = SideKernels.build("rollout", dict.fromkeys(("attention", "ffn", "logp"), "rl_kernel"),
                          torch.bfloat16, Tiling.for_device(dev, 96), cfg.rms_norm_eps, "triton")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, cfg.vocab_size, (int(n),), generator=gen).to(dev)
               for n in torch.randint(4, 24, (80,), generator=gen)]
    max_new = torch.randint(20, 60, (80,), generator=gen).tolist()

    def roll(use_graphs: bool, inside: bool):
        graphs.SAMPLER_IN_GRAPH = inside
        try:
            with torch.inference_mode():
                return run_rollout(Qwen3(cfg, w, 96), k, prompts, max_new, 1.0, 0.9,
                                   torch.Generator(device=dev).manual_seed(2), use_graphs)
        finally:
            graphs.SAMPLER_IN_GRAPH = True

    sampling.STATUS.pop("decode_graph", None)
    eager, outside = roll(False, True), roll(True, False)
    assert "decode_graph" not in sampling.STATUS
    inside = roll(True, True)
    assert sampling.STATUS["decode_graph"] == f"rounds 0-1 inside ({sampling.SPARE} rows)"
    assert inside.execution_mode == outside.execution_mode == graph_mode_name()
    for ro in (outside, inside):
        for a, b in zip(eager.tokens, ro.tokens, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(eager.logprobs, ro.logprobs, strict=True):
            assert torch.equal(a, b)
