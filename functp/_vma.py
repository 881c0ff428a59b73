"""The vma store: which mesh axes each value in a shard_map body varies over.

A :class:`Tracker` keeps one tag per tensor made while a body runs with
``check_vma=True`` and makes the ``pvary``s that the union rule asks for (cached: one
per tensor and axis set). ``_vma_mode.py`` applies the rule to every torch call;
collectives set their result's axes themselves (``_collectives.py``).

Values that no op produced here (constants closed over, fresh tensors) are
invariant: they vary over no axis.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from . import _ops
from ._mesh import Mesh

EMPTY: frozenset = frozenset()
_TAG = "_functp_vma"
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_unwrap = torch._C._functorch.get_unwrapped
_is_batched = torch._C._functorch.is_batchedtensor


def _under_vmap(t: torch.Tensor) -> bool:
    while True:
        if _is_batched(t):
            return True
        if not _is_wrapped(t):
            return False
        t = _unwrap(t)

class Tracker:
    """The vma of every tensor made while one shard_map body runs."""

    _runs = 0

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.mode = None          # the UnionRule applying the rule with these tags
        # tags live on the tensors themselves (a dict keyed by tensor costs a weak
        # reference per lookup); the token ties a tag to this body's run
        Tracker._runs += 1
        self._token = Tracker._runs
        self._pvaried = WeakTensorKeyDictionary()   # tensor -> {axes: pvary'd tensor}
        self._paused = 0
        self._entry: list[torch.Tensor] = []        # the body's replicated inputs
        self._aliases: list[dict] = []              # per input: {axes: alias}
        self._alias_of = WeakTensorKeyDictionary()  # input or a view of it -> index

    def enter(self, local: list, specs: list, axes: tuple[str, ...], base: list | None = None) -> None:
        """Tags the inputs of a body that is manual over ``axes``: each varies over
        the axes its spec mentions (plus, in a nested body, ``base[i]``, what it
        varied over outside).

        A floating input replicated over some of ``axes`` gets an alias per subset of
        them, used wherever it meets a value varying over that subset. The aliases of
        all inputs over one subset come from one ``functp::pvary``, whose backward
        sums their cotangents in one bucketed all-reduce after the whole backward.
        """
        by_group: dict[tuple[str, ...], list[int]] = {}
        vmas = {}
        for i, (x, spec) in enumerate(zip(local, specs)):
            if spec is None:
                continue
            vmas[i] = vma = frozenset(spec.axes) | (base[i] if base else EMPTY)
            self.set(x, vma)
            missing = [a for a in axes if a not in vma]
            if missing and (x.is_floating_point() or x.is_complex()):
                for k in range(1, len(missing) + 1):
                    for sub in itertools.combinations(missing, k):
                        by_group.setdefault(sub, []).append(i)
        first = {}
        for sub, idx in by_group.items():
            outs = _ops.pvary([local[i] for i in idx], self.mesh.axis_group(sub).key, False)
            for i, out in zip(idx, outs):
                if i not in first:      # a nested body adds to the enclosing one's
                    first[i] = len(self._entry)
                    self._entry.append(local[i])
                    self._alias_of[local[i]] = first[i]
                    self._aliases.append({})
                self._aliases[first[i]][frozenset(sub)] = out
                self.set(out, vmas[i] | frozenset(sub))

    # -- queries --------------------------------------------------------------
    def _own(self, t: torch.Tensor):
        tag = t.__dict__.get(_TAG)
        return tag[1] if tag is not None and tag[0] == self._token else None

    def get(self, t: torch.Tensor) -> frozenset:
        v = self._own(t)
        if v is None:
            # torch.func transforms wrap tensors in C++ (no torch function call to
            # see): a wrapper varies like the tensor it wraps
            v = self.get(_unwrap(t)) if _is_wrapped(t) else EMPTY
        base = t._base
        if base is None:
            return v
        b = self._own(base)
        return v if not b or b is v else v | b

    def set(self, t: torch.Tensor, vma: frozenset) -> None:
        tag = (self._token, vma)
        while True:    # the wrapped tensors too: they are what a transform unwraps to
            t.__dict__[_TAG] = tag
            if not _is_wrapped(t):
                return
            t = _unwrap(t)

    def forget(self, tensors) -> None:
        """Drops the tags of the body's inputs (the user's tensors) once it is done,
        so that none is left in their ``__dict__`` (torch.save would keep it)."""
        for t in tensors:
            while isinstance(t, torch.Tensor):
                t.__dict__.pop(_TAG, None)
                t = _unwrap(t) if _is_wrapped(t) else None

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

    # -- pvary ------------------------------------------------------------------
    def _group(self, axes):
        return self.mesh.axis_group(tuple(a for a in self.mesh.axis_names if a in axes))

    def pvary(self, t: torch.Tensor, axes) -> torch.Tensor:
        """``t`` marked as varying over ``axes`` too (cached: one pvary per tensor and
        axis set, so a weight used twice gets one gradient all-reduce)."""
        v = self.get(t)
        missing = frozenset(axes) - v
        if not missing:
            return t
        key = tuple(sorted(missing))
        cache = self._pvaried.get(t)
        if cache is not None and key in cache:
            return cache[key]
        j = self._alias_of.get(t)
        if j is not None and missing in self._aliases[j] and not _under_vmap(t):
            # an input (or a view of it): use its alias for these axes, viewed the
            # same way, so its gradient joins the input's bucketed all-reduce
            b = self._aliases[j][missing]
            with self.paused():
                out = b if t is self._entry[j] else b.as_strided(t.size(), t.stride(),
                                                                  t.storage_offset())
        elif t.is_floating_point() or t.is_complex():
            with self.paused():
                out = _ops.pvary([t], self._group(missing).key, False)[0]
        else:   # no gradient to sum: a change of type only
            with self.paused():
                out = t.view_as(t) if t.dim() else t.clone()
        self.set(out, v | missing)
        self._pvaried.setdefault(t, {})[key] = out
        return out

    def pvary_inplace(self, t: torch.Tensor, axes) -> None:
        """Before ``t`` (or a view of it) is mutated by a more varying value."""
        root = t if t._base is None else t._base
        missing = frozenset(axes) - self.get(root)
        if missing and (root.is_floating_point() or root.is_complex()):
            with self.paused():
                _ops.PvaryInplace.apply(root, self._group(missing).key)
        self.set(root, self.get(root) | missing)
