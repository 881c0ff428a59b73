"""Forward collectives waited on at the first use of their result.

A collective a vma-tracked shard_map body calls (``psum``, ``pmax``/``pmin``,
``all_gather``, a tiled ``psum_scatter``, ``ppermute``) is launched at once, and its
result handed out before the data has arrived, marked pending (a key in the
``__dict__`` of the kernel's tensor and of the one the body sees, a torch.func
wrapper of it). Three places wait on it:

- the body's next torch calls (:func:`check`, from the vma ``UnionRule``, which sees
  every torch call of the body): one whose arguments include a pending result waits
  on it first. That is the usual case (a TP layer's ``psum`` read by the next op),
  and it costs no more.
- if a call does not read it, a ``TorchDispatchMode`` (:class:`_Waits`) is pushed on
  this thread's dispatch stack, only until nothing is pending: it sits below
  torch.func's layers, so under ``torch.func.grad`` as under tape autograd it sees
  the very tensor the kernel returned, and it waits before the first operator that
  reads it, whatever torch call runs it. A view of a pending result reads nothing:
  it is marked pending too. (A mode cannot pop itself while it handles an operator,
  so the next torch call of the body pops it.)
- the body's exit (:func:`settle`): a result returned unused, or left behind by an
  exception, never leaves the body in flight.

A collective's *input* is protected too: gloo and NCCL read it while the collective
runs, so an operator that writes to its memory before the wait (``out = ppermute(buf,
...)`` then ``buf.zero_()``) would change what the peers receive. The mode waits on
that collective before such an operator runs (:func:`_protect_sends`); a program that
does not write to what it just sent pays nothing for it (measured in
``benchmarks/README.md``, issue 41).

Waited on at once instead, as before (:func:`allow` says no): a body that is not
under tape autograd or one ``torch.func.grad`` (``vmap`` and ``jvp`` hand the mode
other tensors, or read the result in their rules), a call from a transform nested in
the body, a backward (the autograd engine sets each node's modes itself), forward-mode
AD, another dispatch mode (``torch.compile``'s tracing, ``functp.estimate``, remat),
``check_vma=False`` bodies (no ``UnionRule``), and ``functp.set_overlap(forward=False)``.
"""
from __future__ import annotations

import threading

import torch

from . import _context
from ..runtime._torch_compat import (BelowAutograd, DisableFuncTorch, EagerDispatchMode,
                                     TransformGrad, current_graph_task_id, dispatch_mode_at,
                                     dispatch_stack_len, forward_ad as fwd_ad,
                                     layer_stack_depth, peek_interpreter_stack,
                                     pop_dispatch_mode, push_dispatch_mode)

PENDING = "_functp_pending"     # a pending result's __dict__ key: its Pending
_BELOW = -1                     # _settle's depth where the handler waits
_GRAD_BODY = "_functp_grad_body"   # a Tracker's: its body runs under one torch.func.grad

_PLAIN = {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.Size,
          torch.memory_format, torch.layout}     # (set membership costs no Python call)


class _State(threading.local):
    """This thread's pending collectives (a simulated rank is a thread, and dispatch
    modes are per thread)."""
    forward = True      # laziness on: the process's setting; a simulated rank's own
    on = False          # something pending, or our mode pushed: the body's calls check
    pushed = False      # our mode is on the dispatch stack, pushed at torch.func ``depth``
    depth = 0
    allow = False       # the collective being called may be held (allow())
    last = None         # the Pending just held, for activate()
    lazy_depth = None   # the torch.func depth of the body that held them

    def __init__(self) -> None:
        self.pending: list = []         # prim.Pending, in launch order
        self.mode = _Waits(self.pending)


class _Waits(EagerDispatchMode):
    """Waits on a pending collective before an op reads its result; marks views."""

    def __init__(self, pending: list) -> None:
        super().__init__()
        # its thread's list itself (an autograd engine's device thread may run the
        # mode with the state it captured, not its own)
        self.pending = pending

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.pending:
            if func._schema.is_mutable:    # (an attribute: the usual op pays no call)
                _protect_sends(self.pending, func, args, kwargs)
            hit = None
            for a in (*args, *kwargs.values()) if kwargs else args:
                c = a.__class__
                if c is list or c is tuple:        # torch.cat's list
                    for t in a:
                        if isinstance(t, torch.Tensor) and PENDING in t.__dict__:
                            hit = _found(hit, t)
                elif (c is torch.Tensor or c not in _PLAIN and isinstance(a, torch.Tensor)) \
                        and PENDING in a.__dict__:
                    p = a.__dict__[PENDING]
                    if hit is None and p.marked is not None:    # (the usual case inline)
                        hit = [p]
                    else:
                        hit = _found(hit, a)
            if hit is not None:
                if func.is_view and len(hit) == 1:    # reads nothing: pending too
                    out = func(*args, **kwargs) if kwargs else func(*args)
                    _mark(out, hit[0])
                    return out
                for p in hit:
                    _settle(self.pending, p, _BELOW)
        return func(*args, **kwargs) if kwargs else func(*args)


