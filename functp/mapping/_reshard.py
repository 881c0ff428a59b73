"""``reshard``: move local blocks from one spec to another with the fewest collectives.

Three parts: the planner (``_reshard_plan.plan``: which collectives, from the two
layouts alone), the shape exchange (``_reshard_shapes``: the global shapes that
uneven blocks need) and, here, the executor (``run_plan``: a plan run on this rank's
block, outside shard_map with the raw collectives, inside with functp's
differentiable ones) and the public functions. What a spec means on a mesh (block
sizes, offsets, the torch.chunk rule for uneven sizes) is ``_layout``'s.

A call goes: match the tree with both spec trees -> plan each leaf -> learn the
global shapes (given, exchanged, or even blocks inside shard_map) -> run the plans.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any, NamedTuple, Sequence

import optree
import torch

from ..ops import _collectives as coll
from ..ops import _context
from ..ops import _primitives as prim
from ..runtime._errors import ShardingError, leaf_text
from ..mesh._layout import (Layout, block, check_packed, even_global_shape, is_even,
                      layout, local_of, local_shape, mark_uneven, packing, pad_dim, piece_sizes,
                      require_divisible, unview, view, view_shape, view_spec)
from ..mesh._mesh import Mesh
from ._reshard_plan import communicates, plan
from ._reshard_shapes import checked_shapes, exchange_shapes
from ..mesh._spec import P, normalize_spec
from ..mesh._tree import leaf_specs, match_specs

__all__ = ["reshard", "global_shapes"]

_PACKED = ("packed",)        # a reshard job that goes through the full tensor


# ---------------------------------------------------------------------------------
# executing a plan on one block


class _RawOps:
    """Outside shard_map: the raw collectives (no autograd; callers use no_grad)."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh

    def gather(self, x, axes, dim, tiled):
        return prim.all_gather(x if tiled else x.unsqueeze(dim), self.mesh.axis_group(axes), dim)

    def a2a(self, x, axes, split, concat):
        return prim.all_to_all(x, self.mesh.axis_group(axes), split, concat)

    def vary(self, x, axes):
        return x


class _BodyOps:
    """Inside a shard_map body: functp's differentiable collectives, which also keep
    the vma tags right (a gathered dimension becomes invariant over its axes; a
    locally sliced one varies over them, so its gradient is summed back)."""

    def gather(self, x, axes, dim, tiled):
        return coll.all_gather_invariant(x, axes, axis=dim, tiled=tiled)

    def a2a(self, x, axes, split, concat):
        return coll.all_to_all(x, axes, split, concat, tiled=True)

    def vary(self, x, axes):
        return coll.pvary(x, axes)


def _trim_blocks(y: torch.Tensor, dim: int, sizes: list[int], width: int) -> torch.Tensor:
    """``y`` holds ``len(sizes)`` padded blocks of ``width`` along ``dim``: keep the
    first ``sizes[j]`` rows of block ``j``."""
    if all(s == width for s in sizes):
        return y
    return torch.cat([y.narrow(dim, j * width, s) for j, s in enumerate(sizes)], dim)


