"""A :class:`Parallelized` call recorded once, then replayed: vma decided at the plan's
boundaries instead of per op (``ops/_replay.py`` says what is recorded and why it is
exact).

``call`` is ``Parallelized.__call__``'s: per key (grad mode; the vmas of the parameters
and of the tensor arguments; the other arguments' values), the first call runs under
the union rule and records; every rank of the body agrees on the record (one small
all-gather, once per key) before any rank replays it. Later calls replay it, unless
the check mode is on (then each call is recorded again and must decide as the first
did) or ``apply.replay`` is False. A forward hook added to or removed from the
module drops every record (:class:`Records`), whose plain module attributes are part
of the key; a call inside a torch.func transform of the body's own is decided per op,
but for one grad transform (a gradient penalty, jacrev's forward). While a call is
recorded or replayed the plan's hooks hand their work to :class:`_Recording` /
:class:`_Replaying`.
"""
from __future__ import annotations

import contextlib
import functools
import operator

import torch

from ..mesh._mesh import Mesh
from ..ops import _context, _lazy
from ..ops._buckets import _gather_ints
from ..ops._call_leaves import PLAIN, call_tensors, flatten_call, output_tensors
from ..ops._replay import Record, Recorder, Scope, pop_rule, push_rule, rule_on_top
from ..ops._vma import _TAG, EMPTY
from ..runtime import _compile, _crosscheck, _watch, _world
from ..runtime._errors import ShardingError
from ..runtime._torch_compat import (TransformGrad, global_forward_hooks,
                                     global_forward_pre_hooks, peek_interpreter_stack)

# a transformers config's fields that choose what the model returns (and so which
# tensors cross its boundary): a call after one is toggled records anew (read from the
# config's own dict: its attribute access is a Python call; transformers 5 keeps
# output_attentions as _output_attentions behind a property)
_CONFIG_FIELDS = ("output_attentions", "_output_attentions", "output_hidden_states",
                  "return_dict", "use_cache")


def config_key(module):
    """``f()``: ``module.config``'s output fields, one call; None without a config."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    d = vars(config)
    fields = [f for f in _CONFIG_FIELDS if f in d]
    if not fields:
        return None
    get = operator.itemgetter(*fields)
    one = len(fields) == 1

    def read() -> tuple:
        try:
            v = get(d)
        except KeyError:          # (a field deleted since: read them one by one)
            return tuple(d.get(f) for f in fields)
        return (v,) if one else v
    return read


# the attributes a key reads as they are (a float is a value: see Records.attributes)
_ATTR_TYPES = {bool, int, str, type(None)}
# the most records an apply keeps (then they are dropped and made anew)
_MAX_RECORDS = 256


def _builtin(cls) -> bool:
    """Is ``cls`` torch's own (``nn.Module``, torch.nn's layers), not a model's?"""
    return cls.__module__.startswith("torch.")


def _plain(getter) -> bool:
    """Does a module's attribute getter read plain values only, now?"""
    g, m, one = getter
    try:
        v = g(m)
    except AttributeError:
        return False
    return all(type(x) in _ATTR_TYPES for x in ((v,) if one else v))


