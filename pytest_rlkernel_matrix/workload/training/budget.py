"""How many samples go in a training micro-batch: chosen by tokens and memory, checked up front.

A micro-batch used to be a prompt count per preset (qwen3-0.6b: 32), whatever the length: at
1,024 new tokens that is 32 x 1,056 tokens and P ran out of memory on a 141 GB H200 (issue 46).
Megatron-based RL frameworks size micro-batches by tokens (slime's dynamic batch size,
``--max-tokens-per-gpu``); so does this workload now:

- ``MICRO_BATCH_TOKENS[preset]`` tokens per micro-batch (qwen3-0.6b: 8,448 = 8 x 1,056, the
  micro-batch measured at 1,024 new tokens; 2 samples at 4,096, 44 at 160), divided by the
  padded sequence length ``max_seq``, at least 1 and at most the prompt count;
- lowered to stay at or below a measured cliff (``CLIFFS``: a micro-batch size, in tokens, past
  which one side's training cost per token was measured to rise) of either side;
- lowered further when ``estimate`` says the training step would not fit the device's memory;
- a size that cannot fit at all (one sequence's training step, or the rollout's KV cache) is a
  ``UsageError`` naming the size and what to change, raised before any weight is made.

What was chosen and why goes to the run's manifest (``Choice.manifest``: the size, ``chosen_by``,
a sentence saying why, and every cliff of the preset with whether it lowered the size).

The cliff issue 55 measured (R's training cost per token 2.8x at 44 samples x 160 new tokens
what it was at 32, on an H200) was not a token count: it came with micro-batches whose
``samples x padded length`` is not a multiple of 16, which made R's weight-gradient products
read unaligned rows (``triton_backward.matmul_bwd`` now pads that axis). No cliff measured on
the current kernels is in ``CLIFFS``; a new measurement adds one here, with where it was
measured, and the chooser keeps to its side.

The memory model is an estimate, deliberately on the high side, and states its terms: the
weights and their training state (weight, gradient, AdamW's two moments, the rollout copy, R's
derived copies), the rollout's KV cache (``new_cache``: every prompt's full ``max_seq``), and per
training token the activations autograd keeps (counted as fp32 copies of each layer's hidden,
q/k/v, attention output and MLP tensors) plus the LM head's: R's Triton path keeps each row's
fp32 logits for its backward (``triton_kernels.logits_chunks``), P's chunked path a fixed
number of chunk-sized ones (``p_logp.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pytest_rlkernel_matrix.workload.env import UsageError
from pytest_rlkernel_matrix.workload.model import ModelConfig, weight_names

MICRO_BATCH_TOKENS = {"tiny": 320, "small": 576, "qwen3-0.6b": 8448}


@dataclass(frozen=True)
class Cliff:
    """A measured rise of one side's (``R`` or ``P``) training cost per token: micro-batches of
    more than ``above_tokens`` tokens cost ``rise`` times as much per token as one at or below
    it, on ``device``; ``source`` says where the measurement is written down."""

    preset: str
    side: str
    above_tokens: int
    rise: float
    device: str
    source: str

    def __post_init__(self) -> None:
        if self.side not in ("R", "P") or self.above_tokens < 1 or self.rise <= 1.0:
            raise ValueError(f"cliff {self}: side R or P, above_tokens >= 1, rise > 1")


# Measured cliffs on the current kernels (none: see the module's docstring for issue 55's).
CLIFFS: tuple[Cliff, ...] = ()
GIB = 2 ** 30
# Of the device's memory, the share the estimate may plan for (the rest: allocator slack,
# CUDA context, fragmentation, the compile's workspace).
USABLE = 0.85
MEMORY_ENV = "RLK_REF_MEMORY_GIB"


def param_count(cfg: ModelConfig) -> int:
    """Parameters of the untied model (embedding and LM head counted apart)."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    layer = (2 * h + 2 * d + (hq + 2 * hkv) * d * h + hq * d * h + 3 * h * i)
    assert len(weight_names(cfg)) == 3 + 11 * cfg.num_hidden_layers
    return 2 * cfg.vocab_size * h + h + cfg.num_hidden_layers * layer


@dataclass(frozen=True)
class Estimate:
    """Bytes the step needs: fixed (weights and state), the rollout's KV cache, per training
    token (activations and LM-head rows)."""

    fixed: int
    kv_cache: int
    per_token: int

    def training(self, tokens: int) -> int:
        return self.fixed + tokens * self.per_token

    def rollout(self) -> int:
        return self.fixed + self.kv_cache


