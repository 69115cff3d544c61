"""Fail closed (issue 9, points 1-3): every broken artifact gets its exact verdict and reason.

One generated cell directory per case (tests/cellkit.py), analysed in-process: fast, no runs.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from cellkit import RUN_ID, CellKit

from pytest_rlkernel_matrix import cli
from pytest_rlkernel_matrix.judge.read import evidence as evidence_mod
from pytest_rlkernel_matrix.judge.read.logscan import MAX_LINE_BYTES, scan_log
from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix
from pytest_rlkernel_matrix.store.atomic import write_json_atomic


def kit(tmp_path: Path, **kw: Any) -> CellKit:
    return CellKit(tmp_path, **kw).write()


def has(record: dict[str, Any], text: str) -> bool:
    return any(text in r for r in record["reasons"])


def strict_json(path: Path) -> Any:
    def refuse(name: str) -> None:
        raise AssertionError(f"bare {name} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


# -- 1. contract resolution -------------------------------------------------------------------


def test_clean_all_r_cell_is_judged_by_the_logp_provider_contract(tmp_path: Path) -> None:
    rec = kit(tmp_path).analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["reasons"] == []
    assert rec["contract"]["kind"] == "bitwise"
    assert rec["contract"]["sources"]["logp training"] == "bitwise"
    assert rec["contract_judged"] is True


def test_three_drifting_tokens_fail_the_bitwise_baseline(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.write_sidecar(k.sidecar(drift=1e-3, drift_tokens=3))
    rec = k.analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert has(rec, "bitwise contract violated: 3 of 70 active tokens differ")


def test_one_side_omitting_its_contract_is_a_reason_and_the_user_contract_judges(
        tmp_path: Path) -> None:
    k = CellKit(tmp_path, policy={"baseline_contract": {"kind": "bitwise"}, "backend": "cpu"})
    k.write()
    k.edit_readback("rollout", lambda d: d["operators"]["logp"]["provenance"].pop(
        "arithmetic_contract"))
    k.write_sidecar(k.sidecar(drift=0.05))
    rec = k.analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert has(rec, "contract: logp rollout: the logp provider declares no arithmetic_contract "
                    "while the other side declares one")
    assert has(rec, "bitwise contract violated: 16 of 70 active tokens differ")


def _no_provider_contract(k: CellKit) -> None:
    for side in ("training", "rollout"):
        k.edit_readback(side, lambda d: d["operators"]["logp"]["provenance"].pop(
            "arithmetic_contract"))


def test_unjudged_all_r_cell_fails_strict(tmp_path: Path) -> None:
    k = kit(tmp_path)
    _no_provider_contract(k)
    k.write_sidecar(k.sidecar(drift=0.05))
    rec = k.analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert rec["failed"] is True
    assert has(rec, "no contract: not judged")
    assert has(rec, "strict mode never passes an unjudged all-R cell")


def test_unjudged_all_r_cell_in_audit_is_recorded_with_its_drift(tmp_path: Path) -> None:
    k = kit(tmp_path, mode="audit")
    _no_provider_contract(k)
    k.write_sidecar(k.sidecar(drift=0.05))
    rec = k.analyze()
    assert rec["verdict"] == "valid"
    assert rec["contract_judged"] is False
    assert len(rec["reasons"]) == 1
    assert rec["reasons"][0].startswith("no contract: not judged")
    assert "drift: 16 of 70 active tokens differ (max |dlogp| 0.05)" in rec["reasons"][0]


@pytest.mark.parametrize(("contract", "reason"), [
    ({"kind": "tolerance", "max_abs_diff": float("nan")},
     "contract: logp training: tolerance contract with a non-finite limit max_abs_diff=nan"),
    ({"kind": "tolerance", "max_abs_diff": float("inf")},
     "non-finite limit max_abs_diff=inf"),
    ("approximately", "contract: logp training: unknown contract kind 'approximately'"),
    ({"kind": "tolerance"}, "tolerance contract without a numeric max_abs_diff (None)"),
])
def test_bad_provider_contracts_are_reasons(tmp_path: Path, contract: Any, reason: str) -> None:
    k = kit(tmp_path)
    for side in ("training", "rollout"):
        k.edit_readback(side, lambda d: d["operators"]["logp"]["provenance"].update(
            arithmetic_contract=contract))
    rec = k.analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert has(rec, reason), rec["reasons"]
    out = tmp_path / "rec.json"
    write_json_atomic(out, rec)
    strict_json(out)  # no bare NaN/Infinity reaches a report file


def test_contract_version_family_must_agree_topology_may_differ(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.edit_readback("rollout", lambda d: d["operators"]["logp"]["provenance"].update(
        contract_version="linear_logp:tp=2:cp=1:vocab=128"))
    assert k.analyze()["verdict"] == "valid"
    k.edit_readback("rollout", lambda d: d["operators"]["logp"]["provenance"].update(
        contract_version="vime.native.linear_logp.v1"))
    rec = k.analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert has(rec, "contract: logp contract_version differs: training "
                    "['linear_logp:tp=1:cp=1:vocab=128'], rollout ['vime.native.linear_logp.v1']")


def test_user_and_provider_contracts_conflict(tmp_path: Path) -> None:
    k = CellKit(tmp_path, policy={"baseline_contract": {"kind": "tolerance",
                                                        "max_abs_diff": 1e-3}, "backend": "cpu"})
    rec = k.write().analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert has(rec, "contract: conflicting contracts: logp training bitwise")
    assert has(rec, "matrix.toml baseline_contract tolerance(max_abs_diff=0.001)")


def test_user_tolerance_judges_when_the_provider_declares_none(tmp_path: Path) -> None:
    k = CellKit(tmp_path, policy={"baseline_contract": {"kind": "tolerance",
                                                        "max_abs_diff": 1e-2}, "backend": "cpu"})
    k.write()
    _no_provider_contract(k)
    k.write_sidecar(k.sidecar(drift=1e-3))
    assert k.analyze()["verdict"] == "valid"
    k.write_sidecar(k.sidecar(drift=0.05))
    rec = k.analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert has(rec, "declared tolerance max_abs_diff=0.01 exceeded: max |dlogp| 0.05")


def test_production_cell_drift_is_reported_not_judged(tmp_path: Path) -> None:
    rec = kit(tmp_path, case="P/R", mode="strict").analyze()
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["contract"]["kind"] == "none"
    assert rec["mismatch_count"] > 0


def test_bitwise_validation_passed_false_fails_the_all_r_cell(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.write_json("bitwise-validation.json", {
        "schema_version": "rlkernel.vime_cuda_bitwise_validation.v1", "passed": False,
        "train_rollout_logp": {"passed": False, "mismatch_count": 2}})
    rec = k.analyze()
    assert rec["verdict"] == "contract_mismatch"
    assert has(rec, "bitwise-validation.json: passed=False")


@pytest.mark.parametrize(("line", "error"), [
    ('baseline_contract = "approx"', "matrix.baseline_contract: 'approx' is not a contract"),
    ('baseline_contract = { kind = "tolerance", max_abs_diff = nan }',
     "matrix.baseline_contract.max_abs_diff: Input should be a finite number"),
    ('baseline_contract = { kind = "tolerance", max_abs_diff = -1.0 }',
     "matrix.baseline_contract.max_abs_diff: Input should be greater than or equal to 0"),
    ('baseline_contract = { kind = "tolerance" }',
     "matrix.baseline_contract: a tolerance contract needs max_abs_diff"),
    ("min_samples_per_rank = 0", "matrix.min_samples_per_rank"),
])
def test_matrix_toml_contract_errors_name_file_and_key(tmp_path: Path, line: str,
                                                       error: str) -> None:
    path = tmp_path / "matrix.toml"
    path.write_text(f'[matrix]\n{line}\n[runner]\ncommand = "true"\n'
                    '[hardware.cpu]\nbackend = "cpu"\n')
    with pytest.raises(MatrixFileError) as info:
        load_matrix(path)
    assert str(path) in str(info.value)
    assert error in str(info.value)


def test_matrix_toml_accepts_bitwise_and_a_tolerance_table(tmp_path: Path) -> None:
    path = tmp_path / "matrix.toml"
    for line, dumped in (('baseline_contract = "bitwise"', {"kind": "bitwise"}), (
            'baseline_contract = { kind = "tolerance", max_abs_diff = 1e-6 }',
            {"kind": "tolerance", "max_abs_diff": 1e-6})):
        path.write_text(f'[matrix]\n{line}\n[runner]\ncommand = "true"\n'
                        '[hardware.cpu]\nbackend = "cpu"\n')
        contract = load_matrix(path).matrix.baseline_contract
        assert contract is not None and contract.as_dict() == dumped


def test_json_writer_is_strict(tmp_path: Path) -> None:
    import numpy as np

    out = tmp_path / "r.json"
    write_json_atomic(out, {"a": float("nan"), "b": [float("inf"), -math.inf, 1.5],
                            "c": np.float32("nan"), "d": np.int64(3)})
    assert strict_json(out) == {"a": None, "b": [None, None, 1.5], "c": None, "d": 3}


# -- 2. evidence ties to the run --------------------------------------------------------------


def test_readback_without_case_id(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.edit_readback("rollout", lambda d: d["operators"]["ffn"].pop("case_id"))
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert has(rec, "route: ffn rollout: readback (vllm-rollout-107.json) carries no case_id: "
                    "cannot tie it to the requested case R/R")


def test_rl_kernel_claim_with_a_production_backend_id(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.edit_readback("rollout", lambda d: d["operators"]["attention"].update(
        backend_id="vllm.production.attention"))
    rec = k.analyze()
    assert rec["verdict"] == "fallback"
    assert has(rec, "attention rollout: claims rl_kernel but backend_id "
                    "'vllm.production.attention' is not an RL-Kernel backend (silent fallback)")


def test_rl_kernel_claim_with_zero_calls(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.edit_readback("training", lambda d: d["operators"]["ffn"].update(call_count=0))
    rec = k.analyze()
    assert rec["verdict"] == "fallback"
    assert has(rec, "ffn training: claims rl_kernel but call_count is 0")


def test_sidecar_rank_field_disagrees_with_its_name(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.write_sidecar(k.sidecar(rank=1))
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert has(rec, "rank file mismatch-sidecars/rank00000.call00000000.pt: rank field 1 != "
                    "rank 0 in the file name")


def test_one_sidecar_copied_as_three_ranks(tmp_path: Path) -> None:
    k = kit(tmp_path)
    src = k.dir / "mismatch-sidecars" / "rank00000.call00000000.pt"
    for r in (1, 2):
        shutil.copy(src, src.with_name(f"rank{r:05d}.call00000000.pt"))
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert has(rec, "byte-identical rank files mismatch-sidecars/rank00000.call00000000.pt, "
                    "mismatch-sidecars/rank00001.call00000000.pt, "
                    "mismatch-sidecars/rank00002.call00000000.pt")


def test_rank_files_alike_at_both_ends_are_not_called_byte_identical(tmp_path: Path) -> None:
    """The sidecars' sha256 is taken only for files whose size and first and last 4 KiB agree
    (`evidence._exact_digests`): one byte changed in the middle is another file, a copy the
    same file."""
    from pytest_rlkernel_matrix.judge.read import evidence

    k = kit(tmp_path)
    data = k.sidecar()
    n = 6000
    data["train_log_probs"][0] = -torch.rand(n)
    data["rollout_log_probs"][0] = data["train_log_probs"][0].clone()
    data["loss_masks"][0] = torch.ones(n)
    data["total_lengths"][0], data["response_lengths"][0] = n + 8, n
    src = k.write_sidecar(data)
    raw = bytearray(src.read_bytes())
    raw[len(raw) // 2] ^= 1  # inside a tensor's record (its CRC is not read)
    src.with_name("rank00001.call00000000.pt").write_bytes(bytes(raw))
    shutil.copy(src, src.with_name("rank00002.call00000000.pt"))
    assert len(raw) > 3 * 8192
    assert evidence._provisional_digest(bytes(raw)) == evidence._provisional_digest(
        src.read_bytes())
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    said = [r for r in rec["reasons"] if "byte-identical" in r]
    assert said == ["byte-identical rank files mismatch-sidecars/rank00000.call00000000.pt, "
                    "mismatch-sidecars/rank00002.call00000000.pt: one rank's evidence copied, "
                    "not separate ranks"], rec["reasons"]


def test_ranks_must_be_0_to_n_minus_1(tmp_path: Path) -> None:
    k = kit(tmp_path)
    (k.dir / "mismatch-sidecars" / "rank00000.call00000000.pt").unlink()
    k.write_sidecar(k.sidecar(rank=3), "rank00003.call00000000.pt")
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert has(rec, "rank files hold ranks [3]: not 0..0")


def test_readback_from_another_run(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.edit_readback("rollout", lambda d: d.update(run_id="cpu-attention-rr-OTHER"))
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert has(rec, f"run id 'cpu-attention-rr-OTHER' in readbacks/vllm-rollout-107.json is not "
                    f"this run's {RUN_ID!r}: artifact from another run")


def test_runtime_platform_must_match_the_profile(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.edit_readback("rollout", lambda d: d["operators"]["ffn"]["provenance"]["execution"].update(
        runtime_platform="rocm"))
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert has(rec, "runtime platform 'rocm' (ffn rollout readback) does not match the hardware "
                    "profile's backend 'cpu'")


def test_weight_audits_missing_or_from_one_side(tmp_path: Path) -> None:
    k = kit(tmp_path)  # the older `v0.<framework>-<target>.json` form, still read
    (k.dir / "weight-audit" / "v0.vllm-rollout.json").unlink()
    rec = k.analyze()  # no rollout-side audit: recorded, not a reason by itself (issue 20)
    assert rec["verdict"] == "valid", rec["reasons"]
    assert rec["weight_audit"]["rollout_audited"] is False
    assert rec["weight_audit"]["notes"][0].startswith(
        "weight audit: the rollout side is not audited by the framework")
    (k.dir / "weight-audit" / "v0.megatron-training.json").unlink()
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert has(rec, "no weight-audit files: weight version not verified (training rank 0 writes "
                    "weight-audit/<version>.json)")


def test_coverage_below_the_declared_minimum(tmp_path: Path) -> None:
    k = CellKit(tmp_path, samples=1, policy={"min_samples_per_rank": 2, "min_active_tokens": 20,
                                             "backend": "cpu"})
    rec = k.write().analyze()
    assert rec["verdict"] == "incomparable"
    assert has(rec, "coverage: rank 0 holds 1 logprob sample, below min_samples_per_rank=2")
    assert has(rec, "coverage: 16 active tokens, below min_active_tokens=20")


def test_default_coverage_needs_a_sample_per_rank(tmp_path: Path) -> None:
    k = kit(tmp_path)
    empty = k.sidecar(rank=1)
    for key in ("train_log_probs", "rollout_log_probs", "loss_masks", "total_lengths",
                "response_lengths"):
        empty[key] = []
    k.write_sidecar(empty, "rank00001.call00000000.pt")
    rec = k.analyze()
    assert rec["verdict"] == "incomparable"
    assert has(rec, "coverage: rank 1 holds 0 logprob samples, below min_samples_per_rank=1")


def test_route_fallback_line_counts_even_with_readbacks(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.log("[RL-Kernel][route] framework=vllm target=rollout module=attention case=R/R "
          "implementation=rl_kernel fallback=true")
    rec = k.analyze()
    assert rec["verdict"] == "fallback"
    assert has(rec, "run.log: [RL-Kernel][route] framework=vllm target=rollout module=attention")


def test_non_rl_kernel_fallback_words_do_not_count_with_readbacks(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.log("INFO engine config: allow_fallback=True, sampler fallback=true")
    assert k.analyze()["verdict"] == "valid"


@pytest.mark.parametrize(("lines", "reason"), [
    (["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
      "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"],
     "run.log reports fatal errors despite exit 0: oom: torch.OutOfMemoryError"),
    (["RuntimeError: HIP error: invalid device function"], "hip_error: RuntimeError: HIP error"),
    (["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
      "ValueError: boom"], "traceback: ValueError: boom"),
])
def test_fatal_log_patterns_count_despite_exit_0(tmp_path: Path, lines: list[str],
                                                 reason: str) -> None:
    k = kit(tmp_path)
    k.log(*lines)
    rec = k.analyze()
    assert rec["verdict"] == "error"
    assert has(rec, reason), rec["reasons"]


def test_benign_nccl_warning_is_a_note_not_an_error(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.log("NCCL WARN Failed to open libibverbs.so[.1]")
    rec = k.analyze()
    assert rec["verdict"] == "valid"
    assert "nccl_warning" in rec["log_errors"]


def test_exit_code_file_and_cell_run_disagree(tmp_path: Path) -> None:
    k = kit(tmp_path)
    (k.dir / "exit-code").write_text("139\n")
    rec = k.analyze()
    assert rec["verdict"] == "error"
    assert has(rec, "exit-code file says '139' but cell-run.json says 0: the records disagree")
    (k.dir / "exit-code").unlink()
    assert has(k.analyze(), "no exit-code file: the run's exit status is unverified")


# -- 3. readers never crash, hang or blow up --------------------------------------------------


def test_wrong_types_in_a_readback(tmp_path: Path) -> None:
    k = kit(tmp_path)
    k.edit_readback("rollout", lambda d: d.update(fallbacks=5))
    rec = k.analyze()
    assert rec["verdict"] == "error"
    assert has(rec, "unreadable artifact: readback vllm-rollout-107.json: fallbacks is int, "
                    "not a list")


def test_deeply_nested_json_is_a_reason(tmp_path: Path) -> None:
    k = kit(tmp_path)
    (k.dir / "readbacks" / "vllm-rollout-107.json").write_text("[" * 200_000 + "]" * 200_000)
    rec = k.analyze()
    assert rec["verdict"] == "error"
    assert has(rec, "unreadable vllm-rollout-107.json: RecursionError")


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda d: d.update(train_log_probs=torch.tensor(1.0)),
     "train_log_probs is Tensor, not a list"),
    (lambda d: d["train_log_probs"].__setitem__(0, torch.tensor(1.0)),
     "train_log_probs[0] is a 0-d tensor, expected 1-d"),
    (lambda d: d.update(context_parallel_size=2, total_lengths=[-5] * 4),
     "total_lengths[0] is -5, below 1"),
    (lambda d: d.update(rank="zero"), "rank is 'zero', not an integer"),
    (lambda d: d.update(loss_masks=[[1, [2]]] * 4), "ValueError"),
])
def test_malformed_sidecars_are_errors(tmp_path: Path, mutate: Any, reason: str) -> None:
    k = kit(tmp_path)
    data = k.sidecar()
    mutate(data)
    k.write_sidecar(data)
    rec = k.analyze()
    assert rec["verdict"] == "error"
    assert has(rec, "unreadable artifact: sidecar mismatch-sidecars/rank00000.call00000000.pt: "
                    "malformed")
    assert has(rec, reason), rec["reasons"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_and_escaping_symlink_are_refused(tmp_path: Path) -> None:
    k = kit(tmp_path / "root")
    rb = k.dir / "readbacks" / "vllm-rollout-107.json"
    rb.unlink()
    os.mkfifo(rb)  # opening it for reading would block forever without O_NONBLOCK
    outside = tmp_path / "secret.json"
    outside.write_text("{}")
    (k.dir / "manifest.json").symlink_to(outside)
    rec = k.analyze()
    assert rec["verdict"] == "error"
    assert has(rec, "readbacks/vllm-rollout-107.json: not a regular file: refused")
    assert has(rec, "manifest.json: symlink leaves the cell directory")


def test_oversized_artifact_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    k = kit(tmp_path)
    monkeypatch.setattr(evidence_mod, "MAX_JSON_BYTES", 64)
    rec = k.analyze()
    assert rec["verdict"] == "error"
    assert has(rec, "-byte cap for this artifact: not read")


def test_long_log_lines_are_capped_and_records_on_them_not_parsed(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text("perf 0: {" * 40_000 + "\n"
                   + "x" * (MAX_LINE_BYTES + 10) + "CUDA error: hidden past the cap\n"
                   + "perf 1: {'perf/step_time': 2.0}\n")
    scan = scan_log(log)
    assert scan.lines == 3
    assert scan.long_lines == 2
    assert "cuda_error" not in scan.errors
    assert scan.unparsed_records == 1
    assert scan.records["perf"] == [(1, {"perf/step_time": 2.0})]


def test_corrupt_cell_run_json_is_an_error_record(tmp_path: Path) -> None:
    k = kit(tmp_path)
    (k.dir / "cell-run.json").write_text('{"cell": 5')
    rec = k.analyze()
    assert rec["verdict"] == "error"
    assert rec["failed"] is True
    assert has(rec, "cell-run.json: ")
    assert has(rec, "cell-run.json: unreadable: JSONDecodeError")


def test_report_command_rewrites_a_root_with_corrupt_files(tmp_path: Path) -> None:
    good = kit(tmp_path)
    bad = kit(tmp_path, module="ffn", case="P/R", mode="strict")
    (bad.dir / "cell-run.json").write_text("not json")
    (tmp_path / "matrix-report.json").write_text('{"cells": [1, 2')
    assert cli.main(["report", str(tmp_path)]) == 0  # `rlk-matrix report <root>`
    report = strict_json(tmp_path / "matrix-report.json")
    by_dir = {c["artifact_dir"]: c for c in report["cells"]}
    assert by_dir[f"cpu/{good.cell.slug}"]["verdict"] == "valid"
    broken = by_dir[f"cpu/{bad.cell.slug}"]
    assert broken["verdict"] == "error"
    assert (broken["module"], broken["case"]) == ("ffn", "P/R")
    assert broken["reasons"][0].startswith("cell-run.json: ")
    assert report["reanalysis_notes"][0].startswith("matrix-report.json was unreadable")


def test_an_exception_in_a_cell_is_an_error_record(pytester: pytest.Pytester, make_matrix: Any,
                                                   tmp_path: Path) -> None:
    make_matrix(modules='["attention"]')
    pytester.makeconftest('''
def pytest_rlk_cell_env(config, cell, env):
    if cell.case == "P/R":
        raise RuntimeError("hook exploded")
''')
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "-p", "no:cacheprovider",
                                "-k", "R/R or P/R")
    assert "INTERNALERROR" not in result.stdout.str()
    assert result.ret == 1
    cells = {c["case"]: c for c in json.loads((root / "matrix-report.json").read_text())["cells"]}
    assert cells["P/R"]["verdict"] == "error" and cells["P/R"]["failed"] is True
    assert cells["P/R"]["reasons"] == ["internal error: RuntimeError: hook exploded"]
    assert cells["R/R"]["verdict"] == "valid"


def test_repr_failure_of_any_exception_works_on_pytest_9(pytester: pytest.Pytester,
                                                         make_matrix: Any) -> None:
    make_matrix(modules='["attention"]')
    items, _ = pytester.inline_genitems("-p", "no:cacheprovider")
    assert items
    try:
        raise ValueError("not a verdict")
    except ValueError:
        info = pytest.ExceptionInfo.from_current()
    for style in (None, "short"):  # pytest 9's Function.repr_failure takes no `style`
        assert "ValueError: not a verdict" in str(items[0].repr_failure(info, style=style))