class Records(dict):
    """An ``apply``'s records by key, the plain attributes of the model's modules that
    the key reads (:meth:`attributes`), and what no key holds: the forward hooks of the
    module's submodules (and torch's global ones) they were recorded under. A hook
    runs between boundaries, as the module's own code does, so a record is kept only
    while none is added or removed: then every record is dropped and calls record
    anew (the new hooks traced). Whether they changed is one comparison of the hook
    dicts with copies, which costs no Python call."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.live = [d for m in module.modules()
                     for d in (m._forward_pre_hooks, m._forward_hooks)]
        self.live += [global_forward_pre_hooks, global_forward_hooks]
        self.seen = None
        self.note()
        self._modules = [m for m in module.modules() if not _builtin(type(m))]
        self._getters: list = []
        self._last = None
        self._learn()

    def _learn(self) -> None:
        """Which attributes of the model's own modules hold plain values now, the
        module's own and its class's (a default a forward reads until an instance
        sets it): one getter per module, read per call as one C call each."""
        self._getters, self._last = [], None
        for m in self._modules:
            own = vars(m)
            names = [n for n, v in own.items() if type(v) in _ATTR_TYPES]
            seen = set(own)
            for cls in type(m).__mro__:
                for n, v in vars(cls).items():
                    if n not in seen:      # (the first definition is what m.n reads)
                        seen.add(n)
                        if (type(v) in _ATTR_TYPES and not _builtin(cls)
                                and not n.startswith("__")):
                            names.append(n)
            if names:
                self._getters.append((operator.attrgetter(*names), m, len(names) == 1))

    def attributes(self) -> tuple:
        """The plain attributes (``bool``, ``int``, ``str``, None) of the model's own
        modules and their classes, as they are now: part of the key, since a forward
        may choose its path by them (``if self.mode == ...``: which parameter meets
        which activations, a decision between boundaries that a replay could not see).
        torch's own classes are left out (nn.Module's attributes; a torch.nn layer's
        are its fixed sizes, and its ``training`` chooses dropout, which decides no
        vma); a ``float`` is a value, as in the key's arguments. An attribute deleted
        since, or one whose value is no longer plain, makes the list learnt again
        (once: a getter that still reads no plain value is dropped)."""
        for _ in range(2):
            try:
                now = tuple([g(m) for g, m, _ in self._getters])
                if now == self._last:      # (the usual call: one comparison)
                    return self._last
            except (AttributeError, RuntimeError):  # (deleted; a tensor compared)
                self._learn()
                continue
            bad = [k for k, ((_, _, one), v) in enumerate(zip(self._getters, now))
                   if any(type(x) not in _ATTR_TYPES for x in ((v,) if one else v))]
            if not bad:
                self._last = now
                return now
            self._learn()
        self._getters = [gm for gm in self._getters if _plain(gm)]
        self._last = tuple([g(m) for g, m, _ in self._getters])
        return self._last

    def note(self) -> None:
        """The hooks as they are now are those the records were made under (after a
        record, or after functp registered hooks of its own)."""
        self.seen = [dict(d) for d in self.live]


def _tracker(fr, apply):
    """The vma tracker of the body ``apply`` runs in (frame ``fr``), if its call may be
    recorded or replayed here (vma tracked, eager, at the body's own rule, at the
    body's own torch.func level or one grad transform above it, not inside another
    planned call)."""
    tr = fr.tracker if fr is not None else None
    if (tr is None or not apply.replay or tr.compiled or tr.replay is not None
            or _compile.tracing() or not rule_on_top(tr)):
        return None
    # (inside a torch.func transform the body applies around apply: one grad transform
    # (torch.func.grad, vjp, jacrev's forward) is replayed, its wrapped tensors varying
    # as what they wrap and the record's decisions logical; a torch.func.vmap (its
    # batched tensors are not what a record describes), jvp, or more than one level
    # is decided per op. A transform's level is its depth: one grad above the body's)
    interp = peek_interpreter_stack()
    if interp is not None and interp.level() > tr.level and (
            interp.level() != max(tr.level, 0) + 1 or interp.key() != TransformGrad):
        return None
    return tr


def _key(tr, params: dict, args: tuple, kwargs: dict) -> tuple:
    """What the union rule's decisions depend on, each part the same on every rank by
    construction or agreed when recorded: grad mode; every tensor leaf of the
    parameters and of the arguments (inside tuples, lists, dicts, dataclasses and
    registered pytree nodes) with its vma, whether it needs a gradient, its dtype and
    rank, and which leaf it is a view of; the arguments' structure; the plain values
    (``bool``, ``int``, ``str``, None: configuration, which may choose the module's
    path) -- a ``float`` is a value, not a decision (it may differ per rank: a loss
    scale), keyed by its type only; any other object by its type and the tensors it
    holds."""
    get, token = tr.get, tr.token
    parts = [torch.is_grad_enabled(), tuple(params)]
    tensors = list(params.values())   # (a view's base is looked up among these)
    # (a parameter's tag read inline where it is this run's: the usual case, no call)
    parts += [((tag[1], t.requires_grad)
               if (tag := t.__dict__.get(_TAG)) is not None and tag[0] == token
               and t._base is None else (get(t), t.requires_grad, _view_of(t, tensors)))
              if isinstance(t, torch.Tensor) else type(t) for t in tensors]
    if args or kwargs:
        leaves, spec = flatten_call(args, kwargs)     # (the recorder's walk too)
        parts.append(spec)
        tensors += leaves
        for v in leaves:
            if isinstance(v, torch.Tensor):
                parts.append((get(v), v.requires_grad, v.dtype, v.dim(),
                              None if v._base is None else _view_of(v, tensors)))
            elif isinstance(v, float):
                parts.append(float)
            elif isinstance(v, PLAIN):
                parts.append(v)
            else:
                parts.append(_opaque(tr, v))
    return tuple(parts)


def _view_of(t: torch.Tensor, tensors: list) -> int | None:
    """The place among ``tensors`` of the tensor ``t`` is a view of (-1: of none of
    them; None: not a view)."""
    base = t._base
    if base is None:
        return None
    return next((i for i, x in enumerate(tensors) if x is base), -1)


def _opaque(tr, v) -> tuple:
    """An object the pytrees do not open (a cache): its type and the vmas of the
    tensors among its attributes."""
    d = getattr(v, "__dict__", None)
    ts = [t for t in d.values() if isinstance(t, torch.Tensor)] if d else []
    return (type(v), tuple((tr.get(t), t.requires_grad) for t in ts))


def call(apply, params: dict, args: tuple, kwargs: dict, run):
    """``run(params)`` (the module under the plan) recorded, replayed or as it is."""
    fr = _context.top()
    tr = _tracker(fr, apply)
    if tr is None:
        if fr is not None and fr.tracker is not None and fr.tracker.replay is not None:
            # inside another planned call: in a frame of its own, which that call's
            # recorder sees (its hooks are not that call's boundaries)
            with _context.reentered(fr, f"a parallelized {type(apply.module).__name__}"):
                return run(params)
        return run(params)
    # the rule off the stack first: under it, every tensor attribute read (requires
    # grad, a view's base) is a call of the rule
    mode = tr.mode
    pop_rule()
    try:
        records = apply._records
        key = _key(tr, params, args, kwargs)
        key += (records.attributes(),)
        if apply._config_key is not None:
            key += apply._config_key()
        # (counted on every rank alike: a peer left in this call's agreement finds a
        # rank that replayed it by the count, without a collective: runtime/_watch.
        # The call is taken as one this rank agrees at until it is known to replay:
        # a rank still recording it, its agreement to come, must not be taken for one
        # that replayed it by a peer's watcher, which reads these at any moment)
        w = _watch.state
        n = w.planned + 1
        w.agreed.add(n)
        w.planned, w.key = n, key
        if records.seen != records.live:      # a forward hook added or removed since
            records.clear()
        rec = records.get(key)
        if rec is not None and not _crosscheck.ENABLED:
            w.agreed.discard(n)
            if rec.why is None:
                return _replay(apply, tr, rec, params, run)
    finally:
        push_rule(mode)
    if rec is not None and not _crosscheck.ENABLED:
        return run(params)
    out, new = _record(apply, tr, params, args, kwargs, run, key)
    if rec is None:
        if len(apply._records) >= _MAX_RECORDS:
            # (a key that never repeats, as a module attribute the forward counts its
            # calls in: every call records, and the records must not grow without end)
            apply._records.clear()
        apply._records[key] = new
    elif rec.why is None:
        # (a call that cannot be replayed where the first could: a replay of it would
        # have applied decisions this call does not make)
        diff = rec.differs(new) if new.why is None else f"this call cannot be replayed: {new.why}"
        if diff is not None:
            raise ShardingError(
                f"parallelize({type(apply.module).__name__}): this call decides vma "
                f"differently from the first call with the same arguments' vmas ({diff}); "
                f"without the check mode it would replay the first call's decisions and "
                f"its gradients would be wrong. Set apply.replay = False to decide per op "
                f"on every call (slower), or keep the module's path the same on every call")
    return out


def _record(apply, tr, params: dict, args: tuple, kwargs: dict, run, key: tuple):
    """The call under a recording union rule, every planned module's boundary watched:
    ``(its output, its Record)``."""
    recorder = Recorder(tr, params)
    with Scope(tr, apply._call, _Recording(recorder), recorder), \
            contextlib.ExitStack() as watching:
        for hook in apply.plan_hooks.values():
            watching.enter_context(hook.watched())
        out = run(params)
    acts = EMPTY.union(*[tr.get(t) for t in call_tensors(args, kwargs)])
    rec = recorder.finish(out, params, acts)
    _unseen(apply.plan_hooks, rec)
    # what a replay does: over a single rank a pvary is the identity for gradients,
    # and inside the module (outside its hooks) no vma is read
    rec.alias = [(n, a) for n, a in rec.params.items() if a and tr.group(a).size > 1]
    rec.lift = {h: many for h, ls in rec.lifts.items()
                if (many := {p: a for p, a in ls.items() if tr.group(a).size > 1})}
    if not _crosscheck.ENABLED:
        _agree(apply, tr, rec, params, key)
    if rec.why is None:
        for name in rec.lift:          # (a module whose style needs no hook lifts there)
            apply.plan_hooks[name].need_pre()
    apply._records.note()
    return out, rec


def _unseen(hooked: dict, rec: Record) -> None:
    """A planned module or a parameter the call did not reach leaves the record
    unreplayable: a later call with the same key that reaches it (an attribute
    choosing the depth, an early exit) would run it with decisions nobody made (no
    module of its kind can stand in: its twin's lifts were decided on another
    input), and a replay has no per-op mode to see that it got there."""
    missed = [name for name in hooked if name not in rec.args]
    if missed:
        rec.why = rec.why or (f"planned module {missed[0]!r} did not run in the first call "
                              f"with these arguments")
    elif rec.unused:
        rec.why = rec.why or (f"parameter {rec.unused[0]!r} was not used in the first call "
                              f"with these arguments")


def _summary(key: tuple) -> str:
    """A call's key in words, for an error: its plain arguments and how many tensors."""
    plain = [repr(v) for v in key if isinstance(v, (bool, int, str, type(None)))]
    tensors = sum(1 for v in key if isinstance(v, tuple) and v and isinstance(v[0], frozenset))
    return f"{tensors} tensors and the plain values {', '.join(plain[1:]) or 'none'}"


