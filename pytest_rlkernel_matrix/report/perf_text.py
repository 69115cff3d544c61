"""How the performance statements read in the terminal when none of them can be made.

A statement's ``text`` (`report.perf.sentence`) is one sentence, the same in the terminal, the
JSON and the HTML. When no statement of a module can be made, for a reason every statement
shares (one process per cell; timings not usable), repeating that reason and its remedy once
per side and phase buries the figures: the terminal then says the reason once (for the report
when it is the one-process reason, whose remedy is a session option), and per module only the
point figures, compact, on one line. Presentation only: the statements and their ``text``
stay as they are.

Imports nothing of the report; `report.perf` and `report.attribution` use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ONE_PROCESS = "one process per cell"
ONE_PROCESS_WHY = f"{ONE_PROCESS}: the variation between processes is not measured"
HOW = ("run several processes per cell: --rlk-processes=3 (or [performance] processes = 3 in "
       "matrix.toml), or --rlk-processes=auto")
REMEDY = ("(the variation between processes is not measured); run --rlk-processes=3 (or "
          "[performance] processes = 3 in matrix.toml) or --rlk-processes=auto")
NO_ANSWER = ("inconclusive", "not judged")
_SHORT_PHASE = {"rollout_wall_time": "rollout", "training_wall_time": "training",
                "weight_sync_wall_time": "weight sync", "step_wall_time": "step"}


AFTER_REFUSALS = ("the other processes were refused (see the reasons); fix their cause, or "
                  "more processes: ")


def one_process_why(processes: int = 1, auto: bool = False, budget: float = 0.0) -> str:
    """The `why` of a statement that one process per cell left without an interval, with the
    remedy that fits what was passed: never --rlk-processes=auto to a session that ran it."""
    if auto:
        return (f"{ONE_PROCESS_WHY}; the other processes were refused (see the reasons): fix "
                f"their cause, or a larger --rlk-perf-budget (now {budget:g} min)")
    if processes > 1:
        return (f"{ONE_PROCESS_WHY}; {AFTER_REFUSALS}--rlk-processes={2 * processes} or "
                "--rlk-processes=auto")
    return f"{ONE_PROCESS_WHY}; {HOW}"


def _short(why: str) -> str:
    return ONE_PROCESS if why.startswith(ONE_PROCESS_WHY) else why


def no_statement(statements: Sequence[Mapping[str, Any]]) -> list[str] | None:
    """When none of `statements` is an answer (no interval anywhere): their reasons, each once,
    without the remedy (`ONE_PROCESS` for one process per cell); None when any has an
    interval or an answer (then every sentence is said as it is)."""
    if not statements:
        return None
    reasons: list[str] = []
    for s in statements:
        why = s.get("why")
        if s.get("kind") not in NO_ANSWER or s.get("low") is not None or not why:
            return None
        reasons.append(_short(str(why)))
    return list(dict.fromkeys(reasons))


def figures(statements: Sequence[Mapping[str, Any]]) -> str:
    """The point figures of the statements left inconclusive, per side on one line:
    'training side rollout 1.01x, training 1.87x, step 1.31x; rollout side ...'."""
    by_side: dict[str, list[str]] = {}
    for s in statements:
        if s.get("kind") == "inconclusive" and isinstance(s.get("ratio"), (int, float)):
            phase = _SHORT_PHASE.get(str(s.get("phase")), str(s.get("phase")))
            by_side.setdefault(str(s.get("side")), []).append(f"{phase} {s['ratio']:.2f}x")
    order = sorted(by_side, key=lambda side: (side != "training", side))
    return "; ".join(f"{side} side {', '.join(by_side[side])}" for side in order)


def compact(head: str, reasons: Sequence[str], statements: Sequence[Mapping[str, Any]],
            direction: str, said: Sequence[str] = ()) -> str:
    """A module's one line when no statement can be made: its reasons other than the ones the
    report says once (`said`, `report_reasons`), then the point figures."""
    own = [r for r in reasons if r not in said]
    figs = figures(statements)
    why = f"no statement ({'; '.join(own)})" if own else ""
    if not figs:
        return f"{head}: {why or 'no statement'}"
    return (f"{head} ({direction}; point figures, no interval): " + (f"{why}: " if why else "")
            + figs)


def report_reasons(modules: Sequence[Mapping[str, Any]]) -> list[str]:
    """The reasons the report says once instead of per module: all of them when every module
    has no statement for the same reasons (R/R's timings, shared by every module, not usable;
    one process per cell), else the one-process reason wherever it is one."""
    reasons = [no_statement(m.get("statements") or []) for m in modules
               if m.get("statements")]
    if (reasons and reasons[0] and all(r == reasons[0] for r in reasons)
            and (len(reasons) > 1 or reasons[0] == [ONE_PROCESS])):
        return list(reasons[0])  # (one module: its own line says its reason once)
    return [ONE_PROCESS] if any(r and ONE_PROCESS in r for r in reasons) else []


def report_note(modules: Sequence[Mapping[str, Any]]) -> str | None:
    """The report's one line for the reasons it says once (`report_reasons`), with the
    remedy for one process per cell that fits what was passed; None when there are none."""
    reasons = report_reasons(modules)
    if not reasons:
        return None
    first = next((m for m in modules if "requested" in m), None)
    if first is not None and (first.get("auto") or int(first.get("requested") or 1) > 1):
        remedy_ = one_process_why(int(first.get("requested") or 1), bool(first.get("auto")),
                                  float(first.get("budget") or 0)).removeprefix(
                                      ONE_PROCESS_WHY + "; ")
        return "performance: no statement: " + "; ".join(
            f"{ONE_PROCESS} ({remedy_})" if r == ONE_PROCESS else r for r in reasons)
    every = all(no_statement(m.get("statements") or []) == reasons for m in modules
                if m.get("statements"))
    if not every:  # one process per cell in some modules only (records of several sessions)
        return f"performance: no statement where {ONE_PROCESS} ran {REMEDY}"
    return "performance: no statement: " + "; ".join(
        f"{ONE_PROCESS} {REMEDY}" if r == ONE_PROCESS else r for r in reasons)


def timing_text(statements: Sequence[Mapping[str, Any]]) -> str | None:
    """The attribution's timing part when none of `statements` is an answer: the reasons once,
    without the remedy (the performance lines say it), then the point figures; else None."""
    reasons = no_statement(statements)
    if reasons is None:
        return None
    figs = figures(statements)
    return f"timings: no statement ({'; '.join(reasons)})" + (f": {figs}" if figs else "")


# -- refused processes, by cause (issue 52) -------------------------------------------------------

# causes in order of cause: contamination makes steps noisy, noise makes intervals wide
CAUSES = ("contamination", "noise", "fell back", "route changed", "failed", "duplicate",
          "other")
_SPREAD = re.compile(r"spread (?:\(max-min\)/median )?([\d.]+)%")
_SHARE = re.compile(r"used ([\d.]+)% of the")


def cause_of(reasons: Sequence[str], reason: str | None) -> str:
    """A refused process's cause: the first of its reasons, in order of cause."""
    text = " ".join([*reasons, reason or ""])
    if "contaminat" in text:
        return "contamination"
    if "noise" in text or "spread" in text:
        return "noise"
    if "fell back" in text or "fallback" in text:
        return "fell back"
    if "route" in text:
        return "route changed"
    if "duplicate" in text:
        return "duplicate"
    if "timed out" in text or "error" in text or "exit code" in text:
        return "failed"
    return "other"


