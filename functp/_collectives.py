"""Differentiable collectives for shard_map bodies, with JAX's names and arguments.

Each collective is a new-style ``torch.autograd.Function`` (``setup_context``) so that
``torch.func`` accepts it, with an explicit ``vmap`` rule (torch's generated rule
silently skips the communication) and a ``jvp``. Backward formulas call the
Functions again, so higher-order derivatives compose.

Two transposition regimes exist (DESIGN.md): with ``check_vma=False`` a cotangent is
each rank's *contribution* and must be summed (``psum``ᵀ = ``psum``); with vma
tracking, a cotangent of an invariant value is already the full cotangent
(``psum``ᵀ = identity). ``sum_mode`` in the context selects the first.
"""
from __future__ import annotations

from typing import Any, Sequence

import optree
import torch
from torch.autograd import Function

from . import _context
from . import _primitives as prim
from ._errors import ShardingError
from ._mesh import AxisGroup

__all__ = ["psum", "pmean", "pmax", "pmin", "pvary", "all_gather", "all_gather_invariant",
           "psum_scatter", "all_to_all", "ppermute", "axis_index", "axis_size"]


_EAGER: dict[str, type] = {}
_NO_JVP: dict[str, type] = {}


def _traceable(cls: type) -> type:
    """Registers ``cls`` and a twin without its ``jvp``: Dynamo refuses to trace a
    Function that defines one, and forward-mode AD is not used under compile."""
    _EAGER[cls.__name__] = cls
    _NO_JVP[cls.__name__] = type(cls.__name__ + "NoJvp", (cls,),
                                 {"jvp": Function.jvp, "__module__": cls.__module__})
    return cls


def _apply(name: str, *args):
    """``Function.apply`` by class name (a string, which Dynamo can use as a key)."""
    return (_NO_JVP if torch.compiler.is_compiling() else _EAGER)[name].apply(*args)


