"""Differentiable collectives for shard_map bodies, with JAX's names and arguments.

Each collective is a new-style ``torch.autograd.Function`` (``setup_context``) so that
``torch.func`` accepts it, with an explicit ``vmap`` rule (torch's generated rule
silently skips the communication) and a ``jvp``. Backward formulas call the
Functions again, so higher-order derivatives compose.

Two transposition regimes exist (DESIGN.md): with ``check_vma=False`` a cotangent is
each rank's *contribution* and must be summed (``psum``ᵀ = ``psum``); with vma
tracking, a cotangent of an invariant value is already the full cotangent
(``psum``ᵀ = ``pvary``, the identity). The Functions whose transpose differs take a
``sum_mode`` argument, fixed when the collective is called.
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
        ct = _vary(ct, ctx.g)      # psumᵀ = pvary: identity, but psum when transposed again
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
    def backward(ctx, ct):
        x, out = ctx.saved_tensors
        mask = (x == out).to(ct.dtype)
        if ctx.sum_mode:   # one collective for both the cotangent sum and the tie count
            both = _apply("_Psum", torch.stack([ct, mask]), ctx.g, False, True)
            return both[0] * mask / both[1], None, None, None
        count = _apply("_Psum", mask, ctx.g, False, True)
        return _vary(ct, ctx.g) * mask / count, None, None, None

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
    def forward(g: AxisGroup, sum_mode: bool, *xs):
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.g, ctx.sum_mode = inputs[:2]

    @staticmethod
    def backward(ctx, *cts):
        # only the inputs being differentiated join the bucket
        want = [i for i, need in enumerate(ctx.needs_input_grad[2:]) if need]
        grads: list[Any] = [None] * len(cts)
        summed = _bucketed_psum([cts[i] for i in want], ctx.g, ctx.sum_mode)
        for i, gi in zip(want, summed):
            grads[i] = gi
        return (None, None, *grads)

    @staticmethod
    def jvp(ctx, g_t, mode_t, *ts):
        return tuple(ts)

    @staticmethod
    def vmap(info, in_dims, g, sum_mode, *xs):
        return _apply("_Pvary", g, sum_mode, *xs), tuple(in_dims[2:])


def _vary(t: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """pvary inside a vma-mode backward: an invariant cotangent becoming varying."""
    return _apply("_Pvary", g, False, t)[0]


@_traceable
class _PvaryInplace(Function):
    """pvary of a tensor that is about to be mutated in place by a more varying value:
    marks it dirty, so its later uses (and its views) see the new autograd history."""

    @staticmethod
    def forward(x, g: AxisGroup):
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])
        ctx.g = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        return _apply("_Psum", ct, ctx.g, False, False), None

    @staticmethod
    def jvp(ctx, t, _):
        return t

    @staticmethod
    def vmap(info, in_dims, x, g):
        return _apply("_PvaryInplace", x, g), in_dims[0]


@_traceable
class _EntryAliases(Function):
    """Aliases of the replicated inputs of a vma-tracked body, one per axis set each
    input may be implicitly pvary'd over (``plan[i]`` lists input ``i``'s groups).

    The body uses an input itself where it stays invariant, and its alias wherever
    it meets a value varying over that group. The aliases' cotangents are this
    rank's contributions: backward sums them over their group in one bucketed
    all-reduce per group, and autograd adds the result to the input's own
    (invariant) cotangent. So the gradient all-reduces of all parameters happen
    together, after the whole backward, and only where vma requires them.
    """

    @staticmethod
    def forward(plan: tuple, *xs):
        return tuple(x.view_as(x) for x, groups in zip(xs, plan) for _ in groups)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.plan = inputs[0]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *cts):
        grads: list[Any] = [None] * len(ctx.plan)
        buckets: dict[AxisGroup, list[tuple[int, torch.Tensor]]] = {}
        k = 0
        for i, groups in enumerate(ctx.plan):
            for g in groups:
                if cts[k] is not None and ctx.needs_input_grad[1 + i]:
                    buckets.setdefault(g, []).append((i, cts[k]))
                k += 1
        for g, items in buckets.items():
            for (i, _), summed in zip(items, _bucketed_psum([c for _, c in items], g, False)):
                grads[i] = summed if grads[i] is None else grads[i] + summed
        return (None, *grads)

    @staticmethod
    def jvp(ctx, plan_t, *ts):
        return tuple(t for t, groups in zip(ts, ctx.plan) for _ in groups)

    @staticmethod
    def vmap(info, in_dims, plan, *xs):
        return (_apply("_EntryAliases", plan, *xs),
                tuple(d for d, groups in zip(in_dims[1:], plan) for _ in groups))


def _bucketed_psum(ts: Sequence[torch.Tensor], g: AxisGroup, sum_mode: bool) -> list[torch.Tensor]:
    out: list[Any] = [None] * len(ts)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(ts):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        if len(idx) == 1:
            out[idx[0]] = _apply("_Psum", ts[idx[0]], g, False, sum_mode)
            continue
        flat = _apply("_Psum", torch.cat([ts[i].reshape(-1) for i in idx]), g, False, sum_mode)
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
            ct = _vary(ct, g)
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
class _TakeBlock(Function):
    """This rank's block of a value that is whole along ``dims``' axes (entering a
    nested shard_map); backward gathers the blocks' cotangents back to whole."""

    @staticmethod
    def forward(x, dims: tuple):
        for d, g in dims:
            b = x.shape[d] // g.size
            x = x.narrow(d, g.index * b, b)
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dims = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        for d, g in reversed(ctx.dims):
            ct = _apply("_AllGather", ct, g, d, True, False)
        return ct, None

    @staticmethod
    def jvp(ctx, t, _):
        return _apply("_TakeBlock", t, ctx.dims)

    @staticmethod
    def vmap(info, in_dims, x, dims):
        return _apply("_TakeBlock", _move_bdim(x, in_dims[0]),
                      tuple((d + 1, g) for d, g in dims)), 0


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
    g = fr.mesh.axis_group(axis_name, f"functp.{what}({axis_name!r})")
    fr.check_axes(g.axes, f"functp.{what}({axis_name!r})")
    return fr, g


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


