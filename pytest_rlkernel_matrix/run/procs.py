"""Whole-tree process control for cells: find every process a cell started, stop them all.

A cell's command runs in a new session (its own process group). Killing that group is not
enough: a launcher's children may call `setsid()` (vLLM/Ray workers, daemonised helpers), ignore
SIGTERM, or stay behind in the background after the main process exited. A cell's *family* is,
from a scan of `/proc` (Linux):

1. the main process and every process of its process group or session;
2. every process whose environment carries the cell's marker variable (`PYTEST_RLK_PROC`, set by
   the runner and inherited by everything the job starts, also across `setsid()` and
   double-forks that reparent to init);
3. every process that became a child of the runner while the cell ran and carries no other
   cell's marker: the runner is a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`) for that
   time, so orphans of the cell reparent to it instead of init, even those that cleared their
   environment;
4. all descendants of the above (parent-pid links).

Stopping sends SIGTERM to every member (and its group), waits up to a grace period, then
SIGKILLs whatever is left, rescanning each round (a member may fork while dying), and reaps the
runner's own zombie children.

Cells run concurrently from one process (threads) are told apart by their markers; an orphan
that cleared its environment cannot be attributed and goes with the first cell that finishes.

Not covered: processes the job asks another service to start (`systemd-run`, `docker run`, an
`ssh`/`srun` to another node), processes in another PID namespace, processes running as another
user (no permission to signal them), and a process that clears its environment *and* escapes
while the runner cannot be a subreaper (not Linux, or `prctl` unavailable). Without `/proc`
(not Linux) only the process group is killed.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

PROC = "/proc"
MARKER_VAR = "PYTEST_RLK_PROC"
SESSION_VAR = "PYTEST_RLK_SESSION"
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgrp: int
    sid: int
    state: str

    @property
    def dead(self) -> bool:
        return self.state in ("Z", "X", "x")


def available() -> bool:
    return os.path.isdir(f"{PROC}/self")


def snapshot() -> dict[int, ProcInfo]:
    """pid -> (ppid, process group, session, state) for every process visible in /proc."""
    out: dict[int, ProcInfo] = {}
    try:
        entries = os.listdir(PROC)
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"{PROC}/{name}/stat", "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        # `pid (comm) state ppid pgrp session ...`; comm may hold spaces and parentheses.
        fields = raw[raw.rfind(b")") + 2:].split()
        if len(fields) < 4:
            continue
        out[int(name)] = ProcInfo(int(name), int(fields[1]), int(fields[2]), int(fields[3]),
                                  fields[0].decode("ascii", "replace"))
    return out


def _environ(pid: int) -> bytes | None:
    try:
        with open(f"{PROC}/{pid}/environ", "rb") as fh:
            return b"\0" + fh.read()
    except OSError:
        return None


def environ_has(pid: int, entry: bytes) -> bool:
    """Does process `pid`'s initial environment hold `entry` (`NAME=value` or a prefix)?"""
    data = _environ(pid)
    return data is not None and data.find(b"\0" + entry) >= 0


def _prctl(option: int, value: int) -> int | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if option == _PR_GET_CHILD_SUBREAPER:
            out = ctypes.c_int(0)
            ok = libc.prctl(option, ctypes.byref(out), 0, 0, 0) == 0
            return int(out.value) if ok else None
        return 0 if libc.prctl(option, value, 0, 0, 0) == 0 else None
    except (OSError, AttributeError):
        return None


_reaper_lock = threading.Lock()
_reaper_users = 0
_reaper_was_on = False


def set_subreaper(on: bool) -> bool:
    """Hold (True) or release (False) child-subreaper status (Linux >= 3.4), counted so that
    concurrent cells in one process share it and a process that already was a subreaper stays
    one. Returns whether this process is a subreaper (False where prctl is unavailable)."""
    global _reaper_users, _reaper_was_on
    with _reaper_lock:
        if on:
            if _reaper_users == 0:
                _reaper_was_on = _prctl(_PR_GET_CHILD_SUBREAPER, 0) == 1
                if not _reaper_was_on and _prctl(_PR_SET_CHILD_SUBREAPER, 1) is None:
                    return False
            _reaper_users += 1
            return True
        if _reaper_users > 0:
            _reaper_users -= 1
            if _reaper_users == 0 and not _reaper_was_on:
                _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        return False


def children(pid: int, snap: dict[int, ProcInfo] | None = None) -> set[int]:
    snap = snapshot() if snap is None else snap
    return {p for p, info in snap.items() if info.ppid == pid}


def _descendants(roots: Iterable[int], snap: dict[int, ProcInfo]) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, info in snap.items():
        kids.setdefault(info.ppid, []).append(pid)
    seen: set[int] = set()
    todo = [r for r in roots if r in snap]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(kids.get(pid, ()))
    return seen


