"""Which gradients travel together: a body's gradient buckets, the same on every rank
of a group (``_overlap``'s :class:`~functp.ops._overlap.Sink` fills and launches them).

The buckets must not depend on the order in which a rank used its inputs (experts run
in the order their tokens arrive), nor on whether it used them at all, or two ranks
would pair different gradients in one all-reduce. So they are cut per group (by its
axes) and dtype from the inputs' own order (reversed, as DDP cuts them from the
parameters': the last used fill first), ``bucket_mb`` each (or less, so that a dtype's
gradients make ``min_buckets``: :func:`bucket_bytes`), the first ``first_bucket_mb``; a
group's ranks compare their layouts (count and hash of the inputs' shapes and dtypes)
once per layout, before its first bucket launches. After a
layout's first backward the buckets follow the order the group's first rank got its
gradients in then (agreed in one all-gather, as DDP rebuilds its buckets once); from
then on they are known at the body's entry, so that each bucket is one launch point.
A group's buckets depend on its own layout and order alone: its ranks cut the same
ones whatever other groups each of them sends gradients over.
"""
from __future__ import annotations

import zlib

import torch

from . import _primitives as prim
from ..mesh._mesh import group_of
from ..runtime import _world
from ..runtime._errors import ShardingError
from ..runtime._torch_compat import DisableFuncTorch, c10d_functional as _c10d


def bucket_bytes(total: int, cfg: dict) -> float:
    """A bucket's size (after the first) for a stream of ``total`` bytes of gradients:
    ``bucket_mb``, or less, so that the stream makes ``min_buckets`` of them, but not
    less than ``first_bucket_mb``. DDP's 25 MiB buckets hold a small model's gradients
    in one bucket, launched when the backward is nearly over: two hosts, 8 x
    Linear(1024) (32 MiB), gained nothing from the overlap (DDP 0.99-1.04x the
    unbucketed step); buckets of an eighth of it gave 0.83-0.94x
    (benchmarks/README.md, issue 55), and a large model's are DDP's still."""
    mib = 2**20
    return min(cfg["bucket_mb"] * mib,
               max(cfg["first_bucket_mb"] * mib, total / cfg["min_buckets"]))


# a tensor's vma tag, (run, axes): ``_vma._TAG`` (``_vma`` imports this, through ``_overlap``)
_VMA = "_functp_vma"

# the agreed arrival orders: (rank, group key, layout) -> (pin, [inputs]), first come
# first. A rank is a process (None) or a simulated one: (run, rank, program), the
# program told apart by the run's state list, made anew by each simulate() of a
# reused run and pinned by the entry (so that its id is not reused): a program never
# sees an order its peers' earlier programs agreed on, which they may not hold
_orders: dict = {}
REBUILD = True      # False: the inputs' order always (benchmarks/overlap.py compares)


def _whose():
    run = _world._local.run       # (an attribute, not current_run(): a call per step)
    if run is None:
        return None, None
    return (run.id, _world._local.rank, id(run.state)), run.state


