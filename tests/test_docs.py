"""The operations manual (docs/en, docs/zh, docs/index.md) must not drift from the code.

(a) every `--rlk-*` option named in the docs is registered by the plugin;
(b) every matrix.toml key named in the docs (```toml blocks, `[section] key` mentions) exists in
    the pydantic schema of `matrix.py`; complete toml blocks also validate as a whole file;
(c) every `rlk-matrix <subcommand>` named exists in `cli.build_parser()`;
(d) docs/en and docs/zh hold the same files with the same number of headings per level;
(e) the CPU quickstart block (`<!-- quickstart-cpu -->` in docs/en/cuda-h100.md) runs, and every
    `pytest` line of the README's "Everyday use" block collects on the CPU machine;
(f) no absolute developer path anywhere in the docs. Rule: none of `/work/`, `/root/`, `/home/`,
    `/tmp/`, `/Users/`, `/data/`, `/mnt/`, and no `/opt/` other than `/opt/rocm`, in any line,
    sample output included: captured output is scrubbed to `<matrix-root>`, `$VIME_ROOT`, ...
    before it is pasted. `/path/to/...` placeholders are allowed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from pytest_rlkernel_matrix import cli
from pytest_rlkernel_matrix.spec import matrix

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
LANGS = ("en", "zh")
FENCE_RE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def manual_files() -> list[Path]:
    files = [DOCS / "index.md"]
    for lang in LANGS:
        files += sorted((DOCS / lang).glob("*.md"))
    return files


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def fenced(body: str) -> list[tuple[str, str]]:
    """(info string, content) of every fenced code block."""
    return [(m[1].strip(), m[2]) for m in FENCE_RE.finditer(body)]


def prose(body: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE_RE.sub("", body)


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


# -- (a) options --


@pytest.fixture(scope="module")
def registered_options() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--help", "-p", "no:cacheprovider"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    found = set(re.findall(r"(--rlk-[a-z-]+)", out))
    assert {"--rlk-matrix", "--rlk-plan"} <= found, out[-2000:]
    return found


def test_options_named_in_docs_exist(registered_options: set[str]) -> None:
    unknown = {}
    for path in manual_files():
        for opt in set(re.findall(r"--rlk-[a-z]+(?:-[a-z]+)*", text(path))):
            if opt not in registered_options:
                unknown.setdefault(opt, []).append(rel(path))
    assert not unknown, f"options named in docs but not registered: {unknown}"


def test_every_option_is_documented(registered_options: set[str]) -> None:
    for lang in LANGS:
        body = "".join(text(p) for p in (DOCS / lang).glob("*.md"))
        missing = sorted(o for o in registered_options if o not in body)
        assert not missing, f"docs/{lang} never mentions {missing}"


# -- (b) matrix.toml keys --


def _models(annotation: Any) -> list[type[BaseModel]]:
    """Pydantic models reachable through Optional/Union/tuple/list/dict annotations."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is None:
        return []
    args = typing.get_args(annotation)
    if origin is dict:
        args = args[1:]
    found: list[type[BaseModel]] = []
    for arg in args:
        if arg is not Ellipsis:
            found += _models(arg)
    return found


def _is_mapping_of_models(annotation: Any) -> bool:
    return typing.get_origin(annotation) is dict and bool(_models(annotation))


