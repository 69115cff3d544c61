"""Cross-checks between RL-Kernel's artifacts that its own run validator makes
(docs/en/conformance.md): route lines against the case, `installed_hooks` against the readback
records, and the native logp marker. (The `step N` records' runtime token exposure against the
sidecars is the semantic layer's: judge/semantic/exposure.py.)

- Hooks: every (side, module) a readback records must appear in that side's `installed_hooks`
  (merged over the side's processes, as RL-Kernel sums them), production modules included;
  native Megatron logp (training logp P) must have none, and no readback record either (it runs
  outside RL-Kernel's provider). Every other P module needs a record: without one nothing shows
  it ran. RL-Kernel's messages: `{label} {module} hook was not installed`, `{label} {module} had
  zero calls`, `{label} production logp unexpectedly installed an RL-Kernel hook`, `{label}
  production logp unexpectedly entered provider readback`.
- Route lines: `requested=` must be the case's, `actual=` an RL-Kernel backend id as RL-Kernel
  writes it (or the run's own under its declared runtime policy) where R was requested.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pytest_rlkernel_matrix.judge.read.upstream import (
    NATIVE_LOGP_CONTRACT,
    NATIVE_LOGP_MARKER,
    SIDECAR_LOGP_MARKER,
    side_of,
)

SIDES = ("training", "rollout")


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


def is_rlkernel_backend(backend: str) -> bool:
    """An RL-Kernel backend id as RL-Kernel writes it (`rlkernel.`, exactly: no padding, lower
    case; upstream's validator compares the prefix as written), not unidentified, not a
    production id."""
    return (isinstance(backend, str) and backend.startswith("rlkernel.")
            and not backend.endswith(".unidentified") and ".production" not in backend)


def log_route_findings(modules: Iterable[str], letter_of: Any, routes: Iterable[
        Mapping[str, str]], own: Mapping[str, Any] | None = None,
        ) -> tuple[list[str], list[str]]:
    """(fallbacks, mismatches) from run.log route lines: `letter_of(module, side)` is P or R;
    `own`: the run's declared runtime policy (its own R backends, `judge/route/rules.py`)."""
    prefix = str(own["backend_prefix"]) if own else None  # (normalised by declared_policy)
    fallbacks: list[str] = []
    mismatches: list[str] = []
    wanted = set(modules)
    for route in routes:
        module = route.get("module")
        side = side_of(route.get("framework"), route.get("target"))
        if module not in wanted or side is None:
            continue
        letter = letter_of(module, side)
        where = f"{module} {side}"
        requested, actual = route.get("requested"), route.get("actual")
        impl = route.get("implementation")
        if requested is None and actual is None:  # legacy form
            if letter == "R" and impl is not None and impl != "rl_kernel":
                fallbacks.append(f"{where}: run.log route line says implementation={impl} "
                                 "although R was requested (fallback)")
            continue
        want = "rl_kernel" if letter == "R" else "production"
        if requested is not None and requested != want:
            mismatches.append(f"{where}: run.log route line says requested={requested} but the "
                              f"case requests {want} ({letter})")
        if actual is None:
            continue
        act = actual.strip().casefold()
        mine = prefix is not None and act.startswith(prefix)
        if letter == "R" and not (is_rlkernel_backend(actual) or mine):
            fallbacks.append(f"{where}: run.log route line says actual={actual[:120]} although "
                             "R was requested: not an RL-Kernel backend (fallback)")
        elif letter == "P" and (act.startswith("rlkernel.") or mine):
            mismatches.append(f"{where}: run.log route line says actual={actual[:120]}, an "
                              "R backend, although P was requested")
    return fallbacks, mismatches


def native_logp_evidence(markers: Iterable[str], logp_case: str) -> str | None:
    """The run.log marker proving native Megatron logp ran for this case, or None."""
    for line in markers:
        if NATIVE_LOGP_MARKER in line and f"contract_id={NATIVE_LOGP_CONTRACT}" in line:
            return line[line.index(NATIVE_LOGP_MARKER):][:300]
        if SIDECAR_LOGP_MARKER in line:
            case = line.split(SIDECAR_LOGP_MARKER, 1)[1].split()[:1]
            if case and case[0].strip().upper() == logp_case:
                return line[line.index(SIDECAR_LOGP_MARKER):][:300]
    return None
