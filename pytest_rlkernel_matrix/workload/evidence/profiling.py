"""The reference job's step accounting, its profile runs and the ``slow`` drill.

Step accounting (``STEP_TIMING``, written to the manifest's ``timing``): `perf/step_time` is
weight sync + rollout + training + whatever else the step does; the job's own debug work (the
per-version weight-audit hashing) runs off the step clock and is reported as
`perf/rlk_debug_time`; sidecar, probe and readback writes and the between-step garbage
collection run after the step's clock stops.

A profile run (``RL_KERNEL_PROFILE=1``, started by the plugin for ``--rlk-profile``; never a
measured run) runs the steps after ``RL_KERNEL_PROFILE_SKIP`` under ``torch.profiler`` (CPU, and
CUDA on a GPU) and exports a chrome trace to ``$RL_KERNEL_PROFILE_DIR/trace.rank{r:05d}.json.gz``.
Its ranges: ``rlk.phase.<weight_sync|rollout|training>`` around each phase and
``rlk.<side>.<module>`` around each call of a module kernel (``attention``, ``ffn``, ``logp``,
``comm``), which ``judge/localise/profile.py`` buckets the trace by.

The ``slow`` drill (``RLK_REF_FAULT=slow:<module>:<side>:<factor>``): where that module runs its
R path on that side, each call runs the module's kernels again on the same inputs (result
discarded) until the extra calls reach ``factor - 1`` per call on average (1.5: one extra call
every second call). The extra time is real kernel time on that side's phase, on CPU and GPU
alike (graph-captured decode steps capture the repeat too).
"""

from __future__ import annotations

import gzip
import os
import shutil
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from pytest_rlkernel_matrix.workload.env import SIDES, FaultDrill, UsageError

PROFILE_ENV = "RL_KERNEL_PROFILE"
PROFILE_DIR_ENV = "RL_KERNEL_PROFILE_DIR"
PROFILE_SKIP_ENV = "RL_KERNEL_PROFILE_SKIP"
PHASE_PREFIX = "rlk.phase."
MODULE_KERNELS = ("attention", "ffn", "logp", "comm")

STEP_TIMING = {
    "step_time": "perf/step_time = weight sync (incl. the rollout engine's weight load) + "
                 "rollout + training + the rest of the step; the job's debug work is off it",
    "debug_work": {
        "weight_audit": "sha256 of both sides' weights per exported version (weight-audit/): "
                        "off the step clock, timed as perf/rlk_debug_time"},
    "after_the_step": ["mismatch-sidecar writes", "probe writes (probe runs only)",
                       "readback writes (after the last step)",
                       "gc.collect between steps"],
}


class ProfileRequest:
    """What ``RL_KERNEL_PROFILE*`` asks of this process (disabled without the variable)."""

    def __init__(self, enabled: bool, directory: Path | None, skip: int) -> None:
        self.enabled, self.directory, self.skip = enabled, directory, skip
        self._prof: Any = None
        self._phase: Any = None
        self.profiled_steps = 0

    @classmethod
    def from_env(cls, artifact_dir: Path) -> ProfileRequest:
        e = os.environ
        if e.get(PROFILE_ENV, "").strip() not in ("1", "true"):
            return cls(False, None, 0)
        raw = e.get(PROFILE_SKIP_ENV, "").strip() or "0"
        if not raw.isdigit():
            raise UsageError(f"{PROFILE_SKIP_ENV}={raw!r}: expected an int >= 0")
        where = Path(e.get(PROFILE_DIR_ENV, "").strip() or artifact_dir / "profile")
        where.mkdir(parents=True, exist_ok=True)
        return cls(True, where, int(raw))

    def manifest(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "skip_steps": self.skip,
                "directory": str(self.directory) if self.enabled else None,
                "profiled_steps": self.profiled_steps,
                "excluded_from_performance": self.enabled,
                "ranges": {"phase": PHASE_PREFIX + "<weight_sync|rollout|training>",
                           "module": "rlk.<side>.<attention|ffn|logp|comm>"}}

    def step(self, step: int, device: torch.device) -> None:
        """Before step ``step``: the profiler starts at step ``skip``."""
        if not self.enabled or self._prof is not None or step < self.skip:
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=acts, record_shapes=False, with_stack=False)
        self._prof.__enter__()

    def counted(self) -> None:
        """After a profiled step."""
        if self._prof is not None:
            self.profiled_steps += 1

    def phase(self, name: str | None) -> None:
        """Close the open phase range and open ``rlk.phase.<name>`` (None: just close)."""
        if self._prof is None:
            return
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None
        if name is not None:
            self._phase = torch.profiler.record_function(PHASE_PREFIX + name)
            self._phase.__enter__()

    def finish(self, rank: int) -> Path | None:
        """Stop the profiler and write the chrome trace (gzip); its path."""
        if self._prof is None or self.directory is None:
            return None
        self.phase(None)
        self._prof.__exit__(None, None, None)
        plain = self.directory / f".trace.rank{rank:05d}.{os.getpid()}.json"
        self._prof.export_chrome_trace(str(plain))
        out = self.directory / f"trace.rank{rank:05d}.json.gz"
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        with plain.open("rb") as src, gzip.open(tmp, "wb", compresslevel=3) as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, out)
        plain.unlink()
        self._prof = None
        return out


class _Module:
    """A module kernel seen through a profile range and/or the slow drill; everything else
    (implementation, call counts, caches, the drift drill's ``drift``) is the kernel's own."""

    _own = ("_inner", "_range", "_extra", "_owed")

    def __init__(self, inner: Any, label: str | None, extra: float) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_range", label)
        object.__setattr__(self, "_extra", extra)
        object.__setattr__(self, "_owed", 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def _run(self, fn: Any, *args: Any) -> Any:
        ctx: AbstractContextManager[Any] = (
            torch.profiler.record_function(self._range) if self._range else nullcontext())
        with ctx:
            out = fn(*args)
            tap = self._inner.tap
            if self._extra and not (tap is not None and getattr(tap, "recording", False)):
                self._owed += self._extra  # (a probe's tap records each operator once)
                while self._owed >= 1.0:  # the drill: the same kernels again, result dropped
                    self._owed -= 1.0
                    calls = self._inner.call_count
                    fn(*args)
                    self._inner.call_count = calls  # readbacks count the job's own calls
        return out

    def __call__(self, *args: Any) -> Any:
        return self._run(self._inner, *args)

    def full(self, *args: Any) -> Any:
        return self._run(self._inner.full, *args)

    def selected(self, *args: Any) -> Any:
        return self._run(self._inner.selected, *args)

    def reduce_add(self, *args: Any) -> Any:
        return self._run(self._inner.reduce_add, *args)


def slow_factor(drill: FaultDrill | None, applied: bool, module: str, side: str) -> float:
    """The slow drill's extra calls per call of ``module`` on ``side`` (0: none)."""
    if (drill is None or drill.kind != "slow" or not applied or drill.module != module
            or drill.side != side):
        return 0.0
    return max(0.0, drill.factor - 1.0)


def instrument(kernels: dict[str, Any], profile: ProfileRequest, drill: FaultDrill | None,
               applied: bool) -> None:
    """Wrap each side's module kernels for the profile ranges and the slow drill (in place; a
    measured run without the drill is left untouched)."""
    for side in SIDES:
        k = kernels[side]
        for m in MODULE_KERNELS:
            inner = getattr(k, m)
            extra = slow_factor(drill, applied, m, side)
            if inner is None or not (profile.enabled or extra):
                continue
            setattr(k, m, _Module(inner, f"rlk.{side}.{m}" if profile.enabled else None, extra))
