"""The kernels of the matrix's modules, each module's P and R side by side: ``attention.py``,
``ffn.py``, ``logp.py`` (and ``comm.py`` under TP) hold both sides of one module, dispatching to
P's backends (``p/``) and R's (``r/``); ``base.py`` holds what they share (``ModuleKernel``, the R
primitives, ``r_backend``) and ``side.py`` one side's kernels (``SideKernels``).

May import ``workload.weights`` and ``workload.parallel`` only: never the model, rollout,
training, evidence or the job (tests/test_layout.py).
"""
