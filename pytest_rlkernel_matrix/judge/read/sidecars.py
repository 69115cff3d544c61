"""Mismatch sidecars read the way RL-Kernel's own validator reads them (docs/artifact-format.md).

One file per rank and call, `rank{rank:05d}.call{call:08d}.pt`: a dict with `schema_version`
(`rlkernel.vime_rocm_attention_mismatch_sidecar.v1`; anything else refuses the file, the older
`schema` key included, as RL-Kernel's `compare_train_rollout_logps` refuses it), `rank`,
`call_index`, `tensor_parallel_size`, `context_parallel_size` and per-sample lists
`train_log_probs`, `rollout_log_probs`, `loss_masks`, `total_lengths`, `response_lengths`.
A sample whose train and rollout log-probs are stored in different dtypes is not compared (a
reason naming both), as upstream: values are never widened to compare
(tests/golden/upstream/sidecars: upstream's verdicts).

Ranks follow Megatron's order (tp-cp-dp): `cp_rank = (rank // tp) % cp`, `dp_rank = rank //
(tp * cp)`. TP ranks are replicas: every one is read and compared with the first copy (lowest
file) sample by sample, bytes of train, rollout, sliced mask and both lengths; the first copy
counts. CP ranks hold zigzag slices at logit positions: response offset `j` is logit position
`prompt - 1 + j`; CP rank `r` holds the logit positions of chunks `r` and `2cp-1-r` of
`ceil(total / 2cp)` positions, clipped to `[prompt - 1, total - 1)`, in that order. The full
loss mask is stored and sliced here the same way. Shards are placed back at their offsets, so a
token counts once and a missing shard leaves its positions inactive (and is a reason).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.judge.read.metrics import Sample

SIDECAR_SCHEMA = "rlkernel.vime_rocm_attention_mismatch_sidecar.v1"
LIST_FIELDS = ("train_log_probs", "rollout_log_probs", "loss_masks", "total_lengths",
               "response_lengths")


class SidecarError(ValueError):
    """A malformed sidecar, refused as a whole (the message names the key)."""


class SidecarRefused(SidecarError):
    """A sidecar of a schema this reader does not know (the message names the key)."""


Span = tuple[int, int, int]  # (position in the stored values, first response offset, end)


def response_offsets(total: int, response: int, cp: int, cp_rank: int) -> np.ndarray:
    """Response offsets `j` (logit position `total - response - 1 + j`) a CP rank holds, in the
    order its sidecar stores them (RL-Kernel's `slice_response_mask_for_cp`)."""
    got = [np.arange(lo, hi, dtype=np.int64) for _, lo, hi in response_spans(
        total, response, cp, cp_rank)]
    return np.concatenate(got) if got else np.zeros(0, dtype=np.int64)


@functools.lru_cache(maxsize=4096)
def response_spans(total: int, response: int, cp: int, cp_rank: int) -> tuple[Span, ...]:
    """`response_offsets` as runs of consecutive offsets, in stored order: (position in the
    stored values, first offset, end) each, every offset inside `[0, response)`. CP rank `r`
    holds the logit positions of chunks `r` and `2cp-1-r` of `ceil(total / 2cp)`, clipped to
    the response's logits `[total - response - 1, total - 1)`: at most two runs."""
    if cp == 1:
        return ((0, 0, response),)
    base = total - response - 1
    chunk = (total + 2 * cp - 1) // (2 * cp)
    spans, at = [], 0
    for c in (cp_rank, 2 * cp - cp_rank - 1):
        lo, hi = max(c * chunk, base) - base, min((c + 1) * chunk, total - 1) - base
        if lo < hi:
            spans.append((at, lo, hi))
            at += hi - lo
    return tuple(spans)


def _held(spans: tuple[Span, ...]) -> int:
    return spans[-1][0] + spans[-1][2] - spans[-1][1] if spans else 0


def schema_of(data: Mapping[str, Any]) -> str:
    """The sidecar's schema, or SidecarRefused naming the key. Only `schema_version` counts:
    RL-Kernel's validator refuses a sidecar without it (the older `schema` key included)."""
    if "schema_version" in data:
        value = data["schema_version"]
        if value != SIDECAR_SCHEMA:
            raise SidecarRefused(f"schema_version is {str(value)[:80]!r}, not "
                                 f"{SIDECAR_SCHEMA!r}")
        return str(value)
    if "schema" in data:
        raise SidecarRefused(f"no schema_version key (RL-Kernel's validator refuses the older "
                             f"key schema: {str(data['schema'])[:60]!r})")
    raise SidecarRefused(f"no schema_version key (expected {SIDECAR_SCHEMA!r})")


def _count(value: Any, what: str, minimum: int) -> int:
    if type(value) is int and value >= minimum:  # a plain int: what the checks below accept
        return value
    if ((hasattr(value, "numel") and value.numel() == 1)  # a tensor, or as numpy arrays
            or (isinstance(value, np.ndarray) and value.size == 1)):  # `ptread.load_arrays`
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        raise SidecarError(f"{what} is {str(value)[:80]!r}, not an integer")
    if value < minimum:
        raise SidecarError(f"{what} is {value}, below {minimum}")
    return value


def stored_dtype(value: Any) -> str:
    """The dtype a log-prob tensor was saved in (`bfloat16` for `ptread`'s widened arrays, which
    say so in their dtype's metadata; `float64` for a list, as it is read here)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return "float64"
    meta = getattr(dtype, "metadata", None)
    if meta and "torch" in meta:
        return str(meta["torch"])
    return str(dtype).removeprefix("torch.")


def float_array(value: Any, what: str) -> np.ndarray:
    """A 1-D tensor (or list) as numpy; bf16/fp16 widen to fp32 exactly."""
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype.kind in "fiub":
        return value  # as `ptread.load_arrays` gives a tensor: what the checks below accept
    if hasattr(value, "detach"):
        t = value.detach().cpu()
        if str(t.dtype) in ("torch.bfloat16", "torch.float16"):
            t = t.float()
        arr = t.numpy()
    elif isinstance(value, np.ndarray):  # a tensor as `ptread.load_arrays` gives it (no
        arr = value  # float16 there; bfloat16 already widened to float32)
    elif isinstance(value, (list, tuple)):
        arr = np.asarray(value, dtype=np.float64)
    else:
        raise SidecarError(f"{what} is {type(value).__name__}, not a tensor")
    if arr.ndim != 1:
        raise SidecarError(f"{what} is a {arr.ndim}-d tensor, expected 1-d")
    if arr.dtype.kind not in "fiub":
        raise SidecarError(f"{what} has dtype {arr.dtype}, expected a float tensor")
    return arr


@dataclass
class Shard:
    """One sample's slice held by one rank: active values already sliced to its positions."""

    file: str
    rank: int
    call: int
    dp: int
    index: int
    cp_rank: int
    cp: int
    total: int
    response: int
    train: np.ndarray
    rollout: np.ndarray
    mask: np.ndarray  # bool, sliced to this shard's positions
    spans: tuple[Span, ...]  # where the stored values lie in the response (`response_spans`)
    dtypes: tuple[str, str] = ("", "")  # train's and rollout's stored dtypes (`stored_dtype`)

    @property
    def offsets(self) -> np.ndarray:
        """The response offset of each stored value."""
        return response_offsets(self.total, self.response, self.cp, self.cp_rank)

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.dp, self.call, self.index, self.cp_rank)

    def same_as(self, other: Shard) -> list[str]:
        """Fields in which this replica's bytes differ from `other`."""
        a, b = self, other
        if (a.total == b.total and a.response == b.response and a.train.dtype == b.train.dtype
                and a.rollout.dtype == b.rollout.dtype and a.mask.dtype == b.mask.dtype
                and a.train.shape == b.train.shape and a.rollout.shape == b.rollout.shape
                and a.mask.shape == b.mask.shape and a.dtypes == b.dtypes
                and a.train.tobytes() == b.train.tobytes()
                and a.rollout.tobytes() == b.rollout.tobytes()
                and a.mask.tobytes() == b.mask.tobytes()):
            return []  # (the common case, every field compared below at once)
        out = [name for name, a, b, i in (("train_log_probs", self.train, other.train, 0),
                                          ("rollout_log_probs", self.rollout, other.rollout, 1),
                                          ("loss_masks", self.mask, other.mask, None))
               if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes()
               or (i is not None and self.dtypes[i] != other.dtypes[i])]
        out += [name for name, a, b in (("total_lengths", self.total, other.total),
                                        ("response_lengths", self.response, other.response))
                if a != b]
        return out


