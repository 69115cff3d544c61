"""`matrix-report.html`: content, escaping, offline links, and a real headless-browser render."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from pytest_rlkernel_matrix.report import html as html_module
from pytest_rlkernel_matrix.report.html import HTML_FILE, render_html, write_html
from pytest_rlkernel_matrix.report.html_parts import drift_class

XSS = "<script>alert(1)</script>"
SCRIPT = Path(__file__).parents[1] / "scripts" / "screenshot_report.py"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (Debian: apt-get install -y chromium)")


class Page(HTMLParser):
    """Collects tags' attributes, matrix cells and text from the rendered page."""

    def __init__(self) -> None:
        super().__init__()
        self.attrs: list[tuple[str, dict[str, str | None]]] = []
        self.matrix_cells: list[dict[str, str | None]] = []
        self.scripts = 0
        self.depth = 0  # <details> nesting: text at depth 0 is visible without a click
        self.visible: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.attrs.append((tag, a))
        if tag == "td" and "mcell" in (a.get("class") or "").split():
            self.matrix_cells.append(a)
        if tag == "script":
            self.scripts += 1
        if tag == "details":
            self.depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "details":
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth == 0:
            self.visible.append(data)

    def visible_text(self) -> str:
        return " ".join(" ".join(self.visible).split())


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    return page


def _cell(module: str, case: str, verdict: str, **extra: Any) -> dict[str, Any]:
    slug = f"{module}-{case.replace('/', '').lower()}"
    cell: dict[str, Any] = {
        "hardware": "cpu", "module": module, "case": case, "verdict": verdict,
        "reasons": [], "failed": verdict in ("error", "incomparable"), "mode": "audit",
        "artifact_dir": f"cpu/{slug}", "run_id": f"cpu-{slug}-x",
        "active_token_count": 140, "mismatch_count": 0 if case == "R/R" else 140,
        "logprob_abs_diff_max": 0.0 if case == "R/R" else 1e-3,
        "rollout_wall_time": 1.5, "training_wall_time": 1.25, "weight_sync_wall_time": 0.5,
        "step_wall_time": 3.25,
        "validity": {k: {"valid": True, "reasons": []}
                     for k in ("route", "semantic", "numeric", "performance")},
        "routes": {module: {"requested": case,
                            "training": {"implementation": "rl_kernel", "backend_ids": ["r.t"],
                                         "call_count": 7, "fallback": False,
                                         "contract": "bitwise"},
                            "rollout": None}},
        "dlogp_histogram": {"log10_abs_diff_edges": [-5.0, -4.0, -3.0], "counts": [3, 9],
                            "zero": 2},
        "worst_tokens": [{"sample": 1, "rank": 0, "position": 4, "train_logprob": -1.2,
                          "rollout_logprob": -1.201, "abs_diff": 1e-3}],
        "first_mismatch": [{"sample": 1, "rank": 0, "position": 2}],
    }
    cell.update(extra)
    return cell


def sample_report() -> dict[str, Any]:
    cells = [
        _cell("attention", "R/R", "valid"),
        _cell("attention", "P/R", "fallback", reasons=[f"fallback recorded: {XSS}"],
              fallbacks=[{"source": "run.log", "line": f"[RL-Kernel][route] {XSS}"}]),
        _cell("attention", "R/P", "contract_mismatch", log_errors={"cuda": XSS}),
        _cell("attention", "P/P", "error", artifact_dir="/elsewhere/attention-pp"),
        _cell("ffn", "R/R", "unsupported", artifact_dir="../outside"),
        _cell("ffn", "P/R", "incomparable", artifact_dir="javascript:alert(1)"),
        _cell("ffn", "R/P", "not_run", artifact_dir=None, routes=None, validity=None,
              dlogp_histogram=None, step_wall_time=None),
        {"hardware": "cpu", "module": "ffn", "case": "P/P", "verdict": "valid"},  # bare record
    ]
    return {
        "schema_version": "rlk-matrix.report.v1", "created": "2026-01-01T00:00:00+00:00",
        "matrix": {"name": "demo", "layout": "pairwise", "mode": "audit", "hardware": ["cpu"],
                   "modules": ["attention", "ffn"], "cases": ["R/R", "P/R", "R/P", "P/P"]},
        "matrix_root": "/data/root", "complete": True, "interrupted": False,
        "expected_cells": 8, "summary": {"valid": 2, "fallback": 1},
        "preflight": {"file": "preflight.json", "hardware_fingerprint": "hw0",
                      "build_fingerprint": "b0"},
        "attribution": [{
            "hardware": "cpu", "module": "attention", "conclusion": f"no conclusion {XSS}",
            "refused": ["P/R is fallback"],
            "effects": {"drift": {"logprob_abs_diff_max": {"training": 1e-3, "rollout": 0.0,
                                                           "interaction": None}},
                        "time": {"step_wall_time": {"training": 0.1, "rollout": -0.2,
                                                    "interaction": 0.0, "noise": True}}},
        }],
        "cells": cells,
    }


