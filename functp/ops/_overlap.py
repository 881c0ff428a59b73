"""Gradient collectives in flight during the backward: buckets launched as soon as
their gradients are complete, waited on once the rest of the backward is done.

A top-level shard_map body's floating inputs that need gradients pass through one
``functp::overlap_entry`` op on the way in (:func:`enter`). It is an identity whose
autograd node is made before any of the body's, and the engine runs ready nodes
latest-made first, so its backward runs after the body's whole backward, just before
the gradients leave the body. That is where the launched collectives are waited on.

Launch points:

- a replicated input's vma alias (the ``pvary`` whose transpose is the gradient
  all-reduce) passes, at its first use in the body, through ``functp::grad_ready``
  (:func:`ready_point`). Made there, its node runs as soon as that gradient is
  complete; its backward adds the gradient to its bucket. The buckets are cut from
  the inputs' order (reversed, per group and dtype: ``bucket_mb`` each, the first
  ``first_bucket_mb``, as DDP does) at a layout's first backward, and from then on
  from the order the group's first rank got its gradients in then (agreed in one
  all-gather, as DDP rebuilds its buckets once), never from the order each rank
  uses them in; launched in that order, each once its gradients are in (a gradient
  this rank will not send counts as zeros): every rank pairs the same inputs (see
  :class:`Sink`). A group's ranks compare their layouts (count and hash of the
  inputs' shapes and dtypes) once per layout, before its first bucket launches.
- an ``all_gather`` of such an input (FSDP): the reduce-scatter of its backward is
  launched there and waited on at the entry (``_ops._ag_bwd`` asks the input's sink).

A deferred result is not passed on as the launch point's gradient (the engine could
read it at once, adding it to another contribution); it is kept by the entry's
:class:`Sink` and added to the input's gradient after the wait. Only a backward that
nothing differentiates further (tape ``backward()``/``autograd.grad`` without
``create_graph``, one ``torch.func.grad``) defers, and only while the engine will run
the entry node; otherwise each collective is waited on at once, as before. The
values are those of the single bucketed all-reduce made otherwise (an all-reduce sums
each element over the ranks alone, whatever the bucket it travels in). Not inside
``torch.compile`` (inductor schedules its own collectives), nor under ``vmap``, nor
for a body whose gradients fit in the first bucket (they would leave together anyway).
"""
from __future__ import annotations

import itertools
import threading
import weakref
import zlib

import torch

from . import _context, _lazy
from . import _ops
from . import _primitives as prim
from ..mesh._mesh import group_of
from ..runtime import _compile, _world
from ..runtime._errors import ShardingError
from ..runtime._torch_compat import (DisableFuncTorch, FakeTensor, TransformGrad,
                                     c10d_functional as _c10d, layer_stack_depth,
                                     peek_interpreter_stack, will_engine_execute_node)

__all__ = ["set_overlap"]

SINK = "_functp_sink"          # an entry output's __dict__ key: (its Sink, its index)
# the inputs that may get a sink (a fake one: functp.estimate's tape step, as its real
# run; torch.compile's fakes are turned away by _compile.tracing())
_TENSORS = (torch.Tensor, torch.nn.Parameter, FakeTensor)
_READY = "_functp_ready"       # a grad_ready output's: made once per alias
_VMA = "_functp_vma"           # a tensor's vma tag, (run, axes) (``_vma``, which imports this)

# the settings, read at each launch: the process's, or a simulated rank's own (set in
# its thread, as a process under torchrun sets its own)
_settings = {"enabled": True, "bucket_mb": 25.0, "first_bucket_mb": 1.0, "forward": True}


class _Rank(threading.local):
    values: dict | None = None
    # the pytree paths of the inputs of the body being entered (set by shard_map
    # before its boundary rules call :func:`enter`): errors name an input by them
    paths: list | None = None


_rank = _Rank()


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


def _get() -> dict:
    v = _rank.values
    return _settings if v is None else v


