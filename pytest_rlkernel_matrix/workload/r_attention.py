"""R's core attention on the torch path (CPU, and the GPU's multi-rank cells): causal, fp32,
the same bits for a query row in training, prefill and decode, whatever the batch.

Moved out of ``kernels.py`` (which re-exports it) when issue 46 made it walk the key axis in
fixed blocks up to the keys in use instead of over the cache's whole capacity.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .weights import Tiling


def r_core_attention(q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, tiling: Tiling,
                     keys: int | None = None) -> Tensor:
    """Causal attention, fp32, identical per query row for prefill, decode and training.

    ``q [B, T, Hq, D]`` fp32, ``q_pos [B, T]``, ``k``/``v`` ``[B, S, Hkv, D]``; ``keys``: how
    many leading keys are in use (default ``S``; decode passes the span, so a cache's unused
    tail is never read). Query rows are grouped per (batch, kv head), padded to fixed query
    tiles, and processed in fixed chunks of ``chunk`` tiles. Each chunk walks the key axis in
    fixed blocks of ``key_block`` keys, 0, 1, 2, ..., with an online softmax (running max ``m``,
    sum ``l`` and output ``acc``), and stops after the block that holds the largest position
    among its rows (CPU; on CUDA every block of ``keys``: no host sync, so it can be captured).
    Every library call has the same shapes (``[chunk, tile, D] x [chunk, D, block]`` and back)
    whatever the batch, the length or prefill vs decode. The cost follows the keys that exist,
    not the cache's capacity (issue 46; before it, every chunk ran over the whole key span).

    Why a row's result cannot depend on the batch: its tile holds rows of its own sequence only
    (the batch decides which chunk the tile lands in, not what is in it); the blocks a row takes
    part in are 0 .. its own last block, always in that order and always the same shapes;
    a block past the row's own last one is fully masked for that row, so its scores are -inf,
    the running max stays ``m`` (``max(m, -inf)``), ``alpha = exp(m - m) = 1`` and the block
    adds ``exp(-inf) = 0`` to the sum and ``0 @ v = 0`` to the output: ``x * 1 + 0 = x``,
    exactly. So a chunk that walks further for another row's sake leaves this row's bits as
    they are (padding rows see key 0 only and are dropped).
    """
    b, t, hq, d = q.shape
    hkv, qt, ch, kb = k.shape[2], tiling.query_tile, tiling.chunk, tiling.key_block
    g = hq // hkv
    used = k.shape[1] if keys is None else min(keys, k.shape[1])
    nblk_all = max(1, -(-used // kb))
    span = nblk_all * kb
    kf = F.pad(k[:, :used].float(), (0, 0, 0, 0, 0, span - used)).permute(0, 2, 1, 3)
    vf = F.pad(v[:, :used].float(), (0, 0, 0, 0, 0, span - used)).permute(0, 2, 1, 3)
    kf, vf = kf.reshape(b * hkv, span, d), vf.reshape(b * hkv, span, d)
    rows = q.reshape(b, t, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b * hkv, t * g, d)
    pos = q_pos[:, None, :, None].expand(b, hkv, t, g).reshape(b * hkv, t * g)
    n = t * g
    npad = -(-n // qt) * qt
    rows = F.pad(rows, (0, 0, 0, npad - n))
    pos = F.pad(pos, (0, npad - n), value=0)  # padding rows see key 0 only: no NaN, no work
    nt = npad // qt
    probs_q = rows.reshape(b * hkv * nt, qt, d)
    probs_pos = pos.reshape(b * hkv * nt, qt)
    group = torch.arange(b * hkv, device=q.device).repeat_interleave(nt)
    p = probs_q.shape[0]
    ppad = -(-p // ch) * ch
    probs_q = F.pad(probs_q, (0, 0, 0, 0, 0, ppad - p))
    probs_pos = F.pad(probs_pos, (0, 0, 0, ppad - p), value=0)
    group = F.pad(group, (0, ppad - p))
    key_idx = torch.arange(span, device=q.device)
    scale = 1.0 / math.sqrt(d)
    on_host = q.device.type == "cpu"  # the chunk's own last block, read without a device sync
    outs = []
    for i in range(0, ppad, ch):
        gi, qc, pc = group[i:i + ch], probs_q[i:i + ch], probs_pos[i:i + ch, :, None]
        nblk = min(nblk_all, int(pc.max()) // kb + 1) if on_host else nblk_all
        m = l_ = acc = None
        for j in range(nblk):
            blk = slice(j * kb, (j + 1) * kb)
            kj, vj = kf[:, blk].index_select(0, gi), vf[:, blk].index_select(0, gi)
            sc = torch.bmm(qc, kj.transpose(1, 2)) * scale
            sc = sc.masked_fill(key_idx[blk] > pc, float("-inf"))
            if m is None:  # block 0: every row sees key 0, so its max is finite
                m = sc.amax(-1, keepdim=True)
                e = torch.exp(sc - m)
                l_, acc = e.sum(-1, keepdim=True), torch.bmm(e, vj)
                continue
            m_new = torch.maximum(m, sc.amax(-1, keepdim=True))
            e = torch.exp(sc - m_new)
            alpha = torch.exp(m - m_new)
            l_ = l_ * alpha + e.sum(-1, keepdim=True)
            acc = acc * alpha + torch.bmm(e, vj)
            m = m_new
        assert acc is not None and l_ is not None
        outs.append(acc / l_)
    o = torch.cat(outs)[:p].reshape(b, hkv, npad, d)[:, :, :n]
    return o.reshape(b, hkv, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, hq * d)
