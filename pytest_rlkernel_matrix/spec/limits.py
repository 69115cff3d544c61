"""The performance limits a matrix file declares (`[performance]`), frozen for judging.

In `spec` (not `judge.performance.stats`) because the run layer's contamination sampler reads its
`sample_interval` too, and the run layer never imports the judge layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Policy:
    """The declared limits (`[performance]` in matrix.toml); defaults are the documented ones."""

    min_steps: int = 5
    processes: int = 1
    auto: bool = False  # --rlk-processes=auto (session/scheduler.py)
    budget: float = 10.0  # minutes of measured runs an auto session may take
    min_processes: int = 2
    confidence: float = 0.95
    equivalence: float = 0.05
    max_relative_spread: float = 0.5
    max_foreign_cpu: float = 0.25
    max_concurrent_seconds: float = 1.0
    max_foreign_gpu_processes: int = 0
    sample_interval: float = 0.5

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> Policy:
        """From a record or cell-run.json; unknown keys are ignored, missing ones default."""
        if not isinstance(data, Mapping):
            return cls()
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def over(value: float, limit: float) -> tuple[str, str]:
    """`value` and `limit` as percentages with the digits that decide `value > limit`: never
    '50% > 50%' (0.504 against 0.50 reads '50.4% > 50%')."""
    for digits in range(0, 5):
        a, b = f"{value * 100:.{digits}f}%", f"{limit * 100:.{digits}f}%"
        if a != b:
            return a, b
    return f"{value * 100:.6f}%", f"{limit * 100:.6f}%"
