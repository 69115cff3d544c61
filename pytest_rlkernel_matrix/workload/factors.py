"""Framework factors of the reference workload, switched by env (see docs/en/factors.md).

- ``RLK_REF_ROLLOUT_BATCH`` = ``all`` (default) | N: how many sequences the rollout decodes
  together (prompts go in chunks of N, in sample order; the training micro-batch is unchanged).
  Sampling noise is drawn per (sample, position) before the rollout, so the same prompt draws
  the same token whatever batch it decodes in: only the kernels can make a difference.
- ``RLK_REF_SAMPLING`` = ``raw`` (default) | ``processed``: the logprob the rollout reports for a
  sampled token, the raw temperature-scaled log-softmax (what training recomputes) or the one
  after top-p processing, renormalized over the kept tokens (vLLM's
  ``logprobs_mode=processed_logprobs``). Sampling itself is the same.
- ``RLK_REF_WEIGHT_SYNC`` = ``exact`` (default) | ``bf16`` | ``stale``: how weights reach the
  rollout: a copy, a bfloat16 round trip (no change when the model dtype is bfloat16 already:
  the manifest says so), or the previous weight version (once steps update weights; while
  there is a single version there is nothing older, and the manifest says the factor could not
  act).

- ``RLK_REF_BATCH_INVARIANCE`` = ``none`` (default) | one of vime's five batch-invariance replay
  cases (``replay_cases.py``): the rollout decodes the same samples in that batch layout
  (alone, reordered, padded, denser, with dropped twins); the kept samples draw their own noise.

What each factor did is written to ``manifest.json`` under ``factors`` and printed as one
``[rlk-reference][factor]`` line per factor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pytest_rlkernel_matrix.workload.env import (
    FACTOR_SAMPLING,
    FACTOR_WEIGHT_SYNC,
    UsageError,
    factor_env,
)
from pytest_rlkernel_matrix.workload.rollout import replay_cases
from pytest_rlkernel_matrix.workload.rollout.sampling import FIXED_POINT, _fixed

SAMPLING, WEIGHT_SYNC = FACTOR_SAMPLING, FACTOR_WEIGHT_SYNC


@dataclass
class Factors:
    """The factor settings of this process, and what each one did."""

    rollout_batch: int | None = None  # None = all sequences together
    sampling: str = "raw"
    weight_sync: str = "exact"
    batch_invariance: str = "none"  # replay_cases.CASES (vime's consistency audit)
    effect: dict[str, dict[str, Any]] = field(default_factory=dict)
    _previous: dict[str, Tensor] | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls) -> Factors:
        e = os.environ
        raw_batch, batch, sampling, sync = factor_env(e)
        case = e.get("RLK_REF_BATCH_INVARIANCE", "none").strip().lower() or "none"
        if case != "none" and case not in replay_cases.CASES:
            raise UsageError(f"RLK_REF_BATCH_INVARIANCE={case!r}: expected 'none' or one of "
                             f"{replay_cases.CASES}")
        out = cls(batch, sampling, sync, case)
        out.effect = {
            "rollout_batch": {"value": raw_batch, "applied": None},
            "sampling": {"value": sampling, "applied": sampling != "raw",
                         "note": "reported logprobs after temperature + top-p renormalization"
                         if sampling == "processed" else "raw temperature-scaled log-softmax"},
            "weight_sync": {"value": sync, "applied": None},
        }
        if case != "none":
            out.effect["batch_invariance"] = {"value": case, "applied": None}
        return out

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return self.effect

    def lines(self) -> list[str]:
        return [f"[rlk-reference][factor] name={name} value={e['value']} "
                f"applied={str(e['applied']).lower()}" + (f" note={e['note']}" if e.get("note")
                                                          else "")
                for name, e in self.effect.items()]

    # -- weight sync ----------------------------------------------------------------------------
    def sync_weights(self, train_w: dict[str, Tensor]) -> dict[str, Tensor]:
        """The rollout engine's own copy of this step's weights (called once per step, before
        the optimizer updates them), as this factor delivers it."""
        effect = self.effect["weight_sync"]
        if self.weight_sync == "bf16":
            changed = any(t.dtype != torch.bfloat16 for t in train_w.values())
            effect.update(applied=changed, note="bf16 round trip of every weight" if changed else
                          "weights are bfloat16 already: the round trip changes nothing")
            return {n: t.to(torch.bfloat16).to(t.dtype) for n, t in train_w.items()}
        if self.weight_sync == "stale":
            # the version this step's rollout would hold without the factor is the next step's
            # stale one: kept before the optimizer changes `train_w` in place
            previous, self._previous = self._previous, {n: t.clone() for n, t in train_w.items()}
            older = previous is not None and any(
                not torch.equal(previous[n], t) for n, t in train_w.items())
            if older and previous is not None:
                effect.update(applied=True, note="from the second weight version on, the "
                              "rollout holds the previous one")
                return previous
            if not effect.get("applied"):
                effect.update(applied=False, note="one weight version so far: there is no "
                              "older version to sync, the factor could not act")
            return {n: t.clone() for n, t in train_w.items()}
        effect.update(applied=False if self.weight_sync == "exact" else effect["applied"])
        return {n: t.clone() for n, t in train_w.items()}

    # -- vime's batch-invariance replay cases ---------------------------------------------------
    def _replay_case(self, run: Callable[..., Any], model: Any, k: Any, prompts: list[Tensor],
                     max_new: list[int], temperature: float, top_p: float, gen: torch.Generator,
                     graphs: bool, ignore_eos: bool, noise: Tensor, processed: bool) -> Any:
        """The rollout in the layout of ``batch_invariance``, the fixed samples' results kept
        in their own order (the neighbours' dropped)."""
        effect = self.effect["batch_invariance"]
        tap = getattr(k, "tap", None)
        if tap is not None and getattr(tap, "recording", False):
            raise UsageError("RLK_REF_BATCH_INVARIANCE: not with a probe run (the probe names "
                             "rows by sample; the neighbours would shift them)")
        p = replay_cases.plan(self.batch_invariance, prompts, max_new, noise,
                              getattr(model, "max_seq_len", None))
        effect.update(applied=True, note=p.note)
        parts = [run(model, k, p.prompts[s:s + p.size], p.max_new[s:s + p.size], temperature,
                     top_p, gen, graphs, ignore_eos, noise=p.noise[s:s + p.size],
                     processed=processed)
                 for s in range(0, len(p.prompts), p.size)]
        ro = _join(parts)
        ro.tokens = [ro.tokens[j] for j in p.keep]
        ro.prompt_lengths = [ro.prompt_lengths[j] for j in p.keep]
        ro.logprobs = [ro.logprobs[j] for j in p.keep]
        return ro

    # -- rollout batch --------------------------------------------------------------------------
    def rollout(self, run: Callable[..., Any], model: Any, k: Any, prompts: list[Tensor],
                max_new: list[int], temperature: float, top_p: float, gen: torch.Generator,
                graphs: bool, ignore_eos: bool) -> Any:
        """``run`` (``job.run_rollout``) over chunks of ``rollout_batch`` prompts, joined."""
        noise = torch.rand((len(prompts), max(max_new)), generator=gen, device=gen.device)
        processed = self.sampling == "processed"
        if self.batch_invariance != "none":
            return self._replay_case(run, model, k, prompts, max_new, temperature, top_p, gen,
                                     graphs, ignore_eos, noise, processed)
        n = len(prompts)
        size = n if self.rollout_batch is None else min(self.rollout_batch, n)
        self.effect["rollout_batch"].update(applied=size < n, note=f"{size} of {n} sequences "
                                            "decode together")
        parts = [run(model, k, prompts[s:s + size], max_new[s:s + size], temperature, top_p,
                     gen, graphs, ignore_eos, noise=noise[s:s + size], processed=processed)
                 for s in range(0, n, size)]
        return _join(parts)


def _join(parts: list[Any]) -> Any:
    first = parts[0]
    for p in parts[1:]:
        first.tokens += p.tokens
        first.prompt_lengths += p.prompt_lengths
        first.logprobs += p.logprobs
        if p.execution_mode == "eager":
            first.execution_mode, first.fallback_reason = "eager", p.fallback_reason
    return first


def processed_selected(logprobs: Tensor, tokens: Tensor, top_p: float) -> Tensor:
    """Logprob of ``tokens`` after top-p: renormalized over the nucleus the sampler keeps.

    The nucleus is ``sampling.py``'s: a token is in it iff the mass of the strictly more
    probable tokens is below ``top_p`` (ties kept together), every mass an exact int64 sum of
    the probabilities in fixed point. So the normalizer ``Z`` does not depend on the batch (a
    float ``cumsum``/``logsumexp`` over the vocabulary does on CUDA) and its nucleus is the one
    the sampled token was accepted from. ``log Z`` and the difference are taken in float64."""
    q = _fixed(logprobs.exp())
    if top_p >= 1.0:
        z = q.sum(-1)
    else:
        qs = q.sort(dim=-1, descending=True).values
        above = qs.cumsum(-1) - qs  # exact; at a tie's first index, the mass strictly above
        last = (above < int(top_p * FIXED_POINT)).sum(-1, keepdim=True) - 1
        edge = qs.gather(-1, last.clamp(min=0))  # the nucleus: every token with q >= edge
        z = torch.where(q >= edge, q, 0).sum(-1)
    log_z = (z.double() / FIXED_POINT).log()
    return (logprobs.gather(-1, tokens[:, None])[:, 0].double() - log_z).float()
