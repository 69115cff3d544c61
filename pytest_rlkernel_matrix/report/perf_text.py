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


def one_process_why(processes: int = 1, auto: bool = False, budget: float = 0.0,
                    refused: bool = True) -> str:
    """The `why` of a statement that one process per cell left without an interval, with the
    remedy that fits what was passed: never --rlk-processes=auto to a session that ran it.
    `refused=False`: the other processes asked for did not run (none was refused)."""
    if auto:
        if not refused:
            return (f"{ONE_PROCESS_WHY}; the other processes did not run: a larger "
                    f"--rlk-perf-budget (now {budget:g} min)")
        return (f"{ONE_PROCESS_WHY}; the other processes were refused (see the reasons): fix "
                f"their cause, or a larger --rlk-perf-budget (now {budget:g} min)")
    if processes > 1:
        if not refused:
            return (f"{ONE_PROCESS_WHY}; the other processes did not run: "
                    f"--rlk-processes={2 * processes} or --rlk-processes=auto")
        return (f"{ONE_PROCESS_WHY}; {AFTER_REFUSALS}--rlk-processes={2 * processes} or "
                "--rlk-processes=auto")
    return f"{ONE_PROCESS_WHY}; {HOW}"


NOT_MEASURED = ": the variation between processes is not measured"
_CELLS = ("R/R", "P/R", "R/P", "P/P")


def thin_why(counts: Mapping[str, Mapping[str, int]], processes: int = 1, auto: bool = False,
             budget: float = 0.0) -> str:
    """The `why` of a statement left without an interval because a cell counted one process,
    naming the thin cells with the processes counted per cell and why each thin cell is thin
    (refused, not run), and the remedy that fits (issue 52: an H100 session counted 3/3/2/1
    processes, one refused, one cut by the budget, and said 'one process per cell').

    `counts`: per case {"requested", "ran", "counted"} (``refused`` = ran - counted). When one
    process was asked and ran in every cell, the sentence of `one_process_why`."""
    cells = [c for c in _CELLS if c in counts] or sorted(counts)

    def get(c: str, key: str) -> int:
        return int(counts[c].get(key) or 0)

    refused = {c: max(0, get(c, "ran") - get(c, "counted")) for c in cells}
    missing = {c: max(0, get(c, "requested") - get(c, "ran")) for c in cells}
    thin = [c for c in cells if get(c, "counted") < 2]
    whole = len(thin) == len(cells)
    if whole and not any(refused.values()):  # one process everywhere, none refused
        return one_process_why(processes, auto, budget, refused=False)
    asked = {get(c, "requested") for c in cells}
    shown = ", ".join(f"{c} {get(c, 'counted')}" for c in cells)
    detail = f"processes counted: {shown}" + (f" of {asked.pop()} asked" if len(asked) == 1
                                               else "")
    per = []
    for c in thin:
        parts = ([f"{refused[c]} refused"] if refused[c] else []) + (
            [f"{missing[c]} not run"] if missing[c] else [])
        if parts:
            per.append(f"{c}: {', '.join(parts)}")
    head = (ONE_PROCESS if whole else f"one process in {', '.join(thin)}") + (
        f" ({detail}" + (f"; {'; '.join(per)}" if per else "") + ")")
    fix = []
    if any(refused[c] for c in thin):
        fix.append("fix the refusal's cause (see the reasons)"
                   if sum(refused[c] for c in thin) == 1 else
                   "fix the refusals' causes (see the reasons)")
    if auto:
        fix.append(f"a larger --rlk-perf-budget (now {budget:g} min)")
    elif processes > 1 or any(missing[c] for c in thin):
        fix.append(f"more processes: --rlk-processes={max(3, 2 * processes)} or "
                   "--rlk-processes=auto")
    else:
        fix.append(HOW)
    return f"{head}{NOT_MEASURED}{'' if whole else ' there'}; {', or '.join(fix)}"


def split_why(why: str) -> tuple[str, str]:
    """(the short reason, the remedy) of a one-process `why` (`one_process_why`,
    `thin_why`); (why, '') for any other."""
    if NOT_MEASURED not in why:
        return why, ""
    short, rest = why.split(NOT_MEASURED, 1)
    return short, rest.split("; ", 1)[1] if "; " in rest else ""


def _one(reason: str) -> bool:
    return reason.startswith(("one process per cell", "one process in "))


def _short(why: str) -> str:
    return split_why(why)[0]


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
            and (len(reasons) > 1 or all(_one(x) for x in reasons[0]))):
        return list(reasons[0])  # (one module: its own line says its reason once)
    if any(r and ONE_PROCESS in r for r in reasons):
        return [ONE_PROCESS]
    # a thin cell (`thin_why`): said once with its remedy, the module's line keeps its figures
    return list(dict.fromkeys(x for r in reasons if r for x in r if _one(x)))


