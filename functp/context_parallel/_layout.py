"""Where a sequence's tokens sit on a ``cp`` axis: contiguous blocks, or the causal
load-balanced layout, and every token's position in the whole sequence.

Under a causal mask, the last block of a sequence attends to every key and the first
to one block: contiguous blocks leave rank 0 idle most of the step. The load-balanced
layout cuts the sequence into ``2 * cp`` chunks and gives rank ``i`` chunks ``i`` and
``2 * cp - 1 - i`` (one early, one late), so every rank does the same work. The mask
then needs each token's original position, which :func:`positions` gives (the same
numbers a rotary embedding needs).
"""
from __future__ import annotations

from typing import Any

import optree
import torch

from ..runtime._errors import ShardingError
from ..mapping._sharding import shard, unshard
from ..mesh._mesh import Mesh
from ..mesh._spec import P
from ..ops._collectives import axis_index, axis_size

__all__ = ["cp_shard", "cp_unshard", "cp_positions", "layout_positions", "check_length"]


def check_length(n: int, cp: int, balanced: bool, what: str) -> None:
    """Raises naming the fix unless a whole sequence of length ``n`` splits into the
    layout's chunks (``2 * cp`` when ``balanced``, else ``cp``)."""
    chunks = 2 * cp if balanced else cp
    if n % chunks == 0:
        return
    pad = -n % chunks
    other = ("" if not balanced or n % cp else
             f", or pass balanced=False (contiguous blocks: a multiple of {cp})")
    raise ShardingError(
        f"{what}: a sequence of {n} tokens does not split over cp={cp}: the "
        f"{'load-balanced layout gives each rank two equal chunks, so the length must be a multiple of 2 * cp' if balanced else 'length must be a multiple of cp'}"
        f" = {chunks}; pad it with {pad} tokens to {n + pad} (give the padding its own "
        f"position_ids starting at 0, so that it is a separate document, and leave it "
        f"out of the loss){other}")


def layout_positions(n: int, cp: int, balanced: bool) -> torch.Tensor:
    """The original position of every token of a length-``n`` sequence in the layout's
    order: rank ``r``'s block is ``[r * n // cp, (r + 1) * n // cp)`` of it."""
    if not balanced:
        return torch.arange(n)
    c = n // (2 * cp)
    chunks = torch.arange(n).view(2 * cp, c)
    order = [j for r in range(cp) for j in (r, 2 * cp - 1 - r)]
    return chunks[order].reshape(-1)


def _reorder(tree: Any, cp: int, dim: int, balanced: bool, inverse: bool, what: str) -> Any:
    def one(path, x):
        if not isinstance(x, torch.Tensor) or not balanced:
            return x
        if x.ndim <= dim:
            raise ShardingError(
                f"{what}: leaf {path!r} has shape "
                f"{tuple(x.shape)}, no dimension {dim} to split (pass dim=)")
        check_length(x.shape[dim], cp, balanced, f"{what}: leaf {path!r} dim {dim}")
        perm = layout_positions(x.shape[dim], cp, True).to(x.device)
        return x.index_select(dim, torch.argsort(perm) if inverse else perm)
    paths, leaves, treespec = optree.tree_flatten_with_path(tree)
    return optree.tree_unflatten(treespec, [one(p, x) for p, x in zip(paths, leaves)])


def _spec(spec, axis: str, dim: int):
    return spec if spec is not None else P(*([None] * dim), axis)


def cp_shard(tree: Any, mesh: Mesh, *, axis: str = "cp", dim: int = 1,
             balanced: bool = True, spec: Any = None) -> Any:
    """Whole sequences -> this rank's blocks over ``axis``, in the causal
    load-balanced layout (rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i`` of
    ``2 * cp``) or, with ``balanced=False``, in contiguous blocks.

    **Arguments:** ``tree`` – a tensor or pytree of full tensors (token ids, labels,
    ``position_ids``, hidden states), the same on every rank; ``mesh`` – the mesh;
    ``axis`` – the context-parallel axis; ``dim`` – the sequence dimension (1 for
    ``(batch, seq)``, 2 for SDPA's ``(batch, heads, seq, head_dim)``); ``balanced`` –
    the layout; ``spec`` – the spec of the reordered tensors (default: ``axis`` at
    ``dim``, the rest replicated), e.g. ``P(None, "tp", "cp", None)`` for heads over tp.

    **Returns:** the blocks, as :func:`functp.shard` gives them. No communication.
    Give the same ``balanced`` to :func:`functp.attention` and
    :func:`cp_positions`. Example (4 simulated ranks)::

        def layout():
            mesh = functp.make_mesh((4,), ("cp",))
            return functp.cp_shard(torch.arange(16)[None], mesh)[0].tolist()

        print(functp.simulate(layout, 4))
        # prints:
        # [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    """
    cp = mesh.shape[axis]
    if not balanced:
        for path, x in zip(*optree.tree_flatten_with_path(tree)[:2]):
            if isinstance(x, torch.Tensor) and x.ndim > dim:
                check_length(x.shape[dim], cp, False, f"functp.cp_shard: leaf {path!r} dim {dim}")
    ordered = _reorder(tree, cp, dim, balanced, False, "functp.cp_shard")
    return shard(ordered, mesh, _spec(spec, axis, dim))


def cp_unshard(tree: Any, mesh: Mesh, *, axis: str = "cp", dim: int = 1,
               balanced: bool = True, spec: Any = None) -> Any:
    """This rank's blocks -> whole sequences in their own order: the inverse of
    :func:`cp_shard` (an all-gather per leaf, as :func:`functp.unshard`).

    **Arguments:** as :func:`cp_shard`, ``tree`` holding blocks.

    **Returns:** the full tensors. Example (4 simulated ranks)::

        def round_trip():
            mesh = functp.make_mesh((4,), ("cp",))
            x = torch.arange(16)[None]
            return torch.equal(functp.cp_unshard(functp.cp_shard(x, mesh), mesh), x)

        print(functp.simulate(round_trip, 4))
        # prints:
        # [True, True, True, True]
    """
    full = unshard(tree, mesh, _spec(spec, axis, dim))
    return _reorder(full, mesh.shape[axis], dim, balanced, True, "functp.cp_unshard")


def cp_positions(seq_len: int, mesh: Mesh | None = None, *, axis: str = "cp",
                 balanced: bool = True) -> torch.Tensor:
    """The original positions of this rank's tokens of a ``seq_len``-token sequence
    laid out by :func:`cp_shard`: what a rotary embedding needs.

    **Arguments:** ``seq_len`` – the whole sequence's length; ``mesh`` – outside a
    shard_map body, the mesh (inside one, leave it ``None``: the body's ``axis`` is
    used); ``axis``, ``balanced`` – as :func:`cp_shard`.

    **Returns:** an int64 tensor of ``seq_len // cp`` positions. Example (inside a
    body on a 4-rank ``cp`` axis, rank 1)::

        functp.cp_positions(16)      # tensor([ 2,  3, 12, 13])
    """
    if mesh is None:
        cp, me = axis_size(axis), axis_index(axis)
    else:
        cp, me = mesh.shape[axis], mesh.coordinate[axis]
    check_length(seq_len, cp, balanced, "functp.cp_positions")
    blk = seq_len // cp
    return layout_positions(seq_len, cp, balanced)[me * blk:(me + 1) * blk]
