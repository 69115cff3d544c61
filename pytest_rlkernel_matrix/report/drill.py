"""Is this report from a fault drill? Said at the top of the terminal, the JSON and the HTML.

A fault drill (``RLK_REF_FAULT``, `workload/env.py`: ``slow:<module>:<side>:<factor>``,
``corrupt_weight``, ...) plants a fault on purpose: its timings and drifts are the drill's,
never the kernels' own. The evidence: the reference workload's manifest (``fault_drill`` in the
cell records: what it parsed and whether it applied to that cell) and ``RLK_REF_FAULT`` in the
environment the report was made in (a framework job of your own reads it too, or not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ENV = "RLK_REF_FAULT"


def drill_of(records: Sequence[Mapping[str, Any]],
             env: Mapping[str, str]) -> dict[str, Any] | None:
    """The report's ``drill`` entry (None: no drill seen)."""
    raw = (env.get(ENV) or "").strip()
    applied = sorted({f"{r.get('hardware')} {r.get('module')} {r.get('case')}" for r in records
                      if isinstance(r.get("fault_drill"), Mapping)
                      and r["fault_drill"].get("applied")})
    seen = sorted({str(r["fault_drill"].get("kind")) for r in records
                   if isinstance(r.get("fault_drill"), Mapping)})
    if not raw and not seen:
        return None
    what = f"{ENV}={raw}" if raw else f"fault drill {', '.join(seen)} (in the cells' manifests)"
    where = (f"; applied in {len(applied)} cell(s)" if applied else "")
    return {"env": raw or None, "kinds": seen, "applied_cells": applied,
            "text": (f"FAULT DRILL: {what}{where}: a planted fault, so these timings and drifts "
                     "are the drill's, not the kernels' own")}