class Buckets:
    """The bucket layout of one body's entry: its inputs (shape, dtype, device, size),
    the ones each group's stream holds, and the plan cut from them at a backward.

    A group's stream holds every input replicated over its axes (each of them has an
    alias over it), so an input this rank did not use (an expert no token reached)
    still has its place, its gradient sent as zeros, as DDP's
    ``find_unused_parameters`` does. A group takes part once some input used its
    alias here; its peers, holding the same data or the same program, do too."""

    def __init__(self, local: list, paths: list) -> None:
        # (read in the forward: the backward may run in another thread)
        self.whose, self.pin = (None, None) if _world._local.run is None else _whose()
        self.paths = paths      # each input's pytree path among the body's arguments
        self.meta = [(x.shape, x.dtype, x.device, x.nbytes) for x in local]
        self.members: dict = {}  # group key -> the inputs replicated over its axes
        self.fresh: dict = {}    # group key -> its layout, where no order is agreed yet

    def members_of(self, key: str, tags: list) -> list:
        """The inputs among the entry's outputs ``tags`` (None: gone) replicated over
        group ``key``'s axes: its stream."""
        axes = group_of(key).axis_set
        return [i for i, y in enumerate(tags) if y is not None
                and _VMA in y.__dict__ and not axes & y.__dict__[_VMA][1]]

    def enrol(self, key: str, tags: list) -> None:
        """Group ``key`` takes part in this backward's plan (:meth:`plan`)."""
        self.members[key] = self.members_of(key, tags)

    def agreed(self, key: str, members: list) -> list | None:
        """The order agreed for group ``key``'s layout at an earlier backward (None:
        none yet, or ``REBUILD`` off)."""
        if not REBUILD:
            return None
        return _orders.get((self.whose, key, self.layout_of(members)), (None, None))[1]

    def layout_of(self, members: list) -> tuple:
        """What a group's ranks agree on: each member's position, shape and dtype."""
        return tuple((j,) + self.meta[j][:2] for j in members)

    def plan(self, cfg: dict) -> list:
        """``[(group key, [inputs])]`` of the enrolled groups, each group's buckets in
        launch order (:meth:`cut`, in the order agreed for its layout, or the inputs'
        own order the first time). The first time, the group's ranks check that they
        hold the same layout before anything is launched (not under functp.estimate:
        it predicts a later step, and its ranks have no peers to ask)."""
        self.fresh, plan = {}, []
        for _, key in sorted((group_of(k).axes, k) for k in self.members):
            members = self.members[key]
            order = self.agreed(key, members)
            if order is None and _world.dry_run() is None:
                layout = self.layout_of(members)
                _agree_layout(key, layout, self.meta, self.paths)
                self.fresh[key] = layout
            plan += [(key, js) for js in self.cut(members, order, cfg)]
        return plan

    def cut(self, members: list, order: list | None, cfg: dict) -> list:
        """One group's buckets (``[[inputs]]``) in launch order, the same on every rank
        of it: per dtype, its inputs (``members``) in the ``order`` agreed for it (the
        order its first rank's gradients came in at the first backward) or, without
        one, last to first, cut at ``bucket_mb``; the stream holding the last input
        cut at ``first_bucket_mb`` first (DDP's small first bucket, launched early).
        Streams interleaved: each one's first buckets first."""
        by_dtype: dict = {}
        for j in order or reversed(members):
            by_dtype.setdefault(str(self.meta[j][1]), []).append(j)
        streams = [js for _, js in sorted(by_dtype.items())]
        # (a group's own: its buckets depend on nothing but its layout and order)
        lead = max(range(len(streams)), key=lambda s: max(streams[s]), default=0)
        plan = []
        for s, js in enumerate(streams):
            cur, size, start, prev = [], 0, len(plan), 0
            rest = bucket_bytes(sum(self.meta[j][3] for j in js), cfg)
            lim = cfg["first_bucket_mb"] * 2**20 if s == lead else rest
            for j in js:
                cur.append(j)
                size += self.meta[j][3]
                if size >= lim:
                    plan.append(cur)
                    cur, size, prev, lim = [], 0, lim, rest
            # (half the bucket it would join: the first, small, bucket leaves early and
            # keeps to itself what is not small beside it)
            if cur and size < prev / 2 and len(plan) > start:
                plan[-1].extend(cur)       # (a small remainder, e.g. the first input's
            elif cur:                      # bias, rides with the stream's bucket before it)
                plan.append(cur)
            for b in range(start, len(plan)):     # (a stream's buckets keep their order)
                plan[b] = (b - start, plan[b])
        plan.sort(key=lambda b: (b[0], -min(b[1])) if order else -min(b[1]))
        return [js for _, js in plan]

    def agree_order(self, arrived: list) -> None:
        """After a group's first backward (``arrived``: (input, group key) in the order
        their gradients came): the order they came in on its first rank, taken by
        every rank of it for its later backwards (as DDP rebuilds its buckets once):
        one all-gather per group and layout."""
        for _, key in sorted((group_of(k).axes, k) for k in self.fresh):
            members = self.members[key]
            came = [j for j, k in arrived if k == key]
            seen = set(came)
            mine = came + [j for j in reversed(members) if j not in seen]
            rows = _gather_ints(mine, key, self.meta[members[0]][2])
            if self.whose is not None:   # (a simulated rank: its earlier programs' go)
                for k in [k for k in _orders if k[0] is not None
                          and k[0][:2] == self.whose[:2] and k[0] != self.whose]:
                    del _orders[k]
            _orders[(self.whose, key, self.fresh[key])] = (self.pin, [int(j) for j in rows[0]])


_LAYOUT = "all_gather of their layout, before the gradient buckets' all_reduce(sum)"


def _gather_ints(values: list, key: str, device, op: str = _LAYOUT) -> torch.Tensor:
    """Every rank's ``values`` (as many on each) over the group ``key``, on
    ``device`` (the group's backend's): ``[group size, len(values)]`` in
    process-group rank order. ``op``: the exchange, as a failed wait names it (a
    peer gone or late: by default the bucket all-reduce it precedes)."""
    g = group_of(key)
    with DisableFuncTorch(), torch.no_grad():
        t = torch.tensor(values, dtype=torch.int64, device=device)
        out = prim._wait(_c10d.all_gather_into_tensor(t, g.size, g.group_name), op, g)
    return out.view(g.size, len(values)).cpu()


def _describe(entry: tuple) -> str:
    return f"{entry[1]} {tuple(entry[0])}"


def _agree_layout(key: str, layout: tuple, meta: list, paths: list) -> None:
    """The group's ranks compare the inputs their gradient buckets hold (position,
    shape and dtype of each), once per layout, before the first bucket is launched:
    ranks given different parameters would pair different gradients, or abort in the
    backend on unequal bucket sizes. Raises, on every rank of the group, naming the
    first input that differs."""
    crcs = [zlib.crc32(repr(e).encode()) for e in layout]
    device = meta[layout[0][0]][2]
    rows = _gather_ints([len(layout), zlib.crc32(repr(crcs).encode())], key, device)
    if bool((rows == rows[0]).all()):
        return
    g = group_of(key)
    at = {g.group_rank(i): i for i in range(g.size)}      # process-group rank -> index
    counts = [int(c) for c in rows[:, 0]]
    width = max(counts)
    table = _gather_ints(crcs + [-1] * (width - len(crcs)), key, device)
    k = next(c for c in range(width) if not bool((table[:, c] == table[0, c]).all()))
    differ = sorted(at[r] for r in range(g.size) if int(table[r, k]) != int(table[0, k]))
    mine = (f"{paths[layout[k][0]]} ({_describe(meta[layout[k][0]][:2])})"
            if k < len(layout) else f"missing (it has {len(layout)})")
    raise ShardingError(
        f"shard_map gradient buckets over {g.axes}: the ranks' bodies were given "
        f"different replicated floating inputs: position {k + 1} of them differs at "
        f"indices {differ} along {g.axes} from index {at[0]}; here (index {g.index}) "
        f"it is {mine}; inputs per index: "
        f"{[counts[g.group_rank(i)] for i in range(g.size)]}. Pass every rank the same "
        f"parameters (names, shapes, dtypes) in the same pytree")
