"""Issue 51: one regression test per class an adversarial read found (fail closed, fourth pass):
files under a root through one door, evidence that proves whose it is, fallback words as
upstream has them (tests/test_fallback_words.py), numbers that cannot slip past a limit, and a
cache keyed on all the code."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cellkit import RUN_ID, CellKit, cell_of

from pytest_rlkernel_matrix.report import cache
from pytest_rlkernel_matrix.report.measured import (
    PROCESS_VAR,
    ROLE_VAR,
    attach,
    fingerprint,
    identity_reason,
)
from pytest_rlkernel_matrix.report.record import analyze_run, cell_to_dict, read_cell_run
from pytest_rlkernel_matrix.run.rootlock import LOCK_FILE, RootUnusable, claim, holder
from pytest_rlkernel_matrix.store import safeio

OUTSIDE_TEXT = "outside the root: must never be read, written or truncated\n"


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """`fn()`'s result; fails (instead of hanging the suite) when it waits on a file."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # (re-raised below, in the test's thread)
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} waited on a file for {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def plant(path: Path, kind: str, outside: Path) -> None:
    """Put a special file at `path`: fifo, a link to /dev/zero, a link out of the root, a link
    that stays inside the root (to a regular file beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "link-out":
        path.symlink_to(outside)
    else:
        raise ValueError(kind)


SPECIAL = ("fifo", "device", "link-out")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere" / "victim.json"
    target.parent.mkdir()
    target.write_text(OUTSIDE_TEXT)
    return target


# -- 1. one door for files under a root -----------------------------------------------------

@pytest.mark.parametrize("kind", [*SPECIAL, "hardlink"])
def test_the_session_lock_never_writes_through_what_is_planted_at_its_path(
        tmp_path: Path, outside: Path, kind: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    lock = root / LOCK_FILE
    if kind == "hardlink":
        os.link(outside, lock)
    else:
        plant(lock, kind, outside)
    with pytest.raises(RootUnusable, match=LOCK_FILE):
        within(10, lambda: claim(root))
    assert outside.read_text() == OUTSIDE_TEXT  # nothing outside the root written or truncated


def test_the_lock_holder_is_read_bounded_and_never_waits(tmp_path: Path, outside: Path) -> None:
    for kind in SPECIAL:
        plant(tmp_path / "root" / LOCK_FILE, kind, outside)
        assert "holder unknown" in within(10, lambda: holder(tmp_path / "root" / LOCK_FILE))


def test_a_clean_lock_is_still_taken_and_released(tmp_path: Path) -> None:
    lock = claim(tmp_path / "root")
    assert json.loads((tmp_path / "root" / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def _cell_run_readers(run: Path) -> dict[str, Callable[[], Any]]:
    """Every reader on the report side that opens `<run>/cell-run.json` or `<run>/run.log`."""
    from pytest_rlkernel_matrix.judge.localise.factors import _run_identity

    return {
        "cache policy": lambda: cache._policy_of(run),
        "cache repeat dirs": lambda: cache.repeat_dirs(run),
        "cache key": lambda: cache.cache_key(run, {}),
        "measured fingerprint": lambda: fingerprint({"run_id": "x"}, run),
        "measured identity": lambda: identity_reason({"run_id": "x"}, run, 2),
        "factor identity": lambda: _run_identity(run),
    }


@pytest.mark.parametrize("name", ["cell-run.json", "run.log"])
@pytest.mark.parametrize("kind", SPECIAL)
def test_no_report_side_reader_waits_on_or_follows_a_planted_file(
        tmp_path: Path, outside: Path, kind: str, name: str) -> None:
    k = CellKit(tmp_path / "root").write()
    plant(k.dir / name, kind, outside)
    for label, read in _cell_run_readers(k.dir).items():
        got = within(10, read)
        assert OUTSIDE_TEXT.strip() not in json.dumps(got, default=str), label
    rec = within(30, k.analyze)
    assert rec["verdict"] != "valid"
    assert outside.read_text() == OUTSIDE_TEXT


@pytest.mark.parametrize("kind", SPECIAL)
def test_report_files_the_cli_reads_are_refused_not_waited_on(
        tmp_path: Path, outside: Path, kind: str) -> None:
    from pytest_rlkernel_matrix.report.merge import MergeError, load_report
    from pytest_rlkernel_matrix.report.reanalyze import _read_old_report
    from pytest_rlkernel_matrix.run.contamination import CONTAMINATION_FILE, read_measurement

    root = tmp_path / "root"
    plant(root / "matrix-report.json", kind, outside)
    notes: list[str] = []
    assert within(10, lambda: _read_old_report(root / "matrix-report.json", notes)) == {}
    assert notes and "unreadable" in notes[0]
    with pytest.raises(MergeError):
        within(10, lambda: load_report(root / "matrix-report.json"))
    plant(root / CONTAMINATION_FILE, kind, outside)
    assert within(10, lambda: read_measurement(root)) is None


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_cache_entry_that_is_a_special_file_is_not_used(
        tmp_path: Path, outside: Path, kind: str) -> None:
    k = CellKit(tmp_path / "root").write()
    rel = f"cpu/{k.cell.slug}"
    plant(cache.entry_path(k.root, rel), kind, outside)
    record, why, _ = within(10, lambda: cache.lookup(k.root, rel, {}))
    assert record is None and "unreadable cache entry" in why


def test_a_cache_folder_linked_out_of_the_root_is_never_written(tmp_path: Path) -> None:
    k = CellKit(tmp_path / "root").write()
    elsewhere = tmp_path / "elsewhere-cache"
    elsewhere.mkdir()
    (k.root / cache.CACHE_DIR).symlink_to(elsewhere)
    rel = f"cpu/{k.cell.slug}"
    _, _, key = cache.lookup(k.root, rel, {})
    assert key is not None
    cache.store(k.root, rel, key, {"verdict": "valid"})
    assert list(elsewhere.iterdir()) == []


def test_appends_and_new_files_never_follow_a_link(tmp_path: Path, outside: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "run.log").symlink_to(outside)
    with pytest.raises(safeio.Refused):
        safeio.open_append(root / "run.log", root)
    with pytest.raises(FileExistsError):
        safeio.write_new_text(root / "run.log", "x")
    (root / "sub").symlink_to(outside.parent)
    with pytest.raises(safeio.Refused):
        safeio.write_text(root / "sub" / "exit-code", root, "0\n")
    assert sorted(p.name for p in outside.parent.iterdir()) == ["victim.json"]
    assert outside.read_text() == OUTSIDE_TEXT


# -- 2. evidence proves whose it is --------------------------------------------------------

def test_a_directory_holding_another_cell_is_not_judged_as_the_cell_asked(tmp_path: Path) -> None:
    k = CellKit(tmp_path, case="P/P").write()
    rec = analyze_run(k.dir, cell=cell_of("attention", "R/R"), mode="strict", artifact_dir="x")
    assert rec["verdict"] == "error" and rec["case"] == "R/R"
    assert any("identity" in r and "attention[P/P]" in r for r in rec["reasons"]), rec["reasons"]


def test_a_cell_run_without_a_run_id_is_a_reason_naming_it(tmp_path: Path) -> None:
    k = CellKit(tmp_path).write()
    meta = json.loads((k.dir / "cell-run.json").read_text())
    del meta["run_id"]
    k.write_json("cell-run.json", meta)
    rec = k.analyze()
    assert rec["verdict"] != "valid"
    reasons = rec["reasons"] + [r for j in rec["validity"].values() for r in j["reasons"]]
    assert any("names no run_id" in r for r in reasons), reasons


def _measured(k: CellKit, n: int, **meta: Any) -> Path:
    d = k.dir / f"measured.{n}"
    d.mkdir()
    base = {"session": "t", "cell": cell_to_dict(k.cell), "mode": "strict",
            "run_id": f"{RUN_ID}.p{n}",
            "run": {"command": "x", "exit_code": 0, "timed_out": False, "interrupted": False,
                    "wall_time": 1.0, "started": "s", "finished": "f"},
            "env": {ROLE_VAR: "measured", PROCESS_VAR: str(n)}, "policy": k.policy}
    base.update(meta)
    (d / "cell-run.json").write_text(json.dumps({k2: v for k2, v in base.items()
                                                 if v is not None}))
    (d / "run.log").write_text(f"run {n}\n")
    return d


@pytest.mark.parametrize("change,expect", [
    ({}, None),
    ({"run_id": "another-run.p2"}, "is not"),
    ({"run_id": None}, "names no run_id"),
    ({"env": {ROLE_VAR: "measured"}}, f"names no {PROCESS_VAR}"),
    ({"env": {ROLE_VAR: "measured", PROCESS_VAR: "3"}}, "not this directory's process 2"),
    ({"env": {}}, f"names no {ROLE_VAR}"),
])
def test_a_measured_run_proves_it_is_this_cells_process(
        tmp_path: Path, change: dict[str, Any], expect: str | None) -> None:
    k = CellKit(tmp_path).write()
    d = _measured(k, 2, **change)
    why = identity_reason({"run_id": RUN_ID}, d, 2)
    assert (why is None) if expect is None else (why is not None and expect in why), why


def test_a_measured_run_of_another_cell_is_not_counted(tmp_path: Path) -> None:
    k = CellKit(tmp_path).write()
    other = CellKit(tmp_path / "other", case="P/P").write()
    d = _measured(k, 2, cell=cell_to_dict(other.cell))
    steps = {"steps": [1.0, 1.1, 1.0, 1.05, 1.0]}
    record = {"verdict": "valid", "run_id": RUN_ID, "performance_policy": {"processes": 2},
              "validity": {"performance": {"valid": True, "reasons": []}},
              "phase_spread": {"step_wall_time": steps}}

    def analyze(run_dir: Path) -> dict[str, Any]:
        return analyze_run(run_dir, cell=k.cell, mode="strict", artifact_dir="m")

    attach(record, k.dir, analyze)
    run = record["measured"]["runs"][1]
    assert run["dir"] == d.name and run["used"] is False
    assert "identity" in run["reason"], run


def test_a_factor_cell_copied_from_its_baseline_is_not_judged(tmp_path: Path) -> None:
    from pytest_rlkernel_matrix.judge.localise.factors import compare_runs

    k = CellKit(tmp_path).write()
    copy = tmp_path / "factor-copy"
    shutil.copytree(k.dir, copy)
    out = compare_runs(copy, k.dir, {"verdict": "valid"})
    assert out["judged"] is False and "identity" in out["why"], out
    meta = json.loads((copy / "cell-run.json").read_text())
    meta["run_id"] = "another-run"
    (copy / "cell-run.json").write_text(json.dumps(meta))
    out = compare_runs(copy, k.dir, {"verdict": "valid"})
    assert out["judged"] is False and "byte for byte" in out["why"], out


# -- 3. fallback words in a run ------------------------------------------------------------

@pytest.mark.parametrize("word", ["split_kv_fallback=true", "used_fallback=true",
                                  "fallback_used=True"])
def test_a_route_line_with_any_fallback_key_keeps_the_cell_from_valid(
        tmp_path: Path, word: str) -> None:
    k = CellKit(tmp_path).write()
    k.log("[RL-Kernel][route] framework=vllm target=rollout module=attention "
          f"requested=rl_kernel actual=rlkernel.attention.deterministic.v1 {word}")
    rec = k.analyze()
    assert rec["verdict"] != "valid", rec["reasons"]


# -- 4. numbers that cannot slip past a limit ----------------------------------------------

@pytest.mark.parametrize("value,expect", [("nan", "not finite"), ("1e999", "not finite"),
                                          ("-inf", "not finite"), ("-2.0", "negative time")])
def test_a_perf_record_with_an_impossible_time_is_a_reason(
        tmp_path: Path, value: str, expect: str) -> None:
    k = CellKit(tmp_path).write()
    k.log(f"perf 1: {{'perf/step_time': {value}, 'perf/train_time': 1.0, "
          "'perf/rollout_time': 1.5}")
    rec = k.analyze()
    perf = rec["validity"]["performance"]
    assert perf["valid"] is False and any(expect in r for r in perf["reasons"]), perf


def test_an_unparsed_record_is_a_reason_not_a_counter(tmp_path: Path) -> None:
    k = CellKit(tmp_path).write()
    k.log("perf 1: {'perf/step_time': tensor(3.0), 'perf/train_time': 1.0}")
    perf = k.analyze()["validity"]["performance"]
    assert perf["valid"] is False
    assert any("could not be read (1 perf)" in r for r in perf["reasons"]), perf


def test_a_positive_logprob_is_not_evidence(tmp_path: Path) -> None:
    k = CellKit(tmp_path).write()
    data = k.sidecar()
    data["train_log_probs"][0][0] = 0.25
    data["rollout_log_probs"][0][0] = 0.25
    k.write_sidecar(data)
    rec = k.analyze()
    assert rec["verdict"] != "valid"
    assert any("above 0" in r for r in rec["reasons"]), rec["reasons"]


def test_the_histogram_survives_values_a_last_bit_apart() -> None:
    from pytest_rlkernel_matrix.judge.read.metrics import log10_histogram

    a = np.array([0.5, np.nextafter(0.5, 1.0)])
    counts, edges = log10_histogram(a)
    assert int(counts.sum()) == 2 and len(edges) == 21 and np.isfinite(edges).all()


@pytest.mark.parametrize("policy,key", [
    ({"max_relative_spread": 1e999}, "max_relative_spread"),
    ({"confidence": 0.01}, "confidence"),
    ({"max_foreign_cpu": -0.5}, "max_foreign_cpu"),
    ({"min_steps": 1.5}, "min_steps"),
    ({"surprise": 1}, "surprise"),
])
def test_performance_policy_is_validated(tmp_path: Path, policy: dict[str, Any],
                                         key: str) -> None:
    k = CellKit(tmp_path).write()
    meta = json.loads((k.dir / "cell-run.json").read_text())
    meta["performance_policy"] = policy
    (k.dir / "cell-run.json").write_text(json.dumps(meta).replace("Infinity", "1e999"))
    with pytest.raises(ValueError, match=key):
        read_cell_run(k.dir)
    assert k.analyze()["verdict"] == "error"


def test_duplicate_keys_and_nan_in_cell_run_are_refused(tmp_path: Path) -> None:
    k = CellKit(tmp_path).write()
    text = (k.dir / "cell-run.json").read_text()
    (k.dir / "cell-run.json").write_text(text[:-1] + ', "mode": "off"}')
    with pytest.raises(ValueError, match="duplicate key 'mode'"):
        read_cell_run(k.dir)
    (k.dir / "cell-run.json").write_text(text.replace('"wall_time": 1.0', '"wall_time": NaN'))
    with pytest.raises(ValueError, match=r"run\.wall_time"):
        read_cell_run(k.dir)
    (k.dir / "cell-run.json").write_text(text.replace('"wall_time": 1.0', '"wall_time": -1.0'))
    with pytest.raises(ValueError, match="wall_time"):
        read_cell_run(k.dir)


# -- 5. the cache keyed on all the code that decides ---------------------------------------

@pytest.mark.parametrize("module", ["report/measured.py", "store/safeio.py",
                                    "judge/read/fallback.py", "report/record.py"])
def test_a_change_to_any_judging_module_refuses_the_cached_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    package = Path(cache.__file__).resolve().parent.parent
    copy = tmp_path / "pkg" / package.name
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert cache.code_digest([copy]) == cache.judge_code_digest()  # the whole package
    monkeypatch.setattr(cache, "judge_code_digest", lambda: cache.code_digest([copy]))
    k = CellKit(tmp_path / "root").write()
    rel = f"cpu/{k.cell.slug}"
    _, _, key = cache.lookup(k.root, rel, {})
    assert key is not None
    cache.store(k.root, rel, key, {"verdict": "valid"})
    assert cache.lookup(k.root, rel, {})[0] == {"verdict": "valid"}
    with (copy / module).open("a") as fh:
        fh.write("\n# a rule changed\n")
    record, why, _ = cache.lookup(k.root, rel, {})
    assert record is None and why.startswith("judging code changed"), why


def test_strict_json_names_the_key_of_a_non_finite_number_and_a_duplicate() -> None:
    with pytest.raises(ValueError, match=r"a\.b\[1\]"):
        safeio.loads_strict('{"a": {"b": [1, NaN]}}')
    with pytest.raises(ValueError, match=r"x = inf"):
        safeio.loads_strict('{"x": 1e999}')
    with pytest.raises(safeio.Duplicate, match="'k'"):
        safeio.loads_strict('{"k": 1, "j": {"k": 2}, "k": 3}')
    assert safeio.loads_strict('{"k": 1.5, "j": [1e308]}') == {"k": 1.5, "j": [1e308]}


def test_a_folder_linked_out_of_the_root_is_never_made_into(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (tmp_path / "out").mkdir()
    root.mkdir()
    (root / ".locks").symlink_to(tmp_path / "out")
    with pytest.raises(safeio.Refused):
        safeio.ensure_dir(root / ".locks" / "deeper", root)
    assert list((tmp_path / "out").iterdir()) == []
    assert safeio.ensure_dir(root / "a" / "b", root).is_dir()
