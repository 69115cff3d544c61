"""The reproducibility judgement: the three claims of a run directory (`steps.judge_claims`, over
what `read.steps.read_reproducibility` read into `Evidence.reproducibility`) as
typed findings. A claim that fails is a `fail` finding, one not judged a `not_judged` finding
(never a pass); a claim that holds adds nothing. The verdict is held to the *declared* claims by
`steps.apply_declared` (decide.py); this judgement records them all.
"""

from __future__ import annotations

from typing import Any

from pytest_rlkernel_matrix.judge.findings import Judgement
from pytest_rlkernel_matrix.judge.read.steps import Reproducibility
from pytest_rlkernel_matrix.judge.reproducibility.steps import judge_claims


def judge_reproducibility(rep: Reproducibility | None,
                          ) -> tuple[Judgement, dict[str, dict[str, str]], dict[str, Any]]:
    """(judgement, claims, the drift-over-steps data) of one run directory as read."""
    claims, steps_data = judge_claims(rep)
    judgement = Judgement(layer="reproducibility")
    for name, claim in claims.items():
        text = claim.get("text") or f"{name}: {claim.get('status')}"
        if claim.get("status") == "fails":
            judgement.fail(text, name)
        elif claim.get("status") != "holds":
            judgement.not_judged(text, name)
    return judgement, claims, steps_data
