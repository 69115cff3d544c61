"""The reference job's inputs: the RL-Kernel environment contract it reads, fault drills and the
route each side takes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pytest_rlkernel_matrix.workload.kernels.side import (
    ALL_MODULES,
    MODULES,
    R_BACKEND_IDS,
)

SIDES = ("training", "rollout")


CASES = ("P/P", "P/R", "R/P", "R/R")


FAULT_KINDS = ("recorded_fallback", "silent_fallback", "corrupt_weight", "unsupported",
               "nondeterministic", "drift_growth", "slow")
# nondeterministic (same within a run, different between runs): on the training side, noise on
# the module's gradients (a backward whose atomics vary run to run); on the rollout side, the
# sampler's seed (a rollout engine whose sampling is not pinned); either applies only where the
# module's side runs the R path. drift_growth: the module's output on the side scaled by
# 1 + step * 2**-6 (grows with the step index, none at step 0). slow:<module>:<side>:<factor>:
# where the module's side runs the R path, its kernels take `factor` times as long (profiling.py).


# per preset: prompts, max new tokens, micro-batch size (the last one no longer used by the job:
# budget.MICRO_BATCH_TOKENS chooses the micro-batch by tokens and memory, issue 46)
RUN_DEFAULTS = {
    "tiny": (8, 48, 4), "small": (16, 160, 3), "qwen3-0.6b": (320, 256, 32)}


NONCE_ENV = "RLK_REF_FAULT_NONCE"


def run_nonce() -> int:
    """The nondeterministic drill's per-run value: drawn once by the launching process (before
    it starts its ranks, ``FaultDrill.from_env``) and handed to them in ``RLK_REF_FAULT_NONCE``,
    so it is the same within a run and differs between runs."""
    raw = os.environ.get(NONCE_ENV, "")
    if not raw.isdigit():
        raw = str(int.from_bytes(os.urandom(4), "little") or 1)
        os.environ[NONCE_ENV] = raw
    return int(raw)


class UsageError(Exception):
    """Bad environment or options: exit 2 with a message."""


BACKWARD_ENV = "RLK_REF_R_BACKWARD"
R_BACKWARDS = ("triton", "recompute", "tiled")  # described in autograd.BACKWARD_METHODS


def backward_mode() -> str:
    """``RLK_REF_R_BACKWARD``: how the learning step's backward runs where the training forward
    runs Triton: ``triton`` (default: the loss on the Triton forward, the deterministic Triton
    backward kernels of ``triton_backward.py``), ``recompute`` (the loss on the Triton forward,
    ``autograd.py``'s per-op native recompute backward) or ``tiled`` (the loss forward and
    backward on the torch R path)."""
    raw = os.environ.get(BACKWARD_ENV, "").strip() or "triton"
    if raw not in R_BACKWARDS:
        raise UsageError(f"{BACKWARD_ENV}={raw!r}: expected one of {list(R_BACKWARDS)}")
    return raw


@dataclass
class FaultDrill:
    """A fault drill switched on by ``RLK_REF_FAULT=<kind>[:<module>[:<side>]]`` (the slow
    drill: ``slow:<module>:<side>:<factor>``, factor a number from 1 to 100)."""

    kind: str
    module: str = "attention"
    side: str = "rollout"
    factor: float = 1.0

    @classmethod
    def from_env(cls) -> FaultDrill | None:
        raw = os.environ.get("RLK_REF_FAULT", "").strip()
        if not raw:
            return None
        parts = raw.split(":")
        drill = cls(*parts[:3])
        if (drill.kind not in FAULT_KINDS or drill.module not in ALL_MODULES
                or drill.side not in SIDES or len(parts) > (4 if drill.kind == "slow" else 3)):
            raise UsageError(f"RLK_REF_FAULT={raw!r}: expected <kind>[:<module>[:<side>]] with "
                             f"kind in {FAULT_KINDS}, module in {ALL_MODULES}, side in {SIDES} "
                             "(slow:<module>:<side>:<factor>)")
        if drill.kind == "slow":
            try:
                drill.factor = float(parts[3]) if len(parts) == 4 else float("nan")
            except ValueError:
                drill.factor = float("nan")
            if not 1.0 <= drill.factor <= 100.0:  # NaN fails too
                raise UsageError(f"RLK_REF_FAULT={raw!r}: slow needs "
                                 "slow:<module>:<side>:<factor> with a factor from 1 to 100")
        if drill.kind == "nondeterministic":  # drawn here, before the ranks start
            run_nonce()
        return drill


@dataclass
class Env:
    """The RL-Kernel environment contract as this process sees it."""

    mode: str
    cases: dict[str, str]
    run_id: str
    artifact_dir: Path
    readback_dir: Path
    sidecar_dir: Path
    weight_audit_dir: Path
    route_report: bool
    aligned: bool = True
    modules: tuple[str, ...] = MODULES  # + "comm" when RL_KERNEL_COMM_CASE is set

    @classmethod
    def from_environ(cls) -> Env:
        e = os.environ
        art = e.get("RL_KERNEL_ARTIFACT_DIR", "").strip()
        if not art:
            raise UsageError("RL_KERNEL_ARTIFACT_DIR is not set: the reference workload needs a "
                             "per-cell artifact directory (see docs/artifact-format.md)")
        mode = e.get("RL_KERNEL_MODE", "strict").strip().lower()
        if mode not in ("strict", "audit", "auto", "off"):
            raise UsageError(f"RL_KERNEL_MODE={mode!r}: expected strict|audit|auto|off")
        cases = {}
        for m in MODULES:
            case = e.get(f"RL_KERNEL_{m.upper()}_CASE", "P/P").strip().upper() or "P/P"
            if case not in CASES:
                raise UsageError(f"RL_KERNEL_{m.upper()}_CASE={case!r}: expected one of {CASES}")
            cases[m] = case
        modules = MODULES
        comm = e.get("RL_KERNEL_COMM_CASE", "").strip().upper()
        if comm:  # the optional fourth module: in play only when the matrix asks for it
            if comm not in CASES:
                raise UsageError(f"RL_KERNEL_COMM_CASE={comm!r}: expected one of {CASES}")
            cases["comm"] = comm
            modules = ALL_MODULES
        root = Path(art)
        return cls(mode, cases, e.get("RL_KERNEL_RUN_ID", root.name), root,
                   Path(e.get("RL_KERNEL_READBACK_DIR") or root / "readbacks"),
                   Path(e.get("RL_KERNEL_MISMATCH_SIDECAR_DIR") or root / "mismatch-sidecars"),
                   Path(e.get("RL_KERNEL_WEIGHT_AUDIT_DIR") or root / "weight-audit"),
                   e.get("RL_KERNEL_ROUTE_REPORT", "1").strip() != "0",
                   e.get("RL_KERNEL_ALIGNED", "1").strip() != "0", modules)

    def requested(self, module: str, side: str) -> str:
        """``rl_kernel`` or ``production`` as requested by the case (off: always production)."""
        if self.mode == "off":
            return "production"
        letter = self.cases[module].split("/")[0 if side == "training" else 1]
        return "rl_kernel" if letter == "R" else "production"


@dataclass
class Route:
    """What one side runs per module, and what it claims/records."""

    side: str
    requested: dict[str, str]
    actual: dict[str, str]
    claimed: dict[str, str]
    fallbacks: list[dict[str, str]]
    unsupported: dict[str, str]


def resolve_route(env: Env, side: str, drill: FaultDrill | None, platform: str) -> Route:
    """Apply the case, the mode and any fault drill to one side's module implementations."""
    req = {m: env.requested(m, side) for m in env.modules}
    actual, claimed = dict(req), dict(req)
    fallbacks: list[dict[str, str]] = []
    unsupported: dict[str, str] = {}
    if drill and drill.side == side and req.get(drill.module) == "rl_kernel":
        m = drill.module
        if drill.kind == "recorded_fallback":
            actual[m] = claimed[m] = "production"
            fallbacks.append({"module": m, "reason": "fault drill: rl_kernel backend raised at "
                                                     "dispatch; native path ran instead"})
        elif drill.kind == "silent_fallback":
            actual[m] = "production"  # claimed stays rl_kernel: the lie the plugin must catch
        elif drill.kind == "unsupported":
            unsupported[m] = (f"{R_BACKEND_IDS[m]} has no kernel for device={platform}-"
                              "fault-drill (capability drill)")
            actual[m] = claimed[m] = "production"
            fallbacks.append({"module": m, "reason": "unsupported: " + unsupported[m]})
    return Route(side, req, actual, claimed, fallbacks, unsupported)


