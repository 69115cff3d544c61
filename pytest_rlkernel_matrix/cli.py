"""`rlk-matrix`: work on matrix roots without re-running cells.

- `rlk-matrix preflight [--matrix FILE] [--output DIR]`: only the preflight (fingerprints, raw
  command output, capabilities of the R provider the matrix file uses, the detected profile);
- `rlk-matrix report <matrix-root> [--output FILE] [--jobs N] [--no-cache]`: re-read every run
  directory's artifacts (in parallel; unchanged ones from the analysis cache) and rewrite
  `matrix-report.json` (the request's `analyze-ablation-matrix.py --matrix-root --output`);
- `rlk-matrix table <matrix-report.json>`: drift and phase times per cell as a markdown table;
- `rlk-matrix merge a.json b.json [...] -o out.json`: reports from different hardware side by side
  (never a ratio across hardware, builds or topologies);
- `rlk-matrix latest <rerun-root> [-o out.json]`: the whole matrix after reruns (`--lf`, `-k`):
  each cell's latest verdict and the root it came from, following each report's `rerun_of`;
- `rlk-matrix compare old.json new.json [thresholds]`: per-cell changes; exit 1 past a threshold;
- `rlk-matrix init [DIR] [--engines]`: write a starter `DIR/matrix.toml` (the repo's `matrix.toml`,
  or with `--engines` its `examples/engines.toml`, shipped in the package); never overwrites.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_rlkernel_matrix import __version__
from pytest_rlkernel_matrix.spec.terms import plural
from pytest_rlkernel_matrix.store.safeio import (
    MAX_REPORT_BYTES,
    Refused,
    read_json,
    read_text,
    write_new_text,
)


def _matrix_file(option: str | None) -> Path | None:
    """`--matrix PATH`, else `./matrix.toml` when it exists, else None."""
    if option:
        return Path(option)
    default = Path("matrix.toml")
    return default if default.is_file() else None


def _shorten(text: str, width: int) -> str:
    """One line of at most `width` characters, cut at a word boundary."""
    return textwrap.shorten(" ".join(str(text).split()), width=max(width, 20), placeholder=" ...")


def _wrap(head: str, text: str, width: int, indent: int = 16) -> list[str]:
    """`head` + `text` wrapped at word boundaries; continuation lines indented."""
    return textwrap.wrap(head + " ".join(str(text).split()), width=max(width, 40),
                         subsequent_indent=" " * indent, break_long_words=False,
                         break_on_hyphens=False) or [head]


def _preflight(args: argparse.Namespace) -> int:
    from pytest_rlkernel_matrix.machine import preflight as pf
    from pytest_rlkernel_matrix.machine.capability import capability_report, runner_capabilities
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    matrix_path = _matrix_file(args.matrix)
    matrix = None
    if matrix_path is not None:
        from pytest_rlkernel_matrix.spec.matrix import MatrixFileError, load_matrix

        try:
            matrix = load_matrix(matrix_path)
        except MatrixFileError as exc:
            print(f"rlk-matrix: {exc}", file=sys.stderr)
            return 2
    out = Path(args.output)
    target = out / "preflight.json"
    if target.exists():
        print(f"rlk-matrix: {target} exists; refusing to overwrite", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "preflight-raw"
    raw.mkdir(exist_ok=True)
    kwargs: dict[str, object] = {}
    if matrix is not None:
        section = matrix.preflight

        def where(value: str | None) -> Path | None:
            return (matrix_path.parent / os.path.expandvars(value)).resolve() if value else None

        kwargs = {"checkpoint": where(section.checkpoint), "tokenizer": where(section.tokenizer),
                  "timeout": section.timeout}
    # The probe runs in the Python the cells use ($PYTHON_BIN), as in a matrix session.
    data = pf.collect_preflight(python=os.environ.get("PYTHON_BIN") or sys.executable,
                                raw_dir=raw, **kwargs)  # type: ignore[arg-type]
    gpu = data.get("gpu", {})
    assert isinstance(gpu, dict)
    profile = pf.detect_hardware(data, matrix.hardware) if matrix is not None else None
    backend = str(gpu.get("backend") or "cpu")
    if matrix is not None and profile is not None:
        hw = matrix.hardware[profile]
        backend = str(getattr(hw.backend, "value", hw.backend))
        topology = hw.topology.model_dump()
        usable = (gpu.get("visible") or {}).get("count", gpu.get("count")) or 0
        data["topology"] = topology
        data["topology_check"] = pf.check_topology(topology,
                                                   min(int(usable), int(gpu.get("count") or 0)))
    if args.r_provider:
        provider_from = "--r-provider"
        caps = capability_report(data, backend, r_provider=args.r_provider)
    elif matrix is not None:
        caps = runner_capabilities(data, backend, matrix.runner.command, matrix.runner.r_provider)
        asked = matrix.runner.r_provider
        provider_from = (f"{matrix_path}: [runner] r_provider = {asked}" if asked != "auto"
                         else f"{matrix_path}: [runner] command, r_provider = auto")
    else:
        provider_from = "no matrix file, so the default; pass --matrix or --r-provider"
        caps = capability_report(data, backend, r_provider="rl_engine")
    data["capabilities"] = caps
    data["matrix"] = {"file": str(matrix_path) if matrix_path else None, "profile": profile,
                      "r_provider": caps["r_provider"], "r_provider_from": provider_from}
    hw_fp, build_fp = pf.fingerprint(data)
    write_json_atomic(target, data)
    for line in preflight_summary(data, target, matrix_path, matrix, profile, provider_from,
                                  (hw_fp, build_fp)):
        print(line)
    return 0


def preflight_summary(data: dict[str, object], target: Path, matrix_path: Path | None,
                      matrix: object, profile: str | None, provider_from: str,
                      fingerprints: tuple[str, str]) -> list[str]:
    """A short human summary of a preflight; the whole record stays in preflight.json."""
    width = shutil.get_terminal_size((100, 24)).columns
    gpu = data.get("gpu") or {}
    probe = data.get("probe") or {}
    caps = data["capabilities"]
    assert isinstance(gpu, dict) and isinstance(probe, dict) and isinstance(caps, dict)
    torch = probe.get("torch") or {}
    names = sorted({str(n) for n in gpu.get("names") or []})
    count = int(gpu.get("count") or 0)
    gpus = f"{plural(count, 'GPU')}: {', '.join(names)}" if count else "no GPU"
    machine = f"backend {gpu.get('backend') or 'cpu'}, {gpus}; torch {torch.get('version') or '-'}"
    lines = [f"preflight: {target}", *_wrap("  machine:      ", machine, width - 1)]
    rocm = data.get("rocm") or {}
    assert isinstance(rocm, dict)
    for key, what in (("build_arch_mismatch", "PYTORCH_ROCM_ARCH"),
                      ("ext_arch_mismatch", "the rl_engine._C binary")):
        if rocm.get(key):
            runtime = ", ".join(rocm.get("runtime_gfx_archs") or [])
            lines += _wrap("  ROCm archs:   ", f"runtime {runtime}; {what} does not cover "
                           f"{', '.join(rocm[key])} ({key})", width - 1)
    if probe.get("status") != "ok":
        lines.append("  probe:        " + _shorten(f"{probe.get('status')}: "
                                                  f"{probe.get('error') or ''}", width - 16))
    if matrix_path is None:
        lines.append("  matrix:       none (no --matrix, no ./matrix.toml): no profile detected")
    elif profile is None:
        known = ", ".join(getattr(matrix, "hardware", {}))
        lines.append(f"  matrix:       {matrix_path}: no [hardware.<name>] profile matches "
                     f"this machine (profiles: {known})")
    else:
        lines.append(f"  matrix:       {matrix_path}: profile {profile} detected")
    entries = caps.get("capabilities") or {}
    r_state = ", ".join(f"{k.removeprefix('r_backend.')} {e.get('status')}"
                        for k, e in entries.items() if k.startswith("r_backend."))
    lines += _wrap("  R kernels:    ", f"{caps['r_provider']} ({provider_from}): {r_state}",
                   width - 1)
    summary = caps.get("summary") or {}
    lines.append("  capabilities: " + ", ".join(f"{n} {s}" for s, n in summary.items()))
    grouped: dict[tuple[str, str], list[str]] = {}
    for key, entry in entries.items():
        if entry.get("status") in ("unavailable", "untested"):
            grouped.setdefault((str(entry["status"]), str(entry.get("reason") or "")),
                               []).append(key)
    for (status, reason), keys in sorted(grouped.items(), key=lambda kv: kv[0][0]):
        head = f"    {status}, {reason}: " if reason else f"    {status}: "
        lines += _wrap(head, ", ".join(keys), width - 1, indent=6)
    lines.append(f"  fingerprints: hardware {fingerprints[0]}, build {fingerprints[1]}")
    lines.append("  (every check in full: the JSON; raw command output: preflight-raw/)")
    return lines


def summary_line(report: dict[str, object], path: Path) -> str:
    """One line like pytest's: counts per verdict and the timings mark, cells, completeness,
    where the report is."""
    from pytest_rlkernel_matrix.report.matrix_report import counts_text

    summary = report.get("summary") or {}
    timings = report.get("timings")
    assert isinstance(summary, dict)
    counts = counts_text(summary, timings if isinstance(timings, dict) else None)
    cells = report.get("cells") or []
    expected = report.get("expected_cells")
    state = ("interrupted" if report.get("interrupted")
             else "complete" if report.get("complete") else "incomplete")
    of = f" of {expected}" if expected is not None else ""
    noun = "cell" if (expected if expected is not None else len(cells)) == 1 else "cells"
    return f"{counts} in {len(cells)}{of} {noun} ({state}): {path}"  # type: ignore[arg-type]


def _report(args: argparse.Namespace) -> int:
    from pytest_rlkernel_matrix.report.reanalyze import reanalyze

    root = Path(args.matrix_root)
    from pytest_rlkernel_matrix.run.rootlock import RootError, claim

    empty = f"rlk-matrix: {root} holds no matrix run (no */*/cell-run.json)"
    if not root.is_dir():
        print(empty, file=sys.stderr)
        return 2
    try:
        lock = claim(root, "rlk-matrix")  # never rewrite a report under a running session
    except RootError as exc:
        print(f"rlk-matrix: {exc}", file=sys.stderr)
        return 2
    try:
        if not any(root.glob("*/*/cell-run.json")) and not _ours(root / "matrix-report.json"):
            print(empty, file=sys.stderr)
            return 2
        if args.jobs is not None and args.jobs < 1:
            print("rlk-matrix: --jobs must be at least 1", file=sys.stderr)
            return 2
        path = reanalyze(root, Path(args.output) if args.output else None, jobs=args.jobs,
                         use_cache=not args.no_cache,
                         log=lambda line: print(line, file=sys.stderr))
    finally:
        lock.release()
    report = json.loads(read_text(path, path.parent, MAX_REPORT_BYTES))
    print(summary_line(report, path))
    return 0


def _find_cell(root: Path, cell: str) -> Path | None:
    """The run directory of `cell`: `<hardware>/<slug>`, or "[hardware] module case"."""
    if (root / cell / "cell-run.json").is_file():
        return root / cell
    for meta_path in sorted(root.glob("*/*/cell-run.json")):
        try:
            c = read_json(meta_path, root).get("cell") or {}
        except (OSError, ValueError, AttributeError, RecursionError, Refused):
            continue
        names = {f"{c.get('module')} {c.get('case')}",
                 f"{c.get('hardware')} {c.get('module')} {c.get('case')}"}
        if cell in names:
            return meta_path.parent
    return None


def _probe(args: argparse.Namespace) -> int:
    """Probe one finished cell afterwards: a separate probe run, then the report rewritten."""
    import shlex

    from pytest_rlkernel_matrix.judge.localise.probe import probe_cell, probe_refusal
    from pytest_rlkernel_matrix.report.reanalyze import reanalyze
    from pytest_rlkernel_matrix.run.rootlock import RootBusy, claim
    from pytest_rlkernel_matrix.store.redact import REDACTED

    root = Path(args.matrix_root)
    run_dir = _find_cell(root, args.cell) if root.is_dir() else None
    if run_dir is None:
        print(f"rlk-matrix: no finished cell {args.cell!r} under {root} (give <hardware>/<slug> "
              "or 'module case')", file=sys.stderr)
        return 2
    try:
        meta = read_json(run_dir / "cell-run.json", root)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, RecursionError, Refused) as exc:
        print(f"rlk-matrix: {run_dir}/cell-run.json unreadable: {exc}", file=sys.stderr)
        return 2
    command = (meta.get("run") or {}).get("command")
    if not command:
        print(f"rlk-matrix: {run_dir}/cell-run.json records no command", file=sys.stderr)
        return 2
    why = probe_refusal({k: (meta.get("run") or {}).get(k) for k in ("exit_code", "timed_out")})
    if why is not None:  # a probe run follows only a completed run
        print(f"rlk-matrix: no probe run of {run_dir}: {why}", file=sys.stderr)
        return 2
    cwd = Path.cwd()
    case_env = run_dir / "matrix-case.env"
    if case_env.is_file():
        for line in read_text(case_env, root).splitlines():
            if line.startswith("#   cd "):
                cwd = Path(shlex.split(line[len("#   cd "):].split(" && ")[0])[0])
                break
    recorded = meta.get("env") or {}
    redacted = sorted(k for k, v in recorded.items() if v == REDACTED)
    if redacted:
        print(f"rlk-matrix: secret variables are not in the record and are taken from this "
              f"shell: {', '.join(redacted)}", file=sys.stderr)
    env = {**os.environ, **{k: str(v) for k, v in recorded.items() if v != REDACTED}}
    try:
        lock = claim(root, "rlk-matrix")
    except RootBusy as exc:
        print(f"rlk-matrix: {exc}", file=sys.stderr)
        return 2
    try:
        loc = probe_cell(run_dir, command=command, cwd=cwd, env=env,
                         timeout=float(meta.get("timeout") or 3600), budget=args.tokens,
                         controls=args.controls)
        path = reanalyze(root)
    finally:
        lock.release()
    c = meta.get("cell") or {}
    print(f"{c.get('module')} {c.get('case')}: {loc['summary']}")
    print(f"probe run: {run_dir / loc['probe_run']}; report: {path}")
    return 0 if loc.get("status") != "incomparable" else 1


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio_cell(r: Any) -> str:
    """'1.23 [1.10, 1.38] slower' or '1.05 [0.93, 1.21] no conclusion: noise' (the reason the
    attribution gives, `no_conclusion_reason`)."""
    from pytest_rlkernel_matrix.report.attribution import no_conclusion_reason

    words = r.conclusion
    if words.startswith("no conclusion"):
        words = no_conclusion_reason([r])
    if r.ratio is None:
        return f"- ({words})"
    ci = "" if r.low is None else f" [{r.low:.2f}, {r.high:.2f}]"
    return f"{r.ratio:.2f}{ci} {words}"


def markdown_table(report: dict[str, object]) -> list[str]:
    """Drift, phase times and time ratios (with their intervals) per cell, as a markdown table.

    A ratio is a conclusion only under the rule of `stats.py` (enough steps and processes,
    spread under the limit, interval excluding 1, usable timings); otherwise it reads "no
    conclusion: ...". Every ratio has the direction of the terminal's attribution (`DIRECTION`):
    the R/R baseline's time over the cell's, i.e. time with R over time with P.
    """
    from pytest_rlkernel_matrix.judge.performance.accounting import table_cell as unattributed_cell
    from pytest_rlkernel_matrix.judge.performance.stats import DIRECTION, level
    from pytest_rlkernel_matrix.report.attribution import (
        SIDES,
        comparisons,
        family_policy,
        side_ratios,
        timing_ratio,
    )

    cells = report["cells"]
    assert isinstance(cells, list)
    policy = family_policy(cells)  # the intervals widened for the report's comparisons
    base = {(c["hardware"], c["module"]): c for c in cells if c["case"] == "R/R"}
    native = {(c["hardware"], c["module"]): c for c in cells if c["case"] == "P/P"}
    level_ = level(policy.confidence)
    lines = [
        "| hardware | module | case | verdict | mismatches / active | max abs dlogp | "
        "mean abs dlogp | rollout s | training s | sync s | unattributed s (share) | step s | "
        f"steps | step time, R/R baseline / this cell ({DIRECTION}) [{level_} CI] |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in cells:
        rr = base.get((c["hardware"], c["module"]))
        shown = "-"
        if rr is not None and c is not rr and c.get("step_wall_time") is not None:
            if c["case"] in {case for _, case, _ in SIDES}:
                # The attribution's own step ratio for that side (its phase must carry it).
                shown = _ratio_cell(side_ratios(rr, c, policy)[1])
            else:
                shown = _ratio_cell(timing_ratio(rr, c, "step_wall_time", "", policy))
        elif c is rr:
            shown = "baseline"
        n = ((c.get("phase_spread") or {}).get("step_wall_time") or {}).get("n")
        lines.append(
            f"| {c['hardware']} | {c['module']} | {c['case']} | {c['verdict']} | "
            f"{_fmt(c.get('mismatch_count'), ',')} / {_fmt(c.get('active_token_count'), ',')} | "
            f"{_fmt(c.get('logprob_abs_diff_max'), '.3g')} | "
            f"{_fmt(c.get('logprob_abs_diff_mean'), '.3g')} | "
            f"{_fmt(c.get('rollout_wall_time'), '.2f')} | "
            f"{_fmt(c.get('training_wall_time'), '.2f')} | "
            f"{_fmt(c.get('weight_sync_wall_time'), '.3f')} | {unattributed_cell(c)} | "
            f"{_fmt(c.get('step_wall_time'), '.2f')} "
            f"| {_fmt(n, 'd')} | {shown} |"
        )
    lines += ["", "| hardware | module | step time, R/R run / this module's P/P run "
              f"(R over P for the module, not the case R/P) [{level_} CI] |", "| --- | --- | --- |"]
    for key, rr in base.items():
        pp = native.get(key)
        if pp and rr.get("step_wall_time") and pp.get("step_wall_time"):
            lines.append(f"| {key[0]} | {key[1]} | "
                         f"{_ratio_cell(timing_ratio(rr, pp, 'step_wall_time', '', policy))} |")
    lines += ["", f"Rule: a ratio is a conclusion only with at least {policy.min_steps} measured "
              f"steps and {policy.min_processes} processes per cell, a relative spread at most "
              f"{policy.max_relative_spread:.0%}, usable (uncontaminated) timings and a {level_} "
              "Welch t interval over the processes' steady-state locations excluding 1 (two "
              "cells; the report's statements are the 2x2 factorial's), the declared confidence "
              f"widened for the report's {comparisons(cells)} comparisons (Bonferroni); with one "
              "process per cell no interval is shown."]
    return lines


def _ours(path: Path) -> bool:
    """Whether `path` is the plugin's matrix-report.json (its schema_version), not RL-Kernel's
    debug session report of the same name (`debug_matrix_report.v2`, `groups`)."""
    from pytest_rlkernel_matrix.report.merge import MergeError, load_report

    try:
        load_report(path)
    except (MergeError, OSError):
        return False
    return True


def _table(args: argparse.Namespace) -> int:
    from pytest_rlkernel_matrix.report.merge import MergeError, load_report

    try:  # the plugin's own report only (RL-Kernel's `rlk debug` writes a matrix-report.json
        report = load_report(Path(args.report))  # of its own: debug_matrix_report.v2)
    except (MergeError, OSError) as exc:
        print(f"rlk-matrix: {exc}", file=sys.stderr)
        return 2
    print("\n".join(markdown_table(report)))
    return 0


def _merge(args: argparse.Namespace) -> int:
    from pytest_rlkernel_matrix.report.html import write_html
    from pytest_rlkernel_matrix.report.merge import MergeError, load_report, merge_reports, render
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    out = Path(args.output)
    inputs = [Path(p) for p in args.reports]
    if any(p.resolve() == out.resolve() for p in inputs):
        print(f"rlk-matrix: output {out} is one of the inputs; refusing", file=sys.stderr)
        return 2
    try:
        merged = merge_reports([(p, load_report(p)) for p in inputs],
                               allow_duplicates=args.allow_duplicates)
    except MergeError as exc:
        print(f"rlk-matrix: {exc}", file=sys.stderr)
        return 2
    write_json_atomic(out, merged)
    html = write_html(merged, out.with_suffix(".html"))
    print("\n".join(render(merged)))
    print(f"merged: {summary_line(merged, out)} (html {html})")
    return 0


def _latest(args: argparse.Namespace) -> int:
    from pytest_rlkernel_matrix.report.html import write_html
    from pytest_rlkernel_matrix.report.merge import MergeError
    from pytest_rlkernel_matrix.report.rerun import chain, latest, render
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    try:
        reports = chain(Path(args.root))
        combined = latest(reports)
    except MergeError as exc:
        print(f"rlk-matrix: {exc}", file=sys.stderr)
        return 2
    print("reports (oldest first): " + ", ".join(str(p) for p, _ in reports))
    print("\n".join(render(combined)))
    if args.output:
        out = Path(args.output)
        if out.exists():
            print(f"rlk-matrix: {out} exists; artifacts are never overwritten", file=sys.stderr)
            return 2
        write_json_atomic(out, combined)
        write_html(combined, out.with_suffix(".html"))
    print(f"latest: {summary_line(combined, Path(args.output or args.root))}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from pytest_rlkernel_matrix.report.compare import Thresholds, compare_reports, render
    from pytest_rlkernel_matrix.report.merge import MergeError, load_report
    from pytest_rlkernel_matrix.store.atomic import write_json_atomic

    try:
        old, new = load_report(Path(args.old)), load_report(Path(args.new))
        thresholds = Thresholds(args.max_drift_increase, args.max_mismatch_increase,
                                args.max_time_increase_pct, args.fail_on_verdict_change)
        result = compare_reports(old, new, thresholds, old_name=args.old, new_name=args.new,
                                 accept_build_change=args.accept_build_change)
    except (MergeError, ValueError) as exc:
        print(f"rlk-matrix: {exc}", file=sys.stderr)
        return 2
    print("\n".join(render(result)))
    if args.json:
        write_json_atomic(Path(args.json), result)
    return 1 if result["violations"] else 0


TEMPLATES = {False: "matrix.toml", True: "engines.toml"}  # --engines -> shipped template


def template_text(engines: bool) -> str:
    """The starter matrix file shipped in the package (`templates/`)."""
    from importlib.resources import files

    return (files("pytest_rlkernel_matrix") / "templates" / TEMPLATES[engines]).read_text(
        encoding="utf-8")


WEIGHTS_NOTE = (
    "note: the claim weights_bitwise (baseline_claims) needs a rollout-side weight audit,\n"
    "  weight-audit/rollout/<version>.json (version, scope \"rollout_loaded_parameters\", sha256,\n"
    "  tensor_count, tensors), written by the rollout engine after each weight sync. RL-Kernel's\n"
    "  vime integration writes only the training side (weight-audit/<version>.json): a launcher\n"
    "  that drives vime must add it, or the claim is \"not judged\" (docs/en/verdicts.md).")


def _init(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    target = directory / "matrix.toml"
    if target.exists() or target.is_symlink():
        print(f"rlk-matrix: {target} exists; refusing to overwrite (remove it or pick another "
              "directory)", file=sys.stderr)
        return 2
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_new_text(target, template_text(args.engines))  # never replaces nor follows
    except FileExistsError:
        print(f"rlk-matrix: {target} exists; refusing to overwrite", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"rlk-matrix: cannot write {target}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    here = shlex.quote(str(directory))
    print(f"wrote {target}")
    if args.engines:
        print("next, once (torch==2.13.0 installed first):\n"
              '  pip install "pytest-rlkernel-matrix[engines]"\n'
              "  pip uninstall -y torchvision torchaudio torchcodec\n"
              "  python -m pytest_rlkernel_matrix.engines.checkpoint "
              f"{shlex.quote(str(directory / '.rlk-engines' / 'tiny-qwen3'))}\n"
              f"then: cd {here} && pytest   (`pytest --rlk-plan` lists the cells)")
    else:
        print(f"next: cd {here} && pytest   (`pytest --rlk-plan` lists the cells; the built-in "
              "reference workload needs torch)")
    print(WEIGHTS_NOTE)
    return 0


def docs_dir() -> Path | None:
    """This installation's manual: shipped in the wheel (`pytest_rlkernel_matrix/docs/`, copied
    there by setup.py's build step) or, in a checkout or editable install, the repository's
    `docs/` beside the package. None when neither holds it."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "docs", package.parent / "docs"):
        if (candidate / "index.md").is_file() and (candidate / "en" / "index.md").is_file():
            return candidate
    return None


