"""Built-in reference workload: a Qwen3 train/rollout consistency step writing RL-Kernel
artifacts (``python -m pytest_rlkernel_matrix.workload``), laid out like the matrix it serves.

Owns the step (``job.py``), its inputs (``env.py``, ``factors.py``), the model (``model.py``,
``weights.py``) and the ranks (``parallel.py``); ``kernels/`` (each module's P and R side by side),
``rollout/``, ``training/`` and ``evidence/`` are its rooms. May import torch and
``machine/``'s probe helpers, never the harness (docs/architecture.md, "The reference workload").
"""
