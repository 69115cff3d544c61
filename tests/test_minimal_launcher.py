"""`examples/minimal_launcher.py` through the plugin as a real matrix (real subprocesses, real
torch), and docs/artifact-format.md's table of required and optional keys ("Writing a launcher")
checked against the plugin's readers: each row's keys are removed from a valid cell's artifacts
and the cell is judged again (`analyze_run`, the path `rlk-matrix report` takes)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pytest_rlkernel_matrix.report.record import analyze_run

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "artifact-format.md"
# RL-Kernel's readback writer's keys (docs/artifact-format.md; the upstream facts in the brief's
# reference): the example writes them all.
UPSTREAM_READBACK_KEYS = {"framework", "target", "plan", "installed_hooks", "fallbacks",
                          "profile_calls", "operators"}
UPSTREAM_OPERATOR_KEYS = {"framework", "target", "module", "case_id", "implementation",
                          "backend_id", "call_count", "execution_mode", "provenance"}
SIDECAR_KEYS = {"schema_version", "rank", "call_index", "tensor_parallel_size",
                "context_parallel_size", "train_log_probs", "rollout_log_probs", "loss_masks",
                "total_lengths", "response_lengths"}


def table_rows() -> list[tuple[str, str, str]]:
    """(file, key, required) of every row between the launcher-keys markers."""
    text = DOC.read_text(encoding="utf-8")
    body = text[text.index("<!-- launcher-keys -->"):text.index("<!-- /launcher-keys -->")]
    rows = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("file", "---"):
            continue
        rows.append((cells[0], cells[1], cells[2]))
    assert len(rows) >= 30, rows
    assert {r[2] for r in rows} == {"yes", "no", "timings"}
    return rows


ROWS = table_rows()


@pytest.fixture(scope="session")
def matrix_root(tmp_path_factory: pytest.TempPathFactory, shared_probe: Path) -> Path:
    """The R/R run and the logp P/R cell (native training logp), strict mode, as a user runs
    them: once per test run
    (under xdist the first worker runs it, the others wait for it and read the same root)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "rlk-minimal-launcher-root"
    with FileLock(str(root) + ".lock"):
        if not (root / "matrix-report.json").exists():
            _run_matrix(root, shared_probe)
    return root


