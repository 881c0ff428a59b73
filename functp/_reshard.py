"""``reshard``: move local blocks from one spec to another with the fewest collectives.

Layout model (shared by ``shard``, ``unshard``, interop and checkpoints): a dimension
split over axes ``(a1, ..., ak)`` is cut the way ``torch.chunk`` cuts it, by ``a1``
first, then each piece by ``a2``, and so on (DTensor's nesting). When the size is
divisible by the product of the axis sizes this is the plain even split over the
flattened axes; otherwise trailing ranks hold fewer rows, or none (10 rows over 4
ranks: 3, 3, 3, 1; 2 rows over 4 ranks: 1, 1, 0, 0).

Planning works on the per-dimension axis tuples alone, so every rank builds the same
plan. An axis can be appended to the minor end of a dimension without communication
(a local slice), moved from the minor end of one dimension to the minor end of another
(one all-to-all) or dropped from the minor end (an all-gather); each step covers as
many axes, and the gathers as many dimensions, as one collective can.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
from typing import Any, Sequence

import optree
import torch
import torch.nn.functional as F

from . import _collectives as coll
from . import _context, _packed
from . import _primitives as prim
from ._errors import ShardingError
from ._mesh import Mesh
from ._spec import P, normalize_spec
from ._tree import match_specs

__all__ = ["reshard", "global_shapes"]

Layout = tuple[tuple[str, ...], ...]       # per tensor dimension: its axes, major first


# ---------------------------------------------------------------------------------
# layout arithmetic


def chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """``(offset, size)`` of piece ``i`` when ``torch.chunk`` cuts ``n`` rows into ``k``
    pieces, counting the empty pieces it leaves out at the end."""
    c = -(-n // k)
    start = min(i * c, n)
    return start, min(start + c, n) - start


def block(n: int, axes: Sequence[str], shape: dict[str, int], coord: dict[str, int]
          ) -> tuple[int, int]:
    """``(offset, size)`` of the block at ``coord`` of a dimension of size ``n`` split
    over ``axes`` (nested, major first)."""
    off = 0
    for a in axes:
        o, n = chunk(n, shape[a], coord[a])
        off += o
    return off, n


def local_of(x: torch.Tensor, spec: P, mesh: Mesh, path: str = "value") -> torch.Tensor:
    """This rank's block (a view) of the full tensor ``x`` under ``spec``; a packed
    dimension gives this rank's slice of each of its blocks."""
    if _packed.packing(spec):
        _packed.check(path, x.shape, spec, mesh.shape)
        return _packed.unview(local_of(_packed.view(x, spec), _packed.view_spec(spec), mesh,
                                       path), spec)
    for d, axes in enumerate(layout(spec, x.ndim)):
        if axes:
            off, size = block(x.shape[d], axes, mesh.shape, mesh.coordinate)
            x = x.narrow(d, off, size)
    return x


def full_of(x: torch.Tensor, n: Sequence[int], spec: P, mesh: Mesh, ops,
            path: str = "value") -> torch.Tensor:
    """The full tensor (global shape ``n``) from every rank's block ``x`` under ``spec``:
    one all-gather per split dimension (none if nothing is split)."""
    if _packed.packing(spec):
        _packed.check(path, n, spec, mesh.shape)     # (the same on every rank: n is global)
        xv, nv = _packed.view(x, spec), _packed.view_shape(n, spec)
        return _packed.unview(full_of(xv, nv, _packed.view_spec(spec), mesh, ops), spec)
    src = layout(spec, x.ndim, mesh)
    if not any(src):
        return x
    return run_plan(x, n, src, plan(src, ((),) * x.ndim), mesh, ops).contiguous()


def piece_sizes(n: int, axes: Sequence[str], shape: dict[str, int]) -> list[int]:
    """Block sizes of every member of ``axes`` (flattened index, major first)."""
    ranges = [range(shape[a]) for a in axes]
    return [block(n, axes, shape, dict(zip(axes, c)))[1] for c in itertools.product(*ranges)]


