"""P's Triton decode attention (``workload/kernels/p/triton_decode.py``): each row's softmax over
its own
keys of the token-major cache, every query head of a KV head in one tile, any key split.

On a GPU the kernel runs in bf16 at qwen3-0.6b's head layout; on a CPU with triton installed
and ``TRITON_INTERPRET=1`` the same kernel runs in Triton's interpreter in fp32, small
(``test_interpreter_subprocess`` starts that run where triton is installed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from triton_env import CUDA, DEV, DT, HAS_TRITON, INTERPRET, needs_kernels

from pytest_rlkernel_matrix.workload.kernels.p import native, triton_decode

TOL = 2e-2 if CUDA else 1e-5  # bf16 output against fp32 math; fp32 in the interpreter
# GPU: qwen3-0.6b's heads (16 query, 8 KV, 128 wide); interpreter: small, 3 query heads per KV.
SHAPE = (37, 192, 16, 8, 128) if CUDA else (5, 40, 6, 2, 16)
CONFIGS = ([(64, 4, 2, 1), (64, 4, 2, 4), (32, 4, 1, 1)] if CUDA
           else [(16, 1, 1, 1), (16, 1, 1, 3), (32, 2, 1, 2)])


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    b, cap, hq, hkv, d = SHAPE
    g = torch.Generator().manual_seed(seed)
    kc, vc = torch.randn(b, cap, hkv, d, generator=g), torch.randn(b, cap, hkv, d, generator=g)
    q = torch.randn(b, hq, d, generator=g)
    pos = torch.randint(0, cap, (b, 1), generator=g)
    pos[0, 0], pos[1, 0] = 0, cap - 1  # the first key alone, the last slot
    return (*(x.to(DEV, DT) for x in (q, kc, vc)), pos.to(DEV))


def _masked_sdpa(q, kc, vc, pos):
    b, cap, hkv, d = kc.shape
    mask = torch.arange(cap, device=q.device)[None, :] <= pos
    return F.scaled_dot_product_attention(
        q.float().reshape(b, hkv, -1, d), kc.float().transpose(1, 2), vc.float().transpose(1, 2),
        attn_mask=mask[:, None, None, :]).reshape(q.shape)


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "bn{}-w{}-s{}-split{}".format(*c))
def test_triton_decode_is_masked_attention_over_each_rows_keys(config) -> None:
    """Within rounding of the masked SDPA (fp32 math over the same inputs), for every split of
    the key axis; keys past a row's position (garbage here) are never read."""
    q, kc, vc, pos = _inputs(4)
    got = triton_decode.decode_attention(q, kc, vc, pos, config)
    assert got.shape == q.shape and got.dtype == q.dtype
    err = (got.float() - _masked_sdpa(q, kc, vc, pos)).abs().max().item()
    assert err < TOL, err
    past = torch.arange(kc.shape[1], device=DEV)[None, :].expand(kc.shape[:2]) > pos
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[past], vc2[past] = 1e4, -1e4
    assert torch.equal(triton_decode.decode_attention(q, kc2, vc2, pos, config), got)


@needs_kernels
@pytest.mark.gpu
def test_triton_decode_splits_agree() -> None:
    """A split key axis combined by log-sum-exp gives the unsplit result to fp32 rounding."""
    q, kc, vc, pos = _inputs(9)
    one = triton_decode.decode_attention(q, kc, vc, pos, CONFIGS[0])
    split = triton_decode.decode_attention(q, kc, vc, pos, CONFIGS[1])
    assert (one.float() - split.float()).abs().max().item() < TOL


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and HAS_TRITON), reason="needs a CUDA device with triton")
def test_gpu_decode_route_is_triton_and_said() -> None:
    native.STATUS.pop("decode_attention", None)
    q = torch.zeros(2, 16, 128, device="cuda", dtype=torch.bfloat16)
    assert native.decode_route(q) == "triton", native.STATUS
    assert native.STATUS["decode_attention"].startswith("triton grouped decode")


def test_bad_shapes_are_refused_with_the_shapes() -> None:
    q, kc = torch.zeros(2, 6, 16), torch.zeros(2, 8, 4, 16)  # 6 query heads over 4 KV heads
    with pytest.raises(ValueError, match=r"decode_attention: q \(2, 6, 16\) k \(2, 8, 4, 16\)"):
        triton_decode.decode_attention(q, kc, kc, torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="k_cache head dim must be contiguous"):
        kt = torch.zeros(2, 8, 16, 2).transpose(2, 3)
        triton_decode.decode_attention(torch.zeros(2, 4, 16), kt, kt,
                                       torch.zeros(2, 1, dtype=torch.long))


def test_cpu_tensors_take_no_gpu_route() -> None:
    assert native.decode_route(torch.zeros(2, 4, 16)) == ""


@pytest.mark.skipif(CUDA or not HAS_TRITON or INTERPRET,
                    reason="the interpreter run is for a CPU box with triton installed")
def test_interpreter_subprocess() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:rlkernel_matrix", "-k", "not interpreter_subprocess",
                        __file__], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{len(CONFIGS) + 3} passed" in r.stdout  # the kernel's, the splits', two CPU tests
