"""Rematerialization (JAX's ``jax.checkpoint``/``remat``) that works inside a
``shard_map`` body and under ``torch.func`` transforms.

``torch.utils.checkpoint`` relies on saved-tensor hooks, which ``torch.func.grad``
refuses, and it recomputes after the body has returned, where collectives have no
mesh. Here a checkpointed call runs forward once with grad off (nothing saved but
its inputs and what the policy keeps), and an ``autograd.Function`` standing for it
recomputes it in the backward, with the body's frame and vma tags restored: the
forward's collectives run again, and the backward's are the same as without
checkpointing. A policy keeps chosen op outputs from the first run (matmuls, named
values); the recompute still *calls* those ops, under autograd,
but a dispatch mode returns the kept outputs instead of computing them, so gradients
flow through them as usual.

A tensor the function closes over (a weight it reads, not an argument) gets its
gradient too, as with ``torch.utils.checkpoint``: the first run runs under no_grad, so
any tensor an op of it reads that requires grad comes from outside (:class:`_Reads`
collects them); they join the Function's inputs, and the recompute reads them
through a function mode that hands it those inputs instead (:class:`_Swap`). A
module's parameters that ``functional_call`` swapped in are gone from the module by
the backward: ``functionalize``'s and ``parallelize``'s apply say how to swap them in
again (``recompute_within``, ``mapping/_param_swap.py``), and the recompute does, with
its own inputs. Both swap them in with ``ParamSwap`` (``functional_call``'s swap, the
module's layout found once).
"""
from __future__ import annotations

import contextlib
import functools
import random
import sys
import threading
from typing import Callable

import optree
import torch
from torch.overrides import TorchFunctionMode

from ..mapping._param_swap import recompute_contexts
from ..ops import _context
from ..runtime import _compile
from ..runtime._errors import ShardingError
from ..runtime._torch_compat import (DisableFuncTorch, TorchDispatchMode, layer_stack_depth,
                                     unwrap_functorch as _lowest)

__all__ = ["checkpoint", "remat", "checkpoint_name", "remat_policies"]

_aten = torch.ops.aten
_DOTS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


class _Local(threading.local):      # per thread: functp.simulate runs a rank per thread
    def __init__(self) -> None:
        self.recording: list = []   # the _Record of the checkpointed call running forward, if any
        self.recomputing = 0        # recomputes running (a checkpoint inside one runs plainly)


_local = _Local()


class remat_policies:
    """What a :func:`checkpoint`'d call keeps from its forward (JAX's
    ``jax.checkpoint_policies``): a policy maps ``(op, name)`` — an aten or functp
    op, and the name given with :func:`checkpoint_name` or ``None`` — to whether its
    output is kept instead of recomputed."""

    @staticmethod
    def nothing_saveable(op, name) -> bool:
        return False

    @staticmethod
    def dots_saveable(op, name) -> bool:
        return op in _DOTS

    @staticmethod
    def save_only_these_names(*names: str) -> Callable:
        keep = frozenset(names)
        return lambda op, name: name in keep


def checkpoint_name(x: torch.Tensor, name: str) -> torch.Tensor:
    """Names ``x`` for a ``save_only_these_names`` policy: the op that made it keeps
    its output. Outside a checkpointed function's first run it does nothing.

    **Arguments:** ``x`` – a tensor computed inside a checkpointed function;
    ``name`` – a string. **Returns:** ``x``. Example::

        h = functp.checkpoint_name(x @ w.T, "proj")
    """
    if _local.recording and _local.recording[-1] is not None:
        _local.recording[-1].names[id(_lowest(x))] = name
    return x


def _sig(args) -> tuple:
    return tuple(tuple(a.shape) for a in optree.tree_leaves(args) if isinstance(a, torch.Tensor))


class _Record(TorchDispatchMode):
    """The first (no-grad) run: every op with its input shapes and outputs, in order;
    and the names given to outputs."""

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.names: dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, _sig(args), out))
        return out

    def kept(self, keep) -> dict[int, tuple]:
        out = {}
        for i, (op, sig, o) in enumerate(self.ops):
            name = self.names.get(id(o)) if isinstance(o, torch.Tensor) else None
            if keep(op, name):
                out[i] = (op, sig, o)
        return out


