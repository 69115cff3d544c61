"""Is a `matrix.toml` found by default this plugin's own? (standard library only: it runs in
every pytest session where a `matrix.toml` sits in the rootdir, so it stays cheap).

A file is recognised as an RL-Kernel matrix when it holds one of the two tables the schema
(`spec.matrix.MatrixFile`) requires: `[runner]` with a `command`, or `[hardware.<name>]`
profiles with a `backend`. Another project's `matrix.toml` (a CI matrix, `[matrix] python =
[...]`) has neither and is left alone; so is a file that is not TOML. A file named by
`--rlk-matrix` or the `rlk_matrix` ini setting is always the plugin's, errors and all.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

MARKER = "a [runner] table with a command, or [hardware.<name>] tables with a backend"


def is_rlk_matrix(path: Path) -> bool:
    """True when `path` is a TOML file holding this plugin's required tables."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    runner, hardware = data.get("runner"), data.get("hardware")
    if isinstance(runner, dict) and "command" in runner:
        return True
    return isinstance(hardware, dict) and any(
        isinstance(profile, dict) and "backend" in profile for profile in hardware.values())
