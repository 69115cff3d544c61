"""The session's terminal summary (the `rlk matrix` section pytest prints at the end).

Pure rendering of the records the session holds, beside the other renderers (`matrix_report`'s
table, `claims`, `debug_views`, `perf`, `attribution`, the HTML page): lines in, no terminal
object; the plugin writes them. The performance lines are the written report's (read through
`store`), else computed from the records.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.store.safeio import MAX_REPORT_BYTES, Refused, read_json


def failed_run_log(root: Path, rec: dict[str, Any]) -> Path | None:
    """The run.log of a cell that exited non-zero (or timed out), where one was written."""
    ran_badly = rec.get("exit_code") not in (0, None) or rec.get("timed_out")
    if not rec.get("artifact_dir") or not ran_badly:
        return None
    log = root / str(rec["artifact_dir"]) / "run.log"
    return log if log.is_file() else None


def performance_lines(records: Sequence[dict[str, Any]], root: Path,
                      stop: str | None) -> list[str]:
    """One line per module: the performance statements the written report holds; first, why
    --rlk-processes=auto stopped early (`stop`), with the figures (issue 52)."""
    from pytest_rlkernel_matrix.report.matrix_report import REPORT_FILE

    try:
        perf = read_json(root / REPORT_FILE, root, MAX_REPORT_BYTES)["performance"]
    except (OSError, ValueError, KeyError, TypeError, Refused):
        from pytest_rlkernel_matrix.report.perf import performance

        perf = performance(list(records))
    note = [str(perf["note"])] if perf.get("note") else []  # a reason all share, said once
    stop = perf.get("auto_stop") or stop  # the report's own account first (issue 52)
    if stop:
        note.insert(0, f"performance: auto stopped early: {stop}")
    return note + [str(m["line"]) for m in perf.get("modules") or [] if m.get("line")]


def summary_lines(records: Sequence[dict[str, Any]], root: Path, stop: str | None,
                  rerun: Iterable[str] = ()) -> list[str]:
    """The `rlk matrix` section: the table, the verdict counts, claims, debugger views, each
    problem group with its reasons and run.log, attributions, performance, localisations,
    profiles, node fingerprints, where the report is, and a rerun's lines (`rerun`)."""
    from pytest_rlkernel_matrix.judge.localise.profile import terminal_lines
    from pytest_rlkernel_matrix.report.attribution import attribute_factors
    from pytest_rlkernel_matrix.report.claims import claim_lines
    from pytest_rlkernel_matrix.report.debug_views import debugger_lines  # (issue 45)
    from pytest_rlkernel_matrix.report.html import HTML_FILE
    from pytest_rlkernel_matrix.report.matrix_report import (
        REPORT_FILE,
        counts_text,
        node_fingerprint_groups,
        problem_groups,
        summarize,
        table,
        timing_counts,
    )
    from pytest_rlkernel_matrix.report.perf import attribute_said

    records = list(records)
    out = list(table(records))
    out.append(f"verdicts: {counts_text(summarize(records), timing_counts(records))}")
    out += claim_lines(records)
    out += debugger_lines(records)
    for recs, head, reasons in problem_groups(records):  # each reason once per group
        out.append(head)
        out += [f"    {reason}" for reason in reasons]
        for log in dict.fromkeys(failed_run_log(root, rec) for rec in recs):
            if log is not None:
                out.append(f"    run.log: {log}")
    out += [f"{e['hardware']} {e['conclusion']}"
            for e in [*attribute_said(records), *attribute_factors(records)]]
    out += performance_lines(records, root, stop)
    for rec in sorted(records, key=lambda r: (r["hardware"], r["module"], r["case"])):
        loc = rec.get("localisation")
        if isinstance(loc, dict) and isinstance(loc.get("summary"), str):
            out.append(f"{rec['module']} {rec['case']}: {loc['summary']}")
    out += terminal_lines(records)
    out += [f"node fingerprints: {flag}" for flag in node_fingerprint_groups(records)["flags"]]
    out.append(f"matrix report: {root / REPORT_FILE}")
    out.append(f"matrix report (HTML): {root / HTML_FILE}")
    out += list(rerun)
    return out
