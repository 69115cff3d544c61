"""Route validity: did the requested backend run, on the declared platform, with no fallback.

Owns `judge` (the route judgement per module and side), `rules` (RL-Kernel's per-platform
record rules applied as upstream applies them, and the run's declared runtime policy) and
`crosscheck` (route lines and installed hooks against the readbacks). Allow-lists: a record
passes only when it positively shows the backend id, the platform, no fallback and no Triton
where Triton is not allowed; unknown, missing, too large or wrongly typed is a reason.

May import: `judge.read`, `judge.findings`, `spec`, `store`; never another layer.
"""