def layout(spec: P, ndim: int, mesh: Mesh | None = None) -> Layout:
    """Per-dimension axis tuples of ``spec``. Given ``mesh``, axes of size 1 are left
    out: they split nothing, and planning without them avoids no-op collectives."""
    lay = tuple(spec.dim_axes(d) for d in range(ndim))
    if mesh is None:
        return lay
    return tuple(tuple(a for a in t if mesh.shape[a] > 1) for t in lay)


def local_shape(shape: Sequence[int], lay: Layout, mesh: Mesh) -> tuple[int, ...]:
    return tuple(block(n, axes, mesh.shape, mesh.coordinate)[1] for n, axes in zip(shape, lay))


def is_even(shape: Sequence[int], lay: Layout, mesh: Mesh) -> bool:
    return all(n % mesh.axis_size(axes) == 0 for n, axes in zip(shape, lay) if axes)


# Blocks of an uneven layout made by functp carry their global shape under this
# attribute, so that shard_map can refuse them with a clear message on every rank
# (each rank's block of the layout is marked, whatever its own size).
GLOBAL_SHAPE = "_functp_global_shape"

_PACKED = ("packed",)        # a reshard job that goes through the full tensor


def mark_uneven(t: torch.Tensor, n: Sequence[int] | None, lay: Layout, mesh: Mesh
                ) -> torch.Tensor:
    if n is not None and not is_even(n, lay, mesh):
        setattr(t, GLOBAL_SHAPE, torch.Size(n))
    return t


# ---------------------------------------------------------------------------------
# matching trees, specs and shapes


def leaf_specs(tree, mesh: Mesh, specs, root: str, what: str = "specs"):
    """``[(path, leaf, spec or None)]`` and the treespec; specs normalized on tensors."""
    paths, leaves, spec_leaves, treespec = match_specs(specs, tree, what, root)
    out = []
    for path, x, spec in zip(paths, leaves, spec_leaves):
        if isinstance(x, torch.Tensor):
            spec = normalize_spec(spec, mesh.axis_names, f"{what} for {path}", x.shape)
        else:
            spec = None
        out.append((path, x, spec))
    return out, treespec


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
                f"{what}: shapes= gives {s!r} for {path} (a block of shape "
                f"{tuple(x.shape)}); give its global shape, a tuple of {x.ndim} sizes")
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
            f"{what}: {path} has a block of shape {tuple(x.shape)}, but its global shape "
            f"{tuple(n)} under {spec!r} gives this rank (coordinate {mesh.coordinate} on "
            f"{mesh}) a block of shape {want}; pass the global shape the blocks come from")


def exchange_shapes(items, mesh: Mesh, what: str) -> list[tuple[int, ...] | None]:
    """Global shapes of local blocks from one small all-gather of every rank's block
    shapes (over the whole mesh, one int64 row per rank). Every rank checks the same
    gathered table, so a bad layout raises the same error everywhere."""
    row = torch.tensor([n for _, x, s in items if s is not None for n in x.shape],
                       dtype=torch.int64, device=mesh.device_type)
    table = prim.all_gather(row.unsqueeze(0), mesh.axis_group(mesh.axis_names), 0).cpu()
    coords = [dict(zip(mesh.axis_names, c))
              for c in itertools.product(*[range(s) for s in mesh.axis_sizes])]
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
            # the blocks of ranks at coordinate 0 on every other axis tile the dimension
            first = [sizes[r][d] for r, c in enumerate(coords)
                     if all(c[a] == 0 for a in mesh.axis_names if a not in axes)]
            total = sum(first) if axes else first[0]
            if any(block(total, axes, mesh.shape, c)[1] != sizes[r][d]
                   for r, c in enumerate(coords)):
                by_rank = [sizes[r][d] for r in range(len(coords))]
                how = (f"torch.chunk-style blocks over {axes}" if axes
                       else "the same size on every rank (the dimension is not split)")
                raise ShardingError(
                    f"{what}: {p} (shape {tuple(x.shape)} on rank {mesh.coordinate}) has "
                    f"sizes {by_rank} along dimension {d} on the ranks of {mesh} (in mesh "
                    f"order), which are not {how} of any global size under {spec!r}; "
                    f"blocks must come from functp.shard/reshard/load, or pass shapes=")
            n.append(total)
        out.append(tuple(n))
    return out


