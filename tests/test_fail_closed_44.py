"""Issue 44: one regression test per class of hole an adversarial read found (the fix is the
rule, an allow-list; these are the cases that showed each class)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from cellkit import BACKENDS, CellKit

CUDA_POLICY = {"baseline_contract": None, "min_samples_per_rank": 1, "min_active_tokens": 1,
               "backend": "cuda"}


def cuda_kit(tmp_path: Path, policy: dict[str, Any] | None = None) -> CellKit:
    """A clean R/R cell on a CUDA profile (records report CUDA execution, no Triton)."""
    k = CellKit(tmp_path, policy=dict(CUDA_POLICY if policy is None else policy))
    k.write()
    for side in ("training", "rollout"):
        k.edit_readback(side, lambda d: [op["provenance"]["execution"].update(
            runtime_platform="cuda") for op in d["operators"].values()])
    return k


def all_reasons(rec: dict[str, Any]) -> list[str]:
    """The verdict's reasons and every validity layer's (a fallback verdict shows its own)."""
    return rec["reasons"] + [r for j in rec["validity"].values() for r in j["reasons"]]


def edit_ops(k: CellKit, side: str, fn: Any) -> None:
    def each(d: dict[str, Any]) -> None:
        for op in d["operators"].values():
            op["provenance"]["execution"]["runtime_platform"] = "cuda"
            fn(d, op)
    k.edit_readback(side, each)


def test_the_cuda_kit_is_valid(tmp_path: Path) -> None:
    rec = cuda_kit(tmp_path).analyze()
    assert rec["verdict"] == "valid", rec["reasons"]


# -- upstream's rules restated, not applied -----------------------------------------------------

def test_a_triton_kernel_named_inside_a_list_is_triton_use(tmp_path: Path) -> None:
    k = cuda_kit(tmp_path)
    edit_ops(k, "rollout", lambda d, op: op["provenance"]["execution"].update(
        kernels=["flash_fwd", "_attn_fwd_triton_kernel"]))
    rec = k.analyze()
    assert rec["verdict"] != "valid"
    assert any("Triton" in r and "kernels[1]" in r for r in rec["reasons"]), rec["reasons"]


def test_a_platform_key_at_the_records_own_level_is_read_before_nested_ones(
        tmp_path: Path) -> None:
    """Upstream's `_runtime_platform` reads the mapping's own key first: here "rocm"."""
    k = cuda_kit(tmp_path)
    edit_ops(k, "training", lambda d, op: op["provenance"].update(runtime_platform="rocm"))
    rec = k.analyze()
    assert rec["verdict"] != "valid"
    assert any("'rocm'" in r and "CUDA" in r for r in rec["reasons"]), rec["reasons"]


def test_a_truthy_fallback_key_deeper_than_the_old_depth_limit_is_a_fallback(
        tmp_path: Path) -> None:
    deep: dict[str, Any] = {"fallback_used": "split"}
    for _ in range(80):
        deep = {"nested": deep}
    k = cuda_kit(tmp_path)
    edit_ops(k, "training", lambda d, op: op["provenance"].update(extra=deep))
    rec = k.analyze()
    assert rec["verdict"] == "fallback", rec["reasons"]
    assert any("fallback_used='split'" in r for r in rec["reasons"]), rec["reasons"]


def test_a_record_nested_deeper_than_it_can_be_walked_fails_closed(tmp_path: Path) -> None:
    """Upstream's recursive validator fails such a record (RecursionError); so do we, naming it."""
    deep: Any = {"fallback": False}
    for i in range(400):
        deep = {"nested": deep} if i % 2 else [deep]
    k = cuda_kit(tmp_path)
    edit_ops(k, "rollout", lambda d, op: op["provenance"].update(extra=deep))
    rec = k.analyze()
    assert rec["verdict"] != "valid"
    assert any("nested deeper than" in r for r in all_reasons(rec)), all_reasons(rec)


# -- declared policies that escape the rules ----------------------------------------------------

def _declare(k: CellKit, policy: dict[str, Any], rename: Any = None) -> None:
    for side in ("training", "rollout"):
        def each(d: dict[str, Any], op: dict[str, Any]) -> None:
            d["runtime_policy"] = {"schema_version": "rlk.runtime_policy.v1", **policy}
            if rename is not None:
                rename(op)
        edit_ops(k, side, each)


def test_a_backend_prefix_padded_with_whitespace_does_not_escape_rlkernels_rules(
        tmp_path: Path) -> None:
    k = cuda_kit(tmp_path)

    def rename(op: dict[str, Any]) -> None:
        if op["implementation"] == "rl_kernel":
            op["backend_id"] = " " + op["backend_id"]
            op["provenance"]["execution"]["triton_used"] = True
    _declare(k, {"backend_prefix": " rlkernel.", "platform": "cuda", "triton_allowed": True},
             rename)
    rec = k.analyze()
    assert rec["verdict"] != "valid"
    assert any("backend_prefix" in r for r in all_reasons(rec)), all_reasons(rec)
    assert any("Triton" in r for r in all_reasons(rec)), all_reasons(rec)


