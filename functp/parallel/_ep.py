"""Expert parallelism: the styles of a mixture-of-experts layer whose experts are split
over a mesh axis.

:class:`ExpertRouter` and :class:`ExpertParallel` keep every token on every rank (the
router renumbers the routes to this rank's experts, the partial outputs are summed);
:class:`ExpertDispatch` sends each (token, choice) pair to the rank holding its expert
and back, with one ragged all-to-all each way (or equal padded blocks), dropping pairs
over an expert's capacity when asked to; padded to capacity, with sizes that follow
from the shapes alone (no host read: the step compiles into one graph).
"""
from __future__ import annotations

import math
import threading
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ..ops._collectives import (all_gather, all_gather_invariant, all_to_all, axis_index,
                                axis_size, pvary)
from ..runtime import _compile, _world
from ..runtime._errors import ShardingError
from ..mesh._layout import chunk, uneven
from ..mesh._spec import P
# (ops layer, below the styles). The dispatch's sizes come from one all-gather of every
# rank's counts, so they agree by construction: the entry that does not check them again.
from ..ops._ragged import planned_ragged_all_to_all as ragged_all_to_all
from ._flat import gather_group
from ._style import Call, Layout, Style, _layout, register_style, relayout

__all__ = ["ExpertRouter", "ExpertParallel", "ExpertDispatch"]


def _num_experts(module: nn.Module, call: Call) -> int:
    n = getattr(module, "num_experts", None)
    if n is None:
        n = call.params["weight"].shape[0] if "weight" in call.params else None
    if n is None:
        raise ShardingError(
            f"style 'ep_router' on '{call.name}': cannot tell the number of experts; give "
            f"the router a `num_experts` attribute or a `weight` of shape [experts, hidden]")
    return int(n)


class ExpertRouter(Style):
    """The router of an expert-parallel MoE block whose tokens are replicated over
    the axis (tensor-parallel regions). Parameters are replicated; the last output
    (the top-k expert indices) is renumbered to this rank's experts, ``-1`` for an
    expert held elsewhere, so that the experts module computes only its own."""

    def prepare_output(self, module, args, kwargs, output, call):
        n, i = axis_size(call.axis), axis_index(call.axis)
        e = _num_experts(module, call)
        if uneven(e, n):
            raise ShardingError(
                f"style 'ep_router' on '{call.name}': {e} experts do not divide over "
                f"'{call.axis}' (size {n}); use a number of experts divisible by {n}")
        local = e // n
        idx = pvary(output[-1], call.axis) - i * local      # ints: differs per rank
        idx = idx.masked_fill((idx < 0) | (idx >= local), -1)
        return (*output[:-1], idx)


class ExpertParallel(Style):
    """Experts whose parameters are stacked on dimension 0 (``[experts, ...]``), split
    over the axis; tokens are replicated over it. With :class:`ExpertRouter`
    renumbering the routes, each rank applies its experts to the tokens routed to
    them and the partial outputs are summed: ``output_layout`` ``Replicate()``
    (all-reduce) or ``Shard(1)`` (reduce-scatter into a sequence-parallel region).

    Every rank already holds every token here, so this costs one all-reduce per MoE
    layer, like a row-parallel layer, with no token dispatch; use
    :class:`ExpertDispatch` when tokens are sharded over the axis.
    """

    def __init__(self, *, output_layout: Layout = Replicate()):
        self.output_layout = output_layout

    def param_specs(self, module, axis):
        return {n: P(axis) for n, _ in module.named_parameters(recurse=False)}

    def prepare_output(self, module, args, kwargs, output, call):
        return relayout(output, Partial(), _layout(self.output_layout, call.axis,
                                                   "ExpertParallel output_layout"), call.axis)


