"""The `matrix.toml` schema (pydantic v2) and its loader.

Every model forbids unknown keys, so a typo is an error naming the file and key path, not a
silently ignored setting. `load_matrix` turns a bad file into `MatrixFileError`, which the plugin
raises as a pytest usage error (one paragraph, no traceback).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pytest_rlkernel_matrix.spec.terms import (
    ALL_MODULES,
    CASES,
    MODULES,
    factor_case_parts,
    plural,
)

Module = Literal["attention", "ffn", "logp", "comm"]
Mode = Literal["strict", "audit", "auto", "off"]
Layout = Literal["pairwise", "reduced", "module-factorial", "full"]
Backend = Literal["cuda", "rocm", "cpu"]

_CASE_RE = re.compile(r"^[PR]/[PR]$")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")



def unique_entries(value: tuple[str, ...], what: str) -> tuple[str, ...]:
    """A non-empty list of distinct names (`[matrix] modules/cases`, a factor's `cases`)."""
    if not value:
        raise ValueError(f"must name at least one {what}")
    if len(set(value)) != len(value):
        raise ValueError(f"entries must be unique, got {list(value)}")
    return value

class MatrixFileError(Exception):
    """A matrix file that cannot be used; the message names the file and the key path."""


def normalize_case(value: object) -> str:
    """Parse a case the way RL-Kernel does (`strip().upper()`): `p/r` -> `P/R`."""
    if not isinstance(value, str):
        raise ValueError(f"a case is a string like 'P/R', got {type(value).__name__}")
    case = value.strip().upper()
    if not _CASE_RE.match(case):
        raise ValueError(
            f"{value!r} is not a case: expected one of {', '.join(CASES)} "
            "(first letter = training side, second = rollout side; P = production, R = RL-Kernel)"
        )
    return case


_SCOPED_RE = re.compile(r"^([A-Za-z]+)\[(.*)\]$")


def normalize_factor_case(value: object) -> str:
    """A factor's case: `P/P` (every module at it) or `attention[R/P]` (that module at the case,
    the others at the matrix's fixed case): the module lower-case, the case as `normalize_case`."""
    if isinstance(value, str):
        m = _SCOPED_RE.match(value.strip())
        if m:
            module = m.group(1).lower()
            if module not in ALL_MODULES:
                raise ValueError(f"{value!r}: {module!r} is not a module (expected one of "
                                 f"{', '.join(ALL_MODULES)})")
            return f"{module}[{normalize_case(m.group(2))}]"
    return normalize_case(value)


def factor_case_slug(case: str) -> str:
    """`R/P` -> `rp`, `attention[R/P]` -> `attention-rp` (a factor cell's name ends in it)."""
    module, xy = factor_case_parts(case)
    return (f"{module}-" if module else "") + xy.replace("/", "").lower()


def normalize_cases(value: object) -> object:
    """A list of cases, each parsed by `normalize_case`; anything else is left to the model."""
    if isinstance(value, (list, tuple)):
        return tuple(normalize_case(v) for v in value)
    return value


Case = Annotated[str, Field(description="training/rollout, e.g. 'P/R'")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BaselineContract(_Strict):
    """`[matrix] baseline_contract`: the site's numeric claim for the all-R baseline.

    `"bitwise"` (every active token's logprob identical on both sides) or
    `{ kind = "tolerance", max_abs_diff = x }` (every active token's |dlogp| at most x, finite).
    """

    kind: Literal["bitwise", "tolerance"]
    max_abs_diff: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                       description="largest allowed |dlogp| (tolerance only)")

    @model_validator(mode="after")
    def _limit(self) -> BaselineContract:
        if self.kind == "tolerance" and self.max_abs_diff is None:
            raise ValueError("a tolerance contract needs max_abs_diff (a finite float >= 0)")
        if self.kind == "bitwise" and self.max_abs_diff is not None:
            raise ValueError("a bitwise contract takes no max_abs_diff")
        return self

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"kind": self.kind}
        if self.kind == "tolerance":
            out["max_abs_diff"] = self.max_abs_diff
        return out


