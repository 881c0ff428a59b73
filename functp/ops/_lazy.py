"""Forward collectives waited on at the first use of their result.

A collective a shard_map body calls (``psum``, ``pmax``/``pmin``, ``all_gather``,
``psum_scatter``, ``ppermute``) is launched at once and its result handed out before
its data has arrived, marked pending (a key in the tensor's ``__dict__``). A
``TorchDispatchMode`` (:class:`_Waits`), pushed on this thread's dispatch stack only
while something is pending, waits on that collective just before any op reads the
result. A dispatch mode sits below torch.func's layers: under ``torch.func.grad`` it
sees the very tensors the collectives' kernels returned, as under tape autograd. A
view of a pending result (``view``, ``movedim``, ``detach``...) reads nothing: it is
marked pending too, and the wait comes at the first op that reads either.

A mode cannot pop itself while it handles an op (torch stashes it meanwhile and
pushes it back), so once nothing is pending it is popped by the next torch call of
the body (the vma ``UnionRule`` calls :func:`check`), by the next launch, or at the
body's exit. ``check`` also waits before the host reads that bypass dispatch
(``.numpy()``, ``.tolist()``, ``data_ptr()``).

The body's exit waits every pending collective (:func:`settle`): a result returned
unused, or left behind by an exception, never leaves the body in flight.

Waited on at once instead, as before (:func:`ready` says no): outside a vma-tracked
body (``check_vma=False``: no per-op hook to see host reads), under ``vmap`` or more
than one torch.func level (a batching rule hands the mode other tensors), inside a
backward (the autograd engine restores the thread's modes per node), under any
other dispatch mode (``torch.compile``'s tracing, ``functp.estimate``'s fake mode,
remat), and with ``functp.set_overlap(forward=False)``.
"""
from __future__ import annotations

import threading

import torch

from . import _context
from ..runtime._torch_compat import (TorchDispatchMode, TransformGrad, current_graph_task_id,
                                     dispatch_mode_at, dispatch_stack_len, forward_ad as fwd_ad,
                                     layer_stack_depth,
                                     peek_interpreter_stack, pop_dispatch_mode,
                                     push_dispatch_mode)

PENDING = "_functp_pending"     # a pending result's __dict__ key: its Pending

_PLAIN = {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.Size,
          torch.memory_format, torch.layout}     # (set membership costs no Python call)
# host reads that do not go through dispatch (the mode would not see them)
_HOST_READS = {torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.data_ptr,
               torch.Tensor.__array__, torch.Tensor.__dlpack__, torch.Tensor.untyped_storage,
               torch.Tensor.storage}


class _State(threading.local):
    """This thread's pending collectives (a simulated rank is a thread, and dispatch
    modes are per thread)."""
    forward = True      # laziness on: the process's setting; a simulated rank's own
    on = False          # something pending, or our mode pushed: the body's calls check
    pushed = False      # our mode is on the dispatch stack, pushed at torch.func ``depth``
    depth = 0
    allow = False       # the collective being called may be held (allow())
    tracker = None      # the body (its vma Tracker) whose torch.func depth is ``lazy_depth``
    lazy_depth = None   # (None: waits at once at this body's level)

    def __init__(self) -> None:
        self.pending: list = []         # prim.Pending, in launch order
        self.mode = _Waits(self)


class _Waits(TorchDispatchMode):
    """Waits on a pending collective before an op reads its result; marks views."""

    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state      # (an engine thread may run us with another's state)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.state.pending:
            hit = None
            for a in (*args, *kwargs.values()) if kwargs else args:
                c = a.__class__
                if c is list or c is tuple:        # torch.cat's list
                    for t in a:
                        if isinstance(t, torch.Tensor) and PENDING in t.__dict__:
                            hit = _found(hit, t)
                elif (c is torch.Tensor or c not in _PLAIN and isinstance(a, torch.Tensor)) \
                        and PENDING in a.__dict__:
                    hit = _found(hit, a)
            if hit is not None:
                if func.is_view and len(hit) == 1:    # reads nothing: pending too
                    out = func(*args, **kwargs) if kwargs else func(*args)
                    _mark(out, hit[0])
                    return out
                for p in hit:
                    _settle(self.state, p)
        return func(*args, **kwargs) if kwargs else func(*args)