@dataclass
class SidecarInfo:
    rank: int = 0
    call: int = 0
    tp: int = 1
    cp: int = 1
    samples: int = 0
    schema: str = ""


def read_sidecar(data: Any, file: str) -> tuple[SidecarInfo, list[Shard]]:
    """The shards of one loaded sidecar; SidecarError (a ValueError) refuses the whole file."""
    if not isinstance(data, Mapping):
        raise SidecarError("not a mapping")
    info = SidecarInfo(schema=schema_of(data))
    lists = {k: data.get(k) for k in LIST_FIELDS}
    missing = [k for k, v in lists.items() if not isinstance(v, (list, tuple))]
    if missing:
        shown = ", ".join(f"{k} is {type(lists[k]).__name__}, not a list" for k in missing)
        raise SidecarError(f"lacks list fields: {shown}")
    counts = {k: len(v) for k, v in lists.items()}  # type: ignore[arg-type]
    if len(set(counts.values())) > 1:
        raise SidecarError(f"sample lists have different lengths: {counts}")
    info.rank = _count(data.get("rank"), "rank", 0)
    info.call = _count(data.get("call_index"), "call_index", 0)
    info.tp = _count(data.get("tensor_parallel_size"), "tensor_parallel_size", 1)
    info.cp = _count(data.get("context_parallel_size"), "context_parallel_size", 1)
    info.samples = counts["train_log_probs"]
    cp_rank = (info.rank // info.tp) % info.cp
    dp = info.rank // (info.tp * info.cp)
    shards = []
    totals, resps, masks, trains, rolls = (lists[k] for k in (
        "total_lengths", "response_lengths", "loss_masks", "train_log_probs",
        "rollout_log_probs"))
    for i in range(info.samples):
        # (each value taken as is where it is what `_count` / `float_array` accept at once)
        total, resp = totals[i], resps[i]  # type: ignore[index]
        if not (type(total) is int and total >= 1):
            total = _count(total, f"total_lengths[{i}]", 1)
        if not (type(resp) is int and resp >= 1):
            resp = _count(resp, f"response_lengths[{i}]", 1)
        if resp > total:
            raise SidecarError(f"sample {i}: response_lengths {resp} > total_lengths {total}")
        full = masks[i]  # type: ignore[index]
        if not (type(full) is np.ndarray and full.ndim == 1 and full.dtype.kind in "fiub"):
            full = float_array(full, f"loss_masks[{i}]")
        if full.size != resp:
            raise SidecarError(f"sample {i}: full loss mask holds {full.size} values, "
                               f"response_lengths is {resp}")
        spans = response_spans(total, resp, info.cp, cp_rank)
        train, roll = trains[i], rolls[i]  # type: ignore[index]
        dtypes = (stored_dtype(train), stored_dtype(roll))
        if not (type(train) is np.ndarray and train.ndim == 1 and train.dtype.kind in "fiub"):
            train = float_array(train, f"train_log_probs[{i}]")
        if not (type(roll) is np.ndarray and roll.ndim == 1 and roll.dtype.kind in "fiub"):
            roll = float_array(roll, f"rollout_log_probs[{i}]")
        shards.append(Shard(
            file=file, rank=info.rank, call=info.call, dp=dp, index=i, cp_rank=cp_rank, cp=info.cp,
            total=total, response=resp, train=train, rollout=roll,  # (mask sliced, then cast)
            mask=_slice(full, spans).astype(bool), spans=spans, dtypes=dtypes))
    return info, shards


def _slice(full: np.ndarray, spans: tuple[Span, ...]) -> np.ndarray:
    """`full[response_offsets(...)]`: the values at the spans' offsets, in stored order."""
    if len(spans) == 1:
        return full[spans[0][1]:spans[0][2]]
    return np.concatenate([full[lo:hi] for _, lo, hi in spans]) if spans else full[:0]


@dataclass
class Merged:
    """Samples (one per DP rank, call, sample index) and the parts RL-Kernel's figures sum."""

    samples: list[Sample] = field(default_factory=list)
    parts: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    part_calls: list[int] = field(default_factory=list)  # each part's call index
    problems: list[str] = field(default_factory=list)


def merge(shards: Sequence[Shard]) -> Merged:
    """Replicas compared, CP shards placed at their offsets; never raises for bad data: each
    inconsistency is a problem naming rank, call and sample."""
    out = Merged()
    first: dict[tuple[int, int, int, int], Shard] = {}
    for sh in shards:  # file order: the lowest rank of a TP group is the copy that counts
        prev = first.get(sh.key)
        if prev is None:
            first[sh.key] = sh
            continue
        differ = sh.same_as(prev)
        if differ:
            out.problems.append(
                f"TP replica rank {sh.rank} disagrees with rank {prev.rank} on call {sh.call}, "
                f"sample {sh.index} (DP rank {sh.dp}, CP rank {sh.cp_rank}): "
                f"{', '.join(differ)} differ ({sh.file} vs {prev.file})")
    groups: dict[tuple[int, int, int], list[Shard]] = {}
    for sh in first.values():
        if sh.dtypes[0] != sh.dtypes[1]:  # not comparable: never widened (as RL-Kernel)
            out.problems.append(
                f"call {sh.call}, sample {sh.index} (rank {sh.rank}): train/rollout dtype "
                f"mismatch: train_log_probs {sh.dtypes[0]}, rollout_log_probs {sh.dtypes[1]} "
                f"(not compared; {sh.file})")
            continue
        held = _held(sh.spans)
        if sh.train.size != sh.rollout.size or sh.train.size != held:
            out.problems.append(
                f"call {sh.call}, sample {sh.index} (rank {sh.rank}): lengths differ (train "
                f"{sh.train.size}, rollout {sh.rollout.size}, the CP slice of the mask "
                f"{held} for total {sh.total} / response {sh.response})")
            continue
        groups.setdefault((sh.dp, sh.call, sh.index), []).append(sh)
        out.parts.append((sh.train[sh.mask], sh.rollout[sh.mask]))
        out.part_calls.append(sh.call)
    for (dp, call, index), parts in sorted(groups.items()):
        cp = max(p.cp for p in parts)
        got = sorted({p.cp_rank for p in parts})
        lost = [r for r in range(cp) if r not in got]
        if lost:
            out.problems.append(
                f"call {call}, sample {index} (DP rank {dp}): missing CP shard(s) from cp "
                f"rank(s) {lost} (got {got} of 0..{cp - 1})")
        if len({(p.total, p.response) for p in parts}) > 1:
            out.problems.append(f"call {call}, sample {index} (DP rank {dp}): CP shards "
                                "disagree on total/response lengths")
            continue
        n = parts[0].response
        dtype = np.result_type(*(p.train.dtype for p in parts))
        rdtype = np.result_type(*(p.rollout.dtype for p in parts))
        train, roll = np.zeros(n, dtype=dtype), np.zeros(n, dtype=rdtype)
        mask = np.zeros(n, dtype=bool)
        for p in parts:  # each run of consecutive offsets as one slice (`out[offsets] = values`)
            for at, lo, hi in p.spans:
                end = at + hi - lo
                train[lo:hi], roll[lo:hi], mask[lo:hi] = (p.train[at:end], p.rollout[at:end],
                                                          p.mask[at:end])
        out.samples.append(Sample(train=train, rollout=roll, mask=mask, rank=parts[0].rank,
                                  sample=index, call=call))
    return out
