"""The point-to-point transfers of a pipeline tick, and the pipeline's agreements.

A tick's transfers (activations to the next stage, gradients to the previous one) are
batched isend/irecv between the pairs of ranks that exchange, started at the tick end
and waited for where the received tensor is read (the sends at the step's end): each
rank knows from the schedule's table who sends what and in which order, so no rank
ever waits for a send that does not come, and none stops at a tick end for a peer
that is not yet ready. In the check mode and under ``functp.simulate`` they are one
all-to-all over the pp axis whose splits are empty except between the ranks that
exchange (as ``ppermute`` does, ``ops/_primitives.permute``), which every rank joins
at every tick that has a transfer. They are raw collectives (no autograd: the
schedule computes its gradients itself), recorded in ``comm_log`` as ``permute`` and
fingerprinted in the check mode like any other.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..mesh._mesh import AxisGroup
from ..runtime import _comm_log
from ..runtime import _crosscheck
from ..runtime import _star
from ..runtime import _world
from ..ops import _primitives as prim
from ..runtime._torch_compat import c10d_functional as _c10d

__all__ = ["exchange", "start", "ready", "gather_rows", "gather_rows_later"]


def exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, tuple]],
             g: AxisGroup, dtype: torch.dtype) -> list[torch.Tensor]:
    """:func:`start`, waited for: **returns** the received tensors, in ``recvs``'
    order, every send complete."""
    got, waits, sending = start(sends, recvs, g, dtype)
    for work, _ in sending:
        work.wait()
    return [ready(x, w) for x, w in zip(got, waits)]


def start(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, tuple]],
          g: AxisGroup, dtype: torch.dtype) -> tuple[list, list, list]:
    """Starts sending each ``(peer index, tensor)`` of ``sends`` and receiving one
    tensor of each ``(peer index, shape)`` of ``recvs`` (both in the order the peers
    agreed: the schedule's), all in ``dtype``.

    **Returns:** ``(received, waits, sending)``: the receive buffers in ``recvs``'
    order, for each the works to wait for before reading it (:func:`ready`), and the
    send works (with their tensors) to wait for before the step ends. Point-to-point
    between the pairs that exchange, waited for only where a buffer is read: a rank
    does not stop at a tick end for a peer that is not ready to receive. In the check
    mode (whose fingerprint is a collective over the group) and under
    ``functp.simulate`` (whose groups torch's point-to-point calls do not know) one
    all-to-all, complete on return; so too in ``functp.estimate``'s trace, whose
    fake collectives stand for the transfers."""
    if _point_to_point():
        return _pairs(sends, recvs, g, dtype)
    dry = _world.dry_run() is not None
    got = _all_to_all(sends, recvs, g, dtype)
    # (estimate's trace: each send's tensor held as the point-to-point path holds it,
    # until the sender has heard from its peer since: the pipeline's _release)
    held = [(_HELD, t) for _, t in sends] if dry else []
    return got, [()] * len(got), held


class _Held:
    """A fake trace's send: complete once waited for, as gloo's are."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        pass


_HELD = _Held()


def ready(buf: torch.Tensor, waits) -> torch.Tensor:
    """``buf`` once its receive has completed."""
    for work in waits:
        work.wait()
    return buf


def _pairs(sends, recvs, g: AxisGroup, dtype):
    """Batched isend/irecv: only the ranks that exchange wait for each other (an
    all-to-all made every rank of the axis meet at every tick end)."""
    if _comm_log._local.active:        # one event per tick on every rank, as before
        _comm_log.record("permute", g.axes, sum(t.numel() * t.element_size()
                                                for _, t in sends))
    pg = g.pg()
    ops, out, sent = [], [], []
    for peer, t in sends:
        t = t.to(dtype).contiguous()
        sent.append(t)
        ops.append(dist.P2POp(dist.isend, t, dist.get_global_rank(pg, g.group_rank(peer)), pg))
    for peer, shape in recvs:
        buf = torch.empty(shape, dtype=dtype)
        out.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf,
                              dist.get_global_rank(pg, g.group_rank(peer)), pg))
    if not ops:
        return out, [], []
    works = dist.batch_isend_irecv(ops)
    if len(works) != len(ops):         # one work for the batch (a coalesced backend)
        return out, [works] * len(out), [(w, sent) for w in works]
    n = len(sends)
    return (out, [(w,) for w in works[n:]],
            [(w, t) for w, t in zip(works[:n], sent)])


def _all_to_all(sends, recvs, g: AxisGroup, dtype) -> list[torch.Tensor]:
    send_splits, recv_splits = [0] * g.size, [0] * g.size
    by_peer: dict[int, list[torch.Tensor]] = {}
    for peer, t in sends:
        by_peer.setdefault(g.group_rank(peer), []).append(t.reshape(-1))
        send_splits[g.group_rank(peer)] += t.numel()
    parts = [t for rank in sorted(by_peer) for t in by_peer[rank]]
    flat = (torch.cat(parts) if len(parts) > 1 else parts[0] if parts
            else torch.empty(0, dtype=dtype)).to(dtype).contiguous()
    sizes = []
    for peer, shape in recvs:
        n = 1
        for d in shape:
            n *= d
        sizes.append((g.group_rank(peer), n, shape))
        recv_splits[g.group_rank(peer)] += n
    # (the fingerprint compares the row shape only: the ranks' counts differ by design)
    prim._record("permute", g, flat.view(-1, 1), ragged=True)
    y = prim._wait(_c10d.all_to_all_single(flat, recv_splits, send_splits, g.group_name),
                   "permute", g)
    offsets, start = {}, 0
    for rank in range(g.size):
        offsets[rank], start = start, start + recv_splits[rank]
    out = []
    for rank, n, shape in sizes:          # a peer's tensors arrive in the order sent
        out.append(y[offsets[rank]:offsets[rank] + n].view(shape))
        offsets[rank] += n
    return out


def _point_to_point() -> bool:
    """Whether this rank's exchanges are point-to-point: between processes, outside
    the check mode (its fingerprint is a collective over the group) and
    ``functp.estimate``'s trace (fake collectives)."""
    return not (_crosscheck.ENABLED or _world.SIMULATING or _world.dry_run() is not None)


def gather_rows(row: list[float], g: AxisGroup) -> list[list[float]]:
    """Every rank's ``row`` (a few numbers, the same count everywhere), by axis index:
    one all-gather of float64 (exact for ints below 2**53)."""
    return gather_rows_later(row, g)()


def gather_rows_later(row: list[float], g: AxisGroup) -> Callable[[], list[list[float]]]:
    """:func:`gather_rows` launched now: **returns** the function that waits for the
    rows. Between processes (:func:`_point_to_point`, as the transfers)
    point-to-point messages through the group's first rank (``runtime/_star``: on
    gloo two messages deep where its all-gather is ``pp - 1``; the pipeline makes
    two a step), the waits watched; elsewhere an all-gather."""
    if g.size == 1:
        return lambda: [row]
    x = torch.tensor([row], dtype=torch.float64)
    if not _point_to_point():
        later = prim.all_gather_later(x, g)
        return lambda: later().tolist()
    if _comm_log._local.active:
        _comm_log.record("all_gather", g.axes, x.numel() * x.element_size())
    table = _star.gather(x, g.pg(), lambda block: prim.watched(block, "all_gather", g))
    # (the table is in group-rank order; the rows are wanted by axis index)
    return lambda: prim._blocks_from_group_order(table(), g).tolist()