def set_overlap(enabled: bool | None = None, bucket_mb: float | None = None,
                first_bucket_mb: float | None = None, forward: bool | None = None) -> dict:
    """Sets how a shard_map body's communication overlaps its computation: the
    gradients of its replicated inputs are reduced during the backward (functp
    launches each bucket's all-reduce as soon as its gradients are complete, and
    waits at the end of the body's backward), and its forward collectives are waited
    on at the first use of their result.

    **Arguments:** ``enabled`` – False: one all-reduce after the body's backward, and
    every collective waited on at once (the behaviour before overlap); ``bucket_mb`` –
    a bucket's size in MiB (DDP's ``bucket_cap_mb``, 25 by default);
    ``first_bucket_mb`` – the first bucket's (1 MiB: launched early, as DDP's first
    bucket); ``forward`` – False: forward collectives (``psum``, ``all_gather``...)
    waited on at once (True by default). None leaves a setting as it is.
    Set it alike on every rank (inside :func:`functp.simulate`, a rank's call sets its
    own, as a process's would).

    **Returns:** the previous settings, as a dict (``set_overlap(**prev)`` restores).
    Example::

        prev = functp.set_overlap(bucket_mb=4.0)
        grads = torch.func.grad(step)(params, batch)   # 4 MiB gradient buckets
        functp.set_overlap(**prev)
    """
    prev = dict(_get())
    new = dict(prev)
    for k, v in (("enabled", enabled), ("bucket_mb", bucket_mb),
                 ("first_bucket_mb", first_bucket_mb), ("forward", forward)):
        if v is not None:
            flag = k in ("enabled", "forward")
            if not flag and not v > 0:
                raise ValueError(f"functp.set_overlap: {k} must be > 0 MiB, got {v!r}")
            new[k] = bool(v) if flag else float(v)
    rank = _world.current_run() is not None     # a simulated rank: its own settings
    if rank:
        _rank.values = new
    else:
        _settings.update(new)
    _lazy.set_forward(new["enabled"] and new["forward"], rank)
    return prev


def _level_ok() -> bool:
    """Tape autograd, or one torch.func.grad level: where a deferred gradient can wait
    for the entry node (vmap batches it, compile schedules it itself)."""
    interp = peek_interpreter_stack()
    if interp is None:
        return True
    return layer_stack_depth() == 1 and interp.key() == TransformGrad


