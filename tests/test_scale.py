"""Analysis at scale: `.pt` files read by `torch.load(weights_only=True)` only, the parallel and
cached `rlk-matrix report`, the progress bar and the plugin's overhead fields."""

from __future__ import annotations

import io
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_rlkernel_matrix.judge.read.ptread import read_pt


def _saved(obj: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.stride() == b.stride() and torch.equal(a, b))
    if isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def test_pt_files_are_what_weights_only_torch_load_gives() -> None:
    base = torch.arange(12, dtype=torch.float32)
    obj = {"schema_version": "x", "rank": 3, "f": 1.5, "none": None, "ok": True,
           "lists": [torch.randn(7, dtype=torch.bfloat16), torch.randn(5, dtype=torch.float16),
                     torch.tensor([True, False]), base[2:9], base.view(3, 4).t(), base[:0]],
           "size": torch.Size([2, 3]), "nested": ({"a": [1, 2]}, (base[1:3],)), 5: "int key"}
    raw = _saved(obj)
    assert _same(read_pt(raw, torch), torch.load(io.BytesIO(raw), weights_only=True))


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /dev/null",))


def test_no_foreign_global_is_unpickled() -> None:
    with pytest.raises(pickle.UnpicklingError, match="system"):
        read_pt(_saved({"x": _Evil()}, pickle_module=pickle), torch)
    with pytest.raises(pickle.UnpicklingError):  # a legacy (non-zip) load, weights only too
        read_pt(b"not a zip at all", torch)


# -- rlk-matrix report: parallel, cached, progress ------------------------------------------------

TIMING_FIELDS = ("overhead_s", "overhead")


def _root(tmp_path: Path) -> Path:
    from cellkit import CellKit

    root = tmp_path / "root"
    for module, case in (("attention", "R/R"), ("attention", "P/R"), ("ffn", "R/P")):
        CellKit(root, module=module, case=case).write()
    return root


def _cells(root: Path, **kwargs: Any) -> tuple[list[dict[str, Any]], list[str]]:
    import json

    from pytest_rlkernel_matrix.report.reanalyze import reanalyze

    lines: list[str] = []
    path = reanalyze(root, log=lines.append, progress=False, **kwargs)
    cells = json.loads(path.read_text())["cells"]
    for c in cells:
        for k in TIMING_FIELDS:
            c.pop(k, None)
    return cells, lines


def test_parallel_analysis_equals_the_sequential_one(tmp_path: Path) -> None:
    root = _root(tmp_path)
    seq, _ = _cells(root, jobs=1, use_cache=False)
    par, _ = _cells(root, jobs=3, use_cache=False)
    assert [c["verdict"] for c in seq] == ["valid"] * 3
    assert par == seq
    assert not (root / ".rlk-cache").exists()  # --no-cache neither reads nor writes it