def _move_bdim(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    return x if bdim in (None, 0) else x.movedim(bdim, 0)


@_traceable
class _Psum(Function):
    """psum (``mean=False``) or pmean (``mean=True``) over ``g``."""

    @staticmethod
    def forward(x, g: AxisGroup, mean: bool, sum_mode: bool):
        y = prim.all_reduce(x, g, "sum")
        return y / g.size if mean else y

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.g, ctx.mean, ctx.sum_mode = inputs

    @staticmethod
    def backward(ctx, ct):
        if ctx.sum_mode:
            return _apply("_Psum", ct, ctx.g, ctx.mean, True), None, None, None
        return (ct / ctx.g.size if ctx.mean else ct), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply("_Psum", t, ctx.g, ctx.mean, ctx.sum_mode)

    @staticmethod
    def vmap(info, in_dims, x, g, mean, sum_mode):
        return _apply("_Psum", x, g, mean, sum_mode), in_dims[0]


@_traceable
class _Pextremum(Function):
    """pmax/pmin. The gradient goes to the ranks that hold the extremum, split evenly
    among ties (as ``torch.amax`` does within one tensor)."""

    @staticmethod
    def forward(x, g: AxisGroup, op: str, sum_mode: bool):
        return prim.all_reduce(x, g, op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.g, ctx.op, ctx.sum_mode = inputs
        ctx.save_for_backward(x, output)
        ctx.save_for_forward(x, output)

    @staticmethod
    def _route(ctx, v, sum_v: bool):
        """``v`` (summed over ranks first if ``sum_v``) to the extremum's holders."""
        x, out = ctx.saved_tensors
        mask = (x == out).to(v.dtype)
        if sum_v:   # one collective for both the sum and the tie count
            both = _apply("_Psum", torch.stack([v, mask]), ctx.g, False, True)
            return both[0] * mask / both[1]
        return v * mask / _apply("_Psum", mask, ctx.g, False, True)

    @staticmethod
    def backward(ctx, ct):
        return _Pextremum._route(ctx, ct, ctx.sum_mode), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        x, out = ctx.saved_tensors
        mask = (x == out).to(t.dtype)
        both = _apply("_Psum", torch.stack([t * mask, mask]), ctx.g, False, True)
        return both[0] / both[1]

    @staticmethod
    def vmap(info, in_dims, x, g, op, sum_mode):
        return _apply("_Pextremum", x, g, op, sum_mode), in_dims[0]


@_traceable
class _Pvary(Function):
    """Identity forward on several tensors; backward sums their cotangents over ``g``
    with one all-reduce per dtype (a gradient bucket, as DDP does)."""

    @staticmethod
    def forward(g: AxisGroup, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g = inputs[0]

    @staticmethod
    def backward(ctx, *cts):
        # only the inputs being differentiated join the bucket
        want = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
        grads: list[Any] = [None] * len(cts)
        for i, gi in zip(want, _bucketed_psum([cts[i] for i in want], ctx.g)):
            grads[i] = gi
        return (None, *grads)

    @staticmethod
    def jvp(ctx, g_t, *ts):
        return tuple(ts)

    @staticmethod
    def vmap(info, in_dims, g, *xs):
        return _apply("_Pvary", g, *xs), tuple(in_dims[1:])


def _bucketed_psum(ts: Sequence[torch.Tensor], g: AxisGroup) -> list[torch.Tensor]:
    out: list[Any] = [None] * len(ts)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(ts):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        if len(idx) == 1:
            out[idx[0]] = _apply("_Psum", ts[idx[0]], g, False, True)
            continue
        flat = _apply("_Psum", torch.cat([ts[i].reshape(-1) for i in idx]), g, False, True)
        for i, piece in zip(idx, flat.split([ts[i].numel() for i in idx])):
            out[i] = piece.view(ts[i].shape)
    return out


@_traceable
class _AllGather(Function):
    """all_gather; ``invariant_T`` picks the transpose of all_gather_invariant in vma
    mode (keep this rank's slice) instead of psum_scatter."""

    @staticmethod
    def forward(x, g: AxisGroup, dim: int, tiled: bool, invariant_T: bool):
        return prim.all_gather(x if tiled else x.unsqueeze(dim), g, dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.g, ctx.dim, ctx.tiled, ctx.invariant_T = inputs

    @staticmethod
    def backward(ctx, ct):
        g, dim = ctx.g, ctx.dim
        if ctx.invariant_T:
            gx = (ct.narrow(dim, g.index * (ct.shape[dim] // g.size), ct.shape[dim] // g.size)
                  if ctx.tiled else ct.select(dim, g.index))
        else:
            gx = _apply("_PsumScatter", ct, g, dim, ctx.tiled)
        return gx, None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply("_AllGather", t, ctx.g, ctx.dim, ctx.tiled, ctx.invariant_T)

    @staticmethod
    def vmap(info, in_dims, x, g, dim, tiled, invariant_T):
        return _apply("_AllGather", _move_bdim(x, in_dims[0]), g, dim + 1, tiled, invariant_T), 0


@_traceable
class _PsumScatter(Function):
    @staticmethod
    def forward(x, g: AxisGroup, dim: int, tiled: bool):
        y = prim.reduce_scatter(x, g, dim)
        return y if tiled else y.squeeze(dim)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.g, ctx.dim, ctx.tiled = inputs

    @staticmethod
    def backward(ctx, ct):
        return _apply("_AllGather", ct, ctx.g, ctx.dim, ctx.tiled, False), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply("_PsumScatter", t, ctx.g, ctx.dim, ctx.tiled)

    @staticmethod
    def vmap(info, in_dims, x, g, dim, tiled):
        return _apply("_PsumScatter", _move_bdim(x, in_dims[0]), g, dim + 1, tiled), 0


@_traceable
class _AllToAll(Function):
    @staticmethod
    def forward(x, g: AxisGroup, split: int, concat: int, tiled: bool):
        if tiled:
            return prim.all_to_all(x, g, split, concat)
        # untiled: dim `split` (size n) is consumed, a new dim of size n (the source
        # rank) appears at `concat`
        return prim.all_to_all(x, g, split, split).movedim(split, concat)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.g, ctx.split, ctx.concat, ctx.tiled = inputs

    @staticmethod
    def backward(ctx, ct):
        return _apply("_AllToAll", ct, ctx.g, ctx.concat, ctx.split, ctx.tiled), None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply("_AllToAll", t, ctx.g, ctx.split, ctx.concat, ctx.tiled)

    @staticmethod
    def vmap(info, in_dims, x, g, split, concat, tiled):
        return _apply("_AllToAll", _move_bdim(x, in_dims[0]), g, split + 1, concat + 1, tiled), 0


@_traceable
class _Ppermute(Function):
    @staticmethod
    def forward(x, g: AxisGroup, perm: tuple):
        return prim.permute(x, g, perm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.g, ctx.perm = inputs

    @staticmethod
    def backward(ctx, ct):
        inverse = tuple((d, s) for s, d in ctx.perm)
        return _apply("_Ppermute", ct, ctx.g, inverse), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _apply("_Ppermute", t, ctx.g, ctx.perm)

    @staticmethod
    def vmap(info, in_dims, x, g, perm):
        return _apply("_Ppermute", x, g, perm), in_dims[0]


@_traceable
class _ScaleGrad(Function):
    """Identity forward; multiplies the cotangent by ``factor``."""

    @staticmethod
    def forward(x, factor: float):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.factor = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        return ct * ctx.factor, None

    @staticmethod
    def jvp(ctx, t, _):
        return t

    @staticmethod
    def vmap(info, in_dims, x, factor):
        return _apply("_ScaleGrad", x, factor), in_dims[0]


# ---------------------------------------------------------------------------------
# public API


def _group(axis_name, what: str) -> tuple[_context.Frame, AxisGroup]:
    fr = _context.current(what)
    return fr, fr.mesh.axis_group(axis_name, f"functp.{what}({axis_name!r})")


def _map(fn, x):
    return optree.tree_map(fn, x)


def _dim(d: int, ndim: int, what: str, arg: str, shape) -> int:
    if not -ndim <= d < ndim:
        raise ShardingError(
            f"functp.{what}: {arg}={d} is out of range for a tensor of shape {tuple(shape)}")
    return d % ndim


def _need_tensor(x, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ShardingError(f"functp.{what} needs tensors, got {type(x).__name__}")
    return x


def psum(x, axis_name):
    """All-reduce sum over ``axis_name`` (a name or a tuple); ``x`` may be a pytree.

    Backward: identity with vma tracking (the result is invariant over the axes), a
    ``psum`` of the cotangents with ``check_vma=False``. A Python number ``c`` gives
    ``c * axis_size(axis_name)``.
    """
    fr, g = _group(axis_name, "psum")
    return _map(lambda t: _apply("_Psum", t, g, False, not fr.check_vma)
                if isinstance(t, torch.Tensor) else t * g.size, x)


def pmean(x, axis_name):
    """All-reduce mean over ``axis_name``; backward divides the cotangent by the size."""
    fr, g = _group(axis_name, "pmean")
    return _map(lambda t: _apply("_Psum", t, g, True, not fr.check_vma)
                if isinstance(t, torch.Tensor) else t, x)


def pmax(x, axis_name):
    """All-reduce max; the gradient flows to the ranks holding the maximum (ties share)."""
    fr, g = _group(axis_name, "pmax")
    return _map(lambda t: _apply("_Pextremum", _need_tensor(t, "pmax"), g, "max",
                                           not fr.check_vma), x)


def pmin(x, axis_name):
    """All-reduce min; the gradient flows to the ranks holding the minimum (ties share)."""
    fr, g = _group(axis_name, "pmin")
    return _map(lambda t: _apply("_Pextremum", _need_tensor(t, "pmin"), g, "min",
                                           not fr.check_vma), x)


def pvary(x, axis_name):
    """Marks ``x`` as varying over ``axis_name``: identity forward, ``psum`` of the
    gradient backward. Needed only with vma tracking, which also inserts it
    implicitly; with ``check_vma=False`` every value already counts as varying and
    this returns ``x`` unchanged."""
    fr, g = _group(axis_name, "pvary")
    if not fr.check_vma:
        return x
    leaves, spec = optree.tree_flatten(x)
    return optree.tree_unflatten(spec, list(_apply("_Pvary", g, *leaves)))


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False):
    """Gathers every rank's block along ``axis_name``.

    ``tiled=False`` stacks them in a new dimension ``axis`` (of size
    ``axis_size(axis_name)``); ``tiled=True`` concatenates them along ``axis``.
    Backward: ``psum_scatter`` of the cotangent.
    """
    fr, g = _group(axis_name, "all_gather")

    def one(t):
        t = _need_tensor(t, "all_gather")
        d = _dim(axis, t.ndim + (0 if tiled else 1), "all_gather", "axis", t.shape)
        return _apply("_AllGather", t, g, d, tiled, False)
    return _map(one, x)


def all_gather_invariant(x, axis_name, *, axis: int = 0, tiled: bool = False):
    """Like :func:`all_gather`, but the result is typed invariant over ``axis_name``;
    with vma tracking its backward keeps this rank's slice (no communication)."""
    fr, g = _group(axis_name, "all_gather_invariant")

    def one(t):
        t = _need_tensor(t, "all_gather_invariant")
        d = _dim(axis, t.ndim + (0 if tiled else 1), "all_gather_invariant", "axis", t.shape)
        return _apply("_AllGather", t, g, d, tiled, fr.check_vma)
    return _map(one, x)


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False):
    """Sums over ``axis_name`` and leaves each rank its block of ``scatter_dimension``.

    ``tiled=False``: that dimension must have size ``axis_size`` and is removed;
    ``tiled=True``: it must be divisible by it and shrinks. Backward: ``all_gather``.
    """
    fr, g = _group(axis_name, "psum_scatter")

    def one(t):
        t = _need_tensor(t, "psum_scatter")
        d = _dim(scatter_dimension, t.ndim, "psum_scatter", "scatter_dimension", t.shape)
        _check_split(t, d, g, tiled, "psum_scatter", "scatter_dimension")
        return _apply("_PsumScatter", t, g, d, tiled)
    return _map(one, x)


def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, tiled: bool = False):
    """Splits ``split_axis`` into ``axis_size`` blocks, sends block ``j`` to rank ``j``,
    and puts the received blocks along ``concat_axis`` in rank order.

    ``tiled=False``: ``split_axis`` must have size ``axis_size``; it is removed and a
    new dimension of that size (the source rank) is inserted at ``concat_axis``.
    Backward: the inverse all-to-all.
    """
    fr, g = _group(axis_name, "all_to_all")

    def one(t):
        t = _need_tensor(t, "all_to_all")
        s = _dim(split_axis, t.ndim, "all_to_all", "split_axis", t.shape)
        c = _dim(concat_axis, t.ndim, "all_to_all", "concat_axis", t.shape)
        _check_split(t, s, g, tiled, "all_to_all", "split_axis")
        return _apply("_AllToAll", t, g, s, c, tiled)
    return _map(one, x)


def ppermute(x, axis_name, perm):
    """Sends this rank's ``x`` along ``(src, dst)`` pairs of axis indices; a rank that
    no pair sends to gets zeros. Backward: the inverse permutation."""
    fr, g = _group(axis_name, "ppermute")
    perm = tuple((int(s), int(d)) for s, d in perm)
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ShardingError(
            f"functp.ppermute: perm {list(perm)} sends from or to one index twice; "
            f"each source and each destination may appear at most once")
    bad = [i for i in srcs + dsts if not 0 <= i < g.size]
    if bad:
        raise ShardingError(
            f"functp.ppermute: perm {list(perm)} has index {bad[0]} outside "
            f"0..{g.size - 1} (the size of {g.axes})")
    return _map(lambda t: _apply("_Ppermute", _need_tensor(t, "ppermute"), g, perm), x)


def axis_index(axis_name) -> int:
    """This rank's index along ``axis_name`` (a tuple: flattened, major first)."""
    return _context.current("axis_index").mesh.axis_index(axis_name)


def axis_size(axis_name) -> int:
    """The number of ranks along ``axis_name`` (a tuple: the product)."""
    return _context.current("axis_size").mesh.axis_size(axis_name)


def _check_split(t, d, g: AxisGroup, tiled: bool, what: str, arg: str) -> None:
    n = t.shape[d]
    if (n % g.size if tiled else n != g.size):
        need = f"a multiple of {g.size}" if tiled else f"exactly {g.size}"
        alt = "" if tiled else " (or pass tiled=True)"
        raise ShardingError(
            f"functp.{what} over {g.axes} (size {g.size}): {arg}={d} of a tensor of "
            f"shape {tuple(t.shape)} has size {n}, but it must be {need}{alt}")