_state = _State()


def _live(t: torch.Tensor):
    """The collective ``t`` is marked pending on, or None for a stale mark (one copied
    with a ``__dict__``, say, after its collective was waited on), removed here."""
    p = t.__dict__[PENDING]
    if p.marked is None:
        del t.__dict__[PENDING]
        return None
    return p


def _found(hit: list | None, t: torch.Tensor) -> list | None:
    p = _live(t)
    if p is None:
        return hit
    if hit is None:
        return [p]
    if p not in hit:
        hit.append(p)
    return hit


_WRITES: dict = {}      # an operator -> the (position, name) of each argument it writes


def _written(func) -> tuple:
    w = _WRITES.get(func)
    if w is None:
        w = _WRITES[func] = tuple((i, a.name) for i, a in enumerate(func._schema.arguments)
                                  if a.alias_info is not None and a.alias_info.is_write)
    return w


def _protect_sends(pending: list, func, args, kwargs) -> None:
    """Before ``func`` writes in place: each pending collective whose input shares
    memory with a tensor it writes is waited on first, so that the peers receive the
    value the body sent, not the one written after (a snapshot of every input would
    cost a copy per collective; this costs nothing where the input is not written)."""
    sends = [p for p in pending if p.src]
    if not sends:
        return
    for i, name in _written(func):
        a = args[i] if i < len(args) else (kwargs or {}).get(name)
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                for p in sends:
                    if p.src == ptr and p.marked is not None:
                        _settle(pending, p, _BELOW)


def _mark(out, p) -> None:
    for t in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(t, torch.Tensor):
            t.__dict__[PENDING] = p
            p.marked.append(t)


def allow(tr) -> None:
    """Where a body (``tr`` its vma Tracker) is about to call a collective: lets its
    kernel hand the result out pending (:func:`ready`) if the body runs under tape
    autograd or one ``torch.func.grad`` and the call is made at the body's own level
    (not in a transform nested in it, not in a backward, not under forward-mode AD).
    The kernel cannot tell: below torch.func's layers it sees none of them."""
    if fwd_ad._current_level >= 0:      # a jvp rule would read the result at once
        return
    interp = peek_interpreter_stack()
    if interp is None:
        if tr.level != -1:       # (a tape body's level is -1)
            return
    elif interp.level() != tr.level:    # a transform nested in the body
        return
    else:
        d = tr.__dict__
        if _GRAD_BODY not in d:         # (once per body call)
            d[_GRAD_BODY] = layer_stack_depth() == 1 and interp.key() == TransformGrad
        if not d[_GRAD_BODY]:
            return
    if current_graph_task_id() < 0:
        st = _state
        st.allow, st.lazy_depth = True, 0 if interp is None else 1


def ready() -> bool:
    """In a collective's kernel, after :func:`allow`: may its result be handed out
    pending (under no other dispatch mode)? Consumes the permission."""
    st = _state
    st.allow = False
    n = dispatch_stack_len()
    return not n or dispatch_mode_at(n - 1) is st.mode


def hold(p, src: torch.Tensor | None = None):
    """Hands out ``p.early`` (a launched collective's result, its data not there
    yet) marked pending; after :func:`ready`, before :func:`activate`. ``src``: the
    tensor the collective reads while it runs (its input, unless the backend copied
    it at the launch): an operator writing to its memory first waits on ``p``."""
    st = _state
    if src is not None and src.numel():
        p.src = src.untyped_storage().data_ptr()
    early = p.early
    early.__dict__[PENDING] = p
    p.marked = [early]
    st.pending.append(p)
    st.on = st.last = p
    return early


