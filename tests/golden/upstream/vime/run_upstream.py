"""Run vime's own functions over the generated inputs (`cases.py`) and write their verdicts to
`verdicts.json` (issue 50's golden differential). Needs vime's code; never run by the tests.

    UPSTREAM=/work/scratch/i50/vime python tests/golden/upstream/vime/run_upstream.py

`UPSTREAM` is a scratch folder OUTSIDE this checkout holding, from RL-Align/vime (see README.md for
the commits and how the folder was assembled): `vime/utils/dlogp_diagnostics.py`,
`vime/utils/consistency_metadata.py`, `vime/utils/consistency_drift_report.py`,
`vime/utils/train_dump_utils.py` and `tools/consistency_drift_report.py`.
"""

from __future__ import annotations

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
if HERE.parents[3] in UPSTREAM.parents or HERE.parents[3] == UPSTREAM:
    raise SystemExit("UPSTREAM must be outside the checkout")
sys.path.insert(0, str(UPSTREAM))

from tools.consistency_drift_report import load_consistency_artifacts  # noqa: E402
from vime.utils.consistency_audit import validate_consistency_audit_batch  # noqa: E402
from vime.utils.consistency_drift_report import build_consistency_drift_report  # noqa: E402
from vime.utils.consistency_metadata import validate_samples_consistency_metadata  # noqa: E402
from vime.utils.dlogp_diagnostics import compute_dlogp_diagnostics  # noqa: E402
from vime.utils.train_dump_utils import save_debug_train_data  # noqa: E402

COMMITS = {
    "RL-Align/vime vime/utils/dlogp_diagnostics.py": "bd1f73f",
    "RL-Align/vime vime/utils/consistency_metadata.py": "19a6162",
    "RL-Align/vime vime/utils/consistency_drift_report.py": "16dccde (status rule as at 44b3aafc)",
    "RL-Align/vime vime/utils/train_dump_utils.py": "b2c9b02",
    "RL-Align/vime vime/utils/consistency_audit.py": "ad10c53 (validate_consistency_audit_batch)",
    "RL-Align/vime tools/consistency_drift_report.py": "newest stored (load_consistency_artifacts)",
}


def _num(x: Any) -> Any:
    x = float(x)
    return x if math.isfinite(x) else repr(x)


def _dump(name: str, folder: Path) -> Path:
    """The dump written by vime's own `save_debug_train_data` (its file name and payload)."""
    payload = cases.build(name)
    args = SimpleNamespace(save_debug_train_data=str(folder / "train-data" / "{rollout_id}.pt"))
    torch.distributed.get_rank = lambda: payload["rank"]  # (one process: rank 0)
    save_debug_train_data(args, rollout_id=payload["rollout_id"],
                          rollout_data=payload["rollout_data"])
    return folder / "train-data" / f"{payload['rollout_id']}.rank{payload['rank']}.pt"


def verdict(name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = _dump(name, Path(tmp))
        rd = torch.load(path, weights_only=True)["rollout_data"]
        out: dict[str, Any] = {"file": path.name}
        manifest, cube, prov = load_consistency_artifacts([path])
        report = build_consistency_drift_report(replay_manifest=manifest, result_cube=cube,
                                                runtime_provenance=prov)
        out["drift_report"] = {"status": report["status_label"],
                               "max_abs_dlogp": _num(report["metrics"].get("max_abs_dlogp", 0.0)),
                               "active_token_count": report["metrics"].get("active_token_count")}
    if "loss_masks" in rd:
        try:
            d = compute_dlogp_diagnostics(rd["log_probs"], rd["rollout_log_probs"],
                                          rd["loss_masks"])
        except Exception as exc:  # upstream's own failure is its verdict (bf16: quantile)
            d = None
            out["dlogp_diagnostics"] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}",
                                        "warnings": ["raised"]}
    if "loss_masks" in rd and d is not None:
        m = {k.removeprefix("rlk_audit_"): _num(v) for k, v in d.metrics.items()}
        out["dlogp_diagnostics"] = {
            k: m[k] for k in ("active_token_count", "mask_coverage", "zero_active_sample_count",
                              "dlogp_abs_max", "dlogp_abs_mean", "dlogp_abs_p50", "dlogp_abs_p90",
                              "dlogp_abs_p99", "ratio0_mean", "clipfrac0", "approx_kl0")}
        out["dlogp_diagnostics"]["warnings"] = sorted(
            {w.code for w in d.warnings if w.code != "missing_metadata"})
    elif "loss_masks" not in rd:
        out["dlogp_diagnostics"] = None  # vime's diagnostics need the loss masks
    records = rd.get("consistency_metadata")
    if records is not None:
        n = len(rd["log_probs"])
        samples = [SimpleNamespace(consistency_metadata=records[i] if i < len(records) else None,
                                   index=i, rollout_id=0) for i in range(n)]
        for mode in ("audit", "strict"):
            v = validate_samples_consistency_metadata(samples, mode=mode)
            out[f"metadata_{mode}"] = {"warnings": sorted({i.code for i in v.warnings}),
                                       "failures": sorted({i.code for i in v.failures})}
            prov = next((rd[k] for k in ("runtime_provenance", "consistency_runtime_provenance")
                         if isinstance(rd.get(k), dict)), None)
            a = validate_consistency_audit_batch(rd, mode=mode, runtime_provenance=prov)
            out[f"audit_{mode}"] = {"warnings": sorted({i.code for i in a.warnings}),
                                    "failures": sorted({i.code for i in a.failures})}
    dl = out["dlogp_diagnostics"]
    out["upstream_refuses"] = bool(
        out["drift_report"]["status"] != "PASS"
        or (records is not None and (out["metadata_strict"]["failures"]
                                     or out["audit_strict"]["failures"]))
        or (dl is not None and dl["warnings"]))
    return out


def main() -> None:
    result = {"generated_by": "tests/golden/upstream/vime/run_upstream.py",
              "upstream": COMMITS, "torch": torch.__version__,
              "cases": {name: verdict(name) for name in cases.CASES}}
    (HERE / "verdicts.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"{len(result['cases'])} cases -> {HERE / 'verdicts.json'}")


if __name__ == "__main__":
    main()
