"""RL-Kernel's own record rules, platform by platform, applied to every readback record that
carries an RL-Kernel backend id; and the runtime policy a run declares for backends of its own.

Upstream's validators (RL-Align/RL-Kernel, read, never copied: `integrations/common/runtime.py`
`_contains_triton` / `_contains_fallback`, `experiments/dense/validate_artifacts.py` @39432c1,
`experiments/rocm_attention/validate_artifacts.py` @0665bf6 and `validate_module_artifacts.py`,
`experiments/rocm_ablation/run.py` `_contains_truthy_fallback`) say:

- every platform: a truthy `fallback`, `fallback_used`, `used_fallback` or `split_kv_fallback`
  key anywhere in a record is a fallback (ROCm adds `attention_fallback`); this judge counts
  every case and compound form of a key naming a fallback (`judge.read.fallback`, shared with
  the run.log scanner);
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
with Triton only where the policy allows it. A declared policy is normalised before it is judged
(stripped, case-folded); a prefix in a namespace that is not the run's own (RL-Kernel's, vLLM's,
Megatron's, torch's, vime's, a production id's), malformed, or differing between readbacks is
refused (a reason), never trusted.

Allow-lists, not deny-lists: a record passes only what it positively shows. A record that is not
an object, a backend id that is not a string as RL-Kernel writes it (no padding, lower case), a
platform the cell does not know (`policy.backend` missing or unknown) and a record too large to
walk (more values than `MAX_VALUES`, nested deeper than `MAX_DEPTH`, where upstream's own
recursive validator fails) are reasons; nothing is skipped. The walks are iterative and visit keys
in upstream's order (a mapping's own key before nested ones).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pytest_rlkernel_matrix.judge.read.fallback import names_fallback, truthy_value
from pytest_rlkernel_matrix.judge.read.policy import PLATFORMS

FALLBACK_KEYS = frozenset({"fallback", "fallback_used", "used_fallback", "split_kv_fallback"})
ROCM_FALLBACK_KEYS = FALLBACK_KEYS | {"attention_fallback"}
TRITON_KEYS = frozenset({"triton_used", "uses_triton"})
STRICT_LOGP_BACKEND = "rlkernel.linear_logp.bitwise.v1"
STRICT_FFN_BACKEND = "rlkernel.ffn.qwen3.deterministic.v1"
ROCM_APPROVED_TRITON = frozenset({"rlkernel.rocm.triton_det_gemm",
                                  "rlkernel.rocm.triton_chunked_flash_attention.v1",
                                  "rlkernel.det_gemm.triton_mfma_rocm.v1"})
POLICY_SCHEMA = "rlk.runtime_policy.v1"
# The values one record may hold before it is refused as too large to judge (a reason, never a
# skip): upstream's recursion has no bound but Python's stack, which fails its validator.
MAX_VALUES = 1_000_000
# Nesting past this is a reason too: upstream's recursive helpers fail such a record (Python's
# recursion limit: about 330 levels of lists, 1,000 of mappings), so a record we cannot walk the
# way upstream can is never a pass (a depth limit fails closed, never skips).
MAX_DEPTH = 100
# Namespaces a run cannot declare as its own R: RL-Kernel's, the frameworks' and torch's, and
# the reference workload's production (P) ids (`{framework}.production.{module}`, vime's logp).
FOREIGN_NAMESPACES = frozenset({
    "rlkernel", "rl_kernel", "rl-kernel", "rl_engine", "vllm", "megatron", "torch", "pytorch",
    "vime", "slime", "triton", "cuda", "rocm", "hip", "production", "native"})
_PREFIX = re.compile(r"[a-z0-9][a-z0-9_-]*(?:\.[a-z0-9_-]+)*\.\Z")


class TooLarge(Exception):
    """A record holds more values than `MAX_VALUES`, or nests deeper than `MAX_DEPTH`: it cannot
    be judged (a reason)."""


def normalise(value: str) -> str:
    """A declared or recorded id as it is judged: stripped and case-folded."""
    return value.strip().casefold()


def _walk(value: Any, stop: frozenset[str] = frozenset()) -> Iterator[tuple[str, str | None,
                                                                             Any]]:
    """(path, normalised key or None, value) of `value` and everything inside it, in the order
    upstream's recursive helpers visit them (a mapping's entry, then what it holds, then the next
    entry; list items in order; strings are leaves). Iterative: no depth limit and no recursion;
    an entry whose key is in `stop` is yielded but not entered (upstream's `continue`)."""
    stack: list[tuple[str, str | None, Any, int]] = [("", None, value, 0)]
    seen = 0
    while stack:
        path, key, item, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise TooLarge(f"more than {MAX_VALUES} values")
        yield path, key, item
        if key is not None and key in stop:
            continue
        if isinstance(item, (Mapping, list, tuple)) and depth >= MAX_DEPTH:
            raise TooLarge(f"nested deeper than {MAX_DEPTH} (at {path[:80]}...; RL-Kernel's "
                           "own validator fails such a record)")
        if isinstance(item, Mapping):
            entries = list(item.items())
            for name, sub in reversed(entries):
                stack.append((f"{path}.{name}" if path else str(name),
                              str(name).strip().lower(), sub, depth + 1))
        elif isinstance(item, (list, tuple)):
            for i in range(len(item) - 1, -1, -1):
                stack.append((f"{path}[{i}]", None, item[i], depth + 1))


def _shown(item: Any) -> str:
    return str(item) if isinstance(item, bool) else repr(str(item)[:60])


def truthy_flag(value: Any, keys: frozenset[str]) -> str | None:
    """Where a key of `keys` holds a value upstream counts as true (`not in (False, None, "",
    0)`, RL-Kernel's `_contains_fallback`), as `path=value`; None when nowhere."""
    for where, key, item in _walk(value):
        if key in keys and item not in (False, None, "", 0):
            return f"{where}={_shown(item)}"
    return None


def fallback_flag(value: Any) -> str | None:
    """Where a key naming a fallback holds a truthy value (`judge.read.fallback`: RL-Kernel's
    `_contains_fallback` and every case or compound form of its keys), as `path=value`."""
    for where, key, item in _walk(value):
        if key is not None and names_fallback(key) and truthy_value(item):
            return f"{where}={_shown(item)}"
    return None


def triton_use(value: Any, allowed: frozenset[str] = frozenset()) -> str | None:
    """Where a record uses Triton (RL-Kernel's `_contains_triton`: "triton" in any string,
    inside lists too; a `triton_used` / `uses_triton` key not entered), strings in `allowed`
    excepted. Stricter than upstream by one allow-list rule: such a key passes only when it
    holds False or null (upstream fails only `True`)."""
    for where, key, item in _walk(value, TRITON_KEYS):
        if key in TRITON_KEYS:
            if item is not False and item is not None and not allowed:
                return f"{where}={_shown(item).lower() if item is True else _shown(item)}"
            continue
        if isinstance(item, str) and "triton" in item.lower() and item not in allowed:
            return f"{where or 'value'}={item[:80]!r}"
    return None


def runtime_platform(value: Any) -> str | None:
    """RL-Kernel's `_runtime_platform`: a mapping's own `runtime_platform` string before any
    nested one, then each value's in order (mappings only; the string as written)."""
    stack, seen = [(value, 0)], 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise TooLarge(f"more than {MAX_VALUES} values")
        if not isinstance(item, Mapping):
            continue
        direct = item.get("runtime_platform")
        if isinstance(direct, str):
            return direct
        if depth >= MAX_DEPTH:
            raise TooLarge(f"nested deeper than {MAX_DEPTH} (RL-Kernel's own validator fails "
                           "such a record)")
        stack.extend((sub, depth + 1) for sub in reversed(list(item.values())))
    return None


def _rocm_platforms(value: Any) -> set[str]:
    return {item.strip().lower() for _, key, item in _walk(value)
            if key in ("runtime_platform", "platform") and isinstance(item, str)}


def record_rules(record: Mapping[str, Any], module: str, platform: str) -> tuple[
        list[str], list[str]]:
    """(fallbacks, failures) of one RL-Kernel record under upstream's rules for `platform`
    (one of `PLATFORMS`; the caller refuses any other)."""
    backend = record.get("backend_id")
    backend = backend if isinstance(backend, str) else ""
    prov = record.get("provenance")
    fallbacks: list[str] = []
    failures: list[str] = []
    try:
        flag = fallback_flag(record)
        if flag:
            fallbacks.append(f"says {flag}: a fallback (RL-Kernel's rule: any truthy fallback "
                             "key in a record)")
        if platform == "cuda":
            used = triton_use(record)
            if used:
                failures.append(f"uses Triton ({used}); RL-Kernel's CUDA validator allows none "
                                "(runtime_policy triton_allowed: false)")
            seen = runtime_platform(prov)
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
    except TooLarge as exc:
        failures.append(f"cannot be judged: {exc} in one record")
    return fallbacks, failures


def _prefix_problem(prefix: Any) -> tuple[str | None, str]:
    """(normalised prefix, "") or (None, why it cannot be a namespace of the run's own)."""
    if not isinstance(prefix, str):
        return None, "is not a string"
    low = normalise(prefix)
    if not _PREFIX.match(low) or len(low) > 64:
        return None, ("is not a backend namespace (lower-case dotted words ending in '.', "
                      "at most 64 characters)")
    segments = low[:-1].split(".")
    words = set(segments) | set(re.split(r"[._-]", low[:-1]))
    foreign = sorted(words & FOREIGN_NAMESPACES)
    if foreign:
        return None, (f"names the {foreign[0]!r} namespace, which is not the run's own "
                      "(RL-Kernel's, the frameworks', torch's and production ids cannot be "
                      "declared)")
    return low, ""


def declared_policy(policies: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Any] | None,
                                                                    list[str]]:
    """The run's declared runtime policy, normalised (one for all its readbacks), and problems
    with it. Any problem leaves no policy: nothing is judged as the run's own R then."""
    seen: dict[str, tuple[str, dict[str, Any]]] = {}
    problems: list[str] = []
    for entry in policies:
        source, pol = entry.get("source"), entry.get("policy")
        if not isinstance(pol, Mapping):
            problems.append(f"readback {source}: runtime_policy is not an object")
            continue
        prefix, why = _prefix_problem(pol.get("backend_prefix"))
        if prefix is None:
            problems.append(f"readback {source}: runtime_policy backend_prefix "
                            f"{pol.get('backend_prefix')!r} {why}")
            continue
        platform = pol.get("platform")
        platform = normalise(platform) if isinstance(platform, str) else None
        if platform not in PLATFORMS or type(pol.get("triton_allowed")) is not bool:
            problems.append(f"readback {source}: runtime_policy needs platform (one of "
                            f"{', '.join(PLATFORMS)}) and triton_allowed (true or false); it "
                            f"has {pol.get('platform')!r} and {pol.get('triton_allowed')!r}")
            continue
        norm = {"backend_prefix": prefix, "platform": platform,
                "triton_allowed": pol["triton_allowed"]}
        seen.setdefault(repr(sorted(norm.items())), (str(source), norm))
    if len(seen) > 1:
        problems.append("readbacks declare different runtime policies: "
                        + "; ".join(f"{s}: {p}" for s, p in list(seen.values())[:2]))
    if problems or not seen:
        return None, problems
    return next(iter(seen.values()))[1], problems


