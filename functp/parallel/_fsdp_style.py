"""The fully sharded (FSDP / ZeRO-3, and HSDP) parallel style.

Each parameter of the module is stored as this rank's block over the ``fsdp`` axis and
all-gathered when the module runs, in its forward pre-hook. The transpose of the
tiled ``all_gather`` is a reduce-scatter, so each rank's gradient comes back as the
gradient of its own block, summed over ``fsdp``. With ``replicate`` axes (HSDP's
``dp_replicate``) the block is first marked varying over them, so its gradient is also
all-reduced over them, on the block (1/fsdp of the weight), after the reduce-scatter,
as HSDP orders them.

**Prefetch.** A module's pre-hook also launches the gather of the next module's blocks,
kept until that module's pre-hook uses it (FSDP2's forward prefetch): with forward
collectives that wait at first use, that gather travels while this module computes.
"Next" comes from the plan, never from data: the modules this style shards, in the
order the plan registered them (module tree order). The first call checks that order
against the one the modules run in; a module whose successor did not run right after
it never prefetches, so every rank issues the same collectives in the same order. A
prefetched gather is the very op the module would have issued itself, on the same
block: values, gradients and the reduce-scatter per parameter are unchanged.
"""
from __future__ import annotations

import threading

from torch import nn

from ..ops._collectives import all_gather, pvary
from ..mesh._layout import uneven
from ..mesh._spec import P
from ..runtime import _compile
from ._styles import Style

__all__ = ["FullyShard"]


class _Order:
    """The modules a FullyShard shards, in the plan's order, and which of them have
    been seen followed by their successor (on their first call: then they prefetch)."""

    def __init__(self) -> None:
        self.mods: dict[int, nn.Module] = {}        # id -> module, in registration order
        self.next: dict[int, nn.Module | None] = {}
        self.ok: dict[int, bool] = {}               # id -> prefetches its successor

    def register(self, module: nn.Module) -> None:
        if id(module) not in self.mods:
            self.mods[id(module)] = module
            mods = list(self.mods.values())
            self.next = {id(m): n for m, n in zip(mods, mods[1:] + [None])}

    def saw(self, prev: nn.Module, cur: nn.Module | None) -> None:
        """``cur`` ran right after ``prev`` (None: nothing did, in that call)."""
        # the first call sets it; a later call out of that order turns it off for good
        seen, follows = self.ok.get(id(prev)), self.next.get(id(prev)) is cur
        if seen is None or (seen and not follows):
            self.ok[id(prev)] = follows


class _Run(threading.local):
    """One ``apply`` call's state in this thread (a simulated rank is a thread)."""
    active = False
    prev: nn.Module | None = None
    ran: set | None = None          # id of each module run so far in this call
    pending: dict | None = None     # id(module) -> {short: (block, its gather)}


