"""RL-Kernel's own artifact forms that are not sidecars: weight audits, route lines, the native
logp marker and `bitwise-validation.json` (docs/artifact-format.md, docs/en/conformance.md).

- Weight audits: `weight-audit/<version>.json` (`version`, `scope`, `sha256` over
  `json.dumps(tensors, sort_keys=True)`, `tensor_count`, `tensors`), written by training rank 0
  once per exported version. The chain is judged (parses, keys and types, digest recomputed,
  versions consecutive). `weight-audit/rollout/<version>.json` (or a `weight_version` in a rollout
  readback) is the rollout side's evidence where a run has one; without it the rollout side is
  "not audited by the framework": recorded, a reason only where matrix.toml requires it. The
  older `v0.<framework>-<target>.json` form (`weight_version`, `framework`, `target`, `sha256`)
  is still read, recorded as `legacy`.
- Route lines: `requested=<production|rl_kernel> actual=<backend> fallback=<bool>`; the older
  `implementation=` form is read too (recorded as `legacy`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.store.safeio import MAX_JSON_BYTES, Refused, listing, read_bytes

_TRAINING_NAMES = {"training", "train", "actor", "megatron", "fsdp", "trainer"}
_ROLLOUT_NAMES = {"rollout", "inference", "generation", "vllm", "sglang", "generator"}
TRAINING_SCOPE = "all_exported_parameters"
ROLLOUT_SCOPE = "rollout_loaded_parameters"
AUDIT_KEYS = ("version", "scope", "sha256", "tensor_count", "tensors")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TRAILING_INT = re.compile(r"(\d+)$")
NATIVE_LOGP_MARKER = "linear_logp native active:"
NATIVE_LOGP_CONTRACT = "vime.native.linear_logp.v1"
SIDECAR_LOGP_MARKER = "rlkernel mismatch sidecar active: logp_case="
_OFFLINE_UNAVAILABLE = ("lacks list log_probs/rollout_log_probs",
                        "no comparable train/rollout samples were found")


def side_of(framework: str | None, target: str | None) -> str | None:
    """`training`/`rollout` from a readback's target, else its framework."""
    for name in (target, framework):
        low = (name or "").lower()
        if low in _TRAINING_NAMES:
            return "training"
        if low in _ROLLOUT_NAMES:
            return "rollout"
    return None


# ---------------------------------------------------------------------------------------------
# Weight audits.


@dataclass
class WeightAudit:
    """The run's weight audit chain, as read (judged by `judge_weight_audit`)."""

    format: str | None = None  # "upstream", "legacy", "mixed" or None (no audit files)
    training: dict[str, str] = field(default_factory=dict)  # version -> sha256
    rollout: dict[str, str] = field(default_factory=dict)  # version -> sha256 (rollout files)
    rollout_readback_versions: list[str] = field(default_factory=list)
    tensor_counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # chain problems: reasons
    notes: list[str] = field(default_factory=list)  # what the judgement only records
    files: list[str] = field(default_factory=list)

    @property
    def versions(self) -> list[str]:
        return sorted(self.training, key=_version_key)

    @property
    def rollout_audited(self) -> bool:
        return bool(self.rollout or self.rollout_readback_versions)

    def as_dict(self) -> dict[str, Any]:
        return {"format": self.format, "versions": self.versions,
                "rollout_audited": self.rollout_audited,
                "rollout_versions": sorted(set(self.rollout) | set(
                    self.rollout_readback_versions), key=_version_key),
                "tensor_counts": self.tensor_counts, "problems": self.problems,
                "notes": self.notes,
                "files": self.files}


def _version_key(version: str) -> tuple[int, str]:
    m = _TRAILING_INT.search(version)
    return (int(m.group(1)) if m else -1, version)