class ExpertDispatch(Style):
    """Expert parallelism over an axis that also shards the tokens (data parallel
    ranks that each hold some experts, as in GShard / DeepSpeed-MoE / Megatron).

    The experts module is called as ``experts(x, weights, indices)`` (functp's
    models) or ``experts(x, indices, weights)`` (transformers' experts modules) with
    ``x`` of shape ``[..., hidden]`` and global top-k ``indices`` (the router is
    replicated). The pre-hook sends every (token, choice) pair to the rank holding its
    expert with one :func:`functp.ragged_all_to_all`, grouped by expert; the experts
    run on exactly the rows they received (weight 1, local expert numbers); the
    post-hook sends the results back with a second one and combines them with the
    routing weights. Traffic is exact: the rows a rank sends are the pairs it routes.

    **Arguments:** ``capacity_factor`` – ``None`` (default): no pair is dropped. A
    number ``c``: each expert takes at most ``ceil(c * tokens * top_k / experts)``
    pairs from each rank, ``tokens`` this rank's tokens (Megatron-Core's
    ``moe_expert_capacity_factor``, computed on the local batch before dispatch);
    the others are dropped (their expert output is zero, as a residual layer
    passes the token on) and counted in ``dropped``. ``drop_policy``: which pairs an
    expert over capacity keeps: ``"probs"`` (the highest routing weights, Megatron's
    default) or ``"position"`` (the earliest tokens, as Switch Transformers).
    ``pad_to_capacity``: with a ``capacity_factor``, every expert receives exactly its
    capacity of rows from each rank, the unused ones zero (Megatron's
    ``moe_pad_expert_input_to_capacity``): the exchanges' and the experts' shapes no
    longer depend on the routing, and the sizes follow from the shapes alone (every
    rank of the axis holding as many tokens, as an even batch shard gives): no
    counts are exchanged and nothing is read on the host for them, so the step
    compiles into one graph (``torch.compile(fullgraph=True)``, CUDA graphs), at the
    price of sending and computing the padding: ``local experts x capacity`` rows to
    each peer, each way (and one flag row per peer forward: whether the sender
    routed a pair to no expert). Eagerly, a route to no expert is an error on every
    rank, read after the exchange; while ``torch.compile`` traces nothing is read,
    such a pair is dropped and ``dropped`` is not updated.
    ``dispatch``: ``"ragged"`` (default) or ``"padded"``: the earlier equal-block
    ``all_to_all`` that pads every (source, destination) block to the worst case
    (all of a rank's pairs to one destination; ``axis_size`` times the traffic of a
    balanced dispatch; kept for comparison). ``shared``: axes of the style's axis
    tuple over which the tokens are replicated (tensor-parallel ranks holding one
    batch): each of those ranks dispatches its slice of the tokens (``torch.chunk``'s
    blocks: a count that does not divide leaves the last slices shorter, or empty),
    and the outputs are gathered back, so that no token is computed twice
    (transformers' EP with ``tp_size > 1``). ``fsdp``: an axis (or axes) over which
    the experts' parameters are also sharded, on the expert dimension after the
    expert-parallel split (``P(("ep", "efsdp"))``), and all-gathered in the pre-hook
    (transformers' expert FSDP over ``efsdp``; the gradient comes back
    reduce-scattered); ``replicate``: axes over which those shards are replicated
    (HSDP's ``dp_replicate``), whose gradients are all-reduced on the shard.

    Host syncs: one per call, for the counts (one all-gather of ``axis_size x
    experts`` ints; padded to capacity: no all-gather, one read of the flags after
    the exchange, none under ``torch.compile``); none per expert.
    ``dropped[name]``: the pairs this rank dropped in the last call of the module
    ``name`` (per thread, so per simulated rank).

    Example (experts over ``ep``, tokens sharded over it)::

        plan = {"moe.experts": functp.ExpertDispatch(capacity_factor=1.25)}
        apply, params, specs = functp.parallelize(model, mesh, plan, axis="ep")
    """

    POLICIES = ("probs", "position")

    def __init__(self, *, capacity_factor: float | None = None, drop_policy: str = "probs",
                 dispatch: str = "ragged", shared: tuple[str, ...] = (),
                 fsdp: str | tuple[str, ...] | None = None, replicate: tuple[str, ...] = (),
                 pad_to_capacity: bool = False):
        if capacity_factor is not None and not capacity_factor > 0:
            raise ShardingError(f"ExpertDispatch: capacity_factor must be a positive number "
                                f"or None (no drops), got {capacity_factor!r}")
        if drop_policy not in self.POLICIES:
            raise ShardingError(f"ExpertDispatch: drop_policy must be one of {self.POLICIES}, "
                                f"got {drop_policy!r}")
        if dispatch not in ("ragged", "padded"):
            raise ShardingError(f"ExpertDispatch: dispatch must be 'ragged' or 'padded', got "
                                f"{dispatch!r}")
        if dispatch == "padded" and capacity_factor is not None:
            raise ShardingError("ExpertDispatch: the padded dispatch never drops; use "
                                "dispatch='ragged' with a capacity_factor")
        if pad_to_capacity and capacity_factor is None:
            raise ShardingError("ExpertDispatch: pad_to_capacity=True pads each expert's rows "
                                "to its capacity, which needs a capacity_factor (Megatron's "
                                "moe_expert_capacity_factor); give one, e.g. 1.0")
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.pad_to_capacity = pad_to_capacity
        self.dispatch, self.shared = dispatch, tuple(shared)
        self.fsdp = (fsdp,) if isinstance(fsdp, str) else tuple(fsdp or ())
        if replicate and not self.fsdp:
            raise ShardingError(f"ExpertDispatch: replicate={replicate!r} names the axes an "
                                f"FSDP shard is replicated over; give fsdp= too")
        self.replicate = (replicate,) if isinstance(replicate, str) else tuple(replicate)
        self._local = threading.local()

    def __repr__(self) -> str:
        extra = (f", fsdp={self.fsdp!r}, replicate={self.replicate!r}" if self.fsdp else "")
        extra += ", pad_to_capacity=True" if self.pad_to_capacity else ""
        return (f"ExpertDispatch(capacity_factor={self.capacity_factor!r}, drop_policy="
                f"{self.drop_policy!r}, dispatch={self.dispatch!r}, shared={self.shared!r}"
                f"{extra})")

    @property
    def dropped(self) -> dict[str, int]:
        if not hasattr(self._local, "dropped"):
            self._local.dropped = {}
        return self._local.dropped

    def param_specs(self, module, axis):
        # experts split on dimension 0 over the axis, then (FSDP) over ``fsdp``: a
        # rank's shard is a slice of its experts, as FSDP2's dim-0 shard of them
        dim0 = axis if not self.fsdp else (*(axis if isinstance(axis, tuple) else (axis,)),
                                           *self.fsdp)
        return {n: P(dim0) for n, _ in module.named_parameters(recurse=False)}

    def prepare_input(self, module, args, kwargs, call):
        x, a, b = args[:3]
        idx_at = 2 if a.is_floating_point() else 1     # transformers: (x, indices, weights)
        idx, weights = args[idx_at], args[3 - idx_at]
        hidden, k = x.shape[-1], idx.shape[-1]
        local = _gather_experts(self, module, call)
        tokens, idx = x.reshape(-1, hidden), idx.reshape(-1, k)
        weights = weights.reshape(-1, k)
        call.state["rows"] = []                # the rows at each shared axis, for the gather
        tokens, idx, weights = (_take_slice(t, self.shared, call) for t in (tokens, idx, weights))
        call.state.update(weights=weights, shape=x.shape, k=k)
        if self.dispatch == "padded":
            recv_x, recv_e = _padded_dispatch(tokens, idx.reshape(-1), local, call)
        else:
            recv_x, recv_e = _ragged_dispatch(self, tokens, idx.reshape(-1), weights.reshape(-1),
                                              local, call)
        n_experts = getattr(module, "num_experts", None)
        if isinstance(n_experts, int) and n_experts == local * axis_size(call.axis):
            # transformers' experts read their count from it (MoEParamShard sets it too)
            module.num_experts = local
            call.on_exit(lambda: setattr(module, "num_experts", n_experts))
        call.state["empty"] = recv_x.shape[0] == 0
        if call.state["empty"]:
            # one zero row for expert 0, dropped after: the experts' output stays
            # connected to the exchange and the parameters, so that this rank's
            # backward runs the same collectives as its peers' (as transformers does)
            recv_x, recv_e = recv_x.sum(0, keepdim=True), recv_e.new_zeros(1)
        ones = torch.ones(recv_x.shape[0], 1, dtype=weights.dtype)
        routed = (ones, recv_e.unsqueeze(1)) if idx_at == 2 else (recv_e.unsqueeze(1), ones)
        return (recv_x, *routed, *args[3:]), kwargs

    def prepare_output(self, module, args, kwargs, output, call):
        st = call.state
        for short, block in st.get("restore", {}).items():
            module._parameters[short] = block
        if st["empty"]:
            output = output[:0]
        if self.dispatch == "padded":
            back = all_to_all(output, call.axis, 0, 0, tiled=True)
            pairs = back[st["slot"]]
        else:
            plan, padded = st["plan"], self.pad_to_capacity
            if padded:      # (the return trip carries no flag rows: its own sizes)
                in_off, send, out_off, recv, recv_off = st["back"]
                back = ragged_all_to_all(output, output.new_zeros(st["sent_rows"],
                                                                  output.shape[1]),
                                         in_off, send, out_off, recv, call.axis,
                                         recv_offsets=recv_off)
                pairs = torch.nn.functional.pad(back, (0, 0, 0, 1))[st["slot"]]
            else:
                back = ragged_all_to_all(output, output.new_zeros(st["order"].numel(),
                                                                  output.shape[1]),
                                         plan.recv_off, plan.recv, plan.back_off, plan.send,
                                         call.axis, recv_offsets=plan.in_off)
                pairs = torch.zeros_like(back).index_copy(0, st["order"], back)
        w = st["weights"].unsqueeze(-1)
        out = (pairs.unflatten(0, (-1, st["k"])) * w).sum(1).to(output.dtype)
        return _gather_slice(out, self.shared, call).reshape(st["shape"])


