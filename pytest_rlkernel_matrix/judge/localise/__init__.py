"""Localisation: where a drift or a slowdown starts. Analyses, not validity: nothing here makes
a cell valid or invalid.

Owns `probe` (per-layer probes of a drifting cell), `profile` (profile runs' chrome traces:
kernel sums per side, phase and module), `factors` (a factor cell against its baseline) and
`debugger` (RL-Kernel's debugger bundles compared by upstream's rules: the first divergent
boundary, cross-checked with upstream's own report; its problems keep a cell from valid).

May import: `judge.read`, `judge.findings`, `spec`, `store`, `run` (to start a probe or profile
run); never a validity layer or `decide`.
"""