def own_backend(backend: str, policy: Mapping[str, Any] | None) -> bool:
    """A backend id under the run's declared (normalised) prefix: its own R."""
    return bool(policy) and isinstance(backend, str) and normalise(backend).startswith(
        str(policy["backend_prefix"]))


def policy_rules(record: Mapping[str, Any], policy: Mapping[str, Any]) -> list[str]:
    """Failures of one record with the run's own backend id under its declared policy."""
    failures = []
    want = str(policy["platform"])
    try:
        seen = runtime_platform(record.get("provenance"))
        if seen != want:
            failures.append(f"runs on {seen!r}, the run's runtime policy declares {want!r}")
        if not policy["triton_allowed"]:
            used = triton_use(record)
            if used:
                failures.append(f"uses Triton ({used}); the run's runtime policy allows none")
    except TooLarge as exc:
        failures.append(f"cannot be judged: {exc} in one record")
    return failures


def upstream_findings(records: Iterable[Mapping[str, Any]], platform: str | None,
                      policies: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[str]]:
    """(fallbacks, failures) over every readback record (`{side, module, source, record}`),
    each naming the record: `attention rollout (vllm-rollout-12.json): ...`. `platform` is the
    cell's (its `policy.backend`); a record whose rules need it fails closed without it."""
    policy, failures = declared_policy(policies)
    fallbacks: list[str] = []
    known = platform if platform in PLATFORMS else None
    missing_platform = False
    for entry in records:
        rec = entry.get("record")
        where = f"{entry.get('module')} {entry.get('side')} ({entry.get('source')})"
        if not isinstance(rec, Mapping):
            failures.append(f"{where}: record is a {type(rec).__name__}, not an object: "
                            "nothing in it shows what ran")
            continue
        raw = rec.get("backend_id")
        if not isinstance(raw, str) or not raw:
            failures.append(f"{where}: backend_id {raw!r} is not a backend id")
            continue
        backend = normalise(raw)
        if backend != raw:
            failures.append(f"{where}: backend_id {raw!r} is not written as a backend id "
                            f"(padded or upper case); judged as {backend!r}")
        if backend.startswith("rlkernel."):
            if known is None:
                missing_platform = True
                continue
            fb, bad = record_rules(rec, str(entry.get("module")), known)
            fallbacks += [f"{where}: record {raw!r} {w}" for w in fb]
            failures += [f"{where}: record {raw!r} {w}" for w in bad]
            continue
        try:
            flag = fallback_flag(rec)
        except TooLarge as exc:
            failures.append(f"{where}: record {raw!r} cannot be judged: {exc} in one record")
            continue
        if flag:
            fallbacks.append(f"{where}: record {raw!r} says {flag}: a fallback")
        if policy is not None and own_backend(backend, policy):
            failures += [f"{where}: record {raw!r} {w}" for w in policy_rules(rec, policy)]
    if missing_platform:
        failures.insert(0, (
            "RL-Kernel's record rules cannot be evaluated: the cell's platform is "
            + ("unknown (cell-run.json has no policy.backend)" if platform is None else
               f"{platform!r}, not one of {', '.join(PLATFORMS)} (cell-run.json policy.backend)")
            + ": the records under RL-Kernel's backend ids are not judged valid"))
    return fallbacks, failures