def _gather_experts(style: ExpertDispatch, module, call) -> int:
    """FSDP: this rank's experts whole from their shards over ``fsdp`` (the module
    sees them until its forward returns); the number of this rank's experts."""
    blocks = call.params
    if style.fsdp:
        restore = call.state["restore"] = {}
        # one all-gather per dtype for all the experts' weights (one reduce-scatter
        # of their gradients); HSDP: the gradient all-reduced on the shard
        fulls = gather_group({s: (b, 0) for s, b in blocks.items()}, style.fsdp,
                             style.replicate)
        for short, full in fulls.items():
            restore[short] = module._parameters[short]
            module._parameters[short] = full
        return next(iter(blocks.values())).shape[0] * axis_size(style.fsdp)
    return next(iter(blocks.values())).shape[0]


def _ragged_dispatch(style: ExpertDispatch, tokens, idx, weights, local, call):
    """Every (token, choice) pair to the rank of its expert, grouped by expert, with
    one ragged all-to-all (after the capacity's drops, or padded to it)."""
    n = axis_size(call.axis)
    experts = n * local
    bad = (idx < 0) | (idx >= experts)                       # reported with the counts
    key = torch.where(bad, experts, idx)
    if style.pad_to_capacity:
        return _capacity_dispatch(style, tokens, key, weights, bad, local, call)
    if _compile.tracing():
        raise _compile.cannot_compile(
            f"ExpertDispatch on {call.name!r}: the ragged dispatch's sizes are every "
            f"rank's pairs per expert, read on the host (one all-gather of the counts), "
            f"which torch.compile cannot make one graph of. For a compiled step give "
            f"ExpertDispatch(capacity_factor=..., pad_to_capacity=True): the sizes then "
            f"follow from the shapes alone (capacity_factor=experts / top_k drops no "
            f"pair; 1.0 is Megatron's default); or compile without fullgraph=True (the "
            f"body then runs eagerly)")
    if style.capacity_factor is not None:     # dropped pairs sort last, and stay
        place, cap = _place(style, key, weights, experts)
        key = torch.where(place < cap, key, experts)
    order = torch.argsort(key, stable=True)                  # grouped by expert
    counts = torch.cat([torch.bincount(key, minlength=experts + 1)[:experts],
                        bad.sum().reshape(1)])
    plan = _expert_plan(counts, local, call)                 # the one host sync
    style.dropped[call.name] = idx.numel() - sum(plan.send)
    call.state.update(order=order, plan=plan)
    rows = tokens[torch.div(order, call.state["k"], rounding_mode="floor")]
    recv_x = ragged_all_to_all(rows, rows.new_zeros(plan.recv_total, tokens.shape[1]),
                               plan.in_off, plan.send, plan.out_off, plan.recv, call.axis,
                               recv_offsets=plan.recv_off)
    return recv_x, plan.recv_experts


