"""Performance validity: measured processes, steady state, intervals, the accounted step.

Owns `judge` (is a cell's timing usable: phases present, not contaminated, spread within the
declared limit, the requested route), `phases` (per-phase series and medians of `perf N`
records), `steady` (a process's steady-state steps: MSER drops the warm-up transient; their
trimmed mean on log time), `factorial` (a module's four cells as a 2x2 factorial over processes:
main effects, t intervals, the three answers under closed testing, and the plan that would
resolve an inconclusive one), `stats` (two-cell ratios, the noise gate) and `accounting` (the
time in no phase).

May import: `judge.read`, `judge.findings`, `spec`, `store`, `run` (the contamination rule,
`run.contamination.judge`; the file is read by `judge.read` into `Evidence.contamination`);
never another layer.
"""
