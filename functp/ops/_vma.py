"""The vma store: which mesh axes each value in a shard_map body varies over.

While a body runs with ``check_vma=True``, :class:`Tags` keeps one tag per tensor,
:class:`EntryAliases` the aliases of its replicated inputs, and :class:`Tracker`
(the tags, the aliases and a cache) makes the ``pvary``s that the union rule asks
for: one per tensor and axis set. ``_vma_mode.py`` applies the rule to every torch call;
collectives set their result's axes themselves (``_collectives.py``).

Values that no op produced here (constants closed over, fresh tensors) are
invariant: they vary over no axis.
"""
from __future__ import annotations

import contextlib

import torch

from . import _ops
from . import _overlap
from ..runtime._errors import ShardingError
from ..mesh._mesh import Mesh, group_of
from ..runtime._precision import floating
from ..runtime._torch_compat import (FakeTensor, FunctionalTensor, get_unwrapped as _unwrap,
                            is_batched as _is_batched, is_functional_tensor,
                            is_functorch_wrapped as _is_wrapped, maybe_get_level as _level_of,
                            peek_interpreter_stack as _peek, unwrap_functorch)

EMPTY: frozenset = frozenset()
_TAG = "_functp_vma"


def _under_vmap(t: torch.Tensor) -> bool:
    """Is ``t`` batched by a vmap somewhere in its functorch wrappers? (An alias
    viewed with as_strided cannot stand for a batched view.)"""
    while True:
        if _is_batched(t):
            return True
        if not _is_wrapped(t):
            return False
        t = _unwrap(t)


def _view_like(alias: torch.Tensor, t: torch.Tensor, views) -> torch.Tensor:
    """The view of ``alias`` that ``t`` is of its input: the same view ops again, so
    that the backward is theirs (w.T's is a transpose; an ``as_strided``'s fills a
    zero tensor the size of w, then copies into it), else an ``as_strided``."""
    if views is not None:
        out = alias
        for func, args, kwargs in views:
            out = func(out, *args[1:], **kwargs) if kwargs else func(out, *args[1:])
        if (isinstance(out, torch.Tensor) and out.shape == t.shape
                and out.stride() == t.stride() and out.storage_offset() == t.storage_offset()):
            return out
    return alias.as_strided(t.size(), t.stride(), t.storage_offset())


def _real(t: torch.Tensor) -> bool:
    """Does ``t`` hold data, while torch.compile traces a body on fake tensors? Then
    the body did not make it or get it as an argument: it closes over it."""
    t = unwrap_functorch(t)
    return not isinstance(t, (FakeTensor, FunctionalTensor)) and not is_functional_tensor(t)


def _closed_over(t: torch.Tensor):
    # torch.compile's trace makes a closed-over tensor a constant: its gradient
    # would be lost
    raise ShardingError(
        f"a shard_map body under torch.compile uses a tensor of shape {tuple(t.shape)} "
        f"that requires grad but is not one of its arguments (it closes over it); "
        f"compiled, it would be a constant and get no gradient. Pass it as an argument "
        f"with an in_spec, or detach it if it needs no gradient")


class Tags:
    """The vma of every tensor made while one body runs: a tag ``(token, axes)`` in the
    tensor's own ``__dict__`` (a dict keyed by tensor costs a weak reference per
    lookup); the token ties a tag to this run, so a stale tag reads as invariant.
    :class:`Tracker` sets ``token``, ``level`` and ``compiled`` (one ``__init__`` per
    body run)."""

    _runs = 0
    token: int                # this run's
    level: int                # the torch.func level the body's own tensors live at
    compiled: bool            # traced for torch.compile: closed-over tensors are constants

    def get(self, t: torch.Tensor) -> frozenset:
        """The axes ``t`` varies over (untagged: invariant). Written without helper
        calls: it runs for most tensor arguments of most ops."""
        d = t.__dict__
        tag = d[_TAG] if _TAG in d else None
        if tag is not None and tag[0] == self.token:
            v = tag[1]
        elif _level_of(t) > self.level:
            # made by a torch.func transform inside the body (in C++: no torch
            # function call to see): a wrapper varies like the tensor it wraps
            v = self.get(_unwrap(t))
        else:
            v = EMPTY
            if self.compiled and t.requires_grad and _real(t):
                _closed_over(t)
        base = t._base
        if base is None:
            return v
        d = base.__dict__       # a view varies like its base, which may have changed
        b = d[_TAG] if _TAG in d else None
        if b is None or b[0] != self.token or not b[1] or b[1] is v:
            return v
        return v | b[1]

    def set(self, t: torch.Tensor, vma: frozenset) -> None:
        tag = (self.token, vma)
        t.__dict__[_TAG] = tag
        # a tensor made by a torch.func transform inside the body: tag what it wraps
        # too, down to the body's own level (what the transform unwraps to)
        while _level_of(t) > self.level:
            t = _unwrap(t)
            t.__dict__[_TAG] = tag

    def forget(self, tensors) -> None:
        """Once the body is done: drops the tags of its inputs (the user's tensors),
        so that none is left in their ``__dict__`` (torch.save would keep it), and
        the body's rule (``mode``), whose reference back to the tracker is a cycle:
        left, every tensor the tracker caches (the pvarys and their inputs, the
        entry aliases) would stay allocated after the step until Python's cycle
        collector ran, a step's activations or more on a GPU."""
        if getattr(self, "mode", None) is not None:
            self.mode = None
        for t in tensors:
            d = t.__dict__        # set() tags an input itself only (its own level)
            if _TAG in d:
                del d[_TAG]


