"""The learning half of the reference RL step: rewards, GRPO advantages, the policy-gradient
loss, the deterministic optimizer, the weight-version audit and the fault drills over steps.

Rewards come from a deterministic rule on the sampled tokens (the fraction of response tokens
with an even id). Advantages are GRPO's: each group of ``GROUP`` consecutive samples is
normalised by its own mean and standard deviation (float64 on the host). The loss is the
on-policy clipped-ratio surrogate with the ratio ``exp(logp - logp.detach())`` (1 in value, the
policy gradient in derivative), summed over active tokens and divided by the step's active-token
count, so micro-batches accumulate gradients exactly as one batch would (Megatron's way).

Backward: torch autograd through the training side's own forward. On the CPU R path every op
has a fixed shape (fixed row tiles, fixed attention chunks, fp32), the CPU autograd engine runs
the graph on one thread in a fixed order, so every gradient (including a weight's sum over row
tiles and micro-batches) is reduced in the same order on every run: the backward is
deterministic. Where the forward runs the Triton R kernels, the loss runs on that Triton forward
itself and each kernel's backward is a deterministic Triton kernel (``triton_backward.py``, wired
in ``autograd.py``); ``RLK_REF_R_BACKWARD=recompute`` recomputes each op with native torch ops
instead, ``RLK_REF_R_BACKWARD=tiled`` runs the loss forward and backward on the torch R path
(the manifest's ``learning.backward_method`` / ``backward_kernels`` say which).
On CUDA the backward and the optimizer step run under ``torch.use_deterministic_algorithms`` (with
``CUBLAS_WORKSPACE_CONFIG=:4096:8``): without it one H200 run of 20 steps kept train/rollout
and weights bitwise within the run but two runs differed from step 1 on (docs/examples).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pytest_rlkernel_matrix.workload.env import run_nonce

if TYPE_CHECKING:
    from pytest_rlkernel_matrix.workload.env import FaultDrill
    from pytest_rlkernel_matrix.workload.kernels.side import SideKernels

def prepare_deterministic(device: torch.device) -> None:
    """Before the first cuBLAS call: the workspace setting deterministic cuBLAS needs."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """The learning step's kernels: deterministic algorithms on CUDA (CPU: already so)."""
    if device.type != "cuda":
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@dataclass
class Learn:
    """What the training forward needs to also run the backward: per-sample advantages, the
    step's active-token count and the kernels the loss forward runs with (the training side's
    own; the torch R path where the forward runs Triton and ``RLK_REF_R_BACKWARD=tiled``)."""

    advantages: list[float]
    n_active: int
    grad_kernels: SideKernels | None = None
    loss: float = 0.0


GROUP = 4
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
DRIFT_STEP = 2.0 ** -6  # drift_growth drill: relative output perturbation per step index
MODULE_PARAMS = {"attention": ("self_attn.", "input_layernorm."),
                 "ffn": ("mlp.", "post_attention_layernorm."),
                 "logp": ("lm_head.", "model.norm."), "comm": ()}


def rewards(tokens: Iterable[Tensor], prompt_lengths: Iterable[int]) -> list[float]:
    """Fraction of response tokens with an even id, per sample (deterministic, host)."""
    out = []
    for t, p in zip(tokens, prompt_lengths, strict=True):
        resp = t[p:].cpu()
        out.append(float((resp % 2 == 0).sum()) / max(1, resp.numel()))
    return out


def grpo_advantages(rew: list[float], group: int = GROUP) -> list[float]:
    """(r - mean) / (std + 1e-6) within consecutive groups of ``group`` samples (float64)."""
    out: list[float] = []
    for s in range(0, len(rew), group):
        g = torch.tensor(rew[s:s + group], dtype=torch.float64)
        std = float(g.std(unbiased=False)) if g.numel() > 1 else 0.0
        out.extend(((g - g.mean()) / (std + 1e-6)).tolist())
    return out


