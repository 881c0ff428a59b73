"""Ring attention: the key/value blocks travel around the ``cp`` ring with
``ppermute``, and each query block's softmax is merged block by block (the online
softmax: a running max, denominator and weighted sum, which is the log-sum-exp merge
of the blocks' partial attentions).

The next block's ``ppermute`` is issued before this block's scores are computed:
forward collectives are waited on at their first use (``ops/_lazy``), so the transfer
travels while this rank computes. The backward is autograd's through these ops:
``ppermute``'s transpose sends the key/value gradients back around the ring, so the
gradients are exactly those of the whole sequence's attention.
"""
from __future__ import annotations

import torch

from ..ops._collectives import ppermute
from ._mask import visible

__all__ = ["ring", "cap"]


def cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logit soft-capping (Gemma-2's): ``softcap * tanh(scores / softcap)``; a
    score's own function, so capping block by block is exact."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def _block(q5, k, v, mask, softcap=None):
    """Scores of the grouped queries ``q5`` ``(b, hk, g, sq, d)`` (already scaled)
    against one key block ``(b, hk, sk, d)``, soft-capped (``softcap``) and masked."""
    s = cap(q5 @ k.unsqueeze(2).transpose(-1, -2), softcap)
    if mask is not None:
        m = mask if mask.ndim == 2 else mask.unsqueeze(2)     # (b, 1, 1, sq, sk)
        s = s.masked_fill(~m, float("-inf"))
    return s


def ring(q, k, v, axis: str, n: int, me: int, pos, scale: float, causal: bool,
         window, docs, softcap: float | None = None) -> torch.Tensor:
    """This rank's attention output ``(b, hq, s, dv)`` over the whole sequence.

    ``pos``: every token's original position in the layout's order; ``docs``: the
    documents in that order (``(b, n * s)``) or ``None``."""
    b, hq, s, d = q.shape
    hk = k.shape[1]
    q5 = (q * scale).view(b, hk, hq // hk, s, d)
    q_pos = pos[me * s:(me + 1) * s]
    q_doc = None if docs is None else docs[:, me * s:(me + 1) * s]
    right = [(r, (r + 1) % n) for r in range(n)]
    same = k.shape == v.shape
    kv = torch.stack([k, v]) if same else (k, v)      # one message per step where it can
    m = l = acc = None
    for step in range(n):
        # issued now, waited on where the next step first reads it
        nxt = ppermute(kv, axis, right) if step < n - 1 else None
        src = (me - step) % n                  # whose block this rank holds now
        kb, vb = (kv[0], kv[1])
        k_doc = None if docs is None else docs[:, src * s:(src + 1) * s]
        mask = visible(q_pos, pos[src * s:(src + 1) * s], causal=causal, window=window,
                       q_doc=q_doc, k_doc=k_doc)
        # Every rank runs every step, even a block its mask hides entirely: a rank that
        # skipped one would leave a received block unused, autograd would skip that
        # ppermute's backward there, and its peers would wait in theirs.
        sc = _block(q5, kb, vb, mask, softcap)
        # The max only keeps exp() in range (the result does not depend on it): no
        # gradient. Step 0 is this rank's own block, where every query sees itself,
        # so m is finite from then on and a hidden score's exp is exactly 0.
        m_blk = sc.amax(-1, keepdim=True).detach()
        m_new = m_blk if m is None else torch.maximum(m, m_blk)
        p = torch.exp(sc - m_new)
        pv = p @ vb.unsqueeze(2)
        if m is None:
            l, acc = p.sum(-1, keepdim=True), pv
        else:
            rescale = torch.exp(m - m_new)
            l, acc = l * rescale + p.sum(-1, keepdim=True), acc * rescale + pv
        m, kv = m_new, nxt
    return (acc / l).reshape(b, hq, s, -1)
