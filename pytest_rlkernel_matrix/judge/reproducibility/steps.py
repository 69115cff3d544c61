"""Drift over steps, the weight-version chain and run-to-run reproducibility of one cell.

Three claims are judged here apart from today's numeric (single-step) judgement:

- ``train_rollout_bitwise`` over steps: every step's sidecars bitwise (train == rollout bytes on
  every active token), or the first step that is not, named;
- ``weights_bitwise``: the weight-version chain of both sides (one sha256 per version, from
  ``weight-audit/<version>.json`` and ``weight-audit/rollout/<version>.json``) compared version
  by version; the first version where training and rollout differ is named;
- ``run_to_run_bitwise``: two runs of the same cell with the same seed, sidecar bytes and weight
  chains compared (``compare_runs``); "holds", "fails at step k, rank r, sample s" or
  "not judged: reason".

The drift trend is the least-squares slope of the per-step active-token mean |dlogp| with a
percentile-bootstrap interval over steps (fixed seed, ``RESAMPLES`` draws), following the
timing rule of ``stats.py``: "grows" when the interval lies above 0, "flat" when every step has
the same value or the interval lies inside +-5% of the mean level per step, else "no conclusion".
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.judge.read import evidence as _ev
from pytest_rlkernel_matrix.judge.read.calls import call_gaps, versions_vs_calls
from pytest_rlkernel_matrix.judge.read.metrics import (
    DriftMetrics,
    PartSums,
    SampleCounts,
    compute,
    pooled_from_sums,
)
from pytest_rlkernel_matrix.judge.read.policy import CLAIMS
from pytest_rlkernel_matrix.judge.read.sidecars import float_array, merge
from pytest_rlkernel_matrix.store.safeio import MAX_JSON_BYTES, Refused, listing, read_bytes

# The drift trend's bootstrap: the same draws and seed as performance/stats.py (a layer imports no
# other layer; tests/test_layout.py holds the two equal).
RESAMPLES = 4000
SEED = 20240601
_NAME = re.compile(r"^rank(\d+)\.call(\d+)\.pt$")
FLAT_FRACTION = 0.05
MIN_TREND_STEPS = 3


@dataclass
class Claim:
    """One claim's verdict: ``holds``, ``fails`` or ``not judged``, with the sentence."""

    name: str
    status: str
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail,
                "text": f"{self.name}: {self.status}" + (f" ({self.detail})" if self.detail
                                                          else "")}


@dataclass
class Steps:
    """Per-step series of one run directory and its weight chains."""

    series: list[dict[str, Any]] = field(default_factory=list)
    weights: dict[str, dict[str, str]] = field(default_factory=dict)  # version -> side -> sha
    problems: list[str] = field(default_factory=list)

    def trend(self) -> dict[str, Any]:
        return trend([s["step"] for s in self.series],
                     [s["abs_diff_mean"] for s in self.series])

    def bitwise_claim(self) -> Claim:
        name = "train_rollout_bitwise"
        if self.problems:
            return Claim(name, "not judged", "; ".join(self.problems[:3]))
        if not self.series:
            return Claim(name, "not judged", "no per-step sidecars")
        for s in self.series:
            if not s["active_tokens"]:
                return Claim(name, "not judged", f"step {s['step']}: no active token to "
                             "compare")
            if s["bitwise_mismatch_count"]:
                return Claim(name, "fails", f"first non-bitwise step {s['step']}: "
                             f"{s['bitwise_mismatch_count']} of {s['active_tokens']} tokens")
        return Claim(name, "holds", f"{len(self.series)} steps, every step bitwise")

    def weights_claim(self) -> Claim:
        name = "weights_bitwise"
        if self.problems:
            return Claim(name, "not judged", "; ".join(self.problems[:3]))
        if not self.weights:
            return Claim(name, "not judged", "no per-version weight audits")
        nums = sorted(int(v) for v in self.weights if v.isdigit())
        lost = [n for n in range(nums[0], nums[-1] + 1) if n not in nums] if nums else []
        if lost:
            return Claim(name, "not judged", f"weight versions {nums[0]}..{nums[-1]} lack "
                         f"{lost[:8]}: the chain has gaps")
        for v in sorted(self.weights, key=_version_key):
            sides = self.weights[v]
            missing = [s for s in ("training", "rollout") if s not in sides]
            if missing:
                return Claim(name, "not judged", f"version {v}: no {missing[0]} audit")
            if sides["training"] != sides["rollout"]:
                return Claim(name, "fails", f"first differing version {v}: training "
                             f"{sides['training'][:12]} != rollout {sides['rollout'][:12]}")
        return Claim(name, "holds", f"{len(self.weights)} version(s) equal on both sides")

    def as_dict(self) -> dict[str, Any]:
        return {"series": self.series, "trend": self.trend(),
                "weight_chain": {v: self.weights[v] for v in sorted(self.weights,
                                                                    key=_version_key)},
                "problems": self.problems}


