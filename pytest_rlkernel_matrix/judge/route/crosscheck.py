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

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pytest_rlkernel_matrix.judge.read.upstream import log_route_findings, side_of

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
