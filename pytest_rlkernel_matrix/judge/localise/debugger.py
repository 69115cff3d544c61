"""Localisation from RL-Kernel's consistency debugger: the first divergent boundary of a capture
bundle or of a Qwen3 layer replay, judged by upstream's own comparison rules, and a cross-check
against the `diagnostic-report.json` upstream wrote for it.

Upstream's rules (RL-Align/RL-Kernel `rl_engine/alignment/debug/core.py` and `evidence.py` at
82fd031, `qwen3_report.py` at 4d39c20), applied here to numpy arrays:

- **bits**: two rows are equal when they have one shape and dtype, every element's bytes agree
  (so +0.0 and -0.0 differ) and every value is finite (a NaN or Inf never passes: the comparison
  is "invalid" and the bundle not comparable);
- **stitching**: each side's rows are put together per logical position from its records' feature
  pieces (`feature_offsets`): replicas of one piece must agree bit for bit, pieces must tile the
  features from 0 without a gap or overlap up to the one declared width (`feature_sizes`), all
  shards of one dtype; every declared position must be covered;
- **manifest**: a record's width must be the manifest's (or non-empty for a dynamic width); the
  contracts of a side's replicas must agree and hold every required key; the two sides'
  observed contracts must agree; the runtime identities (weights, tokens, positions, mask,
  sampling) of every record must be one;
- **status**: `not_comparable` when any rule fails, else `diverged` when a boundary differs, else
  `equal`; the first divergence is the first boundary in the manifest's (semantic) order with a
  differing position, at its first such position; `input_evidence` says whether its declared
  inputs were equal, different or unknown.

A bundle that cannot be read, or whose comparison is `not_comparable`, fails the cell closed:
its reasons go to the evidence problems. So does a disagreement with upstream's own report (its
status or first divergence), naming both.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pytest_rlkernel_matrix.judge.read.capture import (
    SIDES,
    Bundle,
    Piece,
    Replay,
    find,
    read_bundle,
    read_replay,
)

# qwen3_report.STAGES at 4d39c20: the stages of one decoder layer in execution order
STAGES = ("input", "attention_norm", "q_projection", "k_projection", "v_projection", "q_norm",
          "k_norm", "query", "key", "value", "attention_core", "attention_output",
          "attention_residual", "mlp_norm", "mlp_gate", "mlp_up", "mlp_activation",
          "mlp_output", "output", "logits", "logp")
_DEPENDENCIES = {"q_norm": ("q_projection",), "k_norm": ("k_projection",),
                 "attention_core": ("query", "key", "value"),
                 "mlp_activation": ("mlp_gate", "mlp_up"), "mlp_output": ("mlp_activation",)}


def stage_module(stage: str) -> str:
    """qwen3_report._module: the module a layer stage belongs to."""
    if stage.startswith("mlp"):
        return "ffn"
    if stage in {"logits", "logp"}:
        return "logp"
    if stage == "output":
        return "residual"
    return "attention" if stage != "input" else "upstream"


def bitdiff(left: np.ndarray, right: np.ndarray) -> dict[str, Any]:
    """core.bitdiff on numpy rows: storage bits (signed zero included), nonfinite refused."""
    if left.shape != right.shape or left.dtype != right.dtype:
        return {"comparable": False, "reason": "shape_or_dtype",
                "left": [list(left.shape), str(left.dtype)],
                "right": [list(right.shape), str(right.dtype)]}
    if not left.size:
        return {"comparable": False, "reason": "empty_tensor"}
    width = left.dtype.itemsize
    lb = np.ascontiguousarray(left).reshape(-1).view(np.uint8).reshape(-1, width)
    rb = np.ascontiguousarray(right).reshape(-1).view(np.uint8).reshape(-1, width)
    mismatch = (lb != rb).any(axis=1)
    finite = bool(np.isfinite(left).all() and np.isfinite(right).all()) \
        if left.dtype.kind == "f" else True
    hits = np.flatnonzero(mismatch)
    first = int(hits[0]) if hits.size else None
    return {
        "comparable": True, "finite": finite, "equal": finite and not hits.size,
        "elements": int(left.size), "bitwise_mismatches": int(hits.size),
        "first_index": None if first is None else [int(i) for i in
                                                    np.unravel_index(first, left.shape)],
        "max_abs_diff": float(np.abs(left.astype(np.float64) - right.astype(np.float64)).max())
        if finite else None,
    }


def stitch(pieces: Iterable[Piece], stage: str, selected: set[int],
           ) -> tuple[dict[int, np.ndarray], list[str]]:
    """core._stitch: logical rows per position from feature pieces, replicas checked."""
    rows: dict[int, dict[int, np.ndarray]] = {}
    errors: list[str] = []
    widths: set[int | None] = set()
    dtypes: set[str] = set()
    for piece in pieces:
        dtypes.add(piece.dtype)
        widths.add(piece.width)
        for index, position in enumerate(piece.positions):
            if position not in selected:
                continue
            have = rows.setdefault(position, {})
            row = piece.value[index].reshape(-1)
            if piece.offset in have:
                if not bitdiff(have[piece.offset], row).get("equal"):
                    errors.append(f"{stage}: replica disagreement at token {position}, "
                                  f"feature {piece.offset}")
            else:
                have[piece.offset] = row
    result: dict[int, np.ndarray] = {}
    if len(dtypes) > 1:
        errors.append(f"{stage}: shard dtypes differ; implicit promotion is not bitwise evidence")
    for position, have in rows.items():
        cursor, joined = 0, []
        for offset, value in sorted(have.items()):
            if offset != cursor:
                errors.append(f"{stage}: gap/overlap at token {position}, feature {cursor}")
                break
            cursor += value.size
            joined.append(value)
        else:
            if len(widths) != 1 or None in widths or cursor != next(iter(widths)):
                errors.append(f"{stage}: incomplete or unknown feature coverage at token "
                              f"{position}")
            result[position] = np.concatenate(joined)
    return result, errors


def _dtype_mismatch(dtypes: Mapping[str, set[str]]) -> str | None:
    """core.bitdiff's `shape_or_dtype`: the two sides' stored dtypes must be one (a bfloat16
    side against a float32 side is not comparable upstream; nothing is widened to compare)."""
    left, right = dtypes.get("training") or set(), dtypes.get("rollout") or set()
    if left and right and left != right:
        return (f"shape_or_dtype: training {'/'.join(sorted(left))} vs rollout "
                f"{'/'.join(sorted(right))}: different dtypes are not comparable (upstream "
                "compares dtypes, it never widens)")
    return None


def _side(routes: Mapping[str, list[str]]) -> str:
    """Where a divergence is seen: the one side not on an RL-Kernel route, else both."""
    production = [s for s in SIDES if any("rlkernel" not in r.replace("_", "").replace("-", "")
                                          .lower() for r in routes.get(s, []))]
    return production[0] if len(production) == 1 else "training vs rollout"


def compare_bundle(b: Bundle) -> dict[str, Any]:
    """analyze_bundle's judgement of a read bundle, as a report-like dict."""
    errors: list[str] = []
    by: dict[str, dict[str, list[Any]]] = {s["id"]: {side: [] for side in SIDES}
                                           for s in b.boundaries}
    identities = []
    for rec in b.records:
        by[rec.boundary][rec.side].append(rec)
        identities.append(rec.identity)
    if not identities or any(v != identities[0] for v in identities):
        errors.append("runtime weights/tokens/positions/mask/sampling identities differ or "
                      "missing")
    rows_out: list[dict[str, Any]] = []
    first: dict[str, Any] | None = None
    for spec in b.boundaries:
        name, selected = spec["id"], set(spec["positions"])
        berr: list[str] = []
        values: dict[str, dict[int, np.ndarray]] = {}
        observed: dict[str, dict[str, Any]] = {}
        routes: dict[str, list[str]] = {}
        dtypes: dict[str, set[str]] = {}
        for side in SIDES:
            recs = by[name][side]
            rows, issues = stitch((r.piece for r in recs), "value", selected)
            berr.extend(issues)
            if set(rows) != selected:
                berr.append(f"{side}: missing logical row coverage")
            for r in recs:
                stray = sorted(set(r.piece.positions) - selected)
                if stray:  # (upstream's writer refuses these; its analysis would skip them)
                    berr.append(f"{side}: {r.file}: positions {stray[:6]} are not declared in "
                                "the manifest")
                if not spec.get("dynamic_width") and r.piece.offset + r.piece.value.shape[1] \
                        > spec["width"]:
                    berr.append(f"{side}: {r.file}: features {r.piece.offset}.."
                                f"{r.piece.offset + r.piece.value.shape[1]} exceed the "
                                f"manifest's width {spec['width']}")
                width = r.piece.width
                if spec.get("dynamic_width"):
                    if width is None or width < 1:
                        berr.append(f"{side}: dynamic feature width is empty")
                elif width != spec["width"]:
                    berr.append(f"{side}: feature width differs from manifest")
            values[side] = rows
            dtypes[side] = {r.piece.dtype for r in recs}
            routes[side] = sorted({r.route for r in recs})
            contracts = [r.contracts for r in recs]
            if not contracts or any(c != contracts[0] for c in contracts):
                berr.append(f"{side}: missing or inconsistent replica contracts")
            observed[side] = contracts[0] if contracts else {}
            for key in spec.get("contracts", []):
                if observed[side].get(key) is None:
                    berr.append(f"{side}: missing required contract {key}")
        left, right = observed["training"], observed["rollout"]
        diff = {k: {"training": left.get(k), "rollout": right.get(k)}
                for k in sorted(left.keys() | right.keys()) if left.get(k) != right.get(k)}
        if diff:
            berr.append("observed calculation contracts differ")
        deltas = []
        mixed = _dtype_mismatch(dtypes)
        if mixed:
            berr.append(mixed)
        for position in sorted(values["training"].keys() & values["rollout"].keys()):
            d = bitdiff(values["training"][position], values["rollout"][position])
            if mixed and d.get("comparable"):
                d = {"comparable": False, "reason": "shape_or_dtype",
                     "left": [list(values["training"][position].shape),
                              "/".join(sorted(dtypes["training"]))],
                     "right": [list(values["rollout"][position].shape),
                               "/".join(sorted(dtypes["rollout"]))]}
            if not d.get("comparable") or not d.get("finite", False):
                berr.append(f"invalid tensor comparison at position {position}")
            if not d.get("equal"):
                deltas.append({"position": position, **d})
        errors.extend(f"{name}: {e}" for e in berr)
        status = "not_comparable" if berr else "diverged" if deltas else "equal"
        prior = {r["boundary"]: r for r in rows_out}
        inputs = spec.get("inputs", [])
        evidence = ("unknown" if not inputs or any(prior[p]["status"] == "not_comparable"
                                                   for p in inputs)
                    else "different" if any(prior[p]["status"] == "diverged" for p in inputs)
                    else "equal")
        row = {"boundary": name, "module": spec["module"], "stage": spec["stage"],
               "layer": spec.get("layer"), "status": status, "errors": berr,
               "contract_differences": diff, "routes": routes, "input_evidence": evidence,
               "differing_positions": len(deltas)}
        rows_out.append(row)
        if deltas and first is None:
            first = {**{k: v for k, v in row.items() if k != "errors"}, **deltas[0],
                     "side": _side(routes)}
    status = "not_comparable" if errors else "diverged" if first else "equal"
    return {"kind": "capture bundle", "path": b.path, "status": status,
            "first_divergence": first, "errors": errors, "boundaries": rows_out,
            "scope": b.manifest.get("scope")}