def _version_key(v: str) -> tuple[int, str]:
    return (int(v), v) if v.isdigit() else (1 << 62, v)


def sidecar_files(root: Path, problems: list[str]) -> dict[tuple[int, int], Path]:
    """(call, rank) -> sidecar path of one run directory."""
    out: dict[tuple[int, int], Path] = {}
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


def read_steps(root: Path) -> Steps:
    """Per-step metrics (one step = one sidecar call index) and both sides' weight chains.

    Within one cell's analysis whose sidecars read cleanly, each call's figures come from the
    cell's own merge (`evidence.StepInputs`: the same samples and parts a merge of that call
    alone gives, so the same figures); otherwise each call's sidecars are merged here."""
    st = Steps()
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
        samples = merged.samples
        st.series.append(_entry(call, compute(_ev._renumber(samples), merged.parts,
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


def trend(steps: list[int], values: list[float]) -> dict[str, Any]:
    """Least-squares slope per step of ``values`` and its bootstrap interval, with the verdict."""
    x, y = np.asarray(steps, dtype=np.float64), np.asarray(values, dtype=np.float64)
    out: dict[str, Any] = {"metric": "active-token mean |dlogp|", "n": int(x.size),
                           "slope": None, "low": None, "high": None, "confidence": 0.95}
    if x.size < MIN_TREND_STEPS:
        out.update(conclusion="no conclusion",
                   reason=f"{x.size} step(s), at least {MIN_TREND_STEPS} needed")
        return out
    if np.all(y == y[0]):
        out.update(slope=0.0, low=0.0, high=0.0, conclusion="flat",
                   reason="every step has the same value")
        return out
    rng = np.random.default_rng(SEED)
    idx = rng.integers(0, x.size, (RESAMPLES, x.size))
    xs, ys = x[idx], y[idx]
    xm, ym = xs.mean(1, keepdims=True), ys.mean(1, keepdims=True)
    den = ((xs - xm) ** 2).sum(1)
    ok = den > 0
    slopes = (((xs - xm) * (ys - ym)).sum(1)[ok] / den[ok])
    slope = float(np.polyfit(x, y, 1)[0])
    low, high = (float(v) for v in np.percentile(slopes, [2.5, 97.5]))
    band = FLAT_FRACTION * float(np.abs(y).mean())
    if low > 0:
        conclusion = "grows"
    elif -band <= low and high <= band:
        conclusion = "flat"
    else:
        conclusion = "no conclusion"
    out.update(slope=slope, low=low, high=high, conclusion=conclusion,
               text=f"slope {slope:.3g}/step [{low:.3g}, {high:.3g}] 95% CI, n={x.size}: "
               f"{conclusion}")
    return out


def compare_runs(first: Path, second: Path) -> Claim:
    """run_to_run_bitwise: sidecar bytes per (step, rank), then both weight chains. Two runs
    that are one (the same directory, a link to it, the same run id) or whose evidence is
    incomplete or unreadable are "not judged", never "holds"."""
    name = "run_to_run_bitwise"
    problems: list[str] = []
    same = _same_run(first, second)
    if same:
        return Claim(name, "not judged", same)
    a, b = sidecar_files(first, problems), sidecar_files(second, problems)
    for run, files in ((first, a), (second, b)):
        problems.extend(f"{run.name}: {why}" for why in call_gaps(files))
    if problems:
        return Claim(name, "not judged", "; ".join(problems[:3]))
    if not a:
        return Claim(name, "not judged", f"no sidecars in {first.name}")
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))[0]
        return Claim(name, "not judged", f"step {only[0]} rank {only[1]}: sidecar in one run "
                     "only")
    try:
        for key in sorted(a):
            ra, rb = read_bytes(a[key], first, 1 << 31), read_bytes(b[key], second, 1 << 31)
            if hashlib.sha256(ra).digest() != hashlib.sha256(rb).digest():
                return Claim(name, "fails", f"fails at step {key[0]}, rank {key[1]}, "
                             f"sample {_first_sample(a[key], b[key], first, second)}")
    except (Refused, OSError) as exc:
        return Claim(name, "not judged", f"a sidecar cannot be read: {str(exc)[:200]}")
    ca, cb = weight_chain(first, problems), weight_chain(second, problems)
    if problems:  # (an unreadable audit in either run: the chains are not whole)
        return Claim(name, "not judged", "; ".join(problems[:3]))
    for v in sorted(set(ca) | set(cb), key=_version_key):
        if ca.get(v) != cb.get(v):
            return Claim(name, "fails", f"fails at weight version {v}")
    return Claim(name, "holds", f"{len(a)} sidecar(s) and {len(ca)} weight version(s) "
                 "byte-identical across 2 runs")


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


def judge_claims(root: Path, repeat_dir: str | None) -> tuple[dict[str, dict[str, str]],
                                                               dict[str, Any]]:
    """The three claims (``CLAIMS``) and the drift-over-steps data of one run directory;
    ``repeat_dir``: the second run's directory name next to it (``run_to_run_bitwise``)."""
    try:
        st = read_steps(root)
    except Exception as exc:  # a reader bug: every claim not judged, never a pass
        why = f"steps: {type(exc).__name__}: {str(exc)[:200]}"
        return {c: Claim(c, "not judged", why).as_dict() for c in CLAIMS}, {}
    if repeat_dir:
        r2r = _repeat_claim(root, repeat_dir)
    else:
        r2r = Claim("run_to_run_bitwise", "not judged", "one run (set [reproducibility] "
                    "runs = 2 or --rlk-repeat-baseline)")
    claims = {"train_rollout_bitwise": st.bitwise_claim(), "run_to_run_bitwise": r2r,
              "weights_bitwise": st.weights_claim()}
    return {k: v.as_dict() for k, v in claims.items()}, st.as_dict()


def _repeat_claim(root: Path, repeat_dir: str) -> Claim:
    """run_to_run_bitwise against `<root's parent>/<repeat_dir>`: a plain sibling directory
    name (no path, not the run itself) that finished with exit code 0; never raises."""
    name = "run_to_run_bitwise"
    if (not repeat_dir or repeat_dir in (".", "..") or "/" in repeat_dir or "\\" in repeat_dir
            or "\0" in repeat_dir):
        return Claim(name, "not judged", f"the second run {repeat_dir[:80]!r} is not a "
                     "directory name beside the first run")
    if repeat_dir == root.name:
        return Claim(name, "not judged", f"the second run {repeat_dir} is the first run")
    again = root.parent / repeat_dir
    try:
        if not (again.is_dir() or again.is_symlink()):
            return Claim(name, "not judged", f"the second run {repeat_dir} is missing")
        same = _same_run(root, again)
        if same:
            return Claim(name, "not judged", same)
        code = _exit_code(again)
        if code != "0":
            return Claim(name, "not judged", f"the second run {repeat_dir} exited {code}")
        return compare_runs(root, again)
    except Exception as exc:  # a reader bug or an odd file: not judged, with why
        return Claim(name, "not judged", f"the second run {repeat_dir}: {type(exc).__name__}: "
                     f"{str(exc)[:200]}")


def _exit_code(run: Path) -> str:
    """The run's ``exit-code`` as written by the runner ("0", "1", "not-started", ...)."""
    try:
        text = read_bytes(run / "exit-code", run, 64).decode("utf-8", "replace").strip()
    except (Refused, OSError) as exc:
        return f"without a readable exit-code ({type(exc).__name__})"
    return text or "without an exit code (timed out or killed)"


def apply_declared(claims: dict[str, dict[str, str]], declared: tuple[str, ...], mode: str,
                   verdict: str, reasons: list[str], waived: tuple[str, ...] = (),
                   ) -> tuple[str, list[str]]:
    """An all-R cell's claims. In strict mode a claim that was judged and fails makes a valid
    cell ``contract_mismatch``, declared (``[matrix] baseline_claims``) or not, and a declared
    claim that was not judged makes it ``incomparable``; otherwise a declared claim that does
    not hold is a reason (``also:`` on a valid cell) and an undeclared one is only reported.
    ``waived``: undeclared claims the cell's own contract speaks for instead (a declared
    tolerance allows train/rollout drift within it: ``train_rollout_bitwise``)."""
    order = [*declared, *(n for n in CLAIMS if n not in declared), *(
        n for n in claims if n not in declared and n not in CLAIMS)]
    for name in order:
        c = claims.get(name)
        if name in declared and not isinstance(c, dict):
            c = Claim(name, "not judged", "not in the record").as_dict()
        if not isinstance(c, dict) or c.get("status") == "holds":
            continue
        if name not in declared and (c.get("status") != "fails" or mode != "strict"
                                     or name in waived or verdict != "valid"):
            continue  # an undeclared claim is only reported, unless it fails under strict
        label = "declared baseline claim" if name in declared else "baseline claim (not declared)"
        why = f"{label} {c.get('text') or name}"
        if mode == "strict" and verdict == "valid":
            verdict = "contract_mismatch" if c.get("status") == "fails" else "incomparable"
            reasons = [why]
        elif why not in reasons:
            reasons = [*reasons, why if verdict != "valid" else f"also: {why}"]
    return verdict, reasons
