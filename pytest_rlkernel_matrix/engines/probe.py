"""Probes and the perturbation drill in the engines job (issue 21).

The request, the tap and the files are the reference workload's (``workload/evidence/probe.py``:
``ProbeRequest`` reads ``RL_KERNEL_PROBE``, ``RL_KERNEL_PROBE_DIR``, ``RL_KERNEL_PROBE_TOKENS``,
``RL_KERNEL_PROBE_POSITIONS`` and ``RLK_REF_PERTURB``; ``Tap`` records and perturbs;
``workload/artifacts.write_probes`` writes ``<side>.rank00000.pt`` and ``index.json``). What this
module adds is where the engines' operator outputs come from:

- a module on the **R** path runs our kernels (``SideKernels``), which hand every operator to
  the tap themselves (:func:`attach` gives them the tap);
- a module on the **P** path is the engine's own: a forward hook on each of its modules
  (``mapping.engine_module``: the HF Qwen3 name of each operator -> the vLLM or Megatron-core
  module) hands the output to the same tap and returns the perturbed output when drilled;
  Megatron's ``[s, b, ...]`` activations are handed over batch-first, like our kernels' rows;
- rows: the rollout side taps **the decode step that produced each probe token** (the step whose
  input row sits at logit position ``prompt_len + token - 1``: the prefill's last row for token
  0). :class:`RequestRows` names the rows of every vLLM step ``(sample, position)`` from the
  step's attention metadata; the training side names the rows of each recompute micro-batch.

Only the tap's ``recording`` flag and the drill make the hooks do anything; without a probe or a
drill no hook is installed (the measured run is unhooked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pytest_rlkernel_matrix.workload.evidence.probe import Tap, operator_names
from pytest_rlkernel_matrix.workload.kernels.side import SideKernels

from .mapping import Shape, engine_module, fuse_qkv_out, split_qkv_out

Key = tuple[int, int]  # (sample, logit position)
TAPS = {  # written into each side's probe file ("tap") and the manifest
    "rollout": "decode step: the vLLM engine step that produced each probe token (prefill's "
               "last row for token 0), forward hooks on vLLM's modules (P) and our kernels' "
               "tap (R)",
    "training": "recompute forward: Megatron-core GPTModel forward of the probed sequence's "
                "micro-batch, forward hooks on Megatron's modules (P) and our kernels' tap (R)",
}
LAYER0_ATTN = "model.layers.0.self_attn.attn"


class ProbeError(RuntimeError):
    """The engine's step cannot be tied to the probe's rows (never guessed)."""


def attach(kernels: SideKernels, tap: Tap | None) -> None:
    """Give one side's kernels the tap (built after the engine, or rebuilt by it)."""
    kernels.tap = tap
    for k in (kernels.attention, kernels.ffn, kernels.logp):
        k.tap = tap


class RequestRows:
    """Which ``(sample, position)`` each row of a vLLM step is.

    A request is known by the first block of its KV cache (``block_table[r, 0]``: unique among
    the running requests, prefix caching is off); it is tied to its sample at its prefill (the
    step whose rows start at position 0), by the prompt tokens the rows carry."""

    def __init__(self, prompts: Sequence[Sequence[int]]) -> None:
        self.prompts = [list(map(int, p)) for p in prompts]
        self.by_block: dict[int, int] = {}
        self.keys: list[Key | None] = []
        self.logit_keys: list[Key | None] = []

    def assign(self, ids: Sequence[int], positions: Sequence[int], qsl: Sequence[int],
               seq_lens: Sequence[int], first_blocks: Sequence[int]) -> list[Key | None]:
        """Name the rows of one step (``qsl``: ``query_start_loc``; one entry of ``seq_lens``
        and ``first_blocks`` per request); also sets ``logit_keys`` (each request's last row,
        the rows vLLM computes logits for)."""
        keys: list[Key | None] = [None] * len(positions)
        logit: list[Key | None] = []
        for r, total in enumerate(seq_lens):
            s0, s1 = int(qsl[r]), int(qsl[r + 1])
            if s1 <= s0:
                continue
            start, blk = int(total) - (s1 - s0), int(first_blocks[r])
            if int(positions[s0]) != start:
                raise ProbeError(f"probe: request row {r} starts at position "
                                 f"{int(positions[s0])}, its metadata says {start}")
            if start == 0:
                chunk = [int(t) for t in ids[s0:s1]]
                hits = [i for i, p in enumerate(self.prompts) if p[:len(chunk)] == chunk]
                if len(hits) != 1:
                    raise ProbeError(f"probe: a prefill's tokens match {len(hits)} prompts "
                                     "(expected exactly one)")
                self.by_block[blk] = hits[0]
            sample = self.by_block.get(blk)
            if sample is None:
                raise ProbeError(f"probe: request row {r} (KV block {blk}) was not seen at "
                                 "its prefill")
            for row in range(s0, s1):
                keys[row] = (sample, int(positions[row]))
            logit.append(keys[s1 - 1])
        self.keys, self.logit_keys = keys, logit
        return keys

    def step(self, tap: Tap, input_ids: Tensor, positions: Tensor, meta: Any) -> None:
        """Name this forward's rows on the tap from vLLM's attention metadata."""
        if meta is None:  # profiling / dummy run: nothing to name
            self.keys, self.logit_keys = [None] * int(positions.shape[0]), []
        else:
            m = meta[LAYER0_ATTN] if isinstance(meta, dict) else meta
            seq = m.seq_lens.tolist()
            self.assign(input_ids.tolist(), positions.tolist(), m.query_start_loc.tolist(),
                        seq, m.block_table[:len(seq), 0].tolist())
        tap.rows(self.keys)