def _agree(apply, tr, rec: Record, params: dict, key: tuple) -> None:
    """Every rank of the body replays the same decisions, or none does: one all-gather
    of the record's digest over the body's ranks (not under functp.estimate: no peers)."""
    fr = _context.top()
    mesh: Mesh = fr.mesh
    g = mesh.axis_group(tuple(fr.manual))
    if g.size == 1 or _world.dry_run() is not None:
        return
    device = next((t.device for t in params.values() if isinstance(t, torch.Tensor)),
                  torch.device("cpu"))
    op = (f"{_watch.AGREEMENT} of parallelize({type(apply.module).__name__}) "
          f"(this rank's first call with {_summary(key)})")
    # A peer that replayed this call never enters this exchange: the watch finds it
    # by the call's number (runtime/_watch), also on NCCL, where no wait blocks and
    # the host sync of the result below is where this rank waits
    w = _watch.state
    w.describe = _summary
    w.agreeing = (op, g)
    try:
        rows = _gather_ints([rec.why is None, rec.digest() & 0x7FFFFFFF], g.key, device, op)
    finally:
        w.agreeing = None
    if not bool((rows == rows[0]).all()):
        rec.why = rec.why or "the ranks of the body recorded different decisions"


def _replay(apply, tr, rec: Record, params: dict, run):
    """The call with the recorded decisions (the rule off the stack: the caller took
    it off): parameters aliased at entry, no per-op mode inside the module, the result
    tagged as recorded."""
    if _lazy._state.on:
        _lazy.settle()
    aliased = dict(params)
    late = [] if tr.aliases is not None and apply._swap.slots is not None else None
    due = {}
    for n, axes in rec.alias:
        k = len(late) if late is not None else 0
        aliased[n] = tr.entry_alias(params[n], axes, late)
        if late is not None and len(late) > k:
            due[n] = late[-1]
    st = apply._call
    if due:
        _launch_points_at_use(apply, tr, due, aliased)
    try:
        with Scope(tr, st, _Replaying(tr, rec)):
            out = run(aliased)
    finally:
        # (the tracker let go: it holds the step's aliases and cached pvarys)
        st.late, st.late_tracker = None, None
    outs = output_tensors(out)
    if len(outs) != len(rec.result):
        raise _changed(type(apply.module).__name__, "its result", len(rec.result), len(outs))
    for t, v in zip(outs, rec.result):
        tr.set(t, v)
    return out