class Sink:
    """The backward state of one body's entry: its gradient buckets, launched
    collectives, and the results each input's gradient still gets.

    The buckets do not depend on the order in which a rank used its inputs (experts
    run in the order their tokens arrive), nor on whether it used them at all: they
    are cut from the inputs' own order (reversed, as DDP cuts them from the
    parameters': the last used fill first), per group and dtype, and launched in that
    order. A group's stream holds every input replicated over its axes (each of them
    has an alias over it), so an input this rank did not use (an expert no token
    reached) adds a zero gradient, as DDP's ``find_unused_parameters`` does, and the
    all-reduce pairs the same inputs on every rank. A group takes part once some input
    used its alias here; its peers, holding the same data or the same program, do too."""

    def __init__(self, local: list, paths: list) -> None:
        # (read in the forward: the backward may run in another thread)
        self.whose, self.pin = (None, None) if _world._local.run is None else _whose()
        self.n = len(local)
        self.paths = paths      # each input's pytree path among the body's arguments
        self.node = None        # the entry's autograd node
        self.outs: list = []    # weak references to the entry's outputs (their vma tags)
        self.meta = [(x.shape, x.dtype, x.device, x.nbytes) for x in local]
        self.members: dict = {}  # group key -> the inputs replicated over its axes
        self.nodes: dict = {}    # group key -> {input: its grad_ready node}
        self.reset()

    def reset(self) -> None:
        self.extra: list = [[] for _ in range(self.n)]   # per input: deferred results
        self.pending: list = []       # prim.Pending, in launch order
        self.deferring = None         # decided at this backward's first gradient
        self.got: dict = {}           # (input, group key) -> its gradient (None: zero)
        self.plan = None              # [(group key, [inputs])], in launch order
        self.left: list = []          # per bucket: gradients still to come
        self.where: dict = {}         # (input, group key) -> its bucket
        self.next = 0                 # the next bucket to launch
        self.arrived: list = []       # (input, group key) in the order their gradients came
        self.fresh: dict = {}         # group key -> its layout, where no order is agreed yet

    def ready(self, j: int, key: str, node) -> None:
        """In the forward: input ``j``'s alias over group ``key`` got its launch point
        ``node``; the first one of a group enrols every input replicated over it."""
        if key not in self.members:
            axes = group_of(key).axis_set
            tags = [r() for r in self.outs]
            self.members[key] = [i for i, y in enumerate(tags) if y is not None
                                 and _VMA in y.__dict__ and not axes & y.__dict__[_VMA][1]]
            self.nodes[key] = {}
        self.nodes[key][j] = node

    def _defers(self, ct: torch.Tensor | None) -> bool:
        if ct is None:      # (no gradient reached this rank's launch points)
            return (_level_ok() and will_engine_execute_node(self.node)
                    and (not torch.is_grad_enabled() or peek_interpreter_stack() is not None))
        return (not _ops._differentiated(ct) and _level_ok()
                and will_engine_execute_node(self.node))

    def defer(self, j: int, ct: torch.Tensor, launch) -> bool:
        """Launches ``launch()`` (a collective of ``ct``, the gradient of input ``j``)
        without waiting, its result added to input ``j``'s gradient at the entry;
        False (nothing launched) where this backward cannot defer."""
        if not self._defers(ct):
            return False
        with prim.deferring() as pending:
            out = launch()
        self.pending.extend(pending)
        self.extra[j].append(out)
        return True

    def add(self, j: int, key: str, ct: torch.Tensor | None) -> bool:
        """Input ``j``'s gradient ``ct`` through its alias over group ``key`` (None: no
        gradient came) joins its bucket, launched once it and every bucket before it
        are complete; False where this backward cannot defer (``ct`` is passed on)."""
        if self.deferring is None:
            if ct is None:
                self.got[(j, key)] = None     # (counted once the plan is made)
                return True
            self.deferring = self._defers(ct)
            if self.deferring:
                self._layout()
        if not self.deferring:
            return False
        slot = (j, key)
        if slot not in self.got:
            self.got[slot] = ct
            self.arrived.append(slot)
            self.left[self.where[slot]] -= 1
            self._advance()
        return True

    def _layout(self) -> None:
        """The buckets (:meth:`_cut`, in the order agreed for each group's layout, or
        the inputs' own order the first time); the gradients no node of this backward
        will send counted as zeros at once. The first time, the group's ranks check
        that they hold the same layout before anything is launched (not under
        functp.estimate: it predicts a later step, and its ranks have no peers to ask)."""
        orders = {}
        for _, key in sorted((group_of(k).axes, k) for k in self.members):
            layout = tuple((j,) + self.meta[j][:2] for j in self.members[key])
            order = _orders.get((self.whose, key, layout), (None, None))[1]
            if order is not None:
                orders[key] = order
            elif _world.dry_run() is None:
                _agree_layout(key, layout, self.meta, self.paths)
                self.fresh[key] = layout
        plan = self._cut(_get(), orders if REBUILD else None)
        self.plan, self.left = plan, [len(js) for _, js in plan]
        for b, (key, js) in enumerate(plan):
            nodes = self.nodes[key]
            for j in js:
                self.where[(j, key)] = b
                node = nodes.get(j)
                if (j, key) in self.got or node is None or not will_engine_execute_node(node):
                    self.got[(j, key)] = None
                    self.left[b] -= 1
        self._advance()

    def _cut(self, cfg: dict, orders: dict | None = None) -> list:
        """``[(group key, [inputs])]`` in launch order, the same on every rank of a
        group: per group (by its axes) and dtype, the inputs in the order agreed for
        the group (``orders``: the order rank 0's gradients came in at the first
        backward) or, without one, last to first, cut at ``bucket_mb``; the bucket
        whose last gradient comes soonest first."""
        orders = orders or {}
        streams, lead_of = [], []
        for _, key in sorted((group_of(k).axes, k) for k in self.members):
            by_dtype: dict = {}
            for j in orders.get(key) or reversed(self.members[key]):
                by_dtype.setdefault(str(self.meta[j][1]), []).append(j)
            streams += [(key, js) for _, js in sorted(by_dtype.items())]
            lead_of += [max(js) for _, js in sorted(by_dtype.items())]
        # the first bucket (DDP's small one, launched early) is that of the stream whose
        # gradients come first: the one holding the last input
        lead = max(range(len(streams)), key=lambda s: lead_of[s], default=0)
        plan = []
        for s, (key, js) in enumerate(streams):
            cur, size, start, prev = [], 0, len(plan), 0
            lim = (cfg["first_bucket_mb"] if s == lead else cfg["bucket_mb"]) * 2**20
            for j in js:
                cur.append(j)
                size += self.meta[j][3]
                if size >= lim:
                    plan.append((key, cur))
                    cur, size, prev, lim = [], 0, lim, cfg["bucket_mb"] * 2**20
            # (half the bucket it would join: the first, small, bucket leaves early and
            # keeps to itself what is not small beside it)
            if cur and size < prev / 2 and len(plan) > start:
                plan[-1][1].extend(cur)    # (a small remainder, e.g. the first input's
            elif cur:                      # bias, rides with the stream's bucket before it)
                plan.append((key, cur))
            for b in range(start, len(plan)):     # (a stream's buckets keep their order)
                plan[b] = (key, plan[b][1], b - start)
        # streams interleaved: each one's first buckets first (ties: the inputs' order)
        plan.sort(key=lambda b: (b[2], -min(b[1])) if orders else -min(b[1]))
        return [(key, js) for key, js, _ in plan]

    def _advance(self) -> None:
        while self.next < len(self.plan) and self.left[self.next] == 0:
            self._launch(*self.plan[self.next])
            self.next += 1

    def _launch(self, key: str, js: list) -> None:
        cts = []
        for j in js:
            ct = self.got[(j, key)]
            self.got[(j, key)] = None     # (the bucket holds it now: freed once sent)
            if ct is None:
                shape, dtype, device, _ = self.meta[j]
                ct = torch.zeros(shape, dtype=dtype, device=device)
            cts.append(ct)
        with prim.deferring() as pending:
            summed = _ops.bucketed_psum(cts, key, False)
        self.pending.extend(pending)
        for j, s in zip(js, summed):
            self.extra[j].append(s)

    def finish(self, cts) -> list:
        """At the entry's backward: the buckets not yet launched launched (with zeros
        for the gradients that never came), every deferred collective waited on (in
        launch order), each input's gradient with its results added."""
        try:
            if self.deferring is None and self.members:
                self.deferring = self._defers(next((c for c in cts if c is not None), None))
                if self.deferring:
                    self._layout()
            if self.deferring:
                while self.next < len(self.plan):
                    self._launch(*self.plan[self.next])
                    self.next += 1
            _wait_all(self.pending)
            if self.deferring and self.fresh:
                self._agree_order()
            grads = []
            for ct, extra in zip(cts, self.extra):
                for t in extra:
                    ct = t if ct is None else ct + t
                grads.append(ct)
            return grads
        finally:
            self.reset()      # (a retained graph's next backward starts afresh)


    def _agree_order(self) -> None:
        """After a group's first backward: the order its gradients came in on its
        first rank, taken by every rank of it for its later backwards (as DDP
        rebuilds its buckets once): one all-gather per group and layout."""
        for _, key in sorted((group_of(k).axes, k) for k in self.fresh):
            members = self.members[key]
            came = [j for j, k in self.arrived if k == key]
            seen = set(came)
            mine = came + [j for j in reversed(members) if j not in seen]
            rows = _gather_ints(mine, key, self.meta[members[0]][2])
            if self.whose is not None:   # (a simulated rank: its earlier programs' go)
                for k in [k for k in _orders if k[0] is not None
                          and k[0][:2] == self.whose[:2] and k[0] != self.whose]:
                    del _orders[k]
            _orders[(self.whose, key, self.fresh[key])] = (self.pin, [int(j) for j in rows[0]])


