"""The union rule, applied to every torch call of a vma-tracked shard_map body.

While a body runs with ``check_vma=True`` a ``TorchFunctionMode`` sees every torch
call. An op's result varies over the union of its tensor inputs' axes, and an input
that varies over fewer axes is first passed through ``pvary`` over the missing ones
(identity forward, ``psum`` of the gradient backward). No per-operator rule exists, so
any torch op, custom op or ``autograd.Function`` follows the same rule.

Custom ``autograd.Function``s: under ``torch.func`` transforms the mode sees them as
one call (``custom_function_call``) and the rule applies as to any op. In eager mode
``Function.apply`` is invisible to modes; only the ops inside its forward are seen,
with grad off. There, the pvarys the rule asks for are added as a hook on the
Function's backward node, which psums the gradients of its less varying inputs.
Nothing in torch is patched.
"""
from __future__ import annotations

import contextlib

import optree
import torch
from torch.autograd.function import BackwardCFunction
from torch.overrides import TorchFunctionMode

from . import _ops
from ._vma import EMPTY, Tracker

_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                    "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                    "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
_INPLACE: dict = {}     # func -> is it in place (names are stable: decide once)


def _is_inplace(func) -> bool:
    hit = _INPLACE.get(func)
    if hit is None:
        name = getattr(func, "__name__", "")
        if "." in name:                               # aten overloads: "add_.Tensor"
            name = name.split(".", 1)[0]
        hit = _INPLACE[func] = (name[-1:] == "_" and name[-2:] != "__") or name in _INPLACE_DUNDERS
    return hit


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


class UnionRule(TorchFunctionMode):
    """Applies the union rule to every torch call, with ``tracker``'s tags."""

    def __init__(self, tracker: Tracker):
        super().__init__()
        self.tr = tracker
        self._nograd_mixed = False    # a no-grad op mixed vmas (a custom Function?)
        self._nograd_inputs: list = []   # its inputs that need gradients, with their vma
        self._hooked: set[int] = set()

    def _unify(self, args, kwargs, inplace: bool):
        """Implicit pvary of the less varying inputs; returns (args, kwargs, union)."""
        ts = _tensors(args, kwargs)
        if not ts:
            return args, kwargs, EMPTY
        get = self.tr.get
        vmas = [get(t) for t in ts]
        union = vmas[0].union(*vmas[1:]) if len(vmas) > 1 else vmas[0]
        if not union or all(v is union or v == union for v in vmas):
            return args, kwargs, union
        if not torch.is_grad_enabled():
            # no gradient flows through this op, so no pvary is needed; but this may
            # be the forward of a custom Function, whose inputs do get gradients
            need = [(t, v) for t, v in zip(ts, vmas) if t.requires_grad]
            if need:
                self._nograd_mixed = True
                self._nograd_inputs.extend(need)
            return args, kwargs, union
        if inplace and isinstance(args[0], torch.Tensor):
            self.tr.pvary_inplace(args[0], union)
        new = {id(t): self.tr.pvary(t, union) for t, v in zip(ts, vmas)
               if v != union and not (inplace and t is args[0])}
        args = tuple(_replace(a, new) for a in args)
        kwargs = {k: _replace(a, new) for k, a in kwargs.items()}
        return args, kwargs, union

    def _tag(self, out, union: frozenset) -> None:
        if isinstance(out, torch.Tensor):
            self.tr.set(out, union)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self.tr.set(o, union)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        tr = self.tr
        if tr._paused:
            return func(*args, **kwargs)
        if func is torch.autograd.grad:
            return self._autograd_grad(func, args, kwargs)
        if self._nograd_mixed and torch.is_grad_enabled():
            self.hook_functions(_tensors(args, kwargs))
        inplace = _is_inplace(func)
        args, kwargs, union = self._unify(args, kwargs, inplace)
        out = func(*args, **kwargs)
        if tr._alias_of and isinstance(out, torch.Tensor) and out._base is not None:
            self._follow_views(out, args)
        if union or inplace:
            self._tag(out, union)
            if inplace and isinstance(args[0], torch.Tensor) and args[0]._base is not None:
                tr.set(args[0]._base, tr.get(args[0]._base) | union)
        if kwargs and "out" in kwargs:
            self._tag(kwargs["out"], union)
        return out

    def _follow_views(self, out: torch.Tensor, args) -> None:
        """A view of a replicated input still counts as that input (see pvary)."""
        alias_of = self.tr._alias_of
        for a in args:
            if isinstance(a, torch.Tensor):
                j = alias_of.get(a)
                if j is not None and out._base is (a if a._base is None else a._base):
                    alias_of[out] = j
                    return

    def _autograd_grad(self, func, args, kwargs):
        # a gradient varies like the input it is taken with respect to (the implicit
        # pvary's transpose already summed it over the other axes)
        out = func(*args, **kwargs)
        inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        for g, x in zip(out, inputs):
            if isinstance(g, torch.Tensor):
                self.tr.set(g, self.tr.get(x))
        return out

    # -- custom autograd Functions in eager mode ---------------------------------------
    def hook_functions(self, ts) -> None:
        """For each of ``ts`` made by a custom Function (eager mode) whose inputs vary
        over fewer axes than their union: psum those inputs' gradients, as the
        implicit pvarys would have."""
        for t in ts:
            node = t.grad_fn
            if isinstance(node, BackwardCFunction) and id(node) not in self._hooked:
                self._hooked.add(id(node))
                self._hook(node, t)
        self._nograd_mixed = False
        self._nograd_inputs.clear()

    def finish(self, out) -> None:
        """At the body's end: hooks for a custom Function whose output is returned."""
        if self._nograd_mixed:
            self.hook_functions([t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)])

    def _hook(self, node, out: torch.Tensor) -> None:
        vmas = []
        for edge, nr in node.next_functions:
            v = None
            if edge is not None:
                var = getattr(edge, "variable", None)     # a leaf's AccumulateGrad
                v = self.tr.get(var) if var is not None else self._vma_of_edge(edge, nr)
            vmas.append(v)
        union = frozenset(self.tr.get(out)).union(*[v for v in vmas if v])
        groups = {i: self.tr._group(union - v).key for i, v in enumerate(vmas)
                  if v is not None and union - v}
        if not groups:
            return

        def psum_less_varying(grad_inputs, grad_outputs):
            return tuple(_ops.psum(g, groups[i], False, False)
                         if g is not None and i in groups else g
                         for i, g in enumerate(grad_inputs))
        node.register_hook(psum_less_varying)

    def _vma_of_edge(self, edge, nr: int) -> frozenset | None:
        """The vma of the non-leaf tensor behind an autograd edge: one of the inputs
        the no-grad ops saw (None: not one of them, so not less varying)."""
        for t, v in self._nograd_inputs:
            if t.grad_fn is edge and t.output_nr == nr:
                return v
        return None


@contextlib.contextmanager
def tracking(tracker: Tracker):
    """Runs a body with the union rule applied to every torch call."""
    mode = UnionRule(tracker)
    tracker.mode = mode
    with mode:
        yield tracker
