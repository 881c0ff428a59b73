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

import threading
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
# run that function eagerly, where nothing is compiling.)
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


def opaque(run: Callable, name: str) -> Callable | None:
    """``run(*args)`` (a vma body) as Dynamo sees it: one opaque call
    (``nonstrict_trace``), which AOTAutograd then traces by running it as Python on
    fake tensors. The tracking mode runs there as in eager mode, so the compiled graph
    has the vma rules' collectives, no more, and vma errors are raised while compiling.
    (Dynamo cannot trace the mode itself: the tags live in the tensors' ``__dict__``.)
    Dynamo accepts only functions made outside the region it compiles: ``None`` for a
    body made while it traces. Call the result with :func:`call_opaque`."""
    if dynamo_tracing():
        return None
    disable, nonstrict_trace = _torch_compat.dynamo()   # (0.3 s, at the first shard_map)

    # A closure (Dynamo drops a bound method's self). AOTAutograd runs it, not Dynamo;
    # should Dynamo fall back to running it (a graph break), it must not trace it
    # either, or it would meet this call again.
    def opaque_body(*args):
        try:
            out = run(_nones(args, _NONE, None))
            if tracing():
                check_traceable(out, name)
            return out
        except ShardingError as e:
            if tracing():
                # with fullgraph=True Dynamo reports only "Unsupported output type for
                # nonstrict_trace-ed function", without this error's text
                warnings.warn(f"torch.compile could not trace the shard_map body "
                              f"{name!r}: {e}", stacklevel=2)
            raise
    return nonstrict_trace(disable(opaque_body))


def call_opaque(fn: Callable | None, args: tuple, name: str):
    """Calls the result of :func:`opaque` on a body's arguments, while Dynamo traces."""
    if fn is None:
        raise ShardingError(
            f"shard_map of {name!r} was made inside a torch.compile region and called "
            f"there; with check_vma=True make it outside, once (functp.shard_map(...) "
            f"before torch.compile), or pass check_vma=False")
    return fn(*_nones(args, None, _NONE))


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
