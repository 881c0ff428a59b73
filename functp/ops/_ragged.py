"""``ragged_all_to_all``: JAX's ``lax.ragged_all_to_all``, with its transpose, and the
helper that plans one from per-destination counts.

Each rank sends a contiguous run of rows of its ``operand`` to every peer (its
offset and size per peer may differ), and each peer writes what it receives into
its ``output`` buffer at an offset the *sender* names; rows of ``output`` nothing
lands on keep their values. Expert-parallel dispatch moves exactly the routed
tokens this way, where a dense ``all_to_all`` pads every block to the largest.

Forward and backward, for rank ``r`` and peer ``j``::

    forward:   operand[in_off[j] : +send[j]]  --->  peer j: output[out_off[j] : +send[j]]
    backward:  d_operand[in_off[j] : +send[j]] <---  peer j: d_output[out_off[j] : +send[j]]
               d_output: the cotangent, zero on the rows something landed on

Inside, the op moves rows between *local* offsets only: it takes where each of this
rank's received runs lands (``land_off``, exchanged once from the senders'
``out_off``), so its transpose is the same op with the two sides swapped and needs
no exchange. Sizes travel as Python ints (``all_to_all_single`` takes its splits on
the host): ``ragged_offsets`` makes them with one small all-gather of the counts and
one host sync; ``ragged_all_to_all`` given tensors syncs once for them.

Sizes that disagree between a sender and its receiver cannot be seen by either alone,
and the backend does not say: gloo leaves a short run's rows unwritten and aborts the
process on a long one. So the sizes a caller hands over are all-gathered and judged
alike on every rank before any row moves (one small collective and one host sync,
shared with the exchange of offsets when there is one), and every rank raises the
same error. Sizes functp derived from one exchange of every rank's counts (a
``ragged_offsets`` plan's lists, unchanged; ``ExpertDispatch``) agree by construction
and are not exchanged again.
"""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Sequence

import torch

from . import _context
from . import _ops
from . import _primitives as prim
from ._collectives import AxisName, _group, _need_tensor
from ..runtime import _compile, _crosscheck, _world
from ..runtime._errors import ShardingError
from ..mesh._mesh import AxisGroup, group_of

__all__ = ["ragged_all_to_all", "ragged_offsets", "RaggedOffsets"]


# -- the raw exchange --------------------------------------------------------------------

def _order(g: AxisGroup) -> list[int]:
    """Axis indices in process-group rank order (the order all_to_all_single uses)."""
    return sorted(range(g.size), key=g.group_rank)


def _ranges(offsets: Sequence[int], sizes: Sequence[int], order: list[int],
            device) -> torch.Tensor:
    return torch.cat([torch.arange(offsets[j], offsets[j] + sizes[j], device=device)
                      for j in order]) if order else torch.zeros(0, dtype=torch.int64)


def _raw(x, buf, group, src_off, send, land_off, recv):
    """``ragged_all_to_all`` over the axes ``a``: rank ``r`` sends run ``j`` of its
    rows to peer ``j``, which writes it into its buffer::

        forward    x: V[a], buf: V[a]  ->  buf with x's runs from every peer landed: V[a]
        backward   ct: V[a]  ->  d_x: the rows of ct that x's runs landed on, sent back
                                 d_buf: ct, zero on the rows something landed on

    The backward is the same exchange with the two sides swapped (both modes). vma:
    ``vma(x) ∪ vma(buf) ∪ a`` (both inputs are pvary'd to it). Batching: the ragged
    dimension stays first, the batch dimension goes second.
    """
    g = group_of(group)
    order = _order(g)
    out = buf.clone()
    chunks = torch.cat([x.narrow(0, src_off[j], send[j]) for j in order])
    if g.size == 1:
        got = chunks
    else:
        prim._record("ragged_all_to_all", g, chunks, ragged=True)
        got = prim._wait(prim._ops.all_to_all_single(
            chunks.contiguous(), [recv[j] for j in order], [send[j] for j in order],
            g.group_name), "ragged_all_to_all", g)
    out.index_copy_(0, _ranges(land_off, recv, order, buf.device), got)
    return out


