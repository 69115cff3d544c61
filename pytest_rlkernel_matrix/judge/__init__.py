"""From what a run left on disk to a verdict: evidence readers (`evidence`, `logscan`),
drift metrics (`metrics`), performance statistics (`stats`), the step's accounting
(`accounting`: the time in no phase), profile runs' chrome traces (`profile`: kernel sums per
side, phase and module, for localisation only) and the verdict with its contract resolution
(`verdict`); `preload` imports what they need while a session's first cell runs.

May import: `store`, `spec`, `run` (the run result and the contamination measurement); never
`report`, the session or the pytest face.
"""
