"""The training engine's own parts beyond the kernels: rewards, GRPO advantages, the loss, the
optimizer and the weight audit (``rl.py``) and the token-budgeted micro-batches (``budget.py``).

May import ``kernels/``, ``model.py`` and ``env.py``; never ``rollout/``, ``evidence/`` or the
job.
"""