def _setup(ctx, args, output):
    x, buf, ctx.group, ctx.src_off, ctx.send, ctx.land_off, ctx.recv = args
    ctx.x_shape, ctx.buf_shape = x.shape, buf.shape


def _bwd(ctx, ct):
    # the same exchange with the sides swapped: what landed goes back where it came
    # from; the buffer's own rows pass their cotangent through, except where rows landed
    back = ragged(ct, ct.new_zeros(ctx.x_shape), ctx.group, ctx.land_off, ctx.recv,
                  ctx.src_off, ctx.send)
    landed = _ranges(ctx.land_off, ctx.recv, _order(group_of(ctx.group)), ct.device)
    return back, ct.index_fill(0, landed, 0), *(None,) * 5


def _jvp(ctx, tx, tbuf, *_):
    like = tx if tx is not None else tbuf
    tx = tx if tx is not None else like.new_zeros(ctx.x_shape)
    tbuf = tbuf if tbuf is not None else like.new_zeros(ctx.buf_shape)
    return ragged(tx, tbuf, ctx.group, ctx.src_off, ctx.send, ctx.land_off, ctx.recv)


def _vmap(info, dims, x, buf, group, src_off, send, land_off, recv):
    # the ragged dimension stays first: the batch goes second, on both sides
    def second(t, d):
        return t.movedim(d, 1) if d is not None else t.unsqueeze(1).expand(
            -1, info.batch_size, *t.shape[1:])
    return ragged(second(x, dims[0]), second(buf, dims[1]), group, src_off, send, land_off,
                  recv), 1


RAGGED_VMA = _ops.VmaRule(needs_varying=False, reduces=False)

ragged = _ops._define(
    "ragged_all_to_all(Tensor x, Tensor buf, str group, int[] src_off, int[] send, "
    "int[] land_off, int[] recv) -> Tensor", _raw,
    lambda x, buf, *a: buf.new_empty(buf.shape),
    setup_context=_setup, backward=_bwd, jvp=_jvp, vmap=_vmap)


# -- the public API ------------------------------------------------------------------------

class RaggedOffsets(NamedTuple):
    """Where each rank's rows go, as :func:`ragged_offsets` plans them (Python ints,
    one entry per peer along the axis, in axis-index order)."""
    input_offsets: list[int]     # where the rows for peer j start in this rank's operand
    send_sizes: list[int]        # how many rows go to peer j
    output_offsets: list[int]    # where they land in peer j's output (the sender names it)
    recv_sizes: list[int]        # how many rows come from peer j
    recv_offsets: list[int]      # where the rows from peer j land in this rank's output
    recv_total: int              # rows this rank receives in all


def _ints(v, n: int, name: str) -> list[int] | torch.Tensor:
    if isinstance(v, torch.Tensor):
        if v.dtype.is_floating_point or v.dim() != 1 or v.numel() != n:
            raise ShardingError(f"functp.ragged_all_to_all: {name} must be {n} integers (one "
                                f"per peer), got a {v.dtype} tensor of shape {tuple(v.shape)}")
        return v
    v = list(v)
    if len(v) != n or not all(isinstance(i, int) for i in v):
        raise ShardingError(f"functp.ragged_all_to_all: {name} must be {n} ints (one per "
                            f"peer along the axis), got {v!r}")
    return v


class _Planned(list):
    """A size list :func:`ragged_offsets` made from every rank's counts: its plan's
    other size list agrees with the peers' by construction, so an exchange that uses
    the two unchanged (either way round: the return trip swaps them) needs no check."""

    def __init__(self, values: list[int], plan: object, role: str, group: str) -> None:
        super().__init__(values)
        self.plan, self.role, self.group, self.snap = plan, role, group, tuple(values)


