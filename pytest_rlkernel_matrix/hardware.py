"""Which hardware profiles a session runs: the ones `--rlk-hardware` names, else the one this
machine's preflight detects, checked against the matrix file (names, the topology's GPU count).

Part of the pytest face (`plugin.py` calls it at configure time); imports the machine layer only
inside the function, so loading the plugin stays light.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_rlkernel_matrix.spec.terms import plural


def select_hardware(config: pytest.Config, matrix: Any, path: Path, plan: bool,
              raw_dir: Path | None) -> tuple[list[str], dict[str, Any]]:
    """The hardware profiles this session runs (`--rlk-hardware`, else the one preflight
    detects) and the preflight data (none for a plan of named profiles)."""
    from pytest_rlkernel_matrix.machine import preflight as pf

    names = asked(config)
    check_names(names, matrix, path)
    if plan and names:
        return names, {}
    profile_topology = matrix.hardware[names[0]].topology.model_dump() if names else None
    section = matrix.preflight

    def where(value: str | None) -> Path | None:
        return (path.parent / os.path.expandvars(value)).resolve() if value else None

    # The probe runs in the Python the cells use ($PYTHON_BIN, the validated environment).
    # RLK_REUSE_PROBE (test suites only) takes it from a saved probe; preflight.json says so.
    reuse = os.environ.get(pf.REUSE_PROBE_ENV)
    data = pf.collect_preflight(python=os.environ.get("PYTHON_BIN") or sys.executable,
                                topology=profile_topology, checkpoint=where(section.checkpoint),
                                tokenizer=where(section.tokenizer), timeout=section.timeout,
                                raw_dir=raw_dir, reuse_probe=Path(reuse) if reuse else None)
    detected = pf.detect_hardware(data, matrix.hardware)
    from pytest_rlkernel_matrix.machine.capability import runner_capabilities

    profile = names[0] if names else detected
    backend = matrix.hardware[profile].backend if profile else data.get("gpu", {}).get("backend")
    data["capabilities"] = runner_capabilities(data, backend or "cpu", matrix.runner.command,
                                               matrix.runner.r_provider)
    gpu = data.get("gpu", {})
    seen = f"backend {gpu.get('backend', '?')}, GPUs: {', '.join(gpu.get('names') or []) or 'none'}"
    remote = matrix.runner.launcher != "local"
    if not names:
        if detected is None:
            raise pytest.UsageError(
                f"{path}: no [hardware.<name>] profile matches this machine ({seen}); "
                + ("with launcher = \"slurm\" the cells run on compute nodes: pass "
                   "--rlk-hardware=<profile of those nodes>" if remote else
                   "add a profile or pass --rlk-hardware with --rlk-plan")
            )
        names = [detected]
    elif not plan and not remote:  # under Slurm each job checks its own node
        foreign = [n for n in names if n != detected]
        if foreign:
            raise pytest.UsageError(
                f"--rlk-hardware={','.join(foreign)}: this machine is detected as "
                f"{detected or 'no profile of ' + str(path)} ({seen}); a cell can only run on "
                "the hardware it names. Use --rlk-plan to print the commands for other hardware."
            )
    if not plan:
        check_topology(path, matrix, names, data)
    return names, data


def asked(config: pytest.Config) -> list[str]:
    asked = config.getoption("rlk_hardware")
    return [n.strip() for n in asked.split(",") if n.strip()] if asked else []


def check_names(names: list[str], matrix: Any, path: Path) -> None:
    unknown = [n for n in names if n not in matrix.hardware]
    if unknown:
        raise pytest.UsageError(
            f"{path}: --rlk-hardware names {', '.join(unknown)}, but the file declares only "
            f"[hardware.{'], [hardware.'.join(matrix.hardware)}]"
        )


def check_topology(path: Path, matrix: Any, names: list[str], data: dict[str, Any]) -> None:
    """A GPU profile's cell needs `gpus_per_cell` (default tp*cp*pp) visible devices."""
    count = int((data.get("gpu") or {}).get("count") or 0)
    for name in names:
        profile = matrix.hardware[name]
        need = profile.topology.devices_per_cell
        if profile.backend != "cpu" and need > 1 and count < need:
            raise pytest.UsageError(
                f"{path}: hardware.{name}.topology asks for {plural(need, 'GPU')} per cell "
                f"(tp={profile.topology.tp}, cp={profile.topology.cp}, pp={profile.topology.pp}"
                f", gpus_per_cell={profile.topology.gpus_per_cell}), but preflight sees "
                f"{count} on this machine"
            )