class MatrixSection(_Strict):
    """`[matrix]`: what the matrix varies and how it is judged by default."""

    name: str = "rl-kernel-ablation"
    modules: tuple[Module, ...] = MODULES
    cases: tuple[Case, ...] = CASES
    fixed_case: Case = "R/R"
    layout: Layout = "pairwise"
    mode: Mode = "audit"
    aligned: bool = True
    baseline_contract: BaselineContract | None = Field(
        default=None,
        description="the site's own numeric claim for the all-R aligned baseline: \"bitwise\" "
        "or { kind = \"tolerance\", max_abs_diff = <finite float> }",
    )
    min_samples_per_rank: int = Field(default=1, ge=1,
                                      description="logprob samples every sidecar rank must hold")
    baseline_claims: tuple[Literal["train_rollout_bitwise", "run_to_run_bitwise",
                                   "weights_bitwise"], ...] = Field(
        default=(), description="claims the all-R baseline must meet (strict: a declared claim "
        "that fails or is not judged makes the cell not valid); all three are reported always")
    min_active_tokens: int = Field(default=1, ge=1,
                                   description="active (mask=1) tokens the logprob evidence holds")
    require_rollout_weight_audit: bool = Field(
        default=False,
        description="a missing rollout-side weight audit (weight-audit/rollout/<version>.json "
        "or a weight_version in a rollout readback) is a reason, not only a note")

    @field_validator("baseline_contract", mode="before")
    @classmethod
    def _contract(cls, value: object) -> object:
        if isinstance(value, str):
            if value.strip().lower() != "bitwise":
                raise ValueError(
                    f"{value!r} is not a contract: use \"bitwise\" or a table "
                    "{ kind = \"tolerance\", max_abs_diff = <finite float> }"
                )
            return {"kind": "bitwise"}
        return value

    @field_validator("cases", mode="before")
    @classmethod
    def _cases(cls, value: object) -> object:
        if isinstance(value, (list, tuple)):
            return tuple(normalize_factor_case(v) for v in value)
        return value

    @field_validator("fixed_case", mode="before")
    @classmethod
    def _fixed(cls, value: object) -> str:
        return normalize_case(value)

    @field_validator("modules", "cases")
    @classmethod
    def _unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return unique_entries(value, "entry")

    @model_validator(mode="after")
    def _baseline(self) -> MatrixSection:
        if "R/R" not in self.cases:
            raise ValueError(
                "cases must include 'R/R': it is the aligned baseline every other cell is "
                "compared against and is never omitted"
            )
        return self


_SLURM_TIME_RE = re.compile(
    r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$"
)
# sbatch options the launcher sets itself (each cell's directory, name and output depend on them).
SLURM_OWNED_OPTIONS = ("--output", "--error", "--chdir", "--job-name", "--parsable", "--export",
                       "--requeue", "--no-requeue", "--wrap", "-o", "-e", "-D", "-J")


class SlurmSection(_Strict):
    """`[runner.slurm]`: how `launcher = "slurm"` submits each cell as one batch job."""

    partition: str | None = None
    nodes: int = Field(default=1, ge=1)
    gpus_per_node: int | None = Field(default=None, ge=0, description="--gpus-per-node")
    gres: str | None = Field(default=None, description="--gres, e.g. 'gpu:8' (or gpus_per_node)")
    cpus_per_task: int | None = Field(default=None, ge=1)
    time: str | None = Field(
        default=None,
        description="--time (minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]); default: the runner "
        "timeout rounded up to whole minutes",
    )
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    extra_args: tuple[str, ...] = Field(default=(), description="further sbatch options")
    max_concurrent: int = Field(default=1, ge=1, description="jobs of this session at once")
    requeue_on: tuple[Literal["NODE_FAIL", "PREEMPTED"], ...] = Field(
        default=(), description="resubmit once, into a fresh artifact directory",
    )
    poll_interval: float = Field(default=1.0, gt=0, description="seconds between squeue polls")

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not _SLURM_TIME_RE.match(value.strip()):
            raise ValueError(
                "not a Slurm time limit: use minutes, MM:SS, HH:MM:SS or D-HH:MM:SS"
            )
        return None if value is None else value.strip()

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for arg in value:
            if not arg.startswith("-"):
                raise ValueError(f"{arg!r} is not an sbatch option (options start with '-')")
            name = arg.split("=", 1)[0]
            if name in SLURM_OWNED_OPTIONS:
                raise ValueError(
                    f"{name} is set by the launcher for each cell (artifact directory, job "
                    "name, output, requeue); remove it from extra_args"
                )
        return value

    @model_validator(mode="after")
    def _gpus(self) -> SlurmSection:
        if self.gpus_per_node is not None and self.gres is not None:
            raise ValueError("give gpus_per_node or gres, not both")
        return self