def compare_replay(r: Replay) -> dict[str, Any]:
    """analyze_replay's layer-by-layer judgement (the rules above; training call 0 only)."""
    errors: list[str] = []
    layers: dict[int, dict[str, list[Any]]] = {}
    for rec in r.records:
        if rec.side == "training" and rec.call != 0:
            continue  # training call 0 is the pre-update score (upstream's rule)
        layers.setdefault(rec.layer, {s: [] for s in SIDES})[rec.side].append(rec)
    idents = {rec.tokens_sha256 for recs in layers.values() for s in SIDES for rec in recs[s]}
    sampling = {rec.sampling for recs in layers.values() for s in SIDES for rec in recs[s]}
    expected = {rec.metadata.get("expected_layers") for recs in layers.values()
                for s in SIDES for rec in recs[s]}
    first: dict[str, Any] | None = None
    rows_out: list[dict[str, Any]] = []
    for layer, pair in sorted(layers.items()):
        lerr: list[str] = []
        if not all(pair.values()):
            lerr.append("missing training or rollout layer snapshots")
        for side, recs in pair.items():
            sizes = {rec.metadata.get("tp_size") for rec in recs}
            ranks = {rec.metadata.get("tp_rank") for rec in recs}
            if len(sizes) != 1 or None in sizes or not isinstance(next(iter(sizes)), int) or (
                    ranks != set(range(next(iter(sizes))))):
                lerr.append(f"{side} tensor-parallel rank coverage is incomplete")
        tiles: dict[str, dict[str, str]] = {s: {} for s in SIDES}
        for side, recs in pair.items():
            for wfile in sorted({rec.weights_file for rec in recs}):
                got = r.weights.get(wfile)
                if got is None:
                    lerr.append(f"missing runtime weight evidence: {wfile}")
                    continue
                for key, digest in got.items():
                    if key in tiles[side] and tiles[side][key] != digest:
                        lerr.append(f"{side} weight replica differs: {key}")
                    tiles[side][key] = digest
        if not tiles["training"] or not tiles["rollout"]:
            lerr.append("missing runtime weight tiles")
        elif tiles["training"] != tiles["rollout"]:
            keys = sorted(k for k in tiles["training"].keys() | tiles["rollout"].keys()
                          if tiles["training"].get(k) != tiles["rollout"].get(k))
            lerr.append(f"runtime weights differ: {keys[:3]}")
        selected = {p for rec in pair["rollout"] for p in rec.positions if p >= 0}
        lengths = {rec.sequence_length for s in SIDES for rec in pair[s]}
        if len(lengths) != 1 or None in lengths:
            lerr.append("missing or inconsistent frozen sequence length")
        elif selected != set(range(next(iter(lengths)) - 1)):
            lerr.append("rollout position coverage is incomplete for the frozen sequence")
        contracts = {s: {json.dumps(rec.metadata.get("contract"), sort_keys=True, default=str)
                         for rec in pair[s]} for s in SIDES}
        if not (all(contracts.values()) and len(contracts["training"]) == 1
                and contracts["training"] == contracts["rollout"]
                and "null" not in contracts["training"]):
            lerr.append("observed Attention scale/norm/dropout contracts differ or are missing")
        diffs, uncaptured = [], []
        for stage in STAGES:
            left, le = stitch((rec.pieces[stage] for rec in pair["training"]
                               if stage in rec.pieces), stage, selected)
            right, re_ = stitch((rec.pieces[stage] for rec in pair["rollout"]
                                 if stage in rec.pieces), stage, selected)
            lerr.extend(le + re_)
            if not left or not right:
                uncaptured.append(stage)
                if stage in {"input", "output"}:
                    lerr.append(f"missing mandatory layer boundary: {stage}")
                continue
            if set(left) != selected or set(right) != selected:
                lerr.append(f"incomplete token coverage for {stage}")
            mixed = _dtype_mismatch({s: {rec.pieces[stage].dtype for rec in pair[s]
                                         if stage in rec.pieces} for s in SIDES})
            if mixed:
                lerr.append(f"{stage}: {mixed}")
                row = {"layer": layer, "position": min(set(left) & set(right), default=None),
                       "stage": stage, "module": stage_module(stage),
                       "side": "training vs rollout", "comparable": False,
                       "reason": "shape_or_dtype"}
                diffs.append(row)
                if first is None:
                    first = row
                continue
            for position in sorted(set(left) & set(right)):
                d = bitdiff(left[position], right[position])
                if not d.get("comparable") or not d.get("finite", False):
                    lerr.append(f"{stage}: invalid tensor comparison at token {position}")
                if not d.get("comparable") or not d.get("equal"):
                    row = {"layer": layer, "position": position, "stage": stage,
                           "module": stage_module(stage), "side": "training vs rollout", **d}
                    diffs.append(row)
                    if first is None:
                        first = row
        if first is not None and first["layer"] == layer and "input_evidence" not in first:
            deps = _DEPENDENCIES.get(first["stage"], ())
            changed = {row["stage"] for row in diffs}
            first["input_evidence"] = (
                "unknown" if not deps or any(d in uncaptured for d in deps)
                else "different" if any(d in changed for d in deps) else "equal")
        errors.extend(f"layer {layer}: {e}" for e in lerr)
        rows_out.append({"layer": layer, "errors": lerr, "uncaptured_stages": uncaptured,
                         "differing_stages": sorted({d["stage"] for d in diffs},
                                                    key=STAGES.index),
                         "compared_positions": len(selected)})
    if not layers:
        errors.append("no layer replay snapshots")
    if len(idents) != 1 or None in idents or len(sampling) != 1:
        errors.append("frozen token or sampling identity differs across captures")
    errors.extend(f"capture failed ({e})" for e in r.errors)
    seen = r.identities["training"] + r.identities["rollout"]
    if not all(r.identities.values()) or any(v != seen[0] for v in seen):
        errors.append("runtime token/mask/sampling identities are missing or different "
                      "(identity/*.json)")
    elif {seen[0].get("tokens")} != idents:
        errors.append("captured layers do not belong to the verified frozen sample")
    head_errors, head_first = compare_head(r)
    errors.extend(head_errors)
    if first is None and head_first is not None:
        first = {"layer": len(layers), "module": "lm_head", "side": "training vs rollout",
                 **head_first}
    if len(expected) != 1 or None in expected or not isinstance(next(iter(expected)), int) or (
            sorted(layers) != list(range(next(iter(expected))))):
        errors.append("decoder layer coverage does not match the actual model")
    status = "not_comparable" if errors else "diverged" if first else "equal"
    return {"kind": "layer replay", "path": r.path, "status": status, "first_divergence": first,
            "errors": errors, "layers": rows_out,
            "scope": "one frozen sample, pre-update eager forwards; captured stages, the LM "
                     "head and the runtime identities (the endpoint sidecars and route files "
                     "are the cell's own judges')"}


