"""Weight audits in a factor cell: differing weights are the factor's doing when the cell varies
what the rollout loads (a note), a failure of the semantic judgement otherwise.
"""

from __future__ import annotations

import re

from pytest_rlkernel_matrix.judge.read.upstream import WeightAudit, _version_key
from pytest_rlkernel_matrix.spec.cells import Cell


def weight_note(cell: Cell | None, version: str, shown: str, differ: bool) -> str:
    """For a cell whose factor changes the rollout's weights: what its weight audits say
    (differing audits are the factor's doing, equal ones say it did nothing); else ''."""
    f = cell.factor if cell is not None else None
    if f is None or f.expect != "weight_drift":
        return ""
    varies = f"{f.name}={f.variant}"
    return f"weight version {version}: " + (
        f"sides hold different weights ({shown}): expected, this cell varies {varies}"
        if differ else f"both sides hold the same weights: {varies} did not change them")


def weight_reasons(cell: Cell | None, reasons: list[str],
                   audit: WeightAudit | None = None) -> list[tuple[bool, str]]:
    """(fails, text) per weight-audit reason: differing weights in a weight-sync factor cell are
    the factor's doing (a note naming the exported version the rollout holds, when it holds
    one: a stale sync), everything else fails the semantic judgement."""
    out = []
    for reason in reasons:
        hit = re.match(r"weight version (\S+): sides hold different weights \((.*)\)$", reason)
        note = weight_note(cell, hit.group(1), _held(hit.group(1), hit.group(2), audit),
                           True) if hit else ""
        out.append((not note, note or reason))
    return out


def _held(version: str, shown: str, audit: WeightAudit | None) -> str:
    """`shown`, plus which other exported version the rollout's weights are (if any)."""
    sha = audit.rollout.get(version) if audit is not None else None
    same = [v for v, t in (audit.training.items() if audit is not None else ())
            if t == sha and v != version]
    if not sha or not same:
        return shown + ("; equal to no exported version" if sha else "")
    older = same[0]
    behind = (f", {int(version) - int(older)} behind" if version.isdigit() and older.isdigit()
              else "")
    return f"{shown}; the rollout holds exported version {older}{behind}"


def judge_weight_audit(wa: WeightAudit, mode: str, require_rollout: bool,
                       ) -> tuple[list[str], list[str]]:
    """(reasons, notes): reasons fail the semantic judgement, notes are only recorded."""
    reasons: list[str] = list(wa.problems)
    notes: list[str] = []
    if not wa.training:
        msg = "no weight-audit files: weight version not verified"
        if mode == "off":
            notes.append(msg)
        elif not wa.problems:
            reasons.append(msg + " (training rank 0 writes weight-audit/<version>.json)")
        return reasons, notes
    for version, sha in sorted(wa.rollout.items(), key=lambda kv: _version_key(kv[0])):
        train = wa.training.get(version)
        if train is None:
            reasons.append(f"weight version {version}: the rollout side loaded a version the "
                           "training side never exported")
        elif train != sha:
            reasons.append(f"weight version {version}: sides hold different weights (training "
                           f"{train[:12]}, rollout {sha[:12]})")
    for version in wa.rollout_readback_versions:
        if version not in wa.training:
            reasons.append(f"weight version {version}: a rollout readback reports a version "
                           "the training side never exported")
    if not wa.rollout_audited:
        msg = ("weight audit: the rollout side is not audited by the framework (no "
               "weight-audit/rollout/ and no weight_version in a rollout readback)")
        if require_rollout and mode != "off":
            reasons.append(msg + ": [matrix] require_rollout_weight_audit = true")
        else:
            notes.append(msg)
    return reasons, notes