def _agreed_by_plan(send, recv, g: AxisGroup) -> bool:
    """Both size lists are one :func:`ragged_offsets` plan's, over this group, unchanged
    since (a host comparison of ``axis_size`` ints; no exchange)."""
    return (isinstance(send, _Planned) and isinstance(recv, _Planned)
            and send.plan is recv.plan and send.role != recv.role and send.group == g.key
            and tuple(send) == send.snap and tuple(recv) == recv.snap)


def ragged_offsets(send_counts: Any, axis_name: AxisName) -> RaggedOffsets:
    """Plans a :func:`ragged_all_to_all` from how many rows this rank sends to each
    peer, its operand grouped by destination (peer 0's rows first) and every output
    filled from its start in source order.

    **Arguments:** ``send_counts`` – an int tensor or list of ``axis_size`` counts;
    ``axis_name`` – the mesh axis (or tuple) of the exchange.

    **Returns:** a :class:`RaggedOffsets`. One all-gather of the counts (``axis_size``
    squared ints) and **one host sync**, for the whole dispatch; none per expert. Its
    ``send_sizes`` and ``recv_sizes`` agree across the ranks by construction: passed
    unchanged to :func:`ragged_all_to_all` (either way round), they are not checked
    again. Example (inside a body; ``dest`` is each token's destination rank)::

        plan = functp.ragged_offsets(torch.bincount(dest, minlength=n), "ep")
        out = x.new_zeros(plan.recv_total, x.shape[1])
        out = functp.ragged_all_to_all(x[dest.argsort()], out, *plan[:4], "ep",
                                       recv_offsets=plan.recv_offsets)
    """
    fr, g = _group(axis_name, "ragged_offsets")
    n = g.size
    counts = torch.as_tensor(send_counts, dtype=torch.int64).reshape(-1)
    if counts.numel() != n:
        raise ShardingError(f"functp.ragged_offsets: send_counts has {counts.numel()} "
                            f"entries; the axis {g.axes} has {n} ranks (one count per peer)")
    with _untracked(fr):
        # every rank's counts (rows: source axis index; columns: destination)
        table = prim._blocks_from_group_order(prim.all_gather(counts.unsqueeze(0), g, 0), g) \
            if n > 1 else counts.unsqueeze(0)
    c = table.tolist()                     # the one host sync
    me = g.index
    if any(v < 0 for row in c for v in row):
        raise ShardingError(f"functp.ragged_offsets: negative send counts {c[me]}")
    send = c[me]
    in_off = [sum(send[:j]) for j in range(n)]
    out_off = [sum(c[s][j] for s in range(me)) for j in range(n)]
    recv = [c[s][me] for s in range(n)]
    recv_off = [sum(recv[:s]) for s in range(n)]
    plan = object()
    return RaggedOffsets(in_off, _Planned(send, plan, "send", g.key), out_off,
                         _Planned(recv, plan, "recv", g.key), recv_off, sum(recv))


