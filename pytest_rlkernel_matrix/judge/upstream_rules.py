"""RL-Kernel's own record rules, platform by platform, applied to every readback record that
carries an RL-Kernel backend id; and the runtime policy a run declares for backends of its own.

Upstream's validators (RL-Align/RL-Kernel, read, never copied: `integrations/common/runtime.py`
`_contains_triton` / `_contains_fallback`, `experiments/dense/validate_artifacts.py` @39432c1,
`experiments/rocm_attention/validate_artifacts.py` @0665bf6 and `validate_module_artifacts.py`,
`experiments/rocm_ablation/run.py` `_contains_truthy_fallback`) say:

- every platform: a truthy `fallback`, `fallback_used`, `used_fallback` or `split_kv_fallback`
  key anywhere in a record is a fallback (ROCm adds `attention_fallback`);
- CUDA (`runtime_policy: {platform: cuda, triton_allowed: false}`): a record that uses Triton (a
  true `triton_used` / `uses_triton`, or "triton" in any string of it) fails, so does one that
  does not report CUDA execution (its first `runtime_platform`), and a logp record whose backend
  is not the strict `rlkernel.linear_logp.bitwise.v1`;
- ROCm: the record proves ROCm execution (`runtime_platform` / `platform` rocm or hip), no
  truthy `reference_only`, Triton only in the approved deterministic backends, and FFN / logp
  records on the strict backends (`rlkernel.ffn.qwen3.deterministic.v1`,
  `rlkernel.linear_logp.bitwise.v1`);
- CPU: upstream has no validator; only the fallback rule applies.

A workload whose R kernels are its own (this project's reference workload) must not present
them under RL-Kernel's ids. It declares a runtime policy in each readback (`runtime_policy`:
`backend_prefix`, `platform`, `triton_allowed`) and its records are judged by that declaration:
an R record with an id under the declared prefix is the run's own R, on the declared platform,
with Triton only where the policy allows it. A prefix that is RL-Kernel's (`rlkernel.`), names a
production backend or differs between readbacks is refused (a reason), never trusted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

FALLBACK_KEYS = frozenset({"fallback", "fallback_used", "used_fallback", "split_kv_fallback"})
ROCM_FALLBACK_KEYS = FALLBACK_KEYS | {"attention_fallback"}
TRITON_KEYS = frozenset({"triton_used", "uses_triton"})
STRICT_LOGP_BACKEND = "rlkernel.linear_logp.bitwise.v1"
STRICT_FFN_BACKEND = "rlkernel.ffn.qwen3.deterministic.v1"
ROCM_APPROVED_TRITON = frozenset({"rlkernel.rocm.triton_det_gemm",
                                  "rlkernel.rocm.triton_chunked_flash_attention.v1",
                                  "rlkernel.det_gemm.triton_mfma_rocm.v1"})
POLICY_SCHEMA = "rlk.runtime_policy.v1"
MAX_DEPTH = 64


def _walk(value: Any, path: str = "", depth: int = 0) -> Iterable[tuple[str, str, Any]]:
    """(path, lower-case key, value) of every mapping entry, depth first (bounded)."""
    if depth > MAX_DEPTH:
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            yield where, str(key).strip().lower(), item
            yield from _walk(item, where, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}[{i}]", depth + 1)


def truthy_flag(value: Any, keys: frozenset[str]) -> str | None:
    """Where a key of `keys` holds a value other than False, None, "" or 0 (upstream's
    `_contains_truthy_fallback`), as `path=value`; None when nowhere."""
    for where, key, item in _walk(value):
        if key in keys and not (item is False or item is None or item == "" or (
                type(item) is int and item == 0) or (type(item) is float and item == 0.0)):
            return f"{where}={str(item)[:60]!r}" if not isinstance(item, bool) else (
                f"{where}={item}")
    return None


def triton_use(value: Any, allowed: frozenset[str] = frozenset()) -> str | None:
    """Where a record uses Triton (upstream's `_contains_triton`: a true `triton_used` /
    `uses_triton`, or "triton" in any string), strings in `allowed` excepted."""
    if isinstance(value, str):
        return None if value in allowed or "triton" not in value.lower() else repr(value[:80])
    for where, key, item in _walk(value):
        if key in TRITON_KEYS and item is True and not allowed:
            return f"{where}=true"
        if isinstance(item, str) and "triton" in item.lower() and item not in allowed:
            return f"{where}={item[:80]!r}"
    return None


def first_platform(value: Any, keys: tuple[str, ...] = ("runtime_platform",)) -> str | None:
    """The first `runtime_platform` (depth first, as upstream's `_runtime_platform`)."""
    for _, key, item in _walk(value):
        if key in keys and isinstance(item, str):
            return item.strip().lower()
    return None


def _rocm_platforms(value: Any) -> set[str]:
    return {str(item).strip().lower() for _, key, item in _walk(value)
            if key in ("runtime_platform", "platform") and isinstance(item, str)}


def record_rules(record: Mapping[str, Any], module: str, platform: str) -> tuple[
        list[str], list[str]]:
    """(fallbacks, failures) of one RL-Kernel record under upstream's rules for `platform`."""
    backend = str(record.get("backend_id", ""))
    prov = record.get("provenance")
    fallbacks, failures = [], []
    flag = truthy_flag(record, ROCM_FALLBACK_KEYS if platform == "rocm" else FALLBACK_KEYS)
    if flag:
        fallbacks.append(f"says {flag}: a fallback (RL-Kernel's rule: any truthy fallback key "
                         "in a record)")
    if platform == "cuda":
        used = triton_use(record)
        if used:
            failures.append(f"uses Triton ({used}); RL-Kernel's CUDA validator allows none "
                            "(runtime_policy triton_allowed: false)")
        seen = first_platform(prov)
        if seen != "cuda":
            failures.append(f"does not report CUDA execution (runtime_platform {seen!r})")
        if module == "logp" and backend != STRICT_LOGP_BACKEND:
            failures.append(f"logp backend {backend!r} is not the strict "
                            f"{STRICT_LOGP_BACKEND!r}")
    elif platform == "rocm":
        if not _rocm_platforms(prov) & {"rocm", "hip"}:
            failures.append("does not prove ROCm execution (no runtime_platform rocm/hip)")
        ref = truthy_flag(prov, frozenset({"reference_only"}))
        if ref:
            failures.append(f"says {ref}: a reference path, not the strict kernel")
        used = triton_use(prov, ROCM_APPROVED_TRITON)
        if used:
            failures.append(f"uses an unapproved Triton backend ({used})")
        want = {"ffn": STRICT_FFN_BACKEND, "logp": STRICT_LOGP_BACKEND}.get(module)
        if want and backend != want:
            failures.append(f"{module} backend {backend!r} is not the strict {want!r}")
    return fallbacks, failures


def declared_policy(policies: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Any] | None,
                                                                    list[str]]:
    """The run's declared runtime policy (one for all its readbacks), and problems with it."""
    seen: dict[str, tuple[str, Any]] = {}
    problems: list[str] = []
    for entry in policies:
        source, pol = entry.get("source"), entry.get("policy")
        if not isinstance(pol, Mapping):
            problems.append(f"readback {source}: runtime_policy is not an object")
            continue
        prefix, platform = pol.get("backend_prefix"), pol.get("platform")
        low = prefix.lower() if isinstance(prefix, str) else ""
        if (not low.endswith(".") or len(low) < 3 or low.startswith("rlkernel")
                or "production" in low):
            problems.append(f"readback {source}: runtime_policy backend_prefix {prefix!r} is "
                            "not a backend namespace of the run's own (RL-Kernel's ids and "
                            "production ids cannot be declared)")
            continue
        if not isinstance(platform, str) or not isinstance(pol.get("triton_allowed"), bool):
            problems.append(f"readback {source}: runtime_policy needs platform (str) and "
                            "triton_allowed (bool)")
            continue
        key = repr(sorted((k, str(v)) for k, v in pol.items()))
        seen.setdefault(key, (str(source), dict(pol)))
    if len(seen) > 1:
        problems.append("readbacks declare different runtime policies: "
                        + "; ".join(f"{s}: {p}" for s, p in list(seen.values())[:2]))
        return None, problems
    return (next(iter(seen.values()))[1] if seen else None), problems


