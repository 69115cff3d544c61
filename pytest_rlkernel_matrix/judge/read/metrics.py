"""Active-token logprob drift metrics, vectorised with numpy, in RL-Kernel's conventions.

Per active token (loss mask = 1): `delta = train - rollout`, in float64 (RL-Kernel's
`compare_train_rollout_logps`). `mismatch_count` uses `!=` (so -0.0 equals +0.0, and NaN never
equals anything); `bitwise_mismatch_count` compares the raw bytes (+0.0 vs -0.0 and NaN payloads
count). The figures are pooled over every active token of every sample/shard (token-weighted),
summed part by part in RL-Kernel's order (one float64 sum per part, accumulated in a Python float,
divided by the token count):

- `mismatch_kl` = mean(rollout - train) = mean(-delta) (k1; its sign carries no meaning),
- `mismatch_k3_kl` = mean(exp(delta) - delta - 1) (k3, >= 0),
- `train_rollout_logprob_abs_diff` = mean |delta| (also `logprob_abs_diff_mean`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
WORST_TOKENS = 10
FIRST_MISMATCH_LISTED = 32


@dataclass
class Sample:
    """One sample's response logprobs from both sides, already masked-aligned."""

    train: np.ndarray
    rollout: np.ndarray
    mask: np.ndarray
    sample: int
    rank: int = 0
    tokens: np.ndarray | None = None
    call: int = 0


@dataclass
class DriftMetrics:
    """What the report carries about train/rollout logprob drift."""

    active_token_count: int = 0
    sample_count: int = 0
    rank_count: int = 0
    logprob_abs_diff_mean: float | None = None
    logprob_abs_diff_max: float | None = None
    logprob_abs_diff_p50: float | None = None
    logprob_abs_diff_p90: float | None = None
    logprob_abs_diff_p99: float | None = None
    mismatch_count: int = 0
    bitwise_mismatch_count: int = 0
    mismatch_fraction: float | None = None
    mismatch_kl: float | None = None
    mismatch_k3_kl: float | None = None
    train_rollout_logprob_abs_diff: float | None = None
    nonfinite_count: int = 0
    positive_logprob_count: int = 0  # finite logprobs above 0: impossible (log p <= 0)
    worst_tokens: list[dict[str, object]] = field(default_factory=list)
    first_mismatch: list[dict[str, int]] = field(default_factory=list)
    first_mismatch_summary: dict[str, float | int] = field(default_factory=dict)
    histogram: dict[str, list[float]] = field(default_factory=dict)
    loss_impact: dict[str, object] = field(default_factory=dict)  # judge.read.loss

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _delta(train: np.ndarray, roll: np.ndarray) -> np.ndarray:
    """train - rollout in float64: `train.astype(float64) - roll.astype(float64)`, for float
    inputs as one subtraction that widens them (exact: the same values, no temporaries)."""
    if train.dtype.kind == "f" and roll.dtype.kind == "f" and max(
            train.dtype.itemsize, roll.dtype.itemsize) <= 8:
        return np.subtract(train, roll, dtype=np.float64)
    return train.astype(np.float64) - roll.astype(np.float64)


def _bits(a: np.ndarray) -> np.ndarray:
    width = a.dtype.itemsize
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}.get(width, np.uint8))


FIGURE_CONVENTION = ("RL-Kernel: delta = train - rollout (float64); mismatch_kl = "
                     "mean(rollout - train); mismatch_k3_kl = mean(exp(delta) - delta - 1); "
                     "train_rollout_logprob_abs_diff = mean |delta|; pooled over active tokens")


PartSums = tuple[int, float, float, float] | None


