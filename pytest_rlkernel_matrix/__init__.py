"""pytest-rlkernel-matrix: the RL-Kernel train/rollout ablation matrix as pytest items.

Data flows matrix file -> cells -> run -> evidence -> verdict -> record -> report, through the
subpackages `spec`, `run` (driven by `session`: plan -> runner -> judge -> recorder, with the
`scheduler` of the processes that follow a cell's first run), `judge` and `report`, over
`machine` (preflight) and `store` (safe reads, atomic writes, redaction); docs/architecture.md
names each step's module. `plugin` holds the hooks.
Nothing here imports torch, vllm or megatron at import time.
"""

__version__ = "0.1.0"