def ragged_all_to_all(operand: torch.Tensor, output: torch.Tensor, input_offsets: Any,
                      send_sizes: Any, output_offsets: Any, recv_sizes: Any,
                      axis_name: AxisName, *, recv_offsets: Sequence[int] | None = None
                      ) -> torch.Tensor:
    """Sends ``operand[input_offsets[j] : + send_sizes[j]]`` to peer ``j``, which writes
    it into its ``output`` at ``output_offsets[j]`` (JAX's ``lax.ragged_all_to_all``).

    **Arguments:** ``operand`` – this rank's rows to send (dim 0 is ragged);
    ``output`` – this rank's receive buffer, shaped like ``operand`` past dim 0; rows
    nothing lands on keep their values; ``input_offsets``, ``send_sizes``,
    ``output_offsets``, ``recv_sizes`` – ``axis_size`` ints each (lists or int
    tensors), per peer in axis-index order; ``recv_sizes[j]`` must equal peer ``j``'s
    ``send_sizes`` entry for this rank; ``axis_name`` – the axis (or tuple) of the
    exchange; ``recv_offsets`` – where the rows from each peer land in this rank's
    ``output`` (what :func:`ragged_offsets` gives): without it, the senders'
    ``output_offsets`` are exchanged first.

    **Returns:** ``output`` with the received rows written (varying over the axis).
    Backward: the same exchange reversed (``operand``'s gradient gathered from the
    rows' destinations; ``output``'s gradient zero where rows landed).

    **Sizes are checked before any row moves**, always: unless both size lists are a
    :func:`ragged_offsets` plan's, unchanged (they agree by construction), the ranks
    all-gather their sizes (one small all-gather, ``axis_size`` x ``5 axis_size + 2``
    ints, and one host sync) and every rank raises the same ``ShardingError`` if a
    sender's ``send_sizes`` entry differs from its receiver's ``recv_sizes`` entry (one
    row fewer would leave output rows unwritten, one more overrun the buffer), or a
    run falls outside an operand or output; in the check mode (``FUNCTP_DEBUG=1``)
    also if ``recv_offsets`` differ from the senders' ``output_offsets``. Pass a
    plan's lists on every rank or your own on every rank (the choice decides whether
    the ranks exchange). Not checked while ``torch.compile`` traces, nor under
    :func:`functp.estimate` (no host reads there). Example (2 ranks, rank 0 sends 1
    row to rank 1)::

        out = functp.ragged_all_to_all(x, buf, [0, 0], [0, 1], [0, 2], [0, 0], "ep")
    """
    return _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                              recv_sizes, axis_name, recv_offsets, False)


def planned_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                              recv_sizes, axis_name, *, recv_offsets):
    """:func:`ragged_all_to_all` for functp's own dispatch (``ExpertDispatch``), whose
    sizes it derived from one exchange of every rank's counts: they agree by
    construction, and are not exchanged again (outside the check mode)."""
    return _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                              recv_sizes, axis_name, recv_offsets, True)


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                       axis_name, recv_offsets, agreed: bool) -> torch.Tensor:
    fr, g = _group(axis_name, "ragged_all_to_all")
    operand = _need_tensor(operand, "ragged_all_to_all")
    output = _need_tensor(output, "ragged_all_to_all")
    n = g.size
    if (operand.dim() < 1 or output.shape[1:] != operand.shape[1:]
            or output.dtype != operand.dtype):
        raise ShardingError(
            f"functp.ragged_all_to_all: output ({output.dtype}, shape {tuple(output.shape)}) "
            f"must have the operand's dtype and shape past dimension 0 (rows): "
            f"{operand.dtype}, {tuple(operand.shape)}")
    args = [_ints(v, n, name) for v, name in (
        (input_offsets, "input_offsets"), (send_sizes, "send_sizes"),
        (output_offsets, "output_offsets"), (recv_sizes, "recv_sizes"))]
    # (while torch.compile traces nothing is checked: the plan's lists are not looked at)
    agreed = agreed or (not _compile.tracing() and _agreed_by_plan(send_sizes, recv_sizes, g))
    with _untracked(fr):
        in_off, send, out_off, recv, land = _sizes(args, recv_offsets, g, agreed, operand,
                                                   output)
    _check(operand, output, in_off, send, land, recv, g)
    tr = fr.tracker
    if tr is None:
        return ragged(operand, output, g.key, in_off, send, land, recv)
    if tr.replay is not None:       # (a planned call: ops/_replay.Scope decides)
        tr.replay.collective("ragged_all_to_all")
    with tr.paused():       # the op's vma rule, over the union of its two inputs
        v = tr.get(operand) | tr.get(output) | g.axis_set
        if tr.get(operand) != v:
            operand = tr.pvary(operand, v - tr.get(operand))
        if tr.get(output) != v:
            output = tr.pvary(output, v - tr.get(output))
        out = ragged(operand, output, g.key, in_off, send, land, recv)
        tr.set(out, RAGGED_VMA.result(v, g.axis_set))
    return out


