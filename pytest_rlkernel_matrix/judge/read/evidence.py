"""Read what a run left on disk (RL-Kernel + vime layout, see docs/artifact-format.md).

Readers are tolerant of version differences: unknown keys are ignored, missing or unreadable
artifacts become `problems` (reasons), never exceptions. `.pt` files are read by
`judge.read.ptread.read_pt_dict` (the one `.pt` reader, with `torch.load(weights_only=True)`'s
semantics: torch's layout and values, else `torch.load(weights_only=True)`) over the bytes
read through `store.safeio`
(capped, regular files inside the run directory); torch is imported only when a `.pt` file
exists. Within `pt_memo()` (one cell's analysis) each `.pt` file is read once: the per-step
claims' reader (`judge.read.steps`) gets the same loaded object and the same problems as the
evidence did.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.judge.read import ptread
from pytest_rlkernel_matrix.judge.read.logscan import LogScan, scan_log
from pytest_rlkernel_matrix.judge.read.metrics import (
    DriftMetrics,
    PartSums,
    Sample,
    SampleCounts,
    compute,
    part_sums,
    sample_counts,
)
from pytest_rlkernel_matrix.judge.read.sidecars import (
    LIST_FIELDS,
    Merged,
    Shard,
    SidecarError,
    SidecarInfo,
    SidecarRefused,
    float_array,
    merge,
    read_sidecar,
)
from pytest_rlkernel_matrix.judge.read.upstream import WeightAudit, read_weight_audits, side_of
from pytest_rlkernel_matrix.store.safeio import (
    MAX_JSON_BYTES,
    MAX_PT_BYTES,
    MAX_SMALL_BYTES,
    Refused,
    listing,
    read_bytes,
)

SIDES = ("training", "rollout")
SIDECAR_DIRS = ("mismatch-sidecars", "mismatch_sidecars")
_SIDECAR_NAME_RE = re.compile(r"^rank(\d+)\.call(\d+)\.pt$")
_TRAIN_DATA_NAME_RE = re.compile(r"\.rank(\d+)\.pt$")


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
    weight_audit: WeightAudit = field(default_factory=WeightAudit)
    hooks: dict[str, dict[str, str]] = field(default_factory=lambda: {s: {} for s in SIDES})
    rank_files: list[dict[str, Any]] = field(default_factory=list)
    samples_per_rank: dict[int, int] = field(default_factory=dict)
    run_ids: dict[str, str] = field(default_factory=dict)
    exit_code_file: str | None = None
    bitwise_validation: dict[str, Any] | None = None
    manifest: dict[str, Any] | None = None
    log: LogScan = field(default_factory=LogScan)
    problems: list[str] = field(default_factory=list)
    debugger: list[dict[str, Any]] = field(default_factory=list)  # set by localise.debugger
    vime_audit: dict[str, Any] | None = None  # read.vime_audit (issue 45)
    vime_semantic: list[str] = field(default_factory=list)  # its semantic reasons
    samples: list[Sample] = field(default_factory=list)  # the merged samples (probe tokens)
    operator_records: list[dict[str, Any]] = field(default_factory=list)  # {side, module,
    runtime_policies: list[dict[str, Any]] = field(default_factory=list)  # source, record}
    contamination: dict[str, Any] | None = None  # contamination.json (None: missing/unreadable)
    reproducibility: Any = None  # read.steps.Reproducibility (read_reproducibility)

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
    hooks = data.get("installed_hooks") or {}
    if isinstance(hooks, dict):
        for module, hook in hooks.items():
            if isinstance(hook, str) and hook:
                ev.hooks[side].setdefault(str(module), hook)
    else:
        ev.problems.append(f"readback {path.name}: installed_hooks is not an object")
    version = data.get("weight_version")
    if side == "rollout" and isinstance(version, (str, int)) and not isinstance(version, bool):
        _add_unique(ev.weight_audit.rollout_readback_versions, str(version))
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
    if "runtime_policy" in data:  # a run's own backends, declared (judge/route/rules.py)
        ev.runtime_policies.append({"source": path.name, "policy": data["runtime_policy"]})
    operators = data.get("operators") or {}
    if not isinstance(operators, dict):
        ev.problems.append(f"readback {path.name}: operators is not an object")
        return
    for module, op in operators.items():
        if not isinstance(op, dict):
            ev.problems.append(f"readback {path.name}: operators.{module} is not an object")
            continue
        ev.operator_records.append({"side": side, "module": str(module), "source": path.name,
                                    "record": op})
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


_LOCAL = threading.local()  # .memo: {(path, root): (loaded, problems)} inside `pt_memo()`


@contextmanager
def pt_memo() -> Iterator[None]:
    """Read each `.pt` file once inside the block (one cell's analysis, in this thread)."""
    outer = getattr(_LOCAL, "memo", None)
    _LOCAL.memo = {}
    try:
        yield
    finally:
        _LOCAL.memo = outer


def _load_pt(path: Path, root: Path, problems: list[str], sidecar: bool = False,
             ) -> tuple[dict[str, Any], str] | None:
    """(dict, sha256 of the bytes) of one `.pt` file, or None with a problem recorded; inside
    `pt_memo()` read once (`sidecar`: by `_read_sidecar_file`, see `_load_sidecar`)."""
    memo = getattr(_LOCAL, "memo", None)
    if memo is None:
        return _read_pt_file(path, root, problems)
    key = (str(path), str(root))
    if key not in memo:
        said: list[str] = []
        memo[key] = (_read_sidecar_file(path, root, said, memo) if sidecar
                     else _read_pt_file(path, root, said), said)
    loaded, said = memo[key]
    problems.extend(said)
    return loaded


def _load_sidecar(path: Path, root: Path, problems: list[str],
                  ) -> tuple[dict[str, Any], str] | None:
    """`_load_pt` of a sidecar. Inside `pt_memo()` the fast path's numpy arrays are kept
    (`ptread.load_arrays`: no torch) where the file reads as a sidecar from them: arrays only
    as items of its sample lists, and `read_sidecar` accepts it (its outcome remembered).
    Those give `read_sidecar` and `float_array` the values torch's tensors give. Any other
    file is read again from the same bytes the torch way, so what is said about it (a
    refusal's wording included) is what the torch tensors make of it."""
    return _load_pt(path, root, problems, sidecar=True)


_SCALAR_TYPES = frozenset((int, float, str, bool, type(None)))
_ARRAY_TYPES = frozenset((np.ndarray,))


def _arrays_only_in_lists(data: dict[str, Any]) -> bool:
    for k, v in data.items():
        if type(v) in _SCALAR_TYPES:  # (holds no array)
            continue
        if k in LIST_FIELDS and type(v) in (list, tuple):
            kinds = set(map(type, v))
            if kinds <= _ARRAY_TYPES or kinds <= _SCALAR_TYPES:  # (what the test below passes)
                continue
            if not all(type(x) is np.ndarray or not _holds_array(x) for x in v):
                return False
        elif _holds_array(v):
            return False
    return True


def _holds_array(v: Any) -> bool:
    if isinstance(v, np.ndarray):
        return True
    if isinstance(v, dict):
        return any(_holds_array(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_array(x) for x in v)
    return False


def _read_sidecar_file(path: Path, root: Path, problems: list[str], memo: dict[Any, Any],
                       ) -> tuple[dict[str, Any], str] | None:
    try:
        raw = read_bytes(path, root, MAX_PT_BYTES)
    except Refused as exc:
        problems.append(str(exc))
        return None
    data = ptread.load_arrays(raw, path.name)
    if isinstance(data, dict) and _arrays_only_in_lists(data):
        try:
            done = read_sidecar(data, f"{path.parent.name}/{path.name}")
        except Exception:  # the torch way below says what is wrong, in its words
            pass
        else:
            memo[("sidecar", id(data))] = (data, done, None)
            memo[("raw", str(path), str(root))] = raw  # (its arrays are views of it anyway)
            return data, _provisional_digest(raw)
    data = ptread.pt_dict(raw, path.name, problems)
    return None if data is None else (data, hashlib.sha256(raw).hexdigest())


def _provisional_digest(raw: bytes) -> str:
    """A stand-in for a sidecar's sha256 (`_exact_digests`): equal for equal bytes (its size
    and the CRCs of its first and last 4 KiB: a torch file's data.pkl and its zip directory,
    with every record's CRC); never a sha256's hex digits (it starts with "~")."""
    view = memoryview(raw)
    return f"~{len(raw)}:{zlib.crc32(view[:4096]):08x}:{zlib.crc32(view[-4096:]):08x}"


def _exact_digests(ev: Evidence, pending: dict[str, list[tuple[dict[str, Any], Path]]]) -> None:
    """The rank files' sha256 where it is needed: the files that share a provisional digest
    (`_provisional_digest`) get their sha256, from the bytes read (kept in `pt_memo()`), or
    read again where they were not kept; every other file's stand-in is unique to it. So the
    files that share a `sha256` value are exactly the files whose sha256 is the same, as when
    every file's sha256 was taken (`verdict._judge_ranks`: byte-identical rank files)."""
    memo = getattr(_LOCAL, "memo", None) or {}
    for rows in pending.values():
        if len(rows) < 2:
            continue
        for row, path in rows:
            raw = memo.get(("raw", str(path), str(ev.root)))
            if raw is None:
                try:
                    raw = read_bytes(path, ev.root, MAX_PT_BYTES)
                except Refused as exc:
                    ev.problems.append(str(exc))
                    continue
            row["sha256"] = hashlib.sha256(raw).hexdigest()


def _read_sidecar_once(data: dict[str, Any], file: str) -> tuple[SidecarInfo, list[Shard]]:
    """`read_sidecar`, once per loaded object inside `pt_memo()` (its outcome, an exception
    included, is remembered with the object); the shards name `file`."""
    memo = getattr(_LOCAL, "memo", None)
    if memo is None:
        return read_sidecar(data, file)
    key = ("sidecar", id(data))
    if key not in memo:
        try:
            memo[key] = (data, read_sidecar(data, file), None)
        except Exception as exc:
            memo[key] = (data, None, exc)
    _, done, exc = memo[key]
    if exc is not None:
        raise exc
    info, shards = done
    return info, (shards if not shards or shards[0].file == file
                  else [dataclasses.replace(sh, file=file) for sh in shards])


def sidecar_shards(data: dict[str, Any], file: str) -> list[Shard]:
    """The shards of a loaded sidecar (`read_sidecar`), naming `file` (read once per analysis)."""
    return _read_sidecar_once(data, file)[1]


def _read_pt_file(path: Path, root: Path, problems: list[str],
                  ) -> tuple[dict[str, Any], str] | None:
    done = ptread.read_pt_dict(path, root, MAX_PT_BYTES, problems)
    return None if done is None else (done[0], hashlib.sha256(done[1]).hexdigest())


def _renumber(samples: Iterable[Sample]) -> list[Sample]:
    out = list(samples)
    if len({(s.call, s.rank, s.sample) for s in out}) != len(out):
        for i, s in enumerate(out):
            s.sample = i
    return out


def _read_sidecar(ev: Evidence, path: Path, shards: list[Shard],
                  pending: dict[str, list[tuple[dict[str, Any], Path]]]) -> None:
    """One sidecar's shards into `shards` and its row into `ev.rank_files`; a row whose
    `sha256` is a stand-in (`_provisional_digest`) is listed in `pending` by it."""
    loaded = _load_sidecar(path, ev.root, ev.problems)
    if loaded is None:
        return
    data, digest = loaded
    rel = f"{path.parent.name}/{path.name}"
    try:
        info, found = _read_sidecar_once(data, rel)
    except (ValueError, TypeError, IndexError, RecursionError, OverflowError, MemoryError,
            RuntimeError) as exc:
        what = "refused" if isinstance(exc, SidecarRefused) else "malformed"
        kind = "" if isinstance(exc, SidecarError) else f"{type(exc).__name__}: "
        ev.problems.append(f"sidecar {rel}: {what}: {kind}{str(exc)[:200]}")
        return
    ev.sidecar_files.append(rel)
    _add_unique(ev.sidecar_schema, info.schema)
    if data.get("run_id") is not None:
        ev.run_ids[rel] = str(data.get("run_id"))
    m = _SIDECAR_NAME_RE.match(path.name)
    row = {"file": rel, "sha256": digest, "rank": info.rank, "tp": info.tp, "cp": info.cp,
           "call": info.call, "samples": info.samples,
           "name_rank": int(m.group(1)) if m else None,
           "name_call": int(m.group(2)) if m else None}
    ev.rank_files.append(row)
    if digest.startswith("~"):
        pending.setdefault(digest, []).append((row, path))
    ev.samples_per_rank[info.rank] = ev.samples_per_rank.get(info.rank, 0) + info.samples
    shards.extend(found)


def _read_train_data(ev: Evidence, path: Path, samples: list[Sample],
                     masked: list[bool]) -> None:
    """One train-data dump's samples; `masked` gets whether it carried `loss_masks` (vime's
    active tokens, `save_debug_train_data`) or not (every token counts)."""
    loaded = _load_pt(path, ev.root, ev.problems)
    if loaded is None:
        return
    data, digest = loaded
    rel = f"train-data/{path.name}"
    rd = data.get("rollout_data")
    if not isinstance(rd, dict):
        ev.problems.append(f"{rel}: rollout_data is not a dict")
        return
    # vime's own reader takes `log_probs`, else `train_log_probs` (its drift loader)
    lp = rd.get("log_probs") if rd.get("log_probs") is not None else rd.get("train_log_probs")
    rlp, masks = rd.get("rollout_log_probs"), rd.get("loss_masks")
    if lp is None or rlp is None:
        ev.sample_problems.append(f"{path.name}: lacks log_probs or rollout_log_probs")
        return
    masked.append(masks is not None)
    try:
        rank = _int(data.get("rank"), "rank", default=0)
        lp, rlp = _seq(lp, "log_probs"), _seq(rlp, "rollout_log_probs")
        ms = None if masks is None else _seq(masks, "loss_masks")
        found: list[Sample] = []
        for i, (t, r) in enumerate(zip(lp, rlp, strict=False)):
            ta, ra = float_array(t, f"log_probs[{i}]"), float_array(r, f"rollout_log_probs[{i}]")
            if ta.size != ra.size:
                ev.sample_problems.append(f"{path.name}: sample {i} lengths differ")
                continue
            if ms is None:  # RL-Kernel's CUDA dump: no mask there, every token counts
                mask = np.ones(ta.size, dtype=bool)
            elif i >= len(ms):
                continue  # (the sample count mismatch is said once, below)
            else:  # vime's active tokens: `loss_masks[i].to(torch.bool)` (non-zero, NaN too)
                mask = float_array(ms[i], f"loss_masks[{i}]") != 0
                if mask.size != ta.size:
                    ev.sample_problems.append(
                        f"{path.name}: sample {i} has {ta.size} log_probs but {mask.size} "
                        "loss_masks (vime: shape_mismatch, sample skipped)")
                    continue
            found.append(Sample(ta, ra, mask, sample=i, rank=rank))
        if ms is not None and len(ms) != len(lp):
            ev.sample_problems.append(f"{path.name}: {len(lp)} log_probs vs {len(ms)} loss_masks "
                                      "samples (vime: sample_count_mismatch)")
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


@dataclass
class StepInputs:
    """What the per-step series (`judge.read.steps`) needs of a cell whose sidecars read
    cleanly,
    from the cell's own merge: per call, its samples' `sample_counts` and its parts'
    `part_sums` in the order a merge of that call's sidecars alone sums them."""

    files: set[str]
    calls: list[int]
    samples: dict[int, list[SampleCounts]]
    sums: dict[int, list[PartSums]]


def _keep_for_steps(ev: Evidence, files: list[Path], merged: Merged,
                    sums: list[PartSums], counts: list[SampleCounts] | None = None) -> None:
    """Inside `pt_memo()`, keep the cell's merge for the per-step series where a merge per
    call (what `steps.read_steps` does) gives the same samples and parts: every sidecar read,
    no merge problem, names `rank<r>.call<c>.pt` agreeing with the contents, one file per
    (call, rank), each call's files listed in rank order, one CP size (CP shards disjoint)
    and one train and one rollout dtype (a call's dtypes are the cell's). Else nothing is
    kept and the steps merge call by call. `counts`: the samples' `sample_counts`, when
    already made."""
    memo = getattr(_LOCAL, "memo", None)
    rows = ev.rank_files
    if memo is None or merged.problems or len(rows) != len(files):
        return
    if any(r["name_call"] is None or r["name_call"] != r["call"] for r in rows):
        return
    if len({(r["name_call"], r["name_rank"]) for r in rows}) != len(rows):
        return
    if len({r["cp"] for r in rows}) != 1:
        return
    last: dict[int, int] = {}
    for r in rows:
        if last.get(r["call"], -1) >= r["name_rank"]:
            return
        last[r["call"]] = r["name_rank"]
    if (len({s.train.dtype for s in merged.samples}) > 1
            or len({s.rollout.dtype for s in merged.samples}) > 1):
        return
    keep = StepInputs({str(p) for p in files}, sorted(last), {}, {})
    if counts is None or len(counts) != len(merged.samples):
        counts = sample_counts(merged.samples)
    for sample, count in zip(merged.samples, counts, strict=True):
        keep.samples.setdefault(sample.call, []).append(count)
    for call, part in zip(merged.part_calls, sums, strict=True):
        keep.sums.setdefault(call, []).append(part)
    memo[("steps", str(ev.root))] = keep


def parsed_audits(root: Path) -> dict[str, Any]:
    """{path: JSON value} of the weight audits this analysis read under `root` (`_load`)."""
    memo = getattr(_LOCAL, "memo", None)
    return (None if memo is None else memo.get(("audits", str(root)))) or {}


def step_inputs(root: Path, files: Iterable[Path]) -> StepInputs | None:
    """The `StepInputs` this analysis kept for `root`, if its sidecars are `files`."""
    memo = getattr(_LOCAL, "memo", None)
    keep = None if memo is None else memo.get(("steps", str(root)))
    return keep if keep is not None and keep.files == {str(p) for p in files} else None


def _read_logprobs(ev: Evidence) -> None:
    said = len(ev.problems)
    files: list[Path] = []
    for sub in SIDECAR_DIRS:
        files.extend(listing(ev.root / sub, "*.pt", ev.root, ev.problems))
    samples: list[Sample] = []
    ranks: set[int] = set()
    parts: list[tuple[np.ndarray, np.ndarray]] | None = None
    merged: Merged | None = None
    if files:
        ev.logprob_source = "mismatch-sidecars"
        shards: list[Shard] = []
        pending: dict[str, list[tuple[dict[str, Any], Path]]] = {}
        for path in files:
            _read_sidecar(ev, path, shards, pending)
        _exact_digests(ev, pending)
        merged = merge(shards)
        samples, parts = merged.samples, merged.parts
        ev.sample_problems.extend(merged.problems)
    else:
        dumps = listing(ev.root / "train-data", "*.pt", ev.root, ev.problems)
        masked: list[bool] = []
        for path in dumps:
            _read_train_data(ev, path, samples, masked)
        if dumps:  # vime's debug dumps carry loss_masks; RL-Kernel's CUDA dumps do not
            ev.logprob_source = ("train-data (loss_masks)" if masked and all(masked) else
                                 "train-data (unmasked)" if not any(masked) else
                                 "train-data (loss_masks in some dumps only)")
            if masked and any(masked) and not all(masked):
                ev.sample_problems.append("train-data: some dumps carry loss_masks and some do "
                                          "not: their active tokens are not one convention")
    if ev.logprob_source is not None:
        try:
            ev.samples = _renumber(samples)
            sums = None if parts is None else part_sums(parts)
            counts: list[SampleCounts] = []  # the same samples as merged.samples, in order
            ev.metrics = compute(ev.samples, parts, sums=sums, counts=counts)
            if merged is not None and sums is not None and len(ev.problems) == said:
                _keep_for_steps(ev, files, merged, sums, counts)
        except (ValueError, TypeError, MemoryError) as exc:
            ev.problems.append(f"logprob metrics: {type(exc).__name__}: {str(exc)[:200]}")
        if ev.metrics is not None:  # ranks whose sidecars were read (TP replicas included)
            ranks = {int(f["rank"]) for f in ev.rank_files if isinstance(f.get("rank"), int)}
            if ranks:
                ev.metrics.rank_count = len(ranks)


def _read_weight_audit(ev: Evidence) -> None:
    from_readbacks = ev.weight_audit.rollout_readback_versions
    memo = getattr(_LOCAL, "memo", None)
    keep: dict[str, Any] | None = None if memo is None else {}
    ev.weight_audit = read_weight_audits(ev.root, ev.problems, keep)
    if memo is not None:  # the per-step weight chain reads the same files: parsed once
        memo[("audits", str(ev.root))] = keep
    ev.weight_audit.rollout_readback_versions = from_readbacks
    for version, sha in ev.weight_audit.training.items():
        ev.weight_versions.setdefault(version, {})["training"] = sha
    for version, sha in ev.weight_audit.rollout.items():
        ev.weight_versions.setdefault(version, {})["rollout"] = sha


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
    from pytest_rlkernel_matrix.judge.read.vime_audit import read_vime  # (issue 45)

    read_vime(ev, _load_pt)
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
    try:  # the run's contamination measurement (run/contamination.py); judged by performance
        data = json.loads(read_bytes(ev.root / "contamination.json", ev.root, MAX_JSON_BYTES))
        ev.contamination = data if isinstance(data, dict) else None
    except (Refused, OSError, ValueError, RecursionError):
        ev.contamination = None
    code = ev.root / "exit-code"
    if code.exists() or code.is_symlink():
        try:
            ev.exit_code_file = read_bytes(code, ev.root, MAX_SMALL_BYTES).decode(
                "utf-8", "replace").strip()
        except Refused as exc:
            ev.problems.append(str(exc))
