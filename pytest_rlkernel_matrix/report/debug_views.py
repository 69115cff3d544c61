"""The HTML report's view data for issue 45's evidence (plain data, never markup): whether a
drift matters for the loss (`loss_rows`), the debugger's first divergence (`debugger_view`) and
the token drift chart of a cell's worst samples (`token_drift_view`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_rlkernel_matrix.report.html_parts import _fmt_d, _map


def loss_rows(loss: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The importance-ratio figures of a cell as (label, text) rows; none without figures."""
    if not loss or loss.get("exact") is None:
        return []
    rows: list[tuple[str, Any]] = [("importance ratio (loss)", str(loss.get("brief") or "-"))]
    if loss.get("exact") is False:
        qs = _map(loss.get("abs_log_ratio_quantiles"))
        if qs:
            rows.append(("|log ratio| quantiles (= |dlogp|)", ", ".join(
                f"{k} {float(v):.3g}" for k, v in qs.items() if isinstance(v, int | float))))
        rows.append(("ratio min / max", f"{_fmt_d(loss.get('ratio_min'))} / "
                                        f"{_fmt_d(loss.get('ratio_max'))}"))
        rows.append(("ratio mean (vime ratio0_mean)", _fmt_d(loss.get("ratio_mean"))))
        for key, label in (("clip", "outside PPO clip"), ("tis_truncated", "TIS truncated"),
                           ("mis_masked", "MIS masked")):
            rows.append((f"{label} (tokens)", f"{loss.get(f'{key}_count')} of "
                                              f"{loss.get('active_tokens')}"))
    rows.append(("ratio conventions", str(loss.get("convention") or "-")))
    return rows


def debugger_view(results: Any) -> dict[str, Any] | None:
    """RL-Kernel's debugger per bundle / replay: status, first divergence and its figures,
    upstream's own report beside it; None when the cell has none."""
    if not isinstance(results, list) or not results:
        return None
    rows = []
    for r in results:
        if not isinstance(r, Mapping):
            continue
        first = _map(r.get("first_divergence"))
        theirs = _map(r.get("upstream_report"))
        rows.append([
            f"{r.get('kind')} {r.get('path')}", str(r.get("status")),
            str(first.get("module", "-")), str(first.get("stage", "-")),
            "-" if first.get("layer") is None else str(first.get("layer")),
            str(first.get("side", "-")),
            "-" if first.get("position") is None else str(first.get("position")),
            "-" if not first else f"{first.get('bitwise_mismatches', '-')} / "
                                  f"{first.get('elements', '-')}",
            _fmt_d(first.get("max_abs_diff")), str(first.get("input_evidence", "-")),
            "-" if not theirs else f"{theirs.get('status')} ({theirs.get('first_divergence')})",
        ])
    head = ["source", "status", "module", "stage", "layer", "side", "position",
            "bits differ / elements", "max |diff|", "inputs", "upstream report"]
    return {"head": head, "rows": rows, "cls": ""}


def debugger_lines(records: Any) -> list[str]:
    """The terminal's lines: each cell's first divergent boundary from the debugger."""
    out = []
    for rec in records:
        for r in rec.get("debugger") or []:
            if isinstance(r, Mapping) and r.get("summary"):
                out.append(f"debugger {rec.get('hardware')} {rec.get('module')} "
                           f"{rec.get('case')}: {r['summary']}")
    return out


W, H, LEFT, RIGHT, TOP, BOTTOM = 440, 150, 44, 10, 10, 30
COLOURS = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00")


def token_drift_view(drift: Any) -> dict[str, Any] | None:
    """Inline-SVG data (no script, no network) for the worst samples' dlogp along the
    response: one polyline per sample, x = response position, y = train - rollout (linear,
    symmetric about 0), masked positions left out."""
    lines_in = [d for d in drift if isinstance(d, Mapping)] if isinstance(drift, list) else []
    series = []
    for d in lines_in:
        pos = [p for p in d.get("positions") or [] if isinstance(p, int | float)]
        val = [v for v in d.get("dlogp") or [] if isinstance(v, int | float)]
        if pos and len(pos) == len(val):
            series.append((d, pos, val))
    if not series:
        return None
    xmax = max(max(p) for _, p, _ in series) or 1
    ymax = max(max(abs(v) for v in val) for _, _, val in series) or 1.0
    base = TOP + (H - TOP - BOTTOM) / 2

    def x(p: float) -> str:
        return f"{LEFT + (W - LEFT - RIGHT) * p / xmax:.1f}"

    def y(v: float) -> str:
        return f"{base - (H - TOP - BOTTOM) / 2 * v / ymax:.1f}"

    lines = []
    for i, (d, pos, val) in enumerate(series):
        lines.append({"points": " ".join(f"{x(p)},{y(v)}" for p, v in zip(pos, val, strict=True)),
                      "colour": COLOURS[i % len(COLOURS)],
                      "title": f"sample {d.get('sample')} (rank {d.get('rank')}, step "
                               f"{d.get('call')}): max |dlogp| {_fmt_d(d.get('max_abs'))} at "
                               f"position {d.get('argmax')}"})
    return {"w": W, "h": H, "lines": lines,
            "axis": {"x1": LEFT, "x2": W - RIGHT, "y": f"{base:.1f}"},
            "ticks": [{"x": LEFT - 4, "y": TOP + 8, "text": f"+{ymax:.2g}"},
                      {"x": LEFT - 4, "y": f"{base + 3:.1f}", "text": "0"},
                      {"x": LEFT - 4, "y": H - BOTTOM, "text": f"-{ymax:.2g}"}],
            "caption": {"x": f"{(LEFT + W) / 2:.0f}", "y": H - 3,
                        "text": f"response position (x, 0..{xmax:g}), dlogp = train - rollout "
                                "(y)"},
            "legend": [{"colour": ln["colour"], "text": ln["title"]} for ln in lines]}


def vime_rows(audit: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """vime's consistency audit of a cell as (label, text) rows; none without an audit."""
    if not audit:
        return []
    rows: list[tuple[str, Any]] = []
    for where, f in _map(audit.get("files")).items():
        m = _map(_map(f).get("replay_manifest"))
        if m:
            cases = _map(m.get("batch_invariance_cases"))
            rows.append((f"vime replay manifest ({where})",
                         f"mode {m.get('mode')}, {m.get('sample_count')} samples; cases: "
                         + ", ".join(f"{k} {v}" for k, v in cases.items())))
        cube = _map(_map(f).get("result_cube"))
        if cube:
            rows.append((f"vime result cube ({where})",
                         ", ".join(f"{k} {v}" for k, v in _map(cube.get("metrics")).items())))
    metrics = _map(audit.get("rlk_audit_metrics"))
    if metrics:
        last = sorted(metrics, key=lambda s: int(s) if str(s).isdigit() else 0)[-1]
        rows.append((f"rlk_audit_* (step {last} of {len(metrics)})",
                     ", ".join(f"{k} {v:.4g}" for k, v in _map(metrics[last]).items()
                               if isinstance(v, int | float))))
    drift = _map(audit.get("drift_report"))
    if drift:  # vime's drift-report status as vime computes it (issue 50)
        rows.append(("vime drift report", f"{drift.get('status')}"
                     + (f" ({'; '.join(str(b) for b in drift.get('because') or [])})"
                        if drift.get("because") else "") + f"; cube {drift.get('cube')}"))
    if audit.get("note"):
        rows.append(("vime audit note", str(audit["note"])))
    return rows
