"""Read what a run left on disk (RL-Kernel + vime layout, see docs/artifact-format.md).

Readers are tolerant of version differences: unknown keys are ignored, missing or unreadable
artifacts become `problems` (reasons), never exceptions. `.pt` files are loaded with
`torch.load(weights_only=True)`; torch is imported only here, only when a `.pt` file exists.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.logscan import LogScan, scan_log
from pytest_rlkernel_matrix.metrics import DriftMetrics, Sample, compute

SIDES = ("training", "rollout")
_TRAINING_NAMES = {"training", "train", "actor", "megatron", "fsdp", "trainer"}
_ROLLOUT_NAMES = {"rollout", "inference", "generation", "vllm", "sglang", "generator"}
SIDECAR_DIRS = ("mismatch-sidecars", "mismatch_sidecars")


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
    contract_versions: list[str] = field(default_factory=list)
    runtime_platforms: list[str] = field(default_factory=list)
    execution_modes: list[str] = field(default_factory=list)

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
    sample_problems: list[str] = field(default_factory=list)
    weight_versions: dict[str, dict[str, str]] = field(default_factory=dict)
    bitwise_validation: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None
    log: LogScan = field(default_factory=LogScan)
    problems: list[str] = field(default_factory=list)

    @property
    def sides_with_readbacks(self) -> set[str]:
        return {s for s in SIDES if self.routes[s]}


def _read_json(path: Path, problems: list[str]) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problems.append(f"unreadable {path.name}: {exc}")
        return None


def _add_unique(items: list[Any], value: Any) -> None:
    if value is not None and value not in items:
        items.append(value)


def _read_readbacks(ev: Evidence) -> None:
    for path in sorted((ev.root / "readbacks").glob("*.json")):
        data = _read_json(path, ev.problems)
        if not isinstance(data, dict):
            if data is not None:
                ev.problems.append(f"readback {path.name} is not a JSON object")
            continue
        ev.readback_files.append(path.name)
        fw, target = data.get("framework"), data.get("target")
        if fw is None and "-" in path.stem:
            fw, _, rest = path.stem.partition("-")
            target = rest.rsplit("-", 1)[0]
        side = side_of(str(fw), str(target))
        if side is None:
            ev.problems.append(f"readback {path.name}: cannot tell the side of {fw}/{target}")
            continue
        for fb in data.get("fallbacks") or []:
            if isinstance(fb, dict):
                ev.fallbacks.append({"side": side, "module": str(fb.get("module", "?")),
                                     "reason": str(fb.get("reason", "")), "source": path.name})
        cap = data.get("capability")
        decisions = data.get("capability_decisions")
        if isinstance(cap, dict) or decisions:
            cap = dict(cap) if isinstance(cap, dict) else {}
            if decisions and "capability_decisions" not in cap:
                cap["capability_decisions"] = decisions
            cap.setdefault("status", data.get("status", "unknown"))
            ev.capability.append({"side": side, "source": path.name, **cap})
        operators = data.get("operators") or {}
        if not isinstance(operators, dict):
            ev.problems.append(f"readback {path.name}: operators is not an object")
            continue
        for module, op in operators.items():
            if not isinstance(op, dict):
                continue
            route = ev.routes[side].setdefault(str(module), Route())
            route.processes += 1
            _add_unique(route.implementations, op.get("implementation"))
            _add_unique(route.backend_ids, op.get("backend_id"))
            _add_unique(route.case_ids, op.get("case_id"))
            _add_unique(route.execution_modes, op.get("execution_mode"))
            count = op.get("call_count")
            if isinstance(count, int):
                route.call_count += count
            prov = op.get("provenance") if isinstance(op.get("provenance"), dict) else {}
            if prov.get("fallback") is True:
                route.fallback = True
            execution = prov.get("execution") if isinstance(prov.get("execution"), dict) else {}
            _add_unique(route.runtime_platforms, execution.get("runtime_platform")
                        or prov.get("runtime_platform"))
            declared = prov.get("arithmetic_contract", op.get("arithmetic_contract"))
            _add_unique(route.contracts, declared)
            _add_unique(route.contract_versions, prov.get("contract_version")
                        or op.get("contract_id"))
            cap_op = prov.get("capability")
            if isinstance(cap_op, dict):
                ev.capability.append(
                    {"side": side, "module": module, "source": path.name, **cap_op}
                )


def _np(value: Any) -> np.ndarray:
    """A tensor (or list) as a numpy array; bf16/fp16 widen to fp32 exactly."""
    if hasattr(value, "detach"):
        t = value.detach().cpu()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        return t.numpy()
    return np.asarray(value)


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
                          slices: list[_CpSlice | None] | None = None) -> list[Sample]:
    train = data.get("train_log_probs")
    roll = data.get("rollout_log_probs")
    masks = data.get("loss_masks")
    if train is None or roll is None:
        problems.append(f"{name}: no train_log_probs/rollout_log_probs")
        return []
    rank = int(data.get("rank", 0) or 0)
    tp = int(data.get("tensor_parallel_size", 1) or 1)
    cp = int(data.get("context_parallel_size", 1) or 1)
    if tp > 1 and rank % tp != 0:
        return []  # duplicated across TP replicas: counted once, on TP rank 0
    cp_rank = (rank // tp) % cp
    totals = list(data.get("total_lengths") or [])
    responses = list(data.get("response_lengths") or [])
    tokens = data.get("tokens")
    indices = list(data.get("sample_indices") or [])
    out: list[Sample] = []
    if len(train) != len(roll):
        problems.append(f"{name}: {len(train)} train samples vs {len(roll)} rollout samples")
        return []
    for i, (t, r) in enumerate(zip(train, roll, strict=True)):
        ta, ra = _np(t).reshape(-1), _np(r).reshape(-1)
        ma = _np(masks[i]).reshape(-1) if masks is not None and i < len(masks) else None
        if ma is None:
            problems.append(f"{name}: sample {i} has no loss mask")
            continue
        keep = None
        if cp > 1 and i < len(totals) and i < len(responses):
            keep = _zigzag_keep(int(totals[i]), int(responses[i]), cp, cp_rank)
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
        tok = _np(tokens[i]).reshape(-1) if isinstance(tokens, list) and i < len(tokens) else None
        index = int(indices[i]) if i < len(indices) else len(out)
        out.append(Sample(train=ta, rollout=ra, mask=ma, rank=rank, tokens=tok, sample=index))
        if slices is not None:
            slices.append(None if keep is None or keep.sum() != ta.size else _CpSlice(
                (rank // (tp * cp), index), cp, cp_rank, keep))
    return out


def _load_pt(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        import torch
    except ImportError:
        problems.append(f"cannot read {path.name}: torch is not installed in the plugin's Python")
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad pickle
        problems.append(f"unreadable {path.name}: {type(exc).__name__}: {exc}")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path.name} is not a dict")
        return None
    return data


def _renumber(samples: Iterable[Sample]) -> list[Sample]:
    out = list(samples)
    if len({(s.rank, s.sample) for s in out}) != len(out):
        for i, s in enumerate(out):
            s.sample = i
    return out


def _read_logprobs(ev: Evidence) -> None:
    files: list[Path] = []
    for sub in SIDECAR_DIRS:
        files.extend(sorted((ev.root / sub).glob("*.pt")))
    samples: list[Sample] = []
    ranks: set[int] = set()
    if files:
        ev.logprob_source = "mismatch-sidecars"
        slices: list[_CpSlice | None] = []
        for path in files:
            data = _load_pt(path, ev.problems)
            if data is None:
                continue
            ev.sidecar_files.append(f"{path.parent.name}/{path.name}")
            _add_unique(ev.sidecar_schema, data.get("schema"))
            ranks.add(int(data.get("rank", 0) or 0))
            samples.extend(_samples_from_sidecar(data, path.name, ev.sample_problems, slices))
        if any(sl is not None for sl in slices):
            samples = _merge_cp(samples, slices, ev.sample_problems)
    else:
        dumps = sorted((ev.root / "train-data").glob("*.pt"))
        if dumps:
            ev.logprob_source = "train-data (unmasked)"
        for path in dumps:
            data = _load_pt(path, ev.problems)
            rd = data.get("rollout_data") if data else None
            if not isinstance(rd, dict):
                continue
            lp, rlp = rd.get("log_probs"), rd.get("rollout_log_probs")
            if lp is None or rlp is None:
                ev.sample_problems.append(f"{path.name}: lacks log_probs or rollout_log_probs")
                continue
            rank = int(data.get("rank", 0) or 0)
            for i, (t, r) in enumerate(zip(lp, rlp, strict=False)):
                ta, ra = _np(t).reshape(-1), _np(r).reshape(-1)
                if ta.size != ra.size:
                    ev.sample_problems.append(f"{path.name}: sample {i} lengths differ")
                    continue
                samples.append(Sample(ta, ra, np.ones(ta.size, dtype=bool), sample=i, rank=rank))
    if ev.logprob_source is not None:
        ev.metrics = compute(_renumber(samples))
        if ranks:  # ranks whose sidecars were read (TP replicas included)
            ev.metrics.rank_count = len(ranks)


def _read_weight_audit(ev: Evidence) -> None:
    for path in sorted((ev.root / "weight-audit").glob("*.json")):
        data = _read_json(path, ev.problems)
        if not isinstance(data, dict) or "sha256" not in data:
            ev.problems.append(f"weight-audit {path.name}: no sha256")
            continue
        version = str(data.get("weight_version", path.stem.split(".")[0]))
        who = "-".join(str(data[k]) for k in ("framework", "target") if k in data) or path.stem
        ev.weight_versions.setdefault(version, {})[who] = str(data["sha256"])


def read_evidence(root: Path) -> Evidence:
    """Read every artifact of one run directory."""
    ev = Evidence(root=root)
    _read_readbacks(ev)
    _read_logprobs(ev)
    _read_weight_audit(ev)
    for name, attr in (("bitwise-validation.json", "bitwise_validation"),
                       ("manifest.json", "manifest")):
        path = root / name
        if path.exists():
            data = _read_json(path, ev.problems)
            if isinstance(data, dict):
                setattr(ev, attr, data)
    ev.log = scan_log(root / "run.log")
    return ev
