"""Profile runs: which operator costs the time, per side, phase and module (localisation only).

A profile run is a separate run of a finished cell (``--rlk-profile`` or ``[profile] when =
"always"``), in its own directory ``<run>/profile`` (``profile.2``, ...), with
``RL_KERNEL_PROFILE=1``; it is never a measured run and its timings never enter a performance
statement (its ``cell-run.json`` says ``excluded_from_performance``). What it reads is a
``torch.profiler`` chrome trace (``export_chrome_trace``, or ``tensorboard_trace_handler``'s
``*.pt.trace.json[.gz]`` as vLLM (``VLLM_TORCH_PROFILER_DIR``) and Megatron-based trainers
write them): JSON ``{"traceEvents": [...]}``, complete events (``ph: "X"``, ``ts``/``dur`` in
microseconds) of the categories ``cpu_op``, ``user_annotation``, ``cuda_runtime`` /
``cuda_driver`` and ``kernel``. No torch is needed to read one.

Attribution, per trace:

- time: GPU kernel time (``kernel`` events) when the trace has any, else CPU operator self time
  (an operator's duration less its child operators'): kernel sums, not step time;
- phase: the enclosing ``rlk.phase.<weight_sync|rollout|training|debug>`` range (the reference
  workload's), else ``unknown``; a GPU kernel takes the ranges of the CPU call that launched it
  (matched by ``correlation``);
- side and module: the enclosing ``rlk.<side>.<module>`` range; a backward operator takes the
  module of the forward operator with its autograd sequence number. Kernels in no module range
  are ``other``. A trace with no ``rlk.*`` module range (a framework's own trace) is bucketed by
  kernel name (``NAME_BUCKETS``: collectives -> comm, flash/fmha/attention -> attention,
  log_softmax/logsumexp -> logp; GEMMs cannot be told apart by name and stay ``other``), with
  the side from the file name (``rollout``/``vllm``/``sglang`` or ``train``/``megatron``/
  ``actor``) or ``unknown``. RL-Kernel's issue #331 asks for the same buckets (Attention, FFN,
  Logp, all-gather and reduce-scatter: our ``comm``) from an Nsight capture; no public RL-Kernel
  tool writes such a bucketed file yet, so the trace itself is read.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix.store.atomic import new_dir
from pytest_rlkernel_matrix.store.safeio import Refused, newest_followup, read_bytes

PROFILE_SUMMARY = "profile.json"
PROFILE_NOTE = ("kernel sums for localisation, not step time: a profile run is never a "
                "measured run and concludes nothing about performance")
BUCKETS = ("attention", "ffn", "logp", "comm", "other")
MAX_TRACE_BYTES = 1 << 30  # compressed or plain, per file
MAX_JSON_BYTES = 4 << 30  # decompressed
TOP = 3
MAX_NAMES = 40  # kernels kept per bucket in the summary (the largest)
_MODULE_RANGE = re.compile(r"^rlk\.(training|rollout)\.(attention|ffn|logp|comm)$")
_PHASE_RANGE = "rlk.phase."
_BACKWARD = "autograd::engine::evaluate_function"
NAME_BUCKETS = (
    ("comm", re.compile(r"nccl|rccl|all_?gather|reduce_?scatter|all_?reduce|c10d::",
                        re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|paged", re.IGNORECASE)),
    ("logp", re.compile(r"log_?softmax|logsumexp|logprob|linear_logp|cross_entropy",
                        re.IGNORECASE)),
)
_SIDE_HINTS = (("rollout", re.compile(r"rollout|vllm|sglang", re.IGNORECASE)),
               ("training", re.compile(r"train|megatron|actor", re.IGNORECASE)))


def load_trace(path: Path, root: Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a chrome trace (``.json`` or ``.json.gz``); ValueError if not one."""
    raw = read_bytes(path, root, MAX_TRACE_BYTES)
    if raw[:2] == b"\x1f\x8b":
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        raw = d.decompress(raw, MAX_JSON_BYTES)
        if d.unconsumed_tail:
            raise ValueError(f"decompresses past {MAX_JSON_BYTES} bytes")
    data = json.loads(raw)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError("no traceEvents list")
    return [e for e in events if isinstance(e, dict)]


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _by_name(name: str) -> str:
    for bucket, pat in NAME_BUCKETS:
        if pat.search(name):
            return bucket
    return "other"


