"""Run RL-Kernel's own record rules over the generated records (`cases.py`) and write its
verdicts to `verdicts.json` (issue 50). Needs RL-Kernel's code; never run by the tests.

    UPSTREAM=/work/scratch/i50/rlk python tests/golden/upstream/records/run_upstream.py

`UPSTREAM` is a scratch folder OUTSIDE this checkout holding `rl_engine/integrations/common/
runtime.py` of RL-Align/RL-Kernel at a5a92ec and `rl_engine/integrations/orchestrators/vime/
experiments/dense/validate_artifacts.py` at 39432c1 (README.md: what of them).

Each record is put in the vllm/rollout readback's `operators[module]` of a readback set whose
every other record is clean, and judged by upstream's `validate_readbacks` (the CUDA validator
that writes `bitwise-validation.json`) and by the runtime's `_contains_fallback` (the strict
route check: a fallback recorded and raised). Upstream refuses the record where either says so,
or where its recursion fails (RecursionError: the validator's run fails).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cases  # noqa: E402

UPSTREAM = Path(os.environ["UPSTREAM"]).resolve()
if HERE.parents[3] == UPSTREAM or HERE.parents[3] in UPSTREAM.parents:
    raise SystemExit("UPSTREAM must be outside the checkout")
sys.path.insert(0, str(UPSTREAM))
from rl_engine.integrations.common.runtime import _contains_fallback  # noqa: E402
from rl_engine.integrations.orchestrators.vime.experiments.dense.validate_artifacts import (  # noqa: E402
    validate_readbacks,
)

COMMITS = {
    "RL-Align/RL-Kernel rl_engine/integrations/common/runtime.py":
        "a5a92ecf6cbf29fdcfc862846e53db5fa244c35e",
    "RL-Align/RL-Kernel rl_engine/integrations/orchestrators/vime/experiments/dense/"
    "validate_artifacts.py": "39432c1666d85c4895a6499e191d6b8b2d3644ab"}


def _readbacks(module: str, record: Any) -> list[dict[str, Any]]:
    def one(framework: str, target: str) -> dict[str, Any]:
        return {"framework": framework, "target": target, "fallbacks": [],
                "installed_hooks": {m: f"{framework}.{m}" for m in cases.STRICT},
                "operators": {m: cases.clean(m) for m in cases.STRICT}}
    training, rollout = one("megatron", "training"), one("vllm", "rollout")
    rollout["operators"][module] = record
    return [training, rollout]


def verdict(module: str, record: Any) -> dict[str, Any]:
    try:
        errors = validate_readbacks(_readbacks(module, record))["errors"]
        fallback = _contains_fallback(record)
    except RecursionError:
        return {"refuses": True, "errors": ["RecursionError"], "fallback": None}
    return {"refuses": bool(errors or fallback), "errors": errors, "fallback": fallback}


def main() -> None:
    sys.setrecursionlimit(1000)  # CPython's default: what the validator runs with
    got = {}
    for name, module, record in cases.records():
        digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]
        got[name] = {"module": module, "record_sha256": digest, **verdict(module, record)}
    out = {"generator": "tests/golden/upstream/records/cases.py", "commits": COMMITS,
           "call": "validate_readbacks(readbacks)['errors'] with the record as the vllm/rollout "
                   "operators[module] of an otherwise clean readback set, and "
                   "_contains_fallback(record)",
           "cases": got}
    (HERE / "verdicts.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(sum(v["refuses"] for v in got.values()), "of", len(got), "refused by upstream")


if __name__ == "__main__":
    main()