@dataclass
class Family:
    """How to recognise one cell's processes (see the module docstring).

    `main_pid`: the cell's main process (also its process group and session id); `marker`: the
    value (or value prefix) of `PYTEST_RLK_PROC` its processes carry; `preexisting_children`:
    this process's children before the cell started (others are the cell's orphans), None to
    not look at this process's children at all.
    """

    main_pid: int | None
    marker: str | None = None
    preexisting_children: frozenset[int] | None = None
    main_alive: bool = True
    seen: set[int] = field(default_factory=set)

    def members(self, snap: dict[int, ProcInfo] | None = None) -> dict[int, ProcInfo]:
        snap = snapshot() if snap is None else snap
        me = os.getpid()
        roots: set[int] = set()
        main = self.main_pid
        if main is not None and self.main_alive:
            roots.add(main)
        ours = b"\0" + f"{MARKER_VAR}={self.marker}".encode() if self.marker else None
        anyone = f"\0{MARKER_VAR}=".encode()
        for pid, info in snap.items():
            if pid in (me, 1):
                continue
            if main is not None and main in (info.pgrp, info.sid):
                roots.add(pid)
                continue
            if info.dead:
                continue
            orphan = (self.preexisting_children is not None and info.ppid == me
                      and pid not in self.preexisting_children)
            if not orphan and ours is None:
                continue
            env = _environ(pid)
            if ours is not None and env is not None and ours in env:
                roots.add(pid)
            elif orphan and (env is None or anyone not in env):
                # A new child of ours (reparented: we are its subreaper) that carries no cell's
                # marker: it cleared its environment. Another cell's orphans carry theirs.
                roots.add(pid)
        found = _descendants(roots, snap)
        found.discard(me)
        found.discard(1)
        out = {pid: snap[pid] for pid in found}
        self.seen.update(p for p, i in out.items() if not i.dead)
        return out


def _signal(members: dict[int, ProcInfo], sig: int, own_pgrp: int) -> set[int]:
    sent: set[int] = set()
    for pgrp in {info.pgrp for info in members.values() if not info.dead}:
        if pgrp > 1 and pgrp != own_pgrp:
            with suppress(OSError):
                os.killpg(pgrp, sig)
    for pid, info in members.items():
        if info.dead:
            continue
        try:
            os.kill(pid, sig)
            sent.add(pid)
        except OSError:
            pass
    return sent


def reap(family: Family) -> None:
    """Collect the exit status of our own dead children that belonged to the family (seen alive
    as members, or still in its process group): no zombies left behind. The main process is left
    to its `Popen`."""
    me = os.getpid()
    main = family.main_pid
    for pid, info in snapshot().items():
        if pid == main or info.ppid != me or not info.dead:
            continue
        if pid in family.seen or (main is not None and main in (info.pgrp, info.sid)):
            with suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def terminate(family: Family, grace: float, hurry: Iterator[bool] | None = None) -> list[int]:
    """SIGTERM every member, wait up to `grace` s, SIGKILL the rest; the pids signalled.

    `hurry`, polled while waiting, cuts the grace short when it yields True (a second Ctrl-C).
    The main process is left for its `Popen` to reap.
    """
    own_pgrp = os.getpgrp()
    signalled: set[int] = set()
    members = family.members()
    alive = {p: i for p, i in members.items() if not i.dead}
    if alive:
        signalled |= _signal(alive, signal.SIGTERM, own_pgrp)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            time.sleep(0.05)
            reap(family)
            members = family.members()
            alive = {p: i for p, i in members.items() if not i.dead}
            if not alive or (hurry is not None and next(hurry)):
                break
            # A member forked since the last round: it gets its SIGTERM too.
            signalled |= _signal({p: i for p, i in alive.items() if p not in signalled},
                                 signal.SIGTERM, own_pgrp)
    for _ in range(20):
        members = family.members()
        alive = {p: i for p, i in members.items() if not i.dead}
        if not alive:
            break
        signalled |= _signal(alive, signal.SIGKILL, own_pgrp)
        time.sleep(0.02)
        reap(family)
    reap(family)
    return sorted(signalled)


def sweep(session_tag: str, grace: float) -> list[int]:
    """Stop every process left by any cell of the session `session_tag` (and its descendants),
    wherever it runs now (an xdist worker's cell, orphaned when its worker died)."""
    if not available() or not session_tag:
        return []
    return terminate(Family(None, f"{session_tag}:"), grace)


def session_processes(session_tag: str) -> list[int]:
    """Live processes of any cell of the session `session_tag` (and their descendants)."""
    if not available() or not session_tag:
        return []
    return sorted(p for p, i in Family(None, f"{session_tag}:").members().items() if not i.dead)


