"""Gradient collectives in flight during the backward: buckets launched as soon as
their gradients are complete, waited on once the rest of the backward is done.

A top-level shard_map body's floating inputs that need gradients pass through one
``functp::overlap_entry`` op on the way in (:func:`enter`). It is an identity whose
autograd node is made before any of the body's, and the engine runs ready nodes
latest-made first, so its backward runs after the body's whole backward, just before
the gradients leave the body. That is where the launched collectives are waited on.

Launch points:

- a replicated input's vma alias (the ``pvary`` whose transpose is the gradient
  all-reduce) passes through ``functp::grad_ready``, whose node runs once the
  gradients of all the aliases it took are complete; its backward adds them to their
  buckets. At a layout's first backward each alias passes its own, made at its first
  use in the body (:func:`ready_point`): the order the gradients come in is learnt
  then, as DDP rebuilds its buckets once. Later, the buckets are cut at the entry and
  each bucket's aliases pass one, made at the first use of any of them
  (:func:`cut_at_entry`; per bucket, not per input, as DDP's reducer marks a bucket
  ready). Made at the entry, a node would wait for the whole backward: the engine
  runs ready nodes latest-made first. The buckets are the same on every rank of a
  group whatever the order each rank uses its inputs in (``_buckets``: cut per group
  and dtype, ``bucket_mb`` each, the first ``first_bucket_mb``, as DDP does), and
  launched in their order, each once its gradients are in (a gradient this rank will
  not send counts as zeros): every rank pairs the same inputs.
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

import torch

from . import _context, _lazy
from . import _ops
from . import _primitives as prim
from ._buckets import Buckets
from ..runtime import _compile, _world
from ..runtime._torch_compat import (FakeTensor, TransformGrad, layer_stack_depth,
                                     peek_interpreter_stack, will_engine_execute_node)

__all__ = ["set_overlap"]

SINK = "_functp_sink"          # an entry output's __dict__ key: (its Sink, its index)
# the inputs that may get a sink (a fake one: functp.estimate's tape step, as its real
# run; torch.compile's fakes are turned away by _compile.tracing())
_TENSORS = (torch.Tensor, torch.nn.Parameter, FakeTensor)
READY = "_functp_ready"       # a grad_ready output's: its launch point is made

# the settings, read at each launch: the process's, or a simulated rank's own (set in
# its thread, as a process under torchrun sets its own)
_settings = {"enabled": True, "bucket_mb": 25.0, "first_bucket_mb": 1.0, "min_buckets": 8,
             "forward": True}


class _Rank(threading.local):
    values: dict | None = None
    # the pytree paths of the inputs of the body being entered (set by shard_map
    # before its boundary rules call :func:`enter`): errors name an input by them
    paths: list | None = None


_rank = _Rank()


def _get() -> dict:
    v = _rank.values
    return _settings if v is None else v


def set_overlap(enabled: bool | None = None, bucket_mb: float | None = None,
                first_bucket_mb: float | None = None, forward: bool | None = None,
                min_buckets: int | None = None) -> dict:
    """Sets how a shard_map body's communication overlaps its computation: the
    gradients of its replicated inputs are reduced during the backward (functp
    launches each bucket's all-reduce as soon as its gradients are complete, and
    waits at the end of the body's backward), and its forward collectives are waited
    on at the first use of their result.

    **Arguments:** ``enabled`` – False: one all-reduce after the body's backward, and
    every collective waited on at once (the behaviour before overlap); ``bucket_mb`` –
    a bucket's size in MiB (DDP's ``bucket_cap_mb``, 25 by default);
    ``first_bucket_mb`` – the first bucket's (1 MiB: launched early, as DDP's first
    bucket); ``min_buckets`` – buckets are made smaller than ``bucket_mb`` (not than
    ``first_bucket_mb``) where a body's gradients of one dtype would make fewer (8 by
    default: a 32 MiB model's gradients travel in 4 MiB buckets, which across two
    hosts hid the all-reduce DDP's 25 MiB leave to the backward's end; 1: DDP's
    buckets); ``forward`` – False: forward collectives (``psum``, ``all_gather``...)
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
    if min_buckets is not None:
        if isinstance(min_buckets, bool) or not isinstance(min_buckets, int) or min_buckets < 1:
            raise ValueError(f"functp.set_overlap: min_buckets must be an int >= 1, got "
                             f"{min_buckets!r}")
        new["min_buckets"] = min_buckets
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
    """The backward state of one body's entry: its gradient buckets (laid out by
    :class:`~functp.ops._buckets.Buckets`) as their gradients come, the collectives
    launched, and the results each input's gradient still gets.

    Each bucket is launched once it and every bucket before it are complete, so every
    rank launches the same buckets in the same order whatever the order its gradients
    came in; a gradient this rank will not send counts as zeros. A group whose order
    was agreed at an earlier backward has its buckets cut at the entry
    (:func:`cut_at_entry`), one launch point each; the others get one per input, and
    learn their order at this backward."""

    def __init__(self, local: list, paths: list) -> None:
        self.layout = Buckets(local, paths)
        self.n = len(local)
        # weak references to the autograd nodes (the graph owns them: a Sink holding
        # them closed a cycle through the C++ graph, which the garbage collector does
        # not see, and every call's Sink, its graph and the entry's tensors leaked)
        self.node = None        # the entry's autograd node
        self.outs: list = []    # weak references to the entry's outputs (their vma tags)
        self.nodes: dict = {}    # group key -> {input: the grad_ready node it passes}
        self.made: list = []     # [(group key, [inputs])]: the buckets cut at the entry
        self.bucket: dict = {}   # (group key, input) -> its bucket's inputs (those)
        self.last: dict = {}     # group key -> its last bucket's inputs (those)
        self.reset()

    def reset(self) -> None:
        self.extra: list = [[] for _ in range(self.n)]   # per input: deferred results
        self.pending: list = []       # prim.Pending, in launch order
        self.deferring = None         # decided at this backward's first gradient
        self.got: dict = {}           # (input, group key) -> its gradient (None: zero)
        self.plan = None              # [(group key, [inputs])]
        self.left: list = []          # per bucket: gradients still to come
        self.where: dict = {}         # (input, group key) -> its bucket
        self.next = 0                 # the next bucket to launch
        self.arrived: list = []       # (input, group key) in the order their gradients came

    def ready(self, js: list, key: str, node) -> None:
        """In the forward: inputs ``js``' aliases over group ``key`` got their launch
        point ``node``; the first one of a group whose buckets are not cut yet enrols
        every input replicated over it."""
        nodes = self.nodes.get(key)
        if nodes is None:
            self.layout.enrol(key, [r() for r in self.outs])
            nodes = self.nodes[key] = {}
        ref = weakref.ref(node)
        for j in js:
            nodes[j] = ref

    def _runs(self) -> bool:
        node = self.node() if self.node is not None else None
        return node is not None and will_engine_execute_node(node)

    def _defers(self, ct: torch.Tensor | None) -> bool:
        if ct is None:      # (no gradient reached this rank's launch points)
            return (_level_ok() and self._runs()
                    and (not torch.is_grad_enabled() or peek_interpreter_stack() is not None))
        return not _ops._differentiated(ct) and _level_ok() and self._runs()

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

    def add(self, js: list, key: str, cts) -> bool:
        """Inputs ``js``' gradients ``cts`` through their aliases over group ``key``
        (None: no gradient came) join their buckets, each launched once it and every
        bucket before it are complete; False where this backward cannot defer
        (``cts`` are passed on)."""
        if self.deferring is None:
            ct = next((c for c in cts if c is not None), None)
            if ct is None:
                for j in js:
                    self.got[(j, key)] = None     # (counted once the plan is made)
                return True
            self.deferring = self._defers(ct)
            if self.deferring:
                self._layout()
        if not self.deferring:
            return False
        got, left, where = self.got, self.left, self.where
        for j, ct in zip(js, cts):
            slot = (j, key)
            if slot not in got:
                got[slot] = ct
                self.arrived.append(slot)
                left[where[slot]] -= 1
        self._advance()
        return True

    def _layout(self) -> None:
        """The buckets: those cut at the entry, then the enrolled groups'
        (:meth:`Buckets.plan <functp.ops._buckets.Buckets.plan>`); the gradients no
        node of this backward will send counted as zeros at once."""
        plan = self.made + self.layout.plan(_get())
        self.plan, self.left = plan, [len(js) for _, js in plan]
        runs: dict = {}      # id of a launch point -> will this backward run it?
        for b, (key, js) in enumerate(plan):
            nodes = self.nodes[key]
            for j in js:
                self.where[(j, key)] = b
                node = nodes.get(j)
                node = node() if node is not None else None
                if node is not None and (ran := runs.get(id(node))) is None:
                    ran = runs[id(node)] = will_engine_execute_node(node)
                if (j, key) in self.got or node is None or not ran:
                    self.got[(j, key)] = None
                    self.left[b] -= 1
        self._advance()

    def _advance(self, every: bool = False) -> None:
        """Launches the buckets in plan order while each is complete (``every``: all
        that are left, the missing gradients as zeros)."""
        # (one order for all groups, the same on every rank: two axis groups may be
        # one process group, e.g. ('dp',) and ('dp', 'tp') where tp has size 1, whose
        # collectives must come in the same order everywhere)
        while self.next < len(self.plan) and (every or self.left[self.next] == 0):
            self._launch(*self.plan[self.next])
            self.next += 1

    def _launch(self, key: str, js: list) -> None:
        cts = []
        for j in js:
            ct = self.got[(j, key)]
            self.got[(j, key)] = None     # (the bucket holds it now: freed once sent)
            if ct is None:
                shape, dtype, device, _ = self.layout.meta[j]
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
            if self.deferring is None and self.nodes:
                self.deferring = self._defers(next((c for c in cts if c is not None), None))
                if self.deferring:
                    self._layout()
            if self.deferring:
                self._advance(every=True)
            _wait_all(self.pending)
            if self.deferring and self.layout.fresh:
                self.layout.agree_order(self.arrived)
            grads = []
            for ct, extra in zip(cts, self.extra):
                for t in extra:
                    ct = t if ct is None else ct + t
                grads.append(ct)
            return grads
        finally:
            self.reset()      # (a retained graph's next backward starts afresh)


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
    ctx.sink, ctx.js, ctx.key = _by_token[args[1]]
    ctx.set_materialize_grads(False)