PREFLIGHT = {
    "python": {"version": "3.11.7", "executable": "/usr/bin/python3"},
    "probe": {"torch": {"version": "2.13.0+cpu", "build": "cpu"},
              "packages": {"vllm": {"version": None, "module_found": False}}},
    "gpu": {"backend": "cuda", "count": 2, "names": ["NVIDIA H100 80GB HBM3", XSS]},
    "nvidia": {"driver": "550.54.15"},
    "repos": {"vime": {"configured": True, "root": "/src/vime", "commit": "abc123",
                       "dirty": False, "status": "ok"}},
    "topology": {"tp": 2, "cp": 2}, "topology_check": {"configured": True, "ok": True},
    "fingerprints": {"hardware": "hw0", "build": "b0"},
}


def test_every_cell_appears_with_its_verdict_class() -> None:
    report = sample_report()
    page = parse(render_html(report, PREFLIGHT))
    got = sorted((a.get("data-verdict"), (a.get("class") or "").split()[:2])
                 for a in page.matrix_cells)
    want = sorted((c["verdict"], ["mcell", f"v-{c['verdict']}"]) for c in report["cells"])
    assert got == want
    details = {a.get("id") for tag, a in page.attrs if tag == "details"}
    anchors = {a["href"][1:] for tag, a in page.attrs
               if tag == "a" and (a.get("href") or "").startswith("#")}
    assert len(anchors) == len(report["cells"]) and anchors <= details


def test_drift_class_is_shown_apart_from_the_verdict() -> None:
    report = sample_report()
    report["cells"][1].update(bitwise_mismatch_count=140, logprob_abs_diff_max=0.0201)
    report["cells"][2].update(active_token_count=0, mismatch_count=0)
    page = parse(render_html(report, PREFLIGHT))
    drift = {(a.get("data-verdict"), a.get("data-drift")) for a in page.matrix_cells}
    # attention R/R: valid + bitwise; P/R: 140 of 140 tokens differ; R/P: no tokens
    assert ("valid", "bitwise") in drift and ("fallback", "drifting") in drift
    assert ("contract_mismatch", "unknown") in drift
    # the bare record has no token counts: unknown, never bitwise
    assert [a.get("data-drift") for a in page.matrix_cells if a.get("data-verdict") == "valid"
            ] == ["bitwise", "unknown"]
    for a in page.matrix_cells:
        assert f"d-{a.get('data-drift')}" in (a.get("class") or "").split()
    visible = page.visible_text()
    assert "drifting, max|dlogp| 2.01e-02" in visible
    assert "unknown: no tokens" in visible
    # the legend names both scales
    assert "verdict (badge)" in visible and "drift class (cell colour and mark)" in visible
    for word in ("bitwise", "drifting", "unknown", "valid", "fallback", "error"):
        assert word in visible


def test_drift_class_fails_closed() -> None:
    assert drift_class({"active_token_count": 10, "mismatch_count": 0,
                        "bitwise_mismatch_count": 0, "logprob_abs_diff_max": 0.0})["cls"] \
        == "bitwise"
    # equal by value, different bits (e.g. -0.0 vs +0.0): not bitwise
    assert drift_class({"active_token_count": 10, "mismatch_count": 0,
                        "bitwise_mismatch_count": 2, "logprob_abs_diff_max": 0.0})["cls"] \
        == "drifting"
    assert drift_class({"active_token_count": 10, "mismatch_count": 0,
                        "nonfinite_count": 1})["cls"] == "drifting"
    assert drift_class({"active_token_count": 10})["cls"] == "unknown"
    assert drift_class({"active_token_count": None, "mismatch_count": 0})["cls"] == "unknown"
    assert drift_class({})["cls"] == "unknown"


