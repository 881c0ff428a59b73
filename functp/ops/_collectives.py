"""The collectives a shard_map body calls, with JAX's names and arguments.

This is the public layer: it resolves axis names to groups in the enclosing body,
checks arguments, and calls the registered ops of ``_ops.py``, where each op's
section holds its forward, transpose, vma rule and batching rule (and a drawing of
them). ``_collective`` applies the op's vma rule: which axes the result varies
over, and an implicit ``pvary`` where the input varies over fewer axes than the
collective needs.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import optree
import torch

from . import _context
from . import _lazy
from . import _ops
from ..runtime._errors import ShardingError, leaf_text
from ..mesh._layout import uneven
from ..mesh._mesh import AxisGroup

_waits = _lazy._state

__all__ = ["psum", "pmean", "pmax", "pmin", "pvary", "pcast", "all_gather",
           "all_gather_invariant", "psum_scatter", "all_to_all", "ppermute", "axis_index",
           "axis_size"]

AxisName = Any   # a mesh axis name, or a tuple of names (major to minor)


# ---------------------------------------------------------------------------------
# public API


def _group(axis_name, what: str) -> tuple[_context.Frame, AxisGroup]:
    fr = _context.current(what)
    try:
        return fr, fr.groups[axis_name]       # resolved and checked once per body
    except (KeyError, TypeError):             # (TypeError: an unhashable name)
        pass
    g = fr.mesh.axis_group(axis_name, f"functp.{what}({axis_name!r})")
    fr.check_axes(g.axes, f"functp.{what}({axis_name!r})")
    fr.groups[axis_name] = g
    return fr, g


def _map(fn, x):
    return fn(x) if isinstance(x, torch.Tensor) else optree.tree_map(fn, x)


def _dim(d: int, ndim: int, what: str, arg: str, shape) -> int:
    if not -ndim <= d < ndim:
        raise ShardingError(
            f"functp.{what}: {arg}={d} is out of range for {leaf_text('the value', shape)}")
    return d % ndim


def _need_tensor(x, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ShardingError(f"functp.{what} needs tensors, got {type(x).__name__}")
    return x


def _collective(fr: _context.Frame, g: AxisGroup, what: str, t: torch.Tensor,
                op: Callable, rule: _ops.VmaRule, *args):
    """Applies registered op ``op`` to ``t`` over ``g`` and, with vma tracking, its
    vma ``rule``: an input invariant over some of the collective's axes is refused
    (``rule.needs_varying``: a reduction of copies) or pvary'd over them, as any op
    does; the result's axes are ``rule.result`` of the input's.
    """
    tr = fr.tracker
    # a reduction over one rank is the identity: a copy, no registered op (its Python
    # autograd kernel) and no backward node of ours (the vma rule still applies)
    one = g.size == 1 and (op is _ops.psum or op is _ops.pextremum)
    if tr is None:
        return t.clone() if one else op(t, g.key, *args)
    if tr.replay is not None:       # (a planned call: ops/_replay.Scope decides)
        tr.replay.collective(what)
    tr._paused += 1          # our own ops are not the user's program
    try:
        v = tr.get(t)
        missing = g.axis_set - v
        if missing:
            if rule.needs_varying:
                raise ShardingError(_invariant_reduction_message(
                    what, g, tuple(a for a in g.axes if a in missing), t))
            t = tr.pvary(t, missing)
            v = v | missing
        # its result may be waited on at its first use (not while a planned module
        # replays: no per-op mode there would see that use)
        if one:
            out = t.clone()
        else:
            if _waits.forward and (tr.replay is None or tr.replay.recorder is not None):
                _lazy.allow(tr)
            out = op(t, g.key, *args)
        tr.set(out, rule.result(v, g.axis_set))
        if _waits.last is not None:     # (pending: the body's next call may read it)
            _lazy.activate(out)
    finally:
        tr._paused -= 1
        _waits.allow = False
    return out


def _invariant_reduction_message(what: str, g: AxisGroup, missing, t) -> str:
    axes = missing[0] if len(missing) == 1 else missing
    return (
        f"functp.{what} over {g.axes!r}: {leaf_text('the value', t.shape)} is invariant "
        f"over mesh axis {axes!r} (every rank along it holds the same value), so "
        f"summing it would multiply it by the axis size. If that product is what you "
        f"mean, write x * functp.axis_size({axes!r}); if each rank's copy really is a "
        f"separate contribution, mark it with functp.pvary(x, {axes!r}) first; otherwise "
        f"leave out {axes!r} from the axes")


def psum(x: Any, axis_name: AxisName) -> Any:
    """All-reduce sum over ``axis_name``.

    **Arguments:** ``x`` – a tensor, a Python number or a pytree of them; ``axis_name``
    – a mesh axis name or a tuple of names.

    **Returns:** the sum over the ranks along the axes, the same on each of them
    (invariant). A Python number ``c`` gives ``c * axis_size(axis_name)``. Backward: the
    identity (with ``check_vma=False``: a ``psum`` of the cotangents). Summing a value
    that is already invariant over an axis raises (JAX silently multiplies it by the
    axis size).

    Example (2 ranks, ``x`` is ``[1., 2.]`` on rank 0 and ``[3., 4.]`` on rank 1)::

        functp.psum(x, "dp")        # tensor([4., 6.]) on both ranks
    """
    fr, g = _group(axis_name, "psum")
    return _map(lambda t: _collective(fr, g, "psum", t, _ops.psum, _ops.PSUM_VMA, False,
                                      fr.tracker is None)
                if isinstance(t, torch.Tensor) else t * g.size, x)


def pmean(x: Any, axis_name: AxisName) -> Any:
    """All-reduce mean over ``axis_name``.

    **Arguments:** as :func:`psum`.

    **Returns:** the mean over the ranks along the axes (invariant). Backward divides
    the cotangent by the axis size. The mean of a value that is invariant over the
    axes is that value; a Python number is returned as it is.

    Example (2 ranks, ``loss`` this rank's mean over its half of the batch)::

        functp.pmean(loss, "dp")    # the mean over the whole batch, on both ranks
    """
    fr, g = _group(axis_name, "pmean")
    return _map(lambda t: _collective(fr, g, "pmean", t, _ops.psum, _ops.PMEAN_VMA, True,
                                      fr.tracker is None)
                if isinstance(t, torch.Tensor) else t, x)


def pmax(x: Any, axis_name: AxisName) -> Any:
    """All-reduce max over ``axis_name``.

    **Arguments:** ``x`` – a tensor or a pytree of tensors; ``axis_name`` – as :func:`psum`.

    **Returns:** the elementwise maximum over the ranks (invariant). The gradient flows
    to the ranks holding the maximum, split evenly among ties.

    Example::

        functp.pmax(x.abs().amax(), "tp")     # the global max |x| of a sharded x
    """
    fr, g = _group(axis_name, "pmax")
    return _map(lambda t: _collective(fr, g, "pmax", _need_tensor(t, "pmax"), _ops.pextremum,
                                      _ops.PEXTREMUM_VMA, "max", fr.tracker is None), x)


def pmin(x: Any, axis_name: AxisName) -> Any:
    """All-reduce min over ``axis_name``; as :func:`pmax`, with the minimum.

    **Arguments:** as :func:`pmax`. **Returns:** the elementwise minimum (invariant).

    Example::

        functp.pmin(x.amin(), "tp")
    """
    fr, g = _group(axis_name, "pmin")
    return _map(lambda t: _collective(fr, g, "pmin", _need_tensor(t, "pmin"), _ops.pextremum,
                                      _ops.PEXTREMUM_VMA, "min", fr.tracker is None), x)


def pvary(x: Any, axis_name: AxisName) -> Any:
    """Marks ``x`` as varying over ``axis_name``: identity forward, ``psum`` of the
    gradient backward.

    vma tracking inserts it implicitly wherever an invariant value meets a varying
    one, so it is rarely written by hand: write it where each rank's copy of an
    invariant value really is a separate contribution (``psum(pvary(w, a), a)`` is
    ``axis_size(a) * w``). With ``check_vma=False`` every value already counts as
    varying and this returns ``x`` unchanged.

    **Arguments:** ``x`` – a tensor or a pytree of tensors; ``axis_name`` – as :func:`psum`.

    **Returns:** ``x``, varying over ``axis_name`` too.

    Example::

        functp.psum(functp.pvary(w, "dp"), "dp")    # == 2 * w on 2 ranks
    """
    fr, g = _group(axis_name, "pvary")
    if fr.tracker is None:
        return x
    if fr.tracker.replay is not None:     # (as a collective: it reads the input's tag)
        fr.tracker.replay.collective("pvary")
    with fr.tracker.paused():
        return _map(lambda t: fr.tracker.pvary(t, g.axes), x)


def pcast(x: Any, axis_name: AxisName, *, to: str) -> Any:
    """JAX 0.11's spelling of a change of vma type: ``to="varying"`` is :func:`pvary`.

    **Arguments:** ``x``, ``axis_name`` – as :func:`pvary`; ``to`` – ``"varying"``.

    **Returns:** ``x`` varying over ``axis_name``.

    Example::

        functp.pcast(w, "dp", to="varying")     # == functp.pvary(w, "dp")
    """
    if to == "varying":
        return pvary(x, axis_name)
    raise ShardingError(
        f"functp.pcast(..., to={to!r}): only to='varying' (pvary) is supported; a value "
        f"becomes invariant through a reduction (psum/pmean) or all_gather_invariant")


def _gather_to(to: str) -> bool:
    """``True`` for JAX's ``to="invarying"`` (all_gather_invariant)."""
    if to in ("varying", "invarying", "invariant"):
        return to != "varying"
    raise ShardingError(
        f"functp.all_gather(..., to={to!r}): use to='varying' (the default) or "
        f"to='invarying' (as all_gather_invariant); 'reduced' is not supported")


def all_gather(x: Any, axis_name: AxisName, *, axis: int = 0, tiled: bool = False,
               to: str = "varying") -> Any:
    """Gathers every rank's block along ``axis_name``.

    **Arguments:** ``x`` – a tensor or a pytree of tensors; ``axis_name`` – as
    :func:`psum`; ``axis`` – where the blocks go; ``tiled`` – ``False`` stacks them in a
    new dimension ``axis`` (of size ``axis_size(axis_name)``), ``True`` concatenates
    them along ``axis``; ``to`` – ``"varying"`` (JAX's default: the result still counts
    as varying over the axes) or ``"invarying"`` (as :func:`all_gather_invariant`).

    **Returns:** the blocks of every rank in axis-index order. Backward:
    ``psum_scatter``.

    Example (2 ranks, ``x`` of shape ``(3, 4)`` on each)::

        functp.all_gather(x, "tp", tiled=True).shape    # (6, 4)
        functp.all_gather(x, "tp").shape                # (2, 3, 4)
    """
    if _gather_to(to):
        return all_gather_invariant(x, axis_name, axis=axis, tiled=tiled)
    fr, g = _group(axis_name, "all_gather")

    def one(t):
        t = _need_tensor(t, "all_gather")
        d = _dim(axis, t.ndim + (0 if tiled else 1), "all_gather", "axis", t.shape)
        return _collective(fr, g, "all_gather", t, _ops.all_gather, _ops.ALL_GATHER_VMA, d,
                           tiled, False)
    return _map(one, x)


def all_gather_invariant(x: Any, axis_name: AxisName, *, axis: int = 0,
                         tiled: bool = False) -> Any:
    """Like :func:`all_gather`, but the result is invariant over ``axis_name``.

    **Arguments:** as :func:`all_gather`.

    **Returns:** the gathered value, usable as a replicated output. With vma tracking
    its backward keeps this rank's slice of the cotangent (no communication).

    Example::

        full = functp.all_gather_invariant(w_block, "tp", tiled=True)   # out_specs P()
    """
    fr, g = _group(axis_name, "all_gather_invariant")

    def one(t):
        t = _need_tensor(t, "all_gather_invariant")
        d = _dim(axis, t.ndim + (0 if tiled else 1), "all_gather_invariant", "axis", t.shape)
        return _collective(fr, g, "all_gather_invariant", t, _ops.all_gather,
                           _ops.ALL_GATHER_INVARIANT_VMA, d, tiled, fr.tracker is not None)
    return _map(one, x)


def psum_scatter(x: Any, axis_name: AxisName, *, scatter_dimension: int = 0,
                 tiled: bool = False) -> Any:
    """Sums over ``axis_name`` and leaves each rank its block of ``scatter_dimension``.

    **Arguments:** ``x`` – a tensor or a pytree of tensors; ``axis_name`` – as
    :func:`psum`; ``scatter_dimension`` – the dimension split among the ranks;
    ``tiled`` – ``False``: that dimension must have size ``axis_size`` and is removed;
    ``True``: it must be divisible by it and shrinks.

    **Returns:** this rank's block of the sum (varying). Backward: ``all_gather``. Like
    :func:`psum`, it refuses a value that is invariant over the axes.

    Example (2 ranks, ``x`` of shape ``(4, 3)``)::

        functp.psum_scatter(x, "tp", tiled=True).shape    # (2, 3)
    """
    fr, g = _group(axis_name, "psum_scatter")

    def one(t):
        t = _need_tensor(t, "psum_scatter")
        d = _dim(scatter_dimension, t.ndim, "psum_scatter", "scatter_dimension", t.shape)
        _check_split(t, d, g, tiled, "psum_scatter", "scatter_dimension")
        return _collective(fr, g, "psum_scatter", t, _ops.psum_scatter,
                           _ops.PSUM_SCATTER_VMA, d, tiled)
    return _map(one, x)


def all_to_all(x: Any, axis_name: AxisName, split_axis: int, concat_axis: int, *,
               tiled: bool = False) -> Any:
    """Splits ``split_axis`` into ``axis_size`` blocks, sends block ``j`` to rank ``j``,
    and puts the received blocks along ``concat_axis`` in rank order.

    **Arguments:** ``x`` – a tensor or a pytree of tensors; ``axis_name`` – as
    :func:`psum`; ``split_axis``, ``concat_axis`` – dimensions of ``x``; ``tiled`` –
    ``False``: ``split_axis`` must have size ``axis_size``; it is removed and a new
    dimension of that size (the source rank) is inserted at ``concat_axis``.

    **Returns:** the exchanged blocks (varying). Backward: the inverse all-to-all.

    Example (2 ranks, ``x`` of shape ``(4, 6)``)::

        functp.all_to_all(x, "ep", 0, 1, tiled=True).shape    # (2, 12)
    """
    fr, g = _group(axis_name, "all_to_all")

    def one(t):
        t = _need_tensor(t, "all_to_all")
        s = _dim(split_axis, t.ndim, "all_to_all", "split_axis", t.shape)
        c = _dim(concat_axis, t.ndim, "all_to_all", "concat_axis", t.shape)
        _check_split(t, s, g, tiled, "all_to_all", "split_axis")
        return _collective(fr, g, "all_to_all", t, _ops.all_to_all, _ops.ALL_TO_ALL_VMA,
                           s, c, tiled)
    return _map(one, x)


def ppermute(x: Any, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> Any:
    """Sends this rank's ``x`` along ``(src, dst)`` pairs of axis indices.

    **Arguments:** ``x`` – a tensor or a pytree of tensors; ``axis_name`` – as
    :func:`psum`; ``perm`` – ``(source index, destination index)`` pairs, each index
    at most once as a source and once as a destination.

    **Returns:** what this rank received; zeros on a rank no pair sends to. Backward:
    the inverse permutation.

    Example (a ring shift over 4 ranks)::

        functp.ppermute(x, "sp", [(i, (i + 1) % 4) for i in range(4)])
    """
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
    flat = [i for pair in perm for i in pair]
    return _map(lambda t: _collective(fr, g, "ppermute", _need_tensor(t, "ppermute"),
                                      _ops.ppermute, _ops.PPERMUTE_VMA, flat), x)


def axis_index(axis_name: AxisName) -> int:
    """This rank's index along ``axis_name``.

    **Arguments:** ``axis_name`` – a mesh axis name or a tuple (flattened, major first).

    **Returns:** a Python int. A value computed from it is not tracked as varying over
    the axis, so combine it with values that already vary (as when masking a sharded
    table).

    Example::

        start = functp.axis_index("tp") * block_rows
    """
    return _group(axis_name, "axis_index")[1].index


def axis_size(axis_name: AxisName) -> int:
    """The number of ranks along ``axis_name``.

    **Arguments:** ``axis_name`` – a mesh axis name or a tuple (the product of sizes).

    **Returns:** a Python int.

    Example::

        functp.axis_size(("dp", "tp"))    # 4 on a 2 x 2 mesh
    """
    return _group(axis_name, "axis_size")[1].size


def _check_split(t, d, g: AxisGroup, tiled: bool, what: str, arg: str) -> None:
    n = t.shape[d]
    if (uneven(n, g.size) if tiled else n != g.size):
        need = f"a multiple of {g.size}" if tiled else f"exactly {g.size}"
        alt = "" if tiled else " (or pass tiled=True)"
        raise ShardingError(
            f"functp.{what} over {g.axes} (size {g.size}): {arg}={d} of "
            f"{leaf_text('the value', t.shape)} has size {n}, but it must be {need}{alt}")
