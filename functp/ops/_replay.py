"""vma decided once for a planned module: its first call runs under the union rule and
records the rule's decisions; later calls replay them at the module's boundaries, with
no per-op mode.

JAX decides vma at trace time; functp's union rule (``_vma_mode``) decides it per torch
call, which costs Python per op (a mode that does nothing but call the op already costs
a fifth of a small step). Inside a module that ``parallelize`` planned, the rule's
decisions are of two kinds, each known at a boundary the plan owns:

- a parameter meets activations that vary over more axes: it is replaced by its alias
  over them (the pvary whose transpose is its gradient all-reduce) before the module
  runs;
- a planned module's input meets that module's split weights (Megatron's ``f``): the
  input is pvary'd in the module's pre-hook.

A :class:`Recorder` watches the first call (through a :class:`Recording` rule) and
writes a :class:`Record`: each parameter's and each planned input's axes, and the vmas
of the values that cross a planned boundary (the hooks' arguments and outputs, the
module's result). Any other decision makes the record unreplayable (its ``why``) and
calls with that key keep the union rule: an activation computed inside the module made
varying while it needs a gradient, a value used both as it is and made varying, an
in-place write that changes a vma, a custom Function mixing vmas, a nested body or
``functp.checkpoint``. A record names no tensor.

A replayed call runs with the union rule's mode off the torch-function stack, except
inside the plan's hooks: there it is pushed again and the hooks' arguments carry the
vmas the record gives them, so the styles' collectives decide exactly as they did.
Forward results are waited on at once there (no per-op mode would see their first use).
``parallel/_replayed.py`` drives this for :class:`functp.Parallelized`.
"""
from __future__ import annotations

import weakref
import zlib

import torch

from . import _context
from ._call_leaves import call_tensors, output_tensors
from ._vma import EMPTY, Tracker
from ._vma_mode import UnionRule, join, _tensors as operands
from ..runtime._torch_compat import (function_mode_at, function_stack_len,
                                     pop_function_mode, push_function_mode)

__all__ = ["Record", "Recorder", "Recording", "Scope", "rule_on_top", "push_rule", "pop_rule"]


def rule_on_top(tr: Tracker) -> bool:
    """Is the body's union rule the innermost torch-function mode (so that a planned
    module can run without it, and be recorded under a rule of its own)?"""
    n = function_stack_len()
    return n > 0 and tr.mode is not None and function_mode_at(n - 1) is tr.mode


# the rule put back on / taken off the torch-function stack: torch's own calls bound
# to these names (a wrapper would be one more Python call at every acting hook of a
# replayed call)
push_rule = push_function_mode
pop_rule = pop_function_mode


def _axes(v: frozenset) -> tuple:
    return tuple(sorted(v))


class Record:
    """One planned call's decisions, with no tensor in it: ``params`` (parameter name ->
    the axes its alias adds; every parameter has an entry), ``lifts`` (hook -> the
    ``(position, axes)`` of its inputs pvary'd after its pre-hook), ``args`` / ``outs``
    (hook -> the vmas of its tensor arguments before its pre-hook / of its output's
    tensors before its post-hook), ``result`` (the vmas of the module's output tensors),
    ``why`` (None, or why these decisions cannot be replayed)."""

    def __init__(self) -> None:
        self.params: dict[str, frozenset] = {}
        self.lifts: dict[str, dict] = {}
        self.args: dict[str, tuple] = {}
        self.outs: dict[str, tuple] = {}
        self.result: tuple = ()
        self.why: str | None = None
        self.unused: list[str] = []   # floating parameters the call never read
        # what a replay applies (set by its caller, who knows the groups): the
        # parameters to alias and the inputs to lift over more than one rank
        self.alias: list = []
        self.lift: dict = {}

    def digest(self) -> int:
        """The same on every rank that recorded the same decisions."""
        text = repr((
            sorted((k, _axes(v)) for k, v in self.params.items()),
            sorted((h, sorted((str(p), _axes(a)) for p, a in ls.items()))
                   for h, ls in self.lifts.items()),
            sorted((h, [_axes(v) for v in vs]) for h, vs in self.args.items()),
            sorted((h, [_axes(v) for v in vs]) for h, vs in self.outs.items()),
            [_axes(v) for v in self.result], self.why is None))
        return zlib.crc32(text.encode())

    def differs(self, other: "Record") -> str | None:
        """The first decision ``other`` makes differently, in words (None: the same)."""
        for what, mine, theirs in (("parameter", self.params, other.params),
                                   ("planned module input", self.lifts, other.lifts),
                                   ("planned module arguments", self.args, other.args),
                                   ("planned module output", self.outs, other.outs)):
            for k in sorted(set(mine) | set(theirs), key=str):
                if mine.get(k) != theirs.get(k):
                    return (f"{what} {k!r}: {_said(mine, k)} at the first call, "
                            f"{_said(theirs, k)} now")
        if self.result != other.result:
            return f"the module's result: {self.result} at the first call, {other.result} now"
        return None