def unknown_keys(model: type[BaseModel], data: Any, where: str) -> list[str]:
    """Keys of `data` (a toml table) that `model`'s schema does not define, recursively."""
    if not isinstance(data, dict):
        return []
    bad: list[str] = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            bad.append(f"{where}.{key}")
            continue
        ann = field.annotation
        subs = _models(ann)
        if not subs:
            continue
        sub = subs[0]
        if _is_mapping_of_models(ann):
            for name, item in (value or {}).items():
                bad += unknown_keys(sub, item, f"{where}.{key}.{name}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                bad += unknown_keys(sub, item, f"{where}.{key}[{i}]")
        else:
            bad += unknown_keys(sub, value, f"{where}.{key}")
    return bad


def toml_blocks() -> list[tuple[Path, str]]:
    return [(p, body) for p in manual_files() for info, body in fenced(text(p)) if info == "toml"]


def test_docs_have_toml_blocks() -> None:
    assert len(toml_blocks()) >= 6


@pytest.mark.parametrize("path,block", toml_blocks(), ids=lambda v: v.name if isinstance(v, Path)
                         else None)
def test_toml_block_keys_exist(path: Path, block: str) -> None:
    data = tomllib.loads(block)
    assert not unknown_keys(matrix.MatrixFile, data, "<file>"), rel(path)
    if "runner" in data and "hardware" in data:  # a whole matrix file: must load as one
        matrix.MatrixFile.model_validate(data)


SECTION_MODELS: dict[str, type[BaseModel]] = {
    "matrix": matrix.MatrixSection,
    "runner": matrix.RunnerSection,
    "preflight": matrix.PreflightSection,
    "runner.slurm": matrix.SlurmSection,
    "performance": matrix.PerformanceSection,
    "reproducibility": matrix.ReproducibilitySection,
}
MENTION_RE = re.compile(r"`\[([a-z0-9_.<>-]+)\] ([a-z_]+)`")


def _section_model(section: str) -> type[BaseModel] | None:
    if section in SECTION_MODELS:
        return SECTION_MODELS[section]
    parts = section.split(".")
    if parts[0] == "hardware" and len(parts) == 2:
        return matrix.HardwareProfile
    if parts[0] == "hardware" and len(parts) == 3:
        sub = matrix.HardwareProfile.model_fields.get(parts[2])
        models = _models(sub.annotation) if sub else []
        return models[0] if models else None
    return None


def test_section_key_mentions_exist() -> None:
    seen = 0
    bad: list[str] = []
    for path in manual_files():
        for section, key in MENTION_RE.findall(text(path)):
            seen += 1
            model = _section_model(section)
            if model is None or key not in model.model_fields:
                bad.append(f"{rel(path)}: [{section}] {key}")
    assert seen >= 10
    assert not bad, bad


# -- (c) rlk-matrix subcommands --


def test_rlk_matrix_subcommands_exist() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    names = set(sub.choices)
    bad: dict[str, list[str]] = {}
    for path in manual_files():
        for word in re.findall(r"(?<![\w/-])rlk-matrix ([a-z][a-z-]*)", text(path)):
            if word not in names:
                bad.setdefault(word, []).append(rel(path))
    assert not bad, f"unknown rlk-matrix subcommands in docs: {bad} (known: {sorted(names)})"


def test_compare_flags_named_in_docs_exist() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for a in sub.choices["compare"]._actions for s in a.option_strings}
    # other tools' flags the manual names: vLLM's, and the reference workload's
    flags |= {"--max-num-seqs", "--max-new-tokens", "--max-prompt-len"}
    for path in manual_files():
        for flag in re.findall(r"--(?:max|fail-on)-[a-z-]+", text(path)):
            assert flag in flags, f"{rel(path)}: {flag} is not a flag of rlk-matrix compare"


# -- (d) en / zh structure --


def heading_levels(body: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for line in prose(body).splitlines():
        m = re.match(r"^(#{1,6}) \S", line)
        if m:
            counts[len(m[1])] = counts.get(len(m[1]), 0) + 1
    return counts


def test_en_and_zh_have_the_same_files() -> None:
    en = sorted(p.name for p in (DOCS / "en").glob("*.md"))
    zh = sorted(p.name for p in (DOCS / "zh").glob("*.md"))
    assert en == zh
    assert {"index.md", "matrix.md", "cuda-h100.md", "rocm-mi330x.md", "verdicts.md", "ci.md",
            "example-report.md"} <= set(en)


@pytest.mark.parametrize("name", sorted(p.name for p in (DOCS / "en").glob("*.md")))
def test_en_and_zh_have_the_same_headings(name: str) -> None:
    en, zh = text(DOCS / "en" / name), text(DOCS / "zh" / name)
    assert heading_levels(en) == heading_levels(zh), name
    assert len(fenced(en)) == len(fenced(zh)), f"{name}: code block count differs"
    assert ("<!-- quickstart-cpu -->" in en) == ("<!-- quickstart-cpu -->" in zh)


def test_relative_links_resolve() -> None:
    bad = []
    for path in manual_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose(text(path))):
            if "://" in target:
                continue
            if not (path.parent / target).exists():
                bad.append(f"{rel(path)} -> {target}")
    assert not bad, bad


# -- (f) no absolute developer paths --

FORBIDDEN_PATH = re.compile(r"(?<![\w.$<>-])/(?:work|root|home|tmp|Users|data|mnt)/|"
                            r"(?<![\w.$<>-])/opt/(?!rocm\b)")