def _collective(fr: _context.Frame, g: AxisGroup, what: str, t, name: str, *args,
                reduces: bool, needs_varying: bool = False):
    """Applies collective Function ``name`` to ``t`` and sets the result's vma.

    With vma tracking, the input must vary over the collective's axes: a reduction
    (``needs_varying``) of a value invariant over them raises, the other collectives
    pvary it implicitly, as any op does. The result varies over the input's axes,
    minus the collective's axes when it ``reduces`` them.
    """
    tr = fr.tracker
    if tr is None:
        return _apply(name, t, g, *args)
    with tr.paused():
        v = tr.get(t)
        missing = tuple(a for a in g.axes if a not in v)
        if missing and needs_varying:
            raise ShardingError(_invariant_reduction_message(what, g, missing, t))
        if missing:
            t = tr.pvary(t, missing)
            v = v | frozenset(missing)
        out = _apply(name, t, g, *args)
        tr.set(out, v - frozenset(g.axes) if reduces else v)
    return out


def _invariant_reduction_message(what: str, g: AxisGroup, missing, t) -> str:
    axes = missing[0] if len(missing) == 1 else missing
    return (
        f"functp.{what} over {g.axes!r}: the value (shape {tuple(t.shape)}) is invariant "
        f"over mesh axis {axes!r} (every rank along it holds the same value), so "
        f"summing it would multiply it by the axis size. If that product is what you "
        f"mean, write x * functp.axis_size({axes!r}); if each rank's copy really is a "
        f"separate contribution, mark it with functp.pvary(x, {axes!r}) first; otherwise "
        f"leave out {axes!r} from the axes")


def psum(x, axis_name):
    """All-reduce sum over ``axis_name`` (a name or a tuple); ``x`` may be a pytree.

    The result is invariant over the axes; its backward is the identity (with
    ``check_vma=False``: a ``psum`` of the cotangents). Summing a value that is
    already invariant over an axis raises (JAX silently multiplies by the size).
    A Python number ``c`` gives ``c * axis_size(axis_name)``.
    """
    fr, g = _group(axis_name, "psum")
    return _map(lambda t: _collective(fr, g, "psum", t, "_Psum", False, fr.tracker is None,
                                      reduces=True, needs_varying=True)
                if isinstance(t, torch.Tensor) else t * g.size, x)


def pmean(x, axis_name):
    """All-reduce mean over ``axis_name``; backward divides the cotangent by the size.
    (The mean of a value invariant over the axes is that value.)"""
    fr, g = _group(axis_name, "pmean")
    return _map(lambda t: _collective(fr, g, "pmean", t, "_Psum", True, fr.tracker is None,
                                      reduces=True)
                if isinstance(t, torch.Tensor) else t, x)


def pmax(x, axis_name):
    """All-reduce max; the gradient flows to the ranks holding the maximum (ties share)."""
    fr, g = _group(axis_name, "pmax")
    return _map(lambda t: _collective(fr, g, "pmax", _need_tensor(t, "pmax"), "_Pextremum",
                                      "max", fr.tracker is None, reduces=True), x)