def docs_epilog() -> str:
    """Where to read, for `rlk-matrix --help`."""
    where = docs_dir()
    if where is None:
        return ("documentation: not found in this installation; it is docs/ in the source "
                "distribution (docs/index.md)")
    return "\n".join((
        "documentation (this installation's copy):",
        f"  start here (English en/, Chinese zh/): {where / 'index.md'}",
        f"  the matrix and matrix.toml:            {where / 'en' / 'matrix.md'}",
        f"  verdicts and the report:               {where / 'en' / 'verdicts.md'}",
        f"  what a launcher writes (required keys): {where / 'artifact-format.md'}",
        f"  the real engines (vLLM + Megatron):    {where / 'en' / 'engines.md'}"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlk-matrix", description=__doc__.splitlines()[0],
                                     epilog=docs_epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("preflight", help="fingerprint this machine and software; run nothing")
    p.add_argument("--output", default=".", help="directory for preflight.json (default: .)")
    p.add_argument("--matrix", default=None, metavar="FILE",
                   help="matrix file whose [runner] picks the R provider and whose [hardware.*] "
                   "profiles are matched (default: ./matrix.toml when present)")
    p.add_argument("--r-provider", choices=("rl_engine", "workload"), default=None,
                   help="whose R kernels to check: RL-Kernel's or the built-in reference "
                   "workload's (default: from the matrix file's [runner]; rl_engine without one)")
    p.set_defaults(func=_preflight)
    r = sub.add_parser("report", help="re-read a matrix root's artifacts; rewrite the report")
    r.add_argument("matrix_root")
    r.add_argument("--output", default=None,
                   help="report path (default: <matrix-root>/matrix-report.json)")
    r.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="cells analysed at once, one process each (default: the CPUs this "
                   "process may use)")
    r.add_argument("--no-cache", action="store_true",
                   help="read every run directory again, ignoring <matrix-root>/.rlk-cache/")
    r.set_defaults(func=_report)
    pr = sub.add_parser("probe", help="probe one finished cell: its first divergent operator")
    pr.add_argument("matrix_root")
    pr.add_argument("cell", help="<hardware>/<slug> (its run directory) or 'module case'")
    pr.add_argument("--tokens", type=int, default=8, help="probe token budget")
    pr.add_argument("--controls", type=int, default=2, help="matching tokens as controls")
    pr.set_defaults(func=_probe)
    t = sub.add_parser("table", help="markdown table of a report: drift, times, R/P ratio")
    t.add_argument("report")
    t.set_defaults(func=_table)
    m = sub.add_parser("merge", help="reports from different hardware side by side (no ratios)")
    m.add_argument("reports", nargs="+", help="matrix-report.json files (two or more)")
    m.add_argument("-o", "--output", required=True,
                   help="merged report path; the HTML goes next to it (.html)")
    m.add_argument("--allow-duplicates", action="store_true",
                   help="keep a (hardware, module, case) found in several inputs")
    m.set_defaults(func=_merge)
    lt = sub.add_parser("latest", help="the whole matrix after reruns: each cell's latest "
                        "verdict and the root it came from (follows each report's rerun_of)")
    lt.add_argument("root", help="the last rerun's matrix root (or its matrix-report.json)")
    lt.add_argument("-o", "--output", default=None,
                    help="also write the combined report there (and its .html)")
    lt.set_defaults(func=_latest)
    c = sub.add_parser("compare", help="per-cell changes old -> new; exit 1 past a threshold")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--max-drift-increase", type=float, default=None, metavar="X",
                   help="fail when a cell's max |dlogp| rises by more than X")
    c.add_argument("--max-mismatch-increase", type=int, default=None, metavar="N",
                   help="fail when a cell's mismatch_count rises by more than N")
    c.add_argument("--max-time-increase-pct", type=float, default=None, metavar="P",
                   help="fail when a comparable step/rollout/training time rises by more than P%%")
    c.add_argument("--fail-on-verdict-change", action="store_true",
                   help="fail when any matched cell's verdict changes")
    c.add_argument("--accept-build-change", action="store_true",
                   help="compare times across different builds (same hardware fingerprint "
                   "still required): the regression gate for a new commit")
    c.add_argument("--json", default=None, metavar="FILE", help="write the comparison as JSON")
    c.set_defaults(func=_compare)
    i = sub.add_parser("init", help="write a starter matrix.toml (never overwrites one)",
                       epilog=docs_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("dir", nargs="?", default=".", help="directory for matrix.toml (default: .)")
    i.add_argument("--engines", action="store_true",
                   help="the real-engines matrix (vLLM + Megatron-core; en/engines.md of "
                   "the documentation below) "
                   "instead of the built-in reference workload")
    i.set_defaults(func=_init)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()
    except BrokenPipeError:
        # `rlk-matrix table | head`: the reader has what it wanted. Point stdout at devnull so
        # the interpreter's final flush does not raise again; exit as a piped tool does.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, as the shell reports a tool stopped by its reader
    return code


if __name__ == "__main__":
    sys.exit(main())
