"""Property tests (issue 34): each judgement module fed empty, truncated, duplicated, reordered
and self-referencing inputs never answers with a passing status. In-process, small example
counts, derandomized: seconds, not minutes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_nothing_compared import OPS, TOKENS, audit, probe_file

from pytest_rlkernel_matrix.judge.localise import factors, probe
from pytest_rlkernel_matrix.judge.read import steps as rsteps
from pytest_rlkernel_matrix.judge.read.calls import call_gaps
from pytest_rlkernel_matrix.judge.read.evidence import Evidence
from pytest_rlkernel_matrix.judge.read.metrics import Sample
from pytest_rlkernel_matrix.judge.read.sidecars import merge, read_sidecar
from pytest_rlkernel_matrix.judge.read.upstream import read_weight_audits
from pytest_rlkernel_matrix.judge.reproducibility import steps
from pytest_rlkernel_matrix.judge.route.rules import upstream_findings
from pytest_rlkernel_matrix.judge.semantic.weights import judge_weight_audit
from pytest_rlkernel_matrix.report import cache

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
MUTATIONS = ("empty", "truncated", "duplicated", "reordered", "self")


@contextmanager
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rlk-prop-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- probe ----------------------------------------------------------------------------------------


def _clean_probe(d: Path, ranks: int) -> None:
    for s in probe.SIDES:
        for r in range(ranks):
            probe_file(d, s, r)
    (d / "index.json").write_text(json.dumps({
        "schema_version": probe.PROBE_SCHEMA, "operators": OPS, "tokens": TOKENS,
        "files": [f"{s}.rank{r:05d}.pt" for s in probe.SIDES for r in range(ranks)]}))


@SETTINGS
@given(kind=st.sampled_from(MUTATIONS), side=st.sampled_from(probe.SIDES),
       ranks=st.integers(1, 2))
def test_probe_never_passes_bad_inputs(kind: str, side: str, ranks: int) -> None:
    with scratch() as d:
        _clean_probe(d, ranks)
        assert probe.localise(d)["status"] == "no_divergence"
        last = d / f"{side}.rank{ranks - 1:05d}.pt"
        if kind == "empty":
            probe_file(d, side, ranks - 1, ops=[], outputs={})
        elif kind == "truncated":
            probe_file(d, side, ranks - 1, tokens=TOKENS[:1],
                       outputs={o: torch.ones(1, 4) for o in OPS})
        elif kind == "duplicated":  # the operators list names one operator twice
            probe_file(d, side, ranks - 1, ops=[OPS[0], *OPS])
        elif kind == "reordered":
            probe_file(d, side, ranks - 1, ops=OPS[::-1])
        else:  # a file that is a link to itself
            last.unlink()
            last.symlink_to(last.name)
        loc = probe.localise(d)
        assert loc["status"] != "no_divergence", (kind, loc["reasons"])
        assert loc["reasons"]


# -- steps: run to run and the per-step claims ----------------------------------------------------


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_nothing_compared import steps_cell

    base = tmp_path_factory.mktemp("runs")
    k = steps_cell(base, calls=(0, 1, 2), versions=3, tp=2)
    again = k.dir.with_name(k.dir.name + ".repeat2")
    shutil.copytree(k.dir, again)
    meta = json.loads((again / "cell-run.json").read_text())
    meta["run_id"] = "the-second-run"
    (again / "cell-run.json").write_text(json.dumps(meta))
    return k.dir


@SETTINGS
@given(kind=st.sampled_from(MUTATIONS), which=st.sampled_from(["first", "second"]),
       call=st.integers(0, 2), rank=st.integers(0, 1))
def test_run_to_run_never_holds_on_bad_inputs(two_runs: Path, kind: str, which: str,
                                              call: int, rank: int) -> None:
    with scratch() as d:
        a, b = d / "a", d / "a.repeat2"
        shutil.copytree(two_runs, a)
        shutil.copytree(two_runs.with_name(two_runs.name + ".repeat2"), b)
        assert steps.compare_runs(rsteps.read_pair(a, b)).status == "holds"
        run = a if which == "first" else b
        sc = run / "mismatch-sidecars"
        name = f"rank{rank:05d}.call{call:08d}.pt"
        if kind == "empty":
            shutil.rmtree(sc)
            sc.mkdir()
        elif kind == "truncated":
            (sc / name).unlink()
        elif kind == "duplicated":  # the second run is the first one: a link, or its run id
            shutil.rmtree(b)
            if which == "first":
                b.symlink_to(a.name)
            else:
                shutil.copytree(a, b)
        elif kind == "reordered":  # two steps' files swapped
            other = sc / f"rank{rank:05d}.call{(call + 1) % 3:08d}.pt"
            tmp = sc / "swap"
            os.replace(sc / name, tmp)
            os.replace(other, sc / name)
            os.replace(tmp, other)
        else:
            (sc / name).unlink()
            (sc / name).symlink_to(name)
        r2r = steps.compare_runs(rsteps.read_repeat(a, b.name))
        assert r2r.status != "holds", (kind, which, r2r)
        if run is a and kind in ("empty", "truncated", "self"):
            st_ = steps.Steps.of(rsteps.read_steps(a))
            assert st_.bitwise_claim().status != "holds", kind


# -- factors --------------------------------------------------------------------------------------


def _samples(n: int, length: int) -> list[Sample]:
    return [Sample(train=np.arange(length, dtype=np.float32) - i,
                   rollout=np.arange(length, dtype=np.float32) - i, mask=np.ones(length, bool),
                   rank=0, sample=i, call=0) for i in range(n)]


def _passes(c: dict[str, Any]) -> bool:
    return bool(c.get("judged")) and not c.get("rollout_logprobs_differ") and not c.get(
        "unpaired_samples") and not c.get("samples_tokens_differ")


@SETTINGS
@given(kind=st.sampled_from(MUTATIONS), n=st.integers(1, 4), length=st.integers(2, 9),
       cut=st.integers(1, 8))
def test_factor_comparison_never_passes_bad_inputs(kind: str, n: int, length: int,
                                                   cut: int) -> None:
    base = _samples(n, length)
    with scratch() as d:
        own_dir, base_dir = d / "own", d / "base"
        own_dir.mkdir()
        base_dir.mkdir()
        own = _samples(n, length)
        if kind == "empty":
            own = []
        elif kind == "truncated":
            own = [Sample(train=s.train[:max(0, length - cut)],
                          rollout=s.rollout[:max(0, length - cut)],
                          mask=s.mask[:max(0, length - cut)], rank=0, sample=s.sample, call=0)
                   for s in own]
        elif kind == "duplicated":
            own = [*own, own[0]]
        elif kind == "reordered":  # sample i's values under sample i+1's key
            own = [Sample(train=s.train, rollout=s.rollout, mask=s.mask, rank=0,
                          sample=(s.sample + 1) % (n + 1), call=0) for s in own]
        evs = {own_dir: Evidence(root=own_dir, samples=own),
               base_dir: Evidence(root=base_dir, samples=base)}
        orig = factors.read_evidence
        factors.read_evidence = lambda p: evs[p]  # type: ignore[assignment]
        try:
            c = factors.compare_runs(own_dir, base_dir if kind != "self" else own_dir,
                                     {"verdict": "valid"})
        finally:
            factors.read_evidence = orig  # type: ignore[assignment]
        assert not _passes(c), (kind, c)


# -- upstream: weight audits and record rules ----------------------------------------------------


@SETTINGS
@given(kind=st.sampled_from(MUTATIONS), version=st.integers(0, 3))
def test_weight_audits_never_pass_bad_inputs(kind: str, version: int) -> None:
    with scratch() as d:
        wa = d / "weight-audit"
        (wa / "rollout").mkdir(parents=True)
        for v in range(4):
            (wa / f"{v}.json").write_text(json.dumps(audit(str(v), v)))
            (wa / "rollout" / f"{v}.json").write_text(json.dumps(
                audit(str(v), v, "rollout_loaded_parameters")))
        target = wa / f"{version}.json"
        if kind == "empty":
            shutil.rmtree(wa)
        elif kind == "truncated":
            target.write_text(target.read_text()[:40])
        elif kind == "duplicated":  # the same version under a second name
            (wa / f"v{version}.json").write_text(target.read_text())
        elif kind == "reordered":  # a version's audit under another version's name
            target.write_text(json.dumps(audit(str((version + 1) % 4), version)))
        else:
            target.unlink()
            target.symlink_to(target.name)
        problems: list[str] = []
        got = read_weight_audits(d, problems)
        reasons, _ = judge_weight_audit(got, "strict", False)
        chain = steps.Steps(weights=rsteps.weight_chain(d, []), problems=list(problems))
        assert reasons + problems or chain.weights_claim().status != "holds", kind


flags = st.sampled_from(["fallback", "fallback_used", "used_fallback", "split_kv_fallback"])
truthy = st.one_of(st.just(True), st.integers(1, 5), st.text(min_size=1, max_size=4))


@SETTINGS
@given(key=flags, value=truthy, depth=st.integers(0, 4),
       backend=st.sampled_from(["rlkernel.attention.deterministic.v1",
                                "vllm.production.attention", "rlk-ref.attention.x"]),
       platform=st.sampled_from(["cpu", "cuda", "rocm"]))
def test_a_truthy_fallback_anywhere_in_a_record_is_found(key: str, value: Any, depth: int,
                                                         backend: str, platform: str) -> None:
    leaf: Any = {key: value}
    for i in range(depth):
        leaf = {f"k{i}": [leaf]} if i % 2 else {f"k{i}": leaf}
    rec = {"backend_id": backend, "provenance": {"execution": {"runtime_platform": platform},
                                                 "nested": leaf}}
    fb, _ = upstream_findings([{"side": "rollout", "module": "attention", "source": "f.json",
                                "record": rec}], platform, [])
    assert fb and fb[0].startswith("attention rollout (f.json): record"), fb


# -- sidecar merge and (rank, call) coverage -------------------------------------------------------


def _sidecar(rank: int, tp: int, cp: int, value: float = 0.0) -> dict[str, Any]:
    total, resp = 12, 8
    from pytest_rlkernel_matrix.judge.read.sidecars import response_offsets

    keep = response_offsets(total, resp, cp, (rank // tp) % cp)
    t = torch.arange(resp, dtype=torch.float32) + value
    return {"schema_version": "rlkernel.vime_rocm_attention_mismatch_sidecar.v1", "rank": rank,
            "call_index": 0, "tensor_parallel_size": tp, "context_parallel_size": cp,
            "train_log_probs": [t[torch.from_numpy(keep.copy())]],
            "rollout_log_probs": [t[torch.from_numpy(keep.copy())]],
            "loss_masks": [torch.ones(resp)], "total_lengths": [total],
            "response_lengths": [resp]}


@SETTINGS
@given(kind=st.sampled_from(MUTATIONS), tp=st.integers(1, 2), cp=st.integers(1, 3),
       pick=st.integers(0, 5))
def test_sidecar_merge_never_passes_bad_inputs(kind: str, tp: int, cp: int, pick: int) -> None:
    world = tp * cp
    shards = [sh for r in range(world)
              for sh in read_sidecar(_sidecar(r, tp, cp), f"rank{r:05d}.pt")[1]]
    clean = merge(shards)
    assert not clean.problems and len(clean.samples) == 1
    r = pick % world
    if kind == "empty":
        got = merge([])
        assert not got.samples  # nothing merged: no sample to call equal
        return
    if kind == "truncated" and cp > 1:  # a CP rank's shard missing
        got = merge([sh for sh in shards if sh.cp_rank != (r // tp) % cp])
        assert got.problems
    elif kind == "duplicated" and tp > 1:  # a TP replica that disagrees with the first copy
        odd = read_sidecar(_sidecar(r, tp, cp, value=0.5), "odd.pt")[1]
        got = merge([*shards, *odd])
        assert got.problems
    elif kind == "reordered":  # the order of the files changes nothing
        got = merge(shards[::-1])
        assert not got.problems
        assert [s.train.tobytes() for s in got.samples] == [
            s.train.tobytes() for s in clean.samples]
    elif kind == "self":  # one rank's shard under every rank's key: replicas disagree or lack
        same = read_sidecar(_sidecar(0, tp, cp), "rank00000.pt")[1]
        got = merge(same * world)
        assert got.problems or cp == 1


@SETTINGS
@given(ranks=st.integers(1, 4), calls=st.integers(1, 5),
       drop=st.sets(st.tuples(st.integers(0, 4), st.integers(0, 3)), max_size=6))
def test_call_gaps_accept_only_a_full_grid(ranks: int, calls: int,
                                           drop: set[tuple[int, int]]) -> None:
    grid = {(c, r) for c in range(calls) for r in range(ranks)}
    have = grid - drop
    gaps = call_gaps(have)
    if not gaps and have:
        cs = {c for c, _ in have}
        rs = {r for _, r in have}
        assert have == {(c, r) for c in range(max(cs) + 1) for r in rs}


# -- the report cache ------------------------------------------------------------------------------


@SETTINGS
@given(kind=st.sampled_from(MUTATIONS), where=st.sampled_from(["cell", "repeat"]))
def test_the_cache_never_serves_a_changed_input(kind: str, where: str) -> None:
    with scratch() as root:
        cell = root / "cpu" / "attention-rr"
        again = cell.with_name("attention-rr.repeat2")
        for d in (cell, again):
            (d / "mismatch-sidecars").mkdir(parents=True)
            torch.save({"x": torch.ones(3)}, d / "mismatch-sidecars" / "rank00000.call00000000.pt")
            (d / "run.log").write_text("perf 0: {}\n")
        (cell / "cell-run.json").write_text(json.dumps({"policy": {
            "repeat_dir": again.name}}))
        rel, inputs = "cpu/attention-rr", {"artifact_dir": "cpu/attention-rr"}
        _, _, key = cache.lookup(root, rel, inputs)
        assert key is not None
        cache.store(root, rel, key, {"verdict": "valid"})
        assert cache.lookup(root, rel, inputs)[0] == {"verdict": "valid"}
        d = cell if where == "cell" else again
        pt = d / "mismatch-sidecars" / "rank00000.call00000000.pt"
        st_ = pt.stat()
        if kind == "empty":
            shutil.rmtree(d / "mismatch-sidecars")
            (d / "mismatch-sidecars").mkdir()
        elif kind == "truncated":  # the same size, other bytes, the mtime put back
            raw = bytearray(pt.read_bytes())
            raw[-30] ^= 0xFF
            tmp = pt.with_name("tmp")
            tmp.write_bytes(bytes(raw))
            os.replace(tmp, pt)
            os.utime(pt, ns=(st_.st_atime_ns, st_.st_mtime_ns))
        elif kind == "duplicated":
            shutil.copy2(pt, pt.with_name("rank00001.call00000000.pt"))
        elif kind == "reordered":  # rewritten in place, same size, mtime put back
            raw = pt.read_bytes()
            with open(pt, "r+b") as fh:
                fh.write(raw)
            os.utime(pt, ns=(st_.st_atime_ns, st_.st_mtime_ns))
        else:  # the repeat run replaced by a link to the first run
            shutil.rmtree(again)
            again.symlink_to(cell.name)
        hit, why, _ = cache.lookup(root, rel, inputs)
        assert hit is None and why, (kind, where)