class RunnerSection(_Strict):
    """`[runner]`: the command one cell runs, in a fresh process per cell."""

    launcher: Literal["local", "slurm"] = Field(
        default="local",
        description="local: a process on this machine; slurm: one batch job per cell",
    )
    slurm: SlurmSection | None = Field(default=None, description="[runner.slurm]")

    command: str | tuple[str, ...] = Field(
        description="a string run with `bash -c` (so $VIME_ROOT expands) or a list run as argv"
    )
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    timeout: float = Field(default=1800.0, gt=0, description="seconds; the process group is killed")
    kill_grace: float = Field(
        default=5.0, gt=0, le=600,
        description="seconds between SIGTERM and SIGKILL when the cell's processes are stopped "
        "(timeout, Ctrl-C, SIGTERM, processes left after the main one exited)",
    )
    r_provider: Literal["auto", "workload", "rl_engine", "external"] = Field(
        default="auto",
        description="whose R kernels the command runs: the built-in workload's, RL-Kernel's "
        "(rl_engine, checked by preflight) or external (preflight cannot check them: untested); "
        "auto decides from the command",
    )
    repeats: int = Field(default=1, ge=1, description="measured steps per cell (medians, spread)")
    warmup: int = Field(default=0, ge=0, description="leading steps excluded from timings")

    @field_validator("command")
    @classmethod
    def _nonempty(cls, value: str | tuple[str, ...]) -> str | tuple[str, ...]:
        if isinstance(value, str) and not value.strip():
            raise ValueError("command is empty")
        if isinstance(value, tuple) and (not value or not all(value)):
            raise ValueError("command list is empty or holds an empty argument")
        return value

    @model_validator(mode="after")
    def _slurm(self) -> RunnerSection:
        if self.launcher == "slurm" and self.slurm is None:
            object.__setattr__(self, "slurm", SlurmSection())
        if self.launcher == "local" and self.slurm is not None:
            raise ValueError(
                '[runner.slurm] is given but launcher is "local": set launcher = "slurm" '
                "or remove the table"
            )
        return self


class HardwareMatch(_Strict):
    """How a machine is recognised: regexes over what the tools report, never a guess."""

    device_name: str | None = Field(default=None, description="regex over NVIDIA/torch names")
    marketing_name: str | None = Field(default=None, description="regex over rocminfo names")
    gfx_arch: tuple[str, ...] | None = Field(default=None, description="runtime gfx archs")

    @field_validator("device_name", "marketing_name")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        return value


class Topology(_Strict):
    """Parallelism and placement the runs use; checked against the GPU count in preflight."""

    tp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    placement: Literal["colocate", "disaggregated"] = "colocate"
    gpus_per_cell: int | None = Field(
        default=None, ge=1,
        description="devices one cell needs (default tp*cp*pp); under xdist each worker owns "
        "this many, disjoint from the other workers'")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def devices_per_cell(self) -> int:
        return self.gpus_per_cell or self.world_size

    @model_validator(mode="after")
    def _enough(self) -> Topology:
        if self.gpus_per_cell is not None and self.gpus_per_cell < self.world_size:
            raise ValueError(
                f"gpus_per_cell={self.gpus_per_cell} is fewer than the tp*cp*pp = "
                f"{self.world_size} ranks of one cell (one device per rank)")
        return self


class ExpectedGap(_Strict):
    """A cell the profile expects not to be supported (like xfail)."""

    module: Module | Literal["*"] = "*"
    case: Case = "*"
    reason: str = ""

    @field_validator("case", mode="before")
    @classmethod
    def _case(cls, value: object) -> str:
        return "*" if value == "*" else normalize_case(value)


class HardwareProfile(_Strict):
    """`[hardware.<name>]`: one machine kind."""

    backend: Backend
    description: str = ""
    match: HardwareMatch = Field(default_factory=HardwareMatch)
    env: dict[str, str] = Field(default_factory=dict)
    topology: Topology = Field(default_factory=Topology)
    expect_unsupported: tuple[ExpectedGap, ...] = ()