def intra_op_threads(environ: Mapping[str, str], world: int) -> int | None:
    """torch's intra-op threads for one of the cell's `world` rank processes.

    `RLK_MATRIX_THREADS` (the cell's CPU share, set by the plugin) is divided among the ranks; a
    user's `OMP_NUM_THREADS` is per process, as OpenMP defines it; otherwise the CPUs of this
    process's affinity mask (never `os.cpu_count()`, which ignores taskset and cpusets) are
    divided among the ranks. None: unreadable values leave torch's default."""
    for var, per_rank in (("RLK_MATRIX_THREADS", True), ("OMP_NUM_THREADS", False)):
        raw = environ.get(var, "").strip()
        if raw:
            try:
                total = int(raw.split(",")[0])
            except ValueError:
                return None
            return max(1, total // world if per_rank else total)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, cpus // world)


FACTOR_SAMPLING = ("raw", "processed")
FACTOR_WEIGHT_SYNC = ("exact", "bf16", "stale")


def factor_env(environ: Mapping[str, str], engine: str = "") -> tuple[str, int | None, str, str]:
    """The three factor variables, read and checked: (``RLK_REF_ROLLOUT_BATCH`` as given, its
    size or None for all, ``RLK_REF_SAMPLING``, ``RLK_REF_WEIGHT_SYNC``). ``engine``: what the
    variable sets in an engine, named in the error (e.g. ``vLLM max_num_seqs``)."""
    def hint(setting: str) -> str:
        return f" ({engine} {setting})" if engine else ""

    raw_batch = environ.get("RLK_REF_ROLLOUT_BATCH", "all").strip().lower() or "all"
    if raw_batch == "all":
        batch = None
    elif raw_batch.isdigit() and int(raw_batch) >= 1:
        batch = int(raw_batch)
    else:
        raise UsageError(f"RLK_REF_ROLLOUT_BATCH={raw_batch!r}: expected 'all' or an int >= 1"
                         + hint("max_num_seqs"))
    sampling = environ.get("RLK_REF_SAMPLING", "raw").strip().lower() or "raw"
    if sampling not in FACTOR_SAMPLING:
        raise UsageError(f"RLK_REF_SAMPLING={sampling!r}: expected one of {FACTOR_SAMPLING}"
                         + hint("logprobs_mode"))
    sync = environ.get("RLK_REF_WEIGHT_SYNC", "exact").strip().lower() or "exact"
    if sync not in FACTOR_WEIGHT_SYNC:
        raise UsageError(f"RLK_REF_WEIGHT_SYNC={sync!r}: expected one of {FACTOR_WEIGHT_SYNC}")
    return raw_batch, batch, sampling, sync