def _said(table: dict, k) -> str:
    return str(table[k]) if k in table else "not reached"


class Recorder:
    """Watches one planned call under :class:`Recording` and fills its :class:`Record`.

    While the call runs it keeps a trace (each op's inputs and outputs as serial
    numbers, their vmas and whether they need a gradient; the hooks' boundaries) and
    explains each implicit pvary by its *roots*: the parameters, or the running planned
    module's inputs, that the pvary'd value was computed from alone (a value computed
    from anything else that needs a gradient has none: not replayable). The roots'
    axes become the record's decisions: a parameter's alias, a module input's lift.

    :meth:`finish` then checks the decisions by running the trace again with them
    (hypothetical vmas): outside the hooks no op may need a pvary (a replay has no mode
    there to make one), and every value crossing a boundary (a hook's arguments and
    output, the call's result) must have the vma the call gave it. Where both hold, a
    replay's gradients are the call's: a pvary moved from a value computed from
    invariant parameters to the parameters themselves commutes with that computation's
    backward (the same on every rank), and everything else is identical."""

    def __init__(self, tracker: Tracker, params: dict) -> None:
        self.tr = tracker
        self.rec = Record()
        self.params = params
        self._ser: dict[int, tuple] = {}    # id -> (weak reference, serial)
        self.vma: list[frozenset] = []      # serial -> vma in the recorded call
        self.grad: list[bool] = []          # serial -> needs a gradient
        self.src: list = []                 # serial -> roots (frozenset) or None
        self.names: dict[int, list[str]] = {}     # serial of a parameter -> its names
        for n, t in params.items():
            if isinstance(t, torch.Tensor):
                i = self.serial(t)
                self.names.setdefault(i, []).append(n)
                self.src[i] = frozenset([("p", n)] + list(self.src[i] or ()))
        self.inputs: dict[int, list] = {}   # serial -> [(hook, pos)] of running modules
        self.nested: dict[int, str] = {}    # serial -> the running module it is inside
        #                                     an argument of (a container's leaf)
        self.running: list = []             # (hook, [(pos, serial)]), innermost last
        self.trace: list = []               # ("op", ins, outs, in_hook, running, grad
        #                                     mode) | boundary
        self.lifts: dict = {}               # root -> axes its pvary'd values needed
        self.in_hook = 0                    # inside a style's prepare_input/output
        self.frames = _context.entered()[0]     # (a frame entered since: nested code)

    def fail(self, why: str) -> None:
        if self.rec.why is None:
            self.rec.why = why

    def serial(self, t: torch.Tensor) -> int:
        """``t``'s serial number (a new one for a tensor not seen yet, with its vma)."""
        hit = self._ser.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        n = len(self.vma)
        self.tr._paused += 1     # (from a hook, outside the rule: reading a tag is a
        try:                     # torch call the rule would see)
            v, grad = self.tr.get(t), t.requires_grad
        finally:
            self.tr._paused -= 1
        self._ser[id(t)] = (weakref.ref(t), n)
        self.vma.append(v)
        self.grad.append(grad)
        self.src.append(None if grad else EMPTY)
        return n

    def _running_hooks(self) -> tuple:
        return tuple(h for h, _ in self.running)

    def roots(self, i: int) -> frozenset | None:
        """What value ``i`` is computed from alone, as seen by the op now running: a
        running module's input is its own root there."""
        where = self.inputs.get(i)
        if where:
            return frozenset(("i",) + w for w in where)
        return self.src[i]

    def before(self, args, kwargs) -> tuple:
        """An op is about to run: the serials of the tensor inputs the union rule
        unifies (its own walk of an op's operands)."""
        return tuple([self.serial(t) for t in operands(args, kwargs or {})])

    def after(self, ins: tuple, out) -> None:
        """The op that read ``ins`` returned ``out``: its outputs' serials, vmas and
        roots (the union of its inputs' that need a gradient, None if one has none)."""
        roots = EMPTY
        for i in ins:
            if self.grad[i]:
                r = self.roots(i)
                roots = None if r is None or roots is None else roots | r
        outs = []
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self._ser.pop(id(t), None)        # (an in-place op's result: a new value)
                n = self.serial(t)
                self.src[n] = roots if t.requires_grad else EMPTY
                outs.append(n)
        self.trace.append(("op", ins, tuple(outs), self.in_hook > 0, self._running_hooks(),
                           torch.is_grad_enabled()))

    def implicit(self, t: torch.Tensor, missing: frozenset) -> None:
        """The union rule pvary'd ``t`` over ``missing`` (cached or not)."""
        i = self.serial(t)
        r = self.roots(i)
        if self.in_hook:      # (a hook runs under the rule in a replay too)
            r = frozenset(x for x in (r or ()) if x[0] == "p")
        elif not t.requires_grad:
            return
        elif r is None or not r:
            hook = self.nested.get(i)
            if hook is not None:
                self.fail(f"planned module {hook!r} gets a tensor (shape {tuple(t.shape)}) "
                          f"inside a container argument that meets one varying over "
                          f"{sorted(missing)}: a replay lifts (Megatron's f) a planned "
                          f"module's top-level arguments only; pass it as one to replay")
                return
            self.fail(f"a value computed inside the module (shape {tuple(t.shape)}) from an "
                      f"activation meets one varying over {sorted(missing)}: the union rule "
                      f"makes it varying at that op, which no planned boundary sees")
            return
        for root in r:
            self.lifts[root] = self.lifts.get(root, EMPTY) | missing

    def entered(self, hook: str, before: list, res) -> None:
        """A planned module's pre-hook ran: ``before`` its tensor arguments as given,
        ``res`` the ``(args, kwargs)`` the module runs with (its inputs while it runs)."""
        ser = tuple([self.serial(t) for t in before])
        self.trace.append(("args", hook, ser, self._running_hooks()))
        args, kwargs = res
        watched = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        watched += [(k, a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)]
        watched = [(pos, self.serial(a)) for pos, a in watched]
        for pos, i in watched:
            self.inputs.setdefault(i, []).append((hook, pos))
        leaves = call_tensors(args, kwargs)
        if len(leaves) > len(watched):      # (leaves of its containers: for an error)
            top = {i for _, i in watched}
            for t in leaves:
                i = self.serial(t)
                if i not in top:
                    self.nested.setdefault(i, hook)
        self.running.append((hook, watched))
        self.trace.append(("enter", hook, tuple(watched)))

    def left(self, hook: str, output) -> None:
        """A planned module's forward returned ``output`` (before its post-hook)."""
        if not self.running or self.running[-1][0] != hook:
            self.fail(f"planned module {hook!r} returned out of order")
            return
        _, watched = self.running.pop()
        if self.nested:
            self.nested = {i: h for i, h in self.nested.items() if h != hook}
        for pos, i in watched:
            where = self.inputs.get(i)
            if where is not None:
                where.remove((hook, pos))
                if not where:
                    del self.inputs[i]
        ser = tuple([self.serial(t) for t in output_tensors(output)])
        self.trace.append(("left", hook, ser, self._running_hooks()))

    def finish(self, out, params: dict, acts: frozenset) -> Record:
        """See :func:`_finish`."""
        return _finish(self, out, params, acts)


