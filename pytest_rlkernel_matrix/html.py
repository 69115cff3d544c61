"""`matrix-report.html`: one self-contained, browsable page for a `matrix-report.json`.

No network: inline CSS, a few lines of inline JS and inline SVG charts. Every string taken from
the report (reasons, log lines, readbacks, names) goes through `html.escape`; links to artifacts
are relative to the matrix root, where the page is written next to `matrix-report.json`.
Every field may be missing or null: the page renders whatever is there.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

__all__ = ["HTML_FILE", "render_html", "write_html"]

HTML_FILE = "matrix-report.html"
PAIRWISE = ("R/R", "P/R", "R/P", "P/P")
MODULE_ORDER = ("attention", "ffn", "logp")
VERDICT_ORDER = ("valid", "fallback", "unsupported", "contract_mismatch", "incomparable",
                 "error", "not_run")
SIDES = ("training", "rollout")
IMPL_LETTER = {"production": "P", "rl_kernel": "R"}
PHASES = (("rollout", "rollout_wall_time"), ("training", "training_wall_time"),
          ("weight sync", "weight_sync_wall_time"), ("step", "step_wall_time"))
DRIFT_FIELDS = ("logprob_abs_diff_mean", "logprob_abs_diff_p50", "logprob_abs_diff_p90",
                "logprob_abs_diff_p99", "logprob_abs_diff_max")
MAX_ROWS = 50
OPEN_CELLS = 3  # the first few cells that are not valid start expanded

CSS = """
:root{--fg:#1f2328;--mute:#656d76;--line:#d0d7de;--bg:#fff;--soft:#f6f8fa}
*{box-sizing:border-box}
body{font:13px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
color:var(--fg);background:var(--bg);margin:0;padding:16px 24px;max-width:1500px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 8px;
border-bottom:1px solid var(--line);padding-bottom:4px}h3{font-size:13px;margin:12px 0 4px}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.meta{color:var(--mute)}.meta b{color:var(--fg);font-weight:600}
table{border-collapse:collapse;margin:4px 0 8px}
th,td{border:1px solid var(--line);padding:3px 7px;text-align:left;vertical-align:top}
th{background:var(--soft);font-weight:600}
.num{font-variant-numeric:tabular-nums}
.badge{display:inline-block;border-radius:10px;padding:1px 8px;margin:2px 4px 2px 0;
border:1px solid rgba(0,0,0,.12);font-weight:600;white-space:nowrap}
.v-valid{background:#d3f5dc}.v-fallback{background:#ffe7a8}.v-unsupported{background:#e3e5e8}
.v-contract_mismatch{background:#ffd2cc}.v-incomparable{background:#ffb3a8}
.v-error{background:#f5877a}.v-not_run{background:#f6f8fa;color:var(--mute)}
.v-other{background:#e8defa}.v-none{background:#fff;color:var(--mute)}
table.matrix td.mcell{padding:0;min-width:150px}
table.matrix td.mcell a{display:block;padding:5px 8px;color:inherit;text-decoration:none}
table.matrix td.mcell a:hover{outline:2px solid #0969da;outline-offset:-2px}
.mcell .word{font-weight:700}.mcell .small{font-size:11.5px;color:#3b4148}
.tag{font-size:10.5px;font-weight:700;border-radius:3px;padding:0 4px;margin-left:4px;
background:#1f2328;color:#fff}
details.cell{border:1px solid var(--line);border-radius:6px;margin:8px 0;padding:0 10px}
details.cell>summary{cursor:pointer;padding:6px 0;font-weight:600}
details.cell[open]>summary{border-bottom:1px solid var(--line);margin-bottom:6px}
details.panel{border:1px solid var(--line);border-radius:6px;padding:0 10px;margin:8px 0}
details.panel>summary{cursor:pointer;padding:6px 0;font-weight:600}
.grid{display:flex;flex-wrap:wrap;gap:8px 28px;align-items:flex-start}
.bad{background:#ffebe9}.ok{color:#1a7f37}.no{color:#cf222e}.na{color:var(--mute)}
ul{margin:4px 0 8px;padding-left:20px}.refused{color:#9a6700}
svg text{font:10.5px system-ui,sans-serif;fill:#3b4148}
svg .bar{fill:#6e9bd1}svg .bar0{fill:#8c959f}svg .axis{stroke:#8c959f}
.links a{margin-right:12px}.toolbar button{font:inherit;margin-right:6px}
.empty{color:var(--mute);font-style:italic}
"""

JS = """
function rlkOpen(){var h=decodeURIComponent(location.hash.slice(1));if(!h)return;
var el=document.getElementById(h);if(el&&el.tagName==='DETAILS'){el.open=true;}}
function rlkAll(open){document.querySelectorAll('details.cell').forEach(function(d){
d.open=open;});}
window.addEventListener('hashchange',rlkOpen);document.addEventListener('DOMContentLoaded',rlkOpen);
"""


# -- small helpers ---------------------------------------------------------------------------------


def _e(value: Any) -> str:
    """Escape any value for HTML text or a quoted attribute."""
    return escape("" if value is None else str(value), quote=True)


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return list(value)
    return [] if value is None else [value]


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _fmt_d(value: Any) -> str:
    v = _num(value)
    if v is None:
        return "-" if value is None else str(value)
    return "0" if v == 0 else f"{v:.2e}"


def _fmt_s(value: Any) -> str:
    v = _num(value)
    return "-" if v is None else f"{v:.2f}s"


def _fmt_bytes(value: Any) -> str:
    v = _num(value)
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.2f} {unit}"
        v /= 1024
    return "-"


def _fmt(value: Any) -> str:
    """Plain text for any JSON value (not yet escaped)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(_fmt(v) for v in value) if value else "-"
    if isinstance(value, Mapping):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def _verdict_class(verdict: Any) -> str:
    if verdict is None:
        return "v-none"
    return f"v-{verdict}" if verdict in VERDICT_ORDER else "v-other"


def _badge(verdict: Any) -> str:
    return f'<span class="badge {_verdict_class(verdict)}">{_e(verdict or "none")}</span>'


def _judged(valid: Any) -> str:
    if valid is True:
        return '<span class="ok">valid</span>'
    if valid is False:
        return '<span class="no">invalid</span>'
    return '<span class="na">not judged</span>'


def _table(head: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    """`head` is plain text; `rows` hold already-escaped HTML cells."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        return '<p class="empty">none</p>'
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    return f'<table class="{cls}"><tr>{th}</tr>{body}</table>'


def _kv(pairs: Iterable[tuple[str, Any]]) -> str:
    rows = [(f"<b>{_e(k)}</b>", _e(_fmt(v))) for k, v in pairs]
    return _table(("field", "value"), rows, "kv")


def _records_table(items: Sequence[Any], first: Sequence[str] = ()) -> str:
    """A table over a list of dicts: `first` columns, then the rest in order of appearance."""
    dicts = [i for i in items if isinstance(i, Mapping)][:MAX_ROWS]
    cols = [c for c in first if any(c in d for d in dicts)]
    for d in dicts:
        cols += [str(k) for k in d if str(k) not in cols]
    rows = []
    for d in dicts:
        rows.append([_e(_fmt_d(d.get(c)) if "diff" in c else _fmt(d.get(c))) for c in cols])
    more = len([i for i in items if isinstance(i, Mapping)]) - len(dicts)
    note = f'<p class="empty">{more} more not shown</p>' if more > 0 else ""
    return _table(cols, rows) + note


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def _cell_ids(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for i, c in enumerate(cells):
        label = "-".join(str(c.get(k)) for k in ("hardware", "module", "case"))
        out.append(f"cell-{i}-{_slug(label)}")
    return out


def _rel_link(root: Any, artifact_dir: Any, name: str = "", prefix: str = "") -> str | None:
    """A relative, percent-quoted href under the matrix root, or None when unsafe/unknown.

    `prefix` is the matrix root relative to the page (empty: the page sits in the root)."""
    if not isinstance(artifact_dir, str) or not artifact_dir.strip():
        return None
    path = PurePosixPath(artifact_dir.replace("\\", "/"))
    if path.is_absolute():
        try:
            path = path.relative_to(PurePosixPath(str(root)))
        except ValueError:
            return None
    if ".." in path.parts or not path.parts:
        return None
    target = "/".join(path.parts) + ("/" + name if name else "/")
    return quote(prefix.rstrip("/") + "/" + target if prefix else target, safe="/")


# -- charts ----------------------------------------------------------------------------------------


def _pow10(x: Any) -> str:
    v = _num(x)
    return "?" if v is None else f"{10 ** v:.0e}"


def histogram_svg(hist: Mapping[str, Any]) -> str:
    """SVG bars of the log10 |dlogp| histogram (plus a grey bar for bitwise-equal tokens)."""
    counts = [int(_num(c) or 0) for c in _list(hist.get("counts"))]
    edges = [_num(x) for x in _list(hist.get("log10_abs_diff_edges"))]
    zero = int(_num(hist.get("zero")) or 0)
    if not counts and not zero:
        return '<p class="empty">no dlogp histogram</p>'
    bars: list[tuple[str, int, bool]] = []
    if zero or "zero" in hist:
        bars.append(("|dlogp| = 0", zero, True))
    for i, n in enumerate(counts):
        lo = edges[i] if i < len(edges) else None
        hi = edges[i + 1] if i + 1 < len(edges) else None
        bars.append((f"[{_pow10(lo)}, {_pow10(hi)})", n, False))
    w, h, left, bottom, top = 440, 150, 36, 30, 8
    right = 10
    peak = max((n for _, n, _ in bars), default=0) or 1
    step = (w - left - right) / len(bars)
    parts = [f'<svg class="hist" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
             f'aria-label="dlogp histogram">']
    base = h - bottom
    for i, (label, n, is_zero) in enumerate(bars):
        bh = (base - top) * n / peak
        x = left + i * step
        cls = "bar0" if is_zero else "bar"
        parts.append(f'<rect class="{cls}" x="{x + 1:.1f}" y="{base - bh:.1f}" '
                     f'width="{max(step - 2, 1):.1f}" height="{bh:.1f}">'
                     f"<title>{_e(label)}: {n}</title></rect>")
    parts.append(f'<line class="axis" x1="{left}" y1="{base}" x2="{w - right}" y2="{base}"/>')
    parts.append(f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{peak}</text>')
    parts.append(f'<text x="{left - 4}" y="{base}" text-anchor="end">0</text>')
    first = 1 if bars and bars[0][2] else 0
    if bars[0][2]:
        parts.append(f'<text x="{left + step / 2:.1f}" y="{base + 12}" '
                     'text-anchor="middle">0</text>')
    if len(edges) >= 2 and counts:
        for j in sorted({0, len(counts) // 2, len(counts)}):
            x = left + (first + j) * step
            anchor = "start" if j == 0 else "end" if j == len(counts) else "middle"
            parts.append(f'<text x="{x:.1f}" y="{base + 12}" text-anchor="{anchor}">'
                         f"{_e(_pow10(edges[j] if j < len(edges) else None))}</text>")
    parts.append(f'<text x="{(left + w) / 2:.0f}" y="{h - 3}" text-anchor="middle">'
                 "|dlogp| (log scale), active tokens</text></svg>")
    return "".join(parts)


def phases_svg(record: Mapping[str, Any]) -> str:
    """Horizontal SVG bars of the phase wall times (rollout, training, weight sync, step): the
    bar is the median over measured steps, the whisker spans min to max, `n` is the step count."""
    spread = _map(record.get("phase_spread"))
    values = [(label, _num(record.get(key)), _map(spread.get(key))) for label, key in PHASES]
    if all(v is None for _, v, _ in values):
        return '<p class="empty">no phase times</p>'
    w, row, left, right = 440, 22, 82, 112
    tops = [v for _, v, _ in values if v is not None]
    tops += [m for _, _, s in values if (m := _num(s.get("max"))) is not None]
    peak = max(tops, default=0.0) or 1.0
    scale = (w - left - right) / peak
    h = row * len(values) + 6
    parts = [f'<svg class="phases" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
             'aria-label="phase wall times: median bar, min-max whisker, n steps">']
    for i, (label, v, s) in enumerate(values):
        y = 3 + i * row
        parts.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{_e(label)}</text>')
        if v is None:
            parts.append(f'<text x="{left}" y="{y + 14}">-</text>')
            continue
        bw = max(scale * max(v, 0.0), 1.0)
        cls = "bar0" if label == "step" else "bar"
        lo, hi, n = _num(s.get("min")), _num(s.get("max")), s.get("n")
        tip = f"{label}: median {_fmt_s(v)}"
        if lo is not None and hi is not None:
            tip += f", min {_fmt_s(lo)}, max {_fmt_s(hi)}, n={n} steps"
        parts.append(f'<rect class="{cls}" x="{left}" y="{y + 3}" width="{bw:.1f}" '
                     f'height="{row - 7}"><title>{_e(tip)}</title></rect>')
        end = left + bw
        if lo is not None and hi is not None:
            x0, x1, mid = left + scale * max(lo, 0.0), left + scale * max(hi, 0.0), y + 3 + (
                row - 7) / 2
            end = max(end, x1)
            parts.append(f'<g class="whisker"><line class="axis" x1="{x0:.1f}" y1="{mid:.1f}" '
                         f'x2="{x1:.1f}" y2="{mid:.1f}"/>'
                         f'<line class="axis" x1="{x0:.1f}" y1="{y + 5}" x2="{x0:.1f}" '
                         f'y2="{y + row - 6}"/><line class="axis" x1="{x1:.1f}" y1="{y + 5}" '
                         f'x2="{x1:.1f}" y2="{y + row - 6}"/></g>')
        shown = _fmt_s(v) + (f" n={n}" if isinstance(n, int) else "")
        parts.append(f'<text x="{end + 4:.1f}" y="{y + 14}">{_e(shown)}</text>')
    parts.append("</svg>")
    return "".join(parts)


# -- sections --------------------------------------------------------------------------------------


def _ordered(preferred: Iterable[Any], seen: Iterable[Any]) -> list[str]:
    seen_list = [str(s) for s in seen]
    out = [p for p in dict.fromkeys(str(p) for p in preferred) if p in seen_list]
    return out + [s for s in dict.fromkeys(seen_list) if s not in out]


def _header(report: Mapping[str, Any], cells: Sequence[Mapping[str, Any]]) -> str:
    matrix = _map(report.get("matrix"))
    name = matrix.get("name") or "matrix"
    if report.get("interrupted"):
        state = '<span class="badge v-error">interrupted</span>'
    elif report.get("complete"):
        state = '<span class="badge v-valid">complete</span>'
    else:
        state = '<span class="badge v-fallback">incomplete</span>'
    summary = _map(report.get("summary"))
    if not summary:
        counts: dict[str, int] = {}
        for c in cells:
            counts[str(c.get("verdict"))] = counts.get(str(c.get("verdict")), 0) + 1
        summary = counts
    order = _ordered(VERDICT_ORDER, summary)
    badges = "".join(f'<span class="badge {_verdict_class(v)}">{_e(summary[v])} {_e(v)}</span>'
                     for v in order)
    meta = [("mode", matrix.get("mode")), ("layout", matrix.get("layout")),
            ("created", report.get("created")),
            ("hardware", _fmt(matrix.get("hardware"))), ("modules", _fmt(matrix.get("modules"))),
            ("cells", f"{len(cells)} of {_fmt(report.get('expected_cells'))}"),
            ("matrix file", matrix.get("file")), ("matrix root", report.get("matrix_root")),
            ("schema", report.get("schema_version"))]
    line = " &middot; ".join(f"{_e(k)} <b>{_e(_fmt(v))}</b>" for k, v in meta if v is not None)
    return (f"<header><h1>RL-Kernel ablation matrix: {_e(name)} {state}</h1>"
            f'<div class="meta">{line}</div><div class="summary">{badges}</div></header>')


def _matrix_view(report: Mapping[str, Any], cells: Sequence[Mapping[str, Any]],
                 ids: Sequence[str]) -> str:
    matrix = _map(report.get("matrix"))
    if not cells:
        return '<h2>Matrix</h2><p class="empty">no cells in this report</p>'
    by_key: dict[tuple[str, str, str], list[int]] = {}
    for i, c in enumerate(cells):
        key = (str(c.get("hardware")), str(c.get("module")), str(c.get("case")))
        by_key.setdefault(key, []).append(i)
    hardware = _ordered(_list(matrix.get("hardware")), (k[0] for k in by_key))
    modules = _ordered(list(MODULE_ORDER) + _list(matrix.get("modules")), (k[1] for k in by_key))
    present = [k[2] for k in by_key]
    if all(c in PAIRWISE for c in present):
        cases = list(PAIRWISE)
    else:
        cases = _ordered(_list(matrix.get("cases")), present)
    head = "".join(f"<th>{_e(c)}</th>" for c in cases)
    rows = []
    for hw in hardware:
        for module in modules:
            if not any(k[0] == hw and k[1] == module for k in by_key):
                continue
            tds = []
            for case in cases:
                idx = by_key.get((hw, module, case), [])
                if not idx:
                    tds.append('<td class="mcell v-none"><a><span class="small">not selected'
                               "</span></a></td>")
                    continue
                tds.append("".join(_matrix_cell(cells[i], ids[i]) for i in idx))
            rows.append(f"<tr><th>{_e(hw)}</th><th>{_e(module)}</th>{''.join(tds)}</tr>")
    return ('<h2>Matrix</h2><p class="meta">training/rollout per column (P = production, '
            "R = RL-Kernel); other modules stay at the fixed case. Click a cell for its "
            f'evidence.</p><table class="matrix"><tr><th>hardware</th><th>module</th>{head}</tr>'
            f"{''.join(rows)}</table>")


def _matrix_cell(c: Mapping[str, Any], anchor: str) -> str:
    verdict = c.get("verdict")
    tags = ""
    if c.get("failed"):
        tags += '<span class="tag">FAILED</span>'
    if c.get("shared_with"):
        tags += '<span class="tag" title="shares its run with other cells">shared</span>'
    active = c.get("active_token_count")
    mism = "-" if active is None else f"{_fmt(c.get('mismatch_count'))}/{_fmt(active)}"
    return (f'<td class="mcell {_verdict_class(verdict)}" data-verdict="{_e(verdict)}">'
            f'<a href="#{anchor}"><span class="word">{_e(verdict or "none")}</span>{tags}<br>'
            f'<span class="small">max|dlogp| {_e(_fmt_d(c.get("logprob_abs_diff_max")))}<br>'
            f"mismatch {_e(mism)} &middot; step {_e(_fmt_s(c.get('step_wall_time')))}"
            "</span></a></td>")


def _attribution(report: Mapping[str, Any]) -> str:
    entries = [e for e in _list(report.get("attribution")) if isinstance(e, Mapping)]
    if not entries:
        return '<h2>Attribution</h2><p class="empty">no attribution in this report</p>'
    out = ["<h2>Attribution</h2>"]
    summary_rows = []
    details = []
    for e in entries:
        refused = "".join(f"<li>{_e(r)}</li>" for r in _list(e.get("refused")))
        summary_rows.append([_e(e.get("hardware")), _e(e.get("module")),
                             _e(e.get("conclusion") or "-"),
                             f'<ul class="refused">{refused}</ul>' if refused else "-"])
        effects = _map(e.get("effects"))
        if effects:
            details.append(f"<h3>{_e(e.get('hardware'))} &middot; {_e(e.get('module'))}</h3>"
                           f'<div class="grid">{_effects_table("drift", effects.get("drift"))}'
                           f"{_effects_table('time', effects.get('time'))}</div>")
    out.append(_table(("hardware", "module", "conclusion", "refused"), summary_rows))
    if details:
        out.append('<details class="panel"><summary>effects (training = P/R - R/R, rollout = '
                   "R/P - R/R, interaction = P/P - P/R - R/P + R/R)</summary>"
                   f"{''.join(details)}</details>")
    return "".join(out)


def _effects_table(kind: str, data: Any) -> str:
    rows = []
    data = _map(data)
    with_noise = any("noise" in _map(v) for v in data.values())
    for name, eff in data.items():
        eff = _map(eff)
        name = str(name)
        fmt = _fmt_s if kind == "time" else _fmt_d if "logprob" in name else _fmt
        label = name.replace("logprob_abs_diff_", "|dlogp| ").removesuffix("_wall_time")
        row = [f'<b title="{_e(name)}">{_e(label.replace("_", " "))}</b>']
        row += [f'<span class="num">{_e(fmt(eff.get(c)))}</span>' for c in PAIRWISE]
        row += [f'<span class="num">{_e(fmt(eff.get(k)))}</span>'
                for k in ("training", "rollout", "interaction")]
        if with_noise:
            row.append(_e(_fmt(eff.get("noise"))))
        rows.append(row)
    head = [kind, *PAIRWISE, "training", "rollout", "interaction"]
    return _table(head + (["noise"] if with_noise else []), rows)


def _routes(c: Mapping[str, Any]) -> str:
    rows = []
    for module, entry in _map(c.get("routes")).items():
        entry = _map(entry)
        requested = str(entry.get("requested") or "")
        letters = requested.split("/") if "/" in requested else ["", ""]
        for k, side in enumerate(SIDES):
            r = entry.get(side)
            want = letters[k] if k < len(letters) else ""
            if not isinstance(r, Mapping):
                rows.append((f"<b>{_e(module)}</b>", _e(requested), _e(side),
                             '<span class="no">unreported</span>', "-", "-", "-", "-", "-"))
                continue
            impl = r.get("implementation")
            got = IMPL_LETTER.get(str(impl), "?")
            mismatch = (bool(want) and got != want) or bool(r.get("fallback"))
            impl_html = _e(impl) if not mismatch else f'<span class="no">{_e(impl)}</span>'
            rows.append((f"<b>{_e(module)}</b>", _e(requested), _e(side),
                         impl_html + f" ({_e(got)} vs {_e(want or '?')})",
                         f'<span class="mono">{_e(_fmt(r.get("backend_ids")))}</span>',
                         _e(_fmt(r.get("call_count"))), _e(_fmt(r.get("fallback"))),
                         _e(_fmt(r.get("contract"))),
                         _e(_fmt(_list(r.get("runtime_platforms"))
                                 + _list(r.get("execution_modes"))))))
    if not rows:
        return ('<p class="empty">no route table; actual training '
                f"{_e(c.get('actual_training_implementation') or '-')}, rollout "
                f"{_e(c.get('actual_rollout_implementation') or '-')}</p>")
    head = ("module", "requested", "side", "actual (got vs wanted)", "backend ids", "calls",
            "fallback", "contract", "platform / mode")
    return _table(head, rows, "routes")


def _fallbacks(c: Mapping[str, Any]) -> str:
    items = []
    for f in _list(c.get("fallbacks")):
        if isinstance(f, Mapping):
            if "line" in f:
                text = f"{f.get('source') or 'log'}: {f.get('line')}"
            else:
                where = " ".join(str(f[k]) for k in ("module", "side") if f.get(k))
                text = f"{where}: {f.get('reason') or _fmt(f)} ({f.get('source') or '?'})"
        else:
            text = _fmt(f)
        items.append(f'<li class="mono">{_e(text)}</li>')
    return f"<ul>{''.join(items)}</ul>" if items else '<p class="empty">none</p>'


def _validity(c: Mapping[str, Any]) -> str:
    validity = _map(c.get("validity"))
    rows = []
    for name in _ordered(("route", "semantic", "numeric", "performance"), validity):
        j = _map(validity.get(name))
        reasons = "".join(f"<li>{_e(r)}</li>" for r in _list(j.get("reasons")))
        rows.append((f"<b>{_e(name)}</b>", _judged(j.get("valid")),
                     f"<ul>{reasons}</ul>" if reasons else "-"))
    return _table(("judgement", "result", "reasons"), rows)


def _links(root: Any, c: Mapping[str, Any], prefix: str) -> str:
    links = []
    for label, name in (("run.log", "run.log"), ("matrix-case.env", "matrix-case.env"),
                        ("artifact dir", "")):
        href = _rel_link(root, c.get("artifact_dir"), name, prefix)
        if href is not None:
            links.append(f'<a href="{_e(href)}">{_e(label)}</a>')
    if not links:
        where = _e(_fmt(c.get("artifact_dir")))
        return f'<p class="empty">no artifact links (artifact_dir {where})</p>'
    return f'<p class="links">{"".join(links)}<code>{_e(c.get("artifact_dir"))}</code></p>'


def _label_lines(title: str, data: Any) -> str:
    data = _map(data)
    if not data:
        return ""
    rows = [(f"<b>{_e(k)}</b>", f'<span class="mono">{_e(_fmt(v))}</span>')
            for k, v in data.items()]
    return f"<h3>{_e(title)}</h3>" + _table(("label", "line"), rows)


def _cell_detail(report: Mapping[str, Any], c: Mapping[str, Any], anchor: str,
                 is_open: bool = False, prefix: str = "") -> str:
    root = report.get("matrix_root")
    verdict = c.get("verdict")
    title = f"{c.get('hardware')} · {c.get('module')} · {c.get('case')}"
    failed = ' <span class="tag">FAILED</span>' if c.get("failed") else ""
    reasons = "".join(f"<li>{_e(r)}</li>" for r in _list(c.get("reasons")))
    active = c.get("active_token_count")
    facts = [
        ("requested case", c.get("requested_case")), ("effective cases", c.get("cases")),
        ("mode", c.get("mode")), ("run id", c.get("run_id")),
        ("exit code", c.get("exit_code")), ("timed out", c.get("timed_out")),
        ("shared with", c.get("shared_with")), ("contract id", c.get("contract_id")),
        ("contract", c.get("contract")), ("build fingerprint", c.get("build_fingerprint")),
        ("hardware fingerprint", c.get("hardware_fingerprint")),
        ("unsupported class", c.get("unsupported_class")),
        ("expected gap", c.get("expected_gap")), ("fault drill", c.get("fault_drill")),
        ("performance usable", c.get("performance_usable")),
    ]
    metrics = [
        ("active tokens", active), ("mismatch count", c.get("mismatch_count")),
        ("mismatch fraction", c.get("mismatch_fraction")),
        *((f"|dlogp| {f.removeprefix('logprob_abs_diff_')}", _fmt_d(c.get(f)))
          for f in DRIFT_FIELDS),
        ("mismatch KL", c.get("mismatch_kl")), ("nonfinite", c.get("nonfinite_count")),
        ("samples / ranks", f"{_fmt(c.get('sample_count'))} / {_fmt(c.get('rank_count'))}"),
        ("logprob source", c.get("logprob_source")),
        ("tokens/s", c.get("tokens_per_second")), ("peak memory", _fmt_bytes(c.get("peak_memory"))),
        ("process wall time", _fmt_s(c.get("process_wall_time"))),
    ]
    facts = [(k, v) for k, v in facts if v not in (None, [], {}, "")]
    metrics = [(k, v) for k, v in metrics if v not in (None, "-", "- / -")]
    worst = _list(c.get("worst_tokens"))
    first = _list(c.get("first_mismatch"))
    return "".join((
        f'<details class="cell" id="{anchor}"{" open" if is_open else ""}>',
        f"<summary>{_badge(verdict)} {_e(title)}{failed}</summary>",
        _links(root, c, prefix),
        f"<h3>reasons</h3><ul>{reasons}</ul>" if reasons else "",
        "<h3>validity</h3>", _validity(c),
        "<h3>routes: requested vs actual</h3>", _routes(c),
        "<h3>fallbacks</h3>", _fallbacks(c),
        '<div class="grid"><div><h3>run, contract, fingerprints</h3>', _kv(facts), "</div>",
        "<div><h3>drift</h3>", _kv(metrics), "</div></div>",
        '<div class="grid"><div><h3>|dlogp| histogram</h3>',
        histogram_svg(_map(c.get("dlogp_histogram"))), "</div>",
        "<div><h3>phase wall times</h3>", phases_svg(c), "</div></div>",
        "<h3>worst tokens</h3>" if worst else "",
        _records_table(worst, ("sample", "rank", "position", "token_id", "train_logprob",
                               "rollout_logprob", "abs_diff")) if worst else "",
        "<h3>first mismatch per sample</h3>" if first else "",
        _records_table(first, ("sample", "rank", "position")) if first else "",
        _label_lines("log errors", c.get("log_errors")),
        _label_lines("contamination", c.get("contamination")),
        "</details>",
    ))


def _preflight(report: Mapping[str, Any], pre: Mapping[str, Any] | None) -> str:
    summary = _map(report.get("preflight"))
    head = ('<details class="panel" id="preflight"><summary>Preflight '
            f"({_e(summary.get('file') or 'preflight.json')})</summary>")
    fps = [("report hardware fingerprint", summary.get("hardware_fingerprint")),
           ("report build fingerprint", summary.get("build_fingerprint"))]
    if not pre:
        return head + _kv(fps) + '<p class="empty">preflight.json not included</p></details>'
    probe = _map(pre.get("probe"))
    torch = _map(probe.get("torch"))
    gpu = _map(pre.get("gpu"))
    nvidia = _map(pre.get("nvidia"))
    rocm = _map(pre.get("rocm"))
    rl = _map(probe.get("rl_engine"))
    py = _map(pre.get("python"))
    own = _map(pre.get("fingerprints"))
    facts = [
        ("created", pre.get("created")), ("python", py.get("version")),
        ("python executable", py.get("executable") or py.get("requested")),
        ("torch", torch.get("version")), ("torch build", torch.get("build")),
        ("torch cuda / hip", f"{_fmt(torch.get('cuda'))} / {_fmt(torch.get('hip'))}"),
        ("torch devices", torch.get("device_count")),
        ("backend", gpu.get("backend")), ("GPU source", gpu.get("source")),
        ("GPU count", gpu.get("count")), ("GPU names", gpu.get("names")),
        ("visible devices", gpu.get("visible")),
        ("driver", nvidia.get("driver") or rocm.get("driver")),
        ("ROCm gfx archs", rocm.get("runtime_gfx_archs")),
        ("rl_engine", rl or None),
        ("topology", pre.get("topology")), ("topology check", pre.get("topology_check")),
        ("checkpoint", _map(pre.get("checkpoint")).get("sha256")),
        ("tokenizer", _map(pre.get("tokenizer")).get("sha256")),
        ("hardware fingerprint", own.get("hardware")), ("build fingerprint", own.get("build")),
        *fps,
    ]
    repos = []
    for name, r in _map(pre.get("repos")).items():
        r = _map(r)
        repos.append((_e(name), _e(r.get("root") or r.get("env")),
                      f'<span class="mono">{_e(_fmt(r.get("commit")))}</span>',
                      _e(_fmt(r.get("dirty"))), _e(r.get("status") or
                                                   ("not configured" if not r.get("configured")
                                                    else "-"))))
    pkgs = [(_e(n), _e(_fmt(_map(p).get("version"))), _e(_fmt(_map(p).get("module_found"))))
            for n, p in _map(probe.get("packages")).items()]
    cmds = [(_e(n), _e(_map(c).get("status")), _e(_fmt(_map(c).get("returncode"))))
            for n, c in _map(pre.get("commands")).items()]
    env = _map(pre.get("env"))
    caps_report = _map(pre.get("capabilities"))
    caps = [(_e(k), _e(_map(c).get("status")), _e(_map(c).get("unsupported_class") or ""),
             _e(_map(c).get("check")), _e(_map(c).get("reason")))
            for k, c in _map(caps_report.get("capabilities")).items()]
    return "".join((
        head, _kv((k, v) for k, v in facts if v is not None),
        f"<h3>capabilities (R provider: {_e(caps_report.get('r_provider'))})</h3>"
        if caps else "",
        _table(("capability", "status", "class", "check", "reason"), caps) if caps else "",
        "<h3>repositories</h3>", _table(("repo", "root", "commit", "dirty", "status"), repos),
        "<h3>packages</h3>", _table(("package", "version", "found"), pkgs),
        "<h3>commands</h3>", _table(("command", "status", "exit"), cmds),
        "<h3>environment</h3>" if env else "", _kv(env.items()) if env else "",
        "</details>",
    ))


# -- entry points ----------------------------------------------------------------------------------


def render_html(report: Mapping[str, Any], preflight: Mapping[str, Any] | None = None, *,
                link_prefix: str = "") -> str:
    """The whole report page as one self-contained HTML string.

    Artifact links are relative: `link_prefix` is the matrix root as seen from the page's
    directory (a relative path; empty when the page sits in the matrix root).
    """
    cells = [c for c in _list(report.get("cells")) if isinstance(c, Mapping)]
    ids = _cell_ids(cells)
    name = _map(report.get("matrix")).get("name") or "matrix"
    notable = [i for i, c in enumerate(cells) if c.get("verdict") not in ("valid", "not_run")]
    details = "".join(_cell_detail(report, c, a, i in notable[:OPEN_CELLS], link_prefix)
                      for i, (c, a) in enumerate(zip(cells, ids, strict=True)))
    return "".join((
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="referrer" content="no-referrer">',
        f"<title>{_e(name)}: RL-Kernel ablation matrix</title>",
        f"<style>{CSS}</style><script>{JS}</script></head><body>",
        _header(report, cells),
        _matrix_view(report, cells, ids),
        _attribution(report),
        '<h2>Cells</h2><p class="toolbar"><button type="button" onclick="rlkAll(true)">'
        'expand all</button><button type="button" onclick="rlkAll(false)">collapse all</button>'
        "</p>",
        details or '<p class="empty">no cells</p>',
        "<h2>Preflight</h2>",
        _preflight(report, preflight),
        "</body></html>\n",
    ))


def write_html(report: Mapping[str, Any], path: Path | str,
               preflight: Mapping[str, Any] | None = None) -> Path:
    """Render and write atomically (temp file in the same directory + `os.replace`).

    Written outside `report["matrix_root"]`, artifact links get the relative path to the root.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = ""
    root = report.get("matrix_root")
    if isinstance(root, str) and root:
        here, there = path.parent.resolve(), Path(root).resolve()
        if here != there:
            prefix = Path(os.path.relpath(there, here)).as_posix()
    from pytest_rlkernel_matrix.report import write_text_atomic

    write_text_atomic(path, render_html(report, preflight, link_prefix=prefix))
    return path