def test_a_cache_hit_gives_the_full_read_record_and_changes_invalidate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_rlkernel_matrix.report import record

    root = _root(tmp_path)
    first, lines = _cells(root, jobs=1)  # no matrix-report.json yet: cells from the directories
    assert lines[-1] == "cache: 0 of 3 run directories unchanged (reused), 3 read"
    _, lines = _cells(root, jobs=1)  # now from matrix-report.json's cells: the same keys
    assert lines == ["cache: 3 of 3 run directories unchanged (reused), 0 read"]
    shutil.rmtree(root / ".rlk-cache")
    full, _ = _cells(root, jobs=1, use_cache=False)
    assert full == first
    cold, lines = _cells(root, jobs=2)
    assert cold == full and lines[-1] == ("cache: 0 of 3 run directories unchanged (reused), "
                                          "3 read")
    assert lines[0] == ("cache: 3 of 3 run directories not cached yet (no cache entry, as on a "
                        "first report): read")  # one count line, not one line per cell
    warm, lines = _cells(root, jobs=2)
    assert warm == full
    assert lines == ["cache: 3 of 3 run directories unchanged (reused), 0 read"]
    # a touched sidecar (same bytes, new mtime): that cell only is read again
    pt = root / "cpu" / "attention-rr" / "mismatch-sidecars" / "rank00000.call00000000.pt"
    st = pt.stat()
    os.utime(pt, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again, lines = _cells(root, jobs=2)
    assert again == full
    assert lines == ["cache: cpu/attention-rr: read again: "
                     "mismatch-sidecars/rank00000.call00000000.pt changed (mtime_ns, ctime_ns)",
                     "cache: 2 of 3 run directories unchanged (reused), 1 read"]
    # a .pt rewritten with the same size and its mtime put back (`cp -p`, `touch -r`): the
    # inode and ctime, which nothing sets back, tell (issue 34)
    _cells(root, jobs=1)
    st = pt.stat()
    copy = pt.with_name("copy.tmp")
    shutil.copy2(pt, copy)
    os.replace(copy, pt)
    os.utime(pt, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (pt.stat().st_size, pt.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    _, lines = _cells(root, jobs=1)
    assert lines[0] == ("cache: cpu/attention-rr: read again: "
                        "mismatch-sidecars/rank00000.call00000000.pt changed (inode, ctime_ns)")
    # a small file edited in place, size and mtime kept: its sha256 tells
    log = root / "cpu" / "ffn-rp" / "run.log"
    st = log.stat()
    text = log.read_text()
    log.write_text(text.replace("perf/step_time': 3.0", "perf/step_time': 4.0"))
    os.utime(log, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed, lines = _cells(root, jobs=1)
    assert lines[0] == "cache: cpu/ffn-rp: read again: run.log changed (sha256)"
    assert [c.get("step_wall_time") for c in changed] != [c.get("step_wall_time") for c in full]
    # a new analysis version: every entry is ignored
    monkeypatch.setattr(record, "ANALYSIS_VERSION", record.ANALYSIS_VERSION + 1)
    _, lines = _cells(root, jobs=1)
    assert sum("read again: analysis version" in line for line in lines) == 3
    # a corrupt entry is ignored with its reason, never trusted
    entry = root / ".rlk-cache" / "cpu__attention-pr.json"
    entry.write_text("{")
    _, lines = _cells(root, jobs=1)
    assert "cache: cpu/attention-pr: read again: unreadable cache entry (JSONDecodeError)" in lines


def test_a_warm_report_imports_neither_torch_nor_numpy_and_says_what_a_full_read_says(
        tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    root = _root(tmp_path)
    code = ("import sys; from pytest_rlkernel_matrix import cli; rc = cli.main(sys.argv[1:]); "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules)); sys.exit(rc)")
    cmd = [sys.executable, "-c", code, "report", str(root), "--jobs", "1"]
    cold = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert cold.stdout.splitlines()[-1] == "['numpy']"  # sidecars read as numpy arrays
    full = (root / "matrix-report.json").read_text()
    warm = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert warm.stdout.splitlines()[-1] == "[]"
    assert "cache: 3 of 3 run directories unchanged (reused), 0 read" in warm.stderr
    cold_report, warm_report = json.loads(full), json.loads(
        (root / "matrix-report.json").read_text())
    for report in (cold_report, warm_report):
        report.pop("created")
    assert warm_report == cold_report  # records, verdicts and the (memoised) attribution
    assert (root / ".rlk-cache" / "attribution.json").exists()


def test_the_attribution_memo_is_used_only_under_its_own_key(tmp_path: Path) -> None:
    import json

    from pytest_rlkernel_matrix.report.matrix_report import MEMO_FILE
    from pytest_rlkernel_matrix.report.reanalyze import reanalyze

    root = _root(tmp_path)
    first = json.loads(reanalyze(root, jobs=1, progress=False).read_text())
    memo = root / ".rlk-cache" / MEMO_FILE
    entry = json.loads(memo.read_text())
    assert entry["attribution"] == first["attribution"]
    entry.update(key="another key", attribution=["not this"], factor_attribution=["nor this"])
    memo.write_text(json.dumps(entry))
    again = json.loads(reanalyze(root, jobs=1, progress=False).read_text())
    assert again["attribution"] == first["attribution"]
    assert again["factor_attribution"] == first["factor_attribution"]
    assert json.loads(memo.read_text())["key"] != "another key"  # rewritten under its key


def test_a_stored_hash_is_reused_only_for_a_file_not_written_since(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_rlkernel_matrix.report import cache

    root = _root(tmp_path)
    rel = "cpu/ffn-rp"
    inputs = {"artifact_dir": rel, "gaps": []}
    _, why, key = cache.lookup(root, rel, inputs)
    assert why == "no cache entry" and key.hashed > 0
    cache.store(root, rel, key, {"verdict": "valid"})
    # hashed within SETTLED_NS of the files' last change: hashed again (and the stamps kept)
    hit, _, again = cache.lookup(root, rel, inputs)
    assert hit == {"verdict": "valid"} and again.hashed == key.hashed
    monkeypatch.setattr(cache, "SETTLED_NS", 0)
    hit, _, settled = cache.lookup(root, rel, inputs)
    assert hit == {"verdict": "valid"} and settled.hashed == 0  # every hash from the entry
    # rewritten in place, size and mtime restored: its ctime moved, so it is read and hashed
    log = root / rel / "run.log"
    st = log.stat()
    log.write_text(log.read_text().replace("perf/step_time': 3.0", "perf/step_time': 4.0"))
    os.utime(log, ns=(st.st_atime_ns, st.st_mtime_ns))
    hit, why, edited = cache.lookup(root, rel, inputs)
    assert hit is None and why == "run.log changed (sha256)" and edited.hashed == 1


def test_report_cli_options_and_no_progress_without_a_terminal(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = _root(tmp_path)
    cmd = [sys.executable, "-m", "pytest_rlkernel_matrix.cli", "report", str(root)]
    first = subprocess.run([*cmd, "--jobs", "2"], capture_output=True, text=True, check=True)
    assert "3 valid (timings: 0 usable, 3 not usable) in 3 of 3 cells" in first.stdout
    assert "\r" not in first.stderr and "cell/s" not in first.stderr  # no bar in a log
    second = subprocess.run([*cmd, "--no-cache", "--jobs", "1"], capture_output=True, text=True,
                            check=True)
    assert "cache:" not in second.stderr
    bad = subprocess.run([*cmd, "--jobs", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--jobs must be at least 1" in bad.stderr


def test_progress_bar_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pytest_rlkernel_matrix.report.reanalyze import reanalyze

    reanalyze(_root(tmp_path), jobs=1, use_cache=False, progress=True)
    err = capsys.readouterr().err
    assert "rlk-matrix report" in err and "0/3 [" in err and "cell/s" in err


def test_a_bar_only_where_both_streams_are_a_terminal_outside_ci() -> None:
    from pytest_rlkernel_matrix.report.progress import in_ci, on_terminal

    with open(os.devnull, "w") as null:
        assert not on_terminal(null, null, {})
        assert not on_terminal(io.StringIO(), io.StringIO(), {})
    assert in_ci({"CI": "true"}) and in_ci({"CI": "1"}) and not in_ci({"CI": "false"})
    assert not in_ci({}) and not in_ci({"CI": ""})


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a pseudo-tty")
def test_session_progress_on_a_terminal_and_silent_in_a_log_or_ci(
        pytester: pytest.Pytester, make_matrix: Any, tmp_path: Path) -> None:
    import subprocess
    import sys

    make_matrix(modules='["attention"]')
    env = {k: v for k, v in os.environ.items() if k != "CI"}

    def session(root: str, *, tty: bool, ci: bool = False, verbose: bool = False) -> str:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v" if verbose else "-q",
               f"--rlk-matrix-root={tmp_path / root}", "-k", "R/R or P/R"]
        run_env = {**env, "CI": "true"} if ci else env
        if tty:  # script(1) gives the session a pseudo-terminal for stdout and stderr
            import shlex

            cmd = ["script", "-qec", shlex.join(cmd), "/dev/null"]
        out = subprocess.run(cmd, cwd=pytester.path, env=run_env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return out.stdout + out.stderr

    shown = session("tty", tty=True, verbose=True)
    assert "rlk cells" in shown and "1/2" in shown and "2/2" in shown
    assert "cpu attention P/R: valid" in shown
    # without -v the bar would break pytest's row of dots: pytest's [100%] is the progress
    assert "rlk cells" not in session("tty-quiet", tty=True)
    assert "rlk cells" not in session("log", tty=False)
    assert "rlk cells" not in session("ci", tty=True, ci=True)


# -- the plugin's overhead per cell ----------------------------------------------------------------

def test_records_carry_the_plugin_overhead(pytester: pytest.Pytester, make_matrix: Any,
                                           tmp_path: Path) -> None:
    import json

    from pytest_rlkernel_matrix.report.reanalyze import reanalyze

    make_matrix(modules='["attention"]')
    root = tmp_path / "root"
    result = pytester.runpytest(f"--rlk-matrix-root={root}", "-p", "no:cacheprovider",
                                "-k", "R/R")
    assert result.ret == 0
    cells = json.loads((root / "matrix-report.json").read_text())["cells"]
    (rec,) = cells
    parts = rec["overhead"]
    named_parts = ("env_s", "launch_wait_s", "record_write_s", "import_wait_s", "evidence_s",
                   "verdict_s", "record_s")
    for key in named_parts:
        assert isinstance(parts[key], float) and parts[key] >= 0, key
    named = sum(parts[k] for k in named_parts)
    assert rec["overhead_s"] == pytest.approx(named, abs=1e-5)
    assert parts["session_measured"] is True
    assert parts["cell_wall_s"] == pytest.approx(rec["process_wall_time"] + rec["overhead_s"],
                                                 abs=1e-5)
    assert 0 <= parts["fraction"] < 1
    assert rec["overhead_s"] < parts["cell_wall_s"]
    meta = json.loads((root / rec["artifact_dir"] / "cell-run.json").read_text())
    assert set(meta["overhead"]) == {"env_s", "launch_wait_s", "record_write_s", "import_wait_s"}
    # a re-analysis keeps the session's part and measures its own analysis
    again = json.loads(reanalyze(root, jobs=1, use_cache=False,
                                 progress=False).read_text())["cells"][0]
    assert {k: again["overhead"][k] for k in meta["overhead"]} == meta["overhead"]


def test_the_page_rendered_beside_the_json_is_the_page_and_failures_are_said_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`reanalyze` renders matrix-report.html in a forked child while it writes the JSON: the
    same page `write_html` writes; a child that fails leaves the render (and its error) to
    this process; a JSON that cannot be written leaves no page and no part file behind."""
    import json
    import threading

    from pytest_rlkernel_matrix.report import html
    from pytest_rlkernel_matrix.report import reanalyze as rean

    root = _root(tmp_path)
    rean.reanalyze(root, jobs=1, progress=False)
    page = root / html.HTML_FILE
    assert page.read_text() == html.render_html(json.loads((root / "matrix-report.json")
                                                           .read_text()), None)
    assert oct(page.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    report = json.loads((root / "matrix-report.json").read_text())
    alone = threading.active_count() == 1  # (another test's thread, e.g. tqdm's: no fork)
    rendering = rean._html_beside(report, root / "x.html", None)
    assert (rendering is not None) == alone
    assert rean._html_done(rendering, root / "x.html") == alone
    if alone:
        assert (root / "x.html").read_text() == page.read_text()
    calls: list[int] = []
    real = html.write_html

    def fails_in_the_child(report: Any, path: Path, pre: Any = None) -> None:
        calls.append(os.getpid())
        if os.getpid() != me:
            raise RuntimeError("child")
        raise OSError("no room for the page")

    me = os.getpid()
    monkeypatch.setattr(html, "write_html", fails_in_the_child)
    with pytest.raises(OSError, match="no room for the page"):
        rean.reanalyze(root, jobs=1, progress=False)
    assert calls == [me]  # (the child's call is in its own memory; this one raised here)
    monkeypatch.setattr(html, "write_html", real)

    def no_json(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    page.unlink()
    monkeypatch.setattr(rean, "write_json_atomic", no_json)
    with pytest.raises(OSError, match="disk full"):
        rean.reanalyze(root, jobs=1, progress=False)
    assert not page.exists()
    assert not [p for p in root.iterdir() if p.name.endswith(".rendered")]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
