"""A cell's plan: pure values, no I/O, no process.

From the matrix file and the session's identity (`token`, `created`), a `Planner` says where a
cell's run lives (`run_dir`, `lock_path`), its run id, the command and its working directory, the
environment contract, the CPU share or device set, the judging policy frozen into cell-run.json,
and the preflight blockers. `CellPlan` is one run's values (what the runner launches); a
`pytest_rlk_cell_env` addition joins it through `CellPlan.with_hook` (the hook's thread variable
wins over the share's). Nothing here creates a directory, opens a file or starts a process.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.run import cpushare
from pytest_rlkernel_matrix.run.runner import cell_env, contract_env
from pytest_rlkernel_matrix.spec.cells import Cell, canonical_cells, expand
from pytest_rlkernel_matrix.spec.matrix import MatrixFile


def utc_stamp(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")


def default_root(matrix_path: Path, option: str | None, env: Mapping[str, str],
                 now: datetime | None = None) -> Path:
    """`--rlk-matrix-root`, else `$MATRIX_ROOT`, else `outputs/rlkernel/ablation-matrix-<stamp>`
    next to the matrix file (`$MATRIX_STAMP` or the UTC time `now`: pass the session's
    `created`, so the root's stamp and the run ids' stamp are one instant)."""
    if option:
        return Path(option).expanduser().resolve()
    if env.get("MATRIX_ROOT"):
        return Path(env["MATRIX_ROOT"]).expanduser().resolve()
    stamp = env.get("MATRIX_STAMP") or utc_stamp(now)
    return matrix_path.parent / "outputs" / "rlkernel" / f"ablation-matrix-{stamp}"


@dataclass(frozen=True)
class CellPlan:
    """One run's values: what the runner writes into `matrix-case.env` and launches."""

    cell: Cell
    run_dir: Path
    label: str
    command: str | list[str]
    cwd: Path
    env: dict[str, str]
    recorded: dict[str, str]
    share: cpushare.CpuShare

    def with_hook(self, extra: Mapping[str, str]) -> CellPlan:
        """The plan with a `pytest_rlk_cell_env` addition: a thread variable it sets wins, and
        then none of the share's variables it did not set are given."""
        env, recorded = {**self.env, **extra}, {**self.recorded, **extra}
        hooked = self.share.with_hook(dict(extra))
        if hooked is not self.share:
            for var in self.share.env:
                if var not in extra:
                    env.pop(var, None)
                    recorded.pop(var, None)
        return replace(self, env=env, recorded=recorded, share=hooked)


