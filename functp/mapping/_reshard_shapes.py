"""Global shapes of local blocks: given by the caller (``shapes=``, checked against
this rank's block) or learned with one small all-gather of every rank's block shapes
(checked the same way on every rank). ``reshard``, ``unshard``, interop and
checkpoints need them for uneven (torch.chunk-style) blocks, whose sizes differ
between ranks (``leaf_specs``, matching a tree with its specs, is ``mesh._tree``'s).
Example (4 ranks)::

    items, treespec = leaf_specs(local, mesh, P("x"), "tree")
    shapes_for(items, treespec, mesh, None, "functp.unshard")   # [(10, 2)]
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..ops import _primitives as prim
from ..runtime._errors import ShardingError, leaf_text
from ..mesh._layout import layout, local_shape, mesh_coordinates, size_from_blocks
from ..mesh._mesh import Mesh
from ..mesh._spec import P

__all__ = ["given_shapes", "check_block", "checked_shapes", "exchange_shapes",
           "shapes_for"]


def given_shapes(treespec, shapes, items, what: str) -> list[tuple[int, ...] | None]:
    """``shapes`` (a tree like the values, with a shape or a tensor at every tensor
    leaf) -> one global shape per leaf (``None`` for non-tensor leaves)."""
    try:
        subtrees = treespec.flatten_up_to(shapes)
    except (ValueError, TypeError) as e:
        raise ShardingError(
            f"{what}: shapes= must have the structure of the tree ({treespec}), with a "
            f"shape (tuple or torch.Size) or a tensor at every tensor leaf: {e}") from None
    out: list[tuple[int, ...] | None] = []
    for (path, x, _), s in zip(items, subtrees):
        if not isinstance(x, torch.Tensor):
            out.append(None)
            continue
        if isinstance(s, torch.Tensor):
            s = s.shape
        ok = isinstance(s, (tuple, list)) and all(isinstance(i, int) and i >= 0 for i in s)
        if not ok or len(s) != x.ndim:
            raise ShardingError(
                f"{what}: shapes= gives {s!r} for {leaf_text(path, x.shape)}, a block; give "
                f"its global shape, a tuple of {x.ndim} sizes")
        out.append(tuple(int(i) for i in s))
    return out


def check_block(path: str, x: torch.Tensor, spec: P, n: Sequence[int], mesh: Mesh,
                what: str) -> None:
    """A block against the global shape the caller gave. This rank's view only: a
    block that breaks the promise raises here (leave ``shapes=`` out to have the
    layout checked the same way on every rank)."""
    want = local_shape(n, layout(spec, x.ndim), mesh)
    if tuple(x.shape) != want:
        raise ShardingError(
            f"{what}: {leaf_text(path, x.shape, spec, mesh)} is this rank's block "
            f"(coordinate {mesh.coordinate}), but the global shape {tuple(n)} given for it "
            f"makes this rank's block {want}; pass the global shape the blocks come from")


def exchange_shapes(items, mesh: Mesh, what: str) -> list[tuple[int, ...] | None]:
    """Global shapes of local blocks from one small all-gather of every rank's block
    shapes (over the whole mesh, one int64 row per rank). Every rank checks the same
    gathered table, so a bad layout raises the same error everywhere."""
    row = torch.tensor([n for _, x, s in items if s is not None for n in x.shape],
                       dtype=torch.int64, device=mesh.device_type)
    table = prim.all_gather(row.unsqueeze(0), mesh.axis_group(mesh.axis_names), 0).cpu()
    coords = mesh_coordinates(mesh)
    out: list[tuple[int, ...] | None] = []
    k = 0
    for p, x, spec in items:
        if spec is None:
            out.append(None)
            continue
        sizes = table[:, k:k + x.ndim].tolist()
        k += x.ndim
        n = []
        for d, axes in enumerate(layout(spec, x.ndim)):
            total = size_from_blocks([s[d] for s in sizes], coords, axes, mesh.shape)
            if total is None:
                by_rank = [sizes[r][d] for r in range(len(coords))]
                how = (f"torch.chunk-style blocks over {axes}" if axes
                       else "the same size on every rank (the dimension is not split)")
                raise ShardingError(
                    f"{what}: {leaf_text(p, spec=spec, mesh=mesh)} has blocks of sizes "
                    f"{by_rank} along dimension {d} on the mesh's ranks (in mesh order), "
                    f"which are not {how} of any global size; blocks must come from "
                    f"functp.shard/reshard/load, or pass shapes=")
            n.append(total)
        out.append(tuple(n))
    return out


def checked_shapes(items, treespec, shapes, mesh: Mesh, what: str) -> list:
    """The global shapes the caller gave (``shapes=``), each checked against this
    rank's block."""
    out = given_shapes(treespec, shapes, items, what)
    for (p, x, s), n in zip(items, out):
        if n is not None:
            check_block(p, x, s, n, mesh, what)
    return out


def shapes_for(items, treespec, mesh: Mesh, shapes, what: str) -> list:
    """Global shapes: given, or exchanged once if some leaf is split."""
    if shapes is not None:
        return checked_shapes(items, treespec, shapes, mesh, what)
    if any(s is not None and any(layout(s, x.ndim, mesh)) for _, x, s in items):
        return exchange_shapes(items, mesh, what)
    return [None if s is None else tuple(x.shape) for _, x, s in items]
