"""The raw collectives on an ``AxisGroup``: functional c10d ops plus ``wait_tensor``.

No autograd here: ``_ops.py`` registers the differentiable ops built on these. Every
call is recorded in ``comm_log``. Each collective is launched, then waited on at once,
except where its result can be handed out before its data arrives (its
post-processing only views the buffer): inside :func:`deferring` (a gradient bucket
launched during the backward, see ``_overlap``) it returns that unfinished result and
leaves a :class:`Pending` to wait on before anyone reads it; called ``lazy`` (a
body's forward collective, from ``_ops``) where ``_lazy.ready()``, the result is
marked pending and waited on at its first use (``_lazy``).

A dimension argument names where the blocks are stacked; blocks are ordered by the
index along the axis tuple, which can differ from the process group's rank order (a
tuple of axes given out of mesh order), so we permute blocks on the way in and out
where needed.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

from ..runtime import _comm_log
from ..runtime import _compile
from ..runtime import _crosscheck
from ..runtime import _watch
from ..runtime import _world
from ..mesh._mesh import AxisGroup
from ..runtime._torch_compat import c10d_functional as _ops
from . import _lazy
from ._lazy import _state as _waits


class _Defer(threading.local):      # per thread: simulated ranks are threads
    pending: list | None = None


_defer = _Defer()


class Pending:
    """A launched collective: ``wait()`` waits for it once (naming it if it fails) and
    returns its finished result. ``early`` is that result before the wait (the same
    memory, its data not there yet), or None where finishing it reads the data."""

    __slots__ = ("raw", "op", "g", "finish", "early", "value", "marked", "src")

    def __init__(self, raw: torch.Tensor, op: str, g: AxisGroup,
                 finish: Callable | None, view: bool) -> None:
        self.raw, self.op, self.g, self.finish, self.value = raw, op, g, finish, None
        self.early = (raw if finish is None else finish(raw)) if view else None
        self.marked = None        # the tensors _lazy marked pending with it
        self.src = 0              # _lazy: the data pointer of the input it reads, if any

    def wait(self) -> torch.Tensor:
        if self.value is None:
            y = _wait(self.raw, self.op, self.g)
            # (early views the same memory, whose data is there now)
            self.value = (self.early if self.early is not None
                          else y if self.finish is None else self.finish(y))
            self.raw = self.finish = None
        return self.value


@contextlib.contextmanager
def deferring():
    """Collectives launched here return before their data arrives, where they can;
    yields the list of their :class:`Pending`, in launch order, which the caller must
    wait on before the results are read. Example::

        with deferring() as pending:
            y = all_reduce(x, g)        # launched; y's data may not be there yet
        ...                             # compute that does not read y
        for p in pending:
            p.wait()                    # now y holds the sum
    """
    prev, _defer.pending = _defer.pending, []
    try:
        yield _defer.pending
    finally:
        _defer.pending = prev


def _finish(raw: torch.Tensor, op: str, g: AxisGroup, finish: Callable | None = None,
            view: bool = True) -> torch.Tensor:
    """Inside :func:`deferring`, the result of the collective launched as ``raw``:
    handed out unfinished, its :class:`Pending` added to the deferred list, where
    ``finish`` only views the buffer (``view``); else waited on now."""
    pending = _defer.pending
    if pending is None or not view:
        y = _wait(raw, op, g)
        return y if finish is None else finish(y)
    p = Pending(raw, op, g, finish, view)
    pending.append(p)
    return p.early


def _held(raw: torch.Tensor, op: str, g: AxisGroup, finish: Callable | None = None,
          own: bool = False, src: torch.Tensor | None = None):
    """The result of the collective launched as ``raw``, handed out before its data
    arrives (``finish`` only views it), waited on at its first use (``_lazy``).
    ``own``: a tensor of its own over ``raw``'s memory, for a collective that gloo
    completes with an in-place copy into ``raw`` (all-gather, reduce-scatter): that
    bumps ``raw``'s version counter at some moment before the wait, which autograd
    would take for a modification of the result (of a view returned by an op, or of
    a value saved for the backward). (gloo's all-reduce copies at the launch, before
    the result is handed out; its all-to-all writes in place without a copy.)"""
    p = Pending(raw, op, g, None, True)
    if own:
        raw = raw.new_empty(0).set_(raw)
    p.early = raw if finish is None else finish(raw)
    return _lazy.hold(p, src)


def _record(op: str, g: AxisGroup, x: torch.Tensor, how: str = "",
            ragged: bool = False) -> None:
    """Before every collective: the check mode's fingerprint exchange, and comm_log.
    ``ragged``: the ranks' row counts differ by design; only the row shape is compared."""
    if _world.SIMULATING:
        _compile.check_collective()
    if _crosscheck.ENABLED:
        _crosscheck.collective(op + how, g, x[:0] if ragged else x)
    if _comm_log._local.active and not _compile.tracing():
        _comm_log.record(op, g.axes, x.numel() * x.element_size())


