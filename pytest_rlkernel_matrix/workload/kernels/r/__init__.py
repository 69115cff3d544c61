"""R's backends: the batch-invariant implementations used identically on both sides
(``r_attention.py``: torch core attention; ``triton_kernels.py`` / ``triton_backward.py`` /
``autograd.py``: the GPU forward, its deterministic backward and their autograd wrapper;
``identity.py``: their backend ids and contract).

May import ``workload.weights`` and P's shared math (``kernels/p/native.py``), nothing above.
"""
