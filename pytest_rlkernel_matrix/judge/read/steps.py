"""Reading for the reproducibility layer: the per-step series of one run directory, both sides'
weight chains, and what a second run of the same cell holds beside it, as typed objects.

Nothing here decides a claim: `judge.reproducibility` turns these objects into ``holds``,
``fails`` or ``not judged``. What can only be read (a sidecar's bytes, an audit's sha256, a
run id, an exit code, the first sample whose bytes differ) is read here, once; within one
cell's analysis (`evidence.pt_memo`) the `.pt` files and audits the evidence already read are
not read again. Every reader here returns what it could not read as a problem, never raises.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.judge.read import evidence as _ev
from pytest_rlkernel_matrix.judge.read.calls import call_gaps, versions_vs_calls
from pytest_rlkernel_matrix.judge.read.metrics import (
    DriftMetrics,
    PartSums,
    SampleCounts,
    compute,
    pooled_from_sums,
)
from pytest_rlkernel_matrix.judge.read.sidecars import float_array, merge
from pytest_rlkernel_matrix.store.safeio import MAX_JSON_BYTES, Refused, listing, read_bytes

_NAME = re.compile(r"^rank(\d+)\.call(\d+)\.pt$")
Key = tuple[int, int]  # (call, rank)


@dataclass
class StepSeries:
    """Per-step figures of one run directory (one step = one sidecar call index) and both
    sides' weight chains (version -> side -> sha256), with what could not be read."""

    series: list[dict[str, Any]] = field(default_factory=list)
    weights: dict[str, dict[str, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass
class RunPair:
    """What two run directories of one cell hold side by side (`run_to_run_bitwise`).

    `unusable`: why the pair cannot be compared (the second run missing, the same run, not
    exited 0, call gaps, an unreadable sidecar or audit); '' when it can. `first_keys` and
    `second_keys`: their sidecars' (call, rank); `differs_at`: the first (call, rank, sample)
    whose sidecar bytes differ, read in key order (the chains are then not read); `chains`:
    both runs' weight chains when every sidecar is byte-identical."""

    first: str
    second: str
    unusable: str = ""
    first_keys: frozenset[Key] = frozenset()
    second_keys: frozenset[Key] = frozenset()
    differs_at: tuple[int, int, str] | None = None
    chains: tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]] | None = None


@dataclass
class Reproducibility:
    """The reproducibility layer's input: the step series (or why it could not be read) and
    the repeat run (None when the cell has none)."""

    steps: StepSeries | None
    steps_error: str = ""
    repeat_dir: str | None = None
    repeat: RunPair | None = None


def sidecar_files(root: Path, problems: list[str]) -> dict[Key, Path]:
    """(call, rank) -> sidecar path of one run directory."""
    out: dict[Key, Path] = {}
    for sub in _ev.SIDECAR_DIRS:
        for path in listing(root / sub, "*.pt", root, problems):
            m = _NAME.match(path.name)
            if m:
                out[(int(m.group(2)), int(m.group(1)))] = path
    return out


def _entry(call: int, m: DriftMetrics) -> dict[str, Any]:
    return {"step": call, "active_tokens": m.active_token_count,
            "abs_diff_mean": m.logprob_abs_diff_mean or 0.0,
            "abs_diff_max": m.logprob_abs_diff_max or 0.0,
            "mismatch_count": m.mismatch_count,
            "bitwise_mismatch_count": m.bitwise_mismatch_count,
            "k3": m.mismatch_k3_kl or 0.0}


def _summary(samples: list[SampleCounts], sums: list[PartSums]) -> DriftMetrics:
    """`compute(..., summary_only=True)`'s figures of one call from its samples' counts and
    its parts' sums (what the series reads of it)."""
    out = DriftMetrics(active_token_count=sum(c[0] for c in samples))
    if out.active_token_count == 0:
        return out
    out.mismatch_count = sum(c[1] for c in samples)
    out.bitwise_mismatch_count = sum(c[2] for c in samples)
    out.nonfinite_count = sum(c[3] for c in samples)
    tops = [c[4] for c in samples if c[4] is not None]
    if tops:
        out.logprob_abs_diff_max = max(tops)
        figures = None if out.nonfinite_count else pooled_from_sums(sums)
        if figures is not None:
            _, out.logprob_abs_diff_mean, out.mismatch_kl, out.mismatch_k3_kl = figures
    return out


