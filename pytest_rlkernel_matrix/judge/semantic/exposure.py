"""The runtime token exposure of a run's `step N` records against its mismatch sidecars, and the
sidecars' sample count against the manifest (RL-Kernel's run validator: `sidecar tokens {n} !=
runtime exposure {x}`, `sidecar samples {n} != expected {m}`); docs/en/conformance.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

NUMEL_KEY = "train/train_current_rollout_logprob_numel"
_NO_CHECK = "sidecar tokens not cross-checked against the runtime exposure"


@dataclass
class Exposure:
    """The runtime token exposure of a run's `step N` records, against its sidecars."""

    checked: bool = False
    global_batch_size: int | None = None
    steps: list[int] = field(default_factory=list)
    per_sample_numel: dict[int, float] = field(default_factory=dict)
    exposure: int | None = None
    sidecar_tokens: int | None = None
    sidecar_samples: int | None = None
    expected_samples: int | None = None  # num_rollout x global_batch_size (manifest.json)
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["per_sample_numel"] = {str(k): v for k, v in self.per_sample_numel.items()}
        return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _batch_size(manifest: Mapping[str, Any] | None, ex: Exposure) -> int | None:
    batching = (manifest or {}).get("batching")
    value = batching.get("global_batch_size") if isinstance(batching, Mapping) else None
    if value is None:
        ex.notes.append("manifest.json has no batching.global_batch_size: the step records' "
                        f"per-sample means cannot be turned into token totals; {_NO_CHECK}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        ex.reasons.append(f"manifest.json batching.global_batch_size is {value!r}, not a "
                          f"positive integer: {_NO_CHECK}")
        return None
    return value


def _sample_count(ex: Exposure, manifest: Mapping[str, Any] | None) -> None:
    """RL-Kernel's `sidecar samples {n} != expected {m}`: the merged sidecars hold one sample per
    rollout step and global-batch sample (`num_rollout` x `batching.global_batch_size`)."""
    rounds = (manifest or {}).get("num_rollout")
    batching = (manifest or {}).get("batching")
    gbs = batching.get("global_batch_size") if isinstance(batching, Mapping) else None
    if ex.sidecar_samples is None or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (rounds, gbs)):
        return
    ex.expected_samples = rounds * gbs
    if ex.sidecar_samples != ex.expected_samples:
        ex.reasons.append(
            f"sidecar samples {ex.sidecar_samples} != expected {ex.expected_samples}: the "
            f"mismatch sidecars hold {ex.sidecar_samples} samples, manifest.json says "
            f"num_rollout {rounds} x batching.global_batch_size {gbs}")


def runtime_exposure(step_records: Iterable[tuple[int, Mapping[str, Any]]],
                     manifest: Mapping[str, Any] | None, sidecar_tokens: int | None,
                     source: str | None, sidecar_samples: int | None = None) -> Exposure:
    """Judge the step records' exposure against `sidecar_tokens` (the merged sidecars' active
    tokens) and the sidecars' sample count against the manifest. Reasons fail the semantic
    judgement; notes are only recorded (no step record with a token count, no
    global_batch_size, no sidecars: nothing to cross-check)."""
    ex = _exposure(step_records, manifest, sidecar_tokens, source)
    if source == "mismatch-sidecars":
        ex.sidecar_samples = sidecar_samples
        _sample_count(ex, manifest)
    return ex


def _exposure(step_records: Iterable[tuple[int, Mapping[str, Any]]],
              manifest: Mapping[str, Any] | None, sidecar_tokens: int | None,
              source: str | None) -> Exposure:
    ex = Exposure(sidecar_tokens=sidecar_tokens if source == "mismatch-sidecars" else None)
    records: dict[int, Mapping[str, Any]] = {}
    for step, rec in step_records:
        records[step] = rec  # the last record of a step wins (RL-Kernel's parser)
    carrying = {s: r for s, r in records.items() if NUMEL_KEY in r}
    if not carrying:
        ex.notes.append(f"no `step N` record carries {NUMEL_KEY}: {_NO_CHECK}")
        return ex
    ex.steps = sorted(records)
    for step in ex.steps:
        value = _number(records[step].get(NUMEL_KEY))
        if value is None:
            ex.reasons.append(f"step {step}: {NUMEL_KEY} is missing or not a finite number "
                              f"({records[step].get(NUMEL_KEY)!r}): {_NO_CHECK}")
        elif value <= 0:
            ex.reasons.append(f"step {step} has no active tokens ({NUMEL_KEY} = {value!r})")
        else:
            ex.per_sample_numel[step] = value
    rounds = (manifest or {}).get("num_rollout")
    if isinstance(rounds, int) and not isinstance(rounds, bool) and ex.steps != list(
            range(rounds)):
        ex.reasons.append(f"step records cover steps {ex.steps[:16]}, but manifest.json "
                          f"num_rollout = {rounds} expects 0..{rounds - 1}")
    gbs = ex.global_batch_size = _batch_size(manifest, ex)
    if ex.sidecar_tokens is None:
        ex.notes.append(f"no mismatch sidecars (logprobs from {source}): {_NO_CHECK}")
    if gbs is None or ex.reasons or ex.sidecar_tokens is None:
        return ex
    total = 0
    for step, mean in ex.per_sample_numel.items():
        tokens = mean * gbs
        if abs(tokens - round(tokens)) > 1e-6 * max(1.0, tokens):
            ex.reasons.append(f"step {step}: {NUMEL_KEY} {mean!r} x global_batch_size {gbs} = "
                              f"{tokens!r} is not a whole number of tokens")
        total += round(tokens)
    if ex.reasons:
        return ex
    ex.checked, ex.exposure = True, total
    if total != ex.sidecar_tokens:
        ex.reasons.append(
            f"sidecar tokens {ex.sidecar_tokens} != runtime exposure {total}: the mismatch "
            f"sidecars hold {ex.sidecar_tokens} active tokens, the step records' per-sample "
            f"{NUMEL_KEY} x global_batch_size {gbs} over steps {ex.steps[:16]} sum to {total}")
    return ex
