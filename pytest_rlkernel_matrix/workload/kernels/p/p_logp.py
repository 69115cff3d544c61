"""P's training log-probabilities as Megatron computes them at long lengths: chunked over tokens.

Today's P (``kernels.LogpKernel._p_full`` then a gather) makes the full-vocabulary logits of a
whole micro-batch and, under autograd, keeps several ``[tokens, vocab]`` fp32 tensors of
``native.megatron_log_softmax`` for the backward: at 128 prompts x 1,024 new tokens with
micro-batch 32 that is 18 GiB per tensor for qwen3-0.6b and one H200 runs out of memory
(issue 46). Megatron does not hold those at these sizes (its fused / vocab-parallel cross entropy
keeps one softmax buffer per rank, and RL frameworks on top of it compute log-probabilities in
chunks of tokens). Here the selected-token log-probability of P's training side runs over
fixed chunks of rows:

- **forward**: for each chunk of ``rows`` tokens, the logits ``F.linear(hn, W)`` in the model
  dtype, then the very ops of ``native.megatron_log_softmax`` (divide by the temperature in the
  model dtype, fp32 max / exp-sum / log) and the gather of the target. Only ``hn`` (the final
  norm's output, ``[tokens, hidden]``) is kept for the backward, not the logits.
- **backward**: each chunk's forward is recomputed under autograd (the same ops, so the same
  backward ops autograd ran for the whole micro-batch) and back-propagated with that chunk's
  incoming gradient; ``d hn`` of the chunk is written to its rows, ``d W`` of every chunk is
  added up in fp32 and cast to the weight's dtype once.

Numerics (the contract, tested in ``tests/workload/test_p_logp.py``): every op after the logits
GEMM works row by row over the whole vocabulary, so a row's selected log-probability is the bits
of today's P whenever its logits are; the logits GEMM of a chunk has fewer rows than the
micro-batch's, and a library GEMM may round a row differently with a different row count (on
the CPU box the tests found none; cuBLAS chooses kernels by shape) -- the same variation today's
P already shows between micro-batch sizes and compositions, P being the production path whose
batch variance is the thing the matrix measures. With one chunk (``rows`` >= tokens) the
forward and both gradients are today's P's bit for bit. With several, ``d W`` of the LM head is
summed over chunks in fp32 instead of inside one GEMM: a different order of the same fp32 sum,
not a precision loss (no bf16 rounding between chunks).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_rlkernel_matrix.workload.kernels.p.native import megatron_log_softmax

# fp32 logits elements per chunk (2**27: 512 MiB per fp32 [rows, vocab] temporary; the backward's
# recompute holds about 5.5 of them at its peak, benchmarks/bench_p_logp_memory.py); the row
# count follows the vocabulary: 883 rows for qwen3-0.6b's 151,936, every row at once for tiny.
CHUNK_ELEMENTS = int(os.environ.get("RLK_REF_P_LOGP_CHUNK_ELEMENTS", str(2 ** 27)))


def chunk_rows(vocab: int, elements: int | None = None) -> int:
    """Rows per chunk so that one fp32 ``[rows, vocab]`` temporary holds ``elements`` values."""
    return max(1, (CHUNK_ELEMENTS if elements is None else elements) // max(1, vocab))


def _chunk(hn: Tensor, w: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """Today's P on one chunk of rows: logits, Megatron's log-softmax, the target's value."""
    lp = megatron_log_softmax(F.linear(hn, w), temperature)
    return lp.gather(-1, targets[:, None])[:, 0]


def _acc_fp32(acc: Tensor | None, a: Tensor, b: Tensor) -> Tensor:
    """``acc + a @ b`` for model-dtype operands, accumulated in fp32 (Megatron's fp32 wgrad
    accumulation). CUDA: the GEMM's own fp32 output (``torch.mm(..., out_dtype=)``) where this
    torch has it; else the operands cast to fp32 (their products are exact in fp32 either way;
    on CUDA that fallback is an fp32 GEMM, slower) and added in place."""
    if a.is_cuda and a.dtype != torch.float32:
        try:
            part = torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
        else:
            return part if acc is None else acc.add_(part)
    if acc is None:
        return torch.mm(a.float(), b.float())
    return acc.addmm_(a.float(), b.float())


class _Selected(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hn: Tensor, w: Tensor, targets: Tensor, temperature: float,
                rows: int) -> Tensor:
        ctx.temperature, ctx.rows = temperature, rows
        ctx.save_for_backward(hn, w, targets)
        n = hn.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hn.device)
        with torch.no_grad():
            for s in range(0, n, rows):
                out[s:s + rows] = _chunk(hn[s:s + rows], w, targets[s:s + rows], temperature)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hn, w, targets = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, rows = hn.shape[0], ctx.rows
        dh = torch.empty_like(hn) if need_h else None
        dw: Tensor | None = None
        single = n <= rows
        for s in range(0, n, rows):
            with torch.enable_grad():
                hc = hn[s:s + rows].detach().requires_grad_(need_h)
                wc = w.detach().requires_grad_(need_w and single)
                logits = F.linear(hc, wc)
                lp = megatron_log_softmax(logits, ctx.temperature)
                out = lp.gather(-1, targets[s:s + rows, None])[:, 0]
                # one chunk: autograd's own d hn and d W (today's bits); several: d hn from
                # autograd, d W summed below in fp32 from the logits' gradient
                inputs = [hc] if need_h else []
                inputs += [wc] if need_w and single else [logits] if need_w else []
                got = list(torch.autograd.grad(out, inputs, grad[s:s + rows]))
                del logits, lp, out  # this chunk's graph goes before the next one's is built
            if need_h:
                assert dh is not None
                dh[s:s + rows] = got.pop(0)
            if need_w and single:
                dw = got.pop(0)
            elif need_w:
                dw = _acc_fp32(dw, got.pop(0).t(), hc.detach())
        if dw is not None:
            dw = dw.to(w.dtype)
        return dh, dw, None, None, None


def selected(hn: Tensor, lm_head: Tensor, targets: Tensor, temperature: float,
             rows: int | None = None) -> Tensor:
    """fp32 log-probability ``[N]`` of ``targets [N]`` for final-norm outputs ``hn [N, H]``,
    Megatron's math over chunks of ``rows`` tokens (default ``chunk_rows(vocab)``)."""
    rows = rows or chunk_rows(lm_head.shape[0])
    if hn.shape[0] == 0:
        return hn.new_empty((0,), dtype=torch.float32)
    out: Tensor = _Selected.apply(hn, lm_head, targets, temperature, rows)
    return out