def pg_loss(lp: Tensor, mask: Tensor, adv: Tensor, n_active: int) -> Tensor:
    """GRPO surrogate ``-sum(adv * ratio * mask) / n_active`` for ``lp``/``mask [B, T]``,
    ``adv [B]``; ratio = exp(lp - lp.detach()) (on-policy: 1, gradient = the policy gradient)."""
    ratio = torch.exp(lp - lp.detach())
    return -(adv[:, None] * ratio * mask).sum() / max(1, n_active)


class AdamW:
    """AdamW (weight decay 0), one parameter after the other, a fixed order of element-wise
    ops: the same bits on every run. The update is torch's ``AdamW(foreach=False)``'s:
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``.

    Written out rather than ``torch.optim.AdamW``: torch's optimizers import ``torch._dynamo``
    on their first parameter group, 2.1 s of CPU in every cell's process on a 2-core box (as
    much as ``import torch``), for a loop this short."""

    def __init__(self, params: list[Tensor], lr: float) -> None:
        self.params, self.lr, self.t = params, lr, 0
        self.m = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
        self.v = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = ADAM_BETAS
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            if p.grad is None:
                continue
            g = p.grad
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / c2 ** 0.5).add_(ADAM_EPS)
            p.addcdiv_(m, denom, value=-self.lr / c1)


def make_optimizer(params: list[Tensor], lr: float) -> AdamW:
    """The learning step's optimizer (see `AdamW`)."""
    return AdamW(params, lr)


def audit(weights: dict[str, Tensor], version: str, scope: str) -> dict:
    """Upstream's per-version weight audit: each tensor's sha256 over its uint8 view, and the
    sha256 of ``json.dumps(tensors, sort_keys=True)``."""
    tensors = {}
    for name in sorted(weights):
        t = weights[name].detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        tensors[name] = {"sha256": hashlib.sha256(raw).hexdigest(), "shape": list(t.shape),
                         "dtype": str(t.dtype)}
    return {"version": version, "scope": scope,
            "sha256": hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest(),
            "tensor_count": len(tensors), "tensors": tensors}


def write_audit(directory: Path, weights: dict[str, Tensor], version: str, side: str,
                write: Callable[[Path, object], None]) -> None:
    """``<dir>/<version>.json`` (training) or ``<dir>/rollout/<version>.json`` (rollout)."""
    if side == "training":
        write(directory / f"{version}.json", audit(weights, version, "all_exported_parameters"))
    else:
        write(directory / "rollout" / f"{version}.json",
              audit(weights, version, "rollout_loaded_parameters"))


def drill_nonce(drill: FaultDrill | None, recorded: dict | None) -> int:
    """The run's nonce when the nondeterministic drill is on and applies to this cell (the
    manifest's ``fault_drill.applied``: the module's side runs the R path), else 0."""
    if drill is None or drill.kind != "nondeterministic" or not (recorded or {}).get("applied"):
        return 0
    return run_nonce()


def sampling_seed(seed: int, step: int, drill: FaultDrill | None, nonce: int) -> int:
    """The rollout sampler's seed of one step: ``seed + 2 + step``; under the nondeterministic
    drill on the rollout side, the run's nonce is mixed in, as a rollout engine whose sampling
    is not pinned run to run would. Train and rollout still see the same tokens within a run
    (training re-scores what the rollout sampled), so only the run-to-run claim breaks."""
    if nonce and drill is not None and drill.side == "rollout":
        return (seed + 2 + step) ^ (nonce << 20)
    return seed + 2 + step


def perturb_gradients(weights: dict[str, Tensor], drill: FaultDrill | None, nonce: int) -> int:
    """nondeterministic drill (training side): add run-dependent noise to the gradients of the
    module's parameters, as a backward with run-to-run varying atomics would. Returns the number
    of tensors touched (0 without the drill, or on the rollout side)."""
    if not nonce or drill is None or drill.side != "training":
        return 0
    gen = torch.Generator(device="cpu").manual_seed(nonce)
    touched = 0
    for name in sorted(weights):
        g = weights[name].grad
        if g is None or not any(k in name for k in MODULE_PARAMS.get(drill.module, ())):
            continue
        noise = torch.randn(g.shape, generator=gen, dtype=torch.float32).to(g.device)
        g.add_((noise * g.float().std().clamp_min(1e-12) * 0.5).to(g.dtype))
        touched += 1
    return touched