def _launch_points_at_use(apply, tr, due: dict, aliased: dict) -> None:
    """The parameters ``due`` (name -> (alias index, axes, group key)) get their
    gradient launch points (``ops/_overlap``) as the module owning each one starts,
    not here: the engine runs ready autograd nodes latest-made first, so a point made
    before the module's own nodes would wait for the module's whole backward, and its
    bucket with it. A forward pre-hook on each owner (before the plan's own, whose
    style reads the parameters too), registered once per module."""
    st, slots = apply._call, apply._swap.slots
    owners = apply._owner_of
    if owners is None:
        owners = apply._owner_of = {id(m._parameters): m for m in apply.module.modules()}
    late: dict = {}
    for n, point in due.items():
        for d, short, _ in slots.get(n, ()):
            mod = owners.get(id(d))
            if mod is None:
                continue
            late.setdefault(id(mod), []).append((d, short, n, aliased[n], point))
            if id(mod) not in apply._hooked_use:
                apply._hooked_use.add(id(mod))
                mod.register_forward_pre_hook(functools.partial(_at_use, st), prepend=True)
                apply._records.note()
    st.late, st.late_tracker = late, tr


def _at_use(st, mod, args) -> None:
    """A module's forward pre-hook: its parameters' launch points, made now; each
    goes where the alias was (the module's slot, unless the plan withheld it there,
    and the parameters the plan's styles read)."""
    todo = st.late.pop(id(mod), None) if st.late else None
    if todo:
        aliases, params = st.late_tracker.aliases, st.params
        for d, short, name, raw, (j, axes, key) in todo:
            y = aliases.ready(j, axes, key)
            if d.get(short) is raw:
                d[short] = y
            if params.get(name) is raw:
                params[name] = y