def _ready_bwd(ctx, *cts):
    if ctx.sink.add(ctx.js, ctx.key, cts):
        return [None] * len(cts), None
    return list(cts), None


def _ready_raw(xs, token):
    """Forward: ``xs`` (replicated inputs' vma aliases) as they are. Backward, once
    every one of their cotangents is in: they go into their gradient buckets of the
    entry's Sink (``token``), each bucket launched once full, and nothing is passed
    on; where this backward cannot defer, the cotangents are passed on to the aliases'
    pvary as they are."""
    return [x.view_as(x) for x in xs]


grad_ready = _ops._define(
    "grad_ready(Tensor[] xs, int token) -> Tensor[]", _ready_raw,
    lambda xs, token: [torch.empty_like(x) for x in xs],
    setup_context=_ready_ctx, backward=_ready_bwd,
    jvp=lambda ctx, ts, *_: tuple(t.view_as(t) for t in ts),
    vmap=lambda info, dims, xs, token: (grad_ready(xs, token), list(dims[0])))


def enter(local: list, among: list | None = None) -> Sink | None:
    """At a top-level body's entry: its floating inputs that need gradients (those at
    the indices ``among``, or all) replaced by the entry op's outputs, each tagged with
    its :class:`Sink` and index; returns the Sink. A body whose gradients all fit in
    the first bucket is left as it is (None): that bucket would leave with the last of
    them anyway, and a small step keeps its per-step cost."""
    # (written with few calls: every step of every body passes here, and most are
    # turned away by the size, in two calls)
    cfg = _rank.values or _settings
    if not cfg["enabled"]:
        return None
    idx = [i for i in (range(len(local)) if among is None else among)
           if (x := local[i]).__class__ in _TENSORS and x.requires_grad
           and (x.dtype.is_floating_point or x.dtype.is_complex)]
    size = 0
    for i in idx:            # (a loop, not sum(...): no call on this per-body path)
        size += local[i].nbytes
    if size < cfg["first_bucket_mb"] * 2**20:
        return None
    if (not torch.is_grad_enabled() or _context.active() or _compile.tracing()
            or not _level_ok()):
        return None
    paths = _rank.paths
    sink = Sink([local[i] for i in idx],
                [paths[i] if paths else f"input {i} of the body" for i in idx])
    token = _put(sink)
    try:
        outs = overlap_entry([local[i] for i in idx], token)
    finally:
        del _by_token[token]
    node = outs[0].grad_fn
    sink.node = weakref.ref(node) if node is not None else None
    sink.outs = [weakref.ref(y) for y in outs]
    for j, (i, y) in enumerate(zip(idx, outs)):
        y.__dict__[SINK] = (sink, j)
        local[i] = y
    return sink


