"""``functp.attention``: softmax attention inside a shard_map body, over a sequence
whose blocks are split along a ``cp`` axis, with the whole sequence's gradients.

Three strategies, each built from functp's collectives so that the gradients come
from their transposes:

- ``"allgather"``: K and V are all-gathered (one collective), each rank attends its
  queries to the whole sequence with torch's SDPA; the backward reduce-scatters the
  K/V gradients (``all_gather``'s transpose is ``psum_scatter``).
- ``"ulysses"``: an all-to-all trades heads for sequence (each rank gets
  ``heads / cp`` heads of the whole sequence), SDPA runs on them, a second
  all-to-all trades back. The head counts must divide by ``cp``.
- ``"ring"``: K/V blocks travel around the ring with ``ppermute`` (``_ring``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..runtime._errors import ShardingError
from ..ops._collectives import all_gather, all_to_all, axis_index, axis_size
from ._layout import layout_positions
from ._mask import documents, visible
from ._ring import cap, ring

__all__ = ["attention", "attend", "STRATEGIES"]

STRATEGIES = ("allgather", "ulysses", "ring")


def _fail(msg: str) -> None:
    raise ShardingError(f"functp.attention: {msg}")


def _check(q, k, v, axis, strategy, n, balanced, window, position_ids, softcap=None) -> None:
    """Every bad argument, named with its shape and the fix; the same on every rank
    (the blocks' shapes are)."""
    if strategy not in STRATEGIES:
        _fail(f"strategy={strategy!r} is not one of {STRATEGIES}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            _fail(f"{name} must be a tensor in SDPA's layout (batch, heads, seq, head_dim) "
                  f"holding this rank's block of the sequence, got "
                  f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    b, hq, s, d = q.shape
    if k.shape[:3] != (b, k.shape[1], s) or v.shape[:3] != k.shape[:3] or k.shape[3] != d:
        _fail(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must share "
              f"batch and sequence block (self-attention), k/v their heads, q/k head_dim")
    if hq % k.shape[1]:
        _fail(f"q has {hq} heads and k/v {k.shape[1]}: grouped-query attention needs the "
              f"q heads to be a multiple of the k/v heads")
    if balanced and s % 2:
        _fail(f"balanced=True: this rank's block of {s} tokens (q {tuple(q.shape)}) must "
              f"hold two equal chunks; lay the sequence out with functp.cp_shard (a "
              f"length that is a multiple of 2 * {axis!r} size = {2 * n}), or pass "
              f"balanced=False for contiguous blocks")
    if strategy == "ulysses" and hq % n:
        _fail(f"strategy='ulysses' splits this rank's {hq} q heads (q {tuple(q.shape)}) "
              f"over {axis!r} (size {n}), which does not divide them: use a head count "
              f"that is a multiple of {n} here (with tensor parallelism, of tp x cp in "
              f"the model), or strategy='allgather' or 'ring'")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not softcap > 0):
        _fail(f"softcap={softcap!r} must be a positive number (scores become "
              f"softcap * tanh(scores / softcap), as Gemma-2's attn_logit_softcapping)")
    if window is not None and (not isinstance(window, int) or window < 1):
        _fail(f"window={window!r} must be a positive int (keys with |i - j| < window)")
    if position_ids is not None and (position_ids.ndim != 2 or position_ids.shape[1] != s
                                     or position_ids.shape[0] not in (1, b)):
        _fail(f"position_ids {tuple(position_ids.shape)} must be this rank's block "
              f"(batch or 1, {s}), as functp.cp_shard lays them out")


def _sdpa(q, k, v, mask, scale, causal=False, softcap=None):
    if mask is not None and mask.ndim == 4 and mask.shape[0] != q.shape[0]:
        mask = mask.expand(q.shape[0], -1, -1, -1)
    if softcap is not None:
        return _capped(q, k, v, mask, scale, causal, softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          is_causal=causal,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _capped(q, k, v, mask, scale, causal, softcap):
    """SDPA's math with the scores soft-capped before the mask (no torch kernel caps
    them): the ``sq x sk`` scores of this call held at once, as an eager attention's."""
    g = q.shape[1] // k.shape[1]
    if g > 1:                           # (GQA: each k/v head serves g query heads)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = cap((q @ k.transpose(-1, -2)) * scale, softcap)
    if causal:                          # (SDPA's is_causal: the top-left triangle)
        tri = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        mask = tri if mask is None else mask & tri
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _gather_kv(k, v, axis):
    if k.shape == v.shape:               # one collective for both
        kv = all_gather(torch.stack([k, v]), axis, axis=3, tiled=True)
        return kv[0], kv[1]
    return all_gather(k, axis, axis=2, tiled=True), all_gather(v, axis, axis=2, tiled=True)


def _ulysses(q, k, v, axis, n, pos, scale, causal, window, docs, softcap=None):
    """Heads <-> sequence: (b, h, s, d) blocks to (b, h / n, n * s, d) and back.

    Between the two, the whole sequence is put into its own order, so that a plain
    causal mask is SDPA's ``is_causal`` (no ``seq x seq`` mask on any rank, whose
    memory would not shrink with ``cp``)."""
    hk = k.shape[1]
    if hk % n:
        # fewer k/v heads than ranks: repeat each so that every rank's q heads find
        # theirs (the q heads divide by n, so by lcm(hk, n)); autograd sums the copies
        r = n // math.gcd(hk, n)
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    back = torch.argsort(pos)                   # layout order -> the sequence's own

    def whole(t, split, concat):
        return all_to_all(t, axis, split, concat, tiled=True).index_select(concat, back)
    qh = whole(q, 1, 2)
    if k.shape == v.shape:
        kv = whole(torch.stack([k, v]), 2, 3)
        kh, vh = kv[0], kv[1]
    else:
        kh, vh = whole(k, 1, 2), whole(v, 1, 2)
    natural = torch.arange(len(pos), device=pos.device)
    doc = None if docs is None else docs.index_select(1, back)
    plain = causal and window is None and doc is None
    mask = None if plain else visible(natural, natural, causal=causal, window=window,
                                      q_doc=doc, k_doc=doc)
    out = _sdpa(qh, kh, vh, mask, scale, causal=plain, softcap=softcap).index_select(2, pos)
    return all_to_all(out, axis, 2, 1, tiled=True)


def _allgather(q, k, v, axis, n, me, pos, scale, causal, window, docs, balanced,
               softcap=None):
    """This rank's queries over the gathered K/V. Under a causal mask each query chunk
    (two in the load-balanced layout) attends only to the keys it can see, K/V in the
    sequence's own order cut to the chunk's prefix (and to its window): about half
    the work and the mask of a whole ``s x seq`` block."""
    kf, vf = _gather_kv(k, v, axis)
    s = q.shape[2]
    if not causal:
        q_doc = None if docs is None else docs[:, me * s:(me + 1) * s]
        mask = visible(pos[me * s:(me + 1) * s], pos, causal=False, window=window,
                       q_doc=q_doc, k_doc=docs)
        return _sdpa(q, kf, vf, mask, scale, softcap=softcap)
    back = torch.argsort(pos)
    kf, vf = kf.index_select(2, back), vf.index_select(2, back)
    doc = None if docs is None else docs.index_select(1, back)
    c = s // 2 if balanced else s
    starts = (me * c, (2 * n - 1 - me) * c) if balanced else (me * s,)
    outs = []
    for i, start in enumerate(starts):
        lo = 0 if window is None else max(0, start - window + 1)
        end = start + c
        q_pos = torch.arange(start, end, device=pos.device)
        mask = visible(q_pos, torch.arange(lo, end, device=pos.device), causal=True,
                       window=window, q_doc=None if doc is None else doc[:, start:end],
                       k_doc=None if doc is None else doc[:, lo:end])
        outs.append(_sdpa(q[:, :, i * c:(i + 1) * c], kf[:, :, lo:end], vf[:, :, lo:end],
                          mask, scale, softcap=softcap))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: str = "cp", *,
              strategy: str = "allgather", causal: bool = False, balanced: bool = True,
              window: int | None = None, position_ids: torch.Tensor | None = None,
              scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole sequence, whose blocks
    are split over ``axis``; call it inside a shard_map body.

    **Arguments:** ``q``, ``k``, ``v`` – this rank's blocks in SDPA's layout ``(batch,
    heads, seq, head_dim)`` (spec ``P(None, None, "cp", None)``; heads may also be
    split over another axis, e.g. ``P(None, "tp", "cp", None)``), ``k``/``v`` with as
    many heads as ``q`` or a divisor (GQA); ``axis`` – the context-parallel axis;
    ``strategy`` – ``"allgather"``, ``"ulysses"`` or ``"ring"`` (module docstring;
    ``docs/long_sequences.md`` says when to pick which); ``causal`` – a causal mask
    over the tokens' original positions; ``balanced`` – the blocks are in
    :func:`functp.cp_shard`'s load-balanced layout (the default, as there) rather
    than contiguous; ``window`` – a sliding window (keys with ``|i - j| < window``);
    ``position_ids`` – this rank's block ``(batch, seq)`` of packed documents'
    positions: a document starts where they restart at 0, and no query sees another
    document's keys; ``scale`` – the score scale (default ``1 / sqrt(head_dim)``);
    ``softcap`` – logit soft-capping, the scaled scores becoming ``softcap *
    tanh(scores / softcap)`` before the mask (Gemma-2's ``attn_logit_softcapping``;
    no SDPA kernel applies it, so ``"allgather"`` and ``"ulysses"`` then compute each
    call's scores whole, as an eager attention does; ``"ring"`` caps each block's).

    **Returns:** this rank's block of the output, ``(batch, heads, seq, head_dim)``;
    its gradients (tape or ``torch.func.grad``) are the whole sequence's attention's.

    Example (inside a body over ``cp``; ``q``, ``k``, ``v`` from ``functp.cp_shard(...,
    dim=2)``)::

        out = functp.attention(q, k, v, "cp", strategy="ring", causal=True)
    """
    n = axis_size(axis)
    _check(q, k, v, axis, strategy, n, balanced, window, position_ids, softcap)
    docs = None if position_ids is None else documents(position_ids, axis, n, balanced)
    return attend(q, k, v, axis, strategy=strategy, causal=causal, balanced=balanced,
                  window=window, docs=docs, scale=scale, softcap=softcap)


def attend(q, k, v, axis: str, *, strategy: str, causal: bool, balanced: bool,
           window: int | None, docs: torch.Tensor | None, scale: float | None,
           checked: bool = True, softcap: float | None = None) -> torch.Tensor:
    """:func:`attention` with the documents already known: ``docs`` is every token's
    document ``(batch, seq)`` over the whole sequence in the layout's order (equal ids
    see each other), or ``None``; for a caller that holds whole sequences
    (``parallel/_cp``: a transformers model's padding and packed documents)."""
    n = axis_size(axis)
    if not checked:
        _check(q, k, v, axis, strategy, n, balanced, window, None, softcap)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    me, s = axis_index(axis), q.shape[2]
    pos = layout_positions(n * s, n, balanced).to(q.device)
    if strategy == "ring":
        return ring(q, k, v, axis, n, me, pos, scale, causal, window, docs, softcap)
    if strategy == "ulysses":
        return _ulysses(q, k, v, axis, n, pos, scale, causal, window, docs, softcap)
    return _allgather(q, k, v, axis, n, me, pos, scale, causal, window, docs, balanced,
                      softcap)
