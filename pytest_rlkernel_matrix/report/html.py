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

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2
from pytest_rlkernel_matrix.report.claims import claims_rows, steps_chart
from pytest_rlkernel_matrix.report.debug_views import (
    debugger_view,
    loss_rows,
    token_drift_view,
    vime_rows,
)
from pytest_rlkernel_matrix.report.html_parts import (
    DRIFT_CLASSES,
    DRIFT_FIELDS,
    DRIFT_MARK,
    DRIFT_MEANING,
    IMPL_LETTER,
    JUDGEMENTS,
    MODULE_ORDER,
    PAIRWISE,
    SIDES,
    TIMING_MEANING,
    VERDICT_MEANING,
    VERDICT_ORDER,
    View,
    _cell_ids,
    _fmt,
    _fmt_bytes,
    _fmt_d,
    _fmt_s,
    _items,
    _judged,
    _kv,
    _list,
    _map,
    _not_judged,
    _num,
    _ordered,
    _phase_word,
    _plan,
    _ratio_text,
    _records_table,
    _rel_link,
    _t,
    _table,
    _verdict_class,
    drift_class,
    forest,
    histogram_view,
    localisation_view,
    phases_view,
    timing_mark,
)
from pytest_rlkernel_matrix.report.matrix_report import row_name, timing_counts
from pytest_rlkernel_matrix.report.perf_text import no_statement

__all__ = ["HTML_FILE", "drift_class", "render_html", "write_html"]

HTML_FILE = "matrix-report.html"
TEMPLATE = "matrix-report.html.j2"
OPEN_CELLS = 3  # the first few cells that are not valid start expanded


# -- small helpers ---------------------------------------------------------------------------------


# -- drift class -----------------------------------------------------------------------------------


# -- charts (geometry only; the template draws) ----------------------------------------------------


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
    timings = _map(report.get("timings")) or timing_counts(cells)
    timing_badges = [{"text": f"{_fmt(timings.get(k))} {w}", "cls": f"timing t-{c}"}
                     for k, w, c in (("usable", "usable", "usable"),
                                     ("not_usable", "not usable", "not-usable"))
                     if timings.get(k)]
    meta = [("mode", matrix.get("mode")), ("layout", matrix.get("layout")),
            ("created", report.get("created")),
            ("hardware", _fmt(matrix.get("hardware"))), ("modules", _fmt(matrix.get("modules"))),
            ("cells", f"{len(cells)} of {_fmt(report.get('expected_cells'))}"),
            ("matrix file", matrix.get("file")), ("matrix root", report.get("matrix_root")),
            ("schema", report.get("schema_version"))]
    drill = _map(report.get("drill"))
    return {"drill": str(drill.get("text")) if drill else None,
            "name": str(matrix.get("name") or "matrix"), "state": state[0],
            "state_cls": state[1], "badges": badges, "drift_badges": drift_badges,
            "timing_badges": timing_badges,
            "meta": [(k, _fmt(v)) for k, v in meta if v is not None]}


def _legend(cells: Sequence[Mapping[str, Any]]) -> View:
    seen = {str(c.get("verdict")) for c in cells}
    verdicts = [{"word": v, "cls": _verdict_class(v), "meaning": VERDICT_MEANING[v]}
                for v in VERDICT_ORDER if v in seen or v != "not_run"]
    drifts = [{"word": d, "cls": f"d-{d}", "mark": DRIFT_MARK[d], "meaning": DRIFT_MEANING[d]}
              for d in DRIFT_CLASSES]
    timings = [{"word": w, "cls": "t-" + w.replace(" ", "-"), "meaning": m}
               for w, m in TIMING_MEANING.items()]
    return {"verdicts": verdicts, "drifts": drifts, "timings": timings}


def _matrix_cell(c: Mapping[str, Any], anchor: str) -> View:
    verdict = c.get("verdict")
    tags = []
    if c.get("failed"):
        tags.append(("FAILED", "the pytest item failed under the session's mode"))
    if c.get("shared_with"):
        tags.append(("shared", "shares its run with other cells"))
    active = c.get("active_token_count")
    mism = "-" if active is None else f"{_fmt(c.get('mismatch_count'))}/{_fmt(active)}"
    bits = c.get("bitwise_mismatch_count")
    if active is not None and bits is not None and bits != c.get("mismatch_count"):
        mism += f" ({_fmt(bits)} in bytes)"
    # the performance judgement is the timings mark, not a flag beside the verdict
    # a claim nobody made (not the baseline's) is no flag either
    not_judged = [(name, result) for name, result, _ in _not_judged(c)
                  if name != "performance" and result != "not claimed"]
    return {"anchor": anchor, "verdict": "" if verdict is None else str(verdict),
            "word": str(verdict or "none"), "vcls": _verdict_class(verdict),
            "drift": drift_class(c), "tags": tags, "mismatch": mism,
            "step": _fmt_s(c.get("step_wall_time")), "timing": timing_mark(c),
            "flags": [f"{name} {result}" for name, result in dict.fromkeys(not_judged)]}