def run_plan(x: torch.Tensor, n: Sequence[int], src: Layout, steps, mesh: Mesh, ops
             ) -> torch.Tensor:
    """Applies ``steps`` to this rank's block ``x`` of a tensor of global shape ``n``."""
    shape, coord = mesh.shape, mesh.coordinate
    cur = list(src)
    for step in steps:
        if step[0] == "slice":
            _, d, axes = step
            off, size = block(x.shape[d], axes, shape, coord)
            x = ops.vary(x, axes).narrow(d, off, size)
            cur[d] = cur[d] + axes
        elif step[0] == "a2a":
            _, d, e, axes = step
            m_d = block(n[d], cur[d][:-len(axes)], shape, coord)[1]
            s = piece_sizes(m_d, axes, shape)
            t = piece_sizes(x.shape[e], axes, shape)  # dim e is whole over `axes`
            x = pad_dim(x, d, s[0])
            if any(tj != t[0] for tj in t):           # pad every outgoing piece to t[0]
                offs = list(itertools.accumulate([0] + t[:-1]))
                x = torch.cat([pad_dim(x.narrow(e, o, tj), e, t[0]) for o, tj in zip(offs, t)], e)
            y = ops.a2a(x, axes, e, d)
            y = y.narrow(e, 0, t[mesh.axis_index(axes)])
            x = _trim_blocks(y, d, s, s[0])
            cur[d], cur[e] = cur[d][:-len(axes)], cur[e] + axes
        else:
            parts = step[1]
            sizes = []
            for d, axes in parts:
                m = block(n[d], cur[d][:-len(axes)], shape, coord)[1]
                sizes.append(piece_sizes(m, axes, shape))
                x = pad_dim(x, d, sizes[-1][0])
            if len(parts) == 1:
                (d, axes), s = parts[0], sizes[0]
                x = _trim_blocks(ops.gather(x, axes, d, True), d, s, s[0])
            else:
                x = _assemble(ops.gather(x, tuple(a for _, ax in parts for a in ax), 0, False),
                              parts, sizes, shape)
            for d, axes in parts:
                cur[d] = cur[d][:-len(axes)]
    return x


def _assemble(y: torch.Tensor, parts, sizes, shape) -> torch.Tensor:
    """``y`` stacks the blocks of a multi-dimension all-gather on a new dim 0 (index
    over the parts' axes, major first): tile them back along their dimensions."""
    ks = [math.prod(shape[a] for a in axes) for _, axes in parts]
    blk = list(y.shape[1:])
    if all(len(set(s)) == 1 for s in sizes):          # even: one permute and reshape
        m = len(parts)
        y = y.reshape(ks + blk)
        where = {d: i for i, (d, _) in enumerate(parts)}
        perm, out = [], []
        for dd, b in enumerate(blk):
            if dd in where:
                perm.append(where[dd])
                out.append(ks[where[dd]] * b)
            else:
                out.append(b)
            perm.append(m + dd)
        return y.permute(perm).reshape(out)
    grid = {}
    for j, idx in enumerate(itertools.product(*[range(k) for k in ks])):
        b = y.select(0, j)
        for (d, _), s, i in zip(parts, sizes, idx):
            b = b.narrow(d, 0, s[i])
        grid[idx] = b

    def tile(level: int, idx: tuple) -> torch.Tensor:
        if level == len(parts):
            return grid[idx]
        return torch.cat([tile(level + 1, idx + (i,)) for i in range(ks[level])],
                         parts[level][0])
    return tile(0, ())


@torch.no_grad()
def move_block(x: torch.Tensor, n: Sequence[int], src: Layout, dst: Layout, mesh: Mesh
               ) -> torch.Tensor:
    """Raw (no autograd) move of one block of global shape ``n`` between layouts."""
    steps = plan(src, dst)
    return run_plan(x, n, src, steps, mesh, _RawOps(mesh)).contiguous() if steps else x


def full_of(x: torch.Tensor, n: Sequence[int], spec: P, mesh: Mesh, ops,
            path: str = "value") -> torch.Tensor:
    """The full tensor (global shape ``n``) from every rank's block ``x`` under ``spec``:
    one all-gather per split dimension (none if nothing is split)."""
    if packing(spec):
        check_packed(path, n, spec, mesh)     # (the same on every rank: n is global)
        xv, nv = view(x, spec), view_shape(n, spec)
        return unview(full_of(xv, nv, view_spec(spec), mesh, ops), spec)
    src = layout(spec, x.ndim, mesh)
    if not any(src):
        return x
    return run_plan(x, n, src, plan(src, ((),) * x.ndim), mesh, ops).contiguous()


