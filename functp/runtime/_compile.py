"""What functp does under ``torch.compile``: every decision about tracing, in one place.

- **Is something tracing?** :data:`dynamo_tracing` (Dynamo runs the Python) and
  :data:`tracing` (Dynamo, or AOTAutograd running the Python on fake tensors): the
  other modules ask these, never ``torch.compiler`` themselves.
- **What Dynamo traces.** A ``check_vma=False`` shard_map body and the collectives in
  it: Dynamo traces them (the collectives' fake kernels give their shapes). A
  ``check_vma=True`` body: one opaque call (:func:`opaque`), which AOTAutograd runs
  as Python, the tracking mode included; Dynamo never traces the mode.
- **What is refused.** ``torch.compile`` inside :func:`functp.simulate` (simulated
  ranks take turns at each collective's wait, and a compiled graph waits inside): at a
  shard_map call (:func:`refused`, then :func:`refuse`, before anything of the body
  is traced), and, for collectives reached another way, at a simulated collective
  (:func:`check_collective`) and at a collective's fake kernel (:func:`check_fake`).
- **A compiled function called inside an eager vma body** runs eagerly, compiling
  nothing (:func:`eager_enter`/:func:`eager_exit`, around the tracking mode): Dynamo
  would trace the mode's rule for each torch call, and cannot (the tags live in the
  tensors' ``__dict__``); eagerly, the union rule sees its every op, as uncompiled.

Example::

    from functp.runtime import _compile
    _compile.tracing()          # False in eager mode, True inside a compiled function
"""
from __future__ import annotations

import contextlib
import functools
import re
import threading
import types
import warnings
from typing import Any, Callable

import optree
import torch

from . import _torch_compat
from . import _world
from ._errors import ShardingError, keystr

# aliases, not wrappers: asked on every shard_map call and collective
dynamo_tracing = torch.compiler.is_dynamo_compiling
tracing = _torch_compat.is_compiling       # (torch < 2.13: not only Dynamo's own traces)

REFUSED = (
    "torch.compile inside functp.simulate is not supported: simulated ranks take turns "
    "at each collective's wait, and a compiled graph waits inside; run the compiled "
    "step under torchrun")


def _raise_refused():
    raise ShardingError(REFUSED)


def refused() -> bool:
    """At a shard_map call: is it being compiled inside functp.simulate? Then the
    caller returns ``refuse()`` at once, before anything of the body is traced
    (traced by Dynamo, this answers a constant)."""
    return _world.SIMULATING and tracing()


# The refusal is a call Dynamo must not trace: a graph break that then runs it, which
# raises this ShardingError (fullgraph=False), or Dynamo's own error quoting the reason
# (fullgraph=True). (Traced, its raise would make Dynamo go on tracing the body's own
# frames one by one; and a graph break inside a function that asks refused() would
# run that function eagerly, where nothing is compiling.) Made by arm_refusal() as
# functp.simulate starts, the only place it is called from: torch.compiler.disable
# imports torch._dynamo, which import functp need not pay.
refuse = _raise_refused


def arm_refusal() -> None:
    """Makes :data:`refuse` the call Dynamo does not trace (as functp.simulate starts,
    before any rank can compile: Dynamo cannot trace making it)."""
    global refuse
    if refuse is _raise_refused:
        refuse = torch.compiler.disable(_raise_refused, reason=REFUSED)


def check_collective() -> None:
    """Before a simulated rank issues a collective: what cannot be simulated (a vma
    body traced as Python on fake tensors reaches here, not the fake kernels)."""
    if tracing() and _world.current_run() is not None:
        raise ShardingError(REFUSED)
    _world.check_collective()


def check_fake() -> None:
    """In a collective's fake kernel: a compiled graph waits on its collectives itself,
    so no simulated rank could hand the turn to the next one."""
    if _world.current_run() is not None:
        raise ShardingError(REFUSED)


def check_traceable(out: Any, name: str) -> None:
    """What a compiled vma body may return: tensors and numbers (``nonstrict_trace``
    passes nothing else back to Dynamo, and says only "Unsupported output type")."""
    paths, leaves, _ = optree.tree_flatten_with_path(out, none_is_leaf=True)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, (torch.Tensor, int, float, bool)):
            raise ShardingError(
                f"{keystr('output', path)} of shard_map body {name!r} is "
                f"{type(leaf).__name__}: under torch.compile a vma body returns only "
                f"tensors and numbers; return the other values outside the shard_map'd "
                f"function (or pass check_vma=False)")