def _wait(t: torch.Tensor, op: str, g: AxisGroup, block: Callable | None = None) -> torch.Tensor:
    """``t`` once its collective ``op`` over ``g`` is complete (with ``block``: once
    ``block()`` has returned: :func:`watched`), the wait watched (``runtime/_watch``)
    and a failure named."""
    if _world.SIMULATING and block is None:
        try:
            return _world.wait(t)
        except RuntimeError as e:     # a timeout or a peer gone: say which collective
            raise _crosscheck.failed(op, g, e) from e
    w = _watch.state
    if _watch.ENABLED and not _crosscheck.ENABLED and not _compile.dynamo_tracing():
        # (a long wait is looked into: runtime/_watch; the check mode finds a
        # divergence before the collective. Inline, no call: the watch thread times the
        # wait by seeing it again. Not traced: Dynamo would guard on the watch's state,
        # and a compiled step, a collective outside a body such as clip_by_global_norm's,
        # recompiled after any eager functp call had set it)
        if w.entered is not None:
            w.calls, w.body, w.entered = w.calls + 1, w.entered, None
        w.wait = (op, g)
        if w.thread is None:
            _watch.start()
    try:
        if block is None:
            return _ops.wait_tensor(t)
        block()
        return t
    except RuntimeError as e:
        raise _crosscheck.failed(op, g, e, _watch.cause()) from e
    finally:
        w.wait = None


def watched(block: Callable[[], None], op: str, g: AxisGroup) -> None:
    """Runs ``block`` (it waits for point-to-point works that together make the
    collective ``op`` over ``g``: a pipeline's agreement), watched and named as that
    collective's wait."""
    _wait(None, op, g, block)