def activate(out: torch.Tensor) -> None:
    """Back where the body called the collective: its result as the body sees it
    (``out``: under torch.func, a wrapper of the kernel's) marked pending too, so
    that :func:`check` sees the body's next call read it."""
    st = _state
    p, st.last = st.last, None
    if p is not None and p.marked is not None and out is not p.early:
        out.__dict__[PENDING] = p
        p.marked.append(out)


def check(args, kwargs) -> None:
    """Before each torch call of a body while ``on``: a pending result among the
    arguments is waited on now (the usual case: a result used by the next call;
    also a host read, ``.numpy()``, ``.tolist()``, which bypasses dispatch); if
    results stay pending, our mode is pushed, to wait on them at the first operator
    that reads them (below torch.func, in whatever the call does); once nothing is,
    it is popped."""
    st = _state
    if st.pending:
        for a in (*args, *kwargs.values()) if kwargs else args:
            c = a.__class__
            if c is list or c is tuple:
                for t in a:
                    if isinstance(t, torch.Tensor) and PENDING in t.__dict__:
                        _settle_marked(st, t)
            elif (c is torch.Tensor or c not in _PLAIN and isinstance(a, torch.Tensor)) \
                    and PENDING in a.__dict__:
                p = a.__dict__[PENDING]
                if p.marked is not None:      # (the usual case inline)
                    _settle(st.pending, p, st.lazy_depth)
                else:
                    _settle_marked(st, a)
        if st.pending and not st.pushed:
            _push(st)
    if not st.pending:
        if st.pushed:
            _release(st)
        else:
            st.on = False


def _settle_marked(st: _State, t: torch.Tensor) -> None:
    p = _live(t)
    if p is not None:
        _settle(st.pending, p, st.lazy_depth)


def _push(st: _State) -> None:
    """Our mode on the dispatch stack, at the body's level (where it will be popped:
    torch.func restores the dispatch keys of a level it returns to, which would drop
    a mode pushed in a transform nested in the body); where it cannot be (there, in
    a backward, above another mode), every pending collective waited on now."""
    if (dispatch_stack_len() or current_graph_task_id() >= 0
            or layer_stack_depth() != st.lazy_depth):
        settle()
        return
    push_dispatch_mode(st.mode)
    st.pushed, st.depth = True, st.lazy_depth


def _settle(pending: list, p, depth: int) -> None:
    """Waits on ``p`` (raising its error), its results unmarked first and ``p`` taken
    off ``pending``; ``depth``: the torch.func depth called at (``_BELOW``: from the
    mode's handler, below torch.func and autograd already)."""
    for t in p.marked:
        t.__dict__.pop(PENDING, None)
    p.marked = None
    pending.remove(p)
    # below autograd (and torch.func): the wait's Python autograd kernel costs calls
    if depth == _BELOW:
        p.wait()
    elif depth:
        with DisableFuncTorch(), BelowAutograd():
            p.wait()
    else:
        with BelowAutograd():
            p.wait()


def _release(st: _State) -> None:
    """Once nothing is pending: our mode popped where it was pushed (on top of the
    dispatch stack, at the same torch.func depth, not inside a backward: the engine
    restores a node's modes, and we would lose count)."""
    if not st.pushed:
        st.on = False
        return
    n = dispatch_stack_len()
    top = dispatch_mode_at(n - 1) if n else None
    if top is not st.mode:
        if not n:                # (popped by someone else)
            st.pushed = st.on = False
    elif current_graph_task_id() < 0 and layer_stack_depth() == st.depth:
        pop_dispatch_mode(None)
        st.pushed = st.on = False


def settle(quiet: bool = False) -> None:
    """Waits on every pending collective of this thread, in launch order, and pops
    the mode: at a body's exit. Raises the first failure (every one is waited on
    first, so none is left unwaited), unless ``quiet`` (an exception is already
    leaving the body). Example::

        y = functp.psum(x, "tp")       # launched; y pending
        ...
        settle()                       # y holds the sum (what a body's exit does)
    """
    st = _state
    first = None
    while st.pending:
        try:
            _settle(st.pending, st.pending[0], st.lazy_depth)
        except Exception as e:      # noqa: BLE001 - the first is raised below
            if first is None:
                first = e
    st.last = None
    _release(st)
    if first is not None and not quiet:
        raise first


def set_forward(on: bool, rank: bool) -> None:
    """``functp.set_overlap(forward=...)``: for a simulated rank (``rank``), its own;
    else the process's."""
    if rank:
        _state.forward = on
    else:
        _State.forward = on
