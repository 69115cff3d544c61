"""Issue 34: a comparison that compared nothing, or whose inputs are incomplete or not
independent, is "not judged" (or `incomparable`), never a pass; strict fails a failing claim;
odd files are reasons, not crashes; the report cache keys what a judgement reads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cellkit import RUN_ID, CellKit

from pytest_rlkernel_matrix.judge.localise import factors, probe
from pytest_rlkernel_matrix.judge.read.metrics import Sample
from pytest_rlkernel_matrix.judge.reproducibility import steps

# -- multi-step cells -----------------------------------------------------------------------------


def audit(version: str, seed: int, scope: str = "all_exported_parameters") -> dict[str, Any]:
    tensors = {"w": {"sha256": hashlib.sha256(f"w:{seed}".encode()).hexdigest(),
                     "shape": [4], "dtype": "torch.float32"}}
    digest = hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest()
    return {"version": version, "scope": scope, "sha256": digest, "tensor_count": 1,
            "tensors": tensors}


def steps_cell(root: Path, calls: tuple[int, ...] = (0, 1, 2, 3), versions: int = 4,
               tp: int = 1, mode: str = "strict", drop: tuple[int, int] | None = None,
               **kw: Any) -> CellKit:
    """A clean all-R cell of several steps: per call one sidecar per rank (`drop`: the (rank,
    call) file left out), upstream weight audits 0..versions-1 of both sides, no manifest."""
    k = CellKit(root, mode=mode, **kw).write()
    for old in (k.dir / "weight-audit").glob("v0.*.json"):
        old.unlink()
    (k.dir / "mismatch-sidecars" / "rank00000.call00000000.pt").unlink()
    for call in calls:
        for rank in range(tp):
            if (rank, call) == drop:
                continue
            data = k.sidecar()
            data.update(rank=rank, call_index=call, tensor_parallel_size=tp)
            data["train_log_probs"] = [t - call for t in data["train_log_probs"]]
            data["rollout_log_probs"] = [t - call for t in data["rollout_log_probs"]]
            data["rank_tag"] = torch.tensor([rank])  # replicas agree, files are not copies
            k.write_sidecar(data, f"rank{rank:05d}.call{call:08d}.pt")
    for v in range(versions):
        k.write_json(f"weight-audit/{v}.json", audit(str(v), v))
        k.write_json(f"weight-audit/rollout/{v}.json", audit(str(v), v,
                                                             "rollout_loaded_parameters"))
    return k


def status(rec: dict[str, Any]) -> dict[str, str]:
    return {n: c["status"] for n, c in rec["claims"].items()}


def test_a_clean_steps_cell_holds(tmp_path: Path) -> None:
    rec = steps_cell(tmp_path).analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert status(rec)["train_rollout_bitwise"] == "holds"
    assert status(rec)["weights_bitwise"] == "holds"


def test_a_missing_step_without_a_manifest_is_no_pass(tmp_path: Path) -> None:
    """Calls 0, 1, 3 with audits 0..3: no manifest to say how many steps ran."""
    rec = steps_cell(tmp_path, calls=(0, 1, 3)).analyze()
    assert rec["verdict"] == "incomparable"
    assert any("sidecar calls [0, 1, 3] are not 0..3: no sidecar of call(s) [2]" in r
               for r in rec["reasons"]), rec["reasons"]
    assert status(rec)["train_rollout_bitwise"] == "not judged"
    assert status(rec)["weights_bitwise"] == "not judged"


def test_calls_must_match_the_weight_versions(tmp_path: Path) -> None:
    rec = steps_cell(tmp_path, calls=(0, 1, 2), versions=4).analyze()
    assert rec["verdict"] == "incomparable"
    assert any("weight versions 0..3 and sidecar calls 0..2 cover different steps" in r
               for r in rec["reasons"]), rec["reasons"]
    assert status(rec)["train_rollout_bitwise"] == "not judged"


def test_one_missing_rank_call_sidecar_names_rank_and_call(tmp_path: Path) -> None:
    """tp 2, 6 steps, rank 1's sidecar of call 4 missing (a whole rank dropped was caught)."""
    rec = steps_cell(tmp_path, calls=tuple(range(6)), versions=6, tp=2, drop=(1, 4)).analyze()
    assert rec["verdict"] == "incomparable", rec["reasons"]
    assert any("sidecar of rank 1, call 4 is missing (rank00001.call00000004.pt" in r
               for r in rec["reasons"]), rec["reasons"]


# -- run to run -----------------------------------------------------------------------------------


