"""Built-in reference workload: a Qwen3 train/rollout consistency step writing RL-Kernel
artifacts (``python -m pytest_rlkernel_matrix.workload``); ``profiling`` holds its step accounting,
its profile runs and the ``slow`` drill."""