def _blocks_to_group_order(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``x`` stacked on dim 0 by axis index -> stacked by group rank."""
    if g.order is None:
        return x
    inv = [0] * g.size
    for i, r in enumerate(g.order):
        inv[r] = i
    return x.unflatten(0, (g.size, -1))[list(inv)].flatten(0, 1)


def _blocks_from_group_order(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """``x`` stacked on dim 0 by group rank -> stacked by axis index."""
    if g.order is None:
        return x
    return x.unflatten(0, (g.size, -1))[list(g.order)].flatten(0, 1)


def all_reduce(x: torch.Tensor, g: AxisGroup, op: str = "sum",
               lazy: bool = False) -> torch.Tensor:
    """``op`` is ``sum``, ``max`` or ``min`` (gloo has no ``avg``; pmean divides).
    ``lazy``: a body's forward collective, waited on at its result's first use where
    it can be (``_lazy``)."""
    if g.size == 1:
        return x.clone()
    _record("all_reduce", g, x, f"({op})")
    y = _ops.all_reduce(x.contiguous(), op, g.group_name)
    if _defer.pending is None:      # (the usual case first: it costs no extra call)
        if lazy and _waits.allow and _lazy.ready():
            return _held(y, f"all_reduce({op})", g)
        return _wait(y, f"all_reduce({op})", g)
    return _finish(y, f"all_reduce({op})", g)


def all_reduce_inplace(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """The sum over the group, written into ``x`` (contiguous, and not needed
    afterwards by anyone else: a gradient bucket) instead of a new buffer."""
    if g.size == 1:
        return x
    _record("all_reduce", g, x, "(sum)")
    # (the in-place op returns x itself: finished or not, it is the result)
    y = _ops.all_reduce_(x, "sum", g.group_name)
    if _defer.pending is None:
        _wait(y, "all_reduce(sum)", g)
    else:
        _finish(y, "all_reduce(sum)", g)
    return x


def all_gather(x: torch.Tensor, g: AxisGroup, dim: int, lazy: bool = False) -> torch.Tensor:
    """Concatenates every rank's ``x`` along ``dim`` (tiled all-gather). ``lazy``:
    as for :func:`all_reduce` (where the blocks need no reordering)."""
    if g.size == 1:
        return x.clone()
    _record("all_gather", g, x)
    send = x.movedim(dim, 0).contiguous()
    y = _ops.all_gather_into_tensor(send, g.size, g.group_name)
    if _defer.pending is None:
        if lazy and g.order is None and _waits.allow and _lazy.ready():
            return _held(y, "all_gather", g, lambda y: y.movedim(0, dim), True, send)
        return _blocks_from_group_order(_wait(y, "all_gather", g), g).movedim(0, dim)
    return _finish(y, "all_gather", g, lambda y: _blocks_from_group_order(y, g).movedim(0, dim),
                   view=g.order is None)


def all_gather_later(x: torch.Tensor, g: AxisGroup) -> Callable[[], torch.Tensor]:
    """:func:`all_gather` of ``x`` on dimension 0, launched now: **returns** a function
    that waits for it and returns the result, so that the caller's work until then
    overlaps the exchange (a pipeline's agreement, read once its first stage has run
    a forward). Inside a deferred region it is gathered at once."""
    if g.size == 1 or _defer.pending is not None:
        y = all_gather(x, g, 0)
        return lambda: y
    _record("all_gather", g, x)
    y = _ops.all_gather_into_tensor(x.contiguous(), g.size, g.group_name)
    return lambda: _blocks_from_group_order(_wait(y, "all_gather", g), g)


def reduce_scatter(x: torch.Tensor, g: AxisGroup, dim: int, lazy: bool = False) -> torch.Tensor:
    """Sums ``x`` over the ranks and keeps block ``index`` of ``dim`` (tiled).
    ``lazy``: as for :func:`all_reduce`."""
    if g.size == 1:
        return x.clone()
    _record("reduce_scatter", g, x)
    y = _blocks_to_group_order(x.movedim(dim, 0), g).contiguous()
    r = _ops.reduce_scatter_tensor(y, "sum", g.size, g.group_name)
    if _defer.pending is None:
        if lazy and _waits.allow and _lazy.ready():
            return _held(r, "reduce_scatter", g, lambda r: r.movedim(0, dim), True, y)
        return _wait(r, "reduce_scatter", g).movedim(0, dim)
    return _finish(r, "reduce_scatter", g, lambda r: r.movedim(0, dim))


def all_to_all(x: torch.Tensor, g: AxisGroup, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Block ``j`` of ``split_dim`` goes to rank ``j``; received blocks are
    concatenated along ``concat_dim`` in rank order (tiled all-to-all)."""
    if g.size == 1:
        return x.clone()
    _record("all_to_all", g, x)
    y = _blocks_to_group_order(x.movedim(split_dim, 0), g).contiguous()
    y = _wait(_ops.all_to_all_single(y, [y.shape[0] // g.size] * g.size,
                                     [y.shape[0] // g.size] * g.size, g.group_name),
              "all_to_all", g)
    # y: received blocks stacked on dim 0 in group order, each shaped like a block of x
    y = _blocks_from_group_order(y, g).unflatten(0, (g.size, -1)).movedim(1, split_dim + 1)
    # now (size, *block shape): put the block index next to concat_dim and merge
    return y.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1)


def permute(x: torch.Tensor, g: AxisGroup, perm: tuple[tuple[int, int], ...],
            lazy: bool = False) -> torch.Tensor:
    """Sends ``x`` from axis index ``src`` to ``dst`` for each pair; zeros where no
    rank sends. Issued as one all-to-all with empty splits except the one pair.
    ``lazy``: as for :func:`all_reduce`, on a rank that receives."""
    dst = {s: d for s, d in perm}
    src = {d: s for s, d in perm}
    me = g.index
    if g.size == 1:
        return x.clone() if dst.get(0) == 0 else torch.zeros_like(x)
    _record("permute", g, x)
    n = x.numel()
    flat = x.reshape(-1)
    send = [0] * g.size
    recv = [0] * g.size
    if me in dst:
        send[g.group_rank(dst[me])] = n
    else:
        flat = flat[:0]
    if me in src:
        recv[g.group_rank(src[me])] = n
    flat = flat.contiguous()
    y = _ops.all_to_all_single(flat, recv, send, g.group_name)
    if me in src and lazy and _waits.allow and _lazy.ready():
        return _held(y, "permute", g, lambda y: y.view(x.shape), src=flat)
    y = _wait(y, "permute", g)
    return y.view(x.shape) if me in src else torch.zeros_like(x)
