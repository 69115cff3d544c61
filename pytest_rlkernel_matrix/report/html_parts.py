"""The HTML report's view data: plain strings, numbers, lists and dicts, never markup.

Formatting helpers, the drift class of a cell and the chart data (histogram, phase bars)
that `report.html` assembles into the page its Jinja2 template renders.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import quote

PAIRWISE = ("R/R", "P/R", "R/P", "P/P")


MODULE_ORDER = ("attention", "ffn", "logp")


VERDICT_ORDER = ("valid", "fallback", "unsupported", "contract_mismatch", "incomparable",
                 "error", "not_run")


VERDICT_MEANING = {
    "valid": "every evidence judgement that applies passed: route, semantic, numeric (drift "
             "without a contract is shown, not judged); the timings have their own mark",
    "fallback": "a side ran production where RL-Kernel was requested",
    "unsupported": "a declared capability gap (unsupported class given)",
    "contract_mismatch": "the drift broke the contract the backends declared",
    "incomparable": "the two sides did not see the same weights or samples",
    "error": "timeout, crash, or missing / unreadable evidence",
    "not_run": "mode off: not run",
}


DRIFT_CLASSES = ("bitwise", "drifting", "unknown")


# The performance mark, apart from the verdict: whether a cell's timings may support a
# performance statement (the `performance` judgement; `performance_usable` in the record).
TIMING_MEANING = {
    "usable": "the timings may support a performance statement (the attribution's rule)",
    "not usable": "the timings are refused (noise, contamination, the route that ran, or a "
                  "verdict other than valid); the reason is listed below the matrix",
}


def timing_mark(c: Mapping[str, Any]) -> dict[str, str] | None:
    """The cell's timings mark: usable / not usable (None: no judged run, e.g. not_run)."""
    if "performance_usable" not in c:
        return None
    word = "usable" if c.get("performance_usable") is True else "not usable"
    return {"word": word, "cls": "t-" + word.replace(" ", "-"), "title": TIMING_MEANING[word]}


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
          ("weight sync", "weight_sync_wall_time"), ("unattributed", "unattributed_wall_time"),
          ("step", "step_wall_time"))


DRIFT_FIELDS = ("logprob_abs_diff_mean", "logprob_abs_diff_p50", "logprob_abs_diff_p90",
                "logprob_abs_diff_p99", "logprob_abs_diff_max")


MAX_ROWS = 50


# View data handed to the template: a table cell is plain text (str) or a `_t`/`_items` dict.
View = dict[str, Any]


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
        reasons = [str(r) for r in _list(j.get("reasons"))] or ["(no reason recorded)"]
        result = "invalid" if valid is False else "not judged"
        if valid is None and all(r.startswith("not claimed") for r in reasons):
            result = "not claimed"  # a claim nobody made for this cell (not the baseline's)
        out += [(name, result, r) for r in reasons]
    return out


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
            tip = f"{label}: {_fmt_s(v)} in the median step"  # one account (record.py)
            share = _num(record.get("unattributed_share"))
            if label == "unattributed" and share is not None:
                tip += f" ({share:.0%} of the step, in no phase)"
            end = left + bw
            whisker = None
            if lo is not None and hi is not None:
                tip += f"; over the steps min {_fmt_s(lo)}, max {_fmt_s(hi)}, n={n} steps"
                x0, x1 = left + scale * max(lo, 0.0), left + scale * max(hi, 0.0)
                end = max(end, x1)
                whisker = {"x0": _f1(x0), "x1": _f1(x1), "mid": _f1(y + 3 + (row - 7) / 2),
                           "y0": y + 5, "y1": y + row - 6}
            entry["bar"] = {"cls": "bar0" if label == "step" else "bar", "x": left,
                            "y": y + 3, "w": _f1(bw), "h": row - 7, "tx": _f1(end + 4),
                            "title": tip, "whisker": whisker,
                            "text": _fmt_s(v) + (f" n={n}" if isinstance(n, int) else "")
                            + (f" ({share:.0%})" if label == "unattributed"
                               and share is not None else "")}
        rows.append(entry)
    return {"w": w, "h": row * len(values) + 6, "left": left, "rows": rows}