_state = _State()


def _found(hit: list | None, t: torch.Tensor) -> list | None:
    p = t.__dict__[PENDING]
    if p.marked is None:          # (a stale mark: copied with a __dict__, say)
        del t.__dict__[PENDING]
        return hit
    if hit is None:
        return [p]
    if p not in hit:
        hit.append(p)
    return hit


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
    st = _state
    if fwd_ad._current_level >= 0:      # a jvp rule would read the result at once
        return
    if st.tracker is not tr:            # (once per body call)
        st.tracker, st.lazy_depth = tr, _body_depth()
    depth = st.lazy_depth
    if depth is not None and current_graph_task_id() < 0 and layer_stack_depth() == depth:
        st.allow = True


def _body_depth() -> int | None:
    """The torch.func depth of the body now running if its collectives may wait
    lazily there: tape autograd (0) or one ``torch.func.grad`` (1); else None."""
    interp = peek_interpreter_stack()
    if interp is None:
        return 0
    return 1 if layer_stack_depth() == 1 and interp.key() == TransformGrad else None


def ready() -> bool:
    """In a collective's kernel, after :func:`allow`: may its result be handed out
    pending (under no other dispatch mode)? Consumes the permission."""
    st = _state
    st.allow = False
    n = dispatch_stack_len()
    return not n or dispatch_mode_at(n - 1) is st.mode


def hold(p):
    """Hands out ``p.early`` (a launched collective's result, its data not there
    yet) marked pending; after :func:`ready`, before :func:`activate`."""
    st = _state
    early = p.early
    early.__dict__[PENDING] = p
    p.marked = [early]
    st.pending.append(p)
    st.on = True
    return early


def activate() -> None:
    """Back where the body called the collective, with results pending: our mode
    pushed (if it is not on top already), so that the next op reading one waits for
    it; under another dispatch mode, every pending collective waited on now.

    (The mode is pushed here, not in the kernel: torch.func restores the dispatch
    keys of the level it returns to, which would drop a mode pushed below it.)"""
    st = _state
    if not st.pending:
        return
    n = dispatch_stack_len()
    if n and dispatch_mode_at(n - 1) is st.mode:       # pushed already
        return
    if n:
        settle()
        return
    push_dispatch_mode(st.mode)
    st.pushed, st.depth = True, st.lazy_depth


def _settle(st: _State, p) -> None:
    """Waits on ``p`` (raising its error), its results unmarked first."""
    for t in p.marked:
        t.__dict__.pop(PENDING, None)
    p.marked = None
    st.pending.remove(p)
    p.wait()


def _release(st: _State) -> None:
    """Pops our mode once nothing is pending, where it was pushed: on top of the
    dispatch stack, at the same torch.func depth, not inside a backward (the engine
    restores a node's modes, and we would lose count)."""
    if st.pending:
        return
    n = dispatch_stack_len()
    top = dispatch_mode_at(n - 1) if n else None
    if top is not st.mode:
        if not n:                # (popped by someone else, or never pushed)
            st.pushed = st.on = False
    elif current_graph_task_id() < 0 and layer_stack_depth() == st.depth:
        pop_dispatch_mode(None)
        st.pushed = st.on = False


def check(func) -> None:
    """Before each torch call of a body while ``on``: pops our
    mode once nothing is pending; pushes it if a result is pending and it is not
    there yet; waits on everything before a host read that bypasses dispatch."""
    st = _state
    if not st.pending:
        _release(st)
    elif func in _HOST_READS:
        settle()
    elif not st.pushed:       # (pending, and not pushed: a mode was in the way)
        activate()


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
            _settle(st, st.pending[0])
        except Exception as e:      # noqa: BLE001 - the first is raised below
            if first is None:
                first = e
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