class PreflightSection(_Strict):
    """`[preflight]`: what to fingerprint besides the machine (`$VARS` expand)."""

    checkpoint: str | None = Field(default=None, description="HF-format checkpoint directory")
    tokenizer: str | None = Field(default=None, description="tokenizer directory")
    timeout: float = Field(default=60.0, gt=0, description="seconds per preflight command")


class PerformanceSection(_Strict):
    """`[performance]`: when timings support a statement (see `stats.py` for the rule)."""

    min_steps: int = Field(default=5, ge=2, description="measured steps (after warmup) each cell "
                           "needs before its times support a slowdown/speed-up/ratio statement")
    processes: int = Field(default=1, ge=1, le=64, description="processes per cell: the first "
                           "is its correctness run, the others measured runs (timings only, "
                           "routes must match the first's), interleaved across the cells; "
                           "--rlk-processes overrides")
    auto: bool = Field(default=False, description="choose the processes per cell: a first "
                       "stage of `processes` (at least 3) measures the variance, then rounds "
                       "are added until every statement would resolve or `budget` is spent "
                       "(--rlk-processes=auto; session/scheduler.py)")
    budget: float = Field(default=10.0, gt=0, le=24 * 60, description="minutes the measured "
                          "processes of an auto session may take (--rlk-perf-budget)")
    min_processes: int = Field(default=2, description="processes each cell needs before its "
                               "times support a statement: the interval resamples processes "
                               "(between-process variation); supply them with processes = N "
                               "(or --rlk-processes=N)")
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0,
                              description="family-wise confidence of the report's performance "
                              "statements (judge/performance/factorial.py)")
    equivalence: float = Field(default=0.05, gt=0, le=1, description="margin m of 'no "
                               "difference within +-m': the whole interval of a time ratio "
                               "inside [1/(1+m), 1+m]")
    max_relative_spread: float = Field(default=0.5, gt=0, description="largest (max - min) / "
                                       "median of a cell's measured step times")
    max_foreign_cpu: float = Field(default=0.25, ge=0, le=1, description="largest share of the "
                                   "machine's CPU time used outside the cell's processes")
    max_concurrent_seconds: float = Field(default=1.0, ge=0, description="longest time another "
                                          "cell of the session may run on the same CPUs/devices")
    max_foreign_gpu_processes: int = Field(default=0, ge=0, description="other compute "
                                           "processes allowed on the cell's GPUs")
    sample_interval: float = Field(default=0.5, gt=0, le=10,
                                   description="seconds between contamination samples")

    @field_validator("min_processes")
    @classmethod
    def _several(cls, value: int) -> int:
        if value < 2:
            raise ValueError(
                f"must be at least 2, not {value}: an interval over one process's steps misses "
                "the variation between processes; run several processes per cell instead with "
                "[performance] processes = 3 (or --rlk-processes=3)")
        return value


class ProbeSection(_Strict):
    """`[probe]`: per-operator probe runs of drifting cells (docs/en/probe.md)."""

    when: Literal["never", "drift"] = Field(default="never", description="drift: after a cell "
                                            "whose sidecars drift, a separate probe run of it")
    tokens: int = Field(default=8, ge=1, le=4096, description="probe token budget per cell")
    controls: int = Field(default=2, ge=0, le=64, description="matching tokens probed as "
                          "controls next to the mismatching ones")
class ProfileSection(_Strict):
    """`[profile]`: separate profile runs (torch.profiler) of the cells, never measured runs
    (docs/en/performance.md, "Profile runs")."""

    when: Literal["never", "always"] = Field(default="never", description="always: after each "
                                             "cell's run, a separate profile run of it")
    skip: int = Field(default=1, ge=0, le=100, description="steps run before the profiler starts")
    steps: int = Field(default=2, ge=1, le=100, description="steps run under the profiler")
    cells: tuple[str, ...] = Field(
        default=("all",), min_length=1,
        description='the cells profiled: "all", or cells as pytest names them ("ffn[R/R]", '
        '"ffn[P/P]": R/R against P/P compares both sides with two profile runs)')

    def chooses(self, names: Iterable[str]) -> bool:
        """Whether a finished run (the cell names sharing it) gets its profile run."""
        return self.when == "always" and ("all" in self.cells
                                          or any(n in self.cells for n in names))


