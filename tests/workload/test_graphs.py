"""Decode-graph bookkeeping that needs no GPU (the graphed rollout itself: test_triton_kernels)."""

from __future__ import annotations

import torch

from pytest_rlkernel_matrix.workload.graphs import bucket_sizes, graph_mode_name


def test_bucket_sizes_largest_first_powers_of_two_down_to_16() -> None:
    assert bucket_sizes(448) == [448, 256, 128, 64, 32, 16]
    assert bucket_sizes(256) == [256, 128, 64, 32, 16]
    assert bucket_sizes(16) == [16]
    assert bucket_sizes(5) == [5]


def test_graph_mode_name_is_rl_kernels_spelling() -> None:
    expected = "compiled_hip_graph" if torch.version.hip else "compiled_cuda_graph"
    assert graph_mode_name() == expected