def _finish(r: Recorder, out, params: dict, acts: frozenset) -> Record:
    """The record of a call that returned ``out``: its decisions, checked against
    its trace; a parameter the call did not use gets the axes of the activations
    ``acts`` it lacks (as any use inside the module would give it)."""
    rec = r.rec
    _nested(r)
    if r.running:
        r.fail("a planned module's forward did not return through its hooks")
    for root, axes in r.lifts.items():
        if root[0] == "p":
            rec.params[root[1]] = axes
        else:
            rec.lifts.setdefault(root[1], {})[root[2]] = axes
    used = {n for e in r.trace if e[0] == "op" for i in e[1]
            for n in r.names.get(i, ())}
    for n, t in params.items():
        if n not in rec.params and isinstance(t, torch.Tensor):
            floating = t.is_floating_point() or t.is_complex()
            rec.params[n] = EMPTY if n in used or not floating else acts - r.tr.get(t)
            if floating and n not in used:
                rec.unused.append(n)
    result = tuple([r.serial(t) for t in output_tensors(out)])
    rec.result = tuple([r.vma[i] for i in result])
    if rec.why is None:
        _rerun(r, result)
    if rec.why is None:
        _boundary_vmas(r)
    return rec


def _nested(r: Recorder) -> None:
    """User code ran in a frame of its own inside the call (a shard_map body,
    functp.checkpoint, another parallelized call): its tags, its entry aliases or its
    recompute are made apart from the trace, and a replay (no mode inside the module)
    would leave them undecided. The root cause, so the reason given whatever the trace
    made of its ops."""
    frames, what = _context.entered()
    if frames != r.frames:
        r.rec.why = f"{what} ran inside the module"


