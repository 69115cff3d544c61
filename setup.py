"""Build step only (all metadata is in pyproject.toml): the manual ships inside the wheel.

`docs/` is the one source. `build_py` copies the manual (`docs/*.md`, `docs/en/`, `docs/zh/`) into
the built package as `pytest_rlkernel_matrix/docs/`, so a wheel user's `rlk-matrix --help` points
at files that exist (`cli.docs_dir`). In a checkout or an editable install the CLI reads `docs/`
next to the package instead. tests/test_packaging.py builds a wheel and checks the copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
MANUAL = ("*.md", "en/*.md", "zh/*.md")  # not docs/examples/ (data) nor docs/img/


class BuildPyWithManual(build_py):
    def run(self) -> None:
        super().run()
        source = HERE / "docs"
        if not (source / "index.md").is_file():  # an sdist without docs/: nothing to ship
            self.warn("docs/ not found: the wheel ships no manual")
            return
        target = Path(self.build_lib) / "pytest_rlkernel_matrix" / "docs"
        for pattern in MANUAL:
            for path in sorted(source.glob(pattern)):
                dest = target / path.relative_to(source)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, dest)


setup(cmdclass={"build_py": BuildPyWithManual})
