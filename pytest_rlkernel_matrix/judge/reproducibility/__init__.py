"""Reproducibility: over steps (drift per step, its trend), across runs (run_to_run_bitwise),
weights bitwise (weights_bitwise: needs a rollout-side weight audit, else "not judged").

Owns `steps` (the claims and the declared ones applied to a verdict).

May import: `judge.read`, `judge.findings`, `spec`, `store`; never another layer.
"""