def session_workers(session_tag: str) -> list[int]:
    """This process's children that carry `PYTEST_RLK_SESSION=<session_tag>` (xdist workers)."""
    me = os.getpid()
    entry = f"{SESSION_VAR}={session_tag}\0".encode()
    return sorted(pid for pid, info in snapshot().items()
                  if info.ppid == me and not info.dead and environ_has(pid, entry))


def alive(pids: Iterable[int]) -> list[int]:
    """Those of `pids` that still exist and are not zombies."""
    snap = snapshot()
    return sorted(p for p in pids if p in snap and not snap[p].dead)


# -- the cell's main process: waited for without `Popen.wait` -------------------------------------


_WAITID = hasattr(os, "waitid") and hasattr(os, "WNOWAIT")


class Main:
    """The cell's main process, waited for and killed without going through `Popen`'s own wait.

    `Popen.wait(timeout=...)` and `Popen.poll()` take `Popen._waitpid_lock` with
    `acquire(False)` and only then enter the `try` that releases it: a KeyboardInterrupt raised
    by a signal handler between the two (Ctrl-C, or the plugin's SIGTERM handler) leaves the lock
    held for good. Every later `wait(timeout)` then times out although the child is dead, and a
    `wait()` without a timeout blocks forever on that lock (a signal handler that does not raise
    does not get it out). Here the status is read with `waitid(WNOWAIT)` (it stays collectable
    when an interrupt lands in between), stored in `Popen.returncode`, and only then collected;
    every wait is bounded, and no lock is taken.
    """

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.seen = False  # `returncode` was set here, from waitid(WNOWAIT): still to collect
        self.collected = False  # collected (here, by `Popen`, or by someone else)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> bool:
        """Has the main process exited? Its exit code, when known, is `returncode`."""
        if self.collected:
            return True
        pid = self.proc.pid
        if not self.seen:
            if self.proc.returncode is not None:  # `Popen` collected it itself
                self.collected = True
                return True
            try:
                if not _WAITID:  # pragma: no cover - every Linux has waitid
                    got, status = os.waitpid(pid, os.WNOHANG)
                    if got == 0:
                        return False
                    self.collected = True
                    self.proc.returncode = os.waitstatus_to_exitcode(status)
                    return True
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # collected by someone else: exited, its code unknown
                self.collected = True
                return True
            if info is None:
                return False
            killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            self.proc.returncode = -info.si_status if killed else info.si_status
            self.seen = True
        # Marked first: an interrupt after this leaves a zombie (reaped at exit), never a second
        # waitpid on a pid that may since belong to another cell's child.
        self.collected = True
        with suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return True

    def wait(self, timeout: float, hurry: Iterator[bool] | None = None) -> bool:
        """Poll for up to `timeout` seconds (cut short when `hurry` yields True); exited?"""
        deadline = time.monotonic() + max(timeout, 0.0)
        while not self.poll():
            left = deadline - time.monotonic()
            if left <= 0 or (hurry is not None and next(hurry)):
                return False
            time.sleep(min(0.05, left))
        return True

    def kill(self) -> None:
        """SIGKILL the main process if it has not been seen to exit (its pid is still ours)."""
        if not self.poll():
            with suppress(OSError):
                os.kill(self.proc.pid, signal.SIGKILL)


# -- stopping the session: SIGTERM behaves like Ctrl-C, and cleanup is not cut short -------------


class StopState:
    """Signals seen by the session. The first SIGINT/SIGTERM raises KeyboardInterrupt (pytest's
    own interrupt path: the report is still written); later ones arriving while the plugin is
    cleaning up (killing a cell's processes, writing the interrupted record) only hurry it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.cleaning = 0
        self.extra = 0
        self._previous: dict[int, object] = {}

    def handler(self, signum: int, frame: object) -> None:
        if self.cleaning:
            self.extra += 1
            return
        self.signum = signum
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    def install(self) -> None:
        """Take SIGTERM (if nobody else has) and SIGINT (if still Python's default)."""
        wanted = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
        for sig, default in wanted.items():
            try:
                if signal.getsignal(sig) is default:
                    self._previous[sig] = signal.signal(sig, self.handler)
            except ValueError:  # not the main thread
                return

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            try:
                if signal.getsignal(sig) == self.handler:
                    signal.signal(sig, previous)  # type: ignore[arg-type]
            except ValueError:
                pass
        self._previous.clear()

    def hurry(self) -> Iterator[bool]:
        start = self.extra
        while True:
            yield self.extra > start

    @contextmanager
    def cleaning_up(self) -> Iterator[None]:
        self.cleaning += 1
        try:
            yield
        finally:
            self.cleaning -= 1


STOP = StopState()