class _NoneArg:
    """Stands for a ``None`` argument across ``nonstrict_trace``, which refuses
    ``None`` leaves but takes a registered pytree constant made before Dynamo ran."""

    def __eq__(self, other):
        return isinstance(other, _NoneArg)

    def __hash__(self):
        return 0


_NONE = _NoneArg()
_NO_CONTEXT = contextlib.nullcontext()
_torch_compat.register_pytree_constant(_NoneArg)


def _nones(x, old, new):
    """``x`` with the leaves that are ``old`` replaced by ``new`` (in tuples, lists
    and dicts: the containers shard_map's arguments come in)."""
    if x is old:
        return new
    if isinstance(x, tuple) and hasattr(x, "_fields"):        # a namedtuple
        return type(x)(*[_nones(y, old, new) for y in x])
    if isinstance(x, (tuple, list)):
        return type(x)(_nones(y, old, new) for y in x)
    if isinstance(x, dict):
        return type(x)((k, _nones(v, old, new)) for k, v in x.items())
    return x


class Opaque:
    """A vma body as Dynamo sees it (made by :func:`opaque`): ``fn``, the opaque call,
    and ``constants``, the tensors the body reads without getting them as
    arguments (``(owner, name)``: a module's buffer, or a closure cell's tensor)."""

    def __init__(self, fn: Callable, constants: list):
        self.fn, self.constants = fn, constants


def opaque(run: Callable, name: str, f: Callable | None = None) -> Opaque | None:
    """``run(*args)`` (a vma body) as Dynamo sees it: one opaque call
    (``nonstrict_trace``), which AOTAutograd then traces by running it as Python on
    fake tensors. The tracking mode runs there as in eager mode, so the compiled graph
    has the vma rules' collectives, no more, and vma errors are raised while compiling.
    (Dynamo cannot trace the mode itself: the tags live in the tensors' ``__dict__``.)
    The tensors ``f`` reads without getting them (:func:`constants`: a module's
    buffers, such as a rotary table) are passed to the call too, so that the graph
    gets them as inputs: read from the module as real tensors, they would be
    constants of the graph, which Inductor refuses.
    Dynamo accepts only functions made outside the region it compiles: ``None`` for a
    body made while it traces. Call the result with :func:`call_opaque`."""
    if dynamo_tracing():
        return None
    disable, nonstrict_trace = _torch_compat.dynamo()   # (0.3 s, at the first shard_map)
    owners = constants(f) if f is not None else []

    # A closure (Dynamo drops a bound method's self). AOTAutograd runs it, not Dynamo;
    # should Dynamo fall back to running it (a graph break), it must not trace it
    # either, or it would meet this call again.
    def opaque_body(consts, *args):
        try:
            # (torch < 2.13: torch.compiler.is_compiling() is false here unless told;
            # transformers' mask code asks it to stay off data-dependent branches)
            session = _torch_compat.compiling_context() if tracing() else _NO_CONTEXT
            with _in_place_of(owners, consts), session:
                out = run(_nones(args, _NONE, None))
            if tracing():
                check_traceable(out, name)
            return out
        except Exception as e:
            if tracing() and _data_dependent(e):
                own = _own_error(e)
                error = own or untraceable(name, e)
                warnings.warn(str(error), stacklevel=2)
                if _torch_compat.one_graph():
                    # Dynamo answers any other error of this call with only "Unsupported
                    # output type for nonstrict_trace-ed function"; this one it passes on
                    # with its text (see untraceable). (A cannot_compile error is e's
                    # cause, or e: chained to e it would make a cycle of causes, which
                    # Dynamo walks to the end)
                    raise error from (None if own is not None else e)
                raise       # (a graph break: without fullgraph=True the body runs eagerly)
            if not isinstance(e, ShardingError):
                raise
            if tracing():
                # with fullgraph=True Dynamo reports only "Unsupported output type for
                # nonstrict_trace-ed function", without this error's text
                warnings.warn(f"torch.compile could not trace the shard_map body "
                              f"{name!r}: {e}{_hint(e)}", stacklevel=2)
            raise
    return Opaque(nonstrict_trace(disable(opaque_body)), owners)


