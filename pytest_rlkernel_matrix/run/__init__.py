"""Running one cell's process: the environment contract and the process (`runner`), the
launchers (local, Slurm), whole-tree process control (`procs`), the matrix root's lock
(`rootlock`), GPU sets (`devices`), CPU slices (`cpushare`) and contamination sampling
(`contamination`).

May import: `store`, `spec`, `machine`; never `judge`, `report` or the pytest face.
"""