def test_not_judged_reasons_are_visible_without_expanding() -> None:
    report = sample_report()
    report["cells"][0]["validity"]["numeric"] = {
        "valid": None, "reasons": [f"no contract: drift is reported, not judged {XSS}"]}
    page = parse(render_html(report, PREFLIGHT))
    visible = page.visible_text()
    assert f"no contract: drift is reported, not judged {XSS}" in visible  # escaped, then parsed
    assert "numeric not judged" in visible
    assert f"fallback recorded: {XSS}" in visible  # a non-valid cell's reason, too


def test_verdict_and_timings_are_separate_marks_counted_in_the_header() -> None:
    """A valid cell whose timings were refused: a green `valid` badge and its own `timings not
    usable` mark (no red "performance invalid" beside the badge), both counted in the header;
    the legend says the badge is the evidence verdict."""
    report = sample_report()
    refused = report["cells"][0]
    refused["performance_usable"] = False
    refused["validity"]["performance"] = {"valid": False, "reasons": ["noise: 2 measured steps"]}
    report["cells"][1]["performance_usable"] = False  # the fallback cell
    report["cells"][3]["performance_usable"] = True
    page = parse(render_html(report, PREFLIGHT))
    visible = page.visible_text()
    assert "timings (apart from the verdict): 1 usable 2 not usable" in visible, visible[:600]
    assert "every evidence judgement that applies passed" in visible
    text = render_html(report, PREFLIGHT)
    first = text[text.index('data-verdict="valid"'):]
    first = first[:first.index("</td>")]
    assert "timings not usable" in first and "performance invalid" not in first
    assert "noise: 2 measured steps" in visible  # the reason, below the matrix
    assert "timings not usable noise: 2 measured steps" in visible


def test_a_reason_is_listed_once_under_every_label_it_carries() -> None:
    """A fallback's reason is both the verdict's and the route judgement's: one row."""
    report = sample_report()
    cell = report["cells"][1]
    why = "attention rollout: run.log route line says actual=vllm.production.attention"
    cell["reasons"] = [why]
    cell["validity"]["route"] = {"valid": False, "reasons": [why]}
    visible = parse(render_html(report, PREFLIGHT)).visible_text()
    assert visible.count(why) == 1, visible
    assert f"not valid, route invalid {why}" in visible


def test_mismatch_kl_is_labelled_by_estimator() -> None:
    report = sample_report()
    report["cells"][1].update(mismatch_kl=2.067e-05, mismatch_k3_kl=1.408e-05)
    text = render_html(report, PREFLIGHT)
    assert ("mismatch KL, k3 = mean(exp(delta) - delta - 1) &gt;= 0, delta = train - rollout"
            in text)
    assert "mismatch KL, k1 = mean(rollout - train), sign not meaningful" in text
    assert "2.07e-05" in text and "1.41e-05" in text


def test_a_byte_only_mismatch_is_shown_beside_the_value_count() -> None:
    report = sample_report()
    report["cells"][0].update(mismatch_count=0, bitwise_mismatch_count=1, active_token_count=55)
    assert "0/55 (1 in bytes)" in render_html(report, PREFLIGHT)


def test_markup_lives_in_the_template() -> None:
    source = Path(html_module.__file__).read_text(encoding="utf-8")
    assert not re.search(r"<(span|td|tr|table|div|ul|li|svg|rect|details)\b", source)
    assert "autoescape=True" in source


def test_report_text_is_escaped() -> None:
    text = render_html(sample_report(), PREFLIGHT)
    assert XSS not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert parse(text).scripts == 1  # only the page's own inline script


def test_offline_and_relative_links() -> None:
    text = render_html(sample_report(), PREFLIGHT)
    page = parse(text)
    urls = [v for _, a in page.attrs for k, v in a.items() if k in ("src", "href") and v]
    assert not [u for u in urls if u.startswith(("http://", "https://", "//"))]
    assert not [tag for tag, _ in page.attrs if tag in ("link", "img", "iframe")]
    assert "@import" not in text and "url(" not in text
    logs = [u for u in urls if u.endswith("run.log")]
    assert "cpu/attention-pr/run.log" in logs and "cpu/attention-pr/matrix-case.env" in urls
    assert all(not u.startswith("/") and ".." not in u for u in urls)
    # An absolute artifact dir outside the root and `..` get no link; a scheme is quoted away.
    assert not [u for u in urls if "elsewhere" in u or "outside" in u]
    assert "javascript%3Aalert%281%29/run.log" in urls


def test_sections_present() -> None:
    text = render_html(sample_report(), PREFLIGHT)
    for needle in ("demo", "Attribution", "no conclusion", "P/R is fallback", "550.54.15",
                   "abc123", "NVIDIA H100 80GB HBM3", "2.13.0+cpu", 'class="hist"',
                   'class="phases"', "rl_kernel", "interaction"):
        assert needle in text, needle
    assert '<details class="panel" id="preflight">' in text


