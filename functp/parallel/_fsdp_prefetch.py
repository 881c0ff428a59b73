"""FSDP's gathers in one ``apply`` call: by a group's first module, or ahead (prefetch).

A FullyShard module's pre-hook gathers its whole weights, together with those of its
group's modules still to run (one all-gather per dtype), and also launches the gather of
the next group's blocks, kept until that group's first module uses it (FSDP2's forward
prefetch): with forward collectives that wait at first use, that gather travels while
this module computes. "Next" comes from the plan, never from data: the modules the
style shards, in the order the plan registered them (module tree order). The first call
checks that order against the one the groups run in; a group whose successor did not
run right after it never prefetches, so every rank issues the same collectives in the
same order. A prefetched gather is the very op the module would have issued itself, on
the same block: values, gradients and the reduce-scatter per parameter are unchanged.
It is used only under the grad mode (and torch.func level) it was made in: a module run
under ``no_grad`` (a frozen part, a ``functp.checkpoint``'s first run) before one that
records gathers again there, on every rank alike.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from ..runtime._torch_compat import peek_interpreter_stack
from ._flat import gather_group

__all__ = ["Prefetch"]


class _Order:
    """The modules a FullyShard shards, in the plan's order, in their gather groups (a
    group's blocks are gathered by one all-gather per dtype), and which groups have
    been seen followed by their successor (on their first call: then they prefetch)."""

    def __init__(self) -> None:
        self.mods: dict[int, nn.Module] = {}        # id -> module, in registration order
        self.key: dict[int, Any] = {}               # id(module) -> its group's key
        self.groups: dict[Any, list[nn.Module]] = {}    # key -> members, in plan order
        self.next: dict[Any, Any] = {}              # key -> the next group's key
        self.ok: dict[Any, bool] = {}               # key -> prefetches its successor

    def register(self, module: nn.Module, key: Any = None) -> None:
        """Adds ``module`` (alone in its group unless ``key`` names one), or moves it
        to group ``key``."""
        self.mods.setdefault(id(module), module)
        self.key[id(module)] = id(module) if key is None else key
        self.rebuild()

    def rebuild(self) -> None:
        """The groups and their order from ``key`` (the first check starts again)."""
        self.groups, self.ok = {}, {}
        for m in self.mods.values():
            self.groups.setdefault(self.key[id(m)], []).append(m)
        keys = list(self.groups)
        self.next = dict(zip(keys, keys[1:] + [None]))

    def saw(self, prev: Any, cur: Any) -> None:
        """Group ``cur`` first ran right after group ``prev`` (None: nothing did)."""
        # the first call sets it; a later call out of that order turns it off for good
        seen, follows = self.ok.get(prev), self.next.get(prev) == cur
        if seen is None or (seen and not follows):
            self.ok[prev] = follows


class _Run(threading.local):
    """This thread's plan order (a style shared by simulated ranks, threads that build
    their own modules, must not interleave their orders: each rank would check its
    own) and the state of its current ``apply`` call."""
    order: _Order | None = None
    active = False
    prev: Any = None                # the key of the group that first ran last
    ran: set | None = None          # the key of each group run so far in this call
    done: set | None = None         # id of each module run so far in this call
    pending: dict | None = None     # id(module) -> (_grad_context(), {short: (block, gather)})
    regathers: dict | None = None   # group key -> its _Regather (free_full_weight)


def _grad_context() -> tuple:
    """What decides the autograd history a gather gets: grad mode, inference mode and
    the innermost torch.func level (a prefetched gather is used only under the same)."""
    top = peek_interpreter_stack()
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            None if top is None else top.level())


class Prefetch:
    """Where each module's whole weights come from in one ``apply`` call of a
    ``FullyShard``: gathered ahead for it (by its group's first module, or by the
    previous group's prefetch), or now.

    **Arguments:** ``replicate`` – the style's HSDP axes (the gathered blocks are
    marked varying over them); ``enabled`` – whether a group's first module also
    gathers the next group's blocks.

    Example (what FullyShard's ``param_specs`` does for a module it splits; its
    pre-hook then asks :meth:`arrive` for the whole weights)::

        gathers = Prefetch((), enabled=True)
        gathers.register(torch.nn.Linear(8, 4), {"weight": 0}, {"weight": (2, 8)})
        print(len(gathers.order.groups))
        # prints:
        # 1
    """

    def __init__(self, replicate: tuple[str, ...], enabled: bool) -> None:
        self.replicate, self.enabled = replicate, enabled
        self.dims: dict[int, dict[str, int]] = {}     # id(module) -> {parameter: dim}
        self.shapes: dict[int, dict[str, tuple]] = {}  # id(module) -> {parameter: block}
        self._run = _Run()

    def register(self, module: nn.Module, dims: dict[str, int], shapes: dict[str, tuple]
                 ) -> None:
        """``module``'s parameters split on ``dims`` into blocks of ``shapes``; a module
        with any joins the plan's order (alone in its group until grouped)."""
        self.dims[id(module)], self.shapes[id(module)] = dims, shapes
        if dims:
            self.order.register(module)

    def group_of(self, module: nn.Module) -> Any:
        """The key of ``module``'s gather group."""
        return self.order.key.get(id(module), id(module))

    def per_call(self, key: Any, make) -> Any:
        """What this ``apply`` call keeps under ``key`` (``make()``, the first time)."""
        kept = self._run.regathers
        if key not in kept:
            kept[key] = make()
        return kept[key]

    @property
    def order(self) -> _Order:
        run = self._run
        if run.order is None:
            run.order = _Order()
        return run.order

    def gather(self, blocks: dict, axis) -> dict:
        """{key: (block, dim)} -> {key: whole weight}: one all-gather per dtype."""
        return gather_group(blocks, axis, self.replicate) if blocks else {}

    def arrive(self, module: nn.Module, own: dict, call) -> dict:
        """Records that ``module`` runs now (the order check, per group), and returns
        its whole weights: gathered ahead for it (by its group's first module, or by
        prefetch), or now, together with those of its group's modules still to run."""
        run, order = self._run, self.order
        if not run.active:                 # the first FSDP module of this apply call
            run.active, run.prev, run.ran, run.done, run.pending = True, None, set(), set(), {}
            run.regathers = {}
            call.on_exit(self._end_run)
        key = order.key.get(id(module), id(module))
        first = key not in run.ran
        if first:
            if run.prev is not None:
                order.saw(run.prev, key)
            run.prev = key
            run.ran.add(key)
        run.done.add(id(module))
        made_in, early = run.pending.pop(id(module), (None, {}))
        # a gather made under another grad mode (or torch.func level) than this module
        # runs in would lose or add autograd history: gather again here, as every rank
        # does (the context is the program's, not the data's); so must a block that is
        # not the one gathered
        if made_in != _grad_context() or any(early.get(s, (None,))[0] is not b
                                             for s, (b, _) in own.items()):
            rest = [m for m in order.groups.get(key, ()) if id(m) not in run.done
                    and id(m) not in run.pending]
            early = self._gather_modules(rest, call.axis, own)
        if first and self.enabled:
            self._prefetch(key, call.axis)
        return {s: full for s, (_, full) in early.items()}

    def _gather_modules(self, mods: list, axis, own: dict | None = None) -> dict:
        """Gathers the blocks functional_call put in ``mods`` for this call with one
        all-gather per dtype, keeping each module's in ``pending``; with ``own`` (the
        blocks of the module running now, kept out of ``pending``), returns its."""
        blocks = {}
        for m in mods:
            for short, d in self.dims[id(m)].items():
                b = m._parameters.get(short)
                if b is not None and tuple(b.shape) == self.shapes[id(m)][short]:
                    blocks[id(m), short] = (b, d)
        for short, bd in (own or {}).items():
            blocks[None, short] = bd
        fulls, made_in, mine = self.gather(blocks, axis), _grad_context(), {}
        for (mid, short), full in fulls.items():
            if mid is None:
                mine[short] = (blocks[mid, short][0], full)
            else:
                self._run.pending.setdefault(mid, (made_in, {}))[1][short] = \
                    (blocks[mid, short][0], full)
        return mine

    def _prefetch(self, key, axis) -> None:
        """Launches the gather of the next group's blocks (those functional_call put in
        its modules for this call), where the order check allows; each module of it
        uses its gather only if its block is that tensor."""
        nxt, run = self.order.next.get(key), self._run
        # (not a group that ran already in this call: out of order, it may not again)
        if nxt is None or not self.order.ok.get(key) or nxt in run.ran:
            return
        self._gather_modules([m for m in self.order.groups[nxt]
                              if id(m) not in run.pending], axis)

    def _end_run(self) -> None:
        run = self._run
        if run.prev is not None:
            self.order.saw(run.prev, None)
        # a gather prefetched for a module that did not run is left unused: if no
        # module of its group used it, no gradient flows through it and its
        # reduce-scatter never runs, on any rank
        run.active, run.prev, run.ran, run.done, run.pending = False, None, None, None, None
        run.regathers = None