def part_sums(parts: Iterable[tuple[np.ndarray, np.ndarray]]) -> list[PartSums]:
    """Per part, in order: (tokens, float64 sums of |delta|, -delta and k3), each sum one numpy
    sum over the part, as RL-Kernel adds them; None for a part with a non-finite delta or k3.

    Parts of one train dtype and one rollout dtype, 1-d and of equal sizes (a merge's), are
    taken a batch at a time: delta, |delta|, -delta and k3 made once over the batch's
    concatenation, elementwise the values each part's own arrays give, and each part's sums
    taken over its own contiguous slice of them (the same values, the same numpy sum)."""
    parts = list(parts)
    if len(parts) < 2 or not _uniform(parts):
        return _part_sums_each(parts)
    out: list[PartSums] = []
    start = 0
    while start < len(parts):
        stop, size = start, 0
        while stop < len(parts) and (stop == start or size + parts[stop][0].size <= _BATCH):
            size += parts[stop][0].size
            stop += 1
        out.extend(_part_sums_batch(parts[start:stop]))
        start = stop
    return out


_BATCH = 1 << 18  # values per batch: bounded temporaries, few numpy calls per part


def _uniform(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> bool:
    t0, r0 = parts[0][0].dtype, parts[0][1].dtype
    return all(type(t) is np.ndarray and type(r) is np.ndarray and t.dtype == t0
               and r.dtype == r0 and t.ndim == 1 and r.ndim == 1 and t.size == r.size
               for t, r in parts)


def _part_sums_batch(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[PartSums]:
    lengths = [t.size for t, _ in parts]
    delta = _delta(np.concatenate([t for t, _ in parts]), np.concatenate([r for _, r in parts]))
    with np.errstate(over="ignore", invalid="ignore"):
        k3 = np.exp(delta) - delta - 1.0
    nonfinite = ~(np.isfinite(delta) & np.isfinite(k3))
    bad: set[int] = set()
    if nonfinite.any():  # the parts holding them: the first whose end is past each
        ends = np.cumsum(np.array(lengths, dtype=np.int64))
        bad = set(np.searchsorted(ends, np.flatnonzero(nonfinite), side="right").tolist())
    absd, negd = np.abs(delta), -delta
    out: list[PartSums] = []
    at = 0
    for i, n in enumerate(lengths):
        end = at + n
        if n == 0:
            out.append((0, 0.0, 0.0, 0.0))
        elif i in bad:
            out.append(None)
        else:
            out.append((n, float(absd[at:end].sum()), float(negd[at:end].sum()),
                        float(k3[at:end].sum())))
        at = end
    return out


def _part_sums_each(parts: Iterable[tuple[np.ndarray, np.ndarray]]) -> list[PartSums]:
    """`part_sums`, one part at a time (any parts)."""
    out: list[PartSums] = []
    for train, roll in parts:
        if train.size == 0:
            out.append((0, 0.0, 0.0, 0.0))
            continue
        delta = _delta(train, roll)
        with np.errstate(over="ignore", invalid="ignore"):
            k3 = np.exp(delta) - delta - 1.0
        if not (np.isfinite(delta).all() and np.isfinite(k3).all()):
            out.append(None)
            continue
        out.append((int(delta.size), float(np.abs(delta).sum()), float((-delta).sum()),
                    float(k3.sum())))
    return out


def pooled_from_sums(sums: Iterable[PartSums]) -> tuple[int, float, float, float] | None:
    """`pooled_figures` from the parts' `part_sums` (each part's sums added to a Python float
    in the order given): the same figures, so parts summed once serve several poolings."""
    n, s_abs, s_kl, s_k3 = 0, 0.0, 0.0, 0.0
    for part in sums:
        if part is None:
            return None
        if part[0] == 0:
            continue
        n += part[0]
        s_abs += part[1]
        s_kl += part[2]
        s_k3 += part[3]
    if n == 0:
        return None
    return n, s_abs / n, s_kl / n, s_k3 / n


def pooled_figures(parts: Iterable[tuple[np.ndarray, np.ndarray]],
                   ) -> tuple[int, float, float, float] | None:
    """(tokens, mean |delta|, mismatch_kl, k3) over `parts` of active (train, rollout) values,
    accumulated as RL-Kernel does: per part a float64 sum, added to a Python float, in the order
    given. None without tokens or when any value is non-finite."""
    return pooled_from_sums(part_sums(parts))


SampleCounts = tuple[int, int, int, int, float | None]


def sample_counts(samples: Sequence[Sample]) -> list[SampleCounts]:
    """Per sample: (active tokens, value mismatches, byte mismatches, non-finite deltas, max
    finite |delta| or None), counted as `compute` counts them over the active tokens (byte
    mismatches: every token where train and rollout dtypes differ), so the counts of a set
    of samples add up to what `compute` gives for it (`compute(..., counts=[])` gives both)."""
    if not samples:
        return []
    _, _, train, roll, lengths = _active(samples)
    neq = train != roll
    bits = (_bits(train) != _bits(roll) if train.dtype == roll.dtype
            else np.ones(train.size, dtype=bool))
    d = _delta(train, roll)
    return _counts(lengths, neq, bits, d, np.isfinite(d))


def _active(samples: Sequence[Sample],
            ) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(each sample's mask as bool, all of them concatenated, the active train values of all
    samples in order, the active rollout values, each sample's active count): `s.train[mask]`
    concatenated, taken as one indexing where every sample's arrays are 1-d of one size."""
    active = [s.mask if s.mask.dtype == np.bool_ else s.mask.astype(bool) for s in samples]
    lengths = np.array([int(np.count_nonzero(m)) for m in active], dtype=np.int64)
    every = active[0].ravel() if len(active) == 1 else np.concatenate([m.ravel() for m in active])
    if all(s.train.ndim == 1 and s.train.shape == s.rollout.shape == m.shape
           for s, m in zip(samples, active, strict=True)):
        train = np.concatenate([s.train for s in samples])[every]
        roll = np.concatenate([s.rollout for s in samples])[every]
    else:  # (numpy's own errors for arrays that do not fit their masks)
        train = np.concatenate([s.train[m] for s, m in zip(samples, active, strict=True)])
        roll = np.concatenate([s.rollout[m] for s, m in zip(samples, active, strict=True)])
    return active, every, train, roll, lengths


def _counts(lengths: np.ndarray, neq: np.ndarray, bits: np.ndarray, d: np.ndarray,
            finite: np.ndarray, absd: np.ndarray | None = None) -> list[SampleCounts]:
    """`sample_counts` from the samples' active lengths and the flags over their active tokens
    (integer counts per sample: exact in any order of addition); `absd`: |d|, given when every
    d is finite."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    some = lengths > 0
    first = starts[some]

    def per_sample(flags: np.ndarray) -> list[int]:
        total = np.zeros(lengths.size, dtype=np.int64)
        if first.size:
            total[some] = np.add.reduceat(flags, first, dtype=np.int64)
        return total.tolist()

    top = np.full(lengths.size, -1.0)
    if first.size:
        top[some] = np.maximum.reduceat(
            np.where(finite, np.abs(d), -1.0) if absd is None else absd, first)
    return [(n, v, b, n - f, None if t < 0 else t) for n, v, b, f, t in zip(
        lengths.tolist(), per_sample(neq), per_sample(bits), per_sample(finite), top.tolist(),
        strict=True)]


def bitwise_reason(m: DriftMetrics) -> str | None:
    """Why a bitwise contract fails on `m`, naming which count failed (value `!=` or bytes),
    or None when both are zero."""
    n, v, b = m.active_token_count, m.mismatch_count, m.bitwise_mismatch_count
    if not (v or b):
        return None
    top = f"max |dlogp| {m.logprob_abs_diff_max or 0:.3g}"
    if v == 0:
        return (f"{b} of {n} active tokens differ in bytes (0 by value: +0.0/-0.0"
                f"{'' if b == 1 else ' pairs'} or a dtype change; {top})")
    return f"{v} of {n} active tokens differ by value, {b} in bytes ({top})"


def compute(samples: Sequence[Sample],
            parts: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
            *, summary_only: bool = False, sums: Sequence[PartSums] | None = None,
            counts: list[SampleCounts] | None = None) -> DriftMetrics:
    """Metrics over the active tokens of all samples. `parts`: the active (train, rollout)
    values in the order RL-Kernel sums them (its shards), for the pooled figures; default: per
    sample, in the order given; `sums`: those parts' `part_sums`, when already made.
    `summary_only` (the per-step series): the same counts, max and pooled figures, without
    percentiles, histogram, worst tokens and first mismatches. `counts`: a list extended with
    the samples' `sample_counts`, from the same arrays."""
    out = DriftMetrics(sample_count=len(samples), rank_count=len({s.rank for s in samples}))
    if not samples:
        return out
    active, every, train, roll, lengths = _active(samples)
    n = int(train.size)
    out.active_token_count = n
    if n == 0:
        if counts is not None:
            counts.extend((0, 0, 0, 0, None) for _ in samples)
        return out
    neq = train != roll
    out.mismatch_count = int(np.count_nonzero(neq))
    out.positive_logprob_count = int(np.count_nonzero(train > 0) + np.count_nonzero(roll > 0))
    if train.dtype == roll.dtype:
        bits = _bits(train) != _bits(roll)
        out.bitwise_mismatch_count = int(np.count_nonzero(bits))
    else:
        bits = np.ones(n, dtype=bool)
        out.bitwise_mismatch_count = n
    d = _delta(train, roll)  # delta, RL-Kernel's sign
    finite = np.isfinite(d)
    out.nonfinite_count = int(n - np.count_nonzero(finite))
    ad = np.abs(d) if out.nonfinite_count == 0 else np.abs(d[finite])  # (the same values)
    if counts is not None:
        counts.extend(_counts(lengths, neq, bits, d, finite,
                              ad if out.nonfinite_count == 0 else None))
    out.mismatch_fraction = out.mismatch_count / n
    score = ad if out.nonfinite_count == 0 else None  # (the worst tokens' scores)
    if ad.size:
        if not summary_only:  # (sorted: the percentiles and the histogram from it, sooner)
            ad = np.sort(ad)
        out.logprob_abs_diff_max = float(ad.max() if summary_only else ad[-1])
        if parts is None and sums is None:
            parts = [(s.train[m], s.rollout[m]) for s, m in zip(samples, active, strict=True)]
        figures = (None if out.nonfinite_count else pooled_from_sums(sums) if sums is not None
                   else pooled_figures(parts or ()))
        if figures is not None:
            _, mean_abs, out.mismatch_kl, out.mismatch_k3_kl = figures
            out.logprob_abs_diff_mean = out.train_rollout_logprob_abs_diff = mean_abs
        if summary_only:
            return out
        p50, p90, p99 = np.percentile(ad, PERCENTILES)
        out.logprob_abs_diff_p50, out.logprob_abs_diff_p90 = float(p50), float(p90)
        out.logprob_abs_diff_p99 = float(p99)
        if out.logprob_abs_diff_max > 0:
            zero = int(np.searchsorted(ad, 0.0, side="right"))
            hist, edges = log10_histogram(ad[zero:])
            out.histogram = {"log10_abs_diff_edges": edges.tolist(),
                             "counts": hist.tolist(), "zero": zero}
    if summary_only:
        return out
    # the worst tokens' scores: |delta|, inf where not finite (|d| when all are)
    _worst(out, samples, every, lengths, d, neq, score)
    from pytest_rlkernel_matrix.judge.read.loss import loss_impact, token_drift  # (45)
    out.loss_impact = loss_impact(d, lengths, [s.call for s in samples], out.mismatch_count,
                                  abs_sorted=ad)
    out.loss_impact["token_drift"] = token_drift(samples, out.worst_tokens)
    return out


HISTOGRAM_BINS = 20


def log10_histogram(ascending: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.histogram(np.log10(ascending), bins=20)` of positive finite values in ascending
    order: log10 keeps their order, so each bin's count is where its edges fall in them (bin
    `i` holds `edges[i] <= x < edges[i + 1]`, the last its right edge too, as numpy's bins
    do); numpy's own histogram wherever log10's results are not in order."""
    logs = np.log10(ascending)
    try:
        edges = np.histogram_bin_edges(logs, bins=HISTOGRAM_BINS)
    except ValueError:  # a span of a few ulps: numpy cannot make 20 finite-sized bins there,
        # so the bins span one decade around them, as numpy does for equal values (issue 51)
        lo, hi = float(np.min(logs)), float(np.max(logs))
        edges = np.histogram_bin_edges(logs, bins=HISTOGRAM_BINS, range=(lo - 0.5, hi + 0.5))
    if logs.size > 1 and not bool((logs[1:] >= logs[:-1]).all()):
        return np.histogram(logs, bins=edges)
    cuts = np.searchsorted(logs, edges[1:-1], side="left")
    return np.diff(cuts, prepend=0, append=logs.size).astype(np.int64), edges


def _worst(
    out: DriftMetrics,
    samples: Sequence[Sample],
    every: np.ndarray,
    lengths: np.ndarray,
    d: np.ndarray,
    neq: np.ndarray,
    score: np.ndarray | None = None,
) -> None:
    """Largest |d| tokens and each sample's first mismatching position (`score`: |d| with inf
    where d is not finite, when already made)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    if score is None:
        score = np.where(np.isfinite(d), np.abs(d), np.inf)
    k = min(WORST_TOKENS, score.size)
    top = np.argpartition(-score, k - 1)[:k]
    top = top[np.argsort(-score[top], kind="stable")]
    # an active token's position in its sample: its index among all samples' mask values
    # (`every`), less its sample's start there
    where = np.flatnonzero(every)
    sizes = np.array([s.mask.size for s in samples], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    for flat in top.tolist():
        if score[flat] == 0:
            break
        i = int(np.searchsorted(offsets, flat, side="right") - 1)
        s = samples[i]
        pos = int(where[flat] - starts[i])
        entry: dict[str, object] = {
            "sample": s.sample, "call": s.call, "rank": s.rank, "position": pos,
            "train_logprob": float(s.train[pos]), "rollout_logprob": float(s.rollout[pos]),
            "abs_diff": float(score[flat]),
        }
        if s.tokens is not None and pos < s.tokens.size:
            entry["token_id"] = int(s.tokens[pos])
        out.worst_tokens.append(entry)
    # each sample's first mismatching active token: the first mismatch at or after its start
    hits = np.flatnonzero(neq)
    if not hits.size:
        return
    first = np.searchsorted(hits, offsets[:-1])
    found = np.flatnonzero(hits[np.minimum(first, hits.size - 1)] < offsets[1:])
    found = found[first[found] < hits.size]
    pos = where[hits[first[found]]] - starts[found]
    ranks = np.array([samples[i].rank for i in found.tolist()], dtype=np.int64)
    numbers = np.array([samples[i].sample for i in found.tolist()], dtype=np.int64)
    out.first_mismatch_summary = {
        "samples_with_mismatch": int(found.size), "samples": len(samples),
        "position_min": int(pos.min()), "position_median": float(np.median(pos)),
        "position_max": int(pos.max()),
    }
    # Earliest first (position, rank, sample; ties in sample order); the summary covers every
    # sample, the list the earliest ones.
    order = np.lexsort((numbers, ranks, pos))[:FIRST_MISMATCH_LISTED]
    out.first_mismatch = [
        {"sample": int(numbers[j]), "rank": int(ranks[j]), "position": int(pos[j]),
         "active_tokens": int(lengths[found[j]])} for j in order.tolist()]
