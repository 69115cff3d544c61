"""Whether a drift matters for the loss (issue 45): the importance-ratio figures of
`judge.read.loss`, checked against a direct computation token by token and against the
formulas of vime's dlogp_diagnostics (clipfrac0, ratio0_mean) and verl's rollout correction
(token-level TIS fraction_high, masked-IS bounds) written out in torch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pytest_rlkernel_matrix.judge.read.loss import (
    Thresholds,
    brief,
    loss_impact,
    loss_short,
)
from pytest_rlkernel_matrix.judge.read.metrics import Sample, compute


def _samples(rng: np.random.Generator, scale: float, calls: int = 3, per_call: int = 4,
             dtype: type = np.float32) -> list[Sample]:
    out = []
    for call in range(calls):
        for i in range(per_call):
            n = int(rng.integers(5, 400))
            roll = rng.normal(-2.0, 1.0, n).astype(dtype)
            train = (roll + rng.standard_t(2, n) * scale).astype(dtype)
            mask = rng.random(n) < 0.8
            out.append(Sample(train, roll, mask, sample=i, rank=0, call=call))
    return out


def _direct(samples: list[Sample], eps: float = 0.2, cap: float = 2.0,
            upper: float = 2.0) -> dict[str, object]:
    """One token at a time, in Python floats."""
    clip = tis = mis = n = 0
    ratios: list[float] = []
    per_step: dict[int, list[int]] = {}
    for s in samples:
        step = per_step.setdefault(s.call, [0, 0, 0, 0])
        for t, r, m in zip(s.train.tolist(), s.rollout.tolist(), s.mask.tolist(), strict=True):
            if not m:
                continue
            d = float(t) - float(r)
            ratio = math.exp(d)
            ratios.append(ratio)
            c, u, k = abs(ratio - 1) > eps, ratio > cap, not (1 / upper <= ratio <= upper)
            clip, tis, mis, n = clip + c, tis + u, mis + k, n + 1
            step[0] += 1
            step[1] += c
            step[2] += u
            step[3] += k
    return {"n": n, "clip": clip, "tis": tis, "mis": mis, "ratios": ratios, "steps": per_step}


@pytest.mark.parametrize("scale", [1e-3, 0.05, 0.5])
def test_figures_match_a_direct_computation(scale: float) -> None:
    rng = np.random.default_rng(int(scale * 1000) + 7)
    samples = _samples(rng, scale)
    loss = compute(samples).loss_impact
    want = _direct(samples)
    assert loss["exact"] is False
    assert loss["active_tokens"] == want["n"]
    assert loss["clip_count"] == want["clip"]
    assert loss["tis_truncated_count"] == want["tis"]
    assert loss["mis_masked_count"] == want["mis"]
    assert loss["clip_fraction"] == want["clip"] / want["n"]
    ratios = np.array(want["ratios"])
    assert loss["ratio_min"] == pytest.approx(ratios.min(), rel=1e-15)
    assert loss["ratio_max"] == pytest.approx(ratios.max(), rel=1e-15)
    assert loss["ratio_mean"] == pytest.approx(ratios.mean(), rel=1e-12)
    for q in (50.0, 90.0, 99.0, 99.9):
        assert loss["abs_log_ratio_quantiles"][f"p{q:g}"] == pytest.approx(
            np.percentile(np.abs(np.log(ratios)), q), rel=1e-9)
        band = math.exp(loss["abs_log_ratio_quantiles"][f"p{q:g}"])
        inside = np.mean((ratios >= 1 / band * (1 - 1e-12)) & (ratios <= band * (1 + 1e-12)))
        assert inside >= q / 100 - 1 / ratios.size
    steps = {s["step"]: s for s in loss["steps"]}
    assert sorted(steps) == sorted(want["steps"])
    for call, (n, c, u, k) in want["steps"].items():
        assert (steps[call]["active_tokens"], steps[call]["clip_count"],
                steps[call]["tis_truncated_count"], steps[call]["mis_masked_count"]) == (n, c, u, k)
    assert sum(s["clip_count"] for s in loss["steps"]) == loss["clip_count"]


def test_vime_and_verl_formulas_in_torch() -> None:
    """vime: ratio0 = exp(dlogp), clipfrac0 = mean(|ratio0 - 1| > eps); verl token level:
    fraction_high = mean(raw > threshold), masked = outside [lower, upper], lower = 1/upper."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    samples = _samples(rng, 0.3, calls=1, per_call=6)
    loss = compute(samples).loss_impact
    train = torch.cat([torch.from_numpy(s.train[s.mask]) for s in samples]).double()
    roll = torch.cat([torch.from_numpy(s.rollout[s.mask]) for s in samples]).double()
    ratio = (train - roll).exp()
    assert loss["clip_fraction"] == pytest.approx(
        ((ratio - 1.0).abs() > 0.2).double().mean().item(), abs=0)
    assert loss["ratio_mean"] == pytest.approx(ratio.mean().item(), rel=1e-12)
    assert loss["tis_truncated_fraction"] == pytest.approx(
        (ratio > 2.0).double().mean().item(), abs=0)
    kept = (ratio >= 0.5) & (ratio <= 2.0)
    assert loss["mis_masked_fraction"] == pytest.approx((~kept).double().mean().item(), abs=0)


