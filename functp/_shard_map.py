"""``shard_map``: run a per-shard program on every rank's local blocks."""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import optree
import torch

from . import _context, _crosscheck, _fingerprint, _world
from . import _layout, _ops
from ._errors import ShardingError
from ._boundary import SumRules, VmaRules
from ._precision import inexact
from ._interop import dtensor_to_local
from ._mesh import Mesh
from ._precision import MixedPrecision, floating
from ._layout import GLOBAL_SHAPE, check_even_block
from ._spec import P, normalize_spec
from ._tree import keystr, match_specs
from ._vma import Tracker
from ._vma_mode import tracking

__all__ = ["shard_map"]


def shard_map(f: Callable | None = None, mesh: Mesh | None = None, in_specs: Any = None,
              out_specs: Any = None, *, check_vma: bool = True,
              axis_names: Any = None, unreduced: Any = (),
              mixed_precision: MixedPrecision | None = None) -> Callable:
    """Maps ``f``, written for one rank's local blocks, over the mesh.

    **Arguments:** ``f`` – the per-shard program; it may call functp's collectives.
    ``mesh`` – a :class:`Mesh`. ``in_specs`` – a pytree prefix of the positional
    arguments (a tuple, one entry per argument, or one spec for all), each leaf a
    ``P`` or a DTensor placement list. ``out_specs`` – the same for ``f``'s result.
    ``check_vma`` – track which mesh axes every value varies over (JAX's vma): the
    fewest backward collectives, and an error when an output declared replicated is
    not. ``False`` skips tracking and uses sum-semantics boundary rules instead (same
    gradients, some extra backward all-reduces). Under ``torch.compile`` a body keeps
    its rules: the compiled graph issues the same collectives as the eager step.
    ``axis_names`` – the mesh axes the body is manual over (default: all). Specs and
    collectives may name only these; along the others values stay whole. A
    shard_map called inside another body must name axes the outer one does not:
    its inputs are whole along them and it splits them by its in_specs itself.
    ``unreduced`` – mesh axes (a name or a tuple) over which the gradients of inputs
    replicated along them are left *unreduced*: each rank gets its own contribution,
    not their sum, and no gradient all-reduce over those axes runs. Sum the
    contributions of several microbatches locally, then reduce once with
    :func:`reduce_unreduced` (JAX's "unreduced" sharding state).
    ``mixed_precision`` – a :class:`MixedPrecision`: the dtype the body computes in
    and the dtype the boundary's gradient all-reduces run in.

    **Returns:** a function taking and returning *local blocks*. Gradients through it
    (``torch.func.grad`` or ``torch.autograd``) are the local blocks of the gradient of
    the global function. Non-tensor leaves pass through unchanged.

    Works as a decorator too: ``@functools.partial(shard_map, mesh=m, in_specs=...,
    out_specs=...)`` or ``@shard_map(mesh=m, in_specs=..., out_specs=...)``.

    Example (2 ranks; ``x`` is this rank's half of the rows)::

        mesh = functp.make_mesh((2,), ("dp",))
        total = functp.shard_map(lambda x: functp.psum(x.sum(), "dp"), mesh,
                                 in_specs=P("dp"), out_specs=P())
        total(x)        # the sum over both ranks' rows, on every rank
    """
    if f is None:
        return functools.partial(shard_map, mesh=mesh, in_specs=in_specs,
                                 out_specs=out_specs, check_vma=check_vma,
                                 axis_names=axis_names, unreduced=unreduced,
                                 mixed_precision=mixed_precision)
    if not callable(f):
        raise ShardingError(f"shard_map: the first argument must be a function, got {f!r}")
    if not isinstance(mesh, Mesh):
        from torch.distributed.device_mesh import DeviceMesh
        if isinstance(mesh, DeviceMesh):
            mesh = Mesh.from_device_mesh(mesh)
        else:
            raise ShardingError(
                f"shard_map: mesh must be a functp.Mesh (from functp.make_mesh), got {mesh!r}")
    for name, val in (("in_specs", in_specs), ("out_specs", out_specs)):
        if val is None:
            raise ShardingError(
                f"shard_map: {name} is required; use P() for replicated values")
    in_specs = tuple(in_specs) if isinstance(in_specs, list) else in_specs
    axes = _manual_axes(mesh, axis_names)
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ShardingError(f"shard_map: mixed_precision must be a functp.MixedPrecision, "
                            f"got {mixed_precision!r}")
    body = _Body(f, mesh, in_specs, out_specs, check_vma, axes, _unreduced(axes, unreduced),
                 mixed_precision)

    @functools.wraps(f)
    def mapped(*args, **kwargs):
        if _world.SIMULATING and torch.compiler.is_compiling():
            return _refuse_compile()
        return body(*args, **kwargs)
    return mapped


