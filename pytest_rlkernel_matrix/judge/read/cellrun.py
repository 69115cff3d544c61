"""`cell-run.json` and the policy frozen into it, as pydantic v2 models: the one place their
keys and types are checked.

Unknown keys are handled on purpose, model by model:

- `CellRunMeta` (the file's top level): ``extra="ignore"``. The session writes keys the judge
  does not read (``overhead``, ``scheduler``, ``devices``, ``window``, ``cpu_share`` ...) and
  newer writers add more; none of them decides a verdict, so they are left unread.
- `RecordedPolicy` (``policy``): ``extra="forbid"``. Every key of it decides how a cell is
  judged; a key this judge does not know (a newer writer's rule, a misspelt one) means the cell
  would be judged under rules it did not ask for, so it fails closed.
- ``run`` stays a plain object here: `run.runner.RunResult(**run)` refuses a foreign key itself
  (a `TypeError`, turned into the cell's `error` record like any reason below).

Types are strict (no ``"3"`` for 3, no ``true`` for 1), strings are refused when empty or
padded with white space (``" cpu"`` is not ``cpu``), and a wrong value is a `ValueError` naming
the file and the key (``cell-run.json: key 'policy.backend': ...``): `report.record` turns it into
the cell's `error` record; it never aborts the session.

pydantic loads only when a cell is read (`report.record.read_cell_run`), never at plugin load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

ClaimName = Literal["train_rollout_bitwise", "run_to_run_bitwise", "weights_bitwise"]
Platform = Literal["cpu", "cuda", "rocm"]


def _unpadded(value: str) -> str:
    if not value or value != value.strip():
        raise ValueError(f"{value!r}: empty or padded with white space")
    return value


Name = Annotated[str, AfterValidator(_unpadded)]


class RecordedPolicy(BaseModel):
    """How the matrix file said to judge the cell (`session.policy`, plus ``repeat_dir`` that
    `extra_runs` adds). ``extra="forbid"``: see the module's docstring."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    baseline_contract: dict[str, Any] | None = None  # (its keys: numeric's contract reader)
    min_samples_per_rank: int = Field(1, ge=1)
    min_active_tokens: int = Field(1, ge=1)
    baseline_claims: list[ClaimName] = Field(default_factory=list)
    require_rollout_weight_audit: bool = False
    backend: Platform | None = None
    repeat_dir: Name | None = None


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
    performance_policy: dict[str, Any] | None = None


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
