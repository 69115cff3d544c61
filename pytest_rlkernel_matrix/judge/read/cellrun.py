"""`cell-run.json` and the policy frozen into it, as pydantic v2 models: the one place their
keys and types are checked.

Unknown keys are handled on purpose, model by model:

- `CellRunMeta` (the file's top level): ``extra="ignore"``. The session writes keys the judge
  does not read (``overhead``, ``scheduler``, ``devices``, ``window``, ``cpu_share`` ...) and
  newer writers add more; none of them decides a verdict, so they are left unread.
- `RecordedPolicy` (``policy``): ``extra="forbid"``. Every key of it decides how a cell is
  judged; a key this judge does not know (a newer writer's rule, a misspelt one) means the cell
  would be judged under rules it did not ask for, so it fails closed.
- ``run`` is checked for its times (`RecordedRun`: finite, not negative; a nested model error
  names ``run``) and otherwise left to `run.runner.RunResult(**run)`, which refuses a foreign key
  itself (a `TypeError`, turned into the cell's `error` record like any reason below).
- ``performance_policy``: `RecordedPerformance`, the matrix file's own `[performance]` model
  (ranges included: ``confidence = 0.01`` is refused), ``extra="forbid"``, finite.
- Anywhere in the file, a number that is not finite is refused (`1e999` reads as inf), and the
  file is read by `store.safeio.read_json`: a key named twice in one object is refused, never
  "the last one wins".

Types are strict (no ``"3"`` for 3, no ``true`` for 1), strings are refused when empty or
padded with white space (``" cpu"`` is not ``cpu``), and a wrong value is a `ValueError` naming
the file and the key (``cell-run.json: key 'policy.backend': ...``): `report.record` turns it into
the cell's `error` record; it never aborts the session.

pydantic loads only when a cell is read (`report.record.read_cell_run`), never at plugin load.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from pytest_rlkernel_matrix.spec.matrix import PerformanceSection

ClaimName = Literal["train_rollout_bitwise", "run_to_run_bitwise", "weights_bitwise"]
Platform = Literal["cpu", "cuda", "rocm"]


def _unpadded(value: str) -> str:
    if not value or value != value.strip():
        raise ValueError(f"{value!r}: empty or padded with white space")
    return value


Name = Annotated[str, AfterValidator(_unpadded)]


class RecordedPolicy(BaseModel):
    """How the matrix file said to judge the cell (`session.policy`, plus ``repeat_dir`` that
    `session.scheduler` adds). ``extra="forbid"``: see the module's docstring."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    baseline_contract: dict[str, Any] | None = None  # (its keys: numeric's contract reader)
    min_samples_per_rank: int = Field(1, ge=1)
    min_active_tokens: int = Field(1, ge=1)
    baseline_claims: list[ClaimName] = Field(default_factory=list)
    require_rollout_weight_audit: bool = False
    backend: Platform | None = None
    repeat_dir: Name | None = None


class RecordedPerformance(PerformanceSection):
    """``performance_policy``: `spec.matrix.PerformanceSection` (its ranges: confidence in
    (0.5, 1), spreads and shares positive, ...), with every number finite (a `1e999` in JSON
    is inf, which a ``> 0`` bound lets through) and no key it does not know."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _finite_everywhere(value: Any, where: str = "", depth: int = 0) -> None:
    """`ValueError` naming the first non-finite float anywhere in `value` (cell-run.json is
    small: the walk is cheap), or a nesting past 100 levels."""
    if depth > 100:
        raise ValueError(f"{where or '(top level)'}: nested deeper than 100 levels")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where or '(top level)'}: {value!r} is not a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite_everywhere(v, f"{where}.{k}" if where else str(k), depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite_everywhere(v, f"{where}[{i}]", depth + 1)


class RecordedRun(BaseModel):
    """``run`` (`run.runner.RunResult`'s fields): times finite and not negative, ids whole
    numbers. ``extra="allow"``: `RunResult(**run)` refuses a foreign key itself."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    exit_code: int | None = None
    timed_out: bool = False
    interrupted: bool = False
    wall_time: float = Field(0.0, ge=0)
    pid: int | None = Field(None, ge=0)
    started_epoch: float | None = Field(None, ge=0)
    finished_epoch: float | None = Field(None, ge=0)


class CellRunMeta(BaseModel):
    """The keys of `cell-run.json` the judge reads. ``extra="ignore"``: see the module's
    docstring."""

    model_config = ConfigDict(extra="ignore", strict=True)

    cell: dict[str, Any]
    run: dict[str, Any]
    mode: Literal["strict", "audit", "auto", "off"]  # spec.matrix.Mode
    run_id: Name | None = None
    artifact_dir: str | None = None
    warmup: int = Field(0, ge=0)
    env: dict[str, str] = Field(default_factory=dict)
    preflight_blockers: list[Annotated[list[str], Field(min_length=2, max_length=2)]] = Field(
        default_factory=list)  # [capability class, why]
    policy: RecordedPolicy | None = None
    performance_policy: RecordedPerformance | None = None

    @model_validator(mode="before")
    @classmethod
    def _finite(cls, data: Any) -> Any:
        _finite_everywhere(data)
        return data

    @model_validator(mode="after")
    def _run_times(self) -> CellRunMeta:
        RecordedRun.model_validate(self.run)
        return self


def _where(err: Any) -> str:
    return ".".join(str(p) for p in err.get("loc", ())) or "(top level)"


def validated(meta: Any, path: Path) -> CellRunMeta:
    """`meta` (what `cell-run.json` at `path` parsed to) checked; `ValueError` naming the file
    and the first wrong key otherwise."""
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: not a JSON object")
    try:
        return CellRunMeta.model_validate(meta)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0] if errors else {}
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        got = repr(first.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."
        raise ValueError(f"{path}: key {_where(first)!r}: {str(first.get('msg', exc))[:200]} "
                         f"(got {got}){more}") from None