@pytest.mark.parametrize("prefix", ["vllm.", "Megatron.", "torch.", " VLLM. ", "vime."])
def test_a_framework_namespace_cannot_be_declared_as_the_runs_own(tmp_path: Path,
                                                                 prefix: str) -> None:
    """vLLM's production ids under a declared `vllm.` prefix must not count as the run's R."""
    k = cuda_kit(tmp_path)

    def rename(op: dict[str, Any]) -> None:
        if op["implementation"] == "rl_kernel":
            op["backend_id"] = f"{prefix.strip().lower()}production.{op['module']}"
    _declare(k, {"backend_prefix": prefix, "platform": "cuda", "triton_allowed": False}, rename)
    rec = k.analyze()
    assert rec["verdict"] != "valid"
    assert any("backend_prefix" in r and "namespace" in r for r in all_reasons(rec)), \
        all_reasons(rec)


@pytest.mark.parametrize("actual", [" rlkernel.attention.deterministic.v1",
                                    "RLKernel.attention.deterministic.v1"])
def test_a_padded_or_cased_r_id_on_a_p_route_line_is_a_mismatch(actual: str) -> None:
    from pytest_rlkernel_matrix.judge.route.crosscheck import log_route_findings

    line = {"framework": "vllm", "target": "rollout", "module": "attention",
            "requested": "production", "actual": actual, "fallback": "false"}
    _, mismatches = log_route_findings(["attention"], lambda m, s: "P", [line])
    assert mismatches and "an R backend, although P was requested" in mismatches[0]
    fallbacks, _ = log_route_findings(["attention"], lambda m, s: "R", [
        dict(line, requested="rl_kernel")])
    assert fallbacks, "an R route line must name the id as RL-Kernel writes it"


# -- missing facts that skip rules --------------------------------------------------------------

def test_a_cell_run_without_policy_backend_fails_closed_naming_the_missing_fact(
        tmp_path: Path) -> None:
    policy = {k: v for k, v in CUDA_POLICY.items() if k != "backend"}
    k = cuda_kit(tmp_path, policy)
    edit_ops(k, "rollout", lambda d, op: op["provenance"]["execution"].update(triton_used=True))
    rec = k.analyze()
    assert rec["verdict"] != "valid"
    assert any("policy.backend" in r for r in rec["reasons"]), rec["reasons"]


def test_an_unknown_platform_fails_closed(tmp_path: Path) -> None:
    k = cuda_kit(tmp_path, {**CUDA_POLICY, "backend": "tpu"})
    rec = k.analyze()
    assert rec["verdict"] != "valid"
    assert any("'tpu'" in r for r in rec["reasons"]), rec["reasons"]


def test_a_record_that_is_not_an_object_is_a_reason(tmp_path: Path) -> None:
    k = cuda_kit(tmp_path)
    k.edit_readback("rollout", lambda d: d["operators"].update(
        extra=["rlkernel.attention.deterministic.v1"]))
    rec = k.analyze()
    assert rec["verdict"] != "valid"


# -- a cache that outlives the judge ------------------------------------------------------------

def test_the_cache_key_holds_the_judging_codes_digest(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_rlkernel_matrix.report import cache

    k = CellKit(tmp_path)
    k.write()
    key = cache.cache_key(k.dir, {"mode": "strict"}).key
    assert key["judge_code"] == cache.judge_code_digest()
    monkeypatch.setattr(cache, "judge_code_digest", lambda: "0" * 64)
    other = cache.cache_key(k.dir, {"mode": "strict"}).key
    assert other != key
    assert cache._why(key, other).startswith("judging code")


def test_the_judging_code_digest_follows_the_modules_content(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.report import cache

    (tmp_path / "judge" / "route").mkdir(parents=True)
    (tmp_path / "judge" / "route" / "rules.py").write_text("A = 1\n")
    first = cache.code_digest([tmp_path / "judge"])
    (tmp_path / "judge" / "route" / "rules.py").write_text("A = 2\n")
    assert cache.code_digest([tmp_path / "judge"]) != first


# -- reading bounded by bytes only --------------------------------------------------------------

RSS_PROBE = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    import torch, numpy  # noqa: F401  (imported before the baseline: not the analysis's)
    from pytest_rlkernel_matrix.report.record import analyze_run
    from cellkit import cell_of
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    base = rss()
    rec = analyze_run(Path(sys.argv[1]), cell=cell_of(), mode="strict",
                      artifact_dir=sys.argv[2])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak, "verdict": rec["verdict"],
                      "reasons": rec["reasons"]}))