class FullyShard(Style):
    """Shards every own parameter of a module over the plan axis; gathers it per call,
    one module ahead (see prefetch below).

    **Arguments:** ``size`` – the size of the plan axis (a parameter is split on dim 0
    when ``size`` divides it, else on its first dimension it divides, else kept
    replicated: :meth:`reason` says why); ``replicate`` – mesh axes over which the
    shards are replicated (HSDP: ``("dp_replicate",)``), whose gradients are summed
    on the block; ``prefetch`` – True (the default): from the second call on, each
    module's pre-hook also gathers the next module's blocks (in the plan's module
    order, where the first call ran them in that order); False: each module gathers
    its own, in its pre-hook. The values and gradients are the same either way.

    Example (what ``parallelize(model, mesh, {"fsdp": "auto"})`` applies to each module;
    ``{"fsdp": FullyShard(4, prefetch=False)}`` turns prefetch off)::

        style = FullyShard(4)
        style.param_specs(torch.nn.Linear(8, 6), "fsdp")    # weight P(None, 'fsdp'), bias P()
    """

    def __init__(self, size: int, replicate: tuple[str, ...] = (), prefetch: bool = True):
        self.size, self.replicate, self.prefetch = size, tuple(replicate), bool(prefetch)
        self._dims: dict[int, dict[str, int]] = {}     # id(module) -> {parameter: dim}
        self._shapes: dict[int, dict[str, tuple]] = {}  # id(module) -> {parameter: block}
        self._order = _Order()
        self._run = _Run()

    def dim(self, shape: tuple[int, ...]) -> int | None:
        """The dimension a parameter of ``shape`` is split on, or None (replicated)."""
        return next((d for d, n in enumerate(shape) if not uneven(n, self.size)), None)

    def reason(self, shape: tuple[int, ...]) -> str:
        """Why a parameter of ``shape`` stays replicated over the plan axis."""
        return (f"no dimension of shape {tuple(shape)} divides into {self.size} fsdp "
                f"shards; pad one of them to a multiple of {self.size}")

    def param_specs(self, module: nn.Module, axis):
        specs, dims, shapes = {}, {}, {}
        for name, p in module.named_parameters(recurse=False):
            d = self.dim(tuple(p.shape))
            specs[name] = P() if d is None else P(*([None] * d), axis)
            if d is not None:
                dims[name] = d
                shapes[name] = tuple(n // self.size if i == d else n
                                     for i, n in enumerate(p.shape))
        self._dims[id(module)], self._shapes[id(module)] = dims, shapes
        if dims:
            self._order.register(module)
        return specs

    def _gather(self, block, d: int, axis):
        if self.replicate:
            block = pvary(block, self.replicate)
        return all_gather(block, axis, axis=d, tiled=True)

    def prepare_input(self, module, args, kwargs, call):
        # the module sees each whole weight from here until its forward returns;
        # functional_call puts the caller's tensors back when apply ends
        dims = self._dims.get(id(module), {})
        if not dims:
            return args, kwargs
        eager = not _compile.tracing()     # (compiled: inductor orders the gathers)
        got = self._arrive(module, call) if eager else {}
        restore = call.state.setdefault("restore", {})
        for short, d in dims.items():
            block = call.params.get(short)
            if block is None:
                continue
            early = got.get(short)
            full = early[1] if early is not None and early[0] is block else \
                self._gather(block, d, call.axis)
            restore[short] = module._parameters[short]
            module._parameters[short] = full
        if eager and self.prefetch:
            self._prefetch(module, call.axis)
        return args, kwargs

    def _arrive(self, module: nn.Module, call) -> dict:
        """Records that ``module`` runs now (the order check) and hands out the gathers
        prefetched for it."""
        run = self._run
        if not run.active:                 # the first FSDP module of this apply call
            run.active, run.prev, run.ran, run.pending = True, None, set(), {}
            call.on_exit(self._end_run)
        if run.prev is not None:
            self._order.saw(run.prev, module)
        run.prev = module
        run.ran.add(id(module))
        return run.pending.pop(id(module), {})

    def _prefetch(self, module: nn.Module, axis) -> None:
        """Launches the gathers of the blocks of ``module``'s successor, where the
        order check allows. The blocks are what functional_call put in the successor
        for this call; its pre-hook uses a gather only if its block is that tensor."""
        nxt, run = self._order.next.get(id(module)), self._run
        # (not a module that ran already in this call: out of order, it may not again)
        if (nxt is None or not self._order.ok.get(id(module)) or id(nxt) in run.pending
                or id(nxt) in run.ran):
            return
        early = {}
        for short, d in self._dims[id(nxt)].items():
            block = nxt._parameters.get(short)
            if block is not None and tuple(block.shape) == self._shapes[id(nxt)][short]:
                early[short] = (block, self._gather(block, d, axis))
        run.pending[id(nxt)] = early

    def _end_run(self) -> None:
        run = self._run
        if run.prev is not None:
            self._order.saw(run.prev, None)
        # a gather prefetched for a module that did not run is left unused: no
        # gradient flows through it, so its reduce-scatter never runs, on any rank
        run.active, run.prev, run.ran, run.pending = False, None, None, None

    def prepare_output(self, module, args, kwargs, output, call):
        for short, block in call.state.get("restore", {}).items():
            module._parameters[short] = block
        return output

    def __repr__(self) -> str:
        return (f"FullyShard(size={self.size}, replicate={self.replicate}"
                f"{'' if self.prefetch else ', prefetch=False'})")
