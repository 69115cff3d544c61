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

from collections.abc import Mapping, Sequence
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


def one_process_why() -> str:
    """The `why` of a statement that one process per cell left without an interval."""
    return f"{ONE_PROCESS_WHY}; {HOW}"


def _short(why: str) -> str:
    return ONE_PROCESS if why == one_process_why() else why


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
    remedy for one process per cell; None when there are none."""
    reasons = report_reasons(modules)
    if not reasons:
        return None
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