class _Generators(TorchDispatchMode):
    """The first run: the state of each ``torch.Generator`` an op is given
    (``generator=``, keyword-only in every aten schema), as it was before its first
    use, so that the recompute draws the same numbers."""

    def __init__(self):
        super().__init__()
        self.states: dict[int, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        g = kwargs.get("generator") if kwargs else None
        if g is not None and id(g) not in self.states:
            self.states[id(g)] = (g, g.get_state())
        return func(*args, **(kwargs or {}))


class _Replay(TorchDispatchMode):
    """The recompute: op ``i`` returns the kept output of op ``i`` of the first run
    when it is the same op (else everything is computed from there on)."""

    def __init__(self, kept: dict[int, tuple]):
        super().__init__()
        self.kept, self.i, self.on = kept, 0, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        i, self.i = self.i, self.i + 1
        hit = self.kept.get(i) if self.on else None
        if hit is not None and hit[0] is func and hit[1] == _sig(args):
            return optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t,
                                   hit[2])
        if hit is not None:
            self.on = False       # the op sequence changed: compute from here on
        return func(*args, **(kwargs or {}))


def _tensors(args, kwargs):
    """The tensors among a torch call's arguments (and in its lists: ``torch.cat``)."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


_MADE = "_functp_remat_made"     # a tensor's __dict__ key: the _Reads run that made it


class _Reads(TorchFunctionMode):
    """The first run: the tensors its torch calls read that require grad and are
    neither its arguments nor made by the run (each output is marked with the run;
    under torch.func a view made under no_grad still says it requires grad), in
    first-read order: what it closes over (a weight, a module's parameter)."""

    def __init__(self, args: list):
        super().__init__()
        self.args = {id(a) for a in args}
        self.found: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for t in _tensors(args, kwargs):
            if t.requires_grad and id(t) not in self.args \
                    and t.__dict__.get(_MADE) is not self:
                self.found.setdefault(id(t), t)
        out = func(*args, **(kwargs or {}))
        for t in _tensors((out,) if isinstance(out, torch.Tensor) else out, None) \
                if isinstance(out, (torch.Tensor, list, tuple)) else ():
            t.__dict__[_MADE] = self
        return out


class _Swap(TorchFunctionMode):
    """The recompute: each closed-over tensor a torch call reads is replaced by the
    Function's input standing for it (the one differentiated); ``seen`` counts which
    were read (or swapped into a module by a :func:`recompute_within` context)."""

    def __init__(self, closed: list, now: list):
        super().__init__()
        self.map = {id(c): (i, n) for i, (c, n) in enumerate(zip(closed, now))}
        self.seen: set[int] = set()

    def _swap(self, a):
        hit = self.map.get(id(a)) if isinstance(a, torch.Tensor) else None
        if hit is not None:
            self.seen.add(hit[0])
            return hit[1]
        if isinstance(a, (list, tuple)) and any(id(t) in self.map for t in a):
            return type(a)(self._swap(t) for t in a)
        return a

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = tuple(self._swap(a) for a in args)
        kwargs = {k: self._swap(a) for k, a in kwargs.items()} if kwargs else {}
        return func(*args, **kwargs)


def _unread_error(st, missing: list[int]) -> ShardingError:
    name = getattr(st.fn, "__name__", st.fn)
    shapes = ", ".join(f"{tuple(st.closed[i].shape)}" for i in missing[:4])
    return ShardingError(
        f"functp.checkpoint({name}): its first run read {len(missing)} tensor(s) that "
        f"require grad and are not its arguments (shapes {shapes}), but its recompute "
        f"in the backward did not read them: they were reachable only while the forward "
        f"ran (a module's parameters swapped in by functional_call, functionalize's or "
        f"parallelize's apply), so their gradients would be lost. Pass them as "
        f"arguments instead, e.g. functp.checkpoint(lambda p, x: "
        f"torch.func.functional_call(layer, p, (x,)))(layer_params, x)")


class _State:
    """What a recompute needs, in one opaque object: passed to ``apply`` as a dict,
    its tensors would be wrapped by torch.func like the Function's inputs."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Recompute(torch.autograd.Function):
    """Stands for the checkpointed call: forward returns the outputs of the first
    run; backward recomputes them with grad on and differentiates."""

    generate_vmap_rule = True

    @staticmethod
    def forward(state, n_in, *xs_and_outs):
        # the first run's outputs come in as (detached) inputs, so that torch.func
        # hands them over at the level this forward runs at
        return tuple(o.view_as(o) for o in xs_and_outs[n_in:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        state, n_in = inputs[0], inputs[1]
        ctx.state, ctx.n_out = state, len(inputs) - 2 - n_in
        ctx.save_for_backward(*inputs[2:2 + n_in])

    @staticmethod
    def backward(ctx, *cts):
        st = ctx.state
        xs = ctx.saved_tensors
        fr, tracker = st.frame, st.frame.tracker if st.frame is not None else None
        with _context.reentered(fr), _rng(st.rng):
            if tracker is not None:       # the inputs' vma, as the first run saw it
                for x, v in zip(xs, st.vmas):
                    tracker.set(x, v)

            # differentiated only where a gradient is wanted: the transposes of the
            # others (a psum for an input pvary'd inside) would be wasted collectives
            want = [i for i, need in enumerate(ctx.needs_input_grad[2:2 + len(xs)]) if need]

            n_args = len(xs) - len(st.closed)
            swaps = []

            def run(*diff):
                leaves = list(xs)
                for i, d in zip(want, diff):
                    leaves[i] = d
                args = optree.tree_unflatten(st.tree, leaves[:n_args])
                if not st.closed:
                    return tuple(optree.tree_leaves(st.fn(*args)))
                swaps.append(_Swap(st.closed, leaves[n_args:]))
                with swaps[-1], contextlib.ExitStack() as again:
                    for enter in st.contexts:     # (outermost first)
                        again.enter_context(enter(swaps[-1]._swap))
                    return tuple(optree.tree_leaves(st.fn(*args)))
            # torch.func.vjp, not autograd.grad: under torch.func this backward may not
            # make tensors require grad
            # torch.func.grad runs this backward with create_graph=True, so at its
            # level the recompute and its vjp would be recorded and kept until the
            # step ends (no memory saved). With that one level and nothing above it,
            # nobody differentiates this backward: record nothing there.
            quiet = (torch.no_grad() if layer_stack_depth() == 1
                     else contextlib.nullcontext())
            _local.recomputing += 1
            try:
                with quiet, _tracking(tracker), (_Replay(st.kept) if st.kept
                                                 else contextlib.nullcontext()):
                    outs, pull = torch.func.vjp(run, *[xs[i] for i in want])
                cts = tuple(c if c is not None else torch.zeros_like(o)
                            for o, c in zip(outs, cts))
                with quiet, _tracking(tracker):
                    got = pull(cts)
            finally:
                _local.recomputing -= 1
            missing = [i for i in range(len(st.closed)) if i not in swaps[0].seen] \
                if swaps else []
            if missing:
                raise _unread_error(st, missing)
        grads: list = [None] * len(xs)
        for i, g in zip(want, got):
            grads[i] = g
        return (None, None, *grads, *[None] * ctx.n_out)


def _rng_state() -> list:
    """Every random source a recompute can replay, as ``(get, set, state)``: torch's
    CPU generator, the current CUDA device's (once CUDA is in use), Python's
    ``random`` and numpy's global generator (once numpy is imported); the user's
    ``torch.Generator`` objects are added by the first run (:class:`_Generators`).
    Not replayed: numpy ``Generator`` and ``random.Random`` instances, the clock."""
    with DisableFuncTorch():      # plain tensors, also under torch.func
        out = [(torch.get_rng_state, torch.set_rng_state, torch.get_rng_state()),
               (random.getstate, random.setstate, random.getstate())]
        if torch.cuda.is_initialized():
            out.append((torch.cuda.get_rng_state, torch.cuda.set_rng_state,
                        torch.cuda.get_rng_state()))
    np = sys.modules.get("numpy")
    if np is not None:
        out.append((np.random.get_state, np.random.set_state, np.random.get_state()))
    return out


@contextlib.contextmanager
def _rng(states: list):
    """The random sources as the first run found them (dropout masks and the user's
    draws repeat), and as they were again afterwards."""
    with DisableFuncTorch():
        now = [get() for get, _, _ in states]
        for _, put, state in states:
            put(state)
    try:
        yield
    finally:
        with DisableFuncTorch():
            for (_, put, _), state in zip(states, now):
                put(state)


@contextlib.contextmanager
def _tracking(tracker):
    """The union rule for the recompute (the body's mode is gone, or is outside this
    backward); the tracker's own mode is left as it was."""
    if tracker is None:
        yield
        return
    from ..ops._vma_mode import UnionRule
    mode = tracker.mode
    try:
        with UnionRule(tracker):
            yield
    finally:
        tracker.mode = mode


def checkpoint(fn: Callable | None = None, *, policy: Callable | None = None) -> Callable:
    """``fn`` rematerialized: its activations are recomputed in the backward instead
    of kept (JAX's ``jax.checkpoint``).

    **Arguments:** ``fn`` – a function of tensors (pytrees allowed) returning tensors;
    it may call functp's collectives when called inside a ``shard_map`` body.
    ``policy`` – what to keep from the forward instead of recomputing
    (:class:`remat_policies`; default: nothing but the inputs).

    **Returns:** a function with ``fn``'s signature. Under ``torch.func.grad``/``vjp``
    and tape autograd the gradients are those of ``fn``, for its arguments and for
    the tensors it closes over that require grad (a weight, a module's parameters,
    also under ``functionalize``'s and ``parallelize``'s apply), as with
    ``torch.utils.checkpoint``; the recompute issues
    ``fn``'s forward collectives again and draws the same random numbers: torch's
    CPU and CUDA generators, any ``torch.Generator`` passed to an op
    (``generator=``), Python's ``random`` and numpy's global generator are replayed.
    Other sources (``numpy.random.Generator`` or ``random.Random`` objects, the
    clock) are not: a function drawing from them gets other draws in its recompute. Example, one block per layer::

        block = functp.checkpoint(block, policy=functp.remat_policies.dots_saveable)
    """
    if fn is None:
        return functools.partial(checkpoint, policy=policy)
    keep = policy or remat_policies.nothing_saveable

    @functools.wraps(fn)
    def wrapped(*args):
        leaves, tree = optree.tree_flatten(args)
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            raise ShardingError(
                f"functp.checkpoint({getattr(fn, '__name__', fn)}): arguments must be "
                f"tensors (close over other values with functools.partial)")
        if (_local.recording or _local.recomputing
                or not torch.is_grad_enabled() and not any(x.requires_grad for x in leaves)):
            # nothing to differentiate, or inside another checkpointed call, whose
            # recompute covers this one
            return fn(*args)
        # (its first run in a frame of its own: a planned call's recorder sees it, as
        # the recompute runs the union rule again, over inputs a replay leaves untagged)
        fr = _context.top()
        tracker = fr.tracker if fr is not None else None
        rng = _rng_state()
        # (keeping nothing needs no record of the ops, only of the generators used)
        rec = _Record() if keep is not remat_policies.nothing_saveable else None
        gens = _Generators()
        reads = _Reads(leaves)
        _local.recording.append(rec)
        try:
            with torch.no_grad(), gens, rec if rec is not None else contextlib.nullcontext():
                with reads, _context.reentered(fr, "functp.checkpoint"):
                    out = fn(*args)
        finally:
            _local.recording.pop()
        closed = list(reads.found.values())
        rng += [(g.get_state, g.set_state, st) for g, st in gens.states.values()]
        outs, otree = optree.tree_flatten(out)
        if tracker is not None and tracker.mode is not None:
            tracker.mode.discard_nograd()     # no custom Function ran: nothing to hook
        state = _State(fn=fn, tree=tree, kept=rec.kept(keep) if rec is not None else {},
                       frame=fr, rng=rng, closed=closed, contexts=recompute_contexts(),
                       vmas=([tracker.get(x) for x in leaves + closed]
                             if tracker is not None else None))
        del rec
        # one call standing for fn, not tracked: its outputs take the first run's tags
        with tracker.paused() if tracker is not None else contextlib.nullcontext():
            res = _Recompute.apply(state, len(leaves) + len(closed), *leaves, *closed, *outs)
        if tracker is not None:
            for r, o in zip(res, outs):
                tracker.set(r, tracker.get(o))
        return optree.tree_unflatten(otree, list(res))
    return wrapped


remat = checkpoint      # JAX has both names