def global_shapes(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """The global shape of every local block in ``tree``, laid out by ``specs``.

    Uses one small all-gather of the block shapes when some leaf is split (none
    otherwise), and checks that the blocks form a valid (torch.chunk-style) layout:
    the same error on every rank if not. Non-tensor leaves come back unchanged. Pass
    the result as ``shapes=`` to :func:`reshard`/:func:`unshard`/checkpoints to skip
    the exchange. Example (4 simulated ranks, 10 rows)::

        def shapes():
            mesh = functp.make_mesh((4,), ("x",))
            local = functp.shard(torch.zeros(10, 2), mesh, P("x"))   # 3, 3, 3, 1 rows
            return functp.global_shapes(local, mesh, P("x"))

        print(functp.simulate(shapes, 4))
        # prints:
        # [torch.Size([10, 2]), torch.Size([10, 2]), torch.Size([10, 2]), torch.Size([10, 2])]
    """
    items, treespec = leaf_specs(tree, mesh, specs, "tree")
    if any(s is not None and any(layout(s, x.ndim, mesh)) for _, x, s in items):
        shapes = exchange_shapes(items, mesh, "global_shapes")
    else:
        shapes = [None if s is None else tuple(x.shape) for _, x, s in items]
    return optree.tree_unflatten(treespec, [
        torch.Size(n) if n is not None else x for (_, x, _), n in zip(items, shapes)])


# ---------------------------------------------------------------------------------
# the public function, in named steps


class _Job(NamedTuple):
    """One leaf's move: its specs, their layouts, and the plan (or ``_PACKED``)."""
    src_spec: P
    dst_spec: P
    src: Layout
    dst: Layout
    steps: Any


def reshard(tree: Any, mesh: Mesh, src_specs: Any, dst_specs: Any, *,
            shapes: Any = None) -> Any:
    """Moves local blocks laid out by ``src_specs`` to the layout of ``dst_specs``.

    **Arguments:** ``tree`` – this rank's blocks; ``src_specs``/``dst_specs`` – spec
    trees (pytree prefixes of ``tree``); ``shapes`` – optional tree of global shapes
    (tuples, ``torch.Size`` or tensors), e.g. from :func:`global_shapes`.

    Communication is the minimum the move needs: none when every dimension keeps its
    axes and only gains more (``P()`` -> ``P('tp')`` is a local slice, and an
    unchanged leaf is returned as is); an all-to-all when an axis moves between
    dimensions; an all-gather only when a dimension loses axes it needs nowhere else.

    Outside ``shard_map`` it is a plain function on blocks of any size (uneven blocks,
    torch.chunk-style, included); without ``shapes=`` a move that communicates first
    learns the global shapes with one small all-gather of the block shapes (blocks of
    unequal sizes would otherwise break the collective). Results are new tensors and
    carry no autograd history. Inside a ``shard_map`` body it is differentiable (built
    from functp's collectives), needs even blocks and never adds a size exchange.

    Example (2 simulated ranks)::

        def moves():
            mesh = functp.make_mesh((2,), ("tp",))
            w = functp.shard(torch.randn(4, 6), mesh, P("tp"))          # rows split
            with functp.comm_log() as log:        # shapes= given: no size exchange
                w2 = functp.reshard(w, mesh, P("tp"), P(None, "tp"), shapes=(4, 6))
                w3 = functp.reshard(w2, mesh, P(None, "tp"), P(), shapes=(4, 6))
            return tuple(w.shape), tuple(w2.shape), tuple(w3.shape), log.summary()

        print(functp.simulate(moves, 2)[0])
        # prints:
        # ((2, 6), (4, 3), (4, 6), {('all_to_all', ('tp',)): 1, ('all_gather', ('tp',)): 1})
    """
    inside = _context.active()
    what = "functp.reshard"
    if inside:
        _check_body_mesh(mesh, what)
    items, treespec = leaf_specs(tree, mesh, src_specs, "tree", "src_specs")
    _, _, dst_leaves, _ = match_specs(dst_specs, tree, "dst_specs", "tree")
    jobs = [_plan_leaf(path, x, s, d, mesh, inside, what)
            for (path, x, s), d in zip(items, dst_leaves)]
    n_list = _global_shapes(items, treespec, jobs, shapes, mesh, inside, what)
    if inside:
        _check_even_inside(items, jobs, n_list, mesh, what)
    ops: Any = _BodyOps() if inside else _RawOps(mesh)
    with contextlib.nullcontext() if inside else torch.no_grad():
        out = [x if j is None or not j.steps else _move(path, x, j, n, mesh, ops, inside)
               for (path, x, _), j, n in zip(items, jobs, n_list)]
    return optree.tree_unflatten(treespec, out)


def _check_body_mesh(mesh: Mesh, what: str) -> None:
    fr = _context.current("reshard")
    if fr.mesh is not mesh:
        raise ShardingError(
            f"{what} inside a shard_map body over {fr.mesh} was given another mesh "
            f"{mesh}; pass the mesh of the enclosing shard_map")


def _plan_leaf(path: str, x, s: P | None, d, mesh: Mesh, inside: bool, what: str
               ) -> _Job | None:
    """The job of one leaf (``None`` for a non-tensor); packed layouts that change go
    through the full tensor, and only outside shard_map."""
    if s is None:
        return None
    d = normalize_spec(d, mesh.axis_names, f"dst_specs for {path}", x.shape)
    src, dst = layout(s, x.ndim, mesh), layout(d, x.ndim, mesh)
    if packing(s) or packing(d):
        if inside:
            raise ShardingError(
                f"{what} inside shard_map: {leaf_text(path, x.shape)} moves from {s!r} to "
                f"{d!r}, and packed layouts are resharded outside shard_map only")
        if packing(s) != packing(d) or src != dst:
            return _Job(s, d, src, dst, _PACKED)
    return _Job(s, d, src, dst, plan(src, dst))


def _global_shapes(items, treespec, jobs, shapes, mesh: Mesh, inside: bool, what: str) -> list:
    """Given (and checked against this rank's blocks), the even blocks' inside
    shard_map, exchanged once when some leaf communicates, or not needed."""
    if shapes is not None:
        return checked_shapes(items, treespec, shapes, mesh, what)
    if inside:
        return [None if j is None else even_global_shape(x.shape, j.src, mesh)
                for (_, x, _), j in zip(items, jobs)]
    if any(j is not None and (j.steps is _PACKED or communicates(j.steps)) for j in jobs):
        return exchange_shapes(items, mesh, what)
    return [None] * len(items)      # slices only: block sizes suffice


def _check_even_inside(items, jobs, n_list, mesh: Mesh, what: str) -> None:
    for (path, x, _), j, n in zip(items, jobs, n_list):
        if j is not None and not (is_even(n, j.src, mesh) and is_even(n, j.dst, mesh)):
            bad = j.src_spec if not is_even(n, j.src, mesh) else j.dst_spec
            require_divisible(
                f"{what} inside shard_map: {path}", n, bad, mesh,
                "first with functp.pad_to_multiple (and functp.unpad the result), or "
                "reshard outside shard_map: shard_map works on even blocks only")


def _move(path: str, x: torch.Tensor, j: _Job, n, mesh: Mesh, ops, inside: bool
          ) -> torch.Tensor:
    """One leaf's block moved by its job; outside shard_map a new tensor, never a
    view of the caller's block."""
    if j.steps is _PACKED:            # a packed layout on either side
        full = full_of(x, n, j.src_spec, mesh, ops)
        return mark_uneven(local_of(full, j.dst_spec, mesh, path).clone(
            memory_format=torch.contiguous_format), n, j.dst, mesh)
    if n is not None and 0 in n:      # nothing to move; every rank knows it
        y = x.new_zeros(local_shape(n, j.dst, mesh))
    else:
        y = run_plan(x, n if n is not None else x.shape, j.src, j.steps, mesh, ops)
    if inside:
        return y
    y = y.contiguous() if communicates(j.steps) else \
        y.clone(memory_format=torch.contiguous_format)
    return mark_uneven(y, n, j.dst, mesh)
