"""`launcher = "local"`: the cell's command as a process group on this machine."""

from __future__ import annotations

import shlex

from pytest_rlkernel_matrix.run.launchers.base import CellJob, Outcome
from pytest_rlkernel_matrix.run.runner import REDACTED, is_secret, run_cell_command


class LocalLauncher:
    """Runs in `wait` (one process at a time per pytest process; xdist gives more)."""

    name = "local"

    def start(self, job: CellJob) -> None:
        return None

    def wait(self, job: CellJob) -> Outcome:
        result = run_cell_command(job.command, cwd=job.cwd, env=job.env, timeout=job.timeout,
                                  artifact_dir=job.run_dir, progress=job.progress,
                                  progress_every=job.progress_every,
                                  kill_grace=job.kill_grace, raise_on_interrupt=False,
                                  session_tag=job.session_tag, cpus=job.cpus)
        return Outcome(result=result)

    def cancel_all(self, why: str) -> list[str]:
        return []  # the running process group is killed by run_cell_command itself

    def render(self, job: CellJob) -> str:
        shown = job.command if isinstance(job.command, str) else shlex.join(job.command)
        lines = [f"cd {shlex.quote(str(job.cwd))} && env \\"]
        for key in sorted(job.recorded):
            value = REDACTED if is_secret(key) else job.recorded[key]
            lines.append(f"  {key}={shlex.quote(value)} \\")
        lines.append(f"  bash -c {shlex.quote(shown)}" if isinstance(job.command, str)
                     else f"  {shown}")
        return "\n".join(lines)

    def retryable(self, outcome: Outcome) -> bool:
        return False
