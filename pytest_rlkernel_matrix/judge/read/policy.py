"""The policy a cell was recorded with (its `cell-run.json`), as a typed object.

`Policy.from_meta` reads what the matrix file froze into the run: the declared baseline
contract, coverage minimums, the hardware profile's `backend` (the cell's platform: a rule that
needs it fails closed without it), the run id, the declared baseline claims and the repeat run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
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
        raw = meta.get("policy")
        raw = raw if isinstance(raw, Mapping) else {}
        contract = raw.get("baseline_contract")

        def count(key: str) -> int:
            value = raw.get(key, 1)
            return value if isinstance(value, int) and not isinstance(value, bool) else 1

        return cls(
            baseline_contract=contract if isinstance(contract, Mapping) else None,
            min_samples_per_rank=max(1, count("min_samples_per_rank")),
            min_active_tokens=max(1, count("min_active_tokens")),
            backend=raw.get("backend") if isinstance(raw.get("backend"), str) else None,
            run_id=str(meta["run_id"]) if meta.get("run_id") is not None else None,
            baseline_claims=tuple(c for c in raw.get("baseline_claims") or () if c in CLAIMS),
            repeat_dir=raw["repeat_dir"] if isinstance(raw.get("repeat_dir"), str) else None,
            require_rollout_weight_audit=raw.get("require_rollout_weight_audit") is True,
        )

    def as_dict(self) -> dict[str, Any]:
        return {"baseline_contract": None if self.baseline_contract is None
                else dict(self.baseline_contract),
                "min_samples_per_rank": self.min_samples_per_rank,
                "min_active_tokens": self.min_active_tokens, "backend": self.backend,
                "baseline_claims": list(self.baseline_claims), "repeat_dir": self.repeat_dir,
                "require_rollout_weight_audit": self.require_rollout_weight_audit}
