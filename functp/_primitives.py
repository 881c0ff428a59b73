"""The raw collectives on an ``AxisGroup``: functional c10d ops plus ``wait_tensor``.

No autograd here: ``_ops.py`` registers the differentiable ops built on these. Every
call is recorded in ``comm_log``. A dimension argument names where the blocks are
stacked; blocks are ordered by the index along the axis tuple, which can differ
from the process group's rank order (a tuple of axes given out of mesh order), so
we permute blocks on the way in and out where needed.
"""
from __future__ import annotations

import torch

from . import _comm_log, _compile, _crosscheck, _world
from ._mesh import AxisGroup
from ._torch_compat import c10d_functional as _ops


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


def _wait(t: torch.Tensor, op: str, g: AxisGroup) -> torch.Tensor:
    try:
        return _world.wait(t) if _world.SIMULATING else _ops.wait_tensor(t)
    except RuntimeError as e:     # a timeout or a peer gone: say which collective
        raise _crosscheck.failed(op, g, e) from e


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


def all_reduce(x: torch.Tensor, g: AxisGroup, op: str = "sum") -> torch.Tensor:
    """``op`` is ``sum``, ``max`` or ``min`` (gloo has no ``avg``; pmean divides)."""
    if g.size == 1:
        return x.clone()
    _record("all_reduce", g, x, f"({op})")
    return _wait(_ops.all_reduce(x.contiguous(), op, g.group_name), f"all_reduce({op})", g)


def all_reduce_inplace(x: torch.Tensor, g: AxisGroup) -> torch.Tensor:
    """The sum over the group, written into ``x`` (contiguous, and not needed
    afterwards by anyone else: a gradient bucket) instead of a new buffer."""
    if g.size == 1:
        return x
    _record("all_reduce", g, x, "(sum)")
    _wait(_ops.all_reduce_(x, "sum", g.group_name), "all_reduce(sum)", g)
    return x


def all_gather(x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
    """Concatenates every rank's ``x`` along ``dim`` (tiled all-gather)."""
    if g.size == 1:
        return x.clone()
    _record("all_gather", g, x)
    y = _wait(_ops.all_gather_into_tensor(x.movedim(dim, 0).contiguous(), g.size,
                                          g.group_name), "all_gather", g)
    return _blocks_from_group_order(y, g).movedim(0, dim)


def reduce_scatter(x: torch.Tensor, g: AxisGroup, dim: int) -> torch.Tensor:
    """Sums ``x`` over the ranks and keeps block ``index`` of ``dim`` (tiled)."""
    if g.size == 1:
        return x.clone()
    _record("reduce_scatter", g, x)
    y = _blocks_to_group_order(x.movedim(dim, 0), g).contiguous()
    return _wait(_ops.reduce_scatter_tensor(y, "sum", g.size, g.group_name),
                 "reduce_scatter", g).movedim(0, dim)


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


def permute(x: torch.Tensor, g: AxisGroup, perm: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Sends ``x`` from axis index ``src`` to ``dst`` for each pair; zeros where no
    rank sends. Issued as one all-to-all with empty splits except the one pair."""
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
    y = _wait(_ops.all_to_all_single(flat.contiguous(), recv, send, g.group_name), "permute", g)
    return y.view(x.shape) if me in src else torch.zeros_like(x)
