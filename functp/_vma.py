"""vma tracking: which mesh axes each value in a shard_map body varies over.

While a body runs with ``check_vma=True`` a ``TorchFunctionMode`` sees every torch
call. An op's result varies over the union of its tensor inputs' axes, and an input
that varies over fewer axes is first passed through ``pvary`` over the missing ones
(identity forward, ``psum`` of the gradient backward). No per-operator rule exists, so
any torch op, custom op or ``autograd.Function`` follows the same rule. Collectives
set their result's axes themselves (``_collectives.py``).

Values that no op produced here (constants closed over, fresh tensors) are
invariant: they vary over no axis.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
from torch.autograd.function import Function
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

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
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                    "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                    "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def _is_inplace(func) -> bool:
    name = getattr(func, "__name__", "")
    if "." in name:                                   # aten overloads: "add_.Tensor"
        name = name.split(".", 1)[0]
    return (name[-1:] == "_" and name[-2:] != "__") or name in _INPLACE_DUNDERS


def _tensors(args, kwargs) -> list[torch.Tensor]:
    """Tensor arguments (not ``out=``), looking one level into lists and tuples
    (torch.cat's list)."""
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            if not (kwargs and a is kwargs.get("out")):
                out.append(a)
        elif isinstance(a, (list, tuple)) and not (kwargs and a is kwargs.get("out")):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _replace(x, new: dict[int, torch.Tensor]):
    if isinstance(x, torch.Tensor):
        return new.get(id(x), x)
    if isinstance(x, (list, tuple)) and any(id(t) in new for t in x):
        return type(x)(new.get(id(t), t) for t in x)
    return x


class Tracker(TorchFunctionMode):
    """The vma of every tensor made while one shard_map body runs."""

    _runs = 0

    def __init__(self, mesh: Mesh):
        super().__init__()
        self.mesh = mesh
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
        varied over outside). Floating inputs replicated over some of ``axes`` get
        ``_EntryAliases``, so their implicit pvarys share one bucketed all-reduce."""
        from ._collectives import _apply
        todo, plan, vmas = [], [], {}
        for i, (x, spec) in enumerate(zip(local, specs)):
            if spec is None:
                continue
            vmas[i] = vma = frozenset(spec.axes) | (base[i] if base else EMPTY)
            self.set(x, vma)
            missing = [a for a in axes if a not in vma]
            if missing and (x.is_floating_point() or x.is_complex()):
                subsets = [c for k in range(1, len(missing) + 1)
                           for c in itertools.combinations(missing, k)]
                todo.append(i)
                plan.append(tuple(self.mesh.axis_group(c) for c in subsets))
        if not todo:
            return
        outs = _apply("_EntryAliases", tuple(plan), *[local[i] for i in todo])
        k = 0
        first = len(self._entry)      # a nested body adds to the enclosing one's
        for j, (i, groups) in enumerate(zip(todo, plan), start=first):
            vma = vmas[i]
            a = local[i]
            self._entry.append(a)
            self._alias_of[a] = j
            aliases = {}
            for g in groups:
                aliases[frozenset(g.axes)] = outs[k]
                self.set(outs[k], vma | frozenset(g.axes))
                k += 1
            self._aliases.append(aliases)

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
        from ._collectives import _apply
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
                out = _apply("_Pvary", self._group(missing), False, t)[0]
        else:   # no gradient to sum: a change of type only
            with self.paused():
                out = t.view_as(t) if t.dim() else t.clone()
        self.set(out, v | missing)
        self._pvaried.setdefault(t, {})[key] = out
        return out

    def pvary_inplace(self, t: torch.Tensor, axes) -> None:
        """Before ``t`` (or a view of it) is mutated by a more varying value."""
        from ._collectives import _apply
        root = t if t._base is None else t._base
        missing = frozenset(axes) - self.get(root)
        if missing and (root.is_floating_point() or root.is_complex()):
            with self.paused():
                _apply("_PvaryInplace", root, self._group(missing))
        self.set(root, self.get(root) | missing)

    # -- the union rule ------------------------------------------------------------
    def _unify(self, args, kwargs, inplace: bool):
        """Implicit pvary of the less varying inputs; returns (args, kwargs, union)."""
        ts = _tensors(args, kwargs)
        if not ts:
            return args, kwargs, EMPTY
        vmas = [self.get(t) for t in ts]
        union = vmas[0].union(*vmas[1:]) if len(vmas) > 1 else vmas[0]
        if not union or all(v is union or v == union for v in vmas):
            return args, kwargs, union
        if inplace and isinstance(args[0], torch.Tensor):
            self.pvary_inplace(args[0], union)
        new = {id(t): self.pvary(t, union) for t, v in zip(ts, vmas)
               if v != union and not (inplace and t is args[0])}
        args = tuple(_replace(a, new) for a in args)
        kwargs = {k: _replace(a, new) for k, a in kwargs.items()}
        return args, kwargs, union

    def _tag(self, out, union: frozenset) -> None:
        if isinstance(out, torch.Tensor):
            self.set(out, union)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self.set(o, union)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self._paused:
            return func(*args, **kwargs)
        if func is torch.autograd.grad:
            return self._autograd_grad(func, args, kwargs)
        inplace = _is_inplace(func)
        args, kwargs, union = self._unify(args, kwargs, inplace)
        out = func(*args, **kwargs)
        if self._alias_of and isinstance(out, torch.Tensor) and out._base is not None:
            self._follow_views(out, args)
        if union or inplace:
            self._tag(out, union)
            if inplace and isinstance(args[0], torch.Tensor) and args[0]._base is not None:
                self.set(args[0]._base, self.get(args[0]._base) | union)
        if kwargs and "out" in kwargs:
            self._tag(kwargs["out"], union)
        return out

    def _follow_views(self, out: torch.Tensor, args) -> None:
        """A view of a replicated input still counts as that input (see pvary)."""
        for a in args:
            if isinstance(a, torch.Tensor):
                j = self._alias_of.get(a)
                if j is not None and out._base is (a if a._base is None else a._base):
                    self._alias_of[out] = j
                    return

    def _autograd_grad(self, func, args, kwargs):
        # a gradient varies like the input it is taken with respect to (the implicit
        # pvary's transpose already summed it over the other axes)
        out = func(*args, **kwargs)
        inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        for g, x in zip(out, inputs):
            if isinstance(g, torch.Tensor):
                self.set(g, self.get(x))
        return out

    # -- custom autograd Functions -------------------------------------------------
    # Eager Function.apply bypasses torch function modes (only the ops inside its
    # forward, run without autograd, would be seen), so while a body runs apply is
    # wrapped: the union rule is applied to the Function as one op, outside it.
    def apply_function(self, orig, cls, args, kwargs):
        if self._paused:
            return orig(cls, *args, **kwargs)
        args, kwargs, union = self._unify(args, kwargs, False)
        with self.paused():
            out = orig(cls, *args, **kwargs)
        if union:
            self._tag(out, union)
        return out


_ACTIVE: list[Tracker] = []
_ORIG_APPLY = Function.__dict__["apply"]


def _patched_apply(cls, *args, **kwargs):
    if _ACTIVE:
        return _ACTIVE[-1].apply_function(_ORIG_APPLY.__func__, cls, args, kwargs)
    return _ORIG_APPLY.__func__(cls, *args, **kwargs)


@contextlib.contextmanager
def tracking(tracker: Tracker):
    """Runs the body with ``tracker`` seeing every torch call and Function.apply."""
    if not _ACTIVE:
        Function.apply = classmethod(_patched_apply)
    _ACTIVE.append(tracker)
    try:
        with tracker:
            yield tracker
    finally:
        _ACTIVE.pop()
        if not _ACTIVE:
            Function.apply = _ORIG_APPLY