def _matrix_view(report: Mapping[str, Any], cells: Sequence[Mapping[str, Any]],
                 ids: Sequence[str]) -> View | None:
    if not cells:
        return None
    matrix = _map(report.get("matrix"))
    by_key: dict[tuple[str, str, str], list[int]] = {}
    for i, c in enumerate(cells):
        f = _map(c.get("factor"))  # a factor cell: one row per factor variant, beside the modules
        row = row_name(c) if f else str(c.get("module"))
        key = (str(c.get("hardware")), row, str(c.get("case")))
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
        found = [("not valid", str(r)) for r in _list(c.get("reasons"))] \
            if c.get("verdict") not in ("valid", None) else []
        found += [("timings not usable" if name == "performance" else f"{name} {result}", r)
                  for name, result, r in _not_judged(c) if result != "not claimed"]
        labels: dict[str, list[str]] = {}  # each reason once, with every label it carries
        for what, reason in found:
            labels.setdefault(reason, [])
            if what not in labels[reason]:
                labels[reason].append(what)
        lines = [(", ".join(whats), reason) for reason, whats in labels.items()]
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


def _factor_rows(report: Mapping[str, Any]) -> View | None:
    entries = [e for e in _list(report.get("factor_attribution")) if isinstance(e, Mapping)]
    rows = [[_fmt(e.get("hardware")), f"{e.get('factor')}={e.get('variant')}",
             ", ".join(str(c) for c in _list(e.get("cases"))), str(e.get("conclusion") or "-")]
            for e in entries]
    return _table(("hardware", "factor", "cases", "conclusion"), rows) if rows else None


def _attribution(report: Mapping[str, Any]) -> View | None:
    entries = [e for e in _list(report.get("attribution")) if isinstance(e, Mapping)]
    factors = _factor_rows(report)
    profile = [str(line) for line in _list(report.get("profile"))]  # judge/localise/profile.py
    if not entries and factors is None and not profile:
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
            "details": details, "factors": factors, "profile": profile}


def _interval(entry: Any) -> str:
    """'0.69 [0.68, 0.70] s (3 processes, n=18)' for one cell's phase."""
    e = _map(entry)
    if e.get("median") is None:
        return "-"
    ci = "" if e.get("low") is None else f" [{e['low']:.3g}, {e['high']:.3g}]"
    return f"{e['median']:.3g}{ci} s ({e.get('processes')} proc, n={e.get('n')})"


def _performance(report: Mapping[str, Any]) -> View | None:
    """Per module: a table of its statements (R on side x phase: answer, ratio, interval,
    plan) and each cell's steady phase times with their intervals (`report.perf`); for the
    report, a forest plot of every statement's interval against the equivalence band and 1."""
    perf = _map(report.get("performance"))
    modules = [m for m in _list(perf.get("modules")) if isinstance(m, Mapping)]
    if not modules:
        return None
    phases = ("rollout_wall_time", "training_wall_time", "weight_sync_wall_time",
              "step_wall_time")
    views = []
    for m in modules:
        stmts = [s for s in _list(m.get("statements")) if isinstance(s, Mapping)]
        marks = {"slower": "no", "faster": "ok"}
        rows = []
        for s in stmts:
            low, high = _num(s.get("low")), _num(s.get("high"))
            rows.append([_fmt(s.get("side")), _phase_word(s.get("phase")),
                         _t(s.get("kind"), marks.get(str(s.get("kind")), "na")),
                         _t(_ratio_text(s.get("ratio")), "mono"),
                         _t(f"[{low:.3f}, {high:.3f}]" if low is not None and high is not None
                            else "-", "mono"),
                         _plan(s) if s.get("kind") not in ("faster", "slower",
                                                           "no difference") else "-"])
        if no_statement(stmts) is not None:  # one reason for every row: the line says it once
            rows = []
        cells = _map(m.get("cells"))
        prow = [[case, *(_interval(_map(cells.get(case)).get(p)) for p in phases)]
                for case in ("R/R", "P/R", "R/P", "P/P") if case in cells]
        views.append({"title": f"{m.get('hardware')} · {m.get('module')}",
                      "line": str(m.get("line") or ""),
                      "statements": _table(("R on side", "phase", "answer", "ratio",
                                            "interval", "plan"), rows, "perf"),
                      "phases": _table(("cell", "steady rollout", "steady training",
                                        "steady weight sync", "steady step"), prow)})
    intro = (f"Every ratio reads {perf.get('direction')}. Statements: {perf.get('method')} "
             f"({perf.get('family')} statements, "
             f"{100 * float(perf.get('family_confidence') or 0):.4g}% family-wise; no "
             f"difference means within ±{100 * float(perf.get('equivalence') or 0):.3g}%). "
             if perf.get("family") else f"{perf.get('note') or 'No statement.'} Every ratio "
             f"reads {perf.get('direction')}. ") + (
        f"Phase times per cell: {perf.get('cell_interval')}.")
    if perf.get("auto_stop"):  # as the terminal says it (issue 52)
        intro = f"performance: auto stopped early: {perf['auto_stop']}. {intro}"
    drill = _map(perf.get("drill"))
    return {"intro": intro, "modules": views, "forest": forest(perf, modules),
            "drill": str(drill.get("text")) if drill else None}