def _changed(kind: str, what: str, then: int, now: int) -> ShardingError:
    return ShardingError(
        f"parallelize({kind}): {what} held {then} tensor(s) at the "
        f"first call with these arguments' vmas and {now} now, so the first call's vma "
        f"decisions do not apply; set apply.replay = False to decide per op on every call")


def _tag(tr, hook: str, ts: list, vmas: tuple | None, what: str) -> None:
    if vmas is None or len(vmas) != len(ts):
        raise _changed("a module", f"{what} of planned module {hook!r}",
                       -1 if vmas is None else len(vmas), len(ts))
    for t, v in zip(ts, vmas):
        tr.set(t, v)


class _Recording:
    """The plan's hooks during a recorded call: each planned module's boundary told
    to the :class:`Recorder` (its arguments as given, the ones it runs with, its
    output), the style's work counted as a hook's (it runs under the rule in a
    replay too)."""

    def __init__(self, recorder: Recorder) -> None:
        self.rec = recorder

    def pre(self, hook, m, args: tuple, kwargs: dict):
        rec = self.rec
        before = call_tensors(args, kwargs)
        rec.in_hook += 1
        try:
            res = hook.pre_work(m, args, kwargs)
        finally:
            rec.in_hook -= 1
        rec.entered(hook.name, before, res if res is not None else (args, kwargs))
        return res

    def post(self, hook, m, args: tuple, kwargs: dict, output):
        rec = self.rec
        rec.left(hook.name, output)
        rec.in_hook += 1
        try:
            return hook.post_work(m, args, kwargs, output)
        finally:
            rec.in_hook -= 1


class _Replaying:
    """The plan's hooks during a replayed call: where a module's boundary does work,
    the union rule pushed again and the arguments (or output) tagged as recorded, so
    that the style's collectives decide as they did; then the recorded lifts."""

    def __init__(self, tr, rec: Record) -> None:
        self.tr, self.rec = tr, rec

    def pre(self, hook, m, args: tuple, kwargs: dict):
        tr, rec = self.tr, self.rec
        res = None
        if hook.acting and not hook.replay_idle:
            push_rule(tr.mode)
            try:
                _tag(tr, hook.name, call_tensors(args, kwargs), rec.args.get(hook.name),
                     "the arguments")
                res = hook.pre_work(m, args, kwargs)
            finally:
                pop_rule()
        lifts = rec.lift.get(hook.name)
        if lifts:
            a, k = res if res is not None else (args, kwargs)
            a, k = list(a), dict(k)
            for pos, axes in lifts.items():
                if isinstance(pos, int):
                    a[pos] = tr.pvary(a[pos], axes)
                else:
                    k[pos] = tr.pvary(k[pos], axes)
            res = (tuple(a), k)
        return res

    def post(self, hook, m, args: tuple, kwargs: dict, output):
        if not hook.acting or hook.replay_idle:
            return None
        tr = self.tr
        push_rule(tr.mode)
        try:
            _tag(tr, hook.name, output_tensors(output), self.rec.outs.get(hook.name),
                 "the output")
            return hook.post_work(m, args, kwargs, output)
        finally:
            pop_rule()