def own_backend(backend: str, policy: Mapping[str, Any] | None) -> bool:
    """A backend id under the run's declared prefix (its own R)."""
    return bool(policy) and backend.lower().startswith(str(policy["backend_prefix"]).lower())


def policy_rules(record: Mapping[str, Any], policy: Mapping[str, Any]) -> list[str]:
    """Failures of one record with the run's own backend id under its declared policy."""
    failures = []
    want = str(policy["platform"]).lower()
    seen = first_platform(record.get("provenance"))
    if seen != want:
        failures.append(f"runs on {seen!r}, the run's runtime policy declares {want!r}")
    if not policy["triton_allowed"]:
        used = triton_use(record)
        if used:
            failures.append(f"uses Triton ({used}); the run's runtime policy allows none")
    return failures


def upstream_findings(records: Iterable[Mapping[str, Any]], platform: str | None,
                      policies: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """(fallbacks, failures) over every readback record (`{side, module, source, record}`),
    each naming the record: `attention rollout (vllm-rollout-12.json): ...`."""
    policy, failures = declared_policy(policies)
    fallbacks: list[str] = []
    for entry in records:
        rec = entry.get("record")
        if not isinstance(rec, Mapping):
            continue
        where = f"{entry.get('module')} {entry.get('side')} ({entry.get('source')})"
        backend = str(rec.get("backend_id", ""))
        if backend.lower().startswith("rlkernel."):
            fb, bad = record_rules(rec, str(entry.get("module")), (platform or "").lower())
            fallbacks += [f"{where}: record {backend!r} {w}" for w in fb]
            failures += [f"{where}: record {backend!r} {w}" for w in bad]
            continue
        flag = truthy_flag(rec, FALLBACK_KEYS)
        if flag:
            fallbacks.append(f"{where}: record {backend!r} says {flag}: a fallback")
        if policy is not None and own_backend(backend, policy):
            failures += [f"{where}: record {backend!r} {w}" for w in policy_rules(rec, policy)]
    return fallbacks, failures
