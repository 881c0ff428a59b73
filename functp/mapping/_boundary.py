"""shard_map's two boundary rules: how inputs enter a body and outputs leave it.

Both give the gradients of the global function (the autodiff contract,
``docs/architecture.md``):

- :class:`VmaRules` (``check_vma=True``): inputs are tagged with the axes their
  spec mentions; a floating input replicated over some axes gets one alias per
  subset of them (one bucketed ``functp::pvary`` per subset), used wherever it meets
  a value varying over that subset. An output must vary only over axes its out_spec
  mentions.
- :class:`SumRules` (``check_vma=False``): every floating input is pvary'd over
  the axes its spec omits (its gradient is summed over them), and each output's
  cotangent is divided among the copies of it that out_specs says are replicated.

``plan`` is what depends only on the input specs and leaf dtypes: shard_map caches
it per input tree, so that a step only applies it.

``unreduced`` axes: a floating input replicated over them enters as if it varied
over them, with no alias (vma) or no pvary (sum rules) over them — the identity
forward of a pvary without its transpose, so each rank keeps its own cotangent.

Axes of size 1 cost nothing here: a pvary over one is the identity both ways (the
sum over one rank), so the sum rules leave such axes out of their pvarys, and a body
whose axes all have size 1 gets no gradient-overlap entry (no collective of it can
be in flight).
"""
from __future__ import annotations

import itertools
import math

import torch

from ..ops import _ops
from ..ops import _overlap
from ..runtime._errors import ShardingError
from ..mesh._mesh import Mesh
from ..runtime._precision import floating, inexact
from ..mesh._spec import P
from ..ops._vma import EMPTY, Tracker


class VmaRules:
    """check_vma=True: JAX's vma rules at the boundary."""

    check_vma = True

    def __init__(self, mesh: Mesh, axes: tuple[str, ...], unreduced: frozenset = EMPTY):
        self.mesh, self.axes, self.unreduced = mesh, axes, frozenset(unreduced)
        self.overlap = _overlaps(mesh, axes)

    def plan(self, specs: list, floating: list[bool], base: list | None = None):
        """``(vmas, groups, aliased)``: each input's vma; ``(group key, axes,
        [inputs])`` for every axis subset some floating replicated inputs need an
        alias over; and those inputs, in order."""
        vmas: list = [None] * len(specs)
        by_group: dict[tuple[str, ...], list[int]] = {}
        for i, spec in enumerate(specs):
            if spec is None:
                continue
            vmas[i] = vma = (frozenset(spec.axes) | (base[i] if base else EMPTY)
                             | (self.unreduced if floating[i] else EMPTY))
            missing = [a for a in self.axes if a not in vma]
            if missing and floating[i]:
                for k in range(1, len(missing) + 1):
                    for sub in itertools.combinations(missing, k):
                        by_group.setdefault(sub, []).append(i)
        # (over a single rank an alias is the identity: the tracker's pvary makes a
        # tagged view where one is met, and none is made for every input at entry)
        by_group = {sub: idx for sub, idx in by_group.items()
                    if self.mesh.axis_group(sub).size > 1}
        groups = [(self.mesh.axis_group(sub).key, frozenset(sub), idx)
                  for sub, idx in by_group.items()]
        aliased = sorted({i for idx in by_group.values() for i in idx})
        return vmas, groups, aliased

    def enter(self, tracker: Tracker, local: list, plan) -> None:
        _dedupe(local)
        # (gradient collectives launched in the backward, waited on at the entry)
        sink = _overlap.enter(local) if self.overlap else None
        tracker.enter(local, *plan, sink=sink)

    def cast(self, tracker: Tracker, local: list, dtype: torch.dtype) -> None:
        """The floating inputs, entered, cast to ``dtype`` with their aliases (the
        aliases' pvary stays before the cast: its reduction keeps the entry dtype)."""
        tracker.cast_inputs(local, dtype)

    def exit(self, tracker: Tracker, path: str, y: torch.Tensor, spec: P) -> torch.Tensor:
        vma = tracker.get(y)
        for a in self.axes:
            if a in vma and a not in spec.axes:
                raise ShardingError(
                    f"{path} varies over mesh axis '{a}' but out_specs {spec!r} says "
                    f"it is replicated over '{a}'; reduce it with "
                    f"functp.psum/pmean(..., '{a}') or mention '{a}' in out_specs")
        # an out_spec may split over an axis the value is invariant over: its blocks
        # then carry separate cotangents, summed by this pvary
        missing = frozenset(spec.axes) - vma
        return tracker.pvary(y, missing) if missing else y


class SumRules:
    """check_vma=False: sum semantics, no tracking."""

    check_vma = False

    def __init__(self, mesh: Mesh, axes: tuple[str, ...], unreduced: frozenset = EMPTY):
        self.mesh, self.axes, self.unreduced = mesh, axes, frozenset(unreduced)
        self.overlap = _overlaps(mesh, axes)

    def plan(self, specs: list, floating: list[bool], base: list | None = None):
        """``(groups, entered)``: ``[(group key, [inputs])]``, the floating inputs
        replicated over the same axes (of size > 1: over one rank a pvary is the
        identity both ways), pvary'd together (one bucketed gradient all-reduce per
        group); and the inputs that pass through the gradient-overlap entry: the
        others (a pvary'd input's entry would be left behind by its pvary)."""
        buckets: dict[tuple[str, ...], list[int]] = {}
        for i, spec in enumerate(specs):
            if spec is not None and floating[i]:
                missing = tuple(a for a in self.axes if a not in spec.axes
                                and a not in self.unreduced and self.mesh.shape[a] > 1)
                if missing:
                    buckets.setdefault(missing, []).append(i)
        pvaried = {i for idx in buckets.values() for i in idx}
        entered = [i for i, s in enumerate(specs) if s is not None and i not in pvaried]
        return ([(self.mesh.axis_group(axes).key, idx) for axes, idx in buckets.items()],
                entered if self.overlap else [])

    def enter(self, tracker: None, local: list, plan) -> None:
        groups, entered = plan
        if entered:              # gradient collectives waited on at the entry
            _overlap.enter(local, entered)
        for key, idx in groups:
            for i, y in zip(idx, _ops.pvary([local[i] for i in idx], key, True)):
                local[i] = y

    def cast(self, tracker: None, local: list, dtype: torch.dtype) -> None:
        for i, x in enumerate(local):
            if floating(x):
                local[i] = x.to(dtype)

    def exit(self, tracker: None, path: str, y: torch.Tensor, spec: P) -> torch.Tensor:
        # Each rank's copy of a replicated output counts once in the global value, so
        # its cotangent (arriving on every rank) is split between the copies.
        n = math.prod([self.mesh.shape[a] for a in self.axes if a not in spec.axes])
        if n > 1 and inexact(y):
            y = _ops.scale_grad(y, 1.0 / n)
        return y


def _overlaps(mesh: Mesh, axes: tuple[str, ...]) -> bool:
    """Whether a body over ``axes`` may have collectives to overlap: some axis has
    more than one rank (over one rank every collective is local, and nothing waits)."""
    return any(mesh.shape[a] > 1 for a in axes)


def _dedupe(local: list) -> None:
    """One tensor passed twice gets a separate alias per use (each gets its own tag)."""
    ids = list(map(id, local))
    if len(set(ids)) == len(ids):       # the usual case, decided in a few calls
        return
    seen: set[int] = set()
    for i, x in enumerate(local):
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                local[i] = x.view_as(x)
            seen.add(id(local[i]))