@dataclass
class Planner:
    """Where and how each cell runs, from the matrix file and the session's identity."""

    matrix: MatrixFile
    matrix_path: Path
    root: Path
    layout: str
    mode: str
    token: str
    created: str
    cells: list[Cell] = field(default_factory=list)
    canonical: dict[str, Cell] = field(default_factory=dict)
    devices: list[str] | None = None
    cpu_slot: cpushare.Slot = field(default_factory=cpushare.Slot)
    preflight: Mapping[str, Any] = field(default_factory=dict)

    # -- which directory holds each run ---------------------------------------------------------
    def selected(self, cells: Sequence[Cell]) -> tuple[dict[str, Cell], int]:
        """(the cell owning each run key, how many cells the report expects) for a selection:
        a selected factor cell brings its baseline's run, reported even when not selected."""
        planner = replace(self, cells=list(cells))
        extra = [planner.factor_baseline(c) for c in cells if c.factor is not None]
        selected = {c.run_key for c in cells}
        return (canonical_cells([*cells, *extra]),
                len(cells) + len({b.run_key for b in extra} - selected))

    def factor_baseline(self, cell: Cell) -> Cell:
        """The unmodified cell a factor cell is compared with (every module at its case)."""
        layout = [*self.cells, *expand(self.matrix.matrix, [cell.hardware], self.layout,
                                       self.mode)]
        return cell.baseline_cell(layout)

    def run_dir(self, cell: Cell) -> Path:
        owner = self.canonical.get(cell.run_key, cell)
        return self.root / owner.hardware / owner.slug

    def lock_path(self, cell: Cell) -> Path:
        return self.root / ".locks" / f"{cell.run_key.replace('/', '__')}.lock"

    def shared_with(self, cell: Cell) -> list[str]:
        return [c.id for c in self.cells if c.run_key == cell.run_key and c.id != cell.id]

    def names(self, cell: Cell) -> list[str]:
        """The names of every selected cell of `cell`'s run, then its own."""
        return [c.name for c in self.cells if c.run_key == cell.run_key] + [cell.name]

    # -- identity -------------------------------------------------------------------------------
    def stamp(self) -> str:
        return self.created.replace("-", "").replace(":", "").split("+")[0]

    def own_run_id(self, hardware: str, slug: str) -> str:
        """The run id this session gives the first run of the cell `hardware/slug`."""
        return f"{hardware}-{slug}-{self.stamp()}Z-{self.token[:8]}"

    def run_id(self, cell: Cell, run_dir: Path | None = None) -> str:  # a repeat: its own id
        owner, again = self.canonical.get(cell.run_key, cell), run_dir and run_dir.suffix
        tail = again.replace(".repeat", "-repeat") if again and ".repeat" in again else ""
        return self.own_run_id(owner.hardware, owner.slug) + tail

    # -- command and environment ----------------------------------------------------------------
    def command(self, cell: Cell) -> str | list[str]:
        """The cell's command: the runner's, with a factor variant's arguments appended."""
        command = self.matrix.runner.command
        args = cell.factor.args if cell.factor is not None else ()
        if isinstance(command, str):
            return command + "".join(" " + shlex.quote(a) for a in args)
        return [*command, *args]

    def command_cwd(self) -> Path:
        cwd = self.matrix.runner.cwd
        base = self.matrix_path.parent
        return (base / os.path.expandvars(cwd)).resolve() if cwd else base

    def environment(self, cell: Cell, mode: str, run_dir: Path,
                    base: Mapping[str, str] | None = None,
                    run_id: str | None = None) -> tuple[dict[str, str], dict[str, str]]:
        runner = self.matrix.runner
        profile = self.matrix.hardware[cell.hardware]
        topo = profile.topology
        contract = contract_env(cell, mode=mode, aligned=self.matrix.matrix.aligned,
                                run_id=run_id or self.run_id(cell, run_dir), artifact_dir=run_dir,
                                repeats=runner.repeats, warmup=runner.warmup,
                                topology={"tp": topo.tp, "cp": topo.cp, "pp": topo.pp,
                                          "gpus_per_cell": topo.devices_per_cell})
        full, recorded = cell_env(contract, profile_env=profile.env, runner_env=runner.env,
                                  python=sys.executable, base=base)
        share = self.cpu_share(cell, base)
        full.update(share.env)
        recorded.update(share.env)
        if cell.factor is not None:  # the variant's env: after the profile's and the runner's
            full.update(cell.factor.env)
            recorded.update(cell.factor.env)
        if self.devices is not None and profile.backend != "cpu":
            from pytest_rlkernel_matrix.run.devices import device_env

            pinned = device_env(profile.backend, self.devices)
            full.update(pinned)
            recorded.update(pinned)
        return full, recorded

    def cpu_share(self, cell: Cell, base: Mapping[str, str] | None = None) -> cpushare.CpuShare:
        """The CPUs and threads a cell of this process gets (`cpushare`); a thread variable the
        user set (environment, profile env, `[runner.env]`) wins. `--rlk-plan` passes an empty
        base: it still reports this session's own variables."""
        profile = self.matrix.hardware[cell.hardware]
        return cpushare.plan_share(self.cpu_slot, launcher=self.matrix.runner.launcher,
                                   inherited=base or os.environ, profile_env=profile.env,
                                   runner_env=self.matrix.runner.env)

    def cell_plan(self, cell: Cell, mode: str, run_dir: Path, run_id: str | None = None,
                  extra_env: Mapping[str, str] | None = None) -> CellPlan:
        """One run of `cell` into `run_dir` (`run_id`, `extra_env`: a measured run's own id and
        role variables)."""
        env, recorded = self.environment(cell, mode, run_dir, run_id=run_id)
        env.update(extra_env or {})
        recorded.update(extra_env or {})
        owner = self.canonical.get(cell.run_key, cell)
        command = self.command(cell)
        return CellPlan(cell=cell, run_dir=run_dir, label=f"{owner.hardware}/{run_dir.name}",
                        command=command if isinstance(command, str) else list(command),
                        cwd=self.command_cwd(), env=env, recorded=recorded,
                        share=self.cpu_share(cell))

    # -- how the cell is judged, and what keeps it from starting --------------------------------
    def policy(self, cell: Cell) -> dict[str, Any]:
        """How the matrix file says to judge `cell` (frozen into cell-run.json for re-analysis)."""
        m = self.matrix.matrix
        contract = m.baseline_contract
        return {"baseline_contract": None if contract is None else contract.as_dict(),
                "min_samples_per_rank": m.min_samples_per_rank,
                "min_active_tokens": m.min_active_tokens,
                "baseline_claims": list(m.baseline_claims),
                "require_rollout_weight_audit": m.require_rollout_weight_audit,
                "backend": self.matrix.hardware[cell.hardware].backend}

    def blockers(self, cell: Cell, mode: str) -> list[list[str]]:
        """(class, reason) for each module whose requested R backend preflight found unavailable."""
        caps = self.preflight.get("capabilities")
        # Under Slurm the login node's capabilities and collectives say nothing about the compute
        # nodes: the node's own evidence (routes, fallbacks) decides there.
        if self.matrix.runner.launcher != "local":
            return []
        collective = [list(b) for b in self.collective_blockers(cell)]
        if mode == "off" or not caps:
            return collective
        from pytest_rlkernel_matrix.machine.capability import requested_r_blockers

        wanted = [m for m in cell.cases.as_dict() if "R" in cell.cases.of(m)]
        return [list(b) for b in requested_r_blockers(caps, wanted)] + collective

    def collective_blockers(self, cell: Cell) -> list[tuple[str, str]]:
        """A multi-rank cell needs its collective backend: NCCL/RCCL on GPUs, gloo on CPU."""
        profile = self.matrix.hardware[cell.hardware]
        if profile.topology.world_size <= 1:
            return []
        cls = "communication_path_unsupported"
        if profile.backend == "cpu":
            raw = ((self.preflight.get("probe") or {}).get("capabilities_raw") or {})
            if (raw.get("nccl") or {}).get("gloo_available") is False:
                return [(cls, f"tp*cp*pp = {profile.topology.world_size} ranks need the gloo "
                              "backend of torch.distributed, which this torch lacks")]
            return []
        entry = ((self.preflight.get("capabilities") or {}).get("capabilities") or {}).get(
            "collectives") or {}
        if entry.get("status") == "unavailable":
            return [(cls, f"tp*cp*pp = {profile.topology.world_size} ranks need "
                          f"{entry.get('name', 'the collective backend')}: {entry.get('reason')}")]
        return []
