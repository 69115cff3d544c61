"""Issue 44 item 3: RL-Kernel's own record checks against ours, over generated records.

Upstream's functions are never in this repository. Point `RLK_UPSTREAM_SCRATCH` at a scratch
folder outside it holding, from RL-Align/RL-Kernel:

- `runtime.py`: `_contains_triton`, `_contains_fallback`, `_runtime_platform` of
  `rl_engine/integrations/common/runtime.py` @ a5a92ecf6cbf29fdcfc862846e53db5fa244c35e, as
  written there (only those three, so that nothing else of rl_engine is needed);
- `validate_record.py`: the per-record checks of `validate_readbacks` in
  `rl_engine/integrations/orchestrators/vime/experiments/dense/validate_artifacts.py` @
  39432c1666d85c4895a6499e191d6b8b2d3644ab, as a function `record_errors(label, module, record)`.

Without it the test skips, saying so. With it, for records under RL-Kernel's backend ids on
CUDA: no record that upstream fails (its errors, a truthy fallback key, or its recursion
failing) passes ours (`route.rules.upstream_findings`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pytest_rlkernel_matrix.judge.route.rules import upstream_findings

SCRATCH = os.environ.get("RLK_UPSTREAM_SCRATCH", "")


def _upstream() -> tuple[ModuleType, ModuleType]:
    folder = Path(SCRATCH)
    if not SCRATCH or not (folder / "runtime.py").is_file() or not (
            folder / "validate_record.py").is_file():
        pytest.skip("RLK_UPSTREAM_SCRATCH is not a folder holding upstream's runtime.py and "
                    "validate_record.py (RL-Kernel @ a5a92ec / 39432c1; see this module's doc): "
                    "the differential against upstream's own functions is not run")
    sys.path.insert(0, str(folder))
    try:
        mods = []
        for name in ("runtime", "validate_record"):
            spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
            mods.append(mod)
    finally:
        sys.path.remove(str(folder))
    return mods[0], mods[1]


KEYS = st.sampled_from(["runtime_platform", "execution", "fallback", " Fallback_Used ",
                        "used_fallback", "split_kv_fallback", "triton_used", "uses_triton",
                        " Triton_Used", "kernels", "platform", "result", "Runtime_Platform", "x"])
LEAVES = st.one_of(
    st.sampled_from(["cuda", "CUDA", " cuda", "cuda ", "rocm", "cpu", "my_triton_kernel",
                     "TRITON", "", "flash", "rlkernel.attention.deterministic.v1"]),
    st.booleans(), st.none(), st.integers(-2, 2), st.sampled_from([0.0, -0.0, 1.5]))
VALUES = st.recursive(LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(KEYS, inner, max_size=4)), max_leaves=24)
BACKENDS = st.sampled_from([
    "rlkernel.attention.deterministic.v1", "rlkernel.ffn.qwen3.deterministic.v1",
    "rlkernel.linear_logp.bitwise.v1", " rlkernel.linear_logp.bitwise.v1",
    "RLKERNEL.attention.deterministic.v1", "rlkernel.linear_logp.other.v1"])


@st.composite
def records(draw: Any) -> tuple[str, Any]:
    record: dict[str, Any] = {"backend_id": draw(BACKENDS)}
    prov = draw(st.dictionaries(KEYS, VALUES, max_size=5))
    if draw(st.booleans()):
        prov.setdefault("execution", {})
        if isinstance(prov["execution"], dict):
            prov["execution"]["runtime_platform"] = draw(st.sampled_from(["cuda", "cuda", "rocm"]))
    record["provenance"] = prov
    for key in draw(st.lists(KEYS, max_size=2)):
        record[key] = draw(VALUES)
    depth = draw(st.sampled_from([0, 0, 0, 50, 150, 400]))
    for i in range(depth):
        record["provenance"] = {"nested": record["provenance"]} if i % 2 else [
            record["provenance"]]
    if depth:
        record["provenance"] = {"runtime_platform": "cuda", "deep": record["provenance"]}
    return draw(st.sampled_from(["attention", "ffn", "logp"])), record


def _upstream_fails(runtime: ModuleType, validate: ModuleType, module: str,
                    record: dict[str, Any]) -> bool:
    try:
        return bool(validate.record_errors("vllm/rollout", module, record)
                    or runtime._contains_fallback(record))
    except RecursionError:  # upstream's validator fails such a record (validate_artifacts' main)
        return True


def _ours_fails(module: str, record: dict[str, Any]) -> bool:
    fallbacks, failures = upstream_findings(
        [{"module": module, "side": "rollout", "source": "r.json", "record": record}], "cuda", [])
    return bool(fallbacks or failures)


SEEN = {"upstream fails": 0, "both pass": 0, "only ours fails": 0}


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=records())
def test_no_record_upstream_fails_passes_ours(case: tuple[str, Any]) -> None:
    runtime, validate = _upstream()
    module, record = case
    upstream = _upstream_fails(runtime, validate, module, record)
    ours = _ours_fails(module, record)
    assert ours or not upstream, (module, record)
    SEEN["upstream fails" if upstream else "only ours fails" if ours else "both pass"] += 1


def test_the_generated_records_exercise_both_outcomes() -> None:
    """Run after the property (same module): the generator made records upstream passes and
    records it fails (otherwise the differential said nothing)."""
    _upstream()
    if not sum(SEEN.values()):
        pytest.skip("the property did not run in this process (-k, or another xdist worker)")
    assert SEEN["upstream fails"] > 0 and SEEN["both pass"] > 0, SEEN