def _load(path: Path, root: Path, problems: list[str], keep: dict[str, Any] | None = None,
          ) -> Any:
    """The file's JSON (UTF-8), or None with the reason in `problems`. `keep` gets the parsed
    value of each file whose bytes `json.loads` would also read as UTF-8 (no BOM, no NUL in
    the first 4 bytes: its encoding detection), for a second reader of the same files."""
    try:
        raw = read_bytes(path, root, MAX_JSON_BYTES)
        data = json.loads(raw.decode("utf-8"))
        if keep is not None and not raw.startswith(b"\xef\xbb\xbf") and b"\0" not in raw[:4]:
            keep[str(path)] = data
        return data
    except Refused as exc:
        problems.append(str(exc))
    except (OSError, ValueError, RecursionError, MemoryError) as exc:
        problems.append(f"unreadable {path.name}: {type(exc).__name__}: {str(exc)[:200]}")
    return None


def _check_upstream(data: Mapping[str, Any], rel: str, stem: str, scope: str) -> list[str]:
    """Problems of one upstream-format audit file (empty: the file is sound)."""
    missing = [k for k in AUDIT_KEYS if k not in data]
    if missing:
        return [f"weight audit {rel}: missing key(s) {', '.join(missing)}"]
    why: list[str] = []
    version, sha, count, tensors = (data["version"], data["sha256"], data["tensor_count"],
                                    data["tensors"])
    if not isinstance(version, str) or version != stem:
        why.append(f"weight audit {rel}: version {version!r} does not match the file name "
                   f"{stem!r}")
    if data["scope"] != scope:
        why.append(f"weight audit {rel}: scope {data['scope']!r}, expected {scope!r}")
    if not isinstance(sha, str) or not _HEX64.match(sha):
        why.append(f"weight audit {rel}: sha256 is not a 64-digit hex string")
    if not isinstance(tensors, dict) or not tensors:
        return [*why, f"weight audit {rel}: tensors is not a non-empty object"]
    for name, entry in tensors.items():
        if type(entry) is dict:  # JSON's own types: what the test below accepts, sooner
            shape = entry.get("shape")
            if (type(entry.get("sha256")) is str and type(entry.get("dtype")) is str
                    and type(shape) is list and all(type(d) is int and d >= 0 for d in shape)):
                continue
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                        for d in entry["shape"])):
            why.append(f"weight audit {rel}: tensors[{str(name)[:80]!r}] needs sha256 (str), "
                       "shape (list of int) and dtype (str)")
            break
    if isinstance(count, bool) or not isinstance(count, int) or count != len(tensors):
        why.append(f"weight audit {rel}: tensor_count {count!r} != {len(tensors)} tensors")
    if isinstance(sha, str) and not why:
        # (parsed JSON holds no cycles: the same text without json's cycle check)
        digest = hashlib.sha256(json.dumps(tensors, sort_keys=True,
                                           check_circular=False).encode()).hexdigest()
        if digest != sha:
            why.append(f"weight audit {rel}: sha256 {sha[:12]} does not match the digest of its "
                       f"tensors ({digest[:12]}): the audit was altered or mis-written")
    return why


def _chain_gaps(versions: Iterable[str], what: str) -> list[str]:
    """Versions must be consecutive numbers (a trailing integer each), none twice."""
    numbered: dict[int, list[str]] = {}
    why: list[str] = []
    for v in versions:
        n = _version_key(v)[0]
        if n < 0:
            why.append(f"weight audit {what}: version {v!r} carries no number: cannot order it")
            continue
        numbered.setdefault(n, []).append(v)
    for n, names in sorted(numbered.items()):
        if len(names) > 1:
            why.append(f"weight audit {what}: versions {sorted(names)} are the same version {n} "
                       "twice")
    nums = sorted(numbered)
    gaps = [n for n in range(nums[0], nums[-1] + 1) if n not in numbered] if nums else []
    if gaps:
        why.append(f"weight audit {what}: versions {nums[0]}..{nums[-1]} lack {gaps[:8]}: the "
                   "chain has gaps")
    return why