def read_steps(root: Path) -> StepSeries:
    """Per-step metrics (one step = one sidecar call index) and both sides' weight chains.

    Within one cell's analysis whose sidecars read cleanly, each call's figures come from the
    cell's own merge (`evidence.StepInputs`: the same samples and parts a merge of that call
    alone gives, so the same figures); otherwise each call's sidecars are merged here."""
    st = StepSeries()
    files = sidecar_files(root, st.problems)
    st.problems.extend(call_gaps(files))
    kept = None if st.problems else _ev.step_inputs(root, files.values())
    if kept is not None:
        st.series = [_entry(call, _summary(kept.samples.get(call, []), kept.sums.get(call, [])))
                     for call in kept.calls]
        st.weights = weight_chain(root, st.problems)
        st.problems.extend(versions_vs_calls((c for c, _ in files), st.weights))
        return st
    by_call: dict[int, list[Path]] = {}
    for (call, _rank), path in sorted(files.items()):
        by_call.setdefault(call, []).append(path)
    for call, paths in sorted(by_call.items()):
        shards: list[Any] = []
        for path in paths:
            loaded = _ev._load_pt(path, root, st.problems)
            if loaded is None:
                continue
            try:
                shards.extend(_ev.sidecar_shards(loaded[0], path.name))
            except (ValueError, TypeError, IndexError) as exc:
                st.problems.append(f"sidecar {path.name}: malformed: {exc}")
        merged = merge(shards)
        st.problems.extend(merged.problems)
        st.series.append(_entry(call, compute(_ev._renumber(merged.samples), merged.parts,
                                              summary_only=True)))
    st.weights = weight_chain(root, st.problems)
    st.problems.extend(versions_vs_calls((c for c, _ in files), st.weights))
    return st


def weight_chain(root: Path, problems: list[str]) -> dict[str, dict[str, str]]:
    """version -> {"training": sha256, "rollout": sha256} from the per-version audits."""
    chain: dict[str, dict[str, str]] = {}
    parsed = _ev.parsed_audits(root)  # what the evidence parsed of the same files
    for side, sub in (("training", "weight-audit"), ("rollout", "weight-audit/rollout")):
        for path in listing(root / sub, "*.json", root, problems):
            data = parsed.get(str(path), parsed)
            try:
                if data is parsed:
                    data = json.loads(read_bytes(path, root, MAX_JSON_BYTES))
            except (Refused, ValueError, UnicodeDecodeError) as exc:
                problems.append(f"{sub}/{path.name}: unreadable: {exc}")
                continue
            if not isinstance(data, dict) or "version" not in data:
                continue  # not upstream's per-version format (e.g. v0.<fw>-<side>.json)
            if not isinstance(data.get("sha256"), str):
                problems.append(f"{sub}/{path.name}: no sha256 string")
                continue
            chain.setdefault(str(data["version"]), {})[side] = data["sha256"]
    return chain


def read_pair(first: Path, second: Path) -> RunPair:
    """Both runs' sidecars (bytes hashed in key order, up to the first difference) and, when
    every sidecar is byte-identical, both weight chains. Two runs that are one (the same
    directory, a link to it, the same run id) or whose evidence is incomplete or unreadable
    are `unusable`, with why."""
    pair = RunPair(first.name, second.name)
    problems: list[str] = []
    same = _same_run(first, second)
    if same:
        pair.unusable = same
        return pair
    a, b = sidecar_files(first, problems), sidecar_files(second, problems)
    for run, files in ((first, a), (second, b)):
        problems.extend(f"{run.name}: {why}" for why in call_gaps(files))
    pair.first_keys, pair.second_keys = frozenset(a), frozenset(b)
    if problems:
        pair.unusable = "; ".join(problems[:3])
        return pair
    if not a or set(a) != set(b):
        return pair
    try:
        for key in sorted(a):
            ra, rb = read_bytes(a[key], first, 1 << 31), read_bytes(b[key], second, 1 << 31)
            if hashlib.sha256(ra).digest() != hashlib.sha256(rb).digest():
                pair.differs_at = (key[0], key[1], _first_sample(a[key], b[key], first, second))
                return pair
    except (Refused, OSError) as exc:
        pair.unusable = f"a sidecar cannot be read: {str(exc)[:200]}"
        return pair
    ca, cb = weight_chain(first, problems), weight_chain(second, problems)
    if problems:  # (an unreadable audit in either run: the chains are not whole)
        pair.unusable = "; ".join(problems[:3])
        return pair
    pair.chains = (ca, cb)
    return pair


