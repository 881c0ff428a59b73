"""One all-gather for a group of FSDP blocks: FSDP2's flat buffer, copy-in and copy-out.

FSDP gathers a module's weights when it runs. One collective per weight pays each
call's launch and latency once per weight (thousands a step on a large model, each a
NCCL launch on a GPU); FSDP2 and Megatron-FSDP instead copy a group's blocks into one
flat buffer per dtype, all-gather it once, and copy each whole weight out of the
result. Here the copies are ordinary torch ops and the gather is functp's tiled
``all_gather``, so autograd transposes the lot: the gradients of the group's weights
are copied into one flat gradient (the copy-out's transpose), reduce-scattered by the
gather's transpose in one collective, and split back into each block's gradient (the
copy-in's transpose). Values and gradients are those of a gather per weight.

Every block of a group is even over the axis (FSDP splits only a dimension the axis
divides), so a rank's part of the flat buffer is the concatenation of its blocks, all
ranks' parts the same length: no padding is needed, and none shows in what the user
sees (the blocks, their specs, checkpoints).

The group's reduce-scatter stays in flight during the rest of the backward, as a
gather per weight's did (``ops/_overlap``): where every block of a flat buffer is an
input of the same top-level body (its entry's :class:`~functp.ops._overlap.Sink`
tagged it), the buffer carries a :class:`_FlatSink`, and the gather's backward
launches the reduce-scatter without waiting and hands each block its piece of the
result (views: read only after the entry's wait), added to that input's gradient at
the entry. Otherwise (HSDP's aliases, blocks made inside the body, a backward that
cannot defer) it is waited on at once.
"""
from __future__ import annotations

from typing import Hashable

import torch

from ..ops._collectives import all_gather, axis_size, pvary
from ..ops._overlap import SINK

__all__ = ["gather_group"]


class _FlatSink:
    """A flat buffer's stand-in for its blocks' entry sink: the gather's backward
    (``_ops._ag_bwd``) calls :meth:`defer` with the buffer's gradient and the launch
    of its reduce-scatter; each block's piece goes to its input at the entry."""

    def __init__(self, tags: list, shapes: list) -> None:
        self.tags, self.shapes = tags, shapes      # per block: (Sink, index), its shape

    def defer(self, _, ct: torch.Tensor, launch) -> bool:
        pieces = []

        def first():                # the collective, launched once, not waited on
            out = launch()
            pieces.extend(out.split([s.numel() for s in self.shapes]))
            return pieces[0].view(self.shapes[0])
        (sink, j), rest = self.tags[0], self.tags[1:]
        if not sink.defer(j, ct, first):
            return False            # (nothing launched: the gather waits as usual)
        for (sink, j), piece, shape in zip(rest, pieces[1:], self.shapes[1:]):
            sink.defer(j, ct, lambda piece=piece, shape=shape: piece.view(shape))
        return True


def _tag(flat: torch.Tensor, blocks: list) -> torch.Tensor:
    """``flat`` with a :class:`_FlatSink` where each of ``blocks`` (its parts, in
    order) is an input of one body's entry; else as it is."""
    # (a block twice, a tied weight used by two modules: both pieces are added)
    tags = [b.__dict__.get(SINK) for b in blocks]
    if tags and all(t is not None for t in tags) and len({id(t[0]) for t in tags}) == 1:
        if flat.__dict__.get(SINK) is not None:      # (the one block itself: a view)
            flat = flat.view_as(flat)
        flat.__dict__[SINK] = (_FlatSink(tags, [b.shape for b in blocks]), 0)
    return flat


def gather_group(blocks: dict[Hashable, tuple[torch.Tensor, int]], axis,
                 replicate: tuple[str, ...] = ()) -> dict[Hashable, torch.Tensor]:
    """The whole weights of a group of blocks, gathered over ``axis`` with one
    all-gather per dtype (inside a ``shard_map`` body).

    **Arguments:** ``blocks`` – key -> (this rank's block, the dimension it is split
    on over ``axis``); ``axis`` – a mesh axis or a tuple of them; ``replicate`` – axes
    over which the blocks are replicated (HSDP): their gradient is also summed over
    them, in the gradient buckets of the body's replicated inputs.

    **Returns:** key -> the whole weight (the blocks of every rank concatenated along
    their dimension, in rank order), as ``all_gather(block, axis, axis=dim,
    tiled=True)`` would give each.

    Example (inside a body over a 2-rank ``fsdp`` axis)::

        full = gather_group({"w": (w_block, 0), "b": (b_block, 0)}, "fsdp")
        full["w"].shape        # (2 * w_block.shape[0], *w_block.shape[1:])
    """
    by_dtype: dict[tuple, list] = {}
    for key, (block, _) in blocks.items():
        by_dtype.setdefault((block.dtype, block.device), []).append(key)
    size, out = axis_size(axis), {}
    for keys in by_dtype.values():
        # HSDP: each block through its own alias over the replicas, whose gradients the
        # body's entry sums in its buckets with the rest of the replicated inputs (a
        # pvary of the flat buffer instead would leave those aliases unused, and the
        # entry's bucket, holding every replicated input on every rank, sends zeros)
        parts = [(pvary(blocks[k][0], replicate) if replicate else blocks[k][0]).reshape(-1)
                 for k in keys]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)          # copy-in
        if not replicate:       # (HSDP: its aliases' gradients go through the buckets)
            flat = _tag(flat, [blocks[k][0] for k in keys])
        gathered = all_gather(flat, axis, axis=0, tiled=True).view(size, -1)
        # (split, not a slice per weight: its transpose is one concatenation)
        for key, piece in zip(keys, gathered.split([p.numel() for p in parts], dim=1)):
            block, dim = blocks[key]
            shape = list(block.shape)
            shape[dim] *= size
            # rank r's block sits at [r * n, (r + 1) * n) along dim: copy-out
            full = piece.reshape(size, *block.shape).movedim(0, dim).reshape(shape)
            if len(keys) > 1 and (size == 1 or not full.is_contiguous()):
                # (a view: it would keep the group's buffer alive, and share its
                # storage with the other weights, which free_full_weight tells apart
                # by storage)
                full = full.clone(memory_format=torch.contiguous_format)
            out[key] = full
    return out