def _size1(key: str) -> bool:
    """Is the group ``key`` a single rank (its psum the identity)?"""
    return group_of(key).size == 1


class EntryAliases:
    """A body's floating replicated inputs and their aliases: for each axis subset an
    input must meet values varying over, an alias of it from one ``functp::pvary`` of
    all such inputs (its backward sums their cotangents in one bucketed all-reduce
    after the whole backward), and the views of the inputs, to view an alias alike."""

    def __init__(self, tags: Tags):
        # the run's token, not the tracker: the tracker holds this object, and a
        # reference back would be a cycle keeping the body's tensors alive after it
        self.token = tags.token
        self.entry: list[torch.Tensor] = []    # the aliased inputs
        self.slot: dict = {}                   # an entry output's Sink index -> its index
        self.aliases: list[dict] = []          # per input: {axes: alias}
        # id of an input or a view of it -> (it, index, the view ops that made it from
        # the input: (func, args, kwargs) each, or None if they cannot be replayed)
        self.of: dict[int, tuple] = {}
        self.entry_views = False               # is some aliased input itself a view?

    def add(self, local: list, vmas: list, groups: list, aliased: list,
            sink=None) -> None:
        """Aliases ``local[i]`` for ``i`` in ``aliased``: for each ``(group key, axes,
        inputs)`` of ``groups``, those inputs get an alias varying over ``axes`` too;
        with ``sink`` (a top-level body's gradient-overlap entry, which the inputs
        passed), their gradient buckets cut at once where they can be
        (:func:`~functp.ops._overlap.cut_at_entry`). (A nested body's inputs add to the
        enclosing body's.)"""
        first = len(self.entry)
        slot = {}
        for j, i in enumerate(aliased, start=first):
            slot[i] = j
            self.of[id(local[i])] = (local[i], j, ())
            if sink is not None and _overlap.SINK in local[i].__dict__:
                self.slot[local[i].__dict__[_overlap.SINK][1]] = j
        self.entry.extend([local[i] for i in aliased])
        self.aliases.extend([{} for _ in aliased])
        token = self.token
        for key, axes, idx in groups:
            # over axes of size 1 the gradient's psum is the identity: a view carries
            # the tag, with no op, no backward node and no launch point (_overlap)
            outs = ([local[i].view_as(local[i]) for i in idx] if _size1(key)
                    else _ops.pvary([local[i] for i in idx], key, False))
            for i, out in zip(idx, outs):
                self.aliases[slot[i]][axes] = out
                out.__dict__[_TAG] = (token, vmas[i] | axes)
            if sink is not None and not _size1(key):
                _overlap.cut_at_entry(sink, key, [local[i] for i in idx
                                                  if _overlap.SINK in local[i].__dict__])
        self.entry_views = any([x._base is not None for x in self.entry])

    def ready(self, j: int, axes: frozenset, key: str) -> torch.Tensor:
        """Input ``j``'s alias over ``axes`` (group ``key``) through its launch point
        (``_overlap``), made here, at its first use: its bucket's for all of the
        bucket's aliases where the buckets were cut at the entry, else its own."""
        out = self.aliases[j][axes]
        if _overlap.READY in out.__dict__:
            return out
        entry = self.entry[j]
        sink, n = entry.__dict__[_overlap.SINK]
        js = _overlap.bucket_point(sink, key, n)
        if js is None:
            out = self.aliases[j][axes] = _overlap.ready_point(out, entry, key)
            return out
        slots = [self.slot[i] for i in js]
        outs = _overlap.through(sink, js, key, [self.aliases[s][axes] for s in slots])
        for s, y in zip(slots, outs):
            self.aliases[s][axes] = y
        return self.aliases[j][axes]

    def cast(self, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> None:
        """``y``, ``x`` cast to ``dtype``, replaces ``x`` (if aliased); its aliases are
        cast too, so the body meets only ``dtype`` while their pvary (and the gradient
        reduction it transposes to) stays in the entry dtype."""
        hit = self.of.pop(id(x), None)
        if hit is None:
            return
        j = hit[1]
        self.of[id(y)] = (y, j, ())
        self.entry[j] = y
        aliases = self.aliases[j]
        for axes, a in list(aliases.items()):
            b = aliases[axes] = a.to(dtype)
            b.__dict__[_TAG] = a.__dict__[_TAG]
        self.entry_views = any([x._base is not None for x in self.entry])

    def follow_view(self, out: torch.Tensor, func, args, kwargs, is_inplace) -> None:
        """A view of an input (or of a view of one) still counts as that input, with
        the view ops that made it (replayable: a view op, not in place, taking the
        input first); a view of one of its *aliases* does not, although the aliases
        are views of the input too. (Callers check that ``out`` is a view.)"""
        base = out._base
        if id(base) not in self.of and not self.entry_views:
            return         # not a view of an input: decided in one call
        for a in args:
            if isinstance(a, torch.Tensor):
                hit = self.of.get(id(a))
                if hit is not None and base is (a if a._base is None else a._base):
                    views = (hit[2] + ((func, args, kwargs),)
                             if hit[2] is not None and a is args[0] and not is_inplace(func)
                             else None)
                    self.of[id(out)] = (out, hit[1], views)
                    return


class Tracker(Tags):
    """One body run's vma: the tags (:class:`Tags`), its inputs' aliases
    (:class:`EntryAliases`, None until a body has some), and the pvarys the union
    rule asks for (cached), none while paused (functp's own ops run)."""

    def __init__(self, mesh: Mesh, compiled: bool = False):
        self.mesh = mesh
        self.compiled = compiled
        self.mode = None          # the UnionRule applying the rule with these tags
        self.aliases: EntryAliases | None = None
        # the group over a set of axes, in mesh order: the mesh's own cache answers a
        # frozenset (bound here: the pvary and union rule call it per op)
        self.group = mesh.axis_group
        Tags._runs += 1
        self.token = Tags._runs
        # Keyed by id() and holding the tensor, so the id stays valid for the run
        # (these tensors are in the autograd graph anyway); a weak-keyed dict costs
        # Python calls on every lookup.
        self._pvaried: dict[int, tuple] = {}    # id -> (tensor, {axes: pvary'd tensor})
        self._paused = 0
        # the planned call now recorded or replayed (an ops/_replay.Scope, which sets
        # and clears it): None outside one
        self.replay = None
        interp = _peek()       # the torch.func level the body's own tensors live at
        self.level = interp.level() if interp is not None else -1

    def enter(self, local: list, vmas: list, groups: list, aliased: list,
              sink=None) -> None:
        """Tags the inputs of a body: input ``i`` varies over ``vmas[i]`` (None: not a
        tensor); the inputs ``aliased`` get aliases over the axes of ``groups`` (see
        :meth:`EntryAliases.add`; ``_boundary.VmaRules.plan`` computes the lists;
        ``sink``: the body's gradient-overlap entry)."""
        token = self.token
        for x, vma in zip(local, vmas):
            if vma is not None:       # an input lives at the body's level: tag it only
                x.__dict__[_TAG] = (token, vma)
        if aliased:
            if self.aliases is None:
                self.aliases = EntryAliases(self)
            self.aliases.add(local, vmas, groups, aliased, sink)

    def cast_inputs(self, local: list, dtype: torch.dtype) -> None:
        """Replaces the entered floating inputs by casts to ``dtype`` (mixed
        precision), tagged as they were, their aliases cast too. Runs before the
        body, outside the tracking mode."""
        for i, x in enumerate(local):
            if not floating(x) or x.dtype == dtype:
                continue
            y = x.to(dtype)
            if _TAG in x.__dict__:
                y.__dict__[_TAG] = x.__dict__[_TAG]
            if self.aliases is not None:
                self.aliases.cast(x, y, dtype)
            local[i] = y

    @contextlib.contextmanager
    def paused(self):
        """Ops run here are functp's own (a collective's forward): not tracked."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def resumed(self):
        """The user's code again (a nested shard_map body, inside our bookkeeping)."""
        paused, self._paused = self._paused, 0
        try:
            yield
        finally:
            self._paused = paused

    def pvary(self, t: torch.Tensor, axes) -> torch.Tensor:
        """``t`` marked as varying over ``axes`` too (cached: one pvary per tensor and
        axis set, so a weight used twice gets one gradient all-reduce); an input's
        alias where it has one."""
        v = self.get(t)
        missing = frozenset(axes) - v
        if not missing:
            return t
        sc = self.replay
        if sc is not None and sc.recorder is not None and not self._paused:
            sc.recorder.implicit(t, missing)     # (a decision of the call recorded)
        cached = self._pvaried.get(id(t))
        if cached is not None and missing in cached[1]:
            return cached[1][missing]
        al = self.aliases
        hit = al.of.get(id(t)) if al is not None else None
        self._paused += 1
        try:
            if hit is not None and missing in al.aliases[hit[1]] and not _under_vmap(t):
                # an input (or a view of it): use its alias for these axes, viewed the
                # same way, so its gradient joins the input's bucketed all-reduce
                _, j, views = hit
                out = al.aliases[j][missing]
                if _overlap.SINK in al.entry[j].__dict__ and self.group(missing).size > 1:
                    # launch point (_overlap; none over size 1: nothing to send)
                    out = al.ready(j, missing, self.group(missing).key)
                if t is not al.entry[j]:
                    out = _view_like(out, t, views)
            elif (t.is_floating_point() or t.is_complex()) and self.group(missing).size > 1:
                out = _ops.pvary([t], self.group(missing).key, False)[0]
            else:   # no gradient to sum (or a psum over size 1): a change of type only
                out = t.view_as(t) if t.dim() else t.clone()
        finally:
            self._paused -= 1
        self.set(out, v | missing)
        if cached is None:
            cached = self._pvaried[id(t)] = (t, {})
        cached[1][missing] = out
        return out

    def entry_alias(self, t: torch.Tensor, axes, late: list | None = None) -> torch.Tensor:
        """``pvary(t, axes)`` where ``t`` is a body's input itself with an alias over
        the missing axes (a replayed call's parameters, one by one: the lookup
        alone). With ``late`` (a list), an alias whose gradient launch point is still
        to be made, in a bucket that may launch before the backward ends, is returned
        without it, and ``(its index, axes, group key)`` appended: the caller makes it
        where the parameter is first used (:meth:`EntryAliases.ready`)."""
        al, tag = self.aliases, t.__dict__.get(_TAG)
        if al is not None and tag is not None and tag[0] == self.token:
            hit = al.of.get(id(t))
            # (the input itself only: a view of it, a tied decoder's ``w.t()``, a slice
            # ``w[:V]``, takes pvary's path, which views the alias as ``t`` is viewed)
            if hit is not None and hit[0] is t and al.entry[hit[1]] is t:
                missing = frozenset(axes) - tag[1]
                out = al.aliases[hit[1]].get(missing)
                if out is not None and _overlap.READY in out.__dict__:
                    return out
                at = al.entry[hit[1]].__dict__.get(_overlap.SINK)
                if out is not None and late is not None and at is not None:
                    g = self.group(missing)
                    if (g.size > 1 and not _under_vmap(t)
                            and _overlap.launches_early(at[0], g.key, at[1])):
                        late.append((hit[1], missing, g.key))
                        return out
        return self.pvary(t, axes)

    def pvary_inplace(self, t: torch.Tensor, axes) -> None:
        """Before ``t`` (or a view of it) is mutated by a more varying value."""
        root = t if t._base is None else t._base
        missing = frozenset(axes) - self.get(root)
        if missing and (root.is_floating_point() or root.is_complex()):
            with self.paused():
                _ops.PvaryInplace.apply(root, self.group(missing).key)
        self.set(root, self.get(root) | missing)