def ready_point(alias: torch.Tensor, entry: torch.Tensor, key: str) -> torch.Tensor:
    """``alias`` (the pvary over group ``key`` of the entry output ``entry``) through
    ``grad_ready``, where its gradient is to be bucketed on arrival; as it is if
    ``entry`` has no sink or ``alias`` already went through (its bucket's)."""
    if SINK not in entry.__dict__ or READY in alias.__dict__ or not torch.is_grad_enabled():
        return alias
    sink, j = entry.__dict__[SINK]
    return through(sink, [j], key, [alias])[0]


def cut_at_entry(sink: Sink, key: str, entries: list) -> None:
    """At a body's entry: group ``key``'s buckets cut at once where its order was
    agreed at an earlier backward (``entries``: the group's entry outputs of
    ``sink``), so that each bucket's aliases pass one ``grad_ready`` (:func:`bucket_point`,
    per bucket, not per input, as DDP's reducer marks a bucket ready); left to the
    first backward of a layout otherwise, which learns the order its gradients come in,
    per input (:func:`ready_point`)."""
    if key in sink.nodes or not torch.is_grad_enabled():
        return
    layout = sink.layout
    members = layout.members_of(key, [r() for r in sink.outs])
    order = layout.agreed(key, members)
    if order is None or {e.__dict__[SINK][1] for e in entries} != set(members):
        return
    sink.nodes[key] = {}
    cut = layout.cut(members, order, _get())
    for js in cut:
        sink.made.append((key, js))
        for j in js:
            sink.bucket[(key, j)] = js
    sink.last[key] = cut[-1] if cut else []


