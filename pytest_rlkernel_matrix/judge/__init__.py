"""From what a run left on disk to a verdict, in the five validity layers the request names.

- `read/`: what a run left on disk -> typed, validated objects (evidence, the bounded `.pt`
  reader, sidecars, run.log, readbacks and weight audits, the cell's policy, drift metrics of
  the sidecars); nothing there decides.
- `route/`, `semantic/`, `numeric/`, `performance/`, `reproducibility/`: one validity layer each;
  each owns its rules (allow-lists: a record passes only what it positively shows) and returns
  typed findings (`findings.Judgement` of `findings.Finding`).
- `localise/`: where a drift or a slowdown starts (probe, profile, factor comparisons):
  analyses, not validity.
- `decide`: combines the layers' findings into one verdict (the most severe wins); reads no file.

Imports run one way: `read/` imports nothing of the judge but itself; a layer (and `localise/`)
imports `read/`, `findings` and the packages below the judge, never another layer; `decide`
imports the layers. tests/test_layout.py holds this.

May import: `store`, `spec`, `machine`, `run` (the run result and the contamination
measurement); never `report`, the session or the pytest face.
"""
