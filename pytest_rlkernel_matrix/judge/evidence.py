"""Read what a run left on disk (RL-Kernel + vime layout, see docs/artifact-format.md).

Readers are tolerant of version differences: unknown keys are ignored, missing or unreadable
artifacts become `problems` (reasons), never exceptions. `.pt` files are loaded with
`torch.load(weights_only=True)`; torch is imported only here, only when a `.pt` file exists.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.judge.logscan import LogScan, scan_log
from pytest_rlkernel_matrix.judge.metrics import DriftMetrics, Sample, compute
from pytest_rlkernel_matrix.store.safeio import (
    MAX_JSON_BYTES,
    MAX_PT_BYTES,
    MAX_SMALL_BYTES,
    Refused,
    listing,
    read_bytes,
)

SIDES = ("training", "rollout")
_TRAINING_NAMES = {"training", "train", "actor", "megatron", "fsdp", "trainer"}
_ROLLOUT_NAMES = {"rollout", "inference", "generation", "vllm", "sglang", "generator"}
SIDECAR_DIRS = ("mismatch-sidecars", "mismatch_sidecars")
_SIDECAR_NAME_RE = re.compile(r"^rank(\d+)\.call(\d+)\.pt$")
_TRAIN_DATA_NAME_RE = re.compile(r"\.rank(\d+)\.pt$")


def side_of(framework: str | None, target: str | None) -> str | None:
    """`training`/`rollout` from a readback's target, else its framework."""
    for name in (target, framework):
        low = (name or "").lower()
        if low in _TRAINING_NAMES:
            return "training"
        if low in _ROLLOUT_NAMES:
            return "rollout"
    return None


@dataclass
class Route:
    """What one side of one module reports it ran (merged over that side's processes)."""

    implementations: list[str] = field(default_factory=list)
    backend_ids: list[str] = field(default_factory=list)
    case_ids: list[str] = field(default_factory=list)
    call_count: int = 0
    processes: int = 0
    fallback: bool = False
    contracts: list[Any] = field(default_factory=list)
    contract_missing: bool = False
    contract_versions: list[str] = field(default_factory=list)
    runtime_platforms: list[str] = field(default_factory=list)
    execution_modes: list[str] = field(default_factory=list)
    case_id_missing: bool = False
    call_counts: list[int] = field(default_factory=list)
    call_count_missing: bool = False
    sources: list[str] = field(default_factory=list)

    @property
    def implementation(self) -> str | None:
        if len(self.implementations) == 1:
            return self.implementations[0]
        return "mixed" if self.implementations else None


@dataclass
class Evidence:
    """Everything read from one cell's artifact directory."""

    root: Path
    readback_files: list[str] = field(default_factory=list)
    routes: dict[str, dict[str, Route]] = field(default_factory=lambda: {s: {} for s in SIDES})
    fallbacks: list[dict[str, str]] = field(default_factory=list)
    capability: list[dict[str, Any]] = field(default_factory=list)
    sidecar_files: list[str] = field(default_factory=list)
    sidecar_schema: list[str] = field(default_factory=list)
    logprob_source: str | None = None
    metrics: DriftMetrics | None = None
    samples: list[Sample] = field(default_factory=list)  # what `metrics` was computed over
    sample_problems: list[str] = field(default_factory=list)
    weight_versions: dict[str, dict[str, str]] = field(default_factory=dict)
    weight_sides: dict[str, set[str]] = field(default_factory=dict)
    rank_files: list[dict[str, Any]] = field(default_factory=list)
    samples_per_rank: dict[int, int] = field(default_factory=dict)
    run_ids: dict[str, str] = field(default_factory=dict)
    exit_code_file: str | None = None
    bitwise_validation: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None
    log: LogScan = field(default_factory=LogScan)
    problems: list[str] = field(default_factory=list)

    @property
    def sides_with_readbacks(self) -> set[str]:
        return {s for s in SIDES if self.routes[s]}


