"""What the reference jobs leave on disk, together: artifacts and sidecars (``artifacts.py``),
RL-Kernel's and vime's own forms (``upstream.py``), per-operator probes (``probe.py``) and the
step accounting, profiles and ``slow`` drill (``profiling.py``); the engines job writes through
them.

May import ``env.py``, ``parallel.py`` and the ``kernels`` package's public names
(``kernels.side``, ``kernels.r.identity``), never a kernel backend, rollout or training.
"""