def bucket_events(events: list[dict[str, Any]], side_hint: str = "unknown") -> dict[str, Any]:
    """{"unit", "annotated", "times": {side: {phase: {module: {name: [us of each call]}}}}} of
    one trace."""
    complete = [e for e in events if e.get("ph") == "X" and _num(e.get("ts")) is not None
                and _num(e.get("dur")) is not None]
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    annotated = any(e.get("cat") == "user_annotation" and _MODULE_RANGE.match(str(e.get("name")))
                    for e in complete)
    host = [e for e in complete if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime",
                                                   "cuda_driver")]
    host.sort(key=lambda e: (str(e.get("pid")), str(e.get("tid")), e["ts"], -e["dur"]))
    times: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    launched: dict[Any, tuple[str, str, str | None]] = {}
    forward: dict[Any, tuple[str, str]] = {}

    def add(ctx: tuple[str, str, str | None], name: str, us: float) -> None:
        side, phase, module = ctx
        if module is None:
            module = "other" if annotated else _by_name(name)
        times[side][phase][module][name].append(us)

    stack: list[list[Any]] = []  # [event, ctx, child us, thread]

    def close(entry: list[Any]) -> None:
        e, ctx, child, _ = entry
        if e.get("cat") == "cpu_op" and not kernels:
            add(ctx, str(e.get("name")), max(0.0, e["dur"] - child))

    for e in host:
        thread = (e.get("pid"), e.get("tid"))
        while stack and (stack[-1][3] != thread
                         or e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
            close(stack.pop())
        side, phase, module = (stack[-1][1] if stack else (side_hint, "unknown", None))
        name = str(e.get("name"))
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        seq = args.get("Sequence number")
        if e.get("cat") == "user_annotation":
            m = _MODULE_RANGE.match(name)
            if m:
                side, module = m.group(1), m.group(2)
            elif name.startswith(_PHASE_RANGE):
                phase = name[len(_PHASE_RANGE):]
        elif e.get("cat") == "cpu_op":
            if name.startswith(_BACKWARD) and seq in forward and module is None:
                side, module = forward[seq]
            elif module is not None and seq is not None and not name.startswith(_BACKWARD):
                forward.setdefault(seq, (side, module))
            if stack and stack[-1][0].get("cat") == "cpu_op":
                stack[-1][2] += e["dur"]
        elif "correlation" in args:
            launched[args["correlation"]] = (side, phase, module)
        stack.append([e, (side, phase, module), 0.0, thread])
    while stack:
        close(stack.pop())
    for k in kernels:
        args = k.get("args") if isinstance(k.get("args"), dict) else {}
        ctx = launched.get(args.get("correlation"), (side_hint, "unknown", None))
        add(ctx, str(k.get("name")), k["dur"])
    return {"unit": "GPU kernel time" if kernels else "CPU operator self time",
            "annotated": annotated, "times": times}


def _side_hint(path: Path) -> str:
    for side, pat in _SIDE_HINTS:
        if pat.search(path.name):
            return side
    return "unknown"


def trace_files(profile_dir: Path) -> list[Path]:
    """The chrome traces of a profile run directory (ours and a framework's)."""
    found = {p for pat in ("**/*.pt.trace.json", "**/*.pt.trace.json.gz", "**/trace.rank*.json",
                           "**/trace.rank*.json.gz") for p in profile_dir.glob(pat)}
    return sorted(p for p in found if p.is_file() and not p.name.startswith("."))


def summarise(profile_dir: Path, steps: int, root: Path | None = None) -> dict[str, Any]:
    """Per side, phase and module: ms per profiled step and the top kernels, of every trace
    under ``profile_dir`` (ranks added up: sums, not step time)."""
    root = root or profile_dir
    problems: list[str] = []
    total: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}
    units, read = set(), []
    for path in trace_files(profile_dir):
        try:
            got = bucket_events(load_trace(path, root), _side_hint(path))
        except (Refused, ValueError, OSError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
            problems.append(f"{path.relative_to(profile_dir)}: unreadable: {exc}")
            continue
        read.append(str(path.relative_to(profile_dir)))
        units.add(got["unit"])
        for side, phases in got["times"].items():
            for phase, modules in phases.items():
                for module, names in modules.items():
                    slot = total.setdefault(side, {}).setdefault(phase, {}).setdefault(module, {})
                    for name, durations in names.items():
                        slot.setdefault(name, []).extend(durations)
    if not read:
        problems.append(f"no chrome trace under {profile_dir.name}/")
    n = max(1, steps)
    buckets: dict[str, Any] = {}
    for side, phases in total.items():
        for phase, modules in phases.items():
            for module, names in modules.items():
                # per kernel: calls x the median call, so a call the OS preempted (a loaded
                # CPU) or a stray stall does not read as kernel time; the plain sum is kept
                est = {k: len(d) * statistics.median(d) / 1000.0 / n for k, d in names.items()}
                order = sorted(est, key=lambda k: -est[k])
                buckets.setdefault(side, {}).setdefault(phase, {})[module] = {
                    "ms_per_step": sum(est.values()),
                    "sum_ms_per_step": sum(sum(d) for d in names.values()) / 1000.0 / n,
                    "calls_per_step": sum(len(d) for d in names.values()) / n,
                    "kernels": {k: est[k] for k in order[:MAX_NAMES]},
                    "top": [{"name": k, "ms_per_step": est[k],
                             "calls_per_step": len(names[k]) / n} for k in order[:TOP]]}
    return {"schema_version": "rlk.profile_summary.v1", "traces": read,
            "unit": " + ".join(sorted(units)) or None, "steps": steps,
            "excluded_from_performance": True, "note": PROFILE_NOTE,
            "buckets": buckets, "problems": problems}


def module_ms(summary: dict[str, Any], side: str, phase: str) -> dict[str, float]:
    """ms per step of each bucket on ``side`` in ``phase`` (absent buckets: 0)."""
    got = ((summary.get("buckets") or {}).get(side) or {}).get(phase) or {}
    return {m: float((got.get(m) or {}).get("ms_per_step") or 0.0) for m in BUCKETS}


def difference(r_cell: dict[str, Any], p_cell: dict[str, Any], side: str,
               phase: str) -> list[dict[str, Any]]:
    """Per bucket on ``side``/``phase``: R's ms/step minus P's and the kernels that differ most,
    largest absolute difference first."""
    out = []
    a, b = module_ms(r_cell, side, phase), module_ms(p_cell, side, phase)
    for m in BUCKETS:
        ka = (((r_cell.get("buckets") or {}).get(side) or {}).get(phase) or {}).get(m) or {}
        kb = (((p_cell.get("buckets") or {}).get(side) or {}).get(phase) or {}).get(m) or {}
        names = set(ka.get("kernels") or {}) | set(kb.get("kernels") or {})
        deltas = sorted(((n, (ka.get("kernels") or {}).get(n, 0.0)
                          - (kb.get("kernels") or {}).get(n, 0.0)) for n in names),
                        key=lambda kv: -abs(kv[1]))[:TOP]
        out.append({"module": m, "r_ms": a[m], "p_ms": b[m], "delta_ms": a[m] - b[m],
                    "kernels": [{"name": n, "delta_ms": d} for n, d in deltas]})
    return sorted(out, key=lambda d: -abs(d["delta_ms"]))


def short_kernel(name: str, limit: int = 60) -> str:
    """A kernel's name for a line: C++ template arguments dropped (`elementwise_kernel<...>`),
    at most `limit` characters; the record keeps the whole name."""
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            if depth == 0:
                out.append("<...>")
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    text = "".join(out).removeprefix("void ").strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."


# (side, the pairs of cells that differ only on that side (R there, P there), the phase that
# side's kernels run in): R/R vs P/R or R/P vs P/P for the training side, R/R vs R/P or P/R vs
# P/P for the rollout side (issue 43: never a pair that differs on both sides)
SIDE_PAIRS = (("training", (("R/R", "P/R"), ("R/P", "P/P")), "training"),
              ("rollout", (("R/R", "R/P"), ("P/R", "P/P")), "rollout"))


def _measured(records: dict[str, dict[str, Any]], r_case: str, p_case: str,
              phase: str) -> str:
    """'measured rollout phase R/R / R/P 1.08x (medians)' from the two cells' records."""
    key = "step_wall_time" if phase == "unknown" else f"{phase}_wall_time"
    a, b = (records.get(r_case) or {}).get(key), (records.get(p_case) or {}).get(key)
    what = "step" if phase == "unknown" else f"{phase} phase"
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or b <= 0:
        return f"measured {what}: not timed in both cells"
    return (f"measured {what} {r_case} / {p_case} {float(a) / float(b):.2f}x (the cells' medians; "
            "the performance statements judge it)")


def statements(records: list[dict[str, Any]]) -> list[str]:
    """Per hardware, module and side, for a pair of profiled cells that differ only on that
    side: the module's own kernel difference ("ffn, rollout side: R +3.1 ms/step over P
    (aten::mm +2.9)"), and, when another bucket differs more, that one too, next to the measured
    phase difference of the same two cells. Kernel sums, for localisation only."""
    cells: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    recs: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for rec in records:
        prof = rec.get("profile")
        if rec.get("case") in ("R/R", "P/R", "R/P", "P/P"):
            key = (str(rec.get("hardware")), str(rec.get("module")))
            recs.setdefault(key, {})[str(rec["case"])] = rec
            if isinstance(prof, dict) and prof.get("buckets"):
                cells.setdefault(key, {})[str(rec["case"])] = prof
    lines = []
    for (hw, module), by_case in sorted(cells.items()):
        for side, pairs, phase in SIDE_PAIRS:
            pair = next(((a, b) for a, b in pairs if a in by_case and b in by_case), None)
            if pair is None:
                if len(by_case) > 1:
                    lines.append(f"{hw} {module} profile, {side} side: no pair of profiled cells "
                                 f"differs only on the {side} side (profiled: "
                                 f"{', '.join(sorted(by_case))}; profile "
                                 f"{' or '.join(' and '.join(p) for p in pairs)})")
                continue
            rr, other = by_case[pair[0]], by_case[pair[1]]
            held = set((rr.get("buckets") or {}).get(side) or {}) | set(
                (other.get("buckets") or {}).get(side) or {})
            if phase not in held:  # a framework's trace without phase ranges: the whole trace
                if "unknown" not in held:
                    continue
                phase = "unknown"
            diffs = difference(rr, other, side, phase)
            own = next((d for d in diffs if d["module"] == module), None)
            shown = [own] if own is not None else []
            if diffs and diffs[0] is not own:
                shown.append(diffs[0])
            parts = []
            for x in shown:
                tops = ", ".join(f"{short_kernel(k['name'])} {k['delta_ms']:+.2f}"
                                 for k in x["kernels"] if k["delta_ms"])
                parts.append(f"{x['module']}, {side} side: R {x['delta_ms']:+.2f} ms/step over P "
                             f"({x['r_ms']:.2f} vs {x['p_ms']:.2f} ms/step"
                             + (f"; {tops}" if tops else "") + ")")
            unit = rr.get("unit") or "kernel time"
            where = "every phase (no phase ranges)" if phase == "unknown" else f"{phase} phase"
            lines.append(f"{hw} {module} profile, {where}, {pair[0]} vs {pair[1]} ({unit}; "
                         f"{PROFILE_NOTE.split(':')[0]}): " + "; largest: ".join(parts)
                         + f"; {_measured(recs[(hw, module)], pair[0], pair[1], phase)}")
    return lines


def attach_profile(record: dict[str, Any], run_dir: Path) -> None:
    """The latest profile run's ``profile.json`` into the record (``profile``), if any."""
    path = newest_followup(run_dir, "profile", PROFILE_SUMMARY, PROFILE_NOTE_FILE)
    if path is None:
        return
    try:
        data = json.loads(read_bytes(path, run_dir, 64 * 1024 * 1024))
        if not isinstance(data, dict) or not isinstance(data.get("buckets"), dict):
            raise ValueError("not a profile summary")
    except (Refused, ValueError, UnicodeDecodeError) as exc:
        data = {"buckets": {}, "problems": [f"{path.relative_to(run_dir)}: unreadable: {exc}"],
                "note": PROFILE_NOTE, "excluded_from_performance": True}
    data["profile_run"] = path.parent.name if path.name == PROFILE_SUMMARY else None
    record["profile"] = data


# ---------------------------------------------------------------------------------------------
# The profile run: a separate run of a finished cell, in its own directory.

PROFILE_NOTE_FILE = "profile-note.json"


def profile_plan(record: dict[str, Any], launcher: str = "local") -> str:
    """``"profile"`` (start a profile run) or why none may follow the cell's run."""
    from pytest_rlkernel_matrix.judge.localise.probe import probe_refusal

    why = probe_refusal(record)
    if why is None and launcher != "local":
        why = f"profile runs use the local launcher; this matrix uses {launcher!r}"
    return why or "profile"


def new_profile_dir(run_dir: Path) -> Path:
    """``<run dir>/profile``, else ``profile.2``, ...: never an existing one."""
    return new_dir(run_dir, "profile")


def profile_cell(run_dir: Path, *, command: str | list[str], cwd: Path, env: dict[str, str],
                 timeout: float, skip: int = 1, steps: int = 2,
                 write: Any = None) -> dict[str, Any]:
    """Run the cell's command again as a profile run (``skip`` unprofiled steps, then ``steps``
    under the profiler) in ``new_profile_dir``, and write its ``profile.json`` summary.

    ``env`` is the measured run's process env plus ``RL_KERNEL_PROFILE*``; the run's
    ``cell-run.json`` says ``excluded_from_performance``. A framework's job that writes its own
    torch.profiler traces should write them under ``$RL_KERNEL_PROFILE_DIR``."""
    from pytest_rlkernel_matrix.run.runner import ARTIFACT_SUBDIRS, run_cell_command
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    write = write or write_json_atomic
    pdir = new_profile_dir(run_dir)
    for sub in ARTIFACT_SUBDIRS.values():
        (pdir / sub).mkdir(exist_ok=True)
    penv = {**env, "RL_KERNEL_ARTIFACT_DIR": str(pdir),
            **{var: str(pdir / sub) for var, sub in ARTIFACT_SUBDIRS.items()},
            "RL_KERNEL_PROFILE": "1", "RL_KERNEL_PROFILE_DIR": str(pdir / "profile"),
            "RL_KERNEL_PROFILE_SKIP": str(skip), "RL_KERNEL_MATRIX_WARMUP": str(skip),
            "RL_KERNEL_MATRIX_REPEATS": str(steps),
            "RL_KERNEL_RUN_ID": env.get("RL_KERNEL_RUN_ID", run_dir.name) + "-profile"}
    result = run_cell_command(command, cwd=cwd, env=penv, timeout=timeout, artifact_dir=pdir,
                              raise_on_interrupt=True)
    write(pdir / "cell-run.json", {
        "profile": True, "excluded_from_performance": True, "profile_of": run_dir.name,
        "run": result.as_dict(), "skip_steps": skip, "profiled_steps": steps,
        "env": {k: penv[k] for k in sorted(penv) if k.startswith("RL_KERNEL_PROFILE")}})
    summary = summarise(pdir / "profile", steps, root=run_dir)
    if result.exit_code != 0:
        summary["problems"].insert(0, f"the profile run exited {result.exit_code}"
                                   f"{' (timed out)' if result.timed_out else ''}: see "
                                   f"{pdir.name}/run.log")
    write(pdir / PROFILE_SUMMARY, summary)
    return summary


def write_profile_note(run_dir: Path, why: str, write: Any = None) -> None:
    """``<run dir>/profile-note.json``: no profile run, and why (the record's ``profile``)."""
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    (write or write_json_atomic)(run_dir / PROFILE_NOTE_FILE, {
        "buckets": {}, "note": PROFILE_NOTE, "excluded_from_performance": True,
        "problems": [f"no profile run: {why}"]})


def follow_profile(matrix: Any, run_dir: Path, job: Any, record: dict[str, Any],
                   write: Any = None, names: tuple[str, ...] = ()) -> bool:
    """After a cell's run (``names``: the cells sharing it), with ``[profile] when = "always"``
    (or ``--rlk-profile``) and the cell among ``[profile] cells``: its profile run, or
    ``profile-note.json`` saying why none; True when either was written."""
    if not matrix.profile.chooses(names):
        return False
    plan = profile_plan(record, matrix.runner.launcher)
    if plan != "profile":
        write_profile_note(run_dir, plan, write)
        return True
    profile_cell(run_dir, command=job.command, cwd=job.cwd, env=dict(job.env),
                 timeout=matrix.runner.timeout, skip=matrix.profile.skip,
                 steps=matrix.profile.steps, write=write)
    return True


def terminal_lines(records: list[dict[str, Any]]) -> list[str]:
    """The terminal's profile lines: each R-vs-P difference and, once, what the figures are."""
    lines = statements(records)
    notes = {str(p) for r in records if isinstance(r.get("profile"), dict)
             for p in (r["profile"].get("problems") or [])[:1]}
    lines += [f"profile: {n}" for n in sorted(notes)]
    if lines:
        lines.append(f"profile figures are {PROFILE_NOTE}")
    return lines
