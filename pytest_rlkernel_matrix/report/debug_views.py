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