def _gather_ints(values: list, key: str, device) -> torch.Tensor:
    """Every rank's ``values`` (as many on each) over the group ``key``, on
    ``device`` (the group's backend's): ``[group size, len(values)]`` in
    process-group rank order."""
    g = group_of(key)
    with DisableFuncTorch(), torch.no_grad():
        t = torch.tensor(values, dtype=torch.int64, device=device)
        # (a peer gone or late: named as the bucket all-reduce it precedes)
        out = prim._wait(_c10d.all_gather_into_tensor(t, g.size, g.group_name),
                         "all_gather of their layout, before the gradient buckets' "
                         "all_reduce(sum)", g)
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


def _wait_all(pending: list) -> None:
    """Waits on each, in order; the first failure is the step's error, the later ones
    are waited on too (they fail at once on a broken group), so that none is left
    registered with c10d as never waited on."""
    for i, p in enumerate(pending):
        try:
            p.wait()
        except Exception:
            for q in pending[i + 1:]:
                try:
                    q.wait()
                except Exception:       # noqa: BLE001 - reported: the first
                    pass
            raise


# The ops take an int token for their Sink (a schema has no place for an object);
# the token is dropped once the op has run.
_tokens = itertools.count()
_by_token: dict[int, tuple] = {}
_lock = threading.Lock()


def _put(value) -> int:
    with _lock:
        t = next(_tokens)
        _by_token[t] = value
    return t