def global_shapes(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """The global shape of every local block in ``tree``, laid out by ``specs``.

    Uses one small all-gather of the block shapes when some leaf is split (none
    otherwise), and checks that the blocks form a valid (torch.chunk-style) layout:
    the same error on every rank if not. Non-tensor leaves come back unchanged. Pass
    the result as ``shapes=`` to :func:`reshard`/:func:`unshard`/checkpoints to skip
    the exchange. Example (4 ranks, 10 rows)::

        local = functp.shard(torch.zeros(10, 2), mesh, P("x"))   # 3, 3, 3, 1 rows
        functp.global_shapes(local, mesh, P("x"))                # torch.Size([10, 2])
    """
    items, treespec = leaf_specs(tree, mesh, specs, "tree")
    if any(s is not None and any(layout(s, x.ndim, mesh)) for _, x, s in items):
        shapes = exchange_shapes(items, mesh, "global_shapes")
    else:
        shapes = [None if s is None else tuple(x.shape) for _, x, s in items]
    return optree.tree_unflatten(treespec, [
        torch.Size(n) if n is not None else x for (_, x, _), n in zip(items, shapes)])


# ---------------------------------------------------------------------------------
# planning


def _prefix(a: tuple, b: tuple) -> bool:
    return b[:len(a)] == a


@functools.lru_cache(maxsize=4096)
def plan(src: Layout, dst: Layout) -> tuple[tuple, ...]:
    """Steps from layout ``src`` to ``dst``: ``("slice", d, axes)``, ``("a2a", d, e,
    axes)`` (minor axes of dim ``d`` move to the minor end of dim ``e``) and
    ``("gather", ((d, axes), ...))`` (one all-gather for several dimensions)."""
    cur = list(src)
    steps: list[tuple] = []
    while tuple(cur) != dst:
        # free: append the next axes of a dimension's target that nothing uses yet
        used = {a for t in cur for a in t}
        for e, (c, t) in enumerate(zip(cur, dst)):
            if _prefix(c, t):
                run = tuple(itertools.takewhile(lambda a: a not in used, t[len(c):]))
                if run:
                    steps.append(("slice", e, run))
                    cur[e] = c + run
                    used |= set(run)
        if tuple(cur) == dst:
            break
        stuck = [d for d in range(len(cur)) if not _prefix(cur[d], dst[d])]
        # move the longest minor run to a dimension whose target continues with it
        move = None
        for d in stuck:
            keep = next(i for i in range(len(cur[d]) + 1)
                        if i == len(cur[d]) or i == len(dst[d]) or cur[d][i] != dst[d][i])
            extra = cur[d][keep:]
            for n in range(len(extra), 0, -1):
                tail = extra[-n:]
                e = next((e for e in range(len(cur)) if e != d and _prefix(cur[e], dst[e])
                          and _prefix(cur[e] + tail, dst[e])), None)
                if e is not None:
                    move = (d, e, tail)
                    break
            if move:
                break
        if move:
            d, e, tail = move
            steps.append(("a2a", d, e, tail))
            cur[d], cur[e] = cur[d][:-len(tail)], cur[e] + tail
            continue
        # nothing can move now: drop every misplaced run in one all-gather
        parts = []
        for d in stuck:
            keep = next(i for i in range(len(cur[d]) + 1)
                        if i == len(cur[d]) or i == len(dst[d]) or cur[d][i] != dst[d][i])
            parts.append((d, cur[d][keep:]))
            cur[d] = cur[d][:keep]
        steps.append(("gather", tuple(parts)))
    return tuple(steps)


def communicates(steps) -> bool:
    return any(s[0] != "slice" for s in steps)


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


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """Zero-pads ``dim`` at its end to ``size`` (F.pad counts dims from the last)."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    return F.pad(x, [0, 0] * (x.ndim - 1 - dim) + [0, extra])


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
            x = _pad(x, d, s[0])
            if any(tj != t[0] for tj in t):           # pad every outgoing piece to t[0]
                offs = list(itertools.accumulate([0] + t[:-1]))
                x = torch.cat([_pad(x.narrow(e, o, tj), e, t[0]) for o, tj in zip(offs, t)], e)
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
                x = _pad(x, d, sizes[-1][0])
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


# ---------------------------------------------------------------------------------
# the public function


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

    Example (2 ranks)::

        w = functp.shard(torch.randn(4, 6), mesh, P("tp"))          # rows split
        w2 = functp.reshard(w, mesh, P("tp"), P(None, "tp"))        # one all_to_all
        w3 = functp.reshard(w2, mesh, P(None, "tp"), P())           # one all_gather
    """
    inside = _context.active()
    what = "functp.reshard"
    if inside:
        fr = _context.current("reshard")
        if fr.mesh is not mesh:
            raise ShardingError(
                f"{what} inside a shard_map body over {fr.mesh} was given another mesh "
                f"{mesh}; pass the mesh of the enclosing shard_map")
    items, treespec = leaf_specs(tree, mesh, src_specs, "tree", "src_specs")
    _, _, dst_leaves, _ = match_specs(dst_specs, tree, "dst_specs", "tree")
    jobs = []
    for (path, x, s), d in zip(items, dst_leaves):
        if s is None:
            jobs.append(None)
            continue
        d = normalize_spec(d, mesh.axis_names, f"dst_specs for {path}", x.shape)
        src, dst = layout(s, x.ndim, mesh), layout(d, x.ndim, mesh)
        if _packed.packing(s) or _packed.packing(d):
            if inside:
                raise ShardingError(
                    f"{what} inside shard_map: {path} moves from {s!r} to {d!r}, and "
                    f"packed layouts are resharded outside shard_map only")
            if _packed.packing(s) != _packed.packing(d) or src != dst:
                jobs.append((s, d, src, dst, _PACKED))   # through the full tensor
                continue
        jobs.append((s, d, src, dst, plan(src, dst)))

    if shapes is not None:
        n_list = given_shapes(treespec, shapes, items, what)
        for (path, x, s), n in zip(items, n_list):
            if n is not None:
                check_block(path, x, s, n, mesh, what)
    elif inside:
        n_list = [None if j is None else
                  tuple(b * mesh.axis_size(a) if a else b for b, a in zip(x.shape, j[2]))
                  for (_, x, _), j in zip(items, jobs)]
    elif any(j is not None and (j[4] is _PACKED or communicates(j[4])) for j in jobs):
        n_list = exchange_shapes(items, mesh, what)
    else:
        n_list = [None] * len(items)      # slices only: block sizes suffice

    if inside:
        for (path, x, s), j, n in zip(items, jobs, n_list):
            if j is not None and not (is_even(n, j[2], mesh) and is_even(n, j[3], mesh)):
                bad = j[0] if not is_even(n, j[2], mesh) else j[1]
                raise ShardingError(
                    f"{what} inside shard_map: {path} (block {tuple(x.shape)}, global "
                    f"shape {tuple(n)}) does not split evenly under {bad!r} on {mesh}; "
                    f"shard_map works on even blocks only: pad the value first with "
                    f"functp.pad_to_multiple (and functp.unpad the result), or reshard "
                    f"outside shard_map")
        ops: Any = _BodyOps()
    else:
        ops = _RawOps(mesh)

    out = []
    with contextlib.nullcontext() if inside else torch.no_grad():
        for (path, x, s), j, n in zip(items, jobs, n_list):
            if j is None or not j[4]:
                out.append(x)
                continue
            s, d, src, dst, steps = j
            if steps is _PACKED:            # a packed layout on either side
                full = full_of(x, n, s, mesh, ops)
                out.append(mark_uneven(local_of(full, d, mesh, path).clone(
                    memory_format=torch.contiguous_format), n, dst, mesh))
                continue
            if n is not None and 0 in n:    # nothing to move; every rank knows it
                y = x.new_zeros(local_shape(n, dst, mesh))
            else:
                y = run_plan(x, n if n is not None else x.shape, src, steps, mesh, ops)
            if not inside:      # new tensors, never views of the caller's blocks
                y = y.contiguous() if communicates(steps) else \
                    y.clone(memory_format=torch.contiguous_format)
                y = mark_uneven(y, n, dst, mesh)
            out.append(y)
    return optree.tree_unflatten(treespec, out)