def pmin(x, axis_name):
    """All-reduce min; the gradient flows to the ranks holding the minimum (ties share)."""
    fr, g = _group(axis_name, "pmin")
    return _map(lambda t: _collective(fr, g, "pmin", _need_tensor(t, "pmin"), "_Pextremum",
                                      "min", fr.tracker is None, reduces=True), x)


def pvary(x, axis_name):
    """Marks ``x`` as varying over ``axis_name``: identity forward, ``psum`` of the
    gradient backward. vma tracking inserts it implicitly wherever an invariant value
    meets a varying one, so it is rarely written by hand. With ``check_vma=False``
    every value already counts as varying and this returns ``x`` unchanged."""
    fr, g = _group(axis_name, "pvary")
    if fr.tracker is None:
        return x
    with fr.tracker.paused():
        return _map(lambda t: fr.tracker.pvary(t, g.axes), x)


def all_gather(x, axis_name, *, axis: int = 0, tiled: bool = False):
    """Gathers every rank's block along ``axis_name``.

    ``tiled=False`` stacks them in a new dimension ``axis`` (of size
    ``axis_size(axis_name)``); ``tiled=True`` concatenates them along ``axis``.
    The result still counts as varying over the axes (use
    :func:`all_gather_invariant` for one that does not). Backward: ``psum_scatter``.
    """
    fr, g = _group(axis_name, "all_gather")

    def one(t):
        t = _need_tensor(t, "all_gather")
        d = _dim(axis, t.ndim + (0 if tiled else 1), "all_gather", "axis", t.shape)
        return _collective(fr, g, "all_gather", t, "_AllGather", d, tiled, False, reduces=False)
    return _map(one, x)


def all_gather_invariant(x, axis_name, *, axis: int = 0, tiled: bool = False):
    """Like :func:`all_gather`, but the result is invariant over ``axis_name``; with
    vma tracking its backward keeps this rank's slice (no communication)."""
    fr, g = _group(axis_name, "all_gather_invariant")

    def one(t):
        t = _need_tensor(t, "all_gather_invariant")
        d = _dim(axis, t.ndim + (0 if tiled else 1), "all_gather_invariant", "axis", t.shape)
        return _collective(fr, g, "all_gather_invariant", t, "_AllGather", d, tiled,
                           fr.tracker is not None, reduces=True)
    return _map(one, x)


def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, tiled: bool = False):
    """Sums over ``axis_name`` and leaves each rank its block of ``scatter_dimension``.

    ``tiled=False``: that dimension must have size ``axis_size`` and is removed;
    ``tiled=True``: it must be divisible by it and shrinks. Backward: ``all_gather``.
    Like :func:`psum`, it refuses a value that is invariant over the axes.
    """
    fr, g = _group(axis_name, "psum_scatter")

    def one(t):
        t = _need_tensor(t, "psum_scatter")
        d = _dim(scatter_dimension, t.ndim, "psum_scatter", "scatter_dimension", t.shape)
        _check_split(t, d, g, tiled, "psum_scatter", "scatter_dimension")
        return _collective(fr, g, "psum_scatter", t, "_PsumScatter", d, tiled,
                           reduces=False, needs_varying=True)
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
        return _collective(fr, g, "all_to_all", t, "_AllToAll", s, c, tiled, reduces=False)
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
    return _map(lambda t: _collective(fr, g, "ppermute", _need_tensor(t, "ppermute"),
                                      "_Ppermute", perm, reduces=False), x)


def axis_index(axis_name) -> int:
    """This rank's index along ``axis_name`` (a tuple: flattened, major first).

    A Python int: a value computed from it is not tracked as varying over the axis,
    so combine it with values that already vary (as when masking a sharded table).
    """
    return _group(axis_name, "axis_index")[1].index


def axis_size(axis_name) -> int:
    """The number of ranks along ``axis_name`` (a tuple: the product)."""
    return _group(axis_name, "axis_size")[1].size


def _check_split(t, d, g: AxisGroup, tiled: bool, what: str, arg: str) -> None:
    n = t.shape[d]
    if (n % g.size if tiled else n != g.size):
        need = f"a multiple of {g.size}" if tiled else f"exactly {g.size}"
        alt = "" if tiled else " (or pass tiled=True)"
        raise ShardingError(
            f"functp.{what} over {g.axes} (size {g.size}): {arg}={d} of a tensor of "
            f"shape {tuple(t.shape)} has size {n}, but it must be {need}{alt}")