def test_renders_defensively() -> None:
    assert "no cells in this report" in render_html({})
    assert "<svg" not in render_html({"cells": [{"verdict": None}, "junk", {}]})
    nulls = {k: None for k in _cell("ffn", "R/R", "valid")}
    render_html({"cells": [nulls], "attribution": [None, {"effects": None}], "summary": None},
                {"gpu": None, "probe": None})


def test_write_html_is_atomic(tmp_path: Path) -> None:
    path = write_html(sample_report(), tmp_path / "sub" / HTML_FILE, PREFLIGHT)
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in path.parent.iterdir()) == [HTML_FILE]


def _run_fake(tmp: Path, probe: Path) -> Path:
    fake = Path(__file__).with_name("fake_framework.py")
    (tmp / "matrix.toml").write_text(
        '[matrix]\nname = "fake"\nmodules = ["attention", "ffn"]\n'
        f'[runner]\ncommand = ["{sys.executable}", "{fake}"]\n'
        'env = { FAKE_SCENARIO = "recorded_fallback", FAKE_ONLY_WHEN = "A-PR_F-RR_L-RR" }\n'
        '[hardware.cpu]\nbackend = "cpu"\n')
    root = tmp / "root"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                    "-k", "attention and (R/R or P/R)", f"--rlk-matrix-root={root}"],
                   cwd=tmp, check=True, capture_output=True, timeout=300,
                   env=dict(os.environ, RLK_REUSE_PROBE=str(probe)))
    return root


def test_write_html_outside_the_root_keeps_links_relative(tmp_path: Path) -> None:
    report = sample_report()
    report["matrix_root"] = str(tmp_path / "root")
    path = write_html(report, tmp_path / "elsewhere" / HTML_FILE)
    urls = [a.get("href") for _, a in parse(path.read_text()).attrs]
    assert "../root/cpu/attention-pr/run.log" in urls


@pytest.fixture(scope="module")
def real_root(tmp_path_factory: pytest.TempPathFactory, shared_probe: Path) -> Path:
    return _run_fake(tmp_path_factory.mktemp("fake"), shared_probe)


def test_real_report_renders(real_root: Path) -> None:
    report = json.loads((real_root / "matrix-report.json").read_text())
    pre = json.loads((real_root / "preflight.json").read_text())
    text = render_html(report, pre)
    page = parse(text)
    verdicts = sorted(str(a.get("data-verdict")) for a in page.matrix_cells if "data-verdict" in a)
    assert verdicts == ["fallback", "valid"]
    assert text.count("not selected") == 2  # R/P and P/P were deselected by -k
    urls = {a.get("href") for _, a in page.attrs}
    for cell in report["cells"]:
        assert f"{cell['artifact_dir']}/run.log" in urls
        assert (real_root / cell["artifact_dir"] / "run.log").is_file()
    assert "vllm attention backend lacks deterministic kernel" in text


def test_session_writes_html_next_to_json(real_root: Path) -> None:
    html = real_root / HTML_FILE
    assert html.is_file(), "the session writes matrix-report.html next to matrix-report.json"
    assert "fallback" in html.read_text(encoding="utf-8")


def _chromium(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp / 'profile'}", *args],
        capture_output=True, text=True, timeout=120, check=True)


@needs_chromium
def test_browser_renders_dom_and_opens_linked_cell(tmp_path: Path) -> None:
    report = sample_report()
    html = write_html(report, tmp_path / HTML_FILE, PREFLIGHT)
    out = _chromium("--dump-dom", f"{html.as_uri()}#cell-0-cpu-attention-r-r", tmp=tmp_path)
    page = parse(out.stdout)
    assert len(page.matrix_cells) == len(report["cells"])
    opened = [a.get("id") for tag, a in page.attrs if tag == "details" and "open" in a]
    assert "cell-0-cpu-attention-r-r" in opened  # the inline JS opened the linked cell
    assert XSS not in out.stdout


