"""pytest-rlkernel-matrix: the RL-Kernel train/rollout ablation matrix as pytest items.

Data flows matrix file -> cells -> run -> evidence -> verdict -> report; each step is one module
(`matrix`, `cells`, `runner`, `evidence`/`metrics`, `verdict`, `report`). `plugin` holds the hooks.
Nothing here imports torch, vllm or megatron at import time.
"""

__version__ = "0.1.0"
