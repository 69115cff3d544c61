"""`rlk-matrix merge`, `compare` and `preflight`, run as real subprocesses (example reports)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples"
CPU = EXAMPLES / "cpu" / "matrix-report.json"
H200 = EXAMPLES / "h200" / "matrix-report.json"
# A number followed by "x" or "times" (e.g. "1.4x faster"), or any speedup wording.
RATIO = re.compile(r"\d(\.\d+)?\s*(x|times)\b|speed-?up|faster|slower", re.IGNORECASE)


def rlk(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def copy_report(tmp_path: Path) -> Callable[..., Path]:
    """Copy an example report into tmp_path as `name`, optionally editing it first."""

    def copy(src: Path, name: str, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
        data = json.loads(src.read_text())
        if edit:
            edit(data)
        out = tmp_path / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data))
        return out

    return copy


def cell(report: dict[str, Any], module: str, case: str) -> dict[str, Any]:
    return next(c for c in report["cells"] if c["module"] == module and c["case"] == case)


# -- merge -----------------------------------------------------------------------------------------


def test_merge_side_by_side_without_ratios(tmp_path: Path,
                                           copy_report: Callable[..., Path]) -> None:
    a, b = copy_report(CPU, "cpu/matrix-report.json"), copy_report(H200, "h200/matrix-report.json")
    out = tmp_path / "merged" / "merged.json"
    proc = rlk("merge", a, b, "-o", out)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    header = next(line for line in text.splitlines() if line.startswith("module"))
    assert "cpu verdict" in header and "h200 verdict" in header
    assert "cpu step" in header and "h200 step" in header
    table = text[text.index(header):text.index("comparability:")]
    assert len([line for line in table.splitlines() if line.strip()]) == 1 + 12  # one table
    steps = {c["hardware"]: c["step_wall_time"] for f in (a, b)
             for c in json.loads(Path(f).read_text())["cells"]}
    assert all(f"{v:.2f}s" in table for v in steps.values())  # each hardware's own step time
    assert not RATIO.search(text), RATIO.search(text)
    assert "comparability: side by side only" in text
    assert "no speed or time ratio is computed across different hardware" in text

    merged = json.loads(out.read_text())
    assert merged["schema_version"] == "rlk-matrix.report.v1"
    assert len(merged["cells"]) == 24
    assert {c["hardware"] for c in merged["cells"]} == {"cpu", "h200"}
    assert merged["summary"] == {"valid": 24}
    assert merged["matrix"]["hardware"] == ["cpu", "h200"]
    assert merged["comparability"]["ratios_across_sources"] is False
    assert "side by side only" in merged["comparability"]["note"]
    assert merged["comparability"]["same_build_fingerprint"] is False
    src = {s["matrix_name"]: s for s in merged["sources"]}
    assert src["reference-workload"]["hardware"] == ["cpu"]
    assert src["reference-workload"]["hardware_fingerprint"] == "9fcfee5f1e33b20d"
    assert src["reference-workload-h200"]["build_fingerprint"] == "12ad47e9f0ac2067"
    assert not RATIO.search(json.dumps(merged["comparability"]))
    assert out.with_suffix(".html").read_text().startswith("<!DOCTYPE html>")
    assert not list(out.parent.glob(".*.tmp"))


def test_merge_refuses_duplicates(tmp_path: Path, copy_report: Callable[..., Path]) -> None:
    a = copy_report(CPU, "a/matrix-report.json")
    b = copy_report(CPU, "b/matrix-report.json",
                    lambda r: r.update(cells=[cell(r, "ffn", "P/R")]))
    out = tmp_path / "merged.json"
    proc = rlk("merge", a, b, "-o", out)
    assert proc.returncode == 2
    assert "duplicate" in proc.stderr and "(cpu, ffn, P/R)" in proc.stderr
    assert "--allow-duplicates" in proc.stderr
    assert not out.exists()

    proc = rlk("merge", a, b, "-o", out, "--allow-duplicates")
    assert proc.returncode == 0, proc.stderr
    merged = json.loads(out.read_text())
    assert len(merged["cells"]) == 13
    assert "cpu[1] verdict" in proc.stdout and "cpu[2] verdict" in proc.stdout


def test_merge_rejects_non_report(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": "something-else"}')
    proc = rlk("merge", CPU, bad, "-o", tmp_path / "m.json")
    assert proc.returncode == 2 and "not a rlk-matrix.report.v1 report" in proc.stderr


# -- compare ---------------------------------------------------------------------------------------


def test_compare_identical_reports_report_only(tmp_path: Path) -> None:
    proc = rlk("compare", CPU, CPU, "--json", tmp_path / "cmp.json")
    assert proc.returncode == 0, proc.stderr
    assert "gate: not set" in proc.stdout
    result = json.loads((tmp_path / "cmp.json").read_text())
    assert len(result["cells"]) == 12 and not result["violations"]
    assert all(c["times"]["comparable"] for c in result["cells"])
    strict = rlk("compare", CPU, CPU, "--max-drift-increase", "0", "--max-mismatch-increase", "0",
                 "--max-time-increase-pct", "0", "--fail-on-verdict-change")
    assert strict.returncode == 0 and "gate: passed" in strict.stdout


def _drift_up(r: dict[str, Any]) -> None:
    c = cell(r, "attention", "P/R")
    c["logprob_abs_diff_max"] += 0.05
    c["mismatch_count"] += 100


@pytest.mark.parametrize(("flags", "code", "check"), [
    ((), 0, None),
    (("--max-drift-increase", "0.01"), 1, "drift"),
    (("--max-drift-increase", "0.1"), 0, None),
    (("--max-mismatch-increase", "50"), 1, "mismatch"),
    (("--max-mismatch-increase", "100"), 0, None),
])
def test_compare_drift_thresholds(copy_report: Callable[..., Path], flags: tuple[str, ...],
                                  code: int, check: str | None) -> None:
    new = copy_report(CPU, "new.json", _drift_up)
    proc = rlk("compare", CPU, new, *flags)
    assert proc.returncode == code, proc.stdout + proc.stderr
    was = cell(json.loads(CPU.read_text()), "attention", "P/R")  # the example's own figures
    top, count = was["logprob_abs_diff_max"], was["mismatch_count"]
    assert f"{top:.3g} -> {top + 0.05:.3g} (+0.05)" in proc.stdout
    assert f"{count:,} -> {count + 100:,} (+100)" in proc.stdout
    if check:
        assert f"VIOLATION {check}: cpu attention P/R:" in proc.stdout
        assert "gate: failed (1 violation)" in proc.stdout


def _slower(r: dict[str, Any]) -> None:
    c = cell(r, "ffn", "P/P")
    c["step_wall_time"] *= 1.2
    c["rollout_wall_time"] *= 1.2


@pytest.mark.parametrize(("pct", "code"), [("10", 1), ("25", 0)])
def test_compare_time_threshold(tmp_path: Path, copy_report: Callable[..., Path],
                                pct: str, code: int) -> None:
    new = copy_report(CPU, "new.json", _slower)
    proc = rlk("compare", CPU, new, "--max-time-increase-pct", pct, "--json", tmp_path / "c.json")
    assert proc.returncode == code, proc.stdout
    assert "(+20.0%)" in proc.stdout
    violations = json.loads((tmp_path / "c.json").read_text())["violations"]
    if code:
        assert [v["check"] for v in violations] == ["time", "time"]  # step and rollout
        assert "VIOLATION time: cpu ffn P/P: step time rose 20.0%" in proc.stdout
    else:
        assert not violations


def test_compare_verdict_change(copy_report: Callable[..., Path]) -> None:
    new = copy_report(CPU, "new.json", lambda r: cell(r, "logp", "R/P").update(
        verdict="fallback", performance_usable=False))
    proc = rlk("compare", CPU, new)
    assert proc.returncode == 0  # no threshold given: report only
    assert "valid -> fallback" in proc.stdout
    proc = rlk("compare", CPU, new, "--fail-on-verdict-change")
    assert proc.returncode == 1
    assert "VIOLATION verdict: cpu logp R/P: verdict changed valid -> fallback" in proc.stdout
    assert "cpu logp R/P: times not compared: new cell is not performance_usable" in proc.stdout


def test_compare_incomparable_timing_explained(tmp_path: Path,
                                               copy_report: Callable[..., Path]) -> None:
    def rebuild(r: dict[str, Any]) -> None:
        for c in r["cells"]:
            c["build_fingerprint"] = "0000000000000000"
            c["step_wall_time"] *= 3

    new = copy_report(CPU, "new.json", rebuild)
    proc = rlk("compare", CPU, new, "--max-time-increase-pct", "5", "--json", tmp_path / "c.json")
    assert proc.returncode == 0, proc.stdout  # times never compared, so never a violation
    assert ("times not compared: build fingerprint differs (cd82d67f6d84dac3 vs "
            "0000000000000000)") in proc.stdout
    assert "%" not in "".join(proc.stdout.splitlines()[2:14])  # no percentage in the table
    assert "--max-time-increase-pct not applied to 12 cells" in proc.stdout
    result = json.loads((tmp_path / "c.json").read_text())
    assert result["times_not_compared"] == 12
    assert all(c["times"]["step_wall_time"]["pct"] is None for c in result["cells"])


def test_compare_one_sided_cells_and_bad_input(tmp_path: Path,
                                               copy_report: Callable[..., Path]) -> None:
    new = copy_report(CPU, "new.json", lambda r: r.update(
        cells=[c for c in r["cells"] if c["module"] != "logp"]))
    proc = rlk("compare", CPU, new)
    assert proc.returncode == 0
    assert "only in old: cpu logp R/R, cpu logp P/R, cpu logp R/P, cpu logp P/P" in proc.stdout
    proc = rlk("compare", CPU, tmp_path / "missing.json")
    assert proc.returncode == 2 and "unreadable report" in proc.stderr


def test_compare_accepts_a_build_change_on_request(tmp_path: Path) -> None:
    """A CI gate compares a new build on the same hardware on purpose."""
    old = json.loads((EXAMPLES / "cpu" / "matrix-report.json").read_text())
    new = json.loads(json.dumps(old))
    for cell in new["cells"]:
        cell["build_fingerprint"] = "0" * 16
        if cell["step_wall_time"]:
            cell["step_wall_time"] *= 3
    a, b = tmp_path / "old.json", tmp_path / "new.json"
    a.write_text(json.dumps(old))
    b.write_text(json.dumps(new))
    base = [sys.executable, "-m", "pytest_rlkernel_matrix.cli", "compare", str(a), str(b),
            "--max-time-increase-pct", "50"]
    refused = subprocess.run(base, capture_output=True, text=True)
    assert refused.returncode == 0 and "build fingerprint differs" in refused.stdout
    gated = subprocess.run([*base, "--accept-build-change"], capture_output=True, text=True)
    assert gated.returncode == 1 and "VIOLATION" in gated.stdout


# -- preflight -------------------------------------------------------------------------------------


def test_preflight_reads_the_matrix_file_and_prints_a_summary(tmp_path: Path) -> None:
    """The repo's matrix runs the built-in workload: its R kernels are what preflight checks."""
    proc = subprocess.run([sys.executable, "-m", "pytest_rlkernel_matrix.cli", "preflight",
                           "--output", str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, COLUMNS="80"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    data = json.loads((tmp_path / "preflight.json").read_text())
    caps = data["capabilities"]
    assert caps["r_provider"] == "workload"
    assert data["matrix"] == {"file": "matrix.toml", "profile": "cpu", "r_provider": "workload",
                              "r_provider_from": "matrix.toml: [runner] command, r_provider = auto"}
    assert "matrix:       matrix.toml: profile cpu detected" in out
    assert "R kernels:    workload (matrix.toml: [runner] command" in out
    states = {k: e["status"] for k, e in caps["capabilities"].items() if k.startswith("r_backend")}
    for key, status in states.items():
        assert f"{key.removeprefix('r_backend.')} {status}" in " ".join(out.split())
    assert "r_backend.attention: rl_engine not installed" not in out
    # short and human: no JSON, every line fits the terminal, nothing cut inside a word
    assert "{" not in out
    assert all(len(line) <= 80 for line in out.splitlines() if str(tmp_path) not in line), out
    assert len(out.splitlines()) <= 16
    assert "reused" not in data["probe"]  # the CLI always probes for real


def test_preflight_rejects_a_bad_matrix_file(tmp_path: Path) -> None:
    bad = tmp_path / "m.toml"
    bad.write_text("[matrix]\nname = 1\n")
    proc = rlk("preflight", "--matrix", bad, "--output", tmp_path / "out")
    assert proc.returncode == 2 and str(bad) in proc.stderr
    assert not (tmp_path / "out" / "preflight.json").exists()