def _routes(c: Mapping[str, Any]) -> View:
    rows = []
    for module, entry in _map(c.get("routes")).items():
        entry = _map(entry)
        requested = str(entry.get("requested") or "")
        letters = requested.split("/") if "/" in requested else ["", ""]
        for k, side in enumerate(SIDES):
            r = entry.get(side)
            want = letters[k] if k < len(letters) else ""
            if entry.get("unfinished"):  # a run that did not finish: its state, never a side
                seen = (_fmt(r.get("ran") or r.get("implementation"))
                        if isinstance(r, Mapping) else "nothing")
                rows.append([_t(module, "b"), requested, side,
                             _t(f"{entry['unfinished']} (reported before it stopped: {seen})",
                                "na"), "-", "-", "-", "-", "-"])
                continue
            if not isinstance(r, Mapping):
                rows.append([_t(module, "b"), requested, side, _t("not reported", "no"),
                             "-", "-", "-", "-", "-"])
                continue
            impl = r.get("ran") or r.get("implementation")  # what ran (readback + route line)
            got = IMPL_LETTER.get(str(impl), "?")
            mismatch = (bool(want) and got != want) or bool(r.get("fallback"))
            said = [f"readback {r.get('implementation') or 'none'}"] + [
                f"route line actual={a}" for a in _list(r.get("route_line"))]
            shown = f"{_fmt(impl)} ({got} vs {want or '?'})" + (
                f"; {', '.join(said)}" if r.get("ran") and r.get("ran") != r.get(
                    "implementation") else "")
            rows.append([_t(module, "b"), requested, side, _t(shown, "no" if mismatch else ""),
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
        rows.append(("mismatch KL, k3 = mean(exp(delta) - delta - 1) >= 0, delta = train - "
                     "rollout", _fmt_d(c.get("mismatch_k3_kl"))))
    if c.get("mismatch_kl") is not None:
        label = c.get("mismatch_kl_estimator") or "k1 = mean(rollout - train), sign not meaningful"
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
        *_kl_rows(c), *loss_rows(_map(c.get("loss_impact"))),
        *vime_rows(_map(c.get("vime_audit"))),
        ("nonfinite", c.get("nonfinite_count")),
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
        "claims": _table(("claim", "status", "detail"), claims_rows(c), "kv")
        if isinstance(c.get("claims"), Mapping) else None, "steps": steps_chart(c),
        "loc": localisation_view(_map(c.get("localisation"))),
        "debugger": debugger_view(c.get("debugger")),
        "token_drift": token_drift_view(_map(c.get("loss_impact")).get("token_drift")),
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


def _bytecode_cache() -> Any:
    """jinja2's own per-user bytecode cache (a directory it creates with mode 0700 and checks
    is the user's), so a report does not compile the template again in every process; None
    where jinja2 finds no safe directory. A cache it cannot read or write costs the compile."""
    import jinja2

    class QuietCache(jinja2.FileSystemBytecodeCache):
        def load_bytecode(self, bucket: Any) -> None:
            try:
                super().load_bytecode(bucket)
            except OSError:
                bucket.reset()

        def dump_bytecode(self, bucket: Any) -> None:
            with contextlib.suppress(OSError):
                super().dump_bytecode(bucket)

    try:
        return QuietCache()
    except (OSError, RuntimeError):
        return None


def _environment() -> jinja2.Environment:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
        lstrip_blocks=True, keep_trailing_newline=True, bytecode_cache=_bytecode_cache())


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
        attribution=_attribution(report), performance=_performance(report), cells=details,
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
    from pytest_rlkernel_matrix.store.atomic import write_text_atomic

    write_text_atomic(path, render_html(report, preflight, link_prefix=prefix))
    return path