def compare_head(r: Replay) -> tuple[list[str], dict[str, Any] | None]:
    """qwen3_report.analyze_head: the LM head's input and logits, bit for bit, with its
    weight tiles complete (one `-head.json` per layer-0 worker) and equal on both sides."""
    errors: list[str] = []
    weights: dict[str, dict[str, Any]] = {s: {} for s in SIDES}
    for side in SIDES:
        stems = set(r.head_weights[side])
        if not stems or stems != r.layer0_weights[side]:
            errors.append(f"{side} LM-head weight rank coverage is incomplete")
        for tiles in r.head_weights[side].values():
            for key, value in tiles.items():
                if key in weights[side] and weights[side][key] != value:
                    errors.append(f"{side} LM-head weight replica differs: {key}")
                weights[side][key] = value
    if not weights["training"] or weights["training"] != weights["rollout"]:
        errors.append("LM-head runtime weights are missing or different")
    positions = {p for _, side, pieces in r.heads if side == "rollout" and "logits" in pieces
                 for p in pieces["logits"].positions}
    first: dict[str, Any] | None = None
    for stage in ("head_input", "logits"):
        left, le = stitch((p[stage] for _, s, p in r.heads if s == "training" and stage in p),
                          stage, positions)
        right, re_ = stitch((p[stage] for _, s, p in r.heads if s == "rollout" and stage in p),
                            stage, positions)
        errors.extend(le + re_)
        if not positions or set(left) != positions or set(right) != positions:
            errors.append(f"missing or incomplete {stage} evidence (heads/)")
        mixed = _dtype_mismatch({s: {p[stage].dtype for _, side, p in r.heads
                                     if side == s and stage in p} for s in SIDES})
        if mixed:
            errors.append(f"{stage}: {mixed}")
        for position in sorted(set(left) & set(right)):
            d = bitdiff(left[position], right[position])
            if not d.get("comparable") or not d.get("finite", False):
                errors.append(f"invalid {stage} comparison at token {position}")
            if not d.get("equal") and first is None:
                first = {"stage": stage, "position": position, **d}
    return errors, first