""")


def _analysis_rss(k: CellKit) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(k.dir), f"cpu/{k.cell.slug}",
                          str(Path(__file__).parent)], capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _evidence_bytes(k: CellKit) -> int:
    return sum(p.stat().st_size for p in k.dir.rglob("*") if p.is_file())


def test_stride_zero_tensors_in_a_sidecar_are_refused_before_they_allocate(
        tmp_path: Path) -> None:
    n = 1 << 25  # 128 MiB per float32 tensor if anything materialised it
    k = CellKit(tmp_path)
    k.write()
    data = k.sidecar()
    data["train_log_probs"][0] = torch.zeros(1).expand(n)
    data["rollout_log_probs"][0] = torch.zeros(1).expand(n)
    data["loss_masks"][0] = torch.ones(1).expand(n)
    data["response_lengths"][0] = n
    data["total_lengths"][0] = n + 8
    data["ignored"] = {"wide": torch.zeros(1).expand(n, 4)}
    k.write_sidecar(data)
    got = _analysis_rss(k)
    assert got["verdict"] != "valid"
    assert any("stride 0" in r for r in got["reasons"]), got["reasons"]
    assert got["peak"] - got["base"] <= 2 * _evidence_bytes(k) + 200 * 2**20, got


@pytest.mark.parametrize("hostile", ["overlapping strides", "colliding int keys"])
def test_other_adversarial_sidecars_stay_within_the_memory_bound(tmp_path: Path,
                                                                 hostile: str) -> None:
    k = CellKit(tmp_path)
    k.write()
    data = k.sidecar()
    if hostile == "overlapping strides":  # 2**22 x 64 elements addressed in 2**22 + 64 stored
        data["ignored"] = torch.zeros((1 << 22) + 64).as_strided((1 << 22, 64), (1, 1))
    else:
        data["ignored"] = {j * (2**61 - 1): 0 for j in range(1, 6000)}
    k.write_sidecar(data)
    got = _analysis_rss(k)
    assert got["verdict"] != "valid"
    assert got["peak"] - got["base"] <= 2 * _evidence_bytes(k) + 200 * 2**20, got


def test_many_colliding_int_keys_in_an_ignored_dict_are_refused(tmp_path: Path) -> None:
    """Python's int hash is `i mod (2**61 - 1)`: these keys all collide (a dict of them takes
    time quadratic in their count); the reader refuses the file before it builds the dict."""
    k = CellKit(tmp_path)
    k.write()
    data = k.sidecar()
    data["ignored"] = {j * (2**61 - 1): 0 for j in range(1, 6000)}
    k.write_sidecar(data)
    rec = k.analyze()
    assert rec["verdict"] != "valid"
    assert any("integers" in r for r in rec["reasons"]), rec["reasons"]


def test_backends_of_the_kit_are_rlkernels() -> None:
    assert all(b.startswith("rlkernel.") for b in BACKENDS.values())


# -- docs: weights_bitwise needs a rollout-side audit -------------------------------------------

def test_init_says_what_a_launcher_must_add_for_weights_bitwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pytest_rlkernel_matrix.cli import main

    assert main(["init", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "weight-audit/rollout/<version>.json" in out and '"not judged"' in out
    assert "weight-audit/rollout/<version>.json" in (tmp_path / "m" / "matrix.toml").read_text()


def test_weights_bitwise_without_a_rollout_audit_is_not_judged(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.judge.read.steps import read_reproducibility
    from pytest_rlkernel_matrix.judge.reproducibility.steps import judge_claims

    k = CellKit(tmp_path)
    k.write()
    (k.dir / "weight-audit" / "v0.vllm-rollout.json").unlink()
    claims, _ = judge_claims(read_reproducibility(k.dir, None))
    assert claims["weights_bitwise"]["status"] == "not judged", claims


# -- the decision: typed findings of five layers ------------------------------------------------

def test_a_decision_carries_every_layers_typed_findings(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.judge.findings import LAYERS

    k = cuda_kit(tmp_path)
    edit_ops(k, "rollout", lambda d, op: op["provenance"]["execution"].update(triton_used=True))
    rec = k.analyze()
    assert set(rec["validity"]) == set(LAYERS)
    # a record that breaks RL-Kernel's rules is a route mismatch: the cell is incomparable
    assert rec["verdict"] == "incomparable"
    assert any(r.startswith("route: ") and "Triton" in r
               for r in rec["validity"]["semantic"]["reasons"])
    assert rec["validity"]["route"]["valid"] is False  # and the route layer's own finding
    assert rec["validity"]["reproducibility"]["valid"] is not True  # one run: not all judged
