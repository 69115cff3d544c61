"""Numeric validity: the active-token drift against the contract the backends declared (or the
matrix file's baseline contract); with a production side there is none (drift reported).

Owns `judge` (contract resolution and the numeric judgement). The drift figures themselves are
measured while reading (`read.metrics`).

May import: `judge.read`, `judge.findings`, `spec`, `store`; never another layer.
"""