def _where(first: Mapping[str, Any] | None) -> str:
    if not first:
        return "none"
    parts = [str(first.get("boundary") or first.get("module"))]
    for key in ("stage", "layer", "position"):
        if first.get(key) is not None:
            parts.append(f"{key} {first[key]}")
    return ", ".join(parts)


def cross_check(ours: Mapping[str, Any], theirs: Mapping[str, Any] | None,
                label: str) -> list[str]:
    """Reasons where upstream's `diagnostic-report.json` and this judgement disagree."""
    if theirs is None:
        return []
    out = []
    if theirs.get("status") != ours.get("status"):
        out.append(f"{label}: upstream diagnostic-report.json says {theirs.get('status')} "
                   f"(first divergence {_where(theirs.get('first_divergence'))}); the plugin's "
                   f"comparison says {ours.get('status')} (first divergence "
                   f"{_where(ours.get('first_divergence'))})")
        return out
    a, b = theirs.get("first_divergence") or {}, ours.get("first_divergence") or {}
    keys = ("boundary", "stage", "layer", "position")
    if any(a.get(k) != b.get(k) for k in keys if k in a or k in b):
        out.append(f"{label}: upstream diagnostic-report.json's first divergence is "
                   f"{_where(a)}; the plugin's is {_where(b)}")
    return out