class ReproducibilitySection(_Strict):
    """`[reproducibility]`: run the all-R baseline cells `runs` times (same seed, separate
    processes and run directories) and compare sidecar bytes and weight chains."""

    runs: int = Field(default=1, ge=1, le=2, description="1: one run per cell; 2: the chosen "
                      "cells run twice and the run_to_run_bitwise claim is judged")
    cells: tuple[str, ...] = Field(
        default=("baseline",), min_length=1,
        description='the cells run twice when runs = 2: "baseline" (every all-R cell), a cell '
        'as pytest names it ("attention[P/R]", "factor-<name>-<variant>-<case>")')

    def chooses(self, names: Iterable[str], baseline: bool) -> bool:
        """Whether a run (the cell names sharing it, whether it is all-R) runs twice."""
        if self.runs < 2:
            return False
        return (baseline and "baseline" in self.cells) or any(n in self.cells for n in names)


FactorExpect = Literal["invariant", "logprob_drift", "weight_drift"]
_RESERVED_ENV = ("RL_KERNEL_",)


class FactorVariant(_Strict):
    """One variant of a factor: env and/or arguments added to the cell command."""

    env: dict[str, str] = Field(default_factory=dict, description="set in the cell's env")
    args: tuple[str, ...] = Field(default=(), description="appended to the cell command")

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if key.startswith(_RESERVED_ENV) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
                raise ValueError(
                    f"{key!r}: a factor may not set the RL-Kernel contract (RL_KERNEL_*) and "
                    "env names are letters, digits and '_'")
        return value

    @property
    def overrides(self) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
        return tuple(sorted(self.env.items())), self.args