def _run_matrix(root: Path, shared_probe: Path) -> None:
    if root.exists():  # an earlier attempt that did not finish
        shutil.rmtree(root)
    env = dict(os.environ, RLK_REUSE_PROBE=str(shared_probe))
    for var in ("MATRIX_ROOT", "MATRIX_STAMP", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER",
                "PYTHON_BIN"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--rlk-matrix=examples/minimal.toml",
         f"--rlk-matrix-root={root}", "-k", "R/R or (logp and P/R)", "-p", "no:cacheprovider",
         "-p", "no:randomly"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "4 valid" in proc.stdout, proc.stdout[-3000:]
    # RL-Kernel's version names are shown as they are (not "vweight_v000000")
    assert "weights bitwise holds (weight_v000000..weight_v000006, 7 versions)" in proc.stdout


def _report(root: Path) -> dict[str, Any]:
    return json.loads((root / "matrix-report.json").read_text())


def _cell_dir(root: Path, module: str, case: str) -> Path:
    (cell,) = [c for c in _report(root)["cells"] if c["module"] == module and c["case"] == case]
    return root / cell["artifact_dir"]


def test_the_minimal_launcher_is_a_valid_matrix(matrix_root: Path) -> None:
    cells = {(c["module"], c["case"]): c for c in _report(matrix_root)["cells"]}
    assert len(cells) == 4
    for (module, case), cell in cells.items():
        assert cell["verdict"] == "valid", (module, case, cell["reasons"])
        assert cell["logprob_source"] == "mismatch-sidecars"
        assert cell["active_token_count"] > 100
    for module in ("attention", "ffn", "logp"):
        rr = cells[(module, "R/R")]
        assert rr["mismatch_count"] == 0 and rr["actual_rollout_implementation"] == "rl_kernel"
    # native Megatron logp (training P): proven by the marker line, no hook and no record
    pr = cells[("logp", "P/R")]
    assert pr["actual_training_implementation"] == "production"
    assert pr["native_logp_marker"].startswith("linear_logp native active:")
    assert pr["routes"]["logp"]["training"]["evidence"] == "run.log marker"
    run = _cell_dir(matrix_root, "logp", "P/R")
    for path in (run / "readbacks").glob("megatron-*.json"):
        data = json.loads(path.read_text())
        assert "logp" not in data["installed_hooks"] and "logp" not in data["operators"]


def test_the_artifacts_follow_upstreams_writers(matrix_root: Path) -> None:
    """The forms RL-Kernel's own writers produce: readback and operator keys, the sidecar's
    keys and 0-based call index, the weight audit's digest over json.dumps(sort_keys=True)."""
    run = _cell_dir(matrix_root, "attention", "R/R")
    for path in (run / "readbacks").glob("*.json"):
        data = json.loads(path.read_text())
        assert set(data) >= UPSTREAM_READBACK_KEYS, path.name
        for op in data["operators"].values():
            assert set(op) >= UPSTREAM_OPERATOR_KEYS
    calls = []
    for path in sorted((run / "mismatch-sidecars").glob("*.pt")):
        data = torch.load(path, weights_only=True)
        assert set(data) == SIDECAR_KEYS
        assert path.name == f"rank{data['rank']:05d}.call{data['call_index']:08d}.pt"
        calls.append(data["call_index"])
    assert calls == list(range(len(calls))) and calls[0] == 0
    audits = sorted((run / "weight-audit").glob("*.json"))
    assert len(audits) == len(calls) + 1  # the initial weights and one per step's update
    for path in audits:
        audit = json.loads(path.read_text())
        blob = json.dumps(audit["tensors"], sort_keys=True).encode("utf-8")
        assert audit["sha256"] == hashlib.sha256(blob).hexdigest()
        assert audit["version"] == path.stem and audit["scope"] == "all_exported_parameters"


# -- the table, key by key --


def _json_files(run: Path, pattern: str) -> list[Path]:
    return sorted(run.glob(pattern))


def _edit_json(paths: list[Path], fn: Callable[[dict[str, Any]], None]) -> None:
    assert paths
    for path in paths:
        data = json.loads(path.read_text())
        fn(data)
        path.write_text(json.dumps(data))


def _drop_lines(run: Path, pattern: str) -> None:
    log = run / "run.log"
    lines = log.read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if not re.search(pattern, ln)]
    assert len(kept) < len(lines), pattern
    log.write_text("".join(kept))


def _drop_perf_key(run: Path, key: str) -> None:
    log = run / "run.log"
    text, n = re.subn(rf"'{re.escape(key)}': [^,}}]+(, )?", "", log.read_text())
    assert n, key
    log.write_text(text)


def mutate(run: Path, file: str, keys: list[str]) -> None:
    """Remove `keys` (or the file) from the artifacts the row names."""
    if file == "`readbacks/*.json`":
        _edit_json(_json_files(run, "readbacks/*.json"),
                   lambda d: [d.pop(k, None) for k in keys])
    elif file.startswith("`readbacks/*.json` operators.<module>"):
        nested = file.endswith(".provenance")

        def drop(d: dict[str, Any]) -> None:
            for op in d["operators"].values():
                target = op["provenance"] if nested else op
                for k in keys:
                    target.pop(k, None)

        _edit_json(_json_files(run, "readbacks/*.json"), drop)
    elif file == "`mismatch-sidecars/*.pt`":
        if keys == ["(file)"]:
            shutil.rmtree(run / "mismatch-sidecars")
            return
        for path in sorted((run / "mismatch-sidecars").glob("*.pt")):
            data = torch.load(path, weights_only=True)
            for k in keys:
                del data[k]
            torch.save(data, path)
    elif file == "`weight-audit/<version>.json`":
        paths = _json_files(run, "weight-audit/*.json")
        if keys == ["(file)"]:
            for path in paths:
                path.unlink()
        else:
            _edit_json(paths, lambda d: [d.pop(k) for k in keys])
    elif file == "`weight-audit/rollout/<version>.json`":
        shutil.rmtree(run / "weight-audit" / "rollout")
    elif file == "`manifest.json`":
        if keys == ["(file)"]:
            (run / "manifest.json").unlink()
        else:
            _edit_json([run / "manifest.json"],
                       lambda d: [d[k.split(".")[0]].pop(k.split(".")[1]) for k in keys])
    elif file == "`run.log`":
        if keys == ["[RL-Kernel][route]"]:
            _drop_lines(run, r"\[RL-Kernel\]\[route\]")
        elif keys == ["native logp marker"]:
            _drop_lines(run, "linear_logp native active")
        elif keys == ["step N"]:
            _drop_lines(run, r"^step \d+:")
        elif keys == ["rollout N"]:
            _drop_lines(run, r"^rollout \d+:")
        else:
            for k in keys:
                _drop_perf_key(run, k)
    else:
        raise AssertionError(f"no mutation for the table's file {file}")


