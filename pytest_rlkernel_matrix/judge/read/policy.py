"""The policy a cell was recorded with (its `cell-run.json`), as a typed object.

`Policy.from_meta` reads what the matrix file froze into the run: the declared baseline
contract, coverage minimums, the hardware profile's `backend` (the cell's platform: a rule that
needs it fails closed without it), the run id, the declared baseline claims and the repeat run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLAIMS = ("train_rollout_bitwise", "run_to_run_bitwise", "weights_bitwise")
PLATFORMS = ("cpu", "cuda", "rocm")


@dataclass(frozen=True)
class Policy:
    """What the matrix file says about judging a cell, frozen into its `cell-run.json`.

    `baseline_contract` is the user's declaration for all-R cells (`{"kind": "bitwise"}` or
    `{"kind": "tolerance", "max_abs_diff": x}`), `backend` the hardware profile's backend and
    `run_id` the id the runner gave the run.
    """

    baseline_contract: Mapping[str, Any] | None = None
    min_samples_per_rank: int = 1
    min_active_tokens: int = 1
    backend: str | None = None
    run_id: str | None = None
    baseline_claims: tuple[str, ...] = ()
    repeat_dir: str | None = None  # the second run of this cell (run_to_run_bitwise)
    require_rollout_weight_audit: bool = False

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Policy:
        """The policy of a `cell-run.json`'s parsed object, checked by `cellrun.CellRunMeta`
        (pydantic, loaded here: not at plugin load); `ValueError` naming the file and key for a
        wrong one (`report.record` makes it the cell's `error` record)."""
        from pytest_rlkernel_matrix.judge.read.cellrun import validated

        checked = validated(dict(meta), Path("cell-run.json"))
        raw = checked.policy
        if raw is None:  # an older or hand-made file: every rule needing a fact fails closed
            return cls(run_id=checked.run_id)
        return cls(
            baseline_contract=raw.baseline_contract,
            min_samples_per_rank=raw.min_samples_per_rank,
            min_active_tokens=raw.min_active_tokens,
            backend=raw.backend,
            run_id=checked.run_id,
            baseline_claims=tuple(raw.baseline_claims),
            repeat_dir=raw.repeat_dir,
            require_rollout_weight_audit=raw.require_rollout_weight_audit,
        )

    def as_dict(self) -> dict[str, Any]:
        return {"baseline_contract": None if self.baseline_contract is None
                else dict(self.baseline_contract),
                "min_samples_per_rank": self.min_samples_per_rank,
                "min_active_tokens": self.min_active_tokens, "backend": self.backend,
                "baseline_claims": list(self.baseline_claims), "repeat_dir": self.repeat_dir,
                "require_rollout_weight_audit": self.require_rollout_weight_audit}
