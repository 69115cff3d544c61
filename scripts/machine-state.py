#!/usr/bin/env python3
"""Does a command leave the machine as it found it? (issue 53: tests leave no daemon and no
system file behind.)

    scripts/machine-state.py snapshot BEFORE.json [ROOT ...]
    ... the command ...
    scripts/machine-state.py compare BEFORE.json [ROOT ...]

`snapshot` records the processes running now (pid, start time, command line) and, for every file
under the ROOTs (default: /etc /run /var/lib /var/spool), its type, mode, owner, size and a
sha256 of its bytes (links: their target). `compare` takes the same picture again and lists every
process that started after the snapshot and is still running (outside this script's own line of
parents), and every file added, removed or changed under the ROOTs; it exits 1 if there is any,
0 if the machine is as it was. Standard library only: .ci/run calls it with any python3.
Processes of other users of a shared machine are counted too: run it where nothing else starts
daemons (a CI machine), or read its list.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path

DEFAULT_ROOTS = ("/etc", "/run", "/var/lib", "/var/spool")
# Churn the test suite does not cause: the package manager's and the kernel's bookkeeping.
IGNORED_PREFIXES = ("/run/user/", "/var/lib/apt/", "/var/lib/dpkg/", "/var/lib/systemd/",
                    "/var/lib/dhcp/", "/run/systemd/", "/var/lib/ucf/")
# Files whose bytes a daemon rewrites by itself: compared by kind, mode and owner, not content.
# munged rewrites its entropy seed at start and exit, so a munged that a Slurm test started and
# stopped again changes it (a random pool, not a setting); a new or removed seed still counts.
CONTENT_IGNORED = ("/var/lib/munge/munged.seed",)


def _processes() -> dict[str, str]:
    """'pid:starttime' -> command line, for every process but kernel threads."""
    out: dict[str, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
            fields = raw[raw.rindex(")") + 2:].split()
            ppid, start = int(fields[1]), fields[19]
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == 2 or entry.name == "2" or not cmd.strip():
            continue  # kernel threads (and zombies, whose command line is empty)
        out[f"{entry.name}:{start}"] = cmd.strip()
    return out


def _ancestors() -> set[str]:
    """pids of this process and its parents (the shell running the command is not 'new')."""
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(str(pid))
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
            pid = int(raw[raw.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _file(path: Path) -> str:
    st = path.lstat()
    head = f"{stat.filemode(st.st_mode)} {st.st_uid}:{st.st_gid}"
    if stat.S_ISLNK(st.st_mode):
        return f"{head} -> {os.readlink(path)}"
    if stat.S_ISDIR(st.st_mode):
        return head
    if not stat.S_ISREG(st.st_mode):
        return f"{head} special"
    if str(path) in CONTENT_IGNORED:
        return f"{head} (content not compared)"
    digest = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        return f"{head} {st.st_size} unreadable: {exc.strerror}"
    return f"{head} {st.st_size} {digest.hexdigest()}"


def _files(roots: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for root in roots:
        top = Path(root)
        if not top.exists():
            continue
        dev = top.lstat().st_dev
        for dirpath, dirnames, filenames in os.walk(top):
            here = Path(dirpath)
            # one file system: /run's and /proc-like mounts below it are not walked into
            dirnames[:] = [d for d in dirnames if (here / d).lstat().st_dev == dev]
            for name in [*dirnames, *filenames]:
                path = here / name
                if str(path).startswith(IGNORED_PREFIXES) or f"{path}/".startswith(
                        IGNORED_PREFIXES):
                    continue
                try:
                    out[str(path)] = _file(path)
                except OSError:
                    continue  # gone meanwhile
    return out


def snapshot(roots: list[str]) -> dict[str, object]:
    return {"roots": roots, "processes": _processes(), "files": _files(roots)}


def differences(before: dict[str, object], after: dict[str, object],
                ignore_pids: set[str] = frozenset()) -> list[str]:  # type: ignore[assignment]
    """Lines naming each new process still running and each file added, removed or changed."""
    lines = []
    old_procs = before.get("processes") or {}
    assert isinstance(old_procs, dict)
    new_procs = after.get("processes") or {}
    assert isinstance(new_procs, dict)
    for key, cmd in sorted(new_procs.items()):
        if key not in old_procs and key.split(":")[0] not in ignore_pids:
            lines.append(f"process still running: pid {key.split(':')[0]}: {cmd[:200]}")
    old_files, new_files = before.get("files") or {}, after.get("files") or {}
    assert isinstance(old_files, dict) and isinstance(new_files, dict)
    for path in sorted(set(old_files) | set(new_files)):
        if path not in new_files:
            lines.append(f"file removed: {path}")
        elif path not in old_files:
            lines.append(f"file added: {path}")
        elif old_files[path] != new_files[path]:
            lines.append(f"file changed: {path} ({old_files[path]} -> {new_files[path]})")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("snapshot", "compare"):
        print(__doc__, file=sys.stderr)
        return 2
    where = Path(argv[1])
    roots = argv[2:] or list(DEFAULT_ROOTS)
    if argv[0] == "snapshot":
        tmp = where.with_name(where.name + ".tmp")
        tmp.write_text(json.dumps(snapshot(roots)))
        tmp.replace(where)
        return 0
    try:
        before = json.loads(where.read_text())
    except (OSError, ValueError) as exc:
        print(f"machine-state: cannot read the snapshot {where}: {exc}", file=sys.stderr)
        return 2
    lines = differences(before, snapshot(before.get("roots") or roots), _ancestors())
    for line in lines:
        print(f"machine-state: {line}")
    if lines:
        print(f"machine-state: {len(lines)} difference(s) from {where}", file=sys.stderr)
        return 1
    print(f"machine-state: as it was ({len(before.get('files') or {})} files under "
          f"{', '.join(before.get('roots') or roots)}; no new process)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