def _keys(cell: str) -> list[str]:
    quoted = re.findall(r"`([^`]+)`", cell)
    return quoted or [cell.replace(" records", "")]


@pytest.mark.parametrize(("file", "key", "required"), ROWS,
                         ids=[f"{f.strip('`')}:{k}" for f, k, _ in ROWS])
def test_table_row_matches_the_readers(matrix_root: Path, tmp_path: Path, file: str, key: str,
                                       required: str) -> None:
    keys = _keys(key)
    # native training logp is a P/R logp cell's evidence; everything else the R/R run's
    source = (_cell_dir(matrix_root, "logp", "P/R") if keys == ["native logp marker"]
              else _cell_dir(matrix_root, "attention", "R/R"))
    run = tmp_path / source.name
    shutil.copytree(source, run)
    before = analyze_run(run)
    assert before["verdict"] == "valid", before["reasons"]
    mutate(run, file, keys)
    after = analyze_run(run)
    perf = after["validity"]["performance"]["reasons"]
    if required == "yes":
        assert after["verdict"] != "valid", f"{file} {key}: still valid without it"
    else:
        assert after["verdict"] == "valid", (file, key, after["reasons"])
        timings = any("no phase wall-clock in run.log" in r for r in perf)
        assert timings == (required == "timings"), (file, key, perf)


def test_a_wrong_run_id_or_contradicting_route_line_is_not_valid(matrix_root: Path,
                                                                 tmp_path: Path) -> None:
    """Optional evidence is still checked where present."""
    source = _cell_dir(matrix_root, "attention", "R/R")
    wrong = tmp_path / "wrong-id"
    shutil.copytree(source, wrong)
    _edit_json(_json_files(wrong, "readbacks/vllm-*.json"),
               lambda d: d.update(run_id="cpu-attention-rr-19700101T000000Z-00000000"))
    record = analyze_run(wrong)
    assert record["verdict"] == "incomparable"
    assert any("artifact from another run" in r for r in record["reasons"]), record["reasons"]
    line = tmp_path / "route-line"
    shutil.copytree(source, line)
    log = line / "run.log"
    text = log.read_text()
    assert "actual=rlkernel.attention.example_rowwise.v1" in text
    log.write_text(text.replace(
        "target=rollout module=attention requested=rl_kernel "
        "actual=rlkernel.attention.example_rowwise.v1",
        "target=rollout module=attention requested=rl_kernel actual=vllm.production.attention"))
    record = analyze_run(line)
    assert record["verdict"] == "fallback", record["reasons"]


def test_messages_count_calls_from_zero(matrix_root: Path, tmp_path: Path) -> None:
    """The first step's sidecar is `call00000000.pt`, `call_index` 0, and messages say `call 0`
    (docs/artifact-format.md: call counts from 0)."""
    run = tmp_path / "call0"
    shutil.copytree(_cell_dir(matrix_root, "attention", "R/R"), run)
    path = run / "mismatch-sidecars" / "rank00000.call00000000.pt"
    data = torch.load(path, weights_only=True)
    assert data["call_index"] == 0
    data["rollout_log_probs"][1] = data["rollout_log_probs"][1][:-1]
    torch.save(data, path)
    record = analyze_run(run)
    assert record["verdict"] == "incomparable"
    assert any("call 0, sample 1 (rank 0): lengths differ" in r for r in record["reasons"]), (
        record["reasons"])
