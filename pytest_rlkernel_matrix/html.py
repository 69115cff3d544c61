"""`matrix-report.html`: one self-contained, browsable page for a `matrix-report.json`.

No network: inline CSS, a few lines of inline JS and inline SVG charts. The markup lives in the
Jinja2 template `templates/matrix-report.html.j2`, rendered with autoescape on, so every string
taken from the report (reasons, log lines, readbacks, names) is escaped by the template engine,
never by hand. This module only turns the report into plain view data (strings, numbers, lists,
dicts: no markup). Links to artifacts are relative to the matrix root, where the page is written
next to `matrix-report.json`. Every field may be missing or null: the page renders whatever is
there.

At a glance, each matrix cell shows two separate things: the **verdict** (the badge) and the
**drift class** (the cell's colour and mark): `bitwise` (every active token's logprob bit-equal
on both sides), `drifting` (with max |dlogp|) or `unknown` (no active tokens, no drift figures).
A `valid` verdict with drift is normal when no contract judges the drift (a P side); the drift
mark keeps a bitwise cell and a drifting one apart without a click.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    import jinja2

__all__ = ["HTML_FILE", "drift_class", "render_html", "write_html"]

HTML_FILE = "matrix-report.html"
TEMPLATE = "matrix-report.html.j2"
PAIRWISE = ("R/R", "P/R", "R/P", "P/P")
MODULE_ORDER = ("attention", "ffn", "logp")
VERDICT_ORDER = ("valid", "fallback", "unsupported", "contract_mismatch", "incomparable",
                 "error", "not_run")
VERDICT_MEANING = {
    "valid": "every judgement that applies passed (drift without a contract is shown, not judged)",
    "fallback": "a side ran production where RL-Kernel was requested",
    "unsupported": "a declared capability gap (unsupported class given)",
    "contract_mismatch": "the drift broke the contract the backends declared",
    "incomparable": "the two sides did not see the same weights or samples",
    "error": "timeout, crash, or missing / unreadable evidence",
    "not_run": "mode off: not run",
}
DRIFT_CLASSES = ("bitwise", "drifting", "unknown")
DRIFT_MEANING = {
    "bitwise": "every active token's training and rollout logprob is bit-equal",
    "drifting": "some active tokens differ; the mark gives max |dlogp|",
    "unknown": "no active tokens or no drift figures: nothing to compare",
}
DRIFT_MARK = {"bitwise": "=", "drifting": "\u2260", "unknown": "?"}
SIDES = ("training", "rollout")
IMPL_LETTER = {"production": "P", "rl_kernel": "R"}
JUDGEMENTS = ("route", "semantic", "numeric", "performance")
PHASES = (("rollout", "rollout_wall_time"), ("training", "training_wall_time"),
          ("weight sync", "weight_sync_wall_time"), ("step", "step_wall_time"))
DRIFT_FIELDS = ("logprob_abs_diff_mean", "logprob_abs_diff_p50", "logprob_abs_diff_p90",
                "logprob_abs_diff_p99", "logprob_abs_diff_max")
MAX_ROWS = 50
OPEN_CELLS = 3  # the first few cells that are not valid start expanded

# View data handed to the template: a table cell is plain text (str) or a `_t`/`_items` dict.
View = dict[str, Any]


# -- small helpers ---------------------------------------------------------------------------------


def _t(text: Any, cls: str = "", title: Any = None) -> View:
    """A table cell / inline span: text with an optional CSS class and tooltip."""
    return {"text": "" if text is None else str(text), "cls": cls,
            "title": None if title is None else str(title), "list": None}


def _items(items: Iterable[Any], cls: str = "") -> View:
    """A table cell holding a bullet list."""
    return {"text": None, "cls": cls, "title": None, "list": [str(i) for i in items]}


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
    """Plain text for any JSON value."""
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


def _judged(valid: Any) -> View:
    if valid is True:
        return _t("valid", "ok")
    if valid is False:
        return _t("invalid", "no")
    return _t("not judged", "na")


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]], cls: str = "") -> View:
    """`head` is plain text; each row's cells are text or `_t`/`_items` dicts."""
    return {"head": [str(h) for h in head], "rows": [list(r) for r in rows], "cls": cls}