def _capacity_dispatch(style: ExpertDispatch, tokens, key, weights, bad, local, call):
    """Pad to capacity, with sizes known before any value is: the pairs each expert
    keeps go to its ``cap`` rows of an ``experts x cap`` buffer (the dropped ones, and
    routes to no expert, to a last row, cut off), sent in blocks of ``local x cap``
    rows per peer, each followed by one flag row (1 where this rank routed a pair to
    no expert). Every peer's capacity follows from the shapes alone
    (:func:`_peer_capacities`), so nothing is exchanged or read on the host for the
    sizes, and the dispatch compiles into one graph (``torch.compile(fullgraph=True)``,
    CUDA graphs). Eagerly the flags and this rank's kept pairs are read once, after
    the exchange: a route to no expert is an error on every rank (every rank got
    every flag); while ``torch.compile`` or :func:`functp.estimate` traces nothing is
    read: such a pair is dropped, and ``dropped`` is not updated."""
    n = axis_size(call.axis)
    experts, hidden = n * local, tokens.shape[1]
    place, cap = _place(style, key, weights, experts)
    caps = _peer_capacities(style, call, key.numel() // call.state["k"], experts)
    me = axis_index(call.axis)
    assert caps[me] == cap, (caps, cap)           # (the same formula, on this rank's rows)
    kept = (place < cap) & (key < experts)
    slot = torch.where(kept, key * cap + place, experts * cap)
    rows = tokens[torch.div(torch.arange(key.numel()), call.state["k"],
                            rounding_mode="floor")]
    buf = tokens.new_zeros(experts * cap + 1, hidden).index_add(0, slot, rows)
    flag = bad.any().to(tokens.dtype).expand(n, 1, hidden)
    sent = torch.cat([buf[:experts * cap].reshape(n, local * cap, hidden), flag], 1)
    # forward: local x cap rows + 1 flag row to each peer; the return trip: the rows
    block = [local * c for c in caps]
    # (a peer's buffer holds its sources' runs in order: this rank's lands after
    # those of the ranks before it; back, its experts' block of the peer's buffer)
    fwd = _static_sizes([local * cap + 1] * n, [b + 1 for b in block],
                        [sum(block[:me]) + me] * n)
    call.state["back"] = _static_sizes(block, [local * cap] * n, [me * b for b in block])
    recv = ragged_all_to_all(sent.reshape(-1, hidden),
                             tokens.new_zeros(sum(block) + n, hidden), *fwd[:4], call.axis,
                             recv_offsets=fwd[4])
    starts = fwd[4]
    recv_x = torch.cat([recv.narrow(0, starts[s], block[s]) for s in range(n)])
    recv_e = torch.cat([torch.arange(local).repeat_interleave(c) for c in caps])
    call.state.update(plan=None, slot=slot, sent_rows=experts * cap)
    if _compile.tracing() or _world.dry_run() is not None:
        return recv_x, recv_e
    flags = torch.stack([recv[starts[s] + block[s], 0] for s in range(n)])
    *flags, kept_here = torch.cat([flags.ne(0).long(), kept.sum().reshape(1)]).tolist()
    style.dropped[call.name] = key.numel() - kept_here           # the one host sync
    if any(flags):
        raise ShardingError(
            f"ExpertDispatch on {call.name!r}: routing indices outside 0..{experts - 1} "
            f"({experts} experts, {local} on each of the {n} ranks of {call.axis!r}) on "
            f"ranks {[s for s, f in enumerate(flags) if f]} of {call.axis!r}; the router "
            f"must give global expert numbers")
    return recv_x, recv_e


def _static_sizes(send: list[int], recv: list[int], out_off: list[int]):
    """A ragged exchange's five size lists (in_off, send, out_off, recv, recv_off)
    from the rows to and from each peer, every run packed from its buffer's start
    in peer order, and where this rank's runs land in each peer's buffer."""
    return ([sum(send[:j]) for j in range(len(send))], send, out_off, recv,
            [sum(recv[:j]) for j in range(len(recv))])


def _peer_capacities(style: ExpertDispatch, call, tokens: int, experts: int) -> list[int]:
    """Every peer's capacity (in axis-index order) from the shapes alone: each rank
    of the axis holds as many tokens before the ``shared`` slicing as this one (an
    even shard of the batch: the check mode's boundary compares the shapes), so a
    peer's tokens are its ``torch.chunk`` slice of those at its own place along the
    shared axes, and its capacity Megatron's ``get_capacity`` of them."""
    axes = call.axis if isinstance(call.axis, tuple) else (call.axis,)
    sizes = [axis_size(a) for a in axes]
    rows0 = call.state["rows"][0] if call.state["rows"] else tokens
    caps = []
    for j in range(math.prod(sizes)):
        coord, rest = {}, j
        for a, size in zip(reversed(axes), reversed(sizes)):     # major first
            coord[a], rest = rest % size, rest // size
        rows = rows0
        for a in style.shared:
            rows = chunk(rows, axis_size(a), coord[a] if a in coord else axis_index(a))[1]
        caps.append(math.ceil(rows * call.state["k"] / experts * style.capacity_factor))
    return caps


def _place(style: ExpertDispatch, idx, weights, experts):
    """Each pair's place among its expert's pairs (by weight or position) and the
    capacity (Megatron's ``get_capacity``, on this rank's pairs): the pairs placed
    below it fit; ``idx`` is ``experts`` for a pair that names no expert."""
    cap = math.ceil(idx.numel() / experts * style.capacity_factor)
    order = torch.arange(idx.numel())
    if style.drop_policy == "probs":          # highest weight first within an expert
        order = torch.argsort(-weights.detach(), stable=True)
    order = order[torch.argsort(idx[order], stable=True)]
    # (bincount's length follows the values, a host read under torch.compile)
    counts = torch.zeros(experts + 1, dtype=idx.dtype).index_add_(0, idx, torch.ones_like(idx))
    start = counts.cumsum(0) - counts
    rank = torch.arange(idx.numel()) - start[idx[order]]     # place within its expert
    return torch.empty_like(rank).scatter_(0, order, rank), cap


class _ExpertPlan(NamedTuple):
    """A ragged dispatch's sizes (Python ints, per peer in axis-index order)."""
    in_off: list[int]       # where the rows for peer j start in this rank's sorted pairs
    send: list[int]         # pairs this rank sends to peer j
    out_off: list[int]      # where they land in peer j's buffer
    recv: list[int]         # pairs peer j sends here
    recv_off: list[int]     # where they land here
    back_off: list[int]     # where the results for peer j land in its sorted pairs
    recv_total: int
    recv_experts: torch.Tensor     # the local expert of every received row


def _expert_plan(counts: torch.Tensor, local: int, call: Call) -> _ExpertPlan:
    """Every rank's pairs per expert, and its count of routes to no expert (one
    all-gather, one host sync) -> the sizes of the dispatch and of its return, and
    each received row's local expert. A bad route is an error on every rank."""
    axis = call.axis
    n, me = axis_size(axis), axis_index(axis)
    table = all_gather(counts, axis).tolist()     # [source][expert] + [bad routes, ...]
    bad = {s: row[n * local] for s, row in enumerate(table) if row[n * local]}
    if bad:
        raise ShardingError(
            f"ExpertDispatch on {call.name!r}: routing indices outside 0..{n * local - 1} "
            f"({n * local} experts, {local} on each of the {n} ranks of {axis!r}): "
            f"{sum(bad.values())} (token, choice) pairs on ranks {sorted(bad)} of {axis!r}; "
            f"the router must give global expert numbers")
    per_dest = [[sum(row[j * local:(j + 1) * local]) for j in range(n)] for row in table]
    send = per_dest[me]
    recv = [per_dest[s][me] for s in range(n)]

    def starts(sizes):
        return [sum(sizes[:j]) for j in range(len(sizes))]
    mine = [c for s in range(n) for c in table[s][me * local:(me + 1) * local]]
    experts = torch.arange(local).repeat(n).repeat_interleave(
        torch.tensor(mine, dtype=torch.int64), output_size=sum(recv))
    return _ExpertPlan(starts(send), send, [sum(per_dest[s][j] for s in range(me))
                                            for j in range(n)],
                       recv, starts(recv), [starts(per_dest[s])[me] for s in range(n)],
                       sum(recv), experts)


def _padded_dispatch(tokens, idx, local, call):
    """Equal blocks of the worst case: every (source, destination) block holds all of
    a rank's pairs; slots no pair fills carry expert ``-1``."""
    n, hidden, k = axis_size(call.axis), tokens.shape[-1], call.state["k"]
    dest = torch.div(idx, local, rounding_mode="floor")
    cap = idx.numel()
    onehot = torch.nn.functional.one_hot(dest, n)
    pos = (onehot.cumsum(0) - 1).gather(1, dest.unsqueeze(1)).squeeze(1)
    slot = dest * cap + pos
    send_x = tokens.new_zeros(n * cap, hidden).index_put(
        (slot,), tokens.repeat_interleave(k, dim=0))
    send_e = torch.full((n * cap,), -1, dtype=idx.dtype).index_put((slot,), idx % local)
    call.state["slot"] = slot
    return (all_to_all(send_x, call.axis, 0, 0, tiled=True),
            all_to_all(send_e, call.axis, 0, 0, tiled=True))


def _take_slice(t: torch.Tensor, shared: tuple[str, ...], call: Call) -> torch.Tensor:
    """This rank's slice of rows replicated over ``shared`` (Replicate -> Shard(0)), in
    ``torch.chunk``'s blocks: ``ceil(rows / n)`` each, the last ones shorter (or
    empty) when ``n`` does not divide the rows, as DTensor's ``Shard(0)``."""
    record = len(call.state["rows"]) < len(shared)
    for a in shared:
        n, i = axis_size(a), axis_index(a)
        rows = t.shape[0]
        if record:
            call.state["rows"].append(rows)
        t = (pvary(t, a) if t.is_floating_point() else t).narrow(0, *chunk(rows, n, i))
    return t


def _gather_slice(t: torch.Tensor, shared: tuple[str, ...], call: Call) -> torch.Tensor:
    """The inverse of :func:`_take_slice`: every rank's slice, each padded to the
    chunk for an equal-block gather, the padding cut off after (its gradient is
    never used)."""
    for a, rows in zip(reversed(shared), reversed(call.state["rows"])):
        first = chunk(rows, axis_size(a), 0)[1]          # the largest block
        t = torch.nn.functional.pad(t, (0, 0, 0, first - t.shape[0]))
        t = all_gather_invariant(t, a, axis=0, tiled=True).narrow(0, 0, rows)
    return t


for _name, _style in {
    "ep_router": ExpertRouter(),
    "ep_experts": ExpertParallel(),
    "ep_experts_sp": ExpertParallel(output_layout=Shard(1)),     # into a sequence-parallel region
    "ep_experts_all_to_all": ExpertDispatch(),
}.items():
    register_style(_name, _style)
