"""Reading: what a run left on disk, as typed, validated objects; nothing here decides.

Owns `evidence` (one pass over a run directory: readbacks, sidecars, logs, manifests),
`ptread` (the one `.pt` reader, bounded in memory and time), `fallback` (what names a
fallback, for run.log lines and records alike: RL-Kernel's `_contains_fallback` and wider),
`sidecars` (RL-Kernel's sidecar
layout, CP shards), `logscan` (run.log), `upstream` (readbacks' fields and weight audits as
RL-Kernel's writers leave them), `policy` (the cell's recorded policy), `calls` (which ranks,
calls and versions the files cover), `metrics` (the drift figures of the sidecars' active
tokens), `loss` (the importance-ratio figures of those tokens: whether a drift matters for the
loss), `capture` (RL-Kernel's debugger bundles, layer replays and diagnostic reports),
`vime_audit` (vime's consistency-audit dumps and metadata), `steps` (the per-step series, both
sides' weight chains and the repeat run: the reproducibility layer's input), `cellrun`
(`cell-run.json` and its recorded policy as pydantic models, `extra` chosen per model) and
`preload` (imports made while a session's first cell runs).

May import: itself, `store`, `spec`; never a validity layer, `localise`, `decide`, `report`.
"""
