"""Typed findings: what every validity layer returns and `decide` combines.

A `Finding` is one statement of one layer (`route`, `semantic`, `numeric`, `performance`,
`reproducibility`) with its severity: `fail` (the layer's rule is broken, or could not be
evaluated: fail closed), `not_judged` (nothing was compared: never a pass) or `note` (recorded,
decides nothing). A `Judgement` is one layer's findings; its `valid` is False with any `fail`,
None when it could not be judged, True only when every rule positively held.

Imports nothing of the package: every layer and `decide` may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LAYERS = ("route", "semantic", "numeric", "performance", "reproducibility")
SEVERITIES = ("note", "not_judged", "fail")  # ascending: the most severe wins


@dataclass(frozen=True)
class Finding:
    """One layer's statement about a cell."""

    layer: str
    severity: str
    reason: str
    source: str = ""


@dataclass
class Judgement:
    """One of the validity judgements: `valid` is None when it could not be judged."""

    valid: bool | None = True
    reasons: list[str] = field(default_factory=list)
    layer: str = ""
    findings: list[Finding] = field(default_factory=list)

    def fail(self, reason: str, source: str = "") -> None:
        self.valid = False
        self.reasons.append(reason)
        self.findings.append(Finding(self.layer, "fail", reason, source))

    def not_judged(self, reason: str | None = None, source: str = "") -> None:
        """Nothing compared: never valid (False stays False)."""
        self.valid = None if self.valid is not False else False
        if reason is not None:
            self.reasons.append(reason)
            self.findings.append(Finding(self.layer, "not_judged", reason, source))

    def note(self, reason: str, source: str = "") -> None:
        self.reasons.append(reason)
        self.findings.append(Finding(self.layer, "note", reason, source))

    @property
    def worst(self) -> str | None:
        """The most severe finding's severity (None without findings)."""
        found = [SEVERITIES.index(f.severity) for f in self.findings]
        return SEVERITIES[max(found)] if found else None
