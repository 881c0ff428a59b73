"""Which keys a query sees: causal, a sliding window, packed documents, from the
tokens' original positions (so the same mask holds in every layout)."""
from __future__ import annotations

import torch

from ..ops._collectives import all_gather_invariant
from ._layout import layout_positions

__all__ = ["visible", "documents"]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, *, causal: bool, window: int | None,
            q_doc: torch.Tensor | None = None,
            k_doc: torch.Tensor | None = None) -> torch.Tensor | None:
    """The boolean mask (``True``: attend) of queries at original positions ``q_pos``
    over keys at ``k_pos``: ``(sq, sk)``, or ``(batch, 1, sq, sk)`` with documents;
    ``None`` when every key is visible (SDPA then needs no mask).

    A key ``j`` is visible to a query ``i`` when ``j <= i`` (``causal``), ``|i - j| <
    window`` (``window``; transformers' sliding window: ``i - j < window`` under a
    causal mask), and both lie in the same document."""
    mask = None
    diff = q_pos[:, None] - k_pos[None, :]
    if causal:
        mask = diff >= 0
    if window is not None:
        near = diff.abs() < window
        mask = near if mask is None else mask & near
    if q_doc is not None:
        same = q_doc[:, None, :, None] == k_doc[:, None, None, :]
        mask = same if mask is None else mask & same
    return mask


def documents(position_ids: torch.Tensor, axis: str, cp: int, balanced: bool) -> torch.Tensor:
    """The document of every token of the whole sequence, in the layout's order
    (``(batch, seq)``), from this rank's block of ``position_ids``: a document starts
    where its ``position_ids`` restart at 0 (as transformers' packed sequences).

    One all-gather of the (integer) ids; the documents are counted in the
    sequence's own order and put back into the layout's."""
    gathered = all_gather_invariant(position_ids, axis, axis=1, tiled=True)
    n = gathered.shape[1]
    pos = layout_positions(n, cp, balanced).to(gathered.device)
    natural = torch.empty_like(gathered)
    natural[:, pos] = gathered
    doc = torch.cumsum(natural == 0, dim=1)
    return doc[:, pos]