def _with_repeat(tmp_path: Path, repeat: str = "attention-rr.repeat2") -> tuple[CellKit, Path]:
    k = steps_cell(tmp_path / "a", mode="strict")
    again = k.dir.parent / repeat
    return k, again


def _copy_run(k: CellKit, again: Path, run_id: str = "second-run") -> None:
    shutil.copytree(k.dir, again)
    meta = json.loads((again / "cell-run.json").read_text())
    meta["run_id"] = run_id
    (again / "cell-run.json").write_text(json.dumps(meta))


def _judge_with(k: CellKit, repeat: str) -> dict[str, Any]:
    meta = json.loads((k.dir / "cell-run.json").read_text())
    meta["policy"] = {**meta["policy"], "repeat_dir": repeat}
    (k.dir / "cell-run.json").write_text(json.dumps(meta))
    return k.analyze()


def test_run_to_run_holds_only_against_a_run_of_its_own(tmp_path: Path) -> None:
    k, again = _with_repeat(tmp_path)
    _copy_run(k, again)
    rec = _judge_with(k, again.name)
    assert status(rec)["run_to_run_bitwise"] == "holds", rec["claims"]
    # the same run id: a copy, not a second run
    _copy_run(k, again.with_name("copy"), run_id=RUN_ID)
    rec = _judge_with(k, "copy")
    assert status(rec)["run_to_run_bitwise"] == "not judged"
    assert "carries the first run's run id" in rec["claims"]["run_to_run_bitwise"]["detail"]


@pytest.mark.parametrize("how", ["symlink", "self", "dot", "path"])
def test_the_first_run_as_its_own_repeat_is_not_judged(tmp_path: Path, how: str) -> None:
    k, again = _with_repeat(tmp_path)
    name = {"symlink": again.name, "self": k.dir.name, "dot": ".", "path": "../a"}[how]
    if how == "symlink":
        again.symlink_to(k.dir.name)
    rec = _judge_with(k, name)
    assert status(rec)["run_to_run_bitwise"] == "not judged", rec["claims"]
    assert rec["verdict"] == "valid"  # undeclared and not judged: reported only


def test_problems_reading_the_repeat_run_are_kept(tmp_path: Path) -> None:
    k, again = _with_repeat(tmp_path)
    _copy_run(k, again)
    (again / "weight-audit" / "rollout" / "2.json").write_text("{not json")
    rec = _judge_with(k, again.name)
    c = rec["claims"]["run_to_run_bitwise"]
    assert c["status"] == "not judged" and "2.json" in c["detail"], c


def test_a_fifo_in_the_repeat_run_is_a_reason_and_the_cell_is_still_judged(
        tmp_path: Path) -> None:
    k, again = _with_repeat(tmp_path)
    _copy_run(k, again)
    target = again / "mismatch-sidecars" / "rank00000.call00000001.pt"
    target.unlink()
    os.mkfifo(target)
    (again / "exit-code").unlink()
    os.mkfifo(again / "exit-code")
    rec = _judge_with(k, again.name)
    assert rec["verdict"] == "valid", rec["reasons"]  # its own evidence, judged
    assert status(rec)["run_to_run_bitwise"] == "not judged"
    (again / "exit-code").unlink()
    (again / "exit-code").write_text("0\n")
    rec = _judge_with(k, again.name)
    assert rec["verdict"] == "valid", rec["reasons"]
    assert status(rec)["run_to_run_bitwise"] == "not judged", rec["claims"]


# -- strict fails a failing claim -----------------------------------------------------------------


def test_strict_fails_an_undeclared_failing_claim_and_a_declared_unjudged_one(
        tmp_path: Path) -> None:
    k, again = _with_repeat(tmp_path)
    _copy_run(k, again)
    data = torch.load(again / "mismatch-sidecars" / "rank00000.call00000002.pt",
                      weights_only=True)
    data["train_log_probs"][1] = data["train_log_probs"][1] - 1e-3
    data["rollout_log_probs"][1] = data["rollout_log_probs"][1] - 1e-3
    torch.save(data, again / "mismatch-sidecars" / "rank00000.call00000002.pt")
    rec = _judge_with(k, again.name)
    assert rec["verdict"] == "contract_mismatch" and rec["failed"]
    assert rec["reasons"] == ["baseline claim (not declared) run_to_run_bitwise: fails (fails "
                              "at step 2, rank 0, sample 1)"]
    # audit: reported, not failed
    meta = json.loads((k.dir / "cell-run.json").read_text())
    meta["mode"] = "audit"
    (k.dir / "cell-run.json").write_text(json.dumps(meta))
    k.mode = "audit"
    assert k.analyze()["verdict"] == "valid"


