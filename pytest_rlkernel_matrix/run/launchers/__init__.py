"""Launchers: how one cell's command is run (`[runner] launcher`).

`local` runs it as a process on this machine (`runner.run_cell_command`); `slurm` submits it as a
batch job. Both write `run.log` and `exit-code` into the cell's artifact directory, so the same
analysis reads either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_rlkernel_matrix.run.launchers.base import Launcher
    from pytest_rlkernel_matrix.spec.matrix import MatrixFile


def make_launcher(matrix: MatrixFile) -> Launcher:
    """The launcher `[runner] launcher` names."""
    runner = matrix.runner
    if runner.launcher == "slurm":
        from pytest_rlkernel_matrix.run.launchers.slurm import SlurmLauncher

        assert runner.slurm is not None
        return SlurmLauncher(runner.slurm, topology={
            name: profile.topology.model_dump() for name, profile in matrix.hardware.items()})
    from pytest_rlkernel_matrix.run.launchers.local import LocalLauncher

    return LocalLauncher()