def report_note(modules: Sequence[Mapping[str, Any]]) -> str | None:
    """The report's one line for the reasons it says once (`report_reasons`), with the
    remedy for one process per cell that fits what was passed; None when there are none."""
    reasons = report_reasons(modules)
    if not reasons:
        return None
    full = {_short(str(s["why"])): str(s["why"]) for m in modules
            for s in m.get("statements") or [] if s.get("why")}
    thin = {r: split_why(full[r])[1] for r in reasons
            if r != ONE_PROCESS and _one(r) and r in full}
    if thin:  # the counts per cell and the remedy that fits them (`thin_why`)
        return "performance: no statement: " + "; ".join(
            f"{r}: {thin[r]}" if thin.get(r) else r for r in reasons)
    first = next((m for m in modules if "requested" in m), None)
    if first is not None and (first.get("auto") or int(first.get("requested") or 1) > 1):
        # the statements' own remedy (refused or not run), else the one that fits the options
        remedy_ = split_why(full[ONE_PROCESS])[1] if ONE_PROCESS in full else one_process_why(
            int(first.get("requested") or 1), bool(first.get("auto")),
            float(first.get("budget") or 0)).removeprefix(ONE_PROCESS_WHY + "; ")
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

# causes in order of cause: contamination makes steps noisy, noise makes intervals wide; a
# contamination that could not be measured (its probe failed) refuses the process too, but says
# nothing about the machine: its own cause, shown with the failure, never with a share
CAUSES = ("contamination", "contamination not measured", "noise", "fell back", "route changed",
          "failed", "duplicate", "other")
_SPREAD = re.compile(r"spread (?:\(max-min\)/median )?([\d.]+)%")
_SHARE = re.compile(r"used ([\d.]+)% of the")
_PREFIXES = ("timings not usable: ", "contaminated: ", "noise: ",
             "contamination not fully measured: ", "contamination not measured: ")


def cause_of(reasons: Sequence[str], reason: str | None) -> str:
    """A refused process's cause: the first of its reasons, in order of cause (measured
    contamination before a failed measurement of it)."""
    text = " ".join([*reasons, reason or ""])
    if "contaminated" in text:
        return "contamination"
    if "contamination not" in text:
        return "contamination not measured"
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


def _strip(text: str) -> str:
    for prefix in _PREFIXES:
        text = text.removeprefix(prefix)
    return text


def _figure(cause: str, run: Mapping[str, Any], reasons: Sequence[str]) -> tuple[float, str]:
    """(how bad, the figure shown) of one refused process for its cause: the reason that
    decided it, never a figure that did not (the H100 session of issue 52 showed 'used 0% of
    the cell's CPUs' for a process refused because nvidia-smi had been killed)."""
    if cause == "contamination":
        said = [r for r in reasons if "contaminated" in r]
        for r in said:  # the CPU share when it decided: the largest is the worst
            m = _SHARE.search(r)
            if m:
                return float(m[1]) / 100, _strip(r)
        if said:  # other processes on the GPUs, throttled clocks, cells on the same devices
            return 0.0, _strip(said[0])
    if cause == "contamination not measured":
        said = [r for r in reasons if "contamination not" in r]
        if said:
            return 0.0, _strip(said[0])
    if cause == "noise":
        for r in reasons:
            m = _SPREAD.search(r)
            if m:
                return float(m[1]) / 100, _strip(r)
    first = next(iter(reasons), None) or str(run.get("reason") or cause)
    return 0.0, _strip(first)


def refusals(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per cause (`CAUSES` order), the refused processes of `records`: count and the worst
    figure, named by cell and process ('P/P process 2: ...')."""
    out: dict[str, dict[str, Any]] = {}
    for rec in records:
        for run in (rec.get("measured") or {}).get("runs") or []:
            if run.get("used"):
                continue
            reasons = [str(r) for r in run.get("reasons") or []] or [str(run.get("reason"))]
            cause = cause_of(reasons, run.get("reason"))
            bad, shown = _figure(cause, run, reasons)
            if rec.get("case") and run.get("process") is not None:
                shown = f"{rec['case']} process {run['process']}: {shown}"
            entry = out.setdefault(cause, {"count": 0, "worst": -1.0, "figure": shown})
            entry["count"] += 1
            if bad > entry["worst"]:
                entry["worst"], entry["figure"] = bad, shown
    return {c: out[c] for c in CAUSES if c in out}


def _cut(text: str, width: int = 240) -> str:  # three 80-column lines at most
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
    if "contamination not measured" in causes:
        fix.append("make the contamination probe work (its failure is named: nvidia-smi, "
                   "rocm-smi or /proc)")
    if "noise" in causes:
        fix.append("steady the steps (a quiet machine; raise [runner] repeats)")
    if any(c not in ("contamination", "contamination not measured", "noise") for c in causes):
        fix.append("fix what the refused processes' reasons name (matrix-report.json)")
    more = (f"or a larger --rlk-perf-budget (now {budget:g} min)" if auto else
            f"or more processes: --rlk-processes={max(3, 2 * processes)} or "
            "--rlk-processes=auto")
    return "remedy: " + "; ".join(fix) + f"; {more}" if fix else f"remedy: {more}"
