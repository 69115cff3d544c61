"""Run RL-Kernel's own layer-replay analysis over the generated runs (`cases.py`) and write its
verdicts to `verdicts.json` (issue 50). Needs RL-Kernel's code; never run by the tests.

    UPSTREAM=/work/scratch/i50/rlk python tests/golden/upstream/replay/run_upstream.py

`UPSTREAM` is a scratch folder OUTSIDE this checkout holding `rl_engine/alignment/debug/
qwen3_report.py` at 4d39c20, `core.py` at 82fd031 and the modules it imports (README.md: which,
and the two import-plumbing files). The layer files are found as `rlk debug` finds them: every
`diagnostics/layers/*.pt` at any depth under the run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cases  # noqa: E402

UPSTREAM = Path(os.environ["UPSTREAM"]).resolve()
if HERE.parents[3] == UPSTREAM or HERE.parents[3] in UPSTREAM.parents:
    raise SystemExit("UPSTREAM must be outside the checkout")
sys.path.insert(0, str(UPSTREAM))
from rl_engine.alignment.debug.qwen3_report import analyze_replay  # noqa: E402

COMMITS = {
    "RL-Align/RL-Kernel rl_engine/alignment/debug/qwen3_report.py":
        "4d39c20485f6813c41a3b76af2371cad166eba47",
    "RL-Align/RL-Kernel rl_engine/alignment/debug/core.py":
        "82fd03185d138d81752abe01e4d4d85ab87880ef",
    "RL-Align/RL-Kernel rl_engine/integrations/common/runtime.py":
        "a5a92ecf6cbf29fdcfc862846e53db5fa244c35e",
    "RL-Align/RL-Kernel rl_engine/integrations/orchestrators/vime/experiments/rocm_attention/"
    "validate_artifacts.py": "0665bf6a3391a37a48b0da8b340e16ceee97d5c3",
    "RL-Align/RL-Kernel rl_engine/integrations/orchestrators/vime/experiments/rocm_attention/"
    "tis_metrics.py": "a5a92ecf6cbf29fdcfc862846e53db5fa244c35e",
}


def verdict(name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run = cases.write(name, Path(tmp) / "run")
        paths = sorted(run.rglob("diagnostics/layers/*.pt"))
        try:
            report = analyze_replay(run, paths)
        except Exception as exc:  # upstream refusing to read is its verdict
            why = str(exc).replace(str(run), "<run>")
            return {"status": "raised", "error": f"{type(exc).__name__}: {why[:200]}"}
        first = report["first_divergence"] or {}
        errors = [e.replace(str(run), "<run>") for e in report["errors"]]
        return {"status": report["status"], "error_count": len(errors), "errors": errors[:6],
                "first_divergence": {k: first.get(k) for k in (
                    "layer", "stage", "module", "position", "bitwise_mismatches")
                    if k in first} or None}


def main() -> None:
    out = {"generator": "tests/golden/upstream/replay/cases.py", "commits": COMMITS,
           "call": "analyze_replay(run, sorted(run.rglob('diagnostics/layers/*.pt')))",
           "cases": {name: verdict(name) for name in cases.CASES}}
    (HERE / "verdicts.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    for name, v in out["cases"].items():
        print(f"{name:30s} {v['status']:15s} {v.get('errors') or v.get('error') or ''} "
              f"{v.get('first_divergence') or ''}")


if __name__ == "__main__":
    main()