def _read_json(path: Path, root: Path, problems: list[str]) -> Any:
    try:
        raw = read_bytes(path, root, MAX_JSON_BYTES)
        return json.loads(raw.decode("utf-8"))
    except Refused as exc:
        problems.append(str(exc))
    except (OSError, ValueError, RecursionError, MemoryError) as exc:
        # ValueError covers JSONDecodeError, UnicodeDecodeError and over-long integers.
        problems.append(f"unreadable {path.name}: {type(exc).__name__}: {str(exc)[:200]}")
    return None


def _add_unique(items: list[Any], value: Any) -> None:
    if value is not None and value not in items:
        items.append(value)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _read_readbacks(ev: Evidence) -> None:
    for path in listing(ev.root / "readbacks", "*.json", ev.root, ev.problems):
        try:
            _read_readback(ev, path)
        except Exception as exc:  # fail closed on any shape the checks above missed
            ev.problems.append(f"readback {path.name}: malformed: {type(exc).__name__}: "
                               f"{str(exc)[:200]}")


def _read_readback(ev: Evidence, path: Path) -> None:
    data = _read_json(path, ev.root, ev.problems)
    if not isinstance(data, dict):
        if data is not None:
            ev.problems.append(f"readback {path.name} is not a JSON object")
        return
    ev.readback_files.append(path.name)
    run_id = data.get("run_id")
    if run_id is not None:
        ev.run_ids[f"readbacks/{path.name}"] = str(run_id)
    fw, target = _str_or_none(data.get("framework")), _str_or_none(data.get("target"))
    if fw is None and "-" in path.stem:
        fw, _, rest = path.stem.partition("-")
        target = rest.rsplit("-", 1)[0]
    side = side_of(fw, target)
    if side is None:
        ev.problems.append(f"readback {path.name}: cannot tell the side of {fw}/{target}")
        return
    fallbacks = data.get("fallbacks") or []
    if not isinstance(fallbacks, list):
        ev.problems.append(f"readback {path.name}: fallbacks is {type(fallbacks).__name__}, "
                           "not a list")
        fallbacks = []
    for fb in fallbacks:
        if isinstance(fb, dict):
            ev.fallbacks.append({"side": side, "module": str(fb.get("module", "?")),
                                 "reason": str(fb.get("reason", ""))[:500],
                                 "source": path.name})
        else:
            ev.fallbacks.append({"side": side, "module": "?", "reason": str(fb)[:500],
                                 "source": path.name})
    cap = data.get("capability")
    decisions = data.get("capability_decisions")
    if isinstance(cap, dict) or decisions:
        cap = dict(cap) if isinstance(cap, dict) else {}
        if decisions and "capability_decisions" not in cap:
            cap["capability_decisions"] = decisions
        if not isinstance(cap.get("capability_decisions", []), list):
            cap["capability_decisions"] = []
        cap.setdefault("status", data.get("status", "unknown"))
        ev.capability.append({"side": side, "source": path.name, **cap})
    operators = data.get("operators") or {}
    if not isinstance(operators, dict):
        ev.problems.append(f"readback {path.name}: operators is not an object")
        return
    for module, op in operators.items():
        if not isinstance(op, dict):
            ev.problems.append(f"readback {path.name}: operators.{module} is not an object")
            continue
        route = ev.routes[side].setdefault(str(module), Route())
        route.processes += 1
        route.sources.append(path.name)
        _add_unique(route.implementations, _str_or_none(op.get("implementation")))
        _add_unique(route.backend_ids, _str_or_none(op.get("backend_id")))
        case_id = op.get("case_id")
        if case_id is None:
            route.case_id_missing = True
        else:
            _add_unique(route.case_ids, str(case_id).strip().upper())
        _add_unique(route.execution_modes, _str_or_none(op.get("execution_mode")))
        count = op.get("call_count")
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            route.call_count += count
            route.call_counts.append(count)
        else:
            route.call_count_missing = True
        prov = op.get("provenance") if isinstance(op.get("provenance"), dict) else {}
        if prov.get("fallback") is True:
            route.fallback = True
        execution = prov.get("execution") if isinstance(prov.get("execution"), dict) else {}
        _add_unique(route.runtime_platforms, _str_or_none(
            execution.get("runtime_platform") or prov.get("runtime_platform")))
        if "arithmetic_contract" in prov or "arithmetic_contract" in op:
            declared = prov.get("arithmetic_contract", op.get("arithmetic_contract"))
            if declared not in route.contracts:
                route.contracts.append(declared)
        else:
            route.contract_missing = True
        _add_unique(route.contract_versions, _str_or_none(
            prov.get("contract_version") or op.get("contract_id")))
        cap_op = prov.get("capability")
        if isinstance(cap_op, dict):
            ev.capability.append({"side": side, "module": module, "source": path.name, **cap_op})


