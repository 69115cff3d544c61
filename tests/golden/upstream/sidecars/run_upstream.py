"""Run RL-Kernel's own sidecar writer and validator over the generated sidecars (`cases.py`) and
write its verdicts to `verdicts.json` (issue 50). Needs RL-Kernel's code; never run by the tests.

    UPSTREAM=/work/scratch/i50/rlk python tests/golden/upstream/sidecars/run_upstream.py

`UPSTREAM` is a scratch folder OUTSIDE this checkout holding, under
`rl_engine/integrations/orchestrators/vime/experiments/rocm_attention/`, `tis_metrics.py` of
RL-Align/RL-Kernel at a5a92ec and `validate_artifacts.py` at 0665bf6 (README.md: what of them).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cases  # noqa: E402

UPSTREAM = Path(os.environ["UPSTREAM"]).resolve()
if HERE.parents[3] == UPSTREAM or HERE.parents[3] in UPSTREAM.parents:
    raise SystemExit("UPSTREAM must be outside the checkout")
sys.path.insert(0, str(UPSTREAM))
from rl_engine.integrations.orchestrators.vime.experiments.rocm_attention import (  # noqa: E402
    tis_metrics,
    validate_artifacts,
)

PKG = "RL-Align/RL-Kernel rl_engine/integrations/orchestrators/vime/experiments/rocm_attention"
COMMITS = {f"{PKG}/tis_metrics.py": "a5a92ecf6cbf29fdcfc862846e53db5fa244c35e",
           f"{PKG}/validate_artifacts.py": "0665bf6a3391a37a48b0da8b340e16ceee97d5c3"}


def _same_as_upstream_writer(name: str, folder: Path) -> bool:
    """The generator's files are what upstream's `_write_sidecar` saves (same dicts), and its
    CP slices are upstream's `slice_response_mask_for_cp`. False where the writer cannot
    produce the case (a malformed file: `cases.MUTATE`, or no file)."""
    if name not in cases.PLANS:
        return False
    theirs = folder / "upstream-writer"
    os.environ[tis_metrics.SIDECAR_DIRECTORY_ENV] = str(theirs)
    for rank, call, tp, cp, samples in cases.plan(name):
        os.environ["RANK"] = str(rank)
        tis_metrics._CALL_COUNTER = itertools.count(call)
        tis_metrics._write_sidecar(
            SimpleNamespace(tensor_model_parallel_size=tp, context_parallel_size=cp),
            train_log_probs=[s["train"] for s in samples],
            rollout_log_probs=[s["rollout"] for s in samples],
            loss_masks=[s["mask"] for s in samples],
            total_lengths=[s["total"] for s in samples],
            response_lengths=[s["response"] for s in samples])
        for s in samples:  # the generator's slice is upstream's (where the lengths are valid)
            if not 0 < s["response"] <= s["total"]:
                continue
            full = torch.arange(s["response"])
            want = validate_artifacts.slice_response_mask_for_cp(
                full, total_length=s["total"], response_length=s["response"],
                context_parallel_size=cp, context_parallel_rank=(rank // tp) % cp)
            assert want.tolist() == cases.response_offsets(
                s["total"], s["response"], cp, (rank // tp) % cp), (name, rank)
    mine = cases.write(name, folder / "generator")
    got = sorted(p.name for p in theirs.glob("*.pt"))
    assert got == sorted(p.name for p in mine.glob("*.pt")), name
    for file in got:
        a = torch.load(theirs / file, weights_only=True)
        b = torch.load(mine / file, weights_only=True)
        assert repr(a) == repr(b), (name, file)
    return True


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def verdict(name: str) -> dict[str, Any]:
    tp, cp = cases.topology(name)
    with tempfile.TemporaryDirectory() as tmp:
        writer = _same_as_upstream_writer(name, Path(tmp))
        folder = cases.write(name, Path(tmp) / "cell")
        try:
            got = validate_artifacts.compare_train_rollout_logps(
                folder, require_exact=True, tensor_parallel_size=tp, context_parallel_size=cp)
        except Exception as exc:  # upstream refusing to read is its verdict
            return {"passed": False, "raised": f"{type(exc).__name__}: {str(exc)[:200]}",
                    "upstream_writer": writer}
    errors = [e.replace(str(folder), "<sidecars>") for e in got["errors"]]
    keys = ("passed", "torch_equal", "bitwise_equal", "bitwise_mismatch_count", "mismatch_count",
            "max_abs_diff", "train_rollout_logprob_abs_diff", "mismatch_kl", "mismatch_k3_kl",
            "sample_count", "element_count")
    return {**{k: _plain(got[k]) for k in keys}, "errors": errors, "upstream_writer": writer,
            "launch": {"tensor_parallel_size": tp, "context_parallel_size": cp}}


def main() -> None:
    out = {"generator": "tests/golden/upstream/sidecars/cases.py", "commits": COMMITS,
           "torch": torch.__version__,
           "call": "compare_train_rollout_logps(folder, require_exact=True, "
                   "tensor_parallel_size=tp, context_parallel_size=cp) with the case's launch",
           "cases": {name: verdict(name) for name in cases.CASES}}
    (HERE / "verdicts.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    for name, v in out["cases"].items():
        print(f"{name:34s} passed={v['passed']!s:5s} {v.get('raised') or v.get('errors')}")


if __name__ == "__main__":
    main()
