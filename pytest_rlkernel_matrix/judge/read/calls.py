"""Which (rank, call) sidecars and which numbered weight versions a run directory holds, and
where that set has gaps: facts about the files on disk, stated as reasons naming the rank and
the call (or the version). The semantic layer fails a cell on them; the reproducibility layer
refuses to compare steps over them.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_NAMED = 8


def call_gaps(pairs: Iterable[tuple[int, int]]) -> list[str]:
    """Problems of a run's sidecar set, given as (call, rank) pairs: calls not 0..max, and
    (rank, call) files missing where the other ranks and calls have theirs."""
    have = set(pairs)
    if not have:
        return []
    calls = sorted({c for c, _ in have})
    ranks = sorted({r for _, r in have})
    out: list[str] = []
    lost_calls = [c for c in range(calls[-1] + 1) if c not in calls]
    if lost_calls:
        out.append(f"sidecar calls {_span(calls)} are not 0..{calls[-1]}: no sidecar of call(s) "
                   f"{lost_calls[:MAX_NAMED]} from any rank (a step missing)")
    missing = [(r, c) for c in calls for r in ranks if (c, r) not in have]
    for r, c in missing[:MAX_NAMED]:
        out.append(f"sidecar of rank {r}, call {c} is missing (rank{r:05d}.call{c:08d}.pt; "
                   f"every rank writes one per call)")
    if len(missing) > MAX_NAMED:
        out.append(f"... and {len(missing) - MAX_NAMED} more missing (rank, call) sidecar(s)")
    return out


def versions_vs_calls(calls: Iterable[int], versions: Iterable[str]) -> list[str]:
    """Where the numbered weight chain holds more than one version (a new version per step),
    it must cover the same steps as the sidecars: versions 0..N against calls 0..N."""
    nums = sorted({int(v) for v in versions if str(v).isdigit()})
    have = sorted(set(calls))
    if len(nums) < 2 or not have:
        return []
    if nums[0] == have[0] and nums[-1] == have[-1]:
        return []
    return [f"weight versions {_span(nums)} and sidecar calls {_span(have)} cover different "
            "steps: a step's evidence is missing"]


def _span(values: list[int]) -> str:
    if values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}" if len(values) > 1 else str(values[0])
    shown = ", ".join(str(v) for v in values[:MAX_NAMED])
    return f"[{shown}{', ...' if len(values) > MAX_NAMED else ''}]"