# A body whose Python branches on a tensor's values cannot be one graph; the common case
# in transformers models, named with the setting that compiles
_DATA_DEPENDENT = (
    ". Compiled, a body's Python may not branch on a tensor's values (a data-dependent "
    "expression: the unsharded model compiled with fullgraph=True fails the same way); "
    "transformers' MoE experts with experts_implementation='eager' loop over the experts "
    "that got tokens: build the model with experts_implementation='batched_mm'")


def _hint(e: Exception) -> str:
    return _DATA_DEPENDENT if "data-dependent" in str(e) else ""


def _data_dependent(e: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    return isinstance(e, GuardOnDataDependentSymNode) or isinstance(
        e.__cause__, GuardOnDataDependentSymNode)


@functools.cache
def _untraceable_type() -> type:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    class UntraceableBody(ShardingError, GuardOnDataDependentSymNode):
        """A compiled shard_map body whose Python branches on a tensor's values. Also a
        GuardOnDataDependentSymNode: the one error of a ``nonstrict_trace`` call whose
        text Dynamo shows (as a UserError made from it), so that the user reads this
        message, not "Unsupported output type"."""

        def __init__(self, message: str, cond: Any = None, own: bool = False):
            ShardingError.__init__(self, message)
            self.cond, self.own = cond, own
    return UntraceableBody


def cannot_compile(message: str) -> ShardingError:
    """The error for a part of functp that cannot be one graph, raised while
    ``torch.compile`` traces a body (``message``: what, why and the fix): with
    ``fullgraph=True`` it is the error the user reads (its text as it is, not
    :func:`untraceable`'s); without, a graph break, and the body runs eagerly.

    Example::

        if _compile.tracing():
            raise _compile.cannot_compile("X reads counts on the host; give Y instead")
    """
    return _untraceable_type()(message, own=True)


def _own_error(e: BaseException) -> BaseException | None:
    """A :func:`cannot_compile` error, raised as ``e`` or as its cause (a planned
    module's hook wraps what its style raised)."""
    for x in (e, e.__cause__):
        if getattr(x, "own", False) and isinstance(x, _untraceable_type()):
            return x
    return None


def untraceable(name: str, e: BaseException) -> ShardingError:
    """The error for a compiled body ``name`` that raised the data-dependent ``e``
    (a ShardingError from a planned module, or torch's own): the module, the cause and
    the fix, first."""
    found = re.search(r"module '([^']*)' \((\w+)\) raised", str(e))
    where = f"module {found[1]!r} ({found[2]}) of it " if found else ""
    raw = e.__cause__ if isinstance(e, ShardingError) and e.__cause__ is not None else e
    return _untraceable_type()(
        f"torch.compile(fullgraph=True) cannot make one graph of the shard_map body "
        f"{name!r}: {where}branches on a tensor's values ({type(raw).__name__}: "
        f"{str(raw).strip().splitlines()[0] if str(raw).strip() else ''}); the plan is "
        f"not the cause (the unsharded model compiled with fullgraph=True fails the same "
        f"way). transformers' MoE experts with experts_implementation='eager' loop over "
        f"the experts that got tokens: build the model with "
        f"experts_implementation='batched_mm'. Otherwise write the branch with torch ops "
        f"(torch.where, torch.cond), or compile without fullgraph=True (the body then "
        f"runs eagerly)", getattr(raw, "cond", None))


def call_opaque(body: Opaque | None, args: tuple, name: str):
    """Calls the result of :func:`opaque` on a body's arguments, while Dynamo traces
    (the body's constants read now: Dynamo makes them inputs of the graph)."""
    if body is None:
        raise ShardingError(
            f"shard_map of {name!r} was made inside a torch.compile region and called "
            f"there; with check_vma=True make it outside, once (functp.shard_map(...) "
            f"before torch.compile), or pass check_vma=False")
    consts = [getattr(o, n) if n is not None else o.cell_contents for o, n in body.constants]
    return body.fn(consts, *_nones(args, None, _NONE))


# -- the tensors a body reads without getting them ---------------------------------------
_DEPTH = 4     # how far from the body the search goes (closures of closures, objects)


def constants(f: Callable) -> list[tuple[Any, str | None]]:
    """The tensors ``f`` reaches that need no gradient, as ``(owner, name)``: every
    buffer of a module it closes over or names as a global (also through an object
    holding the module, such as ``parallelize``'s ``apply``), ``(module, buffer
    name)``, and the tensors in its closure cells, ``(cell, None)``. Searched once,
    when a shard_map is made; the values are read at each compiled call.

    Example::

        m = torch.nn.BatchNorm1d(3)
        constants(lambda x: m(x))[0][1]        # 'running_mean'
    """
    out: list = []
    _search(f, set(), out, set(), _DEPTH)
    return out


def _search(x, seen: set, out: list, tensors: set, depth: int) -> None:
    if depth < 0 or id(x) in seen or isinstance(x, (type, types.ModuleType)):
        return
    seen.add(id(x))
    if isinstance(x, torch.nn.Module):
        for mod in x.modules():
            for name, b in mod._buffers.items():
                if b is not None and not b.requires_grad and id(b) not in tensors:
                    tensors.add(id(b))
                    out.append((mod, name))
        return
    more: list = []
    if isinstance(x, functools.partial):
        more = [x.func, *x.args, *x.keywords.values()]
    elif isinstance(x, types.MethodType):
        more = [x.__func__, x.__self__]
    elif isinstance(x, types.FunctionType):
        for cell in x.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:          # an empty cell (a name bound later)
                continue
            if isinstance(v, torch.Tensor):
                if not v.requires_grad and id(v) not in tensors:
                    tensors.add(id(v))
                    out.append((cell, None))
            else:
                more.append(v)
        g = x.__globals__
        more += [g[n] for n in x.__code__.co_names if n in g]
    elif isinstance(x, (list, tuple)):
        more = list(x[:64])
    elif isinstance(x, dict):
        more = list(x.values())[:64]
    elif hasattr(x, "__dict__") and not isinstance(x, torch.Tensor):
        more = list(vars(x).values())[:64]
    for y in more:
        _search(y, seen, out, tensors, depth - 1)


class _in_place_of:
    """While a compiled body is traced: each constant's traced value (an input of the
    graph) stands in its owner for the real one, so that the body reads it there."""

    def __init__(self, owners: list, values: list):
        self.swaps = [(o, n, v) for (o, n), v in zip(owners, values)]
        self.old: list = []

    def __enter__(self):
        for o, n, v in self.swaps:
            old = getattr(o, n) if n is not None else o.cell_contents
            if old is not v:
                self._set(o, n, v)
                self.old.append((o, n, old))

    def __exit__(self, *exc):
        for o, n, old in reversed(self.old):
            self._set(o, n, old)
        self.old.clear()

    @staticmethod
    def _set(owner, name, value) -> None:
        if name is None:
            owner.cell_contents = value
        else:
            owner._buffers[name] = value


# -- compiled functions inside an eager vma body -----------------------------------------
# The compiler's stance is one per process, and simulated ranks are threads: the first
# body to enter sets "force_eager", the last to leave restores what was there.
_eager_lock = threading.Lock()
_eager_bodies = 0
_eager_prior = None
_STANCE = None     # (set_stance, the force_eager stance, get_eval_frame_callback)


def eager_enter() -> bool:
    """At an eager vma body's entry (its tracking mode pushed): until :func:`eager_exit`,
    ``torch.compile``'d functions run eagerly (``torch.compiler.set_stance("force_eager")``
    semantics, fullgraph or not), so that the union rule sees each of their ops.
    Returns whether it did (False while tracing, where a compiled graph is being made,
    or inside a compiled region's frame, where the stance may not change)."""
    global _STANCE, _eager_bodies, _eager_prior
    if tracing():
        return False
    if _STANCE is None:
        set_stance, stance, callback = _torch_compat.stance()
        _STANCE = (set_stance, stance(stance="force_eager"), callback)
    set_stance, force_eager, callback = _STANCE
    if callback() not in (None, False):
        return False
    with _eager_lock:
        if not _eager_bodies:
            _eager_prior = set_stance(force_eager)
        _eager_bodies += 1
    return True


def eager_exit() -> None:
    """At the exit of a body whose :func:`eager_enter` returned True."""
    global _eager_bodies, _eager_prior
    with _eager_lock:
        _eager_bodies -= 1
        if not _eager_bodies:
            _STANCE[0](_eager_prior)
            _eager_prior = None
