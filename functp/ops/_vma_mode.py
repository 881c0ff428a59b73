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
Function's backward node, which psums the gradients of its less varying inputs
(:class:`FunctionHooks`). Nothing in torch is patched.

A body runs inside ``with UnionRule(tracker):`` (``_shard_map``, and ``_remat``'s
recompute); the tags and pvarys are the tracker's (``_vma.py``).
"""
from __future__ import annotations

import optree
import torch
from torch.overrides import TorchFunctionMode

from . import _lazy, _ops
from ..runtime import _compile
from ..runtime._torch_compat import BackwardCFunction
from ._vma import _TAG, EMPTY, Tracker, _level_of

_AUTOGRAD_GRAD = torch.autograd.grad
_waits = _lazy._state
# classes whose instances are never tensors, and tensor classes, seen so far (set
# membership costs no Python call; isinstance does)
_PLAIN = {int, float, bool, complex, str, type(None), torch.dtype, torch.device,
          torch.Size, slice, type(Ellipsis), torch.memory_format, torch.layout}
_TENSOR_TYPES = {torch.Tensor, torch.nn.Parameter}


def _is_tensor_type(cls) -> bool:
    """Learns whether ``cls`` is a tensor class (once per class)."""
    if issubclass(cls, torch.Tensor):
        _TENSOR_TYPES.add(cls)
        return True
    return False


_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                    "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                    "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
_INPLACE_FUNCS: set = set()       # funcs seen, sorted by whether they mutate (by name:
_OUTOFPLACE_FUNCS: set = set()    # decided once per func)


def _is_inplace(func) -> bool:
    if func in _INPLACE_FUNCS:
        return True
    if func in _OUTOFPLACE_FUNCS:
        return False
    name = getattr(func, "__name__", "")
    if "." in name:                               # aten overloads: "add_.Tensor"
        name = name.split(".", 1)[0]
    inplace = (name[-1:] == "_" and name[-2:] != "__") or name in _INPLACE_DUNDERS
    try:
        (_INPLACE_FUNCS if inplace else _OUTOFPLACE_FUNCS).add(func)
    except TypeError:           # an unhashable callable: decide each time
        pass
    return inplace


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


def join(vmas: list) -> frozenset:
    """The union rule's join: an op's result varies over the union of its tensor
    inputs' vmas, and each input that varies over less (``v != union``) is pvary'd
    to it first. ``ops/_replay``'s re-run of a recorded call applies this same
    function, so the rule and the check of a record cannot drift apart.

    **Arguments:** the inputs' vmas (at least one). **Returns:** their union.
    Example: ``join([frozenset({"dp"}), frozenset({"tp"})])`` is ``{"dp", "tp"}``.
    """
    return vmas[0].union(*vmas[1:]) if len(vmas) > 1 else vmas[0]


def _replace(x, new: dict[int, torch.Tensor]):
    if isinstance(x, torch.Tensor):
        return new.get(id(x), x)
    if isinstance(x, (list, tuple)) and any(id(t) in new for t in x):
        return type(x)(new.get(id(t), t) for t in x)
    return x


class _CustomFunctions:
    """A union rule's part for custom autograd Functions in eager mode, where
    ``Function.apply`` is invisible to modes: a no-grad op that mixes vmas may be a
    Function's forward; its inputs are kept, and the Function's backward node hooked
    once its output is seen (:class:`FunctionHooks`)."""

    tr: Tracker

    def __init__(self) -> None:
        self._nograd_mixed = False    # a no-grad op mixed vmas (a custom Function?)
        self.hooks: FunctionHooks | None = None     # made at the first such op

    def nograd_mixed(self, ts: list, vmas: list) -> None:
        """A no-grad op whose inputs ``ts`` (with ``vmas``) vary over different axes:
        no gradient flows through it, but it may be a custom Function's forward,
        whose inputs do get gradients."""
        need = [(t, v) for t, v in zip(ts, vmas) if t.requires_grad]
        if need:
            if self.hooks is None:
                self.hooks = FunctionHooks(self.tr)
            self._nograd_mixed = True
            self.hooks.inputs.extend(need)

    def hook_functions(self, ts) -> None:
        """For each of ``ts`` made by a custom Function (eager mode) whose inputs vary
        over fewer axes than their union: psum those inputs' gradients, as the
        implicit pvarys would have."""
        self.hooks.hook_outputs(ts)
        self.discard_nograd()

    def discard_nograd(self) -> None:
        """Forgets the mixed no-grad ops seen so far (hooked, or known not to be a
        custom Function's forward: functp.checkpoint's first run)."""
        self._nograd_mixed = False
        if self.hooks is not None:
            self.hooks.inputs.clear()

    def finish(self, out) -> None:
        """At the body's end: hooks for a custom Function whose output is returned."""
        if self._nograd_mixed:
            self.hook_functions([t for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor)])


