"""Partition specs: ``P``, DTensor placement lists, their checks against a mesh, and
the conversion between the two (``P`` <-> placements; what a spec means for block
shapes is ``_layout``'s)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..runtime._errors import ShardingError, leaf_text

if TYPE_CHECKING:                      # annotations only: _mesh knows nothing of specs
    from ._mesh import Mesh

__all__ = ["P", "is_spec", "normalize_spec", "format_spec", "placements_to_spec",
           "spec_to_placements", "axis_placement", "mesh_order"]


class P(tuple):
    """How a tensor is split over named mesh axes: one entry per tensor dimension.

    Each entry is ``None`` (that dimension is not split), a mesh axis name, or a tuple
    of axis names (the dimension is split over their flattened product, major to
    minor). Missing trailing entries mean ``None``. Mesh axes that the spec does not
    mention hold the same block on every rank (the value is replicated over them).

    ``packed={dim: k}`` says that dimension holds ``k`` equal blocks laid end to end
    (a fused gate/up or q/k/v weight), each split over the dimension's axes on its
    own: a rank holds its slice of every block (DTensor's ``_StridedShard``). Seen
    through ``x.unflatten(dim, (k, -1))`` it is an ordinary split of the new second
    dimension. Packing does not change block shapes, and ``==`` ignores it.

    Example::

        >>> from functp import P
        >>> P("dp", None)
        P('dp', None)
        >>> P(("dp", "tp"))[0]
        ('dp', 'tp')
        >>> P("tp", None, packed={0: 2})          # [gate; up] rows, each split over tp
        P('tp', None, packed={0: 2})
    """

    packed: tuple[tuple[int, int], ...] = ()      # (dimension, blocks), by dimension

    def __new__(cls, *entries: str | tuple[str, ...] | None,
                packed: dict[int, int] | None = None) -> "P":
        for e in entries:
            ok = e is None or isinstance(e, str) or (
                isinstance(e, tuple) and all(isinstance(a, str) for a in e))
            if not ok:
                raise ShardingError(
                    f"P{entries!r}: every entry must be None, a mesh axis name or a tuple "
                    f"of axis names, got {e!r} ({type(e).__name__})")
        self = super().__new__(cls, entries)
        if packed:
            for d, k in packed.items():
                if not (isinstance(d, int) and 0 <= d < len(entries) and entries[d] is not None
                        and isinstance(k, int) and k >= 2):
                    raise ShardingError(
                        f"P{entries!r}, packed={packed!r}: packing names a split dimension "
                        f"of the spec and a block count >= 2, as {{0: 2}} for [gate; up]")
            self.packed = tuple(sorted(packed.items()))
        return self

    def __repr__(self) -> str:
        pk = f", packed={dict(self.packed)}" if self.packed else ""
        return "P(" + ", ".join(repr(e) for e in self) + pk + ")"

    def __reduce__(self):
        if self.packed:
            return (_packed_p, (tuple(self), dict(self.packed)))
        return (P, tuple(self))

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes that split tensor dimension ``dim`` (``()`` if none)."""
        if dim >= len(self):
            return ()
        e = self[dim]
        return () if e is None else (e,) if isinstance(e, str) else tuple(e)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis the spec mentions, in order of appearance."""
        return tuple(a for d in range(len(self)) for a in self.dim_axes(d))


def _packed_p(entries: tuple, packed: dict) -> P:
    return P(*entries, packed=packed)


def _is_placement(x: Any) -> bool:
    from torch.distributed.tensor.placement_types import Placement
    return isinstance(x, Placement)


def is_spec(x: Any) -> bool:
    """True for a spec leaf: a ``P`` or a non-empty list/tuple of DTensor placements."""
    if isinstance(x, P):
        return True
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(_is_placement(p) for p in x)


def format_spec(spec: Any) -> str:
    """A spec as a message names it: ``P('tp')``, or placements as they are written
    (``[Partial(sum), Replicate()]``, not DTensor's short ``[P(sum), R]``, whose ``P``
    reads as functp's)."""
    if isinstance(spec, (list, tuple)) and not isinstance(spec, P):
        return "[" + ", ".join(map(repr, spec)) + "]"
    return repr(spec)


def normalize_spec(spec: Any, axis_names: Sequence[str], where: str,
                   shape: Sequence[int] | None = None) -> P:
    """Checks ``spec`` against the mesh (and a tensor shape, if given); returns a ``P``.

    ``where`` names the leaf in the error messages (``"in_specs for args[0]['w']"``).
    """
    leaf = leaf_text(where, shape)
    mesh_txt = f"mesh axes {tuple(axis_names)}"
    if not isinstance(spec, P):
        if is_spec(spec):
            spec = placements_to_spec(spec, axis_names, leaf)
        else:
            hint = " (use P() for a replicated value)" if spec is None else ""
            raise ShardingError(
                f"{leaf}: expected a P(...) or a list of DTensor placements, got "
                f"{spec!r}{hint}")
    seen: set[str] = set()
    for name in spec.axes:
        if name not in axis_names:
            raise ShardingError(
                f"{leaf}: {spec!r} names mesh axis '{name}', but the {mesh_txt} do "
                f"not include it; use one of {tuple(axis_names)}")
        if name in seen:
            raise ShardingError(
                f"{leaf}: {spec!r} uses mesh axis '{name}' twice; a mesh axis can "
                f"split at most one dimension once")
        seen.add(name)
    if shape is not None and len(spec) > len(shape):
        raise ShardingError(
            f"{leaf}: {spec!r} has {len(spec)} entries but the tensor has "
            f"{len(shape)} dimensions; give at most one entry per dimension")
    return spec


# ---------------------------------------------------------------------------------
# P <-> DTensor placements


def placements_to_spec(placements: Sequence[Any], axis_names: Sequence[str], where: str) -> P:
    """``[Shard(0), Replicate()]`` on mesh axes ``(dp, tp)`` -> ``P('dp')``.

    Several mesh axes sharding one dimension are listed major to minor in mesh order,
    which is DTensor's default (left-to-right) nesting.
    """
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    if len(placements) != len(axis_names):
        raise ShardingError(
            f"{where}: placements {format_spec(placements)} give {len(placements)} entries "
            f"but the mesh has {len(axis_names)} axes {tuple(axis_names)}; give one "
            f"placement per mesh axis, or use P(...)")
    dims: dict[int, list[str]] = {}
    for name, p in zip(axis_names, placements):
        if isinstance(p, Partial):
            raise ShardingError(
                f"{where}: Partial is not a valid input spec (placements "
                f"{format_spec(placements)}); reduce the value first, or pass its local "
                f"contribution with a spec that mentions '{name}' and psum it in the body")
        if type(p) is Shard:
            if p.dim < 0:
                raise ShardingError(f"{where}: Shard({p.dim}) needs a non-negative dim")
            dims.setdefault(p.dim, []).append(name)
        elif not isinstance(p, Replicate):
            raise ShardingError(
                f"{where}: placement {p} is not supported; use Shard(d), Replicate() or P(...)")
    n = max(dims) + 1 if dims else 0
    return P(*[None if d not in dims else dims[d][0] if len(dims[d]) == 1
               else tuple(dims[d]) for d in range(n)])


def spec_to_placements(spec: P, mesh: Mesh, ndim: int, where: str) -> list:
    """``P('dp', 'tp')`` on mesh ``(dp, tp)`` -> ``[Shard(0), Shard(1)]``.

    The axes of a dimension split over several must be in mesh order, which is
    DTensor's nesting (axes of size 1 may stand anywhere: they split nothing)."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    place: list = [Replicate()] * len(mesh.axis_names)
    for d in range(ndim):
        axes = spec.dim_axes(d)
        pos = [mesh.axis_names.index(a) for a in axes]
        real = [i for i in pos if mesh.axis_sizes[i] > 1]
        if real != sorted(real):
            ordered = tuple(sorted(axes, key=mesh.axis_names.index))
            raise ShardingError(
                f"{where}: {spec!r} splits dimension {d} over {axes}, against the mesh "
                f"order of {mesh} (axes {mesh.axis_names}); DTensor nests the axes of one "
                f"dimension in mesh order, so it has no placements for this layout. "
                f"functp.reshard it to P({ordered!r}) on that dimension first")
        for i in pos:
            place[i] = Shard(d)
    return place


def axis_placement(spec: P, axis: str):
    """The placement over the single mesh ``axis`` of a value laid out by ``spec``:
    ``Shard(d)`` for the dimension ``axis`` splits, else ``Replicate()``."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    dims = [d for d in range(len(spec)) if axis in spec.dim_axes(d)]
    return Shard(dims[0]) if dims else Replicate()


def mesh_order(spec: P, ndim: int, mesh: Mesh) -> P:
    """``spec`` with the axes of every dimension in mesh order (DTensor's nesting)."""
    lay = [spec.dim_axes(d) for d in range(ndim)]
    return P(*[None if not a else a[0] if len(a) == 1 else
               tuple(sorted(a, key=mesh.axis_names.index)) for a in lay])
