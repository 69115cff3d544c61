"""Decode loop under CUDA/HIP graphs at fixed batch buckets (both P and R rollout).

vLLM-style: the decode step (``Qwen3.decode_step``: embedding, every layer, final norm, LM head,
log-softmax) is captured once per batch bucket and replayed; sampling and bookkeeping stay
eager. A bucket holds its own static inputs (token, position per slot) and KV caches. Finished
sequences keep their slot (its output is ignored) until the live count fits the next smaller
bucket; then the live rows' caches move to that bucket's caches and its graph is captured.

The R kernels are batch-invariant, so a row's log-probs do not depend on the bucket's size, on
its slot, or on the dummy rows beside it: an R rollout gives the same bits eager or graphed.

``execution_mode`` is what RL-Kernel reports: ``compiled_cuda_graph`` / ``compiled_hip_graph``
when every decode step after the prefill was a graph replay, ``eager`` otherwise (graphs off,
CPU, or a capture that failed: ``fallback_reason`` says why).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .kernels import SideKernels
from .model import Qwen3
from .weights import KVCache

MIN_BUCKET = 16


def graph_mode_name() -> str:
    """The RL-Kernel ``execution_mode`` of a graph replay on this build."""
    return "compiled_hip_graph" if torch.version.hip else "compiled_cuda_graph"


def bucket_sizes(n: int) -> list[int]:
    """Batch buckets for ``n`` sequences, largest first: ``n``, then powers of two >= 16."""
    sizes = {n}
    b = MIN_BUCKET
    while b < n:
        sizes.add(b)
        b *= 2
    return sorted(sizes, reverse=True)


class DecodeRunner:
    """Runs decode steps for a shrinking set of live rows, graphed per bucket when asked."""

    def __init__(self, model: Qwen3, kernels: SideKernels, caches: list[KVCache],
                 temperature: float, use_graphs: bool) -> None:
        dev = caches[0].k.device
        self.model, self.kernels, self.temperature = model, kernels, temperature
        self.buckets = bucket_sizes(caches[0].k.shape[0])
        self.bucket = self.buckets[0]
        self.caches = caches
        self.slots = torch.arange(self.bucket, device=dev)  # slot of each live row, row order
        self.tok = torch.zeros(self.bucket, dtype=torch.long, device=dev)
        self.pos = torch.zeros(self.bucket, dtype=torch.long, device=dev)
        self.use_graphs = use_graphs and dev.type == "cuda"
        self.fallback_reason = "" if self.use_graphs else (
            "decode graphs off" if dev.type == "cuda" else "no graphs on cpu")
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Tensor | None = None
        self.per_replay = [0, 0, 0]
        self.captures = 0
        self.replays = 0
        self.eager_steps = 0

    @property
    def execution_mode(self) -> str:
        if self.use_graphs and self.eager_steps == 0 and self.replays:
            return graph_mode_name()
        return "eager"

    def _modules(self) -> list:
        k = self.kernels
        return [k.attention, k.ffn, k.logp]

    def keep(self, rows: Tensor) -> None:
        """Keep only the live rows ``rows`` (indices into the current live rows)."""
        self.slots = self.slots.index_select(0, rows)
        live = int(rows.numel())
        target = min(b for b in self.buckets if b >= live)
        if target >= self.bucket:
            return
        new = self.model.new_cache(target)
        for old, nc in zip(self.caches, new, strict=True):
            nc.k[:live] = old.k.index_select(0, self.slots)
            nc.v[:live] = old.v.index_select(0, self.slots)
        dev = self.tok.device
        self.caches, self.bucket = new, target
        self.slots = torch.arange(live, device=dev)
        self.tok = torch.zeros(target, dtype=torch.long, device=dev)
        self.pos = torch.zeros(target, dtype=torch.long, device=dev)
        self.graph, self.out = None, None

    def _eager(self) -> Tensor:
        return self.model.decode_step(self.kernels, self.tok, self.pos, self.caches,
                                      self.temperature)

    def _capture(self) -> None:
        mods = self._modules()
        before = [m.call_count for m in mods]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compiles, workspaces; idempotent step
                self._eager()
            torch.cuda.current_stream().wait_stream(side)
            mid = [m.call_count for m in mods]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                out = self._eager()
            self.per_replay = [m.call_count - c for m, c in zip(mods, mid, strict=True)]
            self.graph, self.out = graph, out
            self.captures += 1
        except Exception as exc:
            torch.cuda.synchronize()
            self.use_graphs = False
            self.fallback_reason = f"graph capture failed: {type(exc).__name__}: {exc}"
            print(f"[rlk-reference] decode graphs: eager fallback ({self.fallback_reason})")
        finally:
            for m, c in zip(mods, before, strict=True):
                m.call_count = c

    def step(self, tok: Tensor, lengths: Tensor) -> Tensor:
        """Decode the live rows' tokens ``tok`` at positions ``lengths``: log-probs ``[n, V]``."""
        self.tok[self.slots] = tok
        self.pos[self.slots] = lengths
        if self.use_graphs and self.graph is None:
            self._capture()
        if self.graph is not None and self.out is not None:
            self.graph.replay()
            self.replays += 1
            for m, n in zip(self._modules(), self.per_replay, strict=True):
                m.call_count += n
            out = self.out
        else:
            self.eager_steps += 1
            out = self._eager()
        return out.index_select(0, self.slots)