def _batch_first(t: Tensor) -> Tensor:
    return t.transpose(0, 1)


def _same(t: Tensor) -> Tensor:
    return t


def operator_module(op: str) -> str | None:
    """The matrix module an operator belongs to (attention, ffn, logp), None for the embedding
    (the judge's `judge.localise.probe.operator_module`; engines may not import the judge)."""
    if op.endswith(".input_layernorm") or ".self_attn." in op:
        return "attention"
    if op.endswith(".post_attention_layernorm") or ".mlp." in op:
        return "ffn"
    return "logp" if op in ("model.norm", "lm_head", "log_softmax") else None


def _hooks(root: nn.Module, tap: Tap, impls: dict[str, str], num_layers: int, engine: str,
           split: Callable[[Tensor], Sequence[Tensor]], fuse: Callable[..., Tensor],
           view: Callable[[str], Callable[[Tensor], Tensor]],
           log_softmax: Callable[[Tensor], Tensor]) -> list[Any]:
    """Forward (pre-)hooks on the engine's modules of every P operator; their handles."""
    groups: dict[tuple[str, bool], list[tuple[str, str]]] = {}
    for op in operator_names(num_layers):
        module = operator_module(op)
        if module is not None and impls.get(module) == "rl_kernel":
            continue  # our kernel taps it
        path, how = engine_module(op, engine)
        groups.setdefault((path, how == "input"), []).append((op, how))
    handles = []
    for (path, pre), ops in groups.items():
        mod = root.get_submodule(path)
        fn = view(path)
        if pre:
            handles.append(mod.register_forward_pre_hook(_pre_hook(tap, ops[0][0], fn)))
        else:
            handles.append(mod.register_forward_hook(
                _post_hook(tap, ops, fn, split, fuse, log_softmax)))
    return handles


def _pre_hook(tap: Tap, op: str, view: Callable[[Tensor], Tensor]) -> Any:
    def hook(_mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        v = view(args[0])
        r = tap.out(op, v)
        return None if r is v else (view(r).contiguous(), *args[1:])
    return hook


def _post_hook(tap: Tap, ops: list[tuple[str, str]], view: Callable[[Tensor], Tensor],
               split: Callable[[Tensor], Sequence[Tensor]], fuse: Callable[..., Tensor],
               log_softmax: Callable[[Tensor], Tensor]) -> Any:
    kind = ops[0][1].split(":")[0]

    def hook(_mod: nn.Module, _args: Any, out: Any) -> Any:
        y = out[0] if isinstance(out, tuple) else out
        if y is None:
            return None
        if kind == "out":
            pieces = [y]
        elif kind == "qkv":
            pieces = list(split(y))
        else:  # half: [gate | up]
            pieces = list(y.chunk(2, dim=-1))
        changed = False
        for op, how in ops:
            i = int(how.split(":")[1]) if ":" in how else 0
            v = view(pieces[i])
            r = tap.out(op, v)
            if op == "lm_head" and tap.recording:
                tap.out("log_softmax", log_softmax(r))
            if r is not v:
                pieces[i], changed = view(r).contiguous(), True
        if not changed:
            return None
        new = pieces[0] if kind == "out" else (
            fuse(*pieces) if kind == "qkv" else torch.cat(pieces, dim=-1))
        return (new, *out[1:]) if isinstance(out, tuple) else new
    return hook


def install_vllm(model: Any, tap: Tap, prompts: Sequence[Sequence[int]]) -> list[Any]:
    """Probe/drill on the rollout side: our vLLM model class ``RlkQwen3ForCausalLM``."""
    attach(model.kernels, tap)
    model.probe_rows = RequestRows(prompts)
    at = model.model.layers[0].self_attn
    q, kv = int(at.q_size), int(at.kv_size)

    def split(y: Tensor) -> Sequence[Tensor]:
        return y.split([q, kv, kv], dim=-1)

    def fuse(*parts: Tensor) -> Tensor:
        return torch.cat(parts, dim=-1)

    def log_softmax(z: Tensor) -> Tensor:  # what vLLM's sampler computes (raw_logprobs)
        return z.log_softmax(dim=-1, dtype=torch.float32)

    return _hooks(model, tap, model.impls, len(model.model.layers), "vllm", split, fuse,
                  lambda _path: _same, log_softmax)


def megatron_log_softmax(z: Tensor) -> Tensor:
    """The log-softmax Megatron's cross entropy computes (fp32: max-shift, exp-sum, log)."""
    lf = z.float()
    shifted = lf - lf.amax(-1, keepdim=True)
    return shifted - torch.log(shifted.exp().sum(-1, keepdim=True))


def install_megatron(trainer: Any, tap: Tap) -> list[Any]:
    """Probe/drill on the training side: Megatron-core's ``GPTModel`` in ``MegatronTrainer``
    (its R modules are our kernels, which already carry the tap)."""
    attach(trainer.kernels, tap)
    shape: Shape = trainer.shape

    def split(y: Tensor) -> Sequence[Tensor]:
        return split_qkv_out(y, shape)

    def fuse(*parts: Tensor) -> Tensor:
        return fuse_qkv_out(*parts, shape)

    def view(path: str) -> Callable[[Tensor], Tensor]:  # the embedding's output is [b, s, h]
        return _same if path == "embedding.word_embeddings" else _batch_first

    return _hooks(trainer.model, tap, trainer.impls, shape.num_layers, "megatron", split, fuse,
                  view, megatron_log_softmax)


def training_rows(tokens: Sequence[Tensor], mb: Sequence[int], width: int) -> list[Key | None]:
    """Rows of one recompute micro-batch, batch-first: ``(sample, position)`` or None (pad)."""
    return [(i, j) if j < tokens[i].numel() else None for i in mb for j in range(width)]