def localisation_view(loc: Mapping[str, Any]) -> View | None:
    """The probe's localisation: summary, per-layer relative-error chart (log scale, the first
    divergent layer marked), the operators from the first divergent one on, vocabulary figures."""
    if not loc:
        return None
    layers = [(_num(e.get("layer")), _num(e.get("max_rel_err")))
              for e in map(_map, _list(loc.get("per_layer")))]
    layers = [(int(i), v) for i, v in layers if i is not None and v is not None]
    first = _map(loc.get("first_divergent"))
    chart: View | None = None
    if layers:
        w, h, left, right, top, bottom = 440, 170, 46, 12, 10, 34
        logs = [math.log10(v) for _, v in layers if v > 0]
        lo = math.floor(min(logs)) if logs else -8
        hi = math.ceil(max(logs)) if logs else 0
        lo, hi = (lo, hi) if hi > lo else (lo - 1, lo + 1)
        n = max(len(layers) - 1, 1)
        base = h - bottom

        def xy(k: int, v: float) -> tuple[str, str]:
            y = base if v <= 0 else base - (base - top) * (math.log10(v) - lo) / (hi - lo)
            return _f1(left + (w - left - right) * k / n), _f1(y)

        points = []
        for k, (i, v) in enumerate(layers):
            x, y = xy(k, v)
            points.append({"x": x, "y": y, "cls": "bar0" if v <= 0 else "bar",
                           "mark": first.get("layer") == i,
                           "title": f"layer {i}: max relative error "
                                    f"{'0 (bitwise)' if v <= 0 else f'{v:.3g}'}"})
        ticks = [{"x": str(left - 4), "y": _f1(base - (base - top) * (e - lo) / (hi - lo) + 3),
                  "anchor": "end", "text": f"1e{e}"} for e in sorted({lo, (lo + hi) // 2, hi})]
        ticks += [{"x": p["x"], "y": str(base + 12), "anchor": "middle",
                   "text": str(layers[k][0])} for k, p in enumerate(points)
                  if k in (0, len(points) - 1, len(points) // 2)]
        chart = {"w": w, "h": h, "points": points, "ticks": ticks,
                 "line": " ".join(f"{p['x']},{p['y']}" for p in points),
                 "axis": {"x1": left, "y": base, "x2": w - right},
                 "caption": {"x": f"{(left + w) / 2:.0f}", "y": h - 3}}
    ops = [_map(e) for e in _list(loc.get("operators"))]
    start = next((k for k, e in enumerate(ops) if e.get("name") == first.get("operator")), 0)
    rows = [[e.get("name"), e.get("status") if e.get("status") != "compared" else (
        "bitwise" if e.get("bitwise") else "differs"), _fmt(e.get("max_abs")),
        _fmt(e.get("rel_err")), " / ".join(str(v) for v in _map(e.get("dtypes")).values())]
        for e in ops[max(start - 1, 0):start + 12]]
    vocab = _map(loc.get("vocab"))
    vrows = [(k, _fmt(vocab.get(k))) for k in (
        "tokens", "kl_rollout_train_mean", "kl_train_rollout_mean", "kl_rollout_train_max",
        "total_variation_mean", "top1_agreement", "topk_overlap_mean", "top_k") if k in vocab]
    toks = [[t.get("sample"), t.get("token"), t.get("kind", ""), _fmt(t.get("kl_rollout_train")),
             _fmt(t.get("probe_train_logprob")), _fmt(t.get("probe_rollout_logprob")),
             _fmt(t.get("sidecar_train_logprob")), _fmt(t.get("sidecar_rollout_logprob")),
             {True: "yes", False: "NO"}.get(t.get("ties_to_sidecar"), "-")]  # type: ignore[arg-type]
            for t in map(_map, _list(loc.get("tokens")))]
    return {"summary": str(loc.get("summary", "")), "status": str(loc.get("status", "")),
            "probe_run": loc.get("probe_run"), "chart": chart,
            "reasons": [str(r) for r in _list(loc.get("reasons"))[:20]],
            "ops": _table(["operator", "status", "max |delta|", "relative error",
                           "dtypes (training / rollout)"], rows) if rows else None,
            "vocab": _kv(vrows) if vrows else None,
            "tokens": _table(["sample", "token", "kind", "KL(r||t)", "probe train logp",
                              "probe rollout logp", "sidecar train logp",
                              "sidecar rollout logp", "ties to sidecar"], toks) if toks else None}


# -- the performance section's forest plot and table cells (issue 53) ----------------------------

def _ratio_text(v: Any) -> str:
    x = _num(v)
    return "-" if x is None else f"{x:.3f}"


def _plan(s: Mapping[str, Any]) -> str:
    """What would settle an inconclusive statement, or why there is none, in a few words."""
    r = _map(s.get("resolve"))
    if r.get("processes"):
        return f"{r.get('processes')} processes x {r.get('steps')} steps per cell"
    why = str(s.get("why") or "")
    return why if len(why) <= 90 else why[:87] + "..."


def _phase_word(phase: Any) -> str:
    return str(phase).removesuffix("_wall_time").replace("_", " ")


def forest(perf: Mapping[str, Any], modules: Sequence[Mapping[str, Any]]) -> View | None:
    """The forest plot of every statement with an interval: one row per statement (module, R on
    side, phase), its ratio and interval on a log axis against the ±m equivalence band and 1.
    Plain numbers for the template, which draws the inline SVG (no network)."""
    rows: list[dict[str, Any]] = []
    for m in modules:
        for s in _list(m.get("statements")):
            s = _map(s)
            ratio, low, high = _num(s.get("ratio")), _num(s.get("low")), _num(s.get("high"))
            if ratio is None or ratio <= 0:
                continue
            rows.append({"label": f"{m.get('hardware')} {m.get('module')}: R on {s.get('side')}"
                                  f", {_phase_word(s.get('phase'))}",
                         "kind": str(s.get("kind") or "-"), "ratio": ratio,
                         "low": low if low and low > 0 else None,
                         "high": high if high and high > 0 else None})
    if not rows:
        return None
    bounds = [b for b in (_num(x) for x in _list(perf.get("equivalence_bounds"))) if b]
    band = (min(bounds), max(bounds)) if len(bounds) == 2 else None
    margin = _num(perf.get("equivalence"))
    if band is None and margin:  # a report from before `equivalence_bounds`: its margin
        band = (1.0 / (1.0 + margin), 1.0 + margin)  # as judge.performance.margin_bounds
    values = [v for r in rows for v in (r["ratio"], r["low"], r["high"]) if v]
    values += [1.0, *(band or ())]
    lo, hi = math.log(min(values)), math.log(max(values))
    pad = max((hi - lo) * 0.08, 0.01)
    lo, hi = lo - pad, hi + pad
    w, left, right, top, row = 720, 300, 24, 24, 18
    h = top + row * len(rows) + 34

    def px(v: float) -> float:
        return round(left + (w - left - right) * (math.log(v) - lo) / (hi - lo), 1)

    cls = {"faster": "f-faster", "slower": "f-slower", "no difference": "f-same"}
    out_rows = []
    for i, r in enumerate(rows):
        y = top + row * i + row / 2
        out_rows.append({
            "y": round(y, 1), "ty": round(y + 4, 1), "label": r["label"],
            "cx": px(r["ratio"]), "cls": cls.get(r["kind"], "f-other"),
            "x0": px(r["low"]) if r["low"] else None, "x1": px(r["high"]) if r["high"] else None,
            "ratio": _ratio_text(r["ratio"]), "low": _ratio_text(r["low"]),
            "high": _ratio_text(r["high"]), "kind": r["kind"],
            "title": f"{r['label']}: {r['kind']}, ratio {_ratio_text(r['ratio'])}"
                     + (f" [{_ratio_text(r['low'])}, {_ratio_text(r['high'])}]"
                        if r["low"] and r["high"] else " (no interval)")})
    ticks: list[float] = []
    for t in (1.0, min(values), max(values), *(band or ())):  # 1 first; labels never overlap
        if all(abs(px(t) - px(k)) >= 30 for k in ticks):
            ticks.append(t)
    ticks.sort()
    axis_y = top + row * len(rows) + 4
    drill = _map(perf.get("drill"))
    return {"w": w, "h": h, "left": left, "top": top - 6, "bottom": axis_y,
            "one": px(1.0),
            "band": None if band is None else {"x": px(band[0]), "w": round(px(band[1])
                                                                           - px(band[0]), 1),
                                               "low": f"{band[0]:.3f}", "high": f"{band[1]:.3f}"},
            "rows": out_rows,
            "ticks": [{"x": px(t), "y": axis_y + 14, "text": f"{t:.3g}"} for t in ticks],
            "caption": {"x": round((left + w - right) / 2, 1), "y": h - 4},
            "drill": str(drill.get("text")) if drill else None}