def _untracked(fr):
    """functp's own exchanges of sizes: not the user's program, not tracked."""
    return fr.tracker.paused() if fr.tracker is not None else contextlib.nullcontext()


def _sizes(args, recv_offsets, g: AxisGroup, agreed: bool, operand, output):
    """The four JAX arguments and the landing offsets as Python ints, with at most one
    host sync and one small all-gather: the ranks exchange their sizes where they
    must learn the senders' ``output_offsets`` (no ``recv_offsets``) or check them
    (sizes not agreed by construction, or the check mode), and then every rank judges
    every rank's sizes alike (:func:`_verdict`): an error is raised by all of them,
    before any row moves, never by one rank while its peers wait in the exchange."""
    n = g.size
    if recv_offsets is not None:
        recv_offsets = _ints(recv_offsets, n, "recv_offsets")
        if isinstance(recv_offsets, torch.Tensor):
            recv_offsets = recv_offsets.tolist()
        recv_offsets = list(recv_offsets)
    tensors = any(isinstance(a, torch.Tensor) for a in args)
    checks = (not agreed or _crosscheck.ENABLED) and not _compile.tracing()
    if recv_offsets is not None and not checks:
        if not tensors:
            return (*args, recv_offsets)
        rows = torch.stack([torch.as_tensor(a, dtype=torch.int64).reshape(-1)
                            for a in args], 1).tolist()      # the host sync
        return (*([row[k] for row in rows] for k in range(4)), recv_offsets)
    # one row per rank: send | recv | in_off | out_off | recv_offsets (-1: none) | the
    # operand's and the output's rows
    dev = operand.device
    roff = recv_offsets if recv_offsets is not None else [-1] * n
    tail = [*roff, operand.shape[0], output.shape[0]]
    if tensors:
        mine = torch.cat([torch.as_tensor(a, dtype=torch.int64).reshape(-1).to(dev)
                          for a in (args[1], args[3], args[0], args[2])]
                         + [torch.tensor(tail, dtype=torch.int64, device=dev)])
    else:         # (one call: the usual case, lists)
        mine = torch.tensor([*args[1], *args[3], *args[0], *args[2], *tail],
                            dtype=torch.int64, device=dev)
    table = (prim._blocks_from_group_order(prim.all_gather(mine.unsqueeze(0), g, 0), g)
             if n > 1 else mine.unsqueeze(0))
    if _world.dry_run() is not None:
        # functp.estimate: the exchange is issued (a real run's collectives), but fake
        # values are not judged; the senders' offsets read by its rule for host reads
        own = mine.tolist() if tensors else None
        if own is None and recv_offsets is not None:
            return (*args, recv_offsets)
        return _unpack(table.tolist() if recv_offsets is None else None, own, n, g.index,
                       recv_offsets)
    t = table.tolist()                                        # the host sync
    if checks or recv_offsets is None:
        err = _verdict(t, n, g, check_offsets=_crosscheck.ENABLED and recv_offsets is not None)
        if err:
            raise ShardingError(err)
    return _unpack(t, None, n, g.index, recv_offsets)


def _unpack(t, own, n: int, me: int, recv_offsets):
    """This rank's sizes from the gathered table ``t`` (or its own row ``own``)."""
    row = own if own is not None else t[me]
    send, recv, in_off, out_off = (row[k * n:(k + 1) * n] for k in range(4))
    land = (recv_offsets if recv_offsets is not None
            else [t[s][3 * n + me] if t is not None else out_off[me] for s in range(n)])
    return in_off, send, out_off, recv, land