def read_weight_audits(root: Path, problems: list[str],
                       keep: dict[str, Any] | None = None) -> WeightAudit:
    """Read `weight-audit/` (upstream and legacy forms); unreadable files go to `problems`
    (`keep`: see `_load`; the values are only read, never changed)."""
    wa = WeightAudit()
    forms: set[str] = set()
    for sub, scope, into in (("weight-audit", TRAINING_SCOPE, wa.training),
                             ("weight-audit/rollout", ROLLOUT_SCOPE, wa.rollout)):
        for path in listing(root / sub, "*.json", root, problems):
            rel = f"{sub}/{path.name}"
            data = _load(path, root, problems, keep)
            if data is None:
                continue
            wa.files.append(rel)
            if not isinstance(data, dict):
                wa.problems.append(f"weight audit {rel}: not a JSON object")
                continue
            if "framework" in data or "target" in data or "weight_version" in data:
                forms.add("legacy")
                _legacy(wa, data, rel, path.stem)
                continue
            forms.add("upstream")
            why = _check_upstream(data, rel, path.stem, scope)
            wa.problems.extend(why)
            if not why:
                into[data["version"]] = data["sha256"]
                if into is wa.training:
                    wa.tensor_counts[data["version"]] = data["tensor_count"]
    if "upstream" in forms:
        wa.problems.extend(_chain_gaps(wa.training, "chain"))
    wa.format = "mixed" if len(forms) > 1 else next(iter(forms), None)
    return wa


def _legacy(wa: WeightAudit, data: Mapping[str, Any], rel: str, stem: str) -> None:
    sha = data.get("sha256")
    if not isinstance(sha, str):
        wa.problems.append(f"weight audit {rel}: no sha256 string")
        return
    version = str(data.get("weight_version", stem.split(".")[0]))
    fw, target = data.get("framework"), data.get("target")
    side = side_of(fw if isinstance(fw, str) else None, target if isinstance(target, str)
                   else None)
    if side is None:  # `v0.megatron-training.json`: the name says who wrote it
        parts = stem.split(".", 1)[-1].split("-")
        side = side_of(parts[0], parts[-1])
    if side is None:
        wa.problems.append(f"weight audit {rel}: cannot tell the side of {fw}/{target}")
        return
    into = wa.training if side == "training" else wa.rollout
    if version in into and into[version] != sha:
        wa.problems.append(f"weight audit {rel}: two {side} audits of version {version} differ")
    into[version] = sha


# ---------------------------------------------------------------------------------------------
# Route lines (judged in judge/route/crosscheck.py).


def route_form(routes: Iterable[Mapping[str, str]]) -> str | None:
    """`upstream` (requested=/actual=), `legacy` (implementation=), `mixed`, or None."""
    forms = {"upstream" if "requested" in r or "actual" in r else "legacy"
             for r in routes if "module" in r}
    return "mixed" if len(forms) > 1 else next(iter(forms), None)


# ---------------------------------------------------------------------------------------------
# bitwise-validation.json (RL-Kernel's offline train-data comparison).


def bitwise_validation_status(bv: Mapping[str, Any]) -> tuple[str, str]:
    """(`passed` | `unavailable` | `failed`, detail).

    `unavailable`: the comparison found nothing to compare because the train-data dump lacks the
    training `log_probs` (RL-Kernel's own run validator then records the offline comparison as
    unavailable and judges by the runtime evidence); any other `passed` not true is `failed`.
    """
    if bv.get("passed") is True:
        return "passed", ""
    if bv.get("error") is not None:
        return "failed", f"error: {str(bv['error'])[:300]}"
    lp = bv.get("train_rollout_logp")
    rb = bv.get("readbacks")
    if isinstance(lp, Mapping):
        errors = lp.get("errors")
        counts_clean = all(lp.get(k) in (None, 0, 0.0) for k in ("mismatch_count",
                                                                 "max_abs_diff"))
        readbacks_ok = not isinstance(rb, Mapping) or rb.get("passed") is not False
        if (isinstance(errors, list) and errors and counts_clean and readbacks_ok
                and all(isinstance(e, str) and any(u in e for u in _OFFLINE_UNAVAILABLE)
                        for e in errors)):
            return "unavailable", ("train-data dump lacks the training log_probs: offline "
                                   "comparison unavailable; judged by the sidecars")
        return "failed", str(dict(lp))[:300]
    return "failed", f"passed={bv.get('passed')!r}, no train_rollout_logp"