class Factor(_Strict):
    """`[factors.<name>]`: a framework factor crossed with kernel cases (see docs factors.md).

    `baseline` names the unmodified cell (the matrix's own run of that case); each variant
    changes env/arguments of the cell command. `expect` says what the factor may change:
    `invariant` (nothing: the cell is held to the same contract as its baseline),
    `logprob_drift` (what the rollout reports: the train/rollout drift is measured and
    attributed, not held to the contract), `weight_drift` (the weights the rollout holds: the
    weight audits may differ between the sides, and the drift is measured).
    """

    baseline: str = Field(description="the name of the unmodified variant")
    variants: dict[str, FactorVariant]
    cases: tuple[Case, ...] = ("R/R",)
    expect: FactorExpect = "invariant"
    description: str = ""

    @field_validator("cases", mode="before")
    @classmethod
    def _cases(cls, value: object) -> object:
        if isinstance(value, (list, tuple)):
            return tuple(normalize_factor_case(v) for v in value)
        return value

    @field_validator("cases")
    @classmethod
    def _cases_unique(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return unique_entries(value, "case")

    @field_validator("variants")
    @classmethod
    def _variants(cls, value: dict[str, FactorVariant]) -> dict[str, FactorVariant]:
        if not value:
            raise ValueError("declare at least one variant besides the baseline")
        seen: dict[object, str] = {}
        for name, variant in value.items():
            if not _NAME_RE.match(name):
                raise ValueError(f"variant name {name!r} must be lower-case letters, digits, "
                                 "'.', '_' or '-'")
            if not variant.env and not variant.args:
                raise ValueError(f"variant {name!r} overrides nothing: it is equal to the "
                                 "baseline (give env and/or args)")
            if variant.overrides in seen:
                raise ValueError(f"variant {name!r} has the same overrides as variant "
                                 f"{seen[variant.overrides]!r}")
            seen[variant.overrides] = name
        return value

    @model_validator(mode="after")
    def _baseline_name(self) -> Factor:
        if not _NAME_RE.match(self.baseline):
            raise ValueError(f"baseline {self.baseline!r} must be lower-case letters, digits, "
                             "'.', '_' or '-'")
        if self.baseline in self.variants:
            raise ValueError(f"variant {self.baseline!r} has the baseline's name: the baseline "
                             "is the unmodified cell, a variant must differ from it")
        return self


class MatrixFile(_Strict):
    """The whole `matrix.toml`."""

    matrix: MatrixSection = Field(default_factory=MatrixSection)
    runner: RunnerSection
    preflight: PreflightSection = Field(default_factory=PreflightSection)
    performance: PerformanceSection = Field(default_factory=PerformanceSection)
    probe: ProbeSection = Field(default_factory=ProbeSection)
    profile: ProfileSection = Field(default_factory=ProfileSection)
    reproducibility: ReproducibilitySection = Field(default_factory=ReproducibilitySection)
    hardware: dict[str, HardwareProfile]
    factors: dict[str, Factor] = Field(
        default_factory=dict,
        description="[factors.<name>]: framework factors crossed with kernel cases")

    @field_validator("factors")
    @classmethod
    def _factor_names(cls, value: dict[str, Factor]) -> dict[str, Factor]:
        for name in value:
            if not _NAME_RE.match(name):
                raise ValueError(
                    f"factor name {name!r} must be lower-case letters, digits, '.', '_' or '-'")
        return value

    @model_validator(mode="after")
    def _comm_needs_tp(self) -> MatrixFile:
        if "comm" in self.matrix.modules:
            lacking = [n for n, p in self.hardware.items() if p.topology.tp < 2]
            if lacking:
                raise ValueError(
                    "matrix.modules enables 'comm', which varies the tensor-parallel reduction: "
                    "every profile needs topology.tp >= 2, but "
                    + ", ".join(f"hardware.{n}.topology.tp = "
                                f"{self.hardware[n].topology.tp}" for n in lacking))
        return self

    @model_validator(mode="after")
    def _scoped_factor_cases(self) -> MatrixFile:
        for name, factor in self.factors.items():
            for case in factor.cases:
                module, xy = factor_case_parts(case)
                if module and module not in self.matrix.modules:
                    raise ValueError(f"factors.{name}.cases: {case!r}: {module!r} is not in "
                                     f"matrix.modules {list(self.matrix.modules)}")
                if module and xy == self.matrix.fixed_case:
                    raise ValueError(f"factors.{name}.cases: {case!r}: the other modules are at "
                                     f"{xy} already (matrix.fixed_case): write {xy!r}")
        return self

    @model_validator(mode="after")
    def _repeat_cells(self) -> MatrixFile:
        known = {f"{m}[{c}]" for m in self.matrix.modules for c in CASES}
        known |= {f"factor-{n}-{v}-{factor_case_slug(c)}" for n, f in self.factors.items()
                  for v in f.variants for c in f.cases}
        for key, names, word in (("reproducibility.cells", self.reproducibility.cells,
                                  "baseline"), ("profile.cells", self.profile.cells, "all")):
            unknown = [c for c in names if c not in known and c != word]
            if unknown:
                raise ValueError(
                    f"{key}: {unknown[0]!r} is no cell of this matrix (expected \"{word}\", "
                    '"<module>[<case>]" with a module of matrix.modules, or a factor cell '
                    '"factor-<name>-<variant>-<case>")')
        return self

    @field_validator("hardware")
    @classmethod
    def _names(cls, value: dict[str, HardwareProfile]) -> dict[str, HardwareProfile]:
        if not value:
            raise ValueError("declare at least one [hardware.<name>] profile")
        for name in value:
            if not _NAME_RE.match(name):
                raise ValueError(
                    f"profile name {name!r} must be lower-case letters, digits, '.', '_' or '-'"
                )
        return value


def _loc(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or "<top level>"


def format_validation_error(path: Path, error: ValidationError) -> str:
    """One paragraph: file, then `key.path: what was expected (got ...)` per problem."""
    lines = [f"{path}: invalid matrix file ({plural(error.error_count(), 'problem')}):"]
    for item in error.errors(include_url=False):
        loc = _loc(tuple(item["loc"]))
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            msg = "unknown key (not part of the matrix.toml schema)"
        elif item["type"] == "missing":
            msg = "required key is missing"
        got = item.get("input")
        shown = "" if item["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else (
            f" (got {got!r})"
        )
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


def load_matrix(path: Path) -> MatrixFile:
    """Read and validate a matrix file; every failure is a `MatrixFileError`."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise MatrixFileError(f"{path}: cannot read matrix file: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise MatrixFileError(f"{path}: not valid TOML: {exc}") from None
    try:
        return MatrixFile.model_validate(data)
    except ValidationError as exc:
        raise MatrixFileError(format_validation_error(path, exc)) from None
