"""The point-to-point transfers of a pipeline tick, and the pipeline's agreements.

A tick's transfers (activations to the next stage, gradients to the previous one) go
in one all-to-all over the pp axis whose splits are empty except between the ranks
that exchange (as ``ppermute`` does, ``ops/_primitives.permute``): every rank of the
axis joins every tick that has a transfer, and each knows from the schedule's table
who sends what, so no rank ever waits for a send that does not come. They are raw
collectives (no autograd: the schedule computes its gradients itself), recorded in
``comm_log`` as ``permute`` and fingerprinted in the check mode like any other.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..mesh._mesh import AxisGroup
from ..runtime import _comm_log
from ..runtime import _crosscheck
from ..runtime import _world
from ..ops import _primitives as prim
from ..runtime._torch_compat import c10d_functional as _c10d

__all__ = ["exchange", "gather_rows"]


def exchange(sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, tuple]],
             g: AxisGroup, dtype: torch.dtype) -> list[torch.Tensor]:
    """Sends each ``(peer index, tensor)`` of ``sends`` and receives one tensor of
    each ``(peer index, shape)`` of ``recvs`` (both in the order the peers agreed:
    the schedule's), all in ``dtype``. **Returns:** the received tensors, in
    ``recvs``' order. Point-to-point between the pairs that exchange; in the check
    mode (whose fingerprint is a collective over the group) and under
    ``functp.simulate`` (whose groups torch's point-to-point calls do not know) one
    all-to-all."""
    if not (_crosscheck.ENABLED or _world.SIMULATING):
        return _pairs(sends, recvs, g, dtype)
    return _all_to_all(sends, recvs, g, dtype)


def _pairs(sends, recvs, g: AxisGroup, dtype) -> list[torch.Tensor]:
    """Batched isend/irecv: only the ranks that exchange wait for each other (an
    all-to-all made every rank of the axis meet at every tick end)."""
    if _comm_log._local.active:        # one event per tick on every rank, as before
        _comm_log.record("permute", g.axes, sum(t.numel() * t.element_size()
                                                for _, t in sends))
    pg = g.pg()
    ops, out = [], []
    for peer, t in sends:
        ops.append(dist.P2POp(dist.isend, t.to(dtype).contiguous(),
                              dist.get_global_rank(pg, g.group_rank(peer)), pg))
    for peer, shape in recvs:
        buf = torch.empty(shape, dtype=dtype)
        out.append(buf)
        ops.append(dist.P2POp(dist.irecv, buf,
                              dist.get_global_rank(pg, g.group_rank(peer)), pg))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


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


def gather_rows(row: list[float], g: AxisGroup) -> list[list[float]]:
    """Every rank's ``row`` (a few numbers, the same count everywhere), by axis index:
    one all-gather of float64 (exact for ints below 2**53)."""
    x = torch.tensor([row], dtype=torch.float64)
    return prim.all_gather(x, g, 0).tolist() if g.size > 1 else [row]