@needs_chromium
def test_screenshot_script(tmp_path: Path) -> None:
    html = write_html(sample_report(), tmp_path / HTML_FILE, PREFLIGHT)
    png = tmp_path / "shot.png"
    subprocess.run([sys.executable, str(SCRIPT), str(html), str(png)], check=True,
                   capture_output=True, timeout=180)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_template_bytecode_cache_gives_the_same_page(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled template comes from jinja2's per-user bytecode cache after the first render
    (one file, mode 0600 in a 0700 directory); the page is the same either way, and with no
    usable cache directory (the temp dir is a file) the page is rendered all the same."""
    import tempfile

    report = sample_report()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = render_html(report, PREFLIGHT)
    cache = tmp_path / f"_jinja2-cache-{os.getuid()}"
    files = list(cache.iterdir())
    assert len(files) == 1 and files[0].suffix == ".cache"
    assert cache.stat().st_mode & 0o777 == 0o700
    assert render_html(report, PREFLIGHT) == first  # loaded from the cache
    files[0].write_bytes(b"not bytecode")  # a damaged cache file: compiled again
    assert render_html(report, PREFLIGHT) == first
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(blocked))
    assert html_module._bytecode_cache() is None
    assert render_html(report, PREFLIGHT) == first


# A script appended to a copy of the page: it measures the layout as the browser laid it out and
# writes the figures into the DOM, which --dump-dom then returns.
MEASURE = """<script>(function(){var v=window.innerWidth;
var heads=[].slice.call(document.querySelectorAll('table.matrix tr:first-child th'));
var cells=[].slice.call(document.querySelectorAll('table.matrix td.mcell'));
var out={viewport:v,page:document.documentElement.scrollWidth,
cols:heads.map(function(h){return [h.textContent,h.getBoundingClientRect().right];}),
cells:Math.max.apply(null,cells.map(function(c){return c.getBoundingClientRect().right;})),
legend:document.getElementById('legend').textContent};
var pre=document.createElement('pre');pre.id='rlk-measure';pre.textContent=JSON.stringify(out);
document.body.appendChild(pre);})();</script>"""


def _layout(html: Path, width: int, tmp: Path) -> dict[str, Any]:
    probe = tmp / f"measure-{width}.html"
    probe.write_text(html.read_text(encoding="utf-8").replace("</body>", MEASURE + "</body>"),
                     encoding="utf-8")
    out = _chromium(f"--window-size={width},1000", "--hide-scrollbars", "--dump-dom",
                    probe.as_uri(), tmp=tmp).stdout
    text = out.split('<pre id="rlk-measure">', 1)[1].split("</pre>", 1)[0]
    import html as html_lib

    return json.loads(html_lib.unescape(text))


def _wide_report() -> dict[str, Any]:
    """The twelve cells of a pairwise run with the longest marks a cell shows: drift figures,
    timings refused, judgements not passed, a shared run and a failed item."""
    cells = []
    for module in ("attention", "ffn", "logp"):
        for case in ("R/R", "P/R", "R/P", "P/P"):
            extra: dict[str, Any] = {"performance_usable": case != "P/P",
                                     "logprob_abs_diff_max": 0.0 if case == "R/R" else 2.05e-2,
                                     "mismatch_count": 0 if case == "R/R" else 1858,
                                     "active_token_count": 1858}
            if case == "R/R":
                extra["shared_with"] = ["ffn R/R", "logp R/R"]
            if case == "P/P":
                extra["validity"] = {"performance": {"valid": False, "reasons": ["noise"]},
                                     "numeric": {"valid": None, "reasons": ["no contract"]}}
            cells.append(_cell(module, case, "contract_mismatch" if case == "R/P" else "valid",
                               failed=case == "R/P", **extra))
    report = sample_report()
    report.update(cells=cells, expected_cells=12, summary={"valid": 9, "contract_mismatch": 3})
    report["matrix"]["modules"] = ["attention", "ffn", "logp"]
    return report


@needs_chromium
@pytest.mark.parametrize("width", [900, 1400, 1920])
def test_matrix_fits_the_window_at_every_width(tmp_path: Path, width: int) -> None:
    """At 900, 1400 and 1920 px the whole matrix, P/P column included, lies inside the window
    (no horizontal overflow of the page), and the legend names every mark a cell shows."""
    html = write_html(_wide_report(), tmp_path / HTML_FILE, PREFLIGHT)
    m = _layout(html, width, tmp_path)
    assert m["viewport"] == width
    assert [c[0] for c in m["cols"]][-4:] == ["R/R", "P/R", "R/P", "P/P"]
    assert m["cols"][-1][1] <= width, m  # the P/P column's right edge is on screen
    assert m["cells"] <= width, m
    assert m["page"] <= width, m  # nothing else widens the page past the window
    for mark in ("shared", "FAILED", "timings usable", "timings not usable"):
        assert mark in m["legend"], mark