def _kv(pairs: Iterable[tuple[str, Any]]) -> View:
    return _table(("field", "value"), ([_t(k, "b"), _fmt(v)] for k, v in pairs), "kv")


def _records_table(items: Sequence[Any], first: Sequence[str] = ()) -> View:
    """A table over a list of dicts: `first` columns, then the rest in order of appearance."""
    all_dicts = [i for i in items if isinstance(i, Mapping)]
    dicts = all_dicts[:MAX_ROWS]
    cols = [c for c in first if any(c in d for d in dicts)]
    for d in dicts:
        cols += [str(k) for k in d if str(k) not in cols]
    rows = [[_fmt_d(d.get(c)) if "diff" in c else _fmt(d.get(c)) for c in cols] for d in dicts]
    table = _table(cols, rows)
    table["more"] = max(len(all_dicts) - len(dicts), 0)
    return table


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


def _ordered(preferred: Iterable[Any], seen: Iterable[Any]) -> list[str]:
    seen_list = [str(s) for s in seen]
    out = [p for p in dict.fromkeys(str(p) for p in preferred) if p in seen_list]
    return out + [s for s in dict.fromkeys(seen_list) if s not in out]


def _count(value: Any) -> int | None:
    v = _num(value)
    return None if v is None else int(v)


# -- drift class -----------------------------------------------------------------------------------


def drift_class(cell: Mapping[str, Any]) -> dict[str, str]:
    """The cell's drift class, independent of its verdict: bitwise, drifting or unknown.

    Fail closed: bitwise needs active tokens and zero (bitwise) mismatches and no non-finite
    value; a missing count is unknown, never bitwise. Returns `cls`, `mark`, `label` (short
    text for the matrix) and `title` (the figures behind it).
    """
    active = _count(cell.get("active_token_count"))
    mism = _count(cell.get("mismatch_count"))
    bits = _count(cell.get("bitwise_mismatch_count"))
    nonfinite = _count(cell.get("nonfinite_count")) or 0
    worst = _num(cell.get("logprob_abs_diff_max"))
    if not active or (mism is None and bits is None):
        cls = "unknown"
        label = "unknown: no tokens" if not active else "unknown: no mismatch count"
        title = f"active tokens {_fmt(cell.get('active_token_count'))}"
    elif (bits if bits is not None else mism) == 0 and mism in (0, None) and not nonfinite \
            and not worst:
        cls = "bitwise"
        label = "bitwise"
        title = f"0 of {active:,} active tokens differ (bit-equal logprobs)"
    else:
        cls = "drifting"
        label = f"drifting, max|dlogp| {_fmt_d(worst)}"
        shown = mism if mism is not None else bits or 0
        title = f"{shown:,} of {active:,} active tokens differ"
        if bits is not None and mism is not None and bits != mism:
            title += f" ({bits:,} differ in their bits)"
        if nonfinite:
            label += f", {nonfinite:,} non-finite"
            title += f"; {nonfinite:,} non-finite"
    return {"cls": cls, "mark": DRIFT_MARK[cls], "label": label, "title": title}