def _entry_ctx(ctx, args, output):
    ctx.sink = _by_token[args[1]]
    ctx.set_materialize_grads(False)


def _entry_bwd(ctx, *cts):
    return ctx.sink.finish(cts), None


def _entry_raw(xs, token):
    """Forward: each input as it is (``detach``: the same memory, not a view, so the
    body may still modify an input in place, and views of it are views of the
    caller's tensor, as without overlap). Backward: each cotangent plus the results
    of the collectives deferred to this entry (``token``: its Sink), waited on."""
    return [x.detach() for x in xs]


overlap_entry = _ops._define(
    "overlap_entry(Tensor[] xs, int token) -> Tensor[]", _entry_raw,
    lambda xs, token: [torch.empty_like(x) for x in xs],
    setup_context=_entry_ctx, backward=_entry_bwd,
    jvp=lambda ctx, ts, *_: tuple(t.view_as(t) for t in ts),
    vmap=lambda info, dims, xs, token: (overlap_entry(xs, token), list(dims[0])))


def _ready_ctx(ctx, args, output):
    ctx.sink, ctx.j, ctx.key = _by_token[args[1]]
    ctx.set_materialize_grads(False)


def _ready_bwd(ctx, ct):
    if ctx.sink.add(ctx.j, ctx.key, ct):
        return None, None
    return ct, None


def _ready_raw(x, token):
    """Forward: ``x`` (a replicated input's vma alias) as it is. Backward: the
    cotangent goes into a gradient bucket of the entry's Sink (``token``), launched
    once full, and nothing is passed on; where this backward cannot defer, the
    cotangent is passed on to the alias's pvary as it is."""
    return x.view_as(x)


grad_ready = _ops._define(
    "grad_ready(Tensor x, int token) -> Tensor", _ready_raw,
    lambda x, token: torch.empty_like(x),
    setup_context=_ready_ctx, backward=_ready_bwd,
    jvp=lambda ctx, t, *_: t.view_as(t),
    vmap=lambda info, dims, x, token: (grad_ready(x, token), dims[0]))


def enter(local: list, among: list | None = None) -> None:
    """At a top-level body's entry: its floating inputs that need gradients (those at
    the indices ``among``, or all) replaced by the entry op's outputs, each tagged with
    its :class:`Sink` and index. A body whose gradients all fit in the first bucket is
    left as it is: that bucket would leave with the last of them anyway, and a small
    step keeps its per-step cost."""
    # (written with few calls: every step of every body passes here, and most are
    # turned away by the size, in two calls)
    cfg = _rank.values or _settings
    if not cfg["enabled"]:
        return
    idx = [i for i in (range(len(local)) if among is None else among)
           if (x := local[i]).__class__ in _TENSORS and x.requires_grad
           and (x.dtype.is_floating_point or x.dtype.is_complex)]
    size = 0
    for i in idx:            # (a loop, not sum(...): no call on this per-body path)
        size += local[i].nbytes
    if size < cfg["first_bucket_mb"] * 2**20:
        return
    if (not torch.is_grad_enabled() or _context.active() or _compile.tracing()
            or not _level_ok()):
        return
    paths = _rank.paths
    sink = Sink([local[i] for i in idx],
                [paths[i] if paths else f"input {i} of the body" for i in idx])
    token = _put(sink)
    try:
        outs = overlap_entry([local[i] for i in idx], token)
    finally:
        del _by_token[token]
    sink.node = outs[0].grad_fn
    sink.outs = [weakref.ref(y) for y in outs]
    for j, (i, y) in enumerate(zip(idx, outs)):
        y.__dict__[SINK] = (sink, j)
        local[i] = y


def ready_point(alias: torch.Tensor, entry: torch.Tensor, key: str) -> torch.Tensor:
    """``alias`` (the pvary over group ``key`` of the entry output ``entry``) through
    ``grad_ready``, where its gradient is to be bucketed on arrival; as it is if
    ``entry`` has no sink or ``alias`` already went through."""
    if SINK not in entry.__dict__ or _READY in alias.__dict__ or not torch.is_grad_enabled():
        return alias
    sink, j = entry.__dict__[SINK]
    token = _put((sink, j, key))
    try:
        out = grad_ready(alias, token)
    finally:
        del _by_token[token]
    sink.ready(j, key, out.grad_fn)
    out.__dict__.update(alias.__dict__)      # (its vma tag)
    out.__dict__[_READY] = True
    return out
