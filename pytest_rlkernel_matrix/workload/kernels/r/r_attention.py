"""R's core attention on the torch path (CPU, and the GPU's multi-rank cells): causal, fp32,
the same bits for a query row in training, prefill and decode, whatever the batch.

Its dispatch is ``kernels/attention.py`` (``kernels/side.py`` re-exports it). Issue 46 tried a
walk of the key axis in fixed blocks up to the keys in use; it broke R/R bitwise in the real-vLLM
engines job (tests/test_engines.py) and was withdrawn: every chunk runs over the whole key span
again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_rlkernel_matrix.workload.weights import Tiling


def r_core_attention(q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, tiling: Tiling) -> Tensor:
    """Causal attention, fp32, identical per query row for prefill, decode and training.

    ``q [B, T, Hq, D]`` fp32, ``q_pos [B, T]``, ``k``/``v`` ``[B, S, Hkv, D]`` (S <= key span).
    Query rows are grouped per (batch, kv head), padded to fixed query tiles, and processed in
    fixed chunks of ``chunk`` tiles; each chunk does ``bmm -> mask -> max -> exp -> sum -> bmm``
    over the whole fixed key span, so every call has the same shapes.
    """
    b, t, hq, d = q.shape
    hkv, span, qt, ch = k.shape[2], tiling.key_span, tiling.query_tile, tiling.chunk
    g = hq // hkv
    kf = F.pad(k.float(), (0, 0, 0, 0, 0, span - k.shape[1])).permute(0, 2, 1, 3)
    vf = F.pad(v.float(), (0, 0, 0, 0, 0, span - v.shape[1])).permute(0, 2, 1, 3)
    kf, vf = kf.reshape(b * hkv, span, d), vf.reshape(b * hkv, span, d)
    rows = q.reshape(b, t, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b * hkv, t * g, d)
    pos = q_pos[:, None, :, None].expand(b, hkv, t, g).reshape(b * hkv, t * g)
    n = t * g
    npad = -(-n // qt) * qt
    rows = F.pad(rows, (0, 0, 0, npad - n))
    pos = F.pad(pos, (0, npad - n), value=span - 1)  # padding rows see all keys: no NaN
    nt = npad // qt
    probs_q = rows.reshape(b * hkv * nt, qt, d)
    probs_pos = pos.reshape(b * hkv * nt, qt)
    group = torch.arange(b * hkv, device=q.device).repeat_interleave(nt)
    p = probs_q.shape[0]
    ppad = -(-p // ch) * ch
    probs_q = F.pad(probs_q, (0, 0, 0, 0, 0, ppad - p))
    probs_pos = F.pad(probs_pos, (0, 0, 0, ppad - p), value=span - 1)
    group = F.pad(group, (0, ppad - p))
    key_idx = torch.arange(span, device=q.device)
    scale = 1.0 / math.sqrt(d)
    outs = []
    for i in range(0, ppad, ch):
        gi = group[i:i + ch]
        s = torch.bmm(probs_q[i:i + ch], kf.index_select(0, gi).transpose(1, 2)) * scale
        s = s.masked_fill(key_idx > probs_pos[i:i + ch, :, None], float("-inf"))
        e = torch.exp(s - s.amax(-1, keepdim=True))
        outs.append(torch.bmm(e / e.sum(-1, keepdim=True), vf.index_select(0, gi)))
    o = torch.cat(outs)[:p].reshape(b, hkv, npad, d)[:, :, :n]
    return o.reshape(b, hkv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, hq * d)