def _not_judged(c: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(judgement, result, reason) for every judgement that is not a plain `valid`."""
    out = []
    validity = _map(c.get("validity"))
    for name in _ordered(JUDGEMENTS, validity):
        j = _map(validity.get(name))
        valid = j.get("valid")
        if valid is True:
            continue
        result = "invalid" if valid is False else "not judged"
        reasons = [str(r) for r in _list(j.get("reasons"))] or ["(no reason recorded)"]
        out += [(name, result, r) for r in reasons]
    return out


# -- charts (geometry only; the template draws) ----------------------------------------------------


def _pow10(x: Any) -> str:
    v = _num(x)
    return "?" if v is None else f"{10 ** v:.0e}"


def _f1(x: float) -> str:
    return f"{x:.1f}"


def histogram_view(hist: Mapping[str, Any]) -> View | None:
    """Bars of the log10 |dlogp| histogram (plus a grey bar for bitwise-equal tokens)."""
    counts = [int(_num(c) or 0) for c in _list(hist.get("counts"))]
    edges = [_num(x) for x in _list(hist.get("log10_abs_diff_edges"))]
    zero = int(_num(hist.get("zero")) or 0)
    if not counts and not zero:
        return None
    bars: list[tuple[str, int, bool]] = []
    if zero or "zero" in hist:
        bars.append(("|dlogp| = 0", zero, True))
    for i, n in enumerate(counts):
        lo = edges[i] if i < len(edges) else None
        hi = edges[i + 1] if i + 1 < len(edges) else None
        bars.append((f"[{_pow10(lo)}, {_pow10(hi)})", n, False))
    w, h, left, bottom, top, right = 440, 150, 36, 30, 8, 10
    peak = max((n for _, n, _ in bars), default=0) or 1
    step = (w - left - right) / len(bars)
    base = h - bottom
    rects = []
    for i, (label, n, is_zero) in enumerate(bars):
        bh = (base - top) * n / peak
        rects.append({"cls": "bar0" if is_zero else "bar", "x": _f1(left + i * step + 1),
                      "y": _f1(base - bh), "w": _f1(max(step - 2, 1)), "h": _f1(bh),
                      "title": f"{label}: {n}"})
    ticks = [{"x": str(left - 4), "y": str(top + 8), "anchor": "end", "text": str(peak)},
             {"x": str(left - 4), "y": str(base), "anchor": "end", "text": "0"}]
    first = 1 if bars[0][2] else 0
    if first:
        ticks.append({"x": _f1(left + step / 2), "y": str(base + 12), "anchor": "middle",
                      "text": "0"})
    if len(edges) >= 2 and counts:
        for j in sorted({0, len(counts) // 2, len(counts)}):
            anchor = "start" if j == 0 else "end" if j == len(counts) else "middle"
            ticks.append({"x": _f1(left + (first + j) * step), "y": str(base + 12),
                          "anchor": anchor,
                          "text": _pow10(edges[j] if j < len(edges) else None)})
    return {"w": w, "h": h, "rects": rects, "ticks": ticks,
            "axis": {"x1": left, "y": base, "x2": w - right},
            "caption": {"x": f"{(left + w) / 2:.0f}", "y": h - 3}}


def phases_view(record: Mapping[str, Any]) -> View | None:
    """Horizontal bars of the phase wall times (rollout, training, weight sync, step): the bar
    is the median over measured steps, the whisker spans min to max, `n` is the step count."""
    spread = _map(record.get("phase_spread"))
    values = [(label, _num(record.get(key)), _map(spread.get(key))) for label, key in PHASES]
    if all(v is None for _, v, _ in values):
        return None
    w, row, left, right = 440, 22, 82, 112
    tops = [v for _, v, _ in values if v is not None]
    tops += [m for _, _, sp in values if (m := _num(sp.get("max"))) is not None]
    peak = max(tops, default=0.0) or 1.0
    scale = (w - left - right) / peak
    rows = []
    for i, (label, v, sp) in enumerate(values):
        y = 3 + i * row
        entry: View = {"label": label, "lx": left - 6, "ty": y + 14, "bar": None}
        if v is not None:
            bw = max(scale * max(v, 0.0), 1.0)
            lo, hi, n = _num(sp.get("min")), _num(sp.get("max")), sp.get("n")
            tip = f"{label}: median {_fmt_s(v)}"
            end = left + bw
            whisker = None
            if lo is not None and hi is not None:
                tip += f", min {_fmt_s(lo)}, max {_fmt_s(hi)}, n={n} steps"
                x0, x1 = left + scale * max(lo, 0.0), left + scale * max(hi, 0.0)
                end = max(end, x1)
                whisker = {"x0": _f1(x0), "x1": _f1(x1), "mid": _f1(y + 3 + (row - 7) / 2),
                           "y0": y + 5, "y1": y + row - 6}
            entry["bar"] = {"cls": "bar0" if label == "step" else "bar", "x": left,
                            "y": y + 3, "w": _f1(bw), "h": row - 7, "tx": _f1(end + 4),
                            "title": tip, "whisker": whisker,
                            "text": _fmt_s(v) + (f" n={n}" if isinstance(n, int) else "")}
        rows.append(entry)
    return {"w": w, "h": row * len(values) + 6, "left": left, "rows": rows}


# -- sections --------------------------------------------------------------------------------------


def _header(report: Mapping[str, Any], cells: Sequence[Mapping[str, Any]]) -> View:
    matrix = _map(report.get("matrix"))
    if report.get("interrupted"):
        state = ("interrupted", "v-error")
    elif report.get("complete"):
        state = ("complete", "v-valid")
    else:
        state = ("incomplete", "v-fallback")
    summary = _map(report.get("summary"))
    if not summary:
        counts: dict[str, int] = {}
        for c in cells:
            counts[str(c.get("verdict"))] = counts.get(str(c.get("verdict")), 0) + 1
        summary = counts
    badges = [{"text": f"{_fmt(summary[v])} {v}", "cls": _verdict_class(v)}
              for v in _ordered(VERDICT_ORDER, summary)]
    drifts: dict[str, int] = {}
    for c in cells:
        cls = drift_class(c)["cls"]
        drifts[cls] = drifts.get(cls, 0) + 1
    drift_badges = [{"text": f"{drifts[d]} {d}", "cls": f"d-{d}", "mark": DRIFT_MARK[d]}
                    for d in DRIFT_CLASSES if d in drifts]
    meta = [("mode", matrix.get("mode")), ("layout", matrix.get("layout")),
            ("created", report.get("created")),
            ("hardware", _fmt(matrix.get("hardware"))), ("modules", _fmt(matrix.get("modules"))),
            ("cells", f"{len(cells)} of {_fmt(report.get('expected_cells'))}"),
            ("matrix file", matrix.get("file")), ("matrix root", report.get("matrix_root")),
            ("schema", report.get("schema_version"))]
    return {"name": str(matrix.get("name") or "matrix"), "state": state[0],
            "state_cls": state[1], "badges": badges, "drift_badges": drift_badges,
            "meta": [(k, _fmt(v)) for k, v in meta if v is not None]}


def _legend(cells: Sequence[Mapping[str, Any]]) -> View:
    seen = {str(c.get("verdict")) for c in cells}
    verdicts = [{"word": v, "cls": _verdict_class(v), "meaning": VERDICT_MEANING[v]}
                for v in VERDICT_ORDER if v in seen or v != "not_run"]
    drifts = [{"word": d, "cls": f"d-{d}", "mark": DRIFT_MARK[d], "meaning": DRIFT_MEANING[d]}
              for d in DRIFT_CLASSES]
    return {"verdicts": verdicts, "drifts": drifts}


def _matrix_cell(c: Mapping[str, Any], anchor: str) -> View:
    verdict = c.get("verdict")
    tags = []
    if c.get("failed"):
        tags.append(("FAILED", "the pytest item failed under the session's mode"))
    if c.get("shared_with"):
        tags.append(("shared", "shares its run with other cells"))
    active = c.get("active_token_count")
    mism = "-" if active is None else f"{_fmt(c.get('mismatch_count'))}/{_fmt(active)}"
    not_judged = [(name, result) for name, result, _ in _not_judged(c)]
    return {"anchor": anchor, "verdict": "" if verdict is None else str(verdict),
            "word": str(verdict or "none"), "vcls": _verdict_class(verdict),
            "drift": drift_class(c), "tags": tags, "mismatch": mism,
            "step": _fmt_s(c.get("step_wall_time")),
            "flags": [f"{name} {result}" for name, result in dict.fromkeys(not_judged)]}


def _matrix_view(report: Mapping[str, Any], cells: Sequence[Mapping[str, Any]],
                 ids: Sequence[str]) -> View | None:
    if not cells:
        return None
    matrix = _map(report.get("matrix"))
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
    rows = []
    for hw in hardware:
        for module in modules:
            if not any(k[0] == hw and k[1] == module for k in by_key):
                continue
            tds = [[_matrix_cell(cells[i], ids[i]) for i in by_key.get((hw, module, case), [])]
                   for case in cases]
            rows.append({"hardware": hw, "module": module, "tds": tds})
    return {"cases": cases, "rows": rows}


def _glance(cells: Sequence[Mapping[str, Any]], ids: Sequence[str]) -> list[View]:
    """Per cell, what keeps it from a plain valid: its reasons and not-judged judgements."""
    out = []
    for c, anchor in zip(cells, ids, strict=True):
        lines = [("not valid", r) for r in _list(c.get("reasons"))] \
            if c.get("verdict") not in ("valid", None) else []
        lines += [(f"{name} {result}", r) for name, result, r in _not_judged(c)]
        if not lines:
            continue
        verdict = c.get("verdict")
        out.append({"anchor": anchor, "label": f"{c.get('hardware')} · {c.get('module')} · "
                    f"{c.get('case')}", "word": str(verdict or "none"),
                    "vcls": _verdict_class(verdict), "drift": drift_class(c),
                    "lines": [{"what": w, "reason": str(r)} for w, r in lines]})
    return out


def _effects_table(kind: str, data: Any) -> View:
    rows = []
    data = _map(data)
    with_noise = any("noise" in _map(v) for v in data.values())
    for name, eff in data.items():
        eff = _map(eff)
        name = str(name)
        fmt = _fmt_s if kind == "time" else _fmt_d if "logprob" in name else _fmt
        label = name.replace("logprob_abs_diff_", "|dlogp| ").removesuffix("_wall_time")
        row: list[Any] = [_t(label.replace("_", " "), "b", name)]
        row += [_t(fmt(eff.get(c)), "num") for c in PAIRWISE]
        row += [_t(fmt(eff.get(k)), "num") for k in ("training", "rollout", "interaction")]
        if with_noise:
            row.append(_fmt(eff.get("noise")))
        rows.append(row)
    head = [kind, *PAIRWISE, "training", "rollout", "interaction"]
    return _table(head + (["noise"] if with_noise else []), rows)


def _attribution(report: Mapping[str, Any]) -> View | None:
    entries = [e for e in _list(report.get("attribution")) if isinstance(e, Mapping)]
    if not entries:
        return None
    rows = []
    details = []
    for e in entries:
        refused = [str(r) for r in _list(e.get("refused"))]
        rows.append([_fmt(e.get("hardware")), _fmt(e.get("module")),
                     str(e.get("conclusion") or "-"),
                     _items(refused, "refused") if refused else "-"])
        effects = _map(e.get("effects"))
        if effects:
            details.append({"title": f"{e.get('hardware')} · {e.get('module')}",
                            "drift": _effects_table("drift", effects.get("drift")),
                            "time": _effects_table("time", effects.get("time"))})
    return {"table": _table(("hardware", "module", "conclusion", "refused"), rows),
            "details": details}


def _routes(c: Mapping[str, Any]) -> View:
    rows = []
    for module, entry in _map(c.get("routes")).items():
        entry = _map(entry)
        requested = str(entry.get("requested") or "")
        letters = requested.split("/") if "/" in requested else ["", ""]
        for k, side in enumerate(SIDES):
            r = entry.get(side)
            want = letters[k] if k < len(letters) else ""
            if not isinstance(r, Mapping):
                rows.append([_t(module, "b"), requested, side, _t("unreported", "no"),
                             "-", "-", "-", "-", "-"])
                continue
            impl = r.get("implementation")
            got = IMPL_LETTER.get(str(impl), "?")
            mismatch = (bool(want) and got != want) or bool(r.get("fallback"))
            rows.append([_t(module, "b"), requested, side,
                         _t(f"{_fmt(impl)} ({got} vs {want or '?'})", "no" if mismatch else ""),
                         _t(_fmt(r.get("backend_ids")), "mono"), _fmt(r.get("call_count")),
                         _fmt(r.get("fallback")), _fmt(r.get("contract")),
                         _fmt(_list(r.get("runtime_platforms")) + _list(r.get("execution_modes")))])
    head = ("module", "requested", "side", "actual (got vs wanted)", "backend ids", "calls",
            "fallback", "contract", "platform / mode")
    table = _table(head, rows, "routes")
    table["empty"] = (f"no route table; actual training "
                      f"{c.get('actual_training_implementation') or '-'}, rollout "
                      f"{c.get('actual_rollout_implementation') or '-'}")
    return table


def _fallbacks(c: Mapping[str, Any]) -> list[str]:
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
        items.append(text)
    return items


def _validity(c: Mapping[str, Any]) -> View:
    validity = _map(c.get("validity"))
    rows = []
    for name in _ordered(JUDGEMENTS, validity):
        j = _map(validity.get(name))
        reasons = [str(r) for r in _list(j.get("reasons"))]
        rows.append([_t(name, "b"), _judged(j.get("valid")), _items(reasons) if reasons else "-"])
    return _table(("judgement", "result", "reasons"), rows)


def _links(root: Any, c: Mapping[str, Any], prefix: str) -> View:
    links = []
    for label, name in (("run.log", "run.log"), ("matrix-case.env", "matrix-case.env"),
                        ("artifact dir", "")):
        href = _rel_link(root, c.get("artifact_dir"), name, prefix)
        if href is not None:
            links.append({"label": label, "href": href})
    return {"links": links, "dir": _fmt(c.get("artifact_dir"))}


def _label_lines(title: str, data: Any) -> View | None:
    data = _map(data)
    if not data:
        return None
    table = _table(("label", "line"), ([_t(k, "b"), _t(_fmt(v), "mono")] for k, v in data.items()))
    table["title"] = title
    return table


def _kl_rows(c: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The mismatch KL figures, each named by its estimator (only k3 is never negative)."""
    rows: list[tuple[str, Any]] = []
    if c.get("mismatch_k3_kl") is not None:
        rows.append(("mismatch KL, k3 = mean(e^d - d - 1) >= 0", _fmt_d(c.get("mismatch_k3_kl"))))
    if c.get("mismatch_kl") is not None:
        label = c.get("mismatch_kl_estimator") or "k1 = mean(-d), sign not meaningful"
        rows.append((f"mismatch KL, {label}", _fmt_d(c.get("mismatch_kl"))))
    return rows


def _cell_detail(report: Mapping[str, Any], c: Mapping[str, Any], anchor: str,
                 is_open: bool = False, prefix: str = "") -> View:
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
    drift = drift_class(c)
    metrics = [
        ("drift class", drift["label"]),
        ("active tokens", active), ("mismatch count", c.get("mismatch_count")),
        ("bitwise mismatch count", c.get("bitwise_mismatch_count")),
        ("mismatch fraction", c.get("mismatch_fraction")),
        *((f"|dlogp| {f.removeprefix('logprob_abs_diff_')}", _fmt_d(c.get(f)))
          for f in DRIFT_FIELDS),
        *_kl_rows(c), ("nonfinite", c.get("nonfinite_count")),
        ("samples / ranks", f"{_fmt(c.get('sample_count'))} / {_fmt(c.get('rank_count'))}"),
        ("logprob source", c.get("logprob_source")),
        ("tokens/s", c.get("tokens_per_second")), ("peak memory", _fmt_bytes(c.get("peak_memory"))),
        ("process wall time", _fmt_s(c.get("process_wall_time"))),
    ]
    facts = [(k, v) for k, v in facts if v not in (None, [], {}, "")]
    metrics = [(k, v) for k, v in metrics if v not in (None, "-", "- / -")]
    worst = _list(c.get("worst_tokens"))
    first = _list(c.get("first_mismatch"))
    verdict = c.get("verdict")
    return {
        "anchor": anchor, "open": is_open, "word": str(verdict or "none"),
        "vcls": _verdict_class(verdict), "drift": drift, "failed": bool(c.get("failed")),
        "title": f"{c.get('hardware')} · {c.get('module')} · {c.get('case')}",
        "links": _links(report.get("matrix_root"), c, prefix),
        "reasons": [str(r) for r in _list(c.get("reasons"))],
        "validity": _validity(c), "routes": _routes(c), "fallbacks": _fallbacks(c),
        "facts": _kv(facts), "metrics": _kv(metrics),
        "hist": histogram_view(_map(c.get("dlogp_histogram"))), "phases": phases_view(c),
        "worst": _records_table(worst, ("sample", "rank", "position", "token_id",
                                        "train_logprob", "rollout_logprob", "abs_diff"))
        if worst else None,
        "first": _records_table(first, ("sample", "rank", "position")) if first else None,
        "labels": [t for t in (_label_lines("log errors", c.get("log_errors")),
                               _label_lines("contamination", c.get("contamination"))) if t],
    }


def _preflight(report: Mapping[str, Any], pre: Mapping[str, Any] | None) -> View:
    summary = _map(report.get("preflight"))
    fps = [("report hardware fingerprint", summary.get("hardware_fingerprint")),
           ("report build fingerprint", summary.get("build_fingerprint"))]
    view: View = {"file": str(summary.get("file") or "preflight.json"), "present": bool(pre),
                  "fps": _kv(fps)}
    if not pre:
        return view
    probe = _map(pre.get("probe"))
    torch = _map(probe.get("torch"))
    gpu = _map(pre.get("gpu"))
    nvidia = _map(pre.get("nvidia"))
    rocm = _map(pre.get("rocm"))
    rl = _map(probe.get("rl_engine"))
    py = _map(pre.get("python"))
    own = _map(pre.get("fingerprints"))
    reused = _map(probe.get("reused"))
    facts = [
        ("created", pre.get("created")), ("python", py.get("version")),
        ("python executable", py.get("executable") or py.get("requested")),
        ("probe", f"REUSED from {reused.get('from')} (probed {reused.get('probed_at')}), "
                  "not a fresh probe" if reused else None),
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
        status = r.get("status") or ("not configured" if not r.get("configured") else "-")
        repos.append([str(name), _fmt(r.get("root") or r.get("env")),
                      _t(_fmt(r.get("commit")), "mono"), _fmt(r.get("dirty")), str(status)])
    pkgs = [[str(n), _fmt(_map(p).get("version")), _fmt(_map(p).get("module_found"))]
            for n, p in _map(probe.get("packages")).items()]
    cmds = [[str(n), _fmt(_map(c).get("status")), _fmt(_map(c).get("returncode"))]
            for n, c in _map(pre.get("commands")).items()]
    env = _map(pre.get("env"))
    caps_report = _map(pre.get("capabilities"))
    caps = [[str(k), _fmt(_map(c).get("status")), str(_map(c).get("unsupported_class") or ""),
             _fmt(_map(c).get("check")), _fmt(_map(c).get("reason"))]
            for k, c in _map(caps_report.get("capabilities")).items()]
    view.update(
        facts=_kv((k, v) for k, v in facts if v is not None),
        r_provider=_fmt(caps_report.get("r_provider")),
        caps=_table(("capability", "status", "class", "check", "reason"), caps) if caps else None,
        repos=_table(("repo", "root", "commit", "dirty", "status"), repos),
        pkgs=_table(("package", "version", "found"), pkgs),
        cmds=_table(("command", "status", "exit"), cmds),
        env=_kv(env.items()) if env else None,
    )
    return view


# -- entry points ----------------------------------------------------------------------------------


def _environment() -> jinja2.Environment:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
        lstrip_blocks=True, keep_trailing_newline=True)


def render_html(report: Mapping[str, Any], preflight: Mapping[str, Any] | None = None, *,
                link_prefix: str = "") -> str:
    """The whole report page as one self-contained HTML string.

    Artifact links are relative: `link_prefix` is the matrix root as seen from the page's
    directory (a relative path; empty when the page sits in the matrix root).
    """
    cells = [c for c in _list(report.get("cells")) if isinstance(c, Mapping)]
    ids = _cell_ids(cells)
    notable = [i for i, c in enumerate(cells) if c.get("verdict") not in ("valid", "not_run")]
    details = [_cell_detail(report, c, a, i in notable[:OPEN_CELLS], link_prefix)
               for i, (c, a) in enumerate(zip(cells, ids, strict=True))]
    template = _environment().get_template(TEMPLATE)
    return template.render(
        header=_header(report, cells), legend=_legend(cells),
        matrix=_matrix_view(report, cells, ids), glance=_glance(cells, ids),
        attribution=_attribution(report), cells=details,
        preflight=_preflight(report, preflight))


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