def test_strict_declared_claim_not_judged_fails() -> None:
    claims = {n: {"name": n, "status": "holds", "detail": "", "text": f"{n}: holds"}
              for n in steps.CLAIMS}
    claims["run_to_run_bitwise"] = {"name": "run_to_run_bitwise", "status": "not judged",
                                    "detail": "one run", "text": "run_to_run_bitwise: not "
                                    "judged (one run)"}
    assert steps.apply_declared(claims, ("run_to_run_bitwise",), "strict", "valid", []) == (
        "incomparable", ["declared baseline claim run_to_run_bitwise: not judged (one run)"])
    assert steps.apply_declared(claims, (), "strict", "valid", []) == ("valid", [])
    # a declared claim missing from the record is not judged, never a pass
    assert steps.apply_declared({}, ("weights_bitwise",), "strict", "valid", [])[0] == (
        "incomparable")


def test_the_default_matrix_declares_the_claims_the_reference_workload_meets() -> None:
    from pytest_rlkernel_matrix.spec.matrix import load_matrix

    m = load_matrix(Path(__file__).resolve().parents[1] / "matrix.toml")
    assert set(m.matrix.baseline_claims) == {"train_rollout_bitwise", "weights_bitwise"}


# -- factors: different lengths, nothing compared -------------------------------------------------


def _sample(n: int, call: int = 0, sample: int = 0, value: float = -1.0) -> Sample:
    return Sample(train=np.full(n, value, np.float32), rollout=np.full(n, value, np.float32),
                  mask=np.ones(n, bool), rank=0, sample=sample, call=call)


def test_different_lengths_count_as_a_difference() -> None:
    own = [_sample(5, sample=i) for i in range(3)]
    base = [_sample(7, sample=i) for i in range(3)]
    c = factors.compare_samples(own, base)
    assert c["samples_lengths_differ"] == 3
    assert c["compared_logprobs"] == 6 and c["rollout_logprobs_differ"] == 6
    assert c["tokens_equal"] is False


def _factor_dirs(tmp_path: Path, own_len: int, base_len: int) -> tuple[Path, Path]:
    dirs = []
    for name, n in (("own", own_len), ("base", base_len)):
        k = CellKit(tmp_path / name).write()
        data = k.sidecar()
        for key in ("train_log_probs", "rollout_log_probs", "loss_masks"):
            data[key] = [t[:n] if n else t[:0] for t in data[key]]
        data["response_lengths"] = [n] * len(data["train_log_probs"])
        data["total_lengths"] = [n + 8] * len(data["train_log_probs"])
        k.write_sidecar(data)
        # two runs, shown distinct (issue 51): their own run ids and run.log bytes
        meta = json.loads((k.dir / "cell-run.json").read_text())
        k.write_json("cell-run.json", {**meta, "run_id": f"{meta['run_id']}-{name}"})
        k.log(f"run {name}")
        dirs.append(k.dir)
    return dirs[0], dirs[1]


def test_a_factor_that_changes_every_length_is_not_invariant(tmp_path: Path) -> None:
    own, base = _factor_dirs(tmp_path, 10, 12)
    c = factors.compare_runs(own, base, {"verdict": "valid"})
    assert c["judged"] is True
    assert c["rollout_logprobs_differ"] > 0 and c["samples_lengths_differ"] == 4
    # one run directory for both: nothing independent to compare
    c = factors.compare_runs(own, own, {"verdict": "valid"})
    assert c["judged"] is False and "one run directory" in c["why"]


def test_a_factor_comparison_over_no_active_position_is_not_judged(tmp_path: Path) -> None:
    own = [Sample(train=np.zeros(4, np.float32), rollout=np.zeros(4, np.float32),
                  mask=np.zeros(4, bool), rank=0, sample=0, call=0)]
    c = factors.compare_samples(own, own)
    assert c["compared_logprobs"] == 0


# -- probe ----------------------------------------------------------------------------------------


OPS = ["model.embed_tokens", "model.norm"]
TOKENS = [{"sample": 0, "token": 0, "position": 3, "token_id": 1},
          {"sample": 0, "token": 1, "position": 4, "token_id": 2}]


def probe_file(d: Path, side: str, rank: int = 0, *, ops: list[str] | None = None,
               outputs: dict[str, torch.Tensor] | None = None,
               tokens: list[dict[str, int]] | None = None) -> None:
    toks = TOKENS if tokens is None else tokens
    data = {"schema_version": probe.PROBE_SCHEMA, "side": side, "rank": rank,
            "operators": OPS if ops is None else ops, "tokens": toks,
            "outputs": ({o: torch.ones(len(toks), 4) for o in OPS} if outputs is None
                        else outputs),
            "log_softmax": torch.log_softmax(torch.zeros(len(toks), 8), -1), "cases": {}}
    d.mkdir(parents=True, exist_ok=True)
    torch.save(data, d / f"{side}.rank{rank:05d}.pt")