def _tag(tr: Tracker, out, union: frozenset) -> None:
    """``out`` (a tensor, or a list or tuple of them) varies over ``union``."""
    if isinstance(out, torch.Tensor):
        tr.set(out, union)
    elif isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, torch.Tensor):
                tr.set(o, union)


class UnionRule(_CustomFunctions, TorchFunctionMode):
    """Applies the union rule to every torch call, with ``tracker``'s tags; its
    ``with`` block is the body's run (``tracker.mode`` is this rule)."""

    def __init__(self, tracker: Tracker):
        TorchFunctionMode.__init__(self)
        _CustomFunctions.__init__(self)
        self.tr = tracker
        tracker.mode = self
        self._eager = False

    # A torch.compile'd function the body calls runs eagerly, so that this rule sees
    # its ops (Dynamo would trace this mode, and cannot read the tags): _compile.
    def __enter__(self):
        self._eager = _compile.eager_enter()
        try:
            return super().__enter__()
        except BaseException:
            self._exit_eager()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._exit_eager()

    def _exit_eager(self) -> None:
        if self._eager:
            self._eager = False
            _compile.eager_exit()

    def _write(self, t: torch.Tensor, union: frozenset) -> None:   # (no bound attr: a cycle)
        self.tr.pvary_inplace(t, union)     # an in-place op's input as varying as its value

    def _unify(self, args, kwargs, inplace: bool):
        """Implicit pvary of the less varying inputs; returns (args, kwargs, union)."""
        ts = _tensors(args, kwargs)
        if not ts:
            return args, kwargs, EMPTY
        get = self.tr.get
        vmas = [get(t) for t in ts]
        union = join(vmas)
        if not union or all(v is union or v == union for v in vmas):
            return args, kwargs, union
        if not torch.is_grad_enabled():
            self.nograd_mixed(ts, vmas)
            return args, kwargs, union
        if inplace and isinstance(args[0], torch.Tensor):
            self._write(args[0], union)
        new = {id(t): self.tr.pvary(t, union) for t, v in zip(ts, vmas)
               if v != union and not (inplace and t is args[0])}
        args = tuple(_replace(a, new) for a in args)
        kwargs = {k: _replace(a, new) for k, a in kwargs.items()}
        return args, kwargs, union

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tr = self.tr
        if _waits.on:        # a forward collective's result pending (or was): _lazy
            _lazy.check(args, kwargs)
        if tr._paused:
            return func(*args, **kwargs) if kwargs else func(*args)
        if kwargs:
            # keywords take the fast path too (most are dim=, keepdim=, dtype=,
            # is_causal=), except out= and the cases below
            if "out" in kwargs or self._nograd_mixed or func is _AUTOGRAD_GRAD:
                return self._general(func, args, kwargs)
            seq = (*args, *kwargs.values())
        elif self._nograd_mixed or func is _AUTOGRAD_GRAD:
            return self._general(func, args, {})
        else:
            seq = args
        # The fast path, for most ops: tags read from the tensors' __dict__ (no Python
        # call), nothing to do when the inputs agree.
        token = tr.token
        union = None
        for a in seq:
            cls = a.__class__
            if cls in _PLAIN:
                continue
            if cls not in _TENSOR_TYPES and not _is_tensor_type(cls):
                if cls is tuple or cls is list:
                    # sizes, dims (x.view((2, 3)), x.sum(dim=(1, 2))): plain if no
                    # element is a tensor or a nested sequence (checked without calls)
                    for e in a:
                        if e.__class__ not in _PLAIN:
                            return self._general(func, args, kwargs or {})
                    continue
                return self._general(func, args, kwargs or {})     # torch.cat's list, ...
            d = a.__dict__
            tag = d[_TAG] if _TAG in d else None
            if tag is not None and tag[0] == token:
                v = tag[1]
                base = a._base
                if base is not None:   # a view also varies like its base (in place)
                    d = base.__dict__
                    b = d[_TAG] if _TAG in d else None
                    if b is not None and b[0] == token and b[1] and b[1] is not v:
                        v = v | b[1]
            else:
                v = tr.get(a)          # an untagged or a wrapped tensor
            if union is None or v is union:
                union = v
            elif v != union:
                if kwargs:
                    return self._general(func, args, kwargs)
                return self._mixed(func, args)              # inputs disagree
        if func not in _OUTOFPLACE_FUNCS and _is_inplace(func):
            return self._general(func, args, kwargs or {})
        out = func(*args, **kwargs) if kwargs else func(*args)
        if out.__class__ in _TENSOR_TYPES:
            out.__dict__[_TAG] = (token, union or EMPTY)
            # made inside a torch.func transform in the body: tag what it wraps too
            # (an invariant needs no tags there: untagged means invariant)
            if union and _level_of(out) > tr.level:
                tr.set(out, union)
            if out._base is not None and tr.aliases is not None:
                tr.aliases.follow_view(out, func, args, kwargs, _is_inplace)
        elif union:
            _tag(self.tr, out, union)        # a tuple of tensors, or a tensor class not seen yet
        return out

    def _mixed(self, func, args):
        """Positional tensors that vary over different axes (the fast path checked
        that every argument is a tensor or a plain value): pvary the less varying
        ones to the union, as ``_general`` would, without rescanning for lists,
        keywords and ``out=``."""
        if not torch.is_grad_enabled() or (func not in _OUTOFPLACE_FUNCS and _is_inplace(func)):
            return self._general(func, args, {})
        tr = self.tr
        vmas = [tr.get(a) if a.__class__ in _TENSOR_TYPES else None for a in args]
        union = join([v for v in vmas if v is not None])
        args = [a if v is None or v == union else tr.pvary(a, union)
                for a, v in zip(args, vmas)]
        out = func(*args)
        _tag(self.tr, out, union)
        if tr.aliases is not None and isinstance(out, torch.Tensor) and out._base is not None:
            tr.aliases.follow_view(out, func, args, None, _is_inplace)
        return out

    def _general(self, func, args, kwargs):
        """Any call: keyword arguments, lists of tensors, in-place ops, mixed vmas."""
        tr = self.tr
        if func is _AUTOGRAD_GRAD:
            return self._autograd_grad(func, args, kwargs)
        if self._nograd_mixed and torch.is_grad_enabled():
            self.hook_functions(_tensors(args, kwargs))
        inplace = _is_inplace(func)
        args, kwargs, union = self._unify(args, kwargs, inplace)
        out = func(*args, **kwargs)
        if tr.aliases is not None and isinstance(out, torch.Tensor) and out._base is not None:
            tr.aliases.follow_view(out, func, args, kwargs, _is_inplace)
        if union or inplace:
            _tag(self.tr, out, union)
            if inplace and isinstance(args[0], torch.Tensor) and args[0]._base is not None:
                tr.set(args[0]._base, tr.get(args[0]._base) | union)
        if kwargs and "out" in kwargs:
            _tag(self.tr, kwargs["out"], union)
        return out

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


