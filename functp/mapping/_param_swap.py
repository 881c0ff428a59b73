"""Parameters swapped into a module (``torch.func.functional_call``'s swap, where each
one goes found once: :class:`ParamSwap`), and where a recompute swaps them in again.

A module's parameters that ``functional_call`` swapped in are gone from the module by
the backward; a :func:`functp.checkpoint`'d layer inside it recomputes there.
``functionalize``'s and ``parallelize``'s apply say how to swap them in again
(:func:`recompute_within`, :class:`within`); the checkpoint keeps that context
(:func:`recompute_contexts`) for its recompute.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
from torch.func import functional_call

from ..runtime import _compile
from ..runtime._torch_compat import reparametrize_module


class _Local(threading.local):      # per thread: functp.simulate runs a rank per thread
    def __init__(self) -> None:
        self.stack: list = []       # recompute_within's, innermost last


_local = _Local()


def recompute_contexts() -> tuple:
    """The :func:`recompute_within` contexts active now, innermost last (what a
    checkpointed call made now recomputes within)."""
    return tuple(_local.stack)


@contextlib.contextmanager
def recompute_within(enter: Callable):
    """While active, a :func:`checkpoint`'d call made here recomputes (in the
    backward) inside ``enter(swap)``, a context manager that puts back what the
    forward's context held (a module's parameters swapped in by ``functional_call``,
    gone by the backward), each tensor ``t`` of it as ``swap(t)``: the recompute's
    stand-in for a tensor the first run read. Example::

        with recompute_within(lambda swap: reparametrized(module, params, swap)):
            functional_call(module, params, args)     # its checkpointed layers
    """
    _local.stack.append(enter)
    try:
        yield
    finally:
        _local.stack.pop()


class within:
    """:func:`recompute_within` without a generator: the same context, entered on every
    call of ``functionalize``'s and ``parallelize``'s ``apply`` (eager; what
    ``torch.compile`` traces keeps :func:`recompute_within`)."""

    __slots__ = ("enter",)

    def __init__(self, enter: Callable):
        self.enter = enter

    def __enter__(self) -> None:
        _local.stack.append(self.enter)

    def __exit__(self, *exc) -> None:
        _local.stack.pop()


_STALE = object()       # ParamSwap._try: a slot no longer holds the parameter found there


class ParamSwap:
    """``torch.func.functional_call(module, params, tie_weights=True, strict=False)``'s
    swap of parameters into ``module``, with where each one goes found once.

    ``functional_call`` walks every submodule on every call to find the names tied to
    each given one (``named_parameters(remove_duplicate=False)``) and resolves each
    dotted name again. The module's structure does not change from call to call, so
    here each parameter's slots (every ``(submodule, short name)`` holding it, tied
    names included) are found once; each swap checks that a slot still holds the
    parameter found there (a guard costing one lookup per slot) and finds them all
    again if the module's parameters were replaced (``load_state_dict(assign=True)``,
    released weights, a weight untied). A dict with any other key (a tied weight's
    second name, a buffer, a name the module lacks) is left to ``functional_call``:
    :meth:`swap_in` returns None. A submodule reached under two names holds its
    parameters in one slot, swapped once (``functional_call`` swaps it under each name
    and, restoring in the same order, leaves the call's tensor there).
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.slots: dict[str, list] | None = None   # canonical name -> [(dict, short, param)]
        #: how many times the module's parameters were walked (once, unless replaced)
        self.scans = 0

    def _scan(self) -> None:
        """Every parameter's slots, under its first name (``named_parameters()``'s)."""
        self.scans += 1
        first: dict[int, str] = {}
        slots: dict[str, list] = {}
        seen: set = set()
        for prefix, mod in self.module.named_modules(remove_duplicate=False):
            for short, p in mod._parameters.items():
                if p is None or (id(mod), short) in seen:   # (a module reached twice)
                    continue
                seen.add((id(mod), short))
                name = first.setdefault(id(p), f"{prefix}.{short}" if prefix else short)
                slots.setdefault(name, []).append((mod._parameters, short, p))
        self.slots = slots

    def swap_in(self, values: dict[str, Any]) -> list | None:
        """Puts ``values`` (keyed by ``named_parameters()`` names; a tensor or None
        each) into the module, every tied slot included. **Returns:** what to give
        :meth:`restore`, or None (nothing swapped) for a dict ``functional_call``
        must take."""
        if self.slots is None:
            self._scan()
        undo = self._try(values)
        if undo is _STALE:           # a slot held another tensor: the module changed
            self._scan()
            undo = self._try(values)
        return undo if undo and undo is not _STALE else None

    def _try(self, values: dict):
        slots, undo = self.slots, []
        for k, v in values.items():
            where = slots.get(k)
            if where is None:        # (not a first name: functional_call's general path)
                self.restore(undo)
                return None
            for d, short, p in where:
                if d.get(short) is not p:
                    self.restore(undo)
                    return _STALE
                d[short] = v
                undo.append((d, short, p))
        return undo

    @staticmethod
    def restore(undo: list) -> None:
        """Puts back what :meth:`swap_in` replaced, last first."""
        for d, short, p in reversed(undo):
            d[short] = p

    def call(self, values: dict, args: tuple, kwargs: dict, again: Callable):
        """``functional_call(module, values, args, kwargs, tie_weights=True,
        strict=False)``, a :func:`checkpoint` inside recomputing within ``again``
        (:func:`recompute_within`'s ``enter``). **Returns:** the module's output.
        (While a compiler traces: ``functional_call`` itself, traced once.)"""
        undo = None if _compile.tracing() else self.swap_in(values)
        if undo is None:
            with recompute_within(again):
                return functional_call(self.module, values, args, kwargs,
                                       tie_weights=True, strict=False)
        with within(again):
            try:
                return self.module(*args, **kwargs)
            finally:
                self.restore(undo)

    @contextlib.contextmanager
    def swapped(self, values: dict):
        """The module with ``values`` swapped in while the block runs (a recompute)."""
        undo = None if _compile.tracing() else self.swap_in(values)
        if undo is None:
            with reparametrize_module(self.module, values, tie_weights=True, strict=False):
                yield
            return
        try:
            yield
        finally:
            self.restore(undo)


def reparametrized(module: torch.nn.Module, params, swap: Callable):
    """``module`` with ``params`` (a dict, or a tuple of dicts: parameters, buffers)
    swapped in as ``functional_call`` does, each tensor through ``swap``."""
    merged: dict = {}
    for d in params if isinstance(params, tuple) else (params,):
        merged.update({k: swap(v) for k, v in d.items()})
    return reparametrize_module(module, merged, tie_weights=True, strict=False)
