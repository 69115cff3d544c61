"""Performance validity: phase wall-clock is present and not contaminated (profiler, debug
readback, checkpoint write, first compile; measured host/device contention, run/contamination.py,
read into `Evidence.contamination`),
with enough measured steps and a spread under the declared limit (`stats`), and the route is
the requested one. A cell whose performance is not valid gives no performance conclusion.
"""

from __future__ import annotations

from collections.abc import Mapping

from pytest_rlkernel_matrix.judge.findings import Judgement
from pytest_rlkernel_matrix.judge.performance.phases import impossible_timings, phases
from pytest_rlkernel_matrix.judge.performance.stats import timing_noise
from pytest_rlkernel_matrix.judge.read.evidence import Evidence
from pytest_rlkernel_matrix.run.contamination import judge as contamination_judge
from pytest_rlkernel_matrix.spec.limits import Policy as PerformancePolicy

CONTAMINATING_ENV = {
    "RL_KERNEL_DEBUG_READBACK": "debug_readback", "RL_KERNEL_PROFILE": "profiler",
    "RL_KERNEL_SAVE_CHECKPOINT": "checkpoint_write", "VIME_PROFILE": "profiler",
}



def judge_performance(ev: Evidence, env: Mapping[str, str], route_ok: bool, mode: str,
                       warmup: int, policy: PerformancePolicy) -> Judgement:
    perf = Judgement(layer="performance")
    medians, spread = phases(ev.log, warmup)
    missing = [k for k in ("rollout_wall_time", "training_wall_time", "step_wall_time")
               if medians.get(k) is None]
    if missing:
        perf.fail(f"no phase wall-clock in run.log for {', '.join(missing)}")
    for reason in impossible_timings(ev.log):
        perf.fail(reason)
    # in order of cause: contamination (which makes steps noisy) before the noise itself
    for reason in contamination_judge(ev.contamination, policy):
        perf.fail(reason)
    for key, label in CONTAMINATING_ENV.items():
        if env.get(key, "0") not in ("", "0", "false"):
            perf.fail(f"contaminated: {label} ({key}={env[key]})")
    for label, line in ev.log.contamination.items():
        perf.fail(f"contaminated: {label}: {line[:160]}")
    for reason in timing_noise(spread, policy):
        perf.fail(reason)
    if not route_ok:
        why = "auto-mode fallback" if mode == "auto" else "the requested route did not run"
        perf.fail(f"not usable for RL-Kernel performance conclusions: {why}")
    return perf
