"""The reproducibility judgement: the three claims of a run directory (`steps.judge_claims`, over
what `read.steps.read_reproducibility` read into `Evidence.reproducibility`) as
typed findings. A claim that fails is a `fail` finding, one not judged a `not_judged` finding
(never a pass); a claim that holds adds nothing. The verdict is held to the *declared* claims by
`steps.apply_declared` (decide.py); this judgement records them all.

The claims are the all-R baseline's (``baseline=True``): a cell whose rollout or training side
is production (P/R, R/P, P/P) claims no train/rollout or weights bitwise-ness, so those claims
are ``not claimed`` there, never judged (a red "fails" would state a claim nobody made). A
run-to-run comparison that was run for such a cell (``[reproducibility] cells``) is still judged:
its repeat was asked for.
"""

from __future__ import annotations

from typing import Any

from pytest_rlkernel_matrix.judge.findings import Judgement
from pytest_rlkernel_matrix.judge.read.steps import Reproducibility
from pytest_rlkernel_matrix.judge.reproducibility.steps import judge_claims

NOT_CLAIMED = "not claimed"
NOT_CLAIMED_WHY = "reproducibility claims are the all-R baseline's"


def judge_reproducibility(rep: Reproducibility | None, baseline: bool = True,
                          ) -> tuple[Judgement, dict[str, dict[str, str]], dict[str, Any]]:
    """(judgement, claims, the drift-over-steps data) of one run directory as read; for a cell
    that is not the baseline's (``baseline=False``) every claim not asked for is `not claimed`."""
    claims, steps_data = judge_claims(rep)
    judgement = Judgement(layer="reproducibility")
    if not baseline:
        for name, claim in list(claims.items()):
            if name == "run_to_run_bitwise" and claim.get("status") in ("holds", "fails"):
                continue
            claims[name] = {"name": name, "status": NOT_CLAIMED, "detail": NOT_CLAIMED_WHY,
                            "text": f"{name}: {NOT_CLAIMED} ({NOT_CLAIMED_WHY})"}
        if all(c.get("status") == NOT_CLAIMED for c in claims.values()):
            judgement.valid = None
            judgement.note(f"{NOT_CLAIMED}: {NOT_CLAIMED_WHY}")
            return judgement, claims, steps_data
    for name, claim in claims.items():
        if claim.get("status") == NOT_CLAIMED:
            continue
        text = claim.get("text") or f"{name}: {claim.get('status')}"
        if claim.get("status") == "fails":
            judgement.fail(text, name)
        elif claim.get("status") != "holds":
            judgement.not_judged(text, name)
    return judgement, claims, steps_data