def bucket_point(sink: Sink, key: str, j: int):
    """The inputs of the bucket of group ``key`` that holds input ``j``, if the group's
    buckets were cut at the entry (:func:`cut_at_entry`); else None. Its launch point
    is made at the first use of any of them (:func:`through`), not at the entry:
    the engine runs ready nodes latest-made first, so a node made at the entry would
    wait for the whole backward."""
    return sink.bucket.get((key, j))


def launches_early(sink: Sink, key: str, j: int) -> bool:
    """Can input ``j``'s bucket over group ``key`` launch before the backward ends?
    Not the group's last bucket (its gradients complete last, whenever its launch
    point was made), nor any bucket of a group not cut at the entry."""
    js = bucket_point(sink, key, j)
    return js is not None and js is not sink.last[key]


def through(sink: Sink, js: list, key: str, aliases: list) -> list:
    """``aliases`` (of inputs ``js`` over group ``key``) through one ``grad_ready``;
    as they are where the first use is inside a torch.func transform the body applies
    (a gradient penalty's ``torch.func.grad``): the launch point made there is a
    wrapper with no autograd node, its bucket would count it as sending nothing and
    drop the gradient that then comes (the parameters' gradients were zeros); left as
    they are, their pvary's own psum reduces what comes that way, and a later use
    outside the transform makes the launch point. (Told by the node itself: no call.)"""
    token = _put((sink, js, key))
    try:
        outs = grad_ready(aliases, token)
    finally:
        del _by_token[token]
    node = outs[0].grad_fn
    if node is None:
        return aliases
    sink.ready(js, key, node)
    for y, a in zip(outs, aliases):
        y.__dict__.update(a.__dict__)      # (its vma tag)
        y.__dict__[READY] = True
    return outs
