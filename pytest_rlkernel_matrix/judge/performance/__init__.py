"""Performance validity: measured processes, steady state, intervals, the accounted step.

Owns `judge` (is a cell's timing usable: phases present, not contaminated, spread within the
declared limit, the requested route), `phases` (per-phase series and medians of `perf N`
records), `stats` (intervals and ratios) and `accounting` (the time in no phase).

May import: `judge.read`, `judge.findings`, `spec`, `store`, `run` (the contamination
measurement); never another layer.
"""
