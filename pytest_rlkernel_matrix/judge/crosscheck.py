"""Cross-checks between RL-Kernel's artifacts that its own run validator makes
(docs/en/conformance.md): route lines against the case, `installed_hooks` against the readback
records, and the `step N` records' runtime token exposure against the mismatch sidecars.

- Hooks: every (side, module) a readback records must appear in that side's `installed_hooks`
  (merged over the side's processes, as RL-Kernel sums them), production modules included;
  native Megatron logp (training logp P) must have none, and no readback record either (it runs
  outside RL-Kernel's provider). Every other P module needs a record: without one nothing shows
  it ran. RL-Kernel's messages: `{label} {module} hook was not installed`, `{label} {module} had
  zero calls`, `{label} production logp unexpectedly installed an RL-Kernel hook`, `{label}
  production logp unexpectedly entered provider readback`.
- Samples: the merged sidecars hold `num_rollout` x `batching.global_batch_size` samples
  (RL-Kernel: `sidecar samples {n} != expected {m}`).
- Exposure: vime's `step N` records carry per-sample means over the step's global batch;
  `train/train_current_rollout_logprob_numel` x `batching.global_batch_size` (manifest.json),
  summed over the steps, is the number of active tokens the run compared, and must equal the
  sidecars' active-token count (RL-Kernel: `sidecar tokens {n} != runtime exposure {x}`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pytest_rlkernel_matrix.judge.upstream import log_route_findings, side_of

SIDES = ("training", "rollout")
NUMEL_KEY = "train/train_current_rollout_logprob_numel"
_NO_CHECK = "sidecar tokens not cross-checked against the runtime exposure"


def log_route_fallbacks(modules: Iterable[str], letter_of: Callable[[str, str], str], mode: str,
                        fallback_lines: Iterable[str], routes: Iterable[Mapping[str, str]],
                        have_readbacks: bool, have: list[str],
                        own: Mapping[str, Any] | None = None) -> tuple[list[str], list[str]]:
    """(fallbacks, mismatches) from run.log: `fallback=true` lines and route lines that
    contradict the request (RL-Kernel's `requested=`/`actual=` form and the older
    `implementation=` form). `have` holds the fallbacks the readbacks already record."""
    out: list[str] = []
    for line in fallback_lines:
        if have_readbacks and "[RL-Kernel]" not in line:
            continue  # with readbacks, only RL-Kernel's own lines speak for the route
        kv = dict(part.split("=", 1) for part in line.split() if "=" in part)
        side = side_of(kv.get("framework"), kv.get("target"))
        module = kv.get("module")
        if module and side and any(f.startswith(f"{module} {side}") for f in have + out):
            continue  # the readback already records this fallback
        out.append(f"run.log: {line}")
    if mode == "off":
        return out, []
    found, mismatches = log_route_findings(modules, letter_of, routes, own)
    for reason in found:
        where = " ".join(reason.split()[:2])
        if not any(f.startswith(where) for f in have + out):
            out.append(reason)
    return out, mismatches


def hook_findings(modules: Iterable[str], letter_of: Callable[[str, str], str], mode: str,
                  recorded: Mapping[str, Mapping[str, Any]],
                  hooks: Mapping[str, Mapping[str, str]]) -> tuple[list[str], list[str]]:
    """(unproven, contradictions). `recorded[side]` maps a module to its merged readback route
    (anything with `.sources` and `.implementation`), `hooks[side]` a module to its hook id."""
    unproven: list[str] = []
    contradictions: list[str] = []
    if mode == "off":
        return unproven, contradictions
    for module in modules:
        for side in SIDES:
            letter = letter_of(module, side)
            hook = hooks.get(side, {}).get(module)
            got = recorded.get(side, {}).get(module)
            files = ", ".join(getattr(got, "sources", [])[:2]) or "its readback"
            if side == "training" and module == "logp" and letter == "P":
                if hook is not None:
                    contradictions.append(
                        f"logp training: native (production) Megatron logp installed an RL-Kernel "
                        f"hook ({hook[:120]}): production logp unexpectedly installed an "
                        "RL-Kernel hook")
                if got is not None:
                    contradictions.append(
                        f"logp training: native (production) Megatron logp has a readback record "
                        f"({files}), but it runs outside RL-Kernel's provider: production logp "
                        "unexpectedly entered provider readback")
                continue
            if got is None:
                if letter == "P":  # R without a record: verdict's "R route unproven"
                    unproven.append(
                        f"{module} {side}: P requested but no readback records the module "
                        f"(RL-Kernel: {module} had zero calls): P route unproven")
                continue
            if hook is not None:
                continue
            unproven.append(
                f"{module} {side}: {module} hook was not installed (the readback records the "
                f"module as {getattr(got, 'implementation', None)}, but installed_hooks of "
                f"{files} has no entry for it): {letter} route unproven")
    return unproven, contradictions


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