def _verdict(t, n: int, g: AxisGroup, check_offsets: bool) -> str | None:
    """The same message on every rank (from every rank's row of sizes), or None: runs
    whose sender and receiver disagree on the rows, runs outside an operand or output,
    and (``check_offsets``) receivers whose recv_offsets are not the senders'
    output_offsets."""
    def col(r, k, j):
        return t[r][k * n + j]
    at = f"over {g.axes} (peers by index along it)"
    def rows(k):
        return f"{k} row" if k == 1 else f"{k} rows"
    pairs = [(s, d) for s in range(n) for d in range(n) if t[s][d] != t[d][n + s]]
    if pairs:
        pairs = [f"peer {s} sends {rows(col(s, 0, d))} to peer {d} (its send_sizes[{d}]), "
                 f"which plans to receive {col(d, 1, s)} (its recv_sizes[{s}])"
                 for s, d in pairs]
        more = f"; and {len(pairs) - 4} more pairs" if len(pairs) > 4 else ""
        return (f"functp.ragged_all_to_all {at}: senders and receivers disagree on the "
                f"rows between them, so no row was sent (every rank of the axis raises "
                f"this): {'; '.join(pairs[:4])}{more}. One row fewer would leave rows of "
                f"the receiver's output unwritten, one more would overrun it. Every "
                f"send_sizes[j] must equal peer j's recv_sizes entry for this rank: plan "
                f"both with functp.ragged_offsets(send_counts, {g.axes!r}) and pass its "
                f"lists unchanged, or derive recv_sizes from an exchange of the send counts")
    bad = []
    for r in range(n):        # (indexing, no calls: this runs on every checked exchange)
        row = t[r]
        ops, outs = row[5 * n], row[5 * n + 1]
        for j in range(n):
            s, rv, io, ld = row[j], row[n + j], row[2 * n + j], row[4 * n + j]
            if ld < 0:
                ld = t[j][3 * n + r]
            if s < 0 or rv < 0 or io < 0 or ld < 0:
                bad.append(f"peer {r} has a negative offset or size for peer {j}")
            elif io + s > ops:
                bad.append(f"peer {r}'s rows for peer {j} ({io}:{io + s}) run past the "
                           f"operand's {ops} rows")
            elif ld + rv > outs:
                bad.append(f"peer {r}'s {rows(rv)} from peer {j} land at {ld}:{ld + rv}, "
                           f"past the output buffer's {outs} rows (make the buffer larger: "
                           f"ragged_offsets(...).recv_total rows)")
    if bad:
        return (f"functp.ragged_all_to_all {at}: no row was sent (every rank of the axis "
                f"raises this): {'; '.join(bad[:4])}")
    if check_offsets:
        off = [f"peer {d} writes the rows from peer {s} at {col(d, 4, s)}, which "
               f"names {col(s, 3, d)} (its output_offsets[{d}])"
               for d in range(n) for s in range(n)
               if col(d, 1, s) and col(d, 4, s) != col(s, 3, d)]
        if off:
            return (f"functp.ragged_all_to_all {at}: recv_offsets differ from the senders' "
                    f"output_offsets: {'; '.join(off[:4])}; pass the plan's own recv_offsets "
                    f"(functp.ragged_offsets) or leave them out [FUNCTP_DEBUG check]")
    return None


def _check(operand, output, in_off, send, land, recv, g: AxisGroup) -> None:
    for j in range(g.size):
        if send[j] < 0 or recv[j] < 0 or in_off[j] < 0 or land[j] < 0:
            raise ShardingError(f"functp.ragged_all_to_all over {g.axes}: negative offset "
                                f"or size for peer {j}")
        if in_off[j] + send[j] > operand.shape[0]:
            raise ShardingError(
                f"functp.ragged_all_to_all over {g.axes}: the rows for peer {j} "
                f"({in_off[j]}:{in_off[j] + send[j]}) run past the operand's "
                f"{operand.shape[0]} rows (shape {tuple(operand.shape)})")
        if land[j] + recv[j] > output.shape[0]:
            raise ShardingError(
                f"functp.ragged_all_to_all over {g.axes}: the {recv[j]} rows from peer {j} "
                f"land at {land[j]}:{land[j] + recv[j]}, past the output buffer's "
                f"{output.shape[0]} rows (shape {tuple(output.shape)}); make the buffer "
                f"larger (ragged_offsets(...).recv_total rows)")
