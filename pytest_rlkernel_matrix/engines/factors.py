"""Framework factors of the engines job, set through vLLM's own engine settings.

The same env variables as the built-in workload (``workload/factors.py``, docs/en/factors.md),
so one ``[factors]`` table serves both jobs:

- ``RLK_REF_ROLLOUT_BATCH`` = ``all`` (default) | N: vLLM's ``max_num_seqs`` (how many
  sequences the scheduler runs in one forward): all prompts, or N. Every request has its own
  sampling seed, so a token depends on its own logprobs only, not on its batch.
- ``RLK_REF_SAMPLING`` = ``raw`` (default) | ``processed``: vLLM's ``logprobs_mode``. ``raw``
  reports ``raw_logprobs`` (``raw_logits`` when logp is R: the R kernel's ``compute_logits``
  returns fp32 log-probabilities already, reported as they are); ``processed`` reports
  ``processed_logprobs`` (log-softmax after temperature and top-p, renormalized over the kept
  tokens) on either logp route.
- ``RLK_REF_WEIGHT_SYNC``: the engines job loads one checkpoint into both engines and updates no
  weights, so only ``exact`` acts; ``bf16`` (the engines run bfloat16 already) and ``stale``
  (one version) are recorded with ``applied=false`` and a note, never silently ignored.

Nothing here imports vLLM: :func:`engine_settings` builds the keyword arguments the job passes
to ``vllm.LLM`` and is unit-tested without an engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pytest_rlkernel_matrix.workload.env import (
    FACTOR_SAMPLING,
    FACTOR_WEIGHT_SYNC,
    factor_env,
)

SAMPLING, WEIGHT_SYNC = FACTOR_SAMPLING, FACTOR_WEIGHT_SYNC


@dataclass
class EngineFactors:
    """The factor settings of one engines cell, and what each did (``manifest.json``)."""

    rollout_batch: int | None = None  # None: all prompts in one batch
    sampling: str = "raw"
    weight_sync: str = "exact"
    effect: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineFactors:
        e = os.environ if environ is None else environ
        raw_batch, batch, sampling, sync = factor_env(e, "vLLM")
        out = cls(batch, sampling, sync)
        note = {"exact": "both engines load the same checkpoint",
                "bf16": "the engines load the checkpoint in bfloat16 already: the round trip "
                        "changes nothing, the factor could not act",
                "stale": "the engines job updates no weights (one version): there is no older "
                         "version to sync, the factor could not act"}[sync]
        out.effect = {"rollout_batch": {"value": raw_batch, "applied": None},
                      "sampling": {"value": sampling, "applied": sampling != "raw"},
                      "weight_sync": {"value": sync, "applied": False, "note": note}}
        return out

    def engine_settings(self, num_prompts: int, logp_is_r: bool) -> dict[str, Any]:
        """vLLM ``LLM(...)`` keyword arguments for the factors: ``max_num_seqs`` and
        ``logprobs_mode``; also records what each factor does in :attr:`effect`."""
        n = max(num_prompts, 1)
        seqs = n if self.rollout_batch is None else min(self.rollout_batch, n)
        self.effect["rollout_batch"].update(
            applied=seqs < n, note=f"vLLM max_num_seqs={seqs}: at most {seqs} of {n} "
            "sequences in one forward")
        if self.sampling == "processed":
            mode = "processed_logprobs"
            why = "after temperature + top-p, renormalized over the kept tokens"
        else:
            mode = "raw_logits" if logp_is_r else "raw_logprobs"
            why = ("the R logp kernel's log-probabilities as compute_logits returns them"
                   if logp_is_r else "log-softmax of the unprocessed logits")
        self.effect["sampling"]["note"] = f"vLLM logprobs_mode={mode}: {why}"
        return {"max_num_seqs": seqs, "logprobs_mode": mode}

    def lines(self) -> list[str]:
        return [f"[rlk-reference][factor] name={name} value={e['value']} "
                f"applied={str(e['applied']).lower()}" + (f" note={e['note']}" if e.get("note")
                                                          else "")
                for name, e in self.effect.items()]
