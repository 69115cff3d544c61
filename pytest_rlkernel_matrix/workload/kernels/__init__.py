"""The kernels of the matrix's modules (attention, ffn, logp, and comm under TP): per module its
P (production/native) and R (RL-Kernel aligned) implementations, chosen per side by ``SideKernels``.

Owns ``side.py`` (the per-module dispatch), ``p/`` (P's backends) and ``r/`` (R's backends).
May import ``workload.weights`` and ``workload.parallel`` only: never the model, rollout,
training, evidence or the job (tests/test_layout.py).
"""
