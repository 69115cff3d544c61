"""Decode loop under CUDA/HIP graphs at fixed batch buckets (both P and R rollout).

vLLM-style: the decode step (``Qwen3.decode_step``: embedding, every layer, final norm, LM head,
log-softmax) is captured once per batch bucket and replayed, with the sampler's first two
rounds over its log-probs (``sampling.first_round``: no host sync; ``sampling.finish`` takes any
round after, eager, with the bookkeeping; ``RLK_REF_SAMPLER_IN_GRAPH=0`` samples after the
graph). A bucket holds its own static inputs (token, position per slot) and KV caches. Finished
sequences keep their slot (its output is ignored) until the live count fits the next smaller
bucket; then the live rows' caches move to that bucket's caches and its graph is captured.

A P rollout's decode attention (masked SDPA over the cache) reads the keys up to the step's
key span, as vLLM's attention reads each sequence's own length: the span is the longest live
sequence rounded up to ``SPAN_UNIT`` positions, and each (bucket, span) pair is captured once
(the span only grows, the bucket only shrinks). R's attention reads each row's own keys
whatever the span, so an R rollout keeps one span, the whole cache (``span_unit=0``). Span
buckets are opt-in (``RLK_REF_DECODE_SPAN_UNIT``, e.g. 32; 0 keeps the whole cache).

The R kernels are batch-invariant, so a row's log-probs do not depend on the bucket's size, on
its slot, or on the dummy rows beside it: an R rollout gives the same bits eager or graphed.

``execution_mode`` is what RL-Kernel reports: ``compiled_cuda_graph`` / ``compiled_hip_graph``
when every decode step after the prefill was a graph replay, ``eager`` otherwise (graphs off,
CPU, or a capture that failed: ``fallback_reason`` says why).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from pytest_rlkernel_matrix.workload.kernels.side import SideKernels
from pytest_rlkernel_matrix.workload.model import Qwen3
from pytest_rlkernel_matrix.workload.rollout import sampling
from pytest_rlkernel_matrix.workload.weights import KVCache

MIN_BUCKET = 16
# The sampler's rounds 0 and 1 inside the decode graph (RLK_REF_SAMPLER_IN_GRAPH=0: after it).
SAMPLER_IN_GRAPH = os.environ.get("RLK_REF_SAMPLER_IN_GRAPH", "1") != "0"
# Opt-in (not yet measured on a GPU): 0, the default, keeps the whole cache as every step's span.
SPAN_UNIT = int(os.environ.get("RLK_REF_DECODE_SPAN_UNIT", "0"))


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
                 temperature: float, use_graphs: bool, span_unit: int = 0,
                 top_p: float | None = None) -> None:
        dev = caches[0].k.device
        self.model, self.kernels, self.temperature = model, kernels, temperature
        # top_p given: the graph also takes the sampler's rounds 0-1 (sampling.first_round)
        # over the step's log-probs, with this step's uniforms in ``self.u``
        self.top_p = top_p if sampling.FAST_PATHS and SAMPLER_IN_GRAPH else None
        self.span_unit, self.span = span_unit, model.max_seq_len
        self.buckets = bucket_sizes(caches[0].k.shape[0])
        self.bucket = self.buckets[0]
        self.caches = caches
        self.slots = torch.arange(self.bucket, device=dev)  # slot of each live row, row order
        self.tok = torch.zeros(self.bucket, dtype=torch.long, device=dev)
        self.pos = torch.zeros(self.bucket, dtype=torch.long, device=dev)
        self.u = torch.zeros(self.bucket, device=dev)
        self.use_graphs = use_graphs and dev.type == "cuda"
        self.fallback_reason = "" if self.use_graphs else (
            "decode graphs off" if dev.type == "cuda" else "no graphs on cpu")
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[Tensor, sampling.Drawn | None] | None = None
        self.per_replay = [0, 0, 0]
        self.captures = 0
        self.replays = 0
        self.capture_steps = 0  # steps whose output is their capture's warm-up (same kernels)
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
        self.u = torch.zeros(target, device=dev)
        self.graph, self.out = None, None

    def _eager(self) -> tuple[Tensor, sampling.Drawn | None]:
        lp = self.model.decode_step(self.kernels, self.tok, self.pos, self.caches,
                                    self.temperature, self.span)
        if self.top_p is None:
            return lp, None
        return lp, sampling.first_round(lp, self.top_p, self.u, sampling.SPARE)

    def _rows(self, out: tuple[Tensor, sampling.Drawn | None]
              ) -> tuple[Tensor, sampling.Drawn | None]:
        """The live rows of a step's output (the bucket's own tensors while every slot is live
        in order: no copy of the ``[bucket, V]`` log-probs)."""
        lp, drawn = out
        if self.slots.numel() == self.bucket:  # slots 0..bucket-1, none dropped since
            return lp, drawn
        return (lp.index_select(0, self.slots),
                None if drawn is None else drawn.rows(self.slots))

    def _capture(self) -> tuple[Tensor, sampling.Drawn | None] | None:
        """Capture this bucket's graph; the warm-up step's output (this step's log-probs, the
        bits a replay gives), or None when the capture failed."""
        mods = self._modules()
        before = [m.call_count for m in mods]
        warm: tuple[Tensor, sampling.Drawn | None] | None = None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compiles, workspaces; idempotent step
                warm = self._eager()
            torch.cuda.current_stream().wait_stream(side)
            mid = [m.call_count for m in mods]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                out = self._eager()
            self.per_replay = [m.call_count - c for m, c in zip(mods, mid, strict=True)]
            self.graph, self.out = graph, out
            self.captures += 1
            if self.top_p is not None:
                sampling.STATUS["decode_graph"] = f"rounds 0-1 inside ({sampling.SPARE} rows)"
        except Exception as exc:
            torch.cuda.synchronize()
            self.use_graphs = False
            self.fallback_reason = f"graph capture failed: {type(exc).__name__}: {exc}"
            print(f"[rlk-reference] decode graphs: eager fallback ({self.fallback_reason})")
            warm = None
        finally:
            for m, c in zip(mods, before, strict=True):
                m.call_count = c
        return warm

    def step(self, tok: Tensor, lengths: Tensor, need: int = 0, u: Tensor | None = None,
             ) -> tuple[Tensor, sampling.Drawn | None]:
        """Decode the live rows' tokens ``tok`` at positions ``lengths``: log-probs ``[n, V]``,
        and with ``top_p`` the sampler's rounds 0-1 over them with the rows' next uniforms
        ``u``. ``need``: an upper bound of ``max(lengths) + 1`` known on the host (the span)."""
        self.tok[self.slots] = tok
        self.pos[self.slots] = lengths
        if self.top_p is not None:
            assert u is not None, "a fused sampler round needs the step's uniforms"
            self.u[self.slots] = u
        if self.span_unit and need:
            span = min(self.model.max_seq_len, -(-need // self.span_unit) * self.span_unit)
            if span != self.span:
                self.span, self.graph, self.out = span, None, None
        if self.use_graphs and self.graph is None:
            warm = self._capture()
            if warm is not None and self.span_unit:  # span buckets capture often: the warm-up
                # step (the kernels a replay runs) already computed this step's output
                self.capture_steps += 1
                for m, n in zip(self._modules(), self.per_replay, strict=True):
                    m.call_count += n
                return self._rows(warm)
        if self.graph is not None and self.out is not None:
            self.graph.replay()
            self.replays += 1
            for m, n in zip(self._modules(), self.per_replay, strict=True):
                m.call_count += n
            out = self.out
        else:
            self.eager_steps += 1
            out = self._eager()
        return self._rows(out)