def _raise_compile_refused():
    raise ShardingError(_world.COMPILE_REFUSED)


# torch.compile inside functp.simulate is refused here, where it meets the call, before
# anything of the body is traced (both check_vma settings): as a call Dynamo must not
# trace, it is a graph break that then raises this ShardingError (fullgraph=False), or
# Dynamo's own error quoting the reason (fullgraph=True); traced, its raise would make
# Dynamo go on tracing the body's own frames one by one
_refuse_compile = torch.compiler.disable(_raise_compile_refused, reason=_world.COMPILE_REFUSED)


def _unreduced(axes: tuple[str, ...], unreduced) -> frozenset:
    names = {unreduced} if isinstance(unreduced, str) else set(unreduced or ())
    if not names <= set(axes):
        raise ShardingError(
            f"shard_map: unreduced={sorted(names)} must name axes the body is manual "
            f"over, {axes}")
    return frozenset(names)


def _manual_axes(mesh: Mesh, axis_names) -> tuple[str, ...]:
    if axis_names is None:
        return mesh.axis_names
    names = {axis_names} if isinstance(axis_names, str) else set(axis_names)
    unknown = sorted(names - set(mesh.axis_names))
    if unknown or not names:
        raise ShardingError(
            f"shard_map: axis_names {sorted(names)} must be a non-empty subset of the "
            f"mesh axes {mesh.axis_names}")
    return tuple(a for a in mesh.axis_names if a in names)


class _NoneArg:
    """Stands for a ``None`` argument across ``nonstrict_trace``, which refuses
    ``None`` leaves but takes a registered pytree constant made before Dynamo ran."""

    def __eq__(self, other):
        return isinstance(other, _NoneArg)

    def __hash__(self):
        return 0


_NONE = _NoneArg()
torch.utils._pytree.register_constant(_NoneArg)


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


def _check_traceable(out, name: str) -> None:
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


def _opaque(body: "_Body") -> Callable | None:
    """The body as Dynamo sees a vma body: one opaque call (``nonstrict_trace``),
    which AOTAutograd then traces by running the body as Python on fake tensors. The
    tracking mode runs there as in eager mode, so the compiled graph has the vma
    rules' collectives, no more, and vma errors are raised while compiling. (Dynamo
    cannot trace the mode itself: the tags live in the tensors' ``__dict__``.)
    Dynamo accepts only functions made outside the region it compiles: ``None``
    for a body made while it traces."""
    if torch.compiler.is_dynamo_compiling():
        return None
    from torch._dynamo import disable, nonstrict_trace   # (0.3 s, at the first shard_map)

    # A closure (Dynamo drops a bound method's self). AOTAutograd runs it, not Dynamo;
    # should Dynamo fall back to running it (a graph break), it must not trace it
    # either, or it would meet this call again.
    def run(*args):
        try:
            out = body._run(_nones(args, _NONE, None), None)
            if torch.compiler.is_compiling():
                _check_traceable(out, body.name)
            return out
        except ShardingError as e:
            if torch.compiler.is_compiling():
                # with fullgraph=True Dynamo reports only "Unsupported output type for
                # nonstrict_trace-ed function", without this error's text
                warnings.warn(f"torch.compile could not trace the shard_map body "
                              f"{body.name!r}: {e}", stacklevel=2)
            raise
    return nonstrict_trace(disable(run))


class _InPlan:
    """What shard_map knows of one input tree (its structure and leaf types) once
    it has checked it: printable paths, normalized specs (None for non-tensors),
    which leaves are DTensors, and the boundary rules' plan per tuple of dtypes."""

    def __init__(self, paths, specs, tensors, dtensors, specs_raw):
        self.paths, self.specs, self.tensors, self.dtensors = paths, specs, tensors, dtensors
        self.specs_raw = specs_raw          # as given: a DTensor's is normalized per call
        self.spec_lens = [len(specs[i]) if specs[i] is not None else 0 for i in tensors]
        self.boundary: dict = {}        # (check_vma, leaf dtypes) -> the boundary rules' plan


