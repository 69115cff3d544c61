"""Issue 44: per validity layer, hostile inputs never give a passing finding.

Each property feeds a layer empty, truncated, duplicated, reordered, too-deep, oversized,
wrongly-typed or whitespace-padded inputs (hypothesis picks which, and where) and asserts that
nothing passes that a clean input would not: a rule that cannot be evaluated fails closed.
Examples are few and have no deadline: these take seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from cellkit import CellKit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_rlkernel_matrix.judge.numeric.judge import parse_contract
from pytest_rlkernel_matrix.judge.performance.judge import judge_performance
from pytest_rlkernel_matrix.judge.performance.phases import phases
from pytest_rlkernel_matrix.judge.read import ptread
from pytest_rlkernel_matrix.judge.read.evidence import read_evidence
from pytest_rlkernel_matrix.judge.read.logscan import scan_log
from pytest_rlkernel_matrix.judge.read.steps import read_reproducibility
from pytest_rlkernel_matrix.judge.reproducibility.steps import judge_claims
from pytest_rlkernel_matrix.judge.route import rules
from pytest_rlkernel_matrix.judge.route.rules import declared_policy, upstream_findings
from pytest_rlkernel_matrix.spec.limits import Policy as PerformancePolicy

FEW = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
SOME = settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
PADS = st.sampled_from([" ", "\t", "\n", "  ", "\u00a0"])
WRONG = st.one_of(st.integers(), st.floats(), st.booleans(), st.none(), st.lists(st.integers(),
                  max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def clean_record() -> dict[str, Any]:
    return {"backend_id": "rlkernel.attention.deterministic.v1", "call_count": 5,
            "provenance": {"interface": "kit", "fallback": False,
                           "execution": {"runtime_platform": "cuda", "triton_used": False}}}


def _passes(record: Any, module: str = "attention", platform: str | None = "cuda") -> bool:
    fallbacks, failures = upstream_findings(
        [{"module": module, "side": "rollout", "source": "r.json", "record": record}],
        platform, [])
    return not fallbacks and not failures


def _nest(value: Any, depth: int) -> Any:
    for i in range(depth):
        value = [value] if i % 2 else {"n": value}
    return value


# -- route --------------------------------------------------------------------------------------

def test_the_clean_record_passes() -> None:
    assert _passes(clean_record())


@FEW
@given(how=st.sampled_from(["empty", "not an object", "no backend_id", "no provenance",
                            "no platform", "padded backend", "padded platform",
                            "typed backend", "typed platform", "too deep", "unknown platform"]),
       pad=PADS, wrong=WRONG, data=st.data())
def test_route_hostile_records_never_pass(how: str, pad: str, wrong: Any, data: Any) -> None:
    record: Any = clean_record()
    platform: str | None = "cuda"
    if how == "empty":
        record = {}
    elif how == "not an object":
        record = data.draw(st.one_of(st.text(max_size=5), st.integers(), st.none(),
                                     st.lists(st.just(clean_record()), max_size=2)))
    elif how == "no backend_id":
        del record["backend_id"]
    elif how == "no provenance":
        del record["provenance"]
    elif how == "no platform":
        del record["provenance"]["execution"]["runtime_platform"]
    elif how == "padded backend":
        record["backend_id"] = data.draw(st.sampled_from([pad + record["backend_id"],
                                                          record["backend_id"] + pad]))
    elif how == "padded platform":
        record["provenance"]["execution"]["runtime_platform"] = pad + "cuda"
    elif how == "typed backend":
        record["backend_id"] = wrong
    elif how == "typed platform":
        record["provenance"]["execution"]["runtime_platform"] = wrong
    elif how == "too deep":
        record["provenance"]["extra"] = _nest(None, rules.MAX_DEPTH + data.draw(
            st.integers(1, 300)))
    elif how == "unknown platform":
        platform = data.draw(st.sampled_from([None, "", "CUDA ", "tpu", "gpu"]))
    assert not _passes(record, platform=platform), (how, record)


@FEW
@given(where=st.integers(0, 3), copies=st.integers(1, 3), pad=PADS,
       bad=st.sampled_from([("fallback_used", "split"), ("triton_used", True),
                            ("kernel", "_fwd_triton"), ("used_fallback", 1)]))
def test_route_a_failing_record_duplicated_reordered_or_padded_still_fails(
        where: int, copies: int, pad: str, bad: tuple[str, Any]) -> None:
    key, value = bad
    record = clean_record()
    exe = record["provenance"]["execution"]
    target = [record, record["provenance"], exe, {"k": [exe]}][where]
    padded = pad + key.upper() + pad if key != "kernel" else key
    if where == 3:
        record["provenance"]["list"] = [{padded: value}] * copies
    else:
        target[padded] = value
    reordered = dict(reversed(list(record.items())))
    assert not _passes(record) and not _passes(reordered)


def test_route_a_record_with_more_values_than_the_bound_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rules, "MAX_VALUES", 50)
    record = clean_record()
    record["provenance"]["wide"] = list(range(100))
    assert not _passes(record)


@FEW
@given(ns=st.sampled_from(["rlkernel", "vllm", "megatron", "torch", "pytorch", "vime",
                           "rl_kernel", "production"]),
       pad=PADS, upper=st.booleans(), tail=st.sampled_from(["", "x.", "production."]))
def test_declared_policies_in_a_foreign_namespace_are_refused(ns: str, pad: str, upper: bool,
                                                              tail: str) -> None:
    prefix = pad + (ns.upper() if upper else ns) + "." + tail + pad
    policy, problems = declared_policy([{"source": "r.json", "policy": {
        "backend_prefix": prefix, "platform": "cuda", "triton_allowed": False}}])
    assert policy is None and problems


@FEW
@given(prefix=st.one_of(st.text(max_size=12), WRONG), platform=st.one_of(st.text(max_size=6),
                                                                          WRONG),
       triton=st.one_of(st.booleans(), WRONG))
def test_a_declared_policy_is_accepted_only_in_its_normal_form(prefix: Any, platform: Any,
                                                               triton: Any) -> None:
    policy, _ = declared_policy([{"source": "r.json", "policy": {
        "backend_prefix": prefix, "platform": platform, "triton_allowed": triton}}])
    if policy is not None:
        assert rules._PREFIX.match(policy["backend_prefix"])
        assert policy["platform"] in ("cpu", "cuda", "rocm")
        assert type(policy["triton_allowed"]) is bool
        low = policy["backend_prefix"][:-1]
        words = set(low.split(".")) | set(low.replace("-", ".").replace("_", ".").split("."))
        assert not words & rules.FOREIGN_NAMESPACES


# -- semantic (through a whole cell) ------------------------------------------------------------

@pytest.fixture(scope="module")
def kit_template(tmp_path_factory: pytest.TempPathFactory) -> CellKit:
    k = CellKit(tmp_path_factory.mktemp("template"))
    k.write()
    assert k.analyze()["verdict"] == "valid"
    return k


def _copy(template: CellKit, tmp: Path) -> CellKit:
    k = CellKit(tmp)
    shutil.copytree(template.dir, k.dir)
    return k


AUDIT = "weight-audit/v0.vllm-rollout.json"


@SOME
@given(how=st.sampled_from(["empty", "truncated", "typed sha", "padded sha", "padded version",
                            "duplicated other", "not an object"]),
       wrong=WRONG, pad=PADS)
def test_semantic_hostile_weight_audits_never_pass(kit_template: CellKit, tmp_path_factory: Any,
                                                   how: str, wrong: Any, pad: str) -> None:
    k = _copy(kit_template, tmp_path_factory.mktemp("sem"))
    path = k.dir / AUDIT
    data = json.loads(path.read_text())
    if how == "empty":
        path.write_text("")
    elif how == "truncated":
        path.write_text(json.dumps(data)[:-7])
    elif how == "typed sha":
        data["sha256"] = wrong
        path.write_text(json.dumps(data))
    elif how == "padded sha":
        data["sha256"] = pad + data["sha256"]
        path.write_text(json.dumps(data))
    elif how == "padded version":
        data["weight_version"] = "v0" + pad
        path.write_text(json.dumps(data))
    elif how == "duplicated other":
        other = dict(data, sha256="cd" * 32)
        (k.dir / "weight-audit/v0.vllm-rollout-2.json").write_text(json.dumps(other))
    elif how == "not an object":
        path.write_text(json.dumps([data]))
    rec = k.analyze()
    assert rec["verdict"] != "valid", (how, rec["reasons"])


# -- numeric ------------------------------------------------------------------------------------

@FEW
@given(value=st.one_of(WRONG, st.text(max_size=12),
                       st.dictionaries(st.sampled_from(["kind", "max_abs_diff", " kind"]),
                                       st.one_of(WRONG, st.text(max_size=10)), max_size=3)))
def test_numeric_a_contract_is_only_a_bitwise_word_or_a_finite_tolerance(value: Any) -> None:
    contract, why = parse_contract(value)
    assert (contract is None) != (why is None)
    if contract is not None:
        assert contract["kind"] in ("bitwise", "tolerance")
        if contract["kind"] == "tolerance":
            limit = contract["max_abs_diff"]
            assert limit >= 0 and limit == limit and limit != float("inf")


SIDECAR = "mismatch-sidecars/rank00000.call00000000.pt"


@SOME
@given(how=st.sampled_from(["empty dict", "no key", "typed list", "padded schema", "reordered",
                            "duplicated sample", "truncated file", "deep"]),
       key=st.sampled_from(["train_log_probs", "rollout_log_probs", "loss_masks",
                            "response_lengths", "schema_version"]),
       wrong=WRONG, pad=PADS)
def test_numeric_hostile_sidecars_never_give_a_valid_cell(kit_template: CellKit,
                                                          tmp_path_factory: Any, how: str,
                                                          key: str, wrong: Any,
                                                          pad: str) -> None:
    k = _copy(kit_template, tmp_path_factory.mktemp("num"))
    data = k.sidecar()
    drift = CellKit(k.root).sidecar(drift=0.5)  # a drifting sample: a hostile form must not hide it
    data["rollout_log_probs"][0] = drift["rollout_log_probs"][0]
    if how == "empty dict":
        data = {}
    elif how == "no key":
        del data[key]
    elif how == "typed list":
        data[key] = wrong
    elif how == "padded schema":
        data["schema_version"] = pad + data["schema_version"]
    elif how == "reordered":
        data = dict(reversed(list(data.items())))
    elif how == "duplicated sample":
        data["train_log_probs"].append(data["train_log_probs"][0])
    elif how == "deep":
        data["ignored"] = _nest(torch.zeros(1), ptread.MAX_NEST + 5)
    k.write_sidecar(data)
    if how == "truncated file":
        path = k.dir / SIDECAR
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) * 2 // 3])
    rec = k.analyze()
    assert rec["verdict"] != "valid", (how, rec["reasons"])


# -- performance --------------------------------------------------------------------------------

PERF_OK = ("perf {s}: {{'perf/rollout_time': 1.5, 'perf/step_time': 3.0, 'perf/train_time': 1.0, "
           "'perf/update_weights_time': 0.5}}")


@FEW
@given(how=st.sampled_from(["empty", "truncated", "string value", "padded key", "typed value",
                            "no step key"]), pad=PADS, wrong=WRONG)
def test_performance_hostile_perf_records_never_give_a_phase(tmp_path_factory: Any, how: str,
                                                             pad: str, wrong: Any) -> None:
    line = PERF_OK.format(s=0)
    if how == "empty":
        line = ""
    elif how == "truncated":
        line = line[: line.index("'perf/rollout_time'") + 22]
    elif how == "string value":
        line = line.replace("1.5", "'1.5'")
    elif how == "padded key":
        line = line.replace("'perf/rollout_time'", f"'{pad}perf/rollout_time'")
    elif how == "typed value":
        line = line.replace("1.5", repr(wrong) if not isinstance(wrong, (int, float)) or
                            isinstance(wrong, bool) else "None")
    elif how == "no step key":
        line = line.replace("'perf/step_time': 3.0, ", "")
    folder = tmp_path_factory.mktemp("perf")
    (folder / "run.log").write_text(line + "\n")
    medians, _ = phases(scan_log(folder / "run.log"))
    want = "step_wall_time" if how == "no step key" else "rollout_wall_time"
    assert medians[want] is None, (how, line, medians)
    ev = read_evidence(folder)
    perf = judge_performance(ev, {}, True, "strict", 0, PerformancePolicy())
    assert perf.valid is not True


# -- reproducibility ----------------------------------------------------------------------------

@SOME
@given(how=st.sampled_from(["empty dir", "no sidecars", "truncated sidecar", "one audit side",
                            "padded audit"]), pad=PADS)
def test_reproducibility_claims_never_hold_on_hostile_evidence(
        kit_template: CellKit, tmp_path_factory: Any, how: str, pad: str) -> None:
    k = _copy(kit_template, tmp_path_factory.mktemp("rep"))
    if how == "empty dir":
        shutil.rmtree(k.dir)
        k.dir.mkdir(parents=True)
    elif how == "no sidecars":
        shutil.rmtree(k.dir / "mismatch-sidecars")
    elif how == "truncated sidecar":
        path = k.dir / SIDECAR
        path.write_bytes(path.read_bytes()[:100])
    elif how == "one audit side":
        (k.dir / AUDIT).unlink()
    elif how == "padded audit":
        path = k.dir / AUDIT
        data = json.loads(path.read_text())
        data["sha256"] = data["sha256"] + pad
        path.write_text(json.dumps(data))
    claims, _ = judge_claims(read_reproducibility(k.dir, None))
    if how in ("empty dir", "no sidecars", "truncated sidecar"):
        assert claims["train_rollout_bitwise"]["status"] != "holds", claims
    if how in ("empty dir", "one audit side", "padded audit"):
        assert claims["weights_bitwise"]["status"] != "holds", claims
    assert claims["run_to_run_bitwise"]["status"] != "holds", claims


# -- reading ------------------------------------------------------------------------------------

@FEW
@given(depth=st.integers(ptread.MAX_NEST + 1, 400), n=st.integers(2, 4096),
       how=st.sampled_from(["deep", "stride 0", "overlap", "shared many times"]))
def test_reading_out_of_bounds_objects_are_refused_by_both_paths(depth: int, n: int,
                                                                 how: str) -> None:
    import io

    if how == "deep":
        obj: Any = _nest(torch.zeros(1), depth)
    elif how == "stride 0":
        obj = {"t": torch.zeros(1).expand(n)}
    elif how == "overlap":
        base = torch.zeros(2 * n + 3)
        obj = {"t": base.as_strided((n + 2, n + 2), (1, 1))}  # (n+2)^2 elements of 2n+3
    else:
        row = [torch.zeros(1024)] * 64
        obj = {"rows": [row] * (n + 64)}  # 2.5e5+ references of 4 KiB to 4 KiB stored
    buf = io.BytesIO()
    torch.save(obj, buf)
    raw = buf.getvalue()
    with pytest.raises(ptread.OutOfBounds):
        ptread.load(raw, "x.pt")
    with pytest.raises(ptread.OutOfBounds):
        ptread.read_pt(raw, torch, "x.pt")
    assert ptread.load_arrays(raw, "x.pt") is None
