"""One process's steady state: the warm-up transient dropped, a robust location of what is left.

The process is the unit of replication of every performance statement (`factorial.py`):
each process contributes one number per phase, the location of its steady-state steps on log
time. Per process and phase:

1. **Warm-up transient (MSER).** The measured steps (after the declared `warmup`) may still
   carry a transient: compilation, autotuning and caches make a process's first steps slower
   (on an H200, step 1 took 7-18 s against ~1 s). MSER (White 1997; MSER-5 with batches of 5
   steps, here batches of one step, since a process has 5-20 steps) chooses the truncation `d`
   that minimises the squared standard error of the mean of what is left,
   ``sum((x[d:] - mean(x[d:]))**2) / (n - d)**2`` on log times, with ``d`` at most half the
   steps (`MAX_DROP`) so that at least half of a process always counts.
2. **Location.** The 20% trimmed mean of the kept steps' log times (`scipy.stats.trim_mean`'s
   definition, computed in numpy here: that function's per-call checks cost 0.4 ms, a report
   makes hundreds of them, and the coverage simulation hundreds of thousands):
   one slow step (a page fault, a GC) moves it little, and on Gaussian noise it keeps ~94% of
   the mean's efficiency (a median keeps 64%).

`steady` returns the location, which steps were kept (``first``: the index, in the process's
measured steps, of the first kept one) and the kept steps' within-process variance of log time
(the step-noise component that `factorial.plan` needs to say how many steps would help).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MAX_DROP = 0.5  # MSER may drop at most this share of a process's steps
TRIM = 0.2  # each end of the trimmed mean


@dataclass(frozen=True)
class Steady:
    """A process's steady state of one phase."""

    location: float  # trimmed mean of log seconds over the kept steps
    first: int  # index (in the measured steps) of the first kept step
    n: int  # kept steps
    total: int  # measured steps given
    within_var: float | None  # variance of log seconds over the kept steps (None: one step)

    @property
    def seconds(self) -> float:
        return math.exp(self.location)

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "log_location": self.location, "first_kept": self.first,
                "kept": self.n, "measured": self.total, "within_log_var": self.within_var}


def mser(values: Sequence[float], max_drop: float = MAX_DROP) -> int:
    """MSER truncation point of `values` (batch size 1): how many leading ones to drop."""
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    if n < 4:
        return 0
    best, best_d = math.inf, 0
    for d in range(0, math.floor(n * max_drop) + 1):
        rest = x[d:]
        score = float(((rest - rest.mean()) ** 2).sum()) / float(rest.size) ** 2
        if score < best - 1e-15:
            best, best_d = score, d
    return best_d


def trim_mean(values: np.ndarray, proportion: float = TRIM) -> float:
    """`scipy.stats.trim_mean(values, proportion)`: the mean after dropping
    ``int(proportion * n)`` values from each end of the sorted values."""
    x = np.sort(values)
    cut = int(proportion * x.size)
    return float(x[cut:x.size - cut].mean())


def steady(values: Sequence[float]) -> Steady:
    """The steady state of one process's measured step times of a phase (seconds, > 0)."""
    x = np.asarray([v for v in values], dtype=np.float64)
    if x.size == 0 or not np.all(np.isfinite(x)) or np.any(x <= 0):
        raise ValueError("steady needs positive, finite step times")
    logs = np.log(x)
    d = mser(logs)
    kept = logs[d:]
    within = float(np.var(kept, ddof=1)) if kept.size > 1 else None
    return Steady(location=trim_mean(kept), first=d, n=int(kept.size),
                  total=int(x.size), within_var=within)
