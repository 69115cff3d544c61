"""Second reference job: rollout in real vLLM, training forward in real Megatron-core.

Never imported at plugin load (it pulls torch, vLLM and Megatron-core). See
``docs/en/engines.md``. Entry point: ``python -m pytest_rlkernel_matrix.engines``.
"""