class _Body:
    def __init__(self, f, mesh: Mesh, in_specs, out_specs, check_vma: bool,
                 axes: tuple[str, ...], unreduced: frozenset = frozenset(),
                 precision: MixedPrecision | None = None):
        self.f, self.mesh, self.check_vma, self.axes = f, mesh, check_vma, axes
        self.precision = precision
        self.name = getattr(f, "__name__", "body")       # for the check mode's errors
        self.in_specs, self.out_specs = in_specs, out_specs
        self.vma_rules = VmaRules(mesh, axes, unreduced)
        self.sum_rules = SumRules(mesh, axes, unreduced)
        # per input tree: (treespec, leaf types) -> _InPlan; per output tree likewise
        self._in_plans: dict = {}
        self._out_plans: dict = {}
        self._axis_groups: dict = {}     # manual axes -> {axis name: AxisGroup}, for frames
        self._opaque = _opaque(self) if check_vma else None

    def __call__(self, *args, **kwargs):
        if self.mesh._debug_generation != _crosscheck.GENERATION:
            if not torch.compiler.is_dynamo_compiling():
                _crosscheck.agree_mode(self.mesh)      # (first call, or set_debug since)
        if not _crosscheck.ENABLED:
            return self._call(args, kwargs)
        if torch.compiler.is_dynamo_compiling():
            return self._call(args, kwargs)
        try:
            return self._call(args, kwargs)
        except Exception as e:
            # an error on this rank only would leave the others waiting in their next
            # collective: they are told at their next check and raise there too
            _crosscheck.raised(self.mesh, self.name, e)
            raise

    def _call(self, args, kwargs):
        if kwargs:
            raise ShardingError(
                f"shard_map'd function {getattr(self.f, '__name__', self.f)!r} got keyword "
                f"arguments {sorted(kwargs)}; pass them positionally with an in_spec each "
                f"(or close over non-tensor options with functools.partial)")
        outer = _context.top()
        if outer is None:
            return self._run(args, None)
        self._check_nesting(outer)
        if outer.tracker is None:
            return self._run(args, outer)
        with outer.tracker.paused():      # our own bookkeeping is not the user's program
            return self._run(args, outer)

    def _check_nesting(self, outer: _context.Frame) -> None:
        if outer.mesh is not self.mesh:
            raise ShardingError(
                f"a shard_map over {self.mesh} was called inside one over {outer.mesh}; "
                f"a nested shard_map must use the same mesh")
        both = [a for a in self.axes if a in outer.manual]
        if both:
            raise ShardingError(
                f"a shard_map over axes {self.axes} was called inside one that is already "
                f"manual over {outer.manual}; a nested shard_map takes the axes the outer "
                f"one left whole: give the outer one axis_names without {both[0]!r}, or "
                f"the inner one axis_names without it")

    # -- inputs ----------------------------------------------------------------------
    def _in_plan(self, args, leaves, treespec, compiling: bool) -> _InPlan:
        # (while Dynamo traces, a treespec cannot be a key, and a trace runs once)
        key = None if compiling else (treespec, tuple(map(type, leaves)))
        plan = None if compiling else self._in_plans.get(key)
        if plan is None:
            from torch.distributed.tensor import DTensor
            paths, _, specs, _ = match_specs(self.in_specs, args, "in_specs", "args")
            tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            dtensors = [i for i in tensors if isinstance(leaves[i], DTensor)]
            norm = [None] * len(leaves)
            for i in tensors:
                if i not in dtensors:
                    norm[i] = self._spec(specs[i], f"in_specs for {paths[i]}", leaves[i].shape)
            plan = _InPlan(paths, norm, tensors, dtensors, specs)
            if not compiling:
                self._in_plans[key] = plan
        return plan

    def _local_inputs(self, plan: _InPlan, leaves: list, compiling: bool) -> tuple[list, list]:
        """This rank's blocks and their specs, checked against the spec lengths."""
        specs = plan.specs
        if plan.dtensors:        # a DTensor argument is a global value: take its block
            specs = list(specs)
            leaves = list(leaves)
            for i in plan.dtensors:
                leaves[i] = dtensor_to_local(leaves[i], self.mesh, plan.specs_raw[i], plan.paths[i])
                specs[i] = self._spec(plan.specs_raw[i], f"in_specs for {plan.paths[i]}",
                                      leaves[i].shape)
        for i, n in zip(plan.tensors, plan.spec_lens):
            x = leaves[i]
            if n > x.ndim:       # the same tree with a lower-rank tensor
                self._spec(specs[i], f"in_specs for {plan.paths[i]}", x.shape)
            # an uneven block made by functp.shard (Dynamo cannot trace __dict__)
            if (getattr(x, GLOBAL_SHAPE, None) is not None if compiling
                    else GLOBAL_SHAPE in x.__dict__):
                check_even_block(x, specs[i], self.mesh, plan.paths[i])
        return leaves, specs

    def _rules_plan(self, plan: _InPlan, rules, specs: list, local: list, base):
        """``rules.plan`` for these inputs, cached in ``plan`` by the leaves' dtypes
        (not for a nested body or DTensor inputs: it depends on more than the tree)."""
        key = None
        if base is None and not plan.dtensors:
            key = (rules.check_vma, tuple([local[i].dtype for i in plan.tensors]))
            hit = plan.boundary.get(key)
            if hit is not None:
                return hit
        hit = rules.plan(specs, [isinstance(x, torch.Tensor) and inexact(x) for x in local], base)
        if key is not None:
            plan.boundary[key] = hit
        return hit

    def _run(self, args, outer: _context.Frame | None):
        compiling = torch.compiler.is_dynamo_compiling()
        if compiling and outer is None:
            if self.check_vma:
                if self._opaque is None:
                    raise ShardingError(
                        f"shard_map of {self.name!r} was made inside a torch.compile region "
                        f"and called there; with check_vma=True make it outside, once "
                        f"(functp.shard_map(...) before torch.compile), or pass "
                        f"check_vma=False")
                return self._opaque(*_nones(args, None, _NONE))
        # Dynamo traces this call (a check_vma=False body): no tracking, no caches
        tracing = compiling or torch.compiler.is_compiling()   # or AOTAutograd does
        leaves, treespec = optree.tree_flatten(args)
        plan = self._in_plan(args, leaves, treespec, compiling)
        leaves, specs = self._local_inputs(plan, leaves, compiling)
        local = list(leaves)
        base = None
        if outer is None:
            manual = self.axes
            tracker = Tracker(self.mesh, tracing) if self.check_vma and not compiling else None
        else:   # the inputs are whole along our axes: take this rank's blocks
            manual = tuple(a for a in self.mesh.axis_names if a in self.axes or a in outer.manual)
            tracker = outer.tracker
            if tracker is not None:
                base = [tracker.get(x) if s is not None else None for x, s in zip(local, specs)]
            for i in plan.tensors:
                local[i] = self._take_block(plan.paths[i], local[i], specs[i])
        if _crosscheck.ENABLED and not tracing:    # ranks agree on the blocks
            _crosscheck.boundary(self.mesh, self.name, "entry", plan.paths, local)
            if outer is None:     # (a nested body's blocks carry the outer vma tags)
                _fingerprint.check_inputs(self.mesh, self.axes, self.name, plan.paths,
                                          local, specs)
                local = _crosscheck.mark(self.mesh, self.name, "backward done", local)
        rules = self.vma_rules if tracker is not None else self.sum_rules
        mp = self.precision
        if mp is not None and mp.reduction_dtype is not None:   # the reduction's dtype
            local = [x.to(mp.reduction_dtype) if floating(x) else x for x in local]
        rules.enter(tracker, local, self._rules_plan(plan, rules, specs, local, base))
        if mp is not None and mp.param_dtype is not None:    # then the body's
            rules.cast(tracker, local, mp.param_dtype)
        # (not while Dynamo traces: filling a cache it guards on would recompile)
        groups = {} if compiling else self._axis_groups.setdefault(manual, {})
        with _context.frame(self.mesh, self.check_vma, tracker, manual, groups):
            if tracker is None:
                out = self.f(*optree.tree_unflatten(treespec, local))
            elif outer is not None:
                with tracker.resumed():
                    out = self.f(*optree.tree_unflatten(treespec, local))
            else:
                with tracking(tracker):
                    out = self.f(*optree.tree_unflatten(treespec, local))
        if tracker is not None and tracker.mode is not None:
            tracker.mode.finish(out)   # a custom Function's output returned as it is
        try:
            out, specs = self._outputs(out, rules, tracker, outer is not None, compiling)
            if _crosscheck.ENABLED and not tracing:
                out = self._check_outputs(out, specs if outer is None else None)
            return out
        finally:
            if tracker is not None and outer is None:
                tracker.forget([leaves[i] for i in plan.tensors])

    # -- outputs ---------------------------------------------------------------------
    def _check_outputs(self, out, specs: list | None):
        """The check mode at the exit: ranks agree on the output blocks (and, for a
        top-level body, given its outputs' ``specs``, on the values declared
        replicated), and the backward starts on every rank together."""
        paths, leaves, treespec = optree.tree_flatten_with_path(out)
        paths = [keystr("output", p) for p in paths]
        _crosscheck.boundary(self.mesh, self.name, "exit", paths, leaves)
        if specs is not None:
            _fingerprint.check_outputs(self.mesh, self.axes, self.name, paths, leaves, specs,
                                       self.check_vma)
            leaves = _crosscheck.mark(self.mesh, self.name, "backward start", leaves)
        return optree.tree_unflatten(treespec, leaves)

    def _outputs(self, out, rules, tracker, nested: bool, compiling: bool):
        oleaves, otree = optree.tree_flatten(out)
        key = None if compiling else (otree, tuple(map(type, oleaves)))
        hit = None if compiling else self._out_plans.get(key)
        if hit is None:
            paths, _, specs, _ = match_specs(self.out_specs, out, "out_specs", "output")
            specs = [self._spec(s, f"out_specs for {p}", y.shape)
                     if isinstance(y, torch.Tensor) else None
                     for p, y, s in zip(paths, oleaves, specs)]
            hit = (paths, specs)
            if not compiling:
                self._out_plans[key] = hit
        paths, specs = hit
        for i, (y, spec) in enumerate(zip(oleaves, specs)):
            if spec is None:
                continue
            if len(spec) > y.ndim:
                self._spec(spec, f"out_specs for {paths[i]}", y.shape)
            y = rules.exit(tracker, paths[i], y, spec)
            oleaves[i] = self._gather_back(y, spec, tracker) if nested else y
        return optree.tree_unflatten(otree, oleaves), specs

    def _gather_back(self, y: torch.Tensor, spec: P, tracker) -> torch.Tensor:
        """A nested body's output, back to whole along its axes for the outer body
        (a packed dimension gathered block by block, through its packed view)."""
        vma = tracker.get(y) if tracker is not None else None
        view = _layout.view_spec(spec) if spec.packed else spec
        y = _layout.view(y, spec) if spec.packed else y
        for d in range(len(view)):
            axes = view.dim_axes(d)
            if axes:
                y = _ops.all_gather(y, self.mesh.axis_group(axes).key, d, True, True)
        y = _layout.unview(y, spec) if spec.packed else y
        if tracker is not None:
            tracker.set(y, vma - frozenset(self.axes))
        return y

    def _spec(self, spec, where: str, shape) -> P:
        spec = normalize_spec(spec, self.mesh.axis_names, where, shape)
        auto = [a for a in spec.axes if a not in self.axes]
        if auto:
            raise ShardingError(
                f"{where} (shape {tuple(shape)}): {spec!r} names mesh axis {auto[0]!r}, but "
                f"this shard_map is manual only over {self.axes} (axis_names); add "
                f"{auto[0]!r} to axis_names or drop it from the spec")
        return spec

    def _take_block(self, path: str, x: torch.Tensor, spec: P) -> torch.Tensor:
        """This rank's block of ``x``, whole along our axes (a packed dimension: this
        rank's slice of each of its blocks, through its packed view)."""
        if spec.packed:
            _layout.check_packed(f"in_specs for {path}", x.shape, spec, self.mesh.shape)
            view = _layout.view_spec(spec)
            return _layout.unview(self._take_block(path, _layout.view(x, spec), view), spec)
        dims = []
        for d in range(len(spec)):
            axes = spec.dim_axes(d)
            if axes:
                g = self.mesh.axis_group(axes)
                if _layout.uneven(x.shape[d], g.size):
                    raise ShardingError(
                        f"in_specs for {path} (shape {tuple(x.shape)}): {spec!r} splits "
                        f"dimension {d} of size {x.shape[d]} over {axes} of size {g.size}, "
                        f"which does not divide it; pad it to a multiple of {g.size}")
                dims.append((d, g))
        return _ops.take_block(x, [d for d, _ in dims], [g.key for _, g in dims]) if dims else x