def _rerun(r: Recorder, result: tuple) -> None:
    """The trace run again with the record's decisions (see :class:`Recorder`): fails
    the record where a replay would need a pvary outside a hook, or would give a value
    crossing a boundary another vma than the call did."""
    rec, vma = r.rec, r.vma
    hv: dict[int, frozenset] = {}       # serial -> its vma in a replay
    for i, names in r.names.items():
        hv[i] = vma[i] | rec.params.get(names[0], EMPTY)
    lifted: dict[int, list] = {}        # serial -> (hook, axes) added while it runs

    def seen(i: int, running: tuple) -> frozenset:
        v = hv.get(i, vma[i])
        for hook, axes in lifted.get(i, ()):
            if hook in running:
                v = v | axes
        return v

    def boundary(ser: tuple, running: tuple, what: str) -> bool:
        for i in ser:
            if seen(i, running) != vma[i]:
                r.fail(f"{what} would vary over {sorted(seen(i, running))} in a replay, "
                       f"not {sorted(vma[i])}")
                return False
        return True

    for e in r.trace:
        if e[0] == "op":
            _, ins, outs, in_hook, running, graded = e
            vs = [seen(i, running) for i in ins]
            u = join(vs) if vs else EMPTY        # (the union rule's own join)
            # (an op under no_grad records no backward: a pvary its replay lacks there
            # changes no gradient, and its output's vma is the union either way)
            if not in_hook and graded and any(r.grad[i] and v != u
                                              for i, v in zip(ins, vs)):
                r.fail(f"an op inside the module would need a pvary to {sorted(u)} in a "
                       f"replay (the module's own code, no boundary)")
                return
            for o in outs:
                hv[o] = u
            if in_hook and not boundary(outs, running, "a value a hook computes"):
                return
        elif e[0] == "args":
            if not boundary(e[2], e[3], f"an argument of {e[1]!r}"):
                return
        elif e[0] == "enter":
            for pos, i in e[2]:
                axes = rec.lifts.get(e[1], {}).get(pos)
                if axes:
                    lifted.setdefault(i, []).append((e[1], axes))
        elif not boundary(e[2], e[3] + (e[1],), f"the output of {e[1]!r}"):
            return
    boundary(result, (), "the module's result")


