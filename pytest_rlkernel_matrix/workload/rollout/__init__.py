"""The rollout engine's own parts beyond the kernels: seeded top-p sampling (``sampling.py``), the
decode loop under CUDA/HIP graphs (``graphs.py``) and vime's batch-invariance replay layouts
(``replay_cases.py``).

May import ``kernels/``, ``model.py``, ``weights.py`` and ``env.py``; never ``training/``,
``evidence/`` or the job.
"""
