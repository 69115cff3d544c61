"""The machine a matrix runs on: the preflight (`preflight`, running `_probe` in the
target interpreter and the vendor tools), the per-vendor parsers (`nvidia`, `rocm`) and the
capability report (`capability`).

May import: `store`; never torch (the probe script runs in a subprocess).
"""