def read_repeat(root: Path, repeat_dir: str) -> RunPair:
    """The pair of `root` and `<root's parent>/<repeat_dir>`: a plain sibling directory name
    (no path, not the run itself) that finished with exit code 0; never raises."""
    pair = RunPair(root.name, repeat_dir)
    if (not repeat_dir or repeat_dir in (".", "..") or "/" in repeat_dir or "\\" in repeat_dir
            or "\0" in repeat_dir):
        pair.unusable = (f"the second run {repeat_dir[:80]!r} is not a directory name beside "
                         "the first run")
        return pair
    if repeat_dir == root.name:
        pair.unusable = f"the second run {repeat_dir} is the first run"
        return pair
    again = root.parent / repeat_dir
    try:
        if not (again.is_dir() or again.is_symlink()):
            pair.unusable = f"the second run {repeat_dir} is missing"
            return pair
        same = _same_run(root, again)
        if same:
            pair.unusable = same
            return pair
        code = _exit_code(again)
        if code != "0":
            pair.unusable = f"the second run {repeat_dir} exited {code}"
            return pair
        return read_pair(root, again)
    except Exception as exc:  # a reader bug or an odd file: unusable, with why
        pair.unusable = f"the second run {repeat_dir}: {type(exc).__name__}: {str(exc)[:200]}"
        return pair


def read_reproducibility(root: Path, repeat_dir: str | None) -> Reproducibility:
    """Everything the reproducibility layer judges of one run directory; never raises."""
    try:
        rep = Reproducibility(steps=read_steps(root), repeat_dir=repeat_dir)
    except Exception as exc:  # a reader bug: the layer says every claim is not judged
        return Reproducibility(steps=None, steps_error=f"steps: {type(exc).__name__}: "
                               f"{str(exc)[:200]}", repeat_dir=repeat_dir)
    if repeat_dir:
        rep.repeat = read_repeat(root, repeat_dir)
    return rep


def _run_id(run: Path) -> str | None:
    """The run id `cell-run.json` (else `manifest.json`) records, or None."""
    for name in ("cell-run.json", "manifest.json"):
        try:
            data = json.loads(read_bytes(run / name, run, MAX_JSON_BYTES))
        except (Refused, OSError, ValueError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(data, dict) and isinstance(data.get("run_id"), str) and data["run_id"]:
            return data["run_id"]
    return None


def _same_run(first: Path, second: Path) -> str:
    """Why `second` is not a run of its own beside `first` ('' when it is one)."""
    if second.is_symlink():
        return (f"the second run {second.name} is a symbolic link, not a run directory of "
                "its own")
    try:
        if first.resolve() == second.resolve() or second.samefile(first):
            return f"the second run {second.name} is the first run's own directory"
    except OSError as exc:
        return f"the second run {second.name} cannot be read ({type(exc).__name__})"
    ra, rb = _run_id(first), _run_id(second)
    if ra is not None and ra == rb:
        return (f"the second run {second.name} carries the first run's run id {ra!r}: a copy, "
                "not a separate run")
    return ""


def _first_sample(pa: Path, pb: Path, ra: Path, rb: Path) -> str:
    la, lb = _ev._load_pt(pa, ra, []), _ev._load_pt(pb, rb, [])
    if la is None or lb is None:
        return "? (unreadable)"
    for key in ("train_log_probs", "rollout_log_probs", "tokens"):
        xa, xb = la[0].get(key) or [], lb[0].get(key) or []
        for i, (u, w) in enumerate(zip(xa, xb, strict=False)):
            if float_array(u, key).tobytes() != float_array(w, key).tobytes():
                return str(i)
        if len(xa) != len(xb):
            return str(min(len(xa), len(xb)))
    return "? (same logprobs, other bytes differ)"


def _exit_code(run: Path) -> str:
    """The run's ``exit-code`` as written by the runner ("0", "1", "not-started", ...)."""
    try:
        text = read_bytes(run / "exit-code", run, 64).decode("utf-8", "replace").strip()
    except (Refused, OSError) as exc:
        return f"without a readable exit-code ({type(exc).__name__})"
    return text or "without an exit code (timed out or killed)"