def _figure(cause: str, run: Mapping[str, Any], reasons: Sequence[str]) -> tuple[float, str]:
    """(how bad, the figure shown) of one refused process for its cause."""
    if cause == "contamination":
        share = (run.get("contamination") or {}).get("foreign_cpu_share")
        for r in reasons:
            m = _SHARE.search(r)
            if m:
                return float(m[1]) / 100, r.removeprefix("contaminated: ")
        if isinstance(share, (int, float)):
            return float(share), f"other processes used {share:.0%} of the cell's CPUs"
    if cause == "noise":
        for r in reasons:
            m = _SPREAD.search(r)
            if m:
                return float(m[1]) / 100, r.removeprefix("noise: ")
    first = next(iter(reasons), None) or str(run.get("reason") or cause)
    return 0.0, first


def refusals(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per cause (`CAUSES` order), the refused processes of `records`: count and the worst
    figure."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        for run in (rec.get("measured") or {}).get("runs") or []:
            if run.get("used"):
                continue
            reasons = [str(r) for r in run.get("reasons") or []] or [str(run.get("reason"))]
            cause = cause_of(reasons, run.get("reason"))
            bad, shown = _figure(cause, run, reasons)
            entry = out.setdefault(cause, {"count": 0, "worst": -1.0, "figure": shown})
            entry["count"] += 1
            if bad > entry["worst"]:
                entry["worst"], entry["figure"] = bad, shown
    return {c: out[c] for c in CAUSES if c in out}


def _cut(text: str, width: int = 160) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def refusal_lines(causes: Mapping[str, Mapping[str, Any]], ran: int) -> list[str]:
    """One line per cause: '8 of 12 processes refused for contamination (worst: ...)'."""
    return [_cut(f"{c['count']} of {ran} processes refused for {cause} (worst: {c['figure']})")
            for cause, c in causes.items()]


def remedy(causes: Iterable[str], processes: int, auto: bool, budget: float) -> str:
    """What to do about refused processes, fitting what was passed (never suggesting
    --rlk-processes=auto to a session that ran it)."""
    causes = list(causes)
    fix = []
    if "contamination" in causes:
        fix.append("run where no other job shares the CPUs/GPUs (or stop it)")
    if "noise" in causes:
        fix.append("steady the steps (a quiet machine; raise [runner] repeats)")
    if any(c not in ("contamination", "noise") for c in causes):
        fix.append("fix what the refused processes' reasons name (matrix-report.json)")
    more = (f"or a larger --rlk-perf-budget (now {budget:g} min)" if auto else
            f"or more processes: --rlk-processes={max(3, 2 * processes)} or "
            "--rlk-processes=auto")
    return "remedy: " + "; ".join(fix) + f"; {more}" if fix else f"remedy: {more}"
