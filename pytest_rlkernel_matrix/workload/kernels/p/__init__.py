"""P's backends: the native math each framework runs in production (``native.py``: vLLM's and
Megatron's eager/compiled ops; ``p_logp.py``: Megatron's chunked logp; ``triton_decode.py``:
vLLM's Triton decode attention).

May import torch and triton only; the dispatch that picks them is ``kernels/side.py``.
"""