def estimate(cfg: ModelConfig, dtype_bytes: int, n_prompts: int, max_seq: int,
             r_training: bool, tp: int = 1, cp: int = 1) -> Estimate:
    """The step's memory on one rank (tensor parallelism divides the weights and the
    activations' widths, context parallelism the tokens)."""
    params = param_count(cfg) // tp
    # weight + grad + AdamW m, v (the weights' dtype) + the rollout's copy; R: a derived fp32
    # copy of every matrix on the torch path, a fused model-dtype one on Triton (count fp32)
    fixed = params * (5 * dtype_bytes + (4 if r_training else dtype_bytes))
    hkv_d = cfg.num_key_value_heads * cfg.head_dim // tp
    kv = n_prompts * max_seq * cfg.num_hidden_layers * 2 * hkv_d * dtype_bytes
    h, i = cfg.hidden_size, cfg.intermediate_size // tp
    qkv = (cfg.num_attention_heads * cfg.head_dim) // tp + 2 * hkv_d
    attn = cfg.num_attention_heads * cfg.head_dim // tp
    layer = 4 * (6 * h + 3 * qkv + 2 * attn + 6 * i)  # fp32 copies autograd keeps per token
    vocab = cfg.vocab_size // tp
    head = 4 * vocab if r_training else 0  # R (Triton) keeps each row's fp32 logits
    per_token = -(-(cfg.num_hidden_layers * layer + 4 * h + head) // cp)
    if not r_training:  # P: ~5.5 fp32 chunks of the chunked logp (p_logp.py), at most a chunk
        from pytest_rlkernel_matrix.workload.kernels.p.p_logp import (
            CHUNK_ELEMENTS,  # of p_logp.CHUNK_ELEMENTS or every token
        )

        fixed += 6 * 4 * min(CHUNK_ELEMENTS, vocab * max_seq * n_prompts)
    return Estimate(fixed, kv, per_token)


def device_memory(device_type: str, cuda_total: int | None = None) -> int:
    """Bytes of memory the step may use: ``RLK_REF_MEMORY_GIB`` if set, else the GPU's total
    (``cuda_total``) or the machine's physical memory, times ``USABLE``."""
    raw = os.environ.get(MEMORY_ENV, "").strip()
    if raw:
        try:
            gib = float(raw)
        except ValueError:
            gib = -1.0
        if gib <= 0:
            raise UsageError(f"{MEMORY_ENV}={raw!r}: expected a positive number of GiB")
        return int(gib * GIB)
    if device_type == "cuda" and cuda_total:
        return int(cuda_total * USABLE)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * USABLE)


@dataclass(frozen=True)
class Choice:
    """The micro-batch and why: ``tokens`` (the preset's token budget), ``memory`` (lowered to
    fit), ``argument`` (``--micro-batch-size``)."""

    size: int
    chosen_by: str
    tokens: int
    training_gib: float
    rollout_gib: float
    memory_gib: float
    why: str = ""
    cliffs: tuple[dict, ...] = ()

    def manifest(self) -> dict:
        return {"size": self.size, "chosen_by": self.chosen_by, "why": self.why,
                "tokens_per_micro_batch": self.tokens,
                "estimated_training_gib": self.training_gib,
                "estimated_rollout_gib": self.rollout_gib, "memory_gib": self.memory_gib,
                "cliffs": [dict(c) for c in self.cliffs]}


def choose(preset: str, est: Estimate, n_prompts: int, max_seq: int, memory: int,
           asked: int | None, cliffs: tuple[Cliff, ...] | None = None) -> Choice:
    """The micro-batch size (see the module's docstring); ``UsageError`` when nothing fits.
    ``cliffs``: the measured cliffs to keep to (default: ``CLIFFS``)."""
    def gib(b: int) -> float:
        return round(b / GIB, 2)

    where = (f"estimated for {n_prompts} prompts x {max_seq} tokens (max prompt + max new "
             f"tokens) against {gib(memory)} GiB (set {MEMORY_ENV} to plan for another size)")
    if est.rollout() > memory:
        raise UsageError(
            f"the rollout's KV cache does not fit: {gib(est.rollout())} GiB {where}; lower "
            "--num-prompts or --max-new-tokens")
    if est.training(max_seq) > memory:
        raise UsageError(
            f"one sequence's training step does not fit: {gib(est.training(max_seq))} GiB "
            f"{where}; lower --max-new-tokens or --max-prompt-len, or use a device with more "
            "memory")
    fits = max(1, (memory - est.fixed) // (est.per_token * max_seq))
    mine = [c for c in (CLIFFS if cliffs is None else cliffs) if c.preset == preset]
    applied: set[int] = set()
    if asked is not None:
        if asked < 1:
            raise UsageError(f"--micro-batch-size must be >= 1 (got {asked})")
        need = est.training(asked * max_seq)
        if need > memory:
            raise UsageError(
                f"--micro-batch-size {asked} does not fit: {gib(need)} GiB {where}; at most "
                f"{fits} fits, or leave --micro-batch-size out to have it chosen")
        size, by = asked, "argument"
        why = f"--micro-batch-size {asked}"
    else:
        budget = MICRO_BATCH_TOKENS.get(preset, MICRO_BATCH_TOKENS["tiny"])
        size, by = max(1, budget // max_seq), "tokens"
        why = f"{budget} tokens per micro-batch for {preset} // {max_seq} tokens per sample"
        for i, c in sorted(enumerate(mine), key=lambda ic: ic[1].above_tokens):
            if size * max_seq > c.above_tokens and size > 1:
                size, by = max(1, c.above_tokens // max_seq), "cliff"
                applied.add(i)
                why += (f"; lowered to {size} to stay at or below {c.side}'s measured cliff at "
                        f"{c.above_tokens} tokens ({c.rise}x per token past it, {c.device})")
        if size > fits:
            size, by = fits, "memory"
            why += f"; lowered to {fits}, the most the memory estimate fits"
        if size > n_prompts:
            size = n_prompts
            why += f"; capped at the {n_prompts} prompts"
    tokens = size * max_seq
    record = tuple({"side": c.side, "above_tokens": c.above_tokens, "rise": c.rise,
                    "device": c.device, "source": c.source, "applied": i in applied,
                    "past_it": tokens > c.above_tokens} for i, c in enumerate(mine))
    return Choice(size, by, tokens, gib(est.training(tokens)), gib(est.rollout()), gib(memory),
                  why, record)
