"""What a spec means on a mesh: which block of a global tensor each rank holds.

The one home of functp's block arithmetic; every other module asks it. A dimension
split over axes ``(a1, ..., ak)`` is cut the way ``torch.chunk`` cuts it, by ``a1``
first, then each piece by ``a2``, and so on (DTensor's nesting). When the size is
divisible by the product of the axis sizes this is the plain even split over the
flattened axes; otherwise trailing ranks hold fewer rows, or none (10 rows over 4
ranks: 3, 3, 3, 1; 2 rows over 4 ranks: 1, 1, 0, 0). Example (4 ranks)::

    lay = layout(P("x"), 2)                       # (('x',), ())
    local_shape((10, 2), lay, mesh)               # (3, 2) on ranks 0-2, (1, 2) on rank 3

Here: global <-> local shapes, divisibility (and its errors), padding sizes, packed
dimensions (``P(..., packed={dim: k})``, seen through a view in which they are
ordinary splits) and a rank's slices of a full tensor. Shapes, views, narrows and zero
padding only: ``P`` <-> DTensor placements is ``_spec``'s, the process group of a tuple
of axes ``Mesh.axis_group``'s, moving blocks between ranks ``_reshard``'s. Functions
that take a ``mesh`` read only its ``shape``, ``coordinate``, ``axis_names`` and
``axis_sizes``.
"""
from __future__ import annotations

import itertools
import math
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from ..runtime._errors import ShardingError, leaf_text
from ._mesh import Mesh
from ._spec import P, normalize_spec
# the placement converters live in _spec; callers not yet moved import them from here
# (parallel/_style.py: axis_placement; tests/test_layout.py: all four)
from ._spec import axis_placement, mesh_order, placements_to_spec, spec_to_placements  # noqa: F401

Layout = tuple[tuple[str, ...], ...]       # per tensor dimension: its axes, major first

# Blocks of an uneven layout made by functp carry their global shape under this
# attribute, so that shard_map can refuse them with a clear message on every rank
# (each rank's block of the layout is marked, whatever its own size).
GLOBAL_SHAPE = "_functp_global_shape"


# ---------------------------------------------------------------------------------
# sizes and offsets


def axes_size(sizes: Mapping[str, int], axes: Sequence[str]) -> int:
    """Ranks along ``axes`` (the product of their sizes in ``sizes``)."""
    return math.prod(int(sizes[a]) for a in axes)


def uneven(n: int, k: int) -> bool:
    """True when ``n`` rows do not split into ``k`` equal blocks."""
    return n % k != 0


def chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """``(offset, size)`` of piece ``i`` when ``torch.chunk`` cuts ``n`` rows into ``k``
    pieces, counting the empty pieces it leaves out at the end."""
    c = -(-n // k)
    start = min(i * c, n)
    return start, min(start + c, n) - start


def block(n: int, axes: Sequence[str], shape: Mapping[str, int], coord: Mapping[str, int]
          ) -> tuple[int, int]:
    """``(offset, size)`` of the block at ``coord`` of a dimension of size ``n`` split
    over ``axes`` (nested, major first)."""
    off = 0
    for a in axes:
        o, n = chunk(n, shape[a], coord[a])
        off += o
    return off, n


def piece_sizes(n: int, axes: Sequence[str], shape: Mapping[str, int]) -> list[int]:
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
    """This rank's block shape of a tensor of global ``shape`` laid out by ``lay``."""
    return tuple(block(n, axes, mesh.shape, mesh.coordinate)[1] for n, axes in zip(shape, lay))


def even_global_shape(shape: Sequence[int], lay: Layout, mesh: Mesh) -> tuple[int, ...]:
    """The global shape of an even block ``shape`` (every rank's block the same)."""
    return tuple(b * mesh.axis_size(a) if a else b for b, a in zip(shape, lay))


def mesh_coordinates(mesh: Mesh) -> list[dict[str, int]]:
    """Every rank's coordinate, in mesh (row-major) order."""
    return [dict(zip(mesh.axis_names, c))
            for c in itertools.product(*[range(s) for s in mesh.axis_sizes])]


def size_from_blocks(sizes: Sequence[int], coords: Sequence[Mapping[str, int]],
                     axes: Sequence[str], shape: Mapping[str, int]) -> int | None:
    """The global size of a dimension split over ``axes`` whose block at ``coords[r]``
    has ``sizes[r]`` rows (every rank of the mesh listed); ``None`` when no size gives
    those torch.chunk blocks."""
    # the blocks of ranks at coordinate 0 on every other axis tile the dimension
    first = [n for n, c in zip(sizes, coords) if all(c[a] == 0 for a in c if a not in axes)]
    total = sum(first) if axes else first[0]
    if any(block(total, axes, shape, c)[1] != n for n, c in zip(sizes, coords)):
        return None
    return total


def uneven_dim(shape: Sequence[int], lay: Layout, sizes: Mapping[str, int]) -> int | None:
    """The first dimension that ``lay`` does not split evenly, or ``None``."""
    return next((d for d, (n, axes) in enumerate(zip(shape, lay))
                 if axes and uneven(n, axes_size(sizes, axes))), None)


def is_even(shape: Sequence[int], lay: Layout, mesh: Mesh) -> bool:
    return uneven_dim(shape, lay, mesh.shape) is None


def padded_shape(shape: Sequence[int], lay: Layout, mesh: Mesh) -> tuple[int, ...]:
    """Every split dimension rounded up to a multiple of its axes' size."""
    return tuple(-(-s // mesh.axis_size(a)) * mesh.axis_size(a) if a else s
                 for s, a in zip(shape, lay))


def pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` zero-padded at the end of ``dim`` to ``size`` rows (differentiable; F.pad
    counts dimensions from the last)."""
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    return F.pad(x, [0, 0] * (x.ndim - 1 - dim) + [0, extra])


def strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Contiguous strides of ``shape`` (what DTensor's ``from_local`` is given)."""
    out, s = [], 1
    for n in reversed(tuple(shape)):
        out.append(s)
        s *= max(n, 1)
    return tuple(reversed(out))


# ---------------------------------------------------------------------------------
# divisibility, with the errors users see


def require_divisible(where: str, shape: Sequence[int], spec: P, mesh: Mesh, fix: str,
                      dims: Sequence[int] | None = None) -> None:
    """Raises unless ``spec`` splits every dimension of ``shape`` (or those in ``dims``)
    into equal blocks on ``mesh``: the one message for a size that does not divide,
    naming the leaf (``where``, ``shape``), the spec, the dimension, its axes, the
    multiple it must be, the mesh, and ``fix`` (what else to do; ``{k}`` in it stands
    for that multiple, ``{n}`` for the axes' size). A packed dimension (``P(...,
    packed={dim: b})``) holds ``b`` blocks that each split over the axes: its size
    must be a multiple of ``b`` times their size."""
    packed = dict(packing(spec))
    for d in range(len(shape)) if dims is None else dims:
        axes = spec.dim_axes(d)
        n = mesh.axis_size(axes) if axes else 1
        k = n * packed.get(d, 1)
        if not uneven(shape[d], k):
            continue
        if d in packed:
            how = (f"into {packed[d]} packed blocks, each over {axes} of size {n}, which "
                   f"does not divide it; make it a multiple of {k}")
        else:
            how = f"over {axes} of size {n}, which does not divide it; pad it to a multiple of {k}"
        raise ShardingError(
            f"{leaf_text(where, shape)}: {spec!r} splits dimension {d} of size {shape[d]} "
            f"{how} {fix.format(k=k, n=n)} (mesh {mesh})")


def check_even_dtensor(where: str, shape: Sequence[int], spec: P, mesh: Mesh) -> None:
    """A DTensor given to shard_map as a global value must split evenly under ``spec``."""
    require_divisible(
        f"{where}: the DTensor", shape, spec, mesh,
        "(functp.pad_to_multiple on the full value, then to_dtensor) and functp.unpad the "
        "result: shard_map needs equal blocks on every rank")


def check_even_block(x: torch.Tensor, spec: P, mesh: Mesh, path: str) -> None:
    """Raises if ``x`` is a block that functp made from an uneven layout and ``spec``
    splits a dimension of it unevenly: shard_map cannot know a global size from
    uneven blocks. The same on every rank (every block of the layout is marked)."""
    n = getattr(x, GLOBAL_SHAPE, None)
    if n is None or len(n) != x.ndim:
        return
    require_divisible(
        f"in_specs for {path}, blocks of a global value", n, spec, mesh,
        "with functp.pad_to_multiple before sharding (functp.unpad the results), or "
        "choose sizes divisible by {k}: shard_map needs equal blocks on every rank, and "
        "cannot know a global size from uneven ones. For a batch whose mean you take (a "
        "data set's last batch), functp.pad_batch pads it with a 0/1 weight per row: "
        "psum of the weighted losses over psum of the weights is the exact mean")


def mark_uneven(t: torch.Tensor, n: Sequence[int] | None, lay: Layout, mesh: Mesh
                ) -> torch.Tensor:
    """Tags ``t`` with its global shape ``n`` when ``lay`` splits ``n`` unevenly."""
    if n is not None and not is_even(n, lay, mesh):
        setattr(t, GLOBAL_SHAPE, torch.Size(n))
    return t


# ---------------------------------------------------------------------------------
# packed dimensions: P(..., packed={dim: k}) as a view in which they are plain splits
# (x.unflatten(dim, (k, -1)) under the spec with (None, axes) in place of the entry)


def packing(spec: P | None) -> tuple[tuple[int, int], ...]:
    return () if spec is None else getattr(spec, "packed", ())


def view_spec(spec: P) -> P:
    entries = list(spec)
    for d, _ in reversed(packing(spec)):
        entries[d:d + 1] = [None, entries[d]]
    return P(*entries)


def view(x: torch.Tensor, spec: P) -> torch.Tensor:
    for d, k in reversed(packing(spec)):
        x = x.unflatten(d, (k, -1))
    return x


def unview(x: torch.Tensor, spec: P) -> torch.Tensor:
    for d, _ in packing(spec):
        x = x.flatten(d, d + 1)
    return x


def view_shape(shape: Sequence[int], spec: P) -> tuple[int, ...]:
    out = list(shape)
    for d, k in reversed(packing(spec)):
        out[d:d + 1] = [k, out[d] // k]
    return tuple(out)


def packed_slice(x: torch.Tensor, dim: int, blocks: int, n: int, i: int) -> torch.Tensor:
    """Rank ``i`` of ``n``'s slice of each of ``blocks`` equal blocks along ``dim``, laid
    end to end (what a dimension packed ``{dim: blocks}`` and split ``n`` ways holds)."""
    v = x.unflatten(dim, (blocks, -1))
    return v.narrow(dim + 1, *chunk(v.shape[dim + 1], n, i)).flatten(dim, dim + 1)


def check_packed(where: str, shape: Sequence[int], spec: P, mesh: Mesh) -> None:
    """A packed dimension must hold whole, evenly split blocks (:func:`require_divisible`
    on the packed dimensions; the others may be uneven, cut like ``torch.chunk``)."""
    if len(spec) > len(shape):          # (a packed dimension the tensor does not have)
        normalize_spec(spec, mesh.axis_names, where, shape)
    require_divisible(where, shape, spec, mesh,
                      "(each packed block a multiple of {n}: functp.pad_to_multiple pads "
                      "the whole dimension, not each block)", [d for d, _ in packing(spec)])


# ---------------------------------------------------------------------------------
# a rank's block of a full tensor


def block_slices(shape: Sequence[int], lay: Layout, sizes: Mapping[str, int],
                 coord: Mapping[str, int]) -> list[tuple[int, int, int]]:
    """``[(dim, offset, size)]``: the narrows that cut the block at ``coord``."""
    return [(d, *block(n, axes, sizes, coord)) for d, (n, axes) in enumerate(zip(shape, lay))
            if axes]


def block_ranges(shape: Sequence[int], spec: P, mesh: Mesh, path: str = "value"
                 ) -> list[list[tuple[int, int]]]:
    """Per dimension of a full tensor of ``shape``, the ``(offset, size)`` ranges of it
    that this rank's block holds, in block order: one range, or one per block of a
    packed dimension. The block is the product of these ranges, laid end to end (what
    :func:`local_of` cuts), so a reader can fetch it without the full tensor.
    Example: ``P("tp", packed={0: 2})`` over 2 ranks of a ``(8, 3)`` tensor gives rank
    1 ``[[(2, 2), (6, 2)], [(0, 3)]]``."""
    packed = dict(packing(spec))
    if packed:
        check_packed(path, shape, spec, mesh)
    out = []
    for d, n in enumerate(shape):
        axes = layout(spec, len(shape))[d]
        k = packed.get(d, 1)
        off, size = block(n // k, axes, mesh.shape, mesh.coordinate) if axes else (0, n // k)
        out.append([(j * (n // k) + off, size) for j in range(k)])
    return out


def local_of(x: torch.Tensor, spec: P, mesh: Mesh, path: str = "value") -> torch.Tensor:
    """This rank's block (a view) of the full tensor ``x`` under ``spec``; a packed
    dimension gives this rank's slice of each of its blocks."""
    if packing(spec):
        check_packed(path, x.shape, spec, mesh)
        return unview(local_of(view(x, spec), view_spec(spec), mesh, path), spec)
    for d, off, size in block_slices(x.shape, layout(spec, x.ndim), mesh.shape,
                                     mesh.coordinate):
        x = x.narrow(d, off, size)
    return x
