"""Progress of long analyses and long sessions, on a terminal only.

A bar is drawn only when both stdout and stderr are terminals and the environment is not a CI
job (`CI` set to anything but "" / "0" / "false"): a CI log, a redirected run, a pipe and an
xdist worker (whose output is not a terminal the user reads; the controller draws) get nothing.
`rlk-matrix report` draws a live tqdm bar on stderr; a pytest session run with `-v` prints one
tqdm-formatted line through pytest's terminal writer after each cell's own line (a live bar would
overwrite the lines pytest writes itself; without `-v` nothing is added to pytest's row of dots,
whose `[ 25%]` is the progress). tqdm is imported only when a bar is drawn.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import IO, Any


def in_ci(env: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get("CI")
    return value is not None and value.strip().lower() not in ("", "0", "false", "no")


def on_terminal(out: IO[str] | Any, err: IO[str] | Any,
                env: Mapping[str, str] | None = None) -> bool:
    """Whether a progress bar may be shown: both streams are terminals and this is not CI."""
    def tty(stream: Any) -> bool:
        try:
            return bool(stream.isatty())
        except (AttributeError, ValueError, OSError):  # a closed or replaced stream
            return False

    return tty(out) and tty(err) and not in_ci(env)


class SessionProgress:
    """`rlk cells [####    ] 3/12 [01:23<02:46, 27.7s/cell]`, one line per recorded cell."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.start = time.monotonic()

    def line(self, what: str) -> str:
        from tqdm import tqdm

        self.done = min(self.total, self.done + 1)
        meter = tqdm.format_meter(self.done, self.total, time.monotonic() - self.start,
                                  ncols=80, prefix="rlk cells", unit="cell")
        return f"{meter} {what}"
