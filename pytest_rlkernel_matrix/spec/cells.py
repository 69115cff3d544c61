"""Cells: the (hardware, module, case) points a layout asks for, and what each really runs.

A case is `training/rollout` (`P/R` = training production, rollout RL-Kernel). A cell names the
case it varies; its *effective cases* give all three modules. Cells with equal effective cases
are one run, reported under every name (`R/R` of attention, ffn and logp is the same run).

Layouts, and when each is enough:

- `pairwise` (default): per module R/R, P/R, R/P, P/P with the others fixed (R/R). Required
  whenever you need to know *which side* (training or rollout) of a module causes a drift or a
  slowdown, and whether the two sides interact: attribution needs P/R and R/P against R/R.
- `reduced`: per module R/R and P/P only. Enough to screen *whether* a module matters at all
  (P/P == R/R within its contract clears the module), e.g. a quick regression pass; it cannot
  separate a training-side from a rollout-side effect, so any module that drifts in `reduced`
  needs `pairwise` next.
- `module-factorial`: every module R/R or P/P (RL-Kernel's M000..M111, 8 runs): measures
  module-by-module interactions with both sides switched together.
- `full`: all 4^3 = 64 combinations; every side-by-module interaction, at 64 runs' cost.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_rlkernel_matrix.spec.terms import (
    ALL_MODULES,
    MODULES,
    factor_case_parts,
    factor_scope,
)

if TYPE_CHECKING:
    from pytest_rlkernel_matrix.spec.matrix import Factor, MatrixSection

FACTOR_MODULE = "factor"  # the `module` of a factor cell (it varies a factor, not a module)

_ABBREV = {"attention": "A", "ffn": "F", "logp": "L", "comm": "C"}


@dataclass(frozen=True, order=True)
class Cases:
    """Effective cases of one run, one per module (`comm` only when the matrix enables it)."""

    attention: str
    ffn: str
    logp: str
    comm: str = ""  # "" = the comm module is not in this matrix

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(m for m in ALL_MODULES if m in MODULES or getattr(self, m))

    def of(self, module: str) -> str:
        return str(getattr(self, module))

    def as_dict(self) -> dict[str, str]:
        return {m: self.of(m) for m in self.modules}

    @property
    def key(self) -> str:
        """Stable id, e.g. `A-RR_F-PR_L-RR` (`_C-RR` appended when comm is in play)."""
        return "_".join(f"{_ABBREV[m]}-{self.of(m).replace('/', '')}" for m in self.modules)

    @property
    def is_baseline(self) -> bool:
        return all(self.of(m) == "R/R" for m in self.modules)

    @property
    def is_native(self) -> bool:
        return all(self.of(m) == "P/P" for m in self.modules)

    def side(self, module: str, side: str) -> str:
        """`P` or `R` requested for one side (`training` or `rollout`) of a module."""
        case = self.of(module)
        return case[0] if side == "training" else case[2]

    def env(self) -> dict[str, str]:
        return {f"RL_KERNEL_{m.upper()}_CASE": self.of(m) for m in self.modules}


@dataclass(frozen=True)
class FactorPoint:
    """The factor variant a factor cell runs: env and arguments added to the cell command."""

    name: str
    variant: str
    baseline: str
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()
    expect: str = "invariant"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "variant": self.variant, "baseline": self.baseline,
                "env": dict(self.env), "args": list(self.args), "expect": self.expect}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FactorPoint:
        return cls(str(data["name"]), str(data["variant"]), str(data["baseline"]),
                   tuple(sorted((str(k), str(v)) for k, v in dict(data.get("env") or {}).items())),
                   tuple(str(a) for a in data.get("args") or ()),
                   str(data.get("expect") or "invariant"))


@dataclass(frozen=True)
class Cell:
    """One test item: a hardware profile, the module (axis) it varies and the case label.

    A factor cell (`factor` set) runs every module at `case` with one factor variant applied;
    its module is `factor` and its name `factor-<name>-<variant>-<case>`."""

    hardware: str
    module: str
    case: str
    cases: Cases
    factor: FactorPoint | None = None

    @property
    def name(self) -> str:
        if self.factor is not None:
            return self.slug
        return f"{self.module}[{self.case}]"

    @property
    def slug(self) -> str:
        """Directory name under `<matrix-root>/<hardware>/`, e.g. `attention-pr`."""
        case = self.case.replace('/', '').lower()
        if self.factor is not None:
            scope = f"{self.scope}-" if self.scope else ""
            return f"factor-{self.factor.name}-{self.factor.variant}-{scope}{case}"
        return f"{self.module}-{case}"

    @property
    def scope(self) -> str:
        """A factor cell at one module's case (`[factors] cases = ["attention[R/P]"]`): that
        module (the others at the matrix's fixed case); "" when every module is at `case`."""
        return factor_scope(self.case, self.cases.as_dict()) if self.factor is not None else ""

    @property
    def id(self) -> str:
        return f"{self.hardware}/{self.slug}"

    @property
    def is_baseline(self) -> bool:
        return self.factor is None and self.cases.is_baseline

    @property
    def run_key(self) -> str:
        key = f"{self.hardware}/{self.cases.key}"
        if self.factor is not None:
            key += f"~{self.factor.name}={self.factor.variant}"
        return key

    def baseline_cell(self, layout_cells: Sequence[Cell] = ()) -> Cell:
        """A factor cell's baseline: the unmodified run with the same cases (a cell of the
        layout when one runs it, else a cell named `factor-baseline[<case>]`, or for a factor
        cell at one module's case the module cell `<module>[<case>]`)."""
        for cell in layout_cells:
            if (cell.factor is None and cell.hardware == self.hardware
                    and cell.cases == self.cases):
                return cell
        if self.scope:  # one module at the case: the module cell a pairwise layout names
            return Cell(self.hardware, self.scope, self.case, self.cases)
        return Cell(self.hardware, "factor-baseline", self.case, self.cases)


def _with(fixed: str, with_comm: bool, **changed: str) -> Cases:
    values = {m: changed.get(m, fixed) for m in (*MODULES, *(("comm",) if with_comm else ()))}
    return Cases(**values)


def _pairwise(section: MatrixSection, cases: Sequence[str]) -> Iterator[tuple[str, str, Cases]]:
    comm = "comm" in section.modules
    for module in section.modules:
        for case in cases:
            yield module, case, _with(section.fixed_case, comm, **{module: case})


def _factorial(comm: str) -> Iterator[tuple[str, str, Cases]]:
    # RL-Kernel's naming: digit 1 = that module R/R, 0 = P/P, in attention, ffn, logp order.
    # An enabled comm module stays at the fixed case here (it is not one of RL-Kernel's bits).
    for bits in ("000", "100", "010", "001", "110", "101", "011", "111"):
        chosen = ["R/R" if b == "1" else "P/P" for b in bits]
        yield "modules", f"M{bits}", Cases(*chosen, comm=comm)


def _full(cases: Sequence[str], comm: str) -> Iterator[tuple[str, str, Cases]]:
    # The three seed modules in all combinations; an enabled comm module at the fixed case.
    for a in cases:
        for f in cases:
            for lp in cases:
                c = Cases(a, f, lp, comm)
                yield "full", c.key, c


def expand(
    section: MatrixSection, hardware: Sequence[str], layout: str | None = None,
    mode: str | None = None,
) -> list[Cell]:
    """All cells of a layout for each hardware profile, in a stable order (baselines first).

    In mode `off` RL-Kernel is disabled, so a cell whose varied case is P/P really runs every
    module natively: its effective cases are all P/P (one native run, named by each P/P cell).
    """
    chosen = layout or section.layout
    comm = section.fixed_case if "comm" in section.modules else ""
    if chosen == "pairwise":
        points = list(_pairwise(section, section.cases))
    elif chosen == "reduced":
        points = list(_pairwise(section, [c for c in ("R/R", "P/P") if c in section.cases]))
    elif chosen == "module-factorial":
        points = list(_factorial(comm))
    elif chosen == "full":
        points = list(_full(section.cases, comm))
    else:  # pragma: no cover - the option parser restricts choices
        raise ValueError(f"unknown layout {chosen!r}")
    if mode == "off":
        native = Cases("P/P", "P/P", "P/P", "P/P" if comm else "")
        points = [(m, c, native if (c == "P/P" or cs.is_native) else cs) for m, c, cs in points]
    return [Cell(hw, module, case, cases) for hw in hardware for module, case, cases in points]


def expand_factors(factors: Mapping[str, Factor], section: MatrixSection,
                   hardware: Sequence[str]) -> list[Cell]:
    """One cell per (hardware, factor, variant, case): every module at the case, in file order.

    The default matrix has none; a declared factor adds its cells after the layout's."""
    with_comm = "comm" in section.modules
    out: list[Cell] = []
    for hw in hardware:
        for name, factor in factors.items():
            for variant, v in factor.variants.items():
                point = FactorPoint(name, variant, factor.baseline, tuple(sorted(v.env.items())),
                                    tuple(v.args), factor.expect)
                for case in factor.cases:
                    module, xy = factor_case_parts(case)
                    cases = (_with(section.fixed_case, with_comm, **{module: xy}) if module
                             else Cases(case, case, case, case if with_comm else ""))
                    out.append(Cell(hw, FACTOR_MODULE, xy, cases, point))
    return out


def canonical_cells(cells: Sequence[Cell]) -> dict[str, Cell]:
    """For each run key, the first cell naming it: that cell's directory holds the run."""
    first: dict[str, Cell] = {}
    for cell in cells:
        first.setdefault(cell.run_key, cell)
    return first