def index(d: Path, files: list[str]) -> None:
    (d / "index.json").write_text(json.dumps({"schema_version": probe.PROBE_SCHEMA,
                                              "operators": OPS, "tokens": TOKENS,
                                              "files": files}))


def test_a_clean_probe_has_no_divergence(tmp_path: Path) -> None:
    d = tmp_path / "probes"
    for s in probe.SIDES:
        probe_file(d, s)
    index(d, ["training.rank00000.pt", "rollout.rank00000.pt"])
    assert probe.localise(d)["status"] == "no_divergence"


def test_empty_operators_is_nothing_compared(tmp_path: Path) -> None:
    d = tmp_path / "probes"
    for s in probe.SIDES:
        probe_file(d, s, ops=[], outputs={})
    loc = probe.localise(d)
    assert loc["status"] == "incomparable"
    assert "nothing compared" in " ".join(loc["reasons"]) or "no operator" in loc["summary"]


def test_an_operator_missing_from_the_list_is_compared(tmp_path: Path) -> None:
    d = tmp_path / "probes"
    outs = {o: torch.ones(2, 4) for o in [*OPS, "lm_head"]}
    probe_file(d, "training", outputs=outs)
    outs = dict(outs, lm_head=torch.full((2, 4), 2.0))
    probe_file(d, "rollout", outputs=outs)
    index(d, ["training.rank00000.pt", "rollout.rank00000.pt"])
    loc = probe.localise(d)
    assert loc["status"] == "localised" and loc["first_divergent"]["operator"] == "lm_head"
    assert any("not in the probe's operators list" in r for r in loc["reasons"])


@pytest.mark.parametrize("fault", ["absent", "truncated"])
def test_an_absent_file_or_a_truncated_replica_is_no_pass(tmp_path: Path, fault: str) -> None:
    d = tmp_path / "probes"
    for s in probe.SIDES:
        probe_file(d, s)
    files = [f"{s}.rank{r:05d}.pt" for s in probe.SIDES for r in range(2)]
    index(d, files)
    if fault == "truncated":
        for s in probe.SIDES:
            probe_file(d, s, rank=1, tokens=TOKENS[:1],
                       outputs={o: torch.ones(1, 4) for o in OPS})
    loc = probe.localise(d)
    assert loc["status"] == "incomparable", loc
    want = "which is absent" if fault == "absent" else "truncated"
    assert any(want in r for r in loc["reasons"]), loc["reasons"]


def test_rows_of_different_widths_across_ranks_are_a_reason(tmp_path: Path) -> None:
    d = tmp_path / "probes"
    t0, t1 = TOKENS[:1], TOKENS[1:]
    for s in probe.SIDES:  # two CP ranks, each its own token, one row wider
        probe_file(d, s, 0, tokens=t0, outputs={o: torch.ones(1, 4) for o in OPS})
        probe_file(d, s, 1, tokens=t1, outputs={o: torch.ones(1, 6) for o in OPS})
    loc = probe.localise(d)
    assert loc["status"] == "incomparable"
    assert any("different widths" in r for r in loc["reasons"]), loc["reasons"]


# -- the report cache keys the repeat run ---------------------------------------------------------


def test_the_report_cache_reads_again_when_the_repeat_run_changes(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.report.reanalyze import reanalyze

    k, again = _with_repeat(tmp_path)
    _copy_run(k, again)
    _judge_with(k, again.name)
    root = tmp_path / "a"
    logs: list[str] = []
    report = json.loads(reanalyze(root, jobs=1, progress=False, log=logs.append).read_text())
    (cell,) = report["cells"]
    assert cell["claims"]["run_to_run_bitwise"]["status"] == "holds"
    # the repeat run re-run with other bytes: served stale before, read again now
    data = torch.load(again / "mismatch-sidecars" / "rank00000.call00000003.pt",
                      weights_only=True)
    data["rollout_log_probs"][0] = data["rollout_log_probs"][0] - 1.0
    torch.save(data, again / "mismatch-sidecars" / "rank00000.call00000003.pt")
    logs.clear()
    report = json.loads(reanalyze(root, jobs=1, progress=False, log=logs.append).read_text())
    (cell,) = report["cells"]
    assert cell["claims"]["run_to_run_bitwise"]["status"] == "fails"
    assert any("a directory the judgement reads changed (attention-rr.repeat2)" in x
               for x in logs), logs