def summary(result: Mapping[str, Any]) -> str:
    """One line: "capture bundle debug/x: diverged first at ffn mlp_output layer 0 position 2
    (1 of 8 elements differ in bits, max |diff| 3.7e-09; inputs equal)"."""
    first = result.get("first_divergence")
    head = f"{result.get('kind')} {result.get('path')}: {result.get('status')}"
    if not first:
        return head
    tail = (f"{first.get('bitwise_mismatches')} of {first.get('elements')} elements differ in "
            f"bits" if first.get("comparable") else f"not comparable ({first.get('reason')})")
    if first.get("max_abs_diff") is not None:
        tail += f", max |diff| {first['max_abs_diff']:.3g}"
    elif first.get("comparable"):
        tail += ", non-finite values"
    if first.get("input_evidence"):
        tail += f"; inputs {first['input_evidence']}"
    layer = "" if first.get("layer") is None else f" layer {first['layer']}"
    return (f"{head}, first at {first.get('module')} {first.get('stage')}{layer} position "
            f"{first.get('position')} ({first.get('side')}: {tail})")


def judge_cell(root: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(the debugger's results for every bundle / replay in a cell, the problems that keep
    the cell from valid: unreadable, partial or foreign files, comparisons that are not
    comparable, disagreements with upstream's report). Nothing found: ([], [])."""
    problems: list[str] = []
    bundles, replays = find(root, problems)
    results: list[dict[str, Any]] = []
    for folder in bundles:
        b = read_bundle(folder, root)
        label = f"debugger capture bundle {b.path}"
        problems.extend(f"{label}: {p}" for p in b.problems)
        if not b.boundaries:
            continue
        res = compare_bundle(b)
        unfinished = [p for p in b.problems if "incomplete capture:" in p]
        if unfinished:  # analyze_bundle: an interrupted capture makes the bundle not comparable
            res["errors"] = [*unfinished, *res["errors"]]
            res["status"] = "not_comparable"
        res["summary"] = summary(res)
        res["upstream_report"] = None if b.report is None else {
            "status": b.report.get("status"),
            "first_divergence": _where(b.report.get("first_divergence")),
            "diagnosis": (b.report.get("diagnosis") or {}).get("level")
            if isinstance(b.report.get("diagnosis"), dict) else None}
        results.append(res)
        problems.extend(f"{label}: not comparable: {e}" for e in res["errors"][:8])
        problems.extend(cross_check(res, b.report, label))
    for folder in replays:
        r = read_replay(folder, root)
        label = f"debugger layer replay {r.path}"
        problems.extend(f"{label}: {p}" for p in r.problems)
        res = compare_replay(r)
        gates = arm_gates(r.arm_summary)
        if gates:  # session.apply_evidence_gates: the arm's own summary makes it not comparable
            res["errors"].extend(gates)
            res["status"] = "not_comparable"
        res["summary"] = summary(res)
        res["upstream_report_path"] = r.report_path
        res["upstream_report"] = None if r.report is None else {
            "status": r.report.get("status"),
            "first_divergence": _where(r.report.get("first_divergence"))}
        results.append(res)
        problems.extend(f"{label}: not comparable: {e}" for e in res["errors"][:8])
        problems.extend(cross_check(res, r.report, label))
    return results, problems


def arm_gates(arm: Mapping[str, Any] | None) -> list[str]:
    """What RL-Kernel's `session.apply_evidence_gates` takes from `single-arm-summary.json`."""
    if not isinstance(arm, Mapping):
        return []
    out = []
    if arm.get("frozen_sources_match") is False:
        out.append("single-arm-summary.json: frozen source fingerprint changed during capture")
    code = arm.get("launcher_returncode")
    if code not in (0, None):
        out.append(f"single-arm-summary.json: the capture process exited with {code}")
    if arm.get("passed") is False:
        errs = arm.get("errors") if isinstance(arm.get("errors"), list) else []
        out.append("single-arm-summary.json: the arm's own validation failed"
                   + (f" ({'; '.join(str(e) for e in errs[:3])[:300]})" if errs else ""))
    return out


def upstream_files(root: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """RL-Kernel's other debugger files in a cell: `frozen-replay.json` (`frozen_replay.v1`),
    `debug-summary.json` (`debug_summary.v1`), `single-arm-summary.json` and RL-Kernel's own
    `matrix-report.json` (`debug_matrix_report.v2`, never the plugin's): recorded, a foreign
    or unreadable one a problem, a failing gate a reason."""
    from pytest_rlkernel_matrix.judge.read.capture import _depths, _json

    out: list[dict[str, Any]] = []
    problems: list[str] = []
    wants = {"frozen-replay.json": "frozen_replay.v1", "debug-summary.json": "debug_summary.v1",
             "matrix-report.json": None, "single-arm-summary.json": None}
    from pytest_rlkernel_matrix.store.safeio import listing

    for name, schema in wants.items():
        for path in [p for pat in _depths(name, 2) for p in listing(root, pat, root, problems)]:
            rel = str(path.relative_to(root))
            data = _json(path, root, problems)
            if not isinstance(data, dict):
                problems.append(f"debugger {rel}: not a JSON object")
                continue
            got = data.get("schema_version") or data.get("schema")
            row = {"file": rel, "schema_version": got, "status": data.get("status")}
            if schema is not None and got not in (schema, f"rlkernel.{schema}"):
                problems.append(f"debugger {rel}: schema_version {got!r} is not {schema!r}")
            if name == "matrix-report.json":
                if not isinstance(data.get("groups"), list):
                    problems.append(f"debugger {rel}: a matrix-report.json inside a cell that is "
                                    "not RL-Kernel's debug session report (no groups)")
                    continue
                row["groups"] = [str(g.get("group")) for g in data["groups"]
                                 if isinstance(g, dict)]
                row["conclusion"] = data.get("conclusion")
            if name == "single-arm-summary.json" and not (path.parent / "diagnostics").is_dir():
                problems.extend(f"debugger {rel}: {g}" for g in arm_gates(data))
            if name == "debug-summary.json" and data.get("status") in ("diverged",
                                                                      "not_comparable"):
                row["note"] = "upstream's session summary"
            out.append(row)
    return out, problems


def debugger_evidence(ev: Any) -> None:
    """The debugger's results of a cell into `ev.debugger`, its problems into `ev.problems`
    (fail closed; a bug here is a problem too, never an aborted analysis)."""
    try:
        results, problems = judge_cell(ev.root)
    except Exception as exc:  # an unforeseen shape: fail closed, go on
        results, problems = [], [f"debugger evidence: unreadable ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})"]
    try:
        files, more = upstream_files(ev.root)
    except Exception as exc:  # fail closed, go on
        files, more = [], [f"debugger files: unreadable ({type(exc).__name__}: "
                           f"{str(exc)[:200]})"]
    if files:
        results = [*results, {"kind": "upstream files", "path": ".", "status": "recorded",
                              "files": files, "summary": "RL-Kernel debugger files: " + ", ".join(
                                  f"{f['file']} ({f['schema_version']})" for f in files)}]
    ev.debugger = results
    ev.problems.extend(problems + more)
