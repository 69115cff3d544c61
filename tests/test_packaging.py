"""What a user gets from the package itself: `rlk-matrix init` and its shipped templates, the
built wheel's contents and metadata (real subprocesses, a real wheel build)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from pytest_rlkernel_matrix.cli import template_text
from pytest_rlkernel_matrix.spec.matrix import load_matrix

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pytest_rlkernel_matrix"
# The repo's files that `rlk-matrix init` ships as package data (templates/), byte for byte.
SHIPPED = {"matrix.toml": REPO / "matrix.toml", "engines.toml": REPO / "examples" / "engines.toml"}


def rlk(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_templates_are_the_repo_examples(name: str) -> None:
    shipped = PACKAGE / "templates" / name
    assert shipped.read_bytes() == SHIPPED[name].read_bytes(), (
        f"{shipped} differs from {SHIPPED[name]}: copy one onto the other")
    assert template_text(name == "engines.toml") == SHIPPED[name].read_text(encoding="utf-8")


def test_init_writes_a_matrix_pytest_collects(tmp_path: Path, shared_probe: Path) -> None:
    proj = tmp_path / "proj"
    proc = rlk("init", proj, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    written = proj / "matrix.toml"
    assert f"wrote {written}" in proc.stdout and "pytest --rlk-plan" in proc.stdout
    matrix = load_matrix(written)
    assert tuple(matrix.matrix.modules) == ("attention", "ffn", "logp")
    env = {**os.environ, "RLK_REUSE_PROBE": str(shared_probe)}
    plan = subprocess.run([sys.executable, "-m", "pytest", "--rlk-plan", "--rlk-hardware=cpu",
                           "-p", "no:cacheprovider"], cwd=proj, env=env, capture_output=True,
                          text=True, timeout=300)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-2000:]
    assert "rlk plan: 12 cells" in plan.stdout, plan.stdout[-3000:]
    for cell in ("cpu/attention-rr", "cpu/ffn-pr", "cpu/logp-pp"):
        assert f"# {cell}" in plan.stdout, plan.stdout[-3000:]
    assert "collected 12 items" in plan.stdout
    assert not (proj / "outputs").exists() or not any((proj / "outputs").rglob("run.log"))


def test_init_engines_and_never_overwrites(tmp_path: Path) -> None:
    proc = rlk("init", "--engines", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    written = tmp_path / "matrix.toml"
    matrix = load_matrix(written)
    assert matrix.matrix.name == "reference-engines"
    assert matrix.preflight.checkpoint == ".rlk-engines/tiny-qwen3"  # next to the file
    for step in ("torchvision torchaudio torchcodec", "pytest_rlkernel_matrix.engines.checkpoint",
                 "[engines]"):
        assert step in proc.stdout
    before = written.read_bytes()
    for args in (("init",), ("init", "--engines"), ("init", ".")):
        again = rlk(*args, cwd=tmp_path)
        assert again.returncode == 2 and again.stdout == ""
        assert f"{Path('.') / 'matrix.toml' if args[-1] == '.' else 'matrix.toml'}" in again.stderr
        assert "refusing to overwrite" in again.stderr
    assert written.read_bytes() == before
    dangling = tmp_path / "other"
    dangling.mkdir()
    (dangling / "matrix.toml").symlink_to(tmp_path / "missing.toml")
    refused = rlk("init", dangling, cwd=tmp_path)
    assert refused.returncode == 2 and f"{dangling / 'matrix.toml'} exists" in refused.stderr
    assert not (tmp_path / "missing.toml").exists()
    blocked = tmp_path / "a-file"
    blocked.write_text("x")
    bad = rlk("init", blocked / "sub", cwd=tmp_path)
    assert bad.returncode == 2 and f"cannot write {blocked / 'sub' / 'matrix.toml'}" in bad.stderr


def test_wheel_ships_templates_license_and_metadata(tmp_path: Path) -> None:
    """`pip wheel` of the checkout: templates, LICENSE, the manual and the project metadata are
    in it, and an installed wheel's CLI points at the manual it ships."""
    src = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "venv", ".tox", "outputs", "build", "dist", "*.egg-info", "__pycache__",
        ".rlk-engines", ".pytest_cache", ".benchmarks", ".whl", ".device"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = tmp_path.glob("pytest_rlkernel_matrix-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for name in SHIPPED:
            member = f"pytest_rlkernel_matrix/templates/{name}"
            assert member in names
            assert zf.read(member) == SHIPPED[name].read_bytes()
        assert "pytest_rlkernel_matrix/report/templates/matrix-report.html.j2" in names
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(meta_name).decode())
        licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert len(licenses) == 1, sorted(names)
        assert zf.read(licenses[0]) == (REPO / "LICENSE").read_bytes()
    # The manual the CLI points to ships inside the package (setup.py's build step).
    manual = [p for pattern in ("*.md", "en/*.md", "zh/*.md")
              for p in sorted((REPO / "docs").glob(pattern))]
    assert len(manual) >= 25
    with zipfile.ZipFile(wheel) as zf:
        for path in manual:
            member = f"pytest_rlkernel_matrix/docs/{path.relative_to(REPO / 'docs').as_posix()}"
            assert zf.read(member) == path.read_bytes(), member
        assert not [n for n in zf.namelist()
                    if n.startswith("pytest_rlkernel_matrix/docs/examples")]
    # Installed from the wheel (pip --target: no checkout around it), `rlk-matrix --help` and
    # `rlk-matrix init --help` name the shipped files, and they exist.
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                              "--target", str(target), str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    for args in (["--help"], ["init", "--help"]):
        shown = subprocess.run([sys.executable, "-s", "-m", "pytest_rlkernel_matrix.cli", *args],
                               capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert shown.returncode == 0, shown.stderr
        paths = re.findall(r"(?<!\S)(/\S+\.md)", shown.stdout)
        assert len(paths) == 5, shown.stdout
        for path in paths:
            assert path.startswith(str(target / "pytest_rlkernel_matrix" / "docs")), path
            assert Path(path).is_file(), path
        assert "artifact-format.md" in shown.stdout and "en/engines.md" in shown.stdout
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License-File"] == "LICENSE"
    assert "pytest-rlkernel-matrix developers" in (meta["Author"] or "")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    urls = meta.get_all("Project-URL") or []
    assert urls and len(urls) == len(project["urls"])


def test_license_is_the_apache_2_text() -> None:
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