def test_no_absolute_developer_paths() -> None:
    bad = []
    for path in manual_files():
        for n, line in enumerate(text(path).splitlines(), 1):
            if FORBIDDEN_PATH.search(line):
                bad.append(f"{rel(path)}:{n}: {line.strip()[:120]}")
    assert not bad, "\n".join(bad)


def test_forbidden_path_rule_itself() -> None:
    assert FORBIDDEN_PATH.search("cd /work/main")
    assert FORBIDDEN_PATH.search("RL_KERNEL_ARTIFACT_DIR=/tmp/x/h100")
    assert FORBIDDEN_PATH.search("cd /opt/vime")
    assert not FORBIDDEN_PATH.search("export ROCM_HOME=/opt/rocm")
    assert not FORBIDDEN_PATH.search("export VIME_ROOT=/path/to/vime")
    assert not FORBIDDEN_PATH.search('"$MATRIX_ROOT"/h100/attention-rr')


# -- (e) the CPU quickstart runs --


def quickstart_lines() -> list[str]:
    body = text(DOCS / "en" / "cuda-h100.md")
    marker = body.index("<!-- quickstart-cpu -->")
    info, block = fenced(body[marker:])[0]
    assert info == "bash"
    lines = [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines and lines[0].startswith("pytest ")
    return lines


def test_quickstart_blocks_match_between_languages() -> None:
    zh = text(DOCS / "zh" / "cuda-h100.md")
    marker = zh.index("<!-- quickstart-cpu -->")
    zh_lines = [ln.strip() for ln in fenced(zh[marker:])[0][1].splitlines() if ln.strip()]
    assert zh_lines == quickstart_lines()


def test_cpu_quickstart_runs(tmp_path: Path, shared_probe: Path) -> None:
    root = tmp_path / "matrix-root"
    # Not a preflight test: the session takes the test run's shared probe (tests/conftest.py).
    env = dict(os.environ, MATRIX_ROOT=str(root), RLK_REUSE_PROBE=str(shared_probe),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    for var in ("MATRIX_STAMP", "RLK_REF_FAULT", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER"):
        env.pop(var, None)
    outputs = []
    for line in quickstart_lines():
        argv = shlex.split(os.path.expandvars(line.replace('"$MATRIX_ROOT', f'"{root}')))
        if argv[0] == "pytest":
            argv = [sys.executable, "-m", "pytest", *argv[1:], "-p", "no:cacheprovider",
                    "-p", "no:randomly", "-k", "attention and R/R"]
        elif argv[0] == "rlk-matrix":
            argv = [sys.executable, "-m", "pytest_rlkernel_matrix.cli", *argv[1:]]
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    report = json.loads((root / "matrix-report.json").read_text())
    assert report["schema_version"] == "rlk-matrix.report.v1"
    assert (root / "matrix-report.html").exists() and (root / "preflight.json").exists()
    cell = next(c for c in report["cells"] if c["module"] == "attention" and c["case"] == "R/R")
    assert cell["verdict"] == "valid", cell["reasons"]
    assert cell["mismatch_count"] == 0 and cell["active_token_count"] > 0
    assert "| cpu | attention | R/R | valid |" in outputs[-1]



def everyday_pytest_lines() -> list[str]:
    readme = text(REPO / "README.md")
    section = readme[readme.index("## Everyday use"):readme.index("Without re-running anything")]
    (block,) = [body for info, body in fenced(section) if info == "bash"]
    return [ln.split("  #")[0].strip() for ln in block.splitlines()
            if ln.strip() and not ln.startswith("#")]


@pytest.mark.parametrize("line", everyday_pytest_lines())
def test_readme_everyday_lines_run_on_the_cpu_machine(line: str, pytester: pytest.Pytester,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      reuse_probe: Path) -> None:
    """Collected (preflight, hardware detection, selection; no cell runs) against matrix.toml."""
    argv = shlex.split(line)
    while "=" in argv[0]:  # VAR=value prefixes
        name, _, value = argv.pop(0).partition("=")
        monkeypatch.setenv(name, os.path.expandvars(value))
    assert argv[0] == "pytest", line
    args = argv[1:]
    if "path/to/other.toml" in line:  # a placeholder: point it at a real file
        args = [a.replace("path/to/other.toml", str(pytester.path / "other.toml")) for a in args]
        (pytester.path / "other.toml").write_text(text(REPO / "matrix.toml"))
    if "-n" in args:
        pytest.importorskip("xdist")
        i = args.index("-n")
        del args[i:i + 2]  # the -n line is run for real by test_integrations_under_xdist
    (pytester.path / "matrix.toml").write_text(text(REPO / "matrix.toml"))
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:cacheprovider", *args)
    assert result.ret == 0, f"{line}\n{result.stdout.str()}\n{result.stderr.str()}"


# -- the README: a product page that is true today --


def plugin_options() -> set[str]:
    """Every `--rlk-*` option plugin.py registers (read from its source)."""
    src = text(REPO / "pytest_rlkernel_matrix" / "plugin.py")
    return set(re.findall(r"addoption\(\s*\"(--rlk-[a-z-]+)\"", src))


def test_readme_lists_every_option_plugin_py_registers(registered_options: set[str]) -> None:
    options = plugin_options()
    assert {"--rlk-matrix", "--rlk-plan", "--rlk-repeat-baseline", "--rlk-probe"} <= options
    assert options <= registered_options  # the source reading finds real options
    readme = text(REPO / "README.md")
    section = readme[readme.index("Options (`pytest --help`"):readme.index("Markers:")]
    listed = set(re.findall(r"^\| `(--rlk-[a-z-]+)", section, re.MULTILINE))
    assert listed == options, (f"README's options table lacks {sorted(options - listed)}, "
                               f"names unknown {sorted(listed - options)}")


def test_readme_carries_no_history_of_figures() -> None:
    """Test-suite counts and dated timings live in docs/benchmarks.md, not on the product page."""
    readme = prose(text(REPO / "README.md"))
    for pattern in (r"\d+ items", r"\d+ passed", r"\d+ skipped", r"\b20\d\d-\d\d-\d\d\b",
                    r"\d+ min \d+ s"):
        assert not re.search(pattern, readme), pattern
    assert "The project's own tests" in text(DOCS / "benchmarks.md")


def test_readme_layout_matches_a_real_root() -> None:
    """Cells sit under <root>/<hardware>/ and the three R/R cells share one directory, as the
    README says (the checked-in CPU example's report)."""
    readme = text(REPO / "README.md")
    assert "<hardware>/<cell>/" in readme and "`<hardware>/attention-rr`" in readme
    report = json.loads((DOCS / "examples" / "cpu" / "matrix-report.json").read_text())
    dirs = {(c["module"], c["case"]): c["artifact_dir"] for c in report["cells"]}
    assert all(d.startswith(f"{c['hardware']}/") for c, d in
               zip(report["cells"], dirs.values(), strict=True))
    assert {dirs[(m, "R/R")] for m in ("attention", "ffn", "logp")} == {"cpu/attention-rr"}


def test_artifact_format_states_the_weight_versions_the_workload_writes() -> None:
    """The reference workload writes one weight version per step (v0-v5 by default)."""
    run = DOCS / "examples" / "cpu" / "cpu" / "attention-rr" / "weight-audit"
    versions = sorted(int(p.stem) for p in run.glob("*.json"))
    assert versions == list(range(6))
    body = " ".join(text(DOCS / "artifact-format.md").split())
    assert "`0.json` ... `5.json`" in body and "writes one version, `0`, per run" not in body


def test_readme_lists_every_marker() -> None:
    from pytest_rlkernel_matrix.plugin import MARKERS

    readme = text(REPO / "README.md")
    section = readme[readme.index("Markers:"):readme.index("Fixtures (")]
    for line in MARKERS:
        name = line.split(":")[0].split("(")[0]
        assert f"`{name}" in section, name


def test_index_numbers_once_and_docs_index_lists_every_page() -> None:
    """Issue 53: docs/en|zh/index.md number each section once, in order; docs/index.md links
    every page of both manuals."""
    import re

    listing = (DOCS / "index.md").read_text(encoding="utf-8")
    for lang in ("en", "zh"):
        body = (DOCS / lang / "index.md").read_text(encoding="utf-8")
        numbers = [int(n) for n in re.findall(r"(?m)^(\d+)\. \[", body)]
        assert numbers == list(range(1, len(numbers) + 1)), (lang, numbers)
        for page in sorted((DOCS / lang).glob("*.md")):
            if page.name != "index.md":
                assert f"({lang}/{page.name})" in listing, f"docs/index.md: {lang}/{page.name}"
