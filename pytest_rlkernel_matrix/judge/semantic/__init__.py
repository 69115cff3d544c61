"""Semantic validity: both sides compared the same things (checkpoint and weight versions,
samples, tokens, masks, lengths, complete ranks and calls, this run's id, the declared platform).

Owns `judge` (the semantic judgement), `coverage` (rank files tied to the run and covering it),
`exposure` (the step records' runtime token exposure against the sidecars) and `weights`
(weight audits in factor cells).

May import: `judge.read`, `judge.findings`, `spec`, `store`; never another layer.
"""
