"""Is the evidence complete enough to compare? Rank files tied to the run and covering it.

Every rank writes one sidecar per call (step), so the sidecar files of a run must cover every
(rank, call) pair of ranks 0..n-1 and calls 0..max; the weight-version chain, where it holds
more than one numbered version (one per optimizer step), must cover the same steps as the
sidecars. A gap is a reason naming the rank and the call (or the version), never a smaller
comparison that "holds": a comparison over incomplete inputs is not judged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_rlkernel_matrix.judge.read.calls import call_gaps, versions_vs_calls
from pytest_rlkernel_matrix.spec.terms import plural

if TYPE_CHECKING:
    from pytest_rlkernel_matrix.judge.read.evidence import Evidence

def judge_ranks(ev: Evidence, fail: Any) -> None:
    """Rank files tie to the run (names, rank fields, world size, no copies) and cover it
    (every rank's sidecar of every call, calls 0..max, the weight versions' steps);
    ``fail(reason)`` takes each problem."""
    by_digest: dict[str, list[str]] = {}
    sizes: set[tuple[int, int]] = set()
    ranks: set[int] = set()
    pairs: set[tuple[int, int]] = set()
    for info in ev.rank_files:
        by_digest.setdefault(info["sha256"], []).append(info["file"])
        if "rank" not in info:
            continue
        ranks.add(info["rank"])
        sizes.add((info.get("tp", 1), info.get("cp", 1)))
        if isinstance(info.get("call"), int):
            pairs.add((info["call"], info["rank"]))
        if info.get("name_rank") is None:
            fail(f"rank file {info['file']}: the file name carries no rank")
        elif info["name_rank"] != info["rank"]:
            fail(f"rank file {info['file']}: rank field {info['rank']} != rank "
                 f"{info['name_rank']} in the file name")
        if info.get("name_call") not in (None, info.get("call")):
            fail(f"rank file {info['file']}: call_index {info.get('call')} != call "
                 f"{info['name_call']} in the file name")
    for files in by_digest.values():
        if len(files) > 1:
            fail(f"byte-identical rank files {', '.join(sorted(files))}: one rank's evidence "
                 "copied, not separate ranks")
    if len(sizes) > 1:
        fail(f"rank files disagree on (tp, cp) world sizes: {sorted(sizes)}")
    if ranks:
        world = len(ranks)
        if ranks != set(range(world)):
            fail(f"rank files hold ranks {sorted(ranks)[:16]}: not 0..{world - 1}")
        elif len(sizes) == 1:
            tp, cp = next(iter(sizes))
            if world % (tp * cp):
                fail(f"{plural(world, 'rank')}: not a multiple of tp*cp = {tp}*{cp}")
    for why in call_gaps(pairs) + versions_vs_calls(
            (c for c, _ in pairs), ev.weight_audit.training):
        fail(why)