def _boundary_vmas(r: Recorder) -> None:
    """The vmas a replay gives each hook's arguments and output (the call's, the same
    at every call of one hook)."""
    for kind, table in (("args", r.rec.args), ("left", r.rec.outs)):
        for e in r.trace:
            if e[0] == kind:
                vs = tuple([r.vma[i] for i in e[2]])
                if table.setdefault(e[1], vs) != vs:
                    r.fail(f"planned module {e[1]!r} is called with other vmas at "
                           f"another call")


class Recording(UnionRule):
    """The union rule for a planned module's first call: the same decisions, and its
    :class:`Recorder` told which watched tensors each op used as they are."""

    def __init__(self, tracker: Tracker, recorder: Recorder):
        mode = tracker.mode
        super().__init__(tracker)
        tracker.mode = mode          # (the caller makes this the tracker's mode)
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rec = self.recorder
        if self.tr._paused:
            return super().__torch_function__(func, types, args, kwargs)
        ins = rec.before(args, kwargs)
        out = super().__torch_function__(func, types, args, kwargs)
        rec.after(ins, out)
        return out

    def _write(self, t: torch.Tensor, union: frozenset) -> None:
        """An in-place op writes a value varying over ``union`` into ``t``: a tensor
        that needs a gradient made more varying in place is a decision inside the
        module that no boundary sees (one that needs none changes only its tag, and
        the trace follows the op's result)."""
        root = t if t._base is None else t._base
        if root.requires_grad and union - self.tr.get(root):
            self.recorder.fail("a tensor that needs a gradient is written in place with "
                               "a value varying over more axes")
        self.tr.pvary_inplace(t, union)

    def hook_functions(self, ts) -> None:
        self.recorder.fail("a custom autograd Function mixes values of different vmas")
        super().hook_functions(ts)

    def _autograd_grad(self, func, args, kwargs):
        self.recorder.fail("torch.autograd.grad is called inside the module")
        return super()._autograd_grad(func, args, kwargs)


class Scope:
    """The replay's state while one planned call is recorded (``recorder`` given: the
    call runs under a :class:`Recording` rule, put on the torch-function stack in place
    of the body's) or replayed (no recorder): the tracker's ``replay`` while the
    ``with`` block runs, and ``hooks`` the plan's hooks' handler (``call.vma``), both
    set here and cleared here, whatever the block raises. Nothing else carries it.

    Example::

        with Scope(tr, call_state, _Replaying(tr, rec)):
            out = run(aliased)
    """

    def __init__(self, tr: Tracker, call, hooks, recorder: Recorder | None = None) -> None:
        self.tr, self.call, self.hooks, self.recorder = tr, call, hooks, recorder
        self.mode = None       # the body's rule, while a Recording one stands in

    def __enter__(self) -> "Scope":
        tr = self.tr
        if self.recorder is not None:
            self.mode = tr.mode
            rule = Recording(tr, self.recorder)
            pop_rule()
            push_rule(rule)
            tr.mode = rule
        tr.replay, self.call.vma = self, self.hooks
        return self

    def collective(self, what: str) -> None:
        """A functp collective runs in the call. In a style's hook it runs under the
        rule in a replay too; in the module's own code (functp.attention's K/V
        all-gather) a replay has no tags for its input, which would read as invariant
        and be pvary'd (its gradient psum'd): not replayable."""
        r = self.recorder
        if r is not None and not r.in_hook:
            r.fail(f"functp.{what} runs in the module's own code")

    def __exit__(self, *exc) -> None:
        tr = self.tr
        tr.replay, self.call.vma = None, None
        if self.recorder is not None:
            pop_rule()
            push_rule(self.mode)
            tr.mode = self.mode