class FunctionHooks:
    """Custom autograd Functions in eager mode, where ``Function.apply`` is invisible
    to modes: the no-grad ops of a forward that mixed vmas are recorded (``inputs``),
    and the Function's backward node gets a hook that psums the gradients of its less
    varying inputs, as the implicit pvarys would have."""

    def __init__(self, tracker: Tracker):
        self.tr = tracker
        self.inputs: list = []     # (tensor, vma) of such ops' inputs that need gradients
        self._hooked: set[int] = set()

    def hook_outputs(self, ts) -> None:
        """Hooks the backward node of each of ``ts`` made by a custom Function."""
        for t in ts:
            node = t.grad_fn
            if isinstance(node, BackwardCFunction) and id(node) not in self._hooked:
                self._hooked.add(id(node))
                self.hook(node, t)

    def hook(self, node, out: torch.Tensor) -> None:
        """Psums the gradients ``node`` passes to inputs less varying than ``out``."""
        vmas = []
        for edge, nr in node.next_functions:
            v = None
            if edge is not None:
                var = getattr(edge, "variable", None)     # a leaf's AccumulateGrad
                v = self.tr.get(var) if var is not None else self._vma_of_edge(edge, nr)
            vmas.append(v)
        union = self.tr.get(out).union(*[v for v in vmas if v])
        groups = {i: self.tr.group(union - v).key for i, v in enumerate(vmas)
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
        for t, v in self.inputs:
            if t.grad_fn is edge and t.output_nr == nr:
                return v
        return None
