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
"""
from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Sequence

import torch

from . import _context
from . import _ops
from . import _primitives as prim
from ._collectives import AxisName, _group, _need_tensor
from ..runtime import _crosscheck
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


def ragged_offsets(send_counts: Any, axis_name: AxisName) -> RaggedOffsets:
    """Plans a :func:`ragged_all_to_all` from how many rows this rank sends to each
    peer, its operand grouped by destination (peer 0's rows first) and every output
    filled from its start in source order.

    **Arguments:** ``send_counts`` – an int tensor or list of ``axis_size`` counts;
    ``axis_name`` – the mesh axis (or tuple) of the exchange.

    **Returns:** a :class:`RaggedOffsets`. One all-gather of the counts (``axis_size``
    squared ints) and **one host sync**, for the whole dispatch; none per expert.
    Example (inside a body; ``dest`` is each token's destination rank)::

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
    return RaggedOffsets(in_off, send, out_off, recv, recv_off, sum(recv))


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
    ``output_offsets`` are exchanged first (a small all-to-all).

    **Returns:** ``output`` with the received rows written (varying over the axis).
    Backward: the same exchange reversed (``operand``'s gradient gathered from the
    rows' destinations; ``output``'s gradient zero where rows landed). Host syncs:
    one for the sizes when any argument is a tensor or ``recv_offsets`` is missing;
    none with lists and ``recv_offsets`` (then the peers' sizes are exchanged and
    compared only in the check mode, ``FUNCTP_DEBUG=1``: a run the receiver does not
    expect cannot be seen without that exchange). Bad sizes (a run outside
    ``operand`` or ``output``, counts the peers do not agree on, ``recv_offsets``
    other than the senders' ``output_offsets``) raise ``ShardingError``; with the
    check mode on, on every rank. Example (2 ranks, rank 0 sends 1 row to rank 1)::

        out = functp.ragged_all_to_all(x, buf, [0, 0], [0, 1], [0, 2], [0, 0], "ep")
    """
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
    with _untracked(fr):
        in_off, send, out_off, recv, land = _sizes(args, recv_offsets, g)
    _check(operand, output, in_off, send, land, recv, g)
    tr = fr.tracker
    if tr is None:
        return ragged(operand, output, g.key, in_off, send, land, recv)
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


def _sizes(args, recv_offsets, g: AxisGroup):
    """The four JAX arguments and the landing offsets as Python ints, with at most one
    host sync (and one small all-to-all when the landing offsets are not given): each
    rank learns its peers' ``output_offsets`` and ``send_sizes`` for it."""
    n = g.size
    if recv_offsets is not None:
        recv_offsets = _ints(recv_offsets, n, "recv_offsets")
        if isinstance(recv_offsets, torch.Tensor):
            recv_offsets = recv_offsets.tolist()
    if (recv_offsets is not None and not _crosscheck.ENABLED
            and not any(isinstance(a, torch.Tensor) for a in args)):
        return (*args, recv_offsets)
    if recv_offsets is not None and _crosscheck.ENABLED:
        # the check mode: the sizes exchanged as without recv_offsets, and compared
        *sizes, land = _sizes(args, None, g)
        if land != [recv_offsets[j] if sizes[3][j] else land[j] for j in range(n)]:
            raise ShardingError(
                f"functp.ragged_all_to_all over {g.axes}: recv_offsets {recv_offsets} "
                f"(where rank {g.index} writes the rows from each peer) differ from the "
                f"peers' output_offsets for it, {land}; pass the plan's own recv_offsets "
                f"(functp.ragged_offsets) or leave them out [FUNCTP_DEBUG check]")
        return (*sizes, recv_offsets)
    mine = torch.stack([torch.as_tensor(a, dtype=torch.int64).reshape(-1) for a in args], 1)
    if recv_offsets is None:
        # row j (my send, output offset and recv for peer j) goes to peer j: each side
        # sees both ends of every pair, so a mismatch is an error on both ranks
        meta = mine[:, 1:4].contiguous()
        theirs = (prim._blocks_from_group_order(prim.all_to_all(meta, g, 0, 0), g)
                  if n > 1 else meta)
        both = torch.cat([mine, theirs], 1).tolist()         # the host sync
        in_off, send, out_off, recv = ([row[k] for row in both] for k in range(4))
        their_send, land, their_recv = ([row[k] for row in both] for k in range(4, 7))
        for j in range(n):
            if their_send[j] != recv[j] or their_recv[j] != send[j]:
                raise ShardingError(
                    f"functp.ragged_all_to_all over {g.axes}: rank {g.index} and peer {j} "
                    f"disagree on the rows between them: rank {g.index} sends {send[j]} and "
                    f"expects {recv[j]} (recv_sizes[{j}]), peer {j} sends {their_send[j]} and "
                    f"expects {their_recv[j]}; every send_sizes entry must equal the peer's "
                    f"recv_sizes entry for it (functp.ragged_offsets plans them)")
        return in_off, send, out_off, recv, land
    rows = mine.tolist()                                     # the host sync
    return (*([row[k] for row in rows] for k in range(4)), list(recv_offsets))


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