def test_equal_values_give_ratio_exactly_one_including_signed_zero() -> None:
    roll = np.array([-1.5, -0.0, 0.0, -3.25], dtype=np.float32)
    train = np.array([-1.5, 0.0, -0.0, -3.25], dtype=np.float32)
    m = compute([Sample(train, roll, np.ones(4, bool), sample=0, call=5)])
    loss = m.loss_impact
    assert m.bitwise_mismatch_count == 2 and m.mismatch_count == 0
    assert loss["exact"] is True and loss["brief"] == "ratio exactly 1"
    assert loss["steps"] == [{"step": 5, "active_tokens": 4, "clip_count": 0,
                              "clip_fraction": 0.0, "tis_truncated_count": 0,
                              "tis_truncated_fraction": 0.0, "mis_masked_count": 0,
                              "mis_masked_fraction": 0.0}]
    assert loss_short(loss) == "=1"


def test_nonfinite_counts_outside_every_range() -> None:
    roll = np.array([-1.0, -1.0, -1.0, -1.0, -1.0], dtype=np.float64)
    train = np.array([-1.0, np.nan, np.inf, -np.inf, -1.1], dtype=np.float64)
    loss = compute([Sample(train, roll, np.ones(5, bool), sample=0)]).loss_impact
    assert loss["nonfinite_count"] == 3
    assert loss["clip_count"] == 3  # |exp(-0.1) - 1| = 0.095 is inside
    assert loss["tis_truncated_count"] == 3 and loss["mis_masked_count"] == 3
    assert loss["ratio_max"] == 1.0 and loss["ratio_min"] == pytest.approx(math.exp(-0.1))
    assert "3 non-finite" in loss["brief"] and loss_short(loss) == "clip 60.0% nf 3"


def test_brief_reads_as_the_issue_asks() -> None:
    loss = {"exact": False, "clip_fraction": 0.008, "tis_truncated_fraction": 0.0001,
            "mis_masked_fraction": 0.0002, "ratio_min": 0.7, "ratio_max": 2.5,
            "thresholds": Thresholds().as_dict()}
    assert brief(loss).startswith("0.8% of tokens outside the clip range (eps 0.2)")
    assert "TIS cap 2 cuts 0.01%" in brief(loss) and "MIS [0.5, 2] masks 0.02%" in brief(loss)


def test_thresholds_refuse_nonsense() -> None:
    for bad in ({"clip_eps": 0.0}, {"clip_eps": 1.5}, {"tis_cap": float("nan")},
                {"mis_upper": 2.0, "mis_lower": 3.0}):
        with pytest.raises(ValueError, match=r"loss threshold|masked-IS"):
            Thresholds(**bad)
    with pytest.raises(ValueError, match="loss figures"):
        loss_impact(np.zeros(3), np.array([2]), [0], 0)


def test_no_active_tokens_and_summary_only_carry_no_figures() -> None:
    s = Sample(np.zeros(3), np.ones(3), np.zeros(3, bool), sample=0)
    assert compute([s]).loss_impact == {}
    s2 = Sample(np.zeros(3), np.ones(3), np.ones(3, bool), sample=0)
    assert compute([s2], summary_only=True).loss_impact == {}


def test_a_drifting_cells_record_table_and_html(tmp_path) -> None:
    """P/P-like drift end to end: the record's loss figures, the terminal table's IS ratio
    column, the HTML's loss rows and the offline token drift chart (inline SVG, no script)."""
    import copy
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from cellkit import CellKit
    from test_html import PREFLIGHT, Page, sample_report

    from pytest_rlkernel_matrix.report.html import render_html
    from pytest_rlkernel_matrix.report.matrix_report import table

    kit = CellKit(tmp_path / "a", module="ffn", case="P/P").write()
    kit.write_sidecar(kit.sidecar(drift=0.5, drift_tokens=3))
    shutil.copytree(Path(__file__).parent / "data" / "debugger" / "diverged",
                    kit.dir / "debug" / "b")
    rec = kit.analyze()
    loss = rec["loss_impact"]
    assert loss["exact"] is False and loss["clip_count"] == 3  # exp(0.5) - 1 > 0.2
    drift = loss["token_drift"]
    assert drift and drift[0]["max_abs"] == pytest.approx(0.5, abs=2e-3)
    rows = table([rec])
    assert "IS ratio" in rows[0] and "clip " in rows[1]
    base = CellKit(tmp_path / "b").write().analyze()
    assert base["loss_impact"]["brief"] == "ratio exactly 1"
    report = copy.deepcopy(sample_report())
    report["cells"] = [rec, base]
    text = render_html(report, PREFLIGHT)
    page = Page()
    page.feed(text)
    assert page.scripts == 1  # the page's own inline script only: the chart needs none
    assert "outside the clip range (eps 0.2)" in text and "ratio exactly 1" in text
    assert 'class="drift-along"' in text and "<polyline" in text
    assert "localisation (RL-Kernel's consistency debugger)" in text and "mlp_output" in text
    assert "http://" not in text.split("<body", 1)[1].replace("http://www.w3.org", "")
