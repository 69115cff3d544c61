#!/usr/bin/env python3
"""Screenshot a matrix HTML report with headless chromium (offline, throwaway profile).

    python scripts/screenshot_report.py <report.html> <out.png> [--width 1400] [--height 1000]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars")


def find_chromium() -> str | None:
    """`chromium` (Debian) or `chromium-browser`, whichever is on PATH."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(html: Path, png: Path, *, width: int = 1400, height: int = 1000,
               chromium: str | None = None, timeout: float = 120.0) -> Path:
    """Write a `width`x`height` PNG of `html` to `png`; raises if chromium fails."""
    exe = chromium or find_chromium()
    if exe is None:
        raise FileNotFoundError("chromium not found (Debian: apt-get install -y chromium)")
    png = png.resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlk-chromium-") as profile:
        subprocess.run(
            [exe, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
             f"--window-size={width},{height}", html.resolve().as_uri()],
            check=True, capture_output=True, timeout=timeout,
        )
    if not png.is_file():
        raise RuntimeError(f"chromium wrote no screenshot to {png}")
    return png


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("html", type=Path)
    parser.add_argument("png", type=Path)
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1000)
    args = parser.parse_args(argv)
    try:
        out = screenshot(args.html, args.png, width=args.width, height=args.height)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        print(f"screenshot failed: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