def _np(value: Any, what: str) -> np.ndarray:
    """A 1-D float tensor (or list) as a numpy array; bf16/fp16 widen to fp32 exactly."""
    if hasattr(value, "detach"):
        t = value.detach().cpu()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        arr = t.numpy()
    elif isinstance(value, (list, tuple)):
        arr = np.asarray(value, dtype=np.float64)
    else:
        raise ValueError(f"{what} is {type(value).__name__}, not a tensor")
    if arr.ndim != 1:
        raise ValueError(f"{what} is a {arr.ndim}-d tensor, expected 1-d")
    if arr.dtype.kind not in "fiub":
        raise ValueError(f"{what} has dtype {arr.dtype}, expected a float tensor")
    return arr


def _int(value: Any, what: str, *, default: int | None = None, minimum: int = 0) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is {value!r}, not an integer")
    if value < minimum:
        raise ValueError(f"{what} is {value}, below {minimum}")
    return value


def _seq(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if hasattr(value, "detach") or not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} is {type(value).__name__}, not a list")
    return list(value)


def _zigzag_keep(total: int, response: int, cp: int, cp_rank: int) -> np.ndarray:
    """Which response tokens a CP rank holds under zigzag splitting (chunks r and 2cp-1-r of
    ceil(total / 2cp) tokens)."""
    chunk = -(-total // (2 * cp))
    keep = np.zeros(total, dtype=bool)
    for c in (cp_rank, 2 * cp - 1 - cp_rank):
        keep[c * chunk:(c + 1) * chunk] = True
    return keep[total - response:total]


def _zigzag_slice(mask: np.ndarray, total: int, response: int, cp: int, cp_rank: int,
                  ) -> np.ndarray | None:
    """The part of a full response mask this CP rank holds under zigzag splitting."""
    if not 0 <= response <= total:
        return None
    local = _zigzag_keep(total, response, cp, cp_rank)
    if local.size != mask.size:
        return None
    return mask[local]


@dataclass
class _CpSlice:
    """Where a CP rank's slice of one sample sits in the whole response."""

    group: tuple[int, int]  # (data-parallel rank, sample index): one sample
    cp: int
    cp_rank: int
    keep: np.ndarray  # bool over the full response


def _merge_cp(samples: list[Sample], slices: list[_CpSlice | None], problems: list[str],
              ) -> list[Sample]:
    """One sample per (DP rank, sample index): CP slices scattered back into the response, so
    a token is counted once; a slice missing from a sample is a problem, not a silent drop."""
    out: list[Sample] = []
    groups: dict[tuple[int, int], list[tuple[Sample, _CpSlice]]] = {}
    for s, sl in zip(samples, slices, strict=True):
        if sl is None:
            out.append(s)
        else:
            groups.setdefault(sl.group, []).append((s, sl))
    for (dp, index), parts in sorted(groups.items()):
        cp = parts[0][1].cp
        got = sorted(sl.cp_rank for _, sl in parts)
        if got != list(range(cp)):
            problems.append(f"sample {index} (DP rank {dp}): CP slices from ranks {got} of "
                            f"{cp}: the sidecars do not cover the response once")
            continue
        n = parts[0][1].keep.size
        train = np.zeros(n, dtype=parts[0][0].train.dtype)
        roll = np.zeros(n, dtype=parts[0][0].rollout.dtype)
        mask = np.zeros(n, dtype=parts[0][0].mask.dtype)
        for s, sl in parts:
            train[sl.keep], roll[sl.keep], mask[sl.keep] = s.train, s.rollout, s.mask
        first = min(parts, key=lambda p: p[0].rank)[0]
        out.append(Sample(train=train, rollout=roll, mask=mask, rank=first.rank,
                          tokens=first.tokens, sample=index))
    return out


def _samples_from_sidecar(data: dict[str, Any], name: str, problems: list[str],
                          info: dict[str, Any] | None = None,
                          slices: list[_CpSlice | None] | None = None) -> list[Sample]:
    """Samples of one sidecar; malformed fields raise ValueError (the caller reports it).
    With `slices`, one entry per returned sample: where a CP rank's zigzag slice sits in the
    whole response (None when the sample is not a CP slice)."""
    train = _seq(data.get("train_log_probs"), "train_log_probs")
    roll = _seq(data.get("rollout_log_probs"), "rollout_log_probs")
    if data.get("train_log_probs") is None or data.get("rollout_log_probs") is None:
        problems.append(f"{name}: no train_log_probs/rollout_log_probs")
        return []
    masks = data.get("loss_masks")
    masks = None if masks is None else _seq(masks, "loss_masks")
    rank = _int(data.get("rank"), "rank", default=0)
    tp = _int(data.get("tensor_parallel_size"), "tensor_parallel_size", default=1, minimum=1)
    cp = _int(data.get("context_parallel_size"), "context_parallel_size", default=1, minimum=1)
    totals = [_int(v, "total_lengths[]") for v in _seq(data.get("total_lengths"),
                                                        "total_lengths")]
    responses = [_int(v, "response_lengths[]") for v in _seq(data.get("response_lengths"),
                                                             "response_lengths")]
    if info is not None:
        info.update(rank=rank, tp=tp, cp=cp, samples=len(train))
    if tp > 1 and rank % tp != 0:
        return []  # duplicated across TP replicas: counted once, on TP rank 0
    cp_rank = (rank // tp) % cp
    tokens = data.get("tokens")
    indices = _seq(data.get("sample_indices"), "sample_indices")
    out: list[Sample] = []
    if len(train) != len(roll):
        problems.append(f"{name}: {len(train)} train samples vs {len(roll)} rollout samples")
        return []
    for i, (t, r) in enumerate(zip(train, roll, strict=True)):
        ta, ra = _np(t, f"train_log_probs[{i}]"), _np(r, f"rollout_log_probs[{i}]")
        ma = _np(masks[i], f"loss_masks[{i}]") if masks is not None and i < len(masks) else None
        if ma is None:
            problems.append(f"{name}: sample {i} has no loss mask")
            continue
        keep = None
        if (cp > 1 and i < len(totals) and i < len(responses)
                and 0 <= responses[i] <= totals[i]):
            keep = _zigzag_keep(totals[i], responses[i], cp, cp_rank)
            if keep.size != ma.size:
                keep = None
            elif ma.size != ta.size:
                ma = ma[keep]
        if not (ta.size == ra.size == ma.size):
            problems.append(
                f"{name}: sample {i} lengths differ (train {ta.size}, rollout {ra.size}, "
                f"mask {ma.size})"
            )
            continue
        tok = (_np(tokens[i], f"tokens[{i}]")
               if isinstance(tokens, list) and i < len(tokens) else None)
        index = indices[i] if i < len(indices) else None
        out.append(Sample(train=ta, rollout=ra, mask=ma, rank=rank, tokens=tok,
                          sample=index if isinstance(index, int) and not isinstance(index, bool)
                          else len(out)))
        if slices is not None:
            slices.append(None if keep is None or keep.sum() != ta.size else _CpSlice(
                (rank // (tp * cp), out[-1].sample), cp, cp_rank, keep))
    return out


def _load_pt(path: Path, root: Path, problems: list[str]) -> tuple[dict[str, Any], str] | None:
    """(dict, sha256 of the bytes) of one `.pt` file, or None with a problem recorded."""
    try:
        import torch
    except ImportError:
        problems.append(f"cannot read {path.name}: torch is not installed in the plugin's Python")
        return None
    try:
        raw = read_bytes(path, root, MAX_PT_BYTES)
    except Refused as exc:
        problems.append(str(exc))
        return None
    try:
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad pickle
        problems.append(f"unreadable {path.name}: {type(exc).__name__}: {str(exc)[:200]}")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path.name} is not a dict")
        return None
    return data, hashlib.sha256(raw).hexdigest()


def _renumber(samples: Iterable[Sample]) -> list[Sample]:
    out = list(samples)
    if len({(s.rank, s.sample) for s in out}) != len(out):
        for i, s in enumerate(out):
            s.sample = i
    return out


def _read_sidecar(ev: Evidence, path: Path, samples: list[Sample],
                  slices: list[_CpSlice | None]) -> None:
    loaded = _load_pt(path, ev.root, ev.problems)
    if loaded is None:
        return
    data, digest = loaded
    rel = f"{path.parent.name}/{path.name}"
    info: dict[str, Any] = {"file": rel, "sha256": digest}
    m = _SIDECAR_NAME_RE.match(path.name)
    info["name_rank"] = int(m.group(1)) if m else None
    found_slices: list[_CpSlice | None] = []
    try:
        found = _samples_from_sidecar(data, path.name, ev.sample_problems, info, found_slices)
    except (ValueError, TypeError, IndexError, RecursionError, OverflowError, MemoryError,
            RuntimeError) as exc:
        ev.problems.append(f"sidecar {rel}: malformed: {type(exc).__name__}: {str(exc)[:200]}")
        return
    ev.sidecar_files.append(rel)
    _add_unique(ev.sidecar_schema, _str_or_none(data.get("schema")))
    if data.get("run_id") is not None:
        ev.run_ids[rel] = str(data.get("run_id"))
    ev.rank_files.append(info)
    if "rank" in info:
        ev.samples_per_rank[info["rank"]] = ev.samples_per_rank.get(info["rank"], 0) + int(
            info.get("samples", 0))
    samples.extend(found)
    slices.extend(found_slices)


def _read_train_data(ev: Evidence, path: Path, samples: list[Sample]) -> None:
    loaded = _load_pt(path, ev.root, ev.problems)
    if loaded is None:
        return
    data, digest = loaded
    rel = f"train-data/{path.name}"
    rd = data.get("rollout_data")
    if not isinstance(rd, dict):
        ev.problems.append(f"{rel}: rollout_data is not a dict")
        return
    lp, rlp = rd.get("log_probs"), rd.get("rollout_log_probs")
    if lp is None or rlp is None:
        ev.sample_problems.append(f"{path.name}: lacks log_probs or rollout_log_probs")
        return
    try:
        rank = _int(data.get("rank"), "rank", default=0)
        lp, rlp = _seq(lp, "log_probs"), _seq(rlp, "rollout_log_probs")
        found: list[Sample] = []
        for i, (t, r) in enumerate(zip(lp, rlp, strict=False)):
            ta, ra = _np(t, f"log_probs[{i}]"), _np(r, f"rollout_log_probs[{i}]")
            if ta.size != ra.size:
                ev.sample_problems.append(f"{path.name}: sample {i} lengths differ")
                continue
            found.append(Sample(ta, ra, np.ones(ta.size, dtype=bool), sample=i, rank=rank))
    except (ValueError, TypeError, RecursionError, OverflowError, MemoryError,
            RuntimeError) as exc:
        ev.problems.append(f"{rel}: malformed: {type(exc).__name__}: {str(exc)[:200]}")
        return
    if len(lp) != len(rlp):
        ev.sample_problems.append(f"{path.name}: {len(lp)} log_probs vs {len(rlp)} "
                                  "rollout_log_probs samples")
    m = _TRAIN_DATA_NAME_RE.search(path.name)
    ev.rank_files.append({"file": rel, "sha256": digest, "rank": rank, "tp": 1, "cp": 1,
                          "samples": len(lp), "name_rank": int(m.group(1)) if m else None})
    ev.samples_per_rank[rank] = ev.samples_per_rank.get(rank, 0) + len(lp)
    samples.extend(found)


def _read_logprobs(ev: Evidence) -> None:
    files: list[Path] = []
    for sub in SIDECAR_DIRS:
        files.extend(listing(ev.root / sub, "*.pt", ev.root, ev.problems))
    samples: list[Sample] = []
    ranks: set[int] = set()
    if files:
        ev.logprob_source = "mismatch-sidecars"
        slices: list[_CpSlice | None] = []
        for path in files:
            _read_sidecar(ev, path, samples, slices)
        if any(sl is not None for sl in slices):
            try:
                samples = _merge_cp(samples, slices, ev.sample_problems)
            except (ValueError, TypeError, IndexError) as exc:
                ev.problems.append(f"CP slices: cannot merge: {type(exc).__name__}: "
                                   f"{str(exc)[:200]}")
    else:
        dumps = listing(ev.root / "train-data", "*.pt", ev.root, ev.problems)
        if dumps:
            ev.logprob_source = "train-data (unmasked)"
        for path in dumps:
            _read_train_data(ev, path, samples)
    if ev.logprob_source is not None:
        try:
            ev.samples = _renumber(samples)
            ev.metrics = compute(ev.samples)
        except (ValueError, TypeError, MemoryError) as exc:
            ev.problems.append(f"logprob metrics: {type(exc).__name__}: {str(exc)[:200]}")
        if ev.metrics is not None:  # ranks whose sidecars were read (TP replicas included)
            ranks = {int(f["rank"]) for f in ev.rank_files if isinstance(f.get("rank"), int)}
            if ranks:
                ev.metrics.rank_count = len(ranks)


def _read_weight_audit(ev: Evidence) -> None:
    for path in listing(ev.root / "weight-audit", "*.json", ev.root, ev.problems):
        data = _read_json(path, ev.root, ev.problems)
        if not isinstance(data, dict) or not isinstance(data.get("sha256"), str):
            ev.problems.append(f"weight-audit {path.name}: no sha256 string")
            continue
        version = str(data.get("weight_version", path.stem.split(".")[0]))
        fw, target = _str_or_none(data.get("framework")), _str_or_none(data.get("target"))
        who = "-".join(str(data[k]) for k in ("framework", "target") if k in data) or path.stem
        ev.weight_versions.setdefault(version, {})[who] = data["sha256"]
        side = side_of(fw, target) if (fw or target) else None
        if side is None:  # `v0.megatron-training.json`: the name says who wrote it
            parts = path.stem.split(".", 1)[-1].split("-")
            side = side_of(parts[0], parts[-1])
        ev.weight_sides.setdefault(version, set())
        if side is not None:
            ev.weight_sides[version].add(side)


def read_evidence(root: Path) -> Evidence:
    """Read every artifact of one run directory; never raises for a bad artifact."""
    ev = Evidence(root=root)
    for reader in (_read_readbacks, _read_logprobs, _read_weight_audit, _read_small):
        try:
            reader(ev)
        except Exception as exc:  # a reader bug or an unforeseen shape: fail closed, go on
            ev.problems.append(f"{reader.__name__.strip('_')}: {type(exc).__name__}: "
                               f"{str(exc)[:200]}")
    ev.log = scan_log(root / "run.log", root=root)
    ev.problems.extend(ev.log.problems)
    return ev


def _read_small(ev: Evidence) -> None:
    for name, attr in (("bitwise-validation.json", "bitwise_validation"),
                       ("manifest.json", "manifest")):
        path = ev.root / name
        if path.exists() or path.is_symlink():
            data = _read_json(path, ev.root, ev.problems)
            if isinstance(data, dict):
                setattr(ev, attr, data)
            elif data is not None:
                ev.problems.append(f"{name} is not a JSON object")
    if isinstance(ev.manifest, dict) and ev.manifest.get("run_id") is not None:
        ev.run_ids["manifest.json"] = str(ev.manifest["run_id"])
    code = ev.root / "exit-code"
    if code.exists() or code.is_symlink():
        try:
            ev.exit_code_file = read_bytes(code, ev.root, MAX_SMALL_BYTES).decode(
                "utf-8", "replace").strip()
        except Refused as exc:
            ev.problems.append(str(exc))
