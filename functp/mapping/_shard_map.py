"""``shard_map``: run a per-shard program on every rank's local blocks.

The path a call takes, one function per stage, in this file's order:

0. ``shard_map``, ``_checked_arguments``: once: the arguments checked, a ``_Body`` made.
1. ``_Body.__call__``: the check mode's agreement; a rank's error told to the others.
2. ``_call``: at the top, or nested in another body (same mesh, other axes).
3. ``_check_inputs``: in_specs matched to the arguments (cached), every block checked.
4. ``_enter``: enter the manual axes: blocks taken, cast, tagged and aliased.
5. ``_run_body``: the body, with the axes bound and vma tracked.
6. ``_exit``: outputs checked against out_specs and assembled (gathered back if nested).

``_run`` runs stages 3-6; what torch.compile traces of them, and the refusal
inside ``functp.simulate``, are decided in ``_compile``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch

from ..runtime import _compile
from ..ops import _context
from ..ops import _lazy
from ..runtime import _crosscheck
from ..runtime import _fingerprint
from ..runtime import _watch
from ..runtime import _world
from ..mesh import _layout
from ..ops import _ops
from ..ops import _overlap
from ._boundary import SumRules, VmaRules
from ..runtime._errors import ShardingError, keystr
from ._interop import dtensor_to_local
from ..mesh._mesh import Mesh
from ..runtime._precision import MixedPrecision, floating, inexact
from ..mesh._layout import GLOBAL_SHAPE, check_even_block
from ..mesh._spec import P, normalize_spec
from ..mesh._tree import match_specs
from ..ops._vma import Tracker
from ..ops._vma_mode import UnionRule

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
    mesh = _checked_arguments(f, mesh, in_specs, out_specs, mixed_precision)
    axes = _manual_axes(mesh, axis_names)
    body = _Body(f, mesh, tuple(in_specs) if isinstance(in_specs, list) else in_specs,
                 out_specs, check_vma, axes, _unreduced(axes, unreduced), mixed_precision)

    @functools.wraps(f)
    def mapped(*args, **kwargs):
        if _world.SIMULATING and _compile.refused():    # (the flag first: no call
            return _compile.refuse()                     # outside functp.simulate)
        return body(*args, **kwargs)
    return mapped


def _checked_arguments(f, mesh, in_specs, out_specs, mixed_precision) -> Mesh:
    """Stage 0, once per shard_map: the arguments' types; the functp mesh."""
    if not callable(f):
        raise ShardingError(f"shard_map: the first argument must be a function, got {f!r}")
    if not isinstance(mesh, Mesh):
        from torch.distributed.device_mesh import DeviceMesh
        if not isinstance(mesh, DeviceMesh):
            raise ShardingError(
                f"shard_map: mesh must be a functp.Mesh (from functp.make_mesh), got {mesh!r}")
        mesh = Mesh.from_device_mesh(mesh)
    for name, val in (("in_specs", in_specs), ("out_specs", out_specs)):
        if val is None:
            raise ShardingError(
                f"shard_map: {name} is required; use P() for replicated values")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ShardingError(f"shard_map: mixed_precision must be a functp.MixedPrecision, "
                            f"got {mixed_precision!r}")
    return mesh


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
    """One shard_map'd function: its specs, its boundary rules and its caches. A call
    runs the stages below in order (see the module docstring)."""

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
        self._opaque = (_compile.opaque(functools.partial(_run, self), self.name, f)
                        if check_vma else None)

    def __call__(self, *args, **kwargs):
        """Stage 1: the check mode's agreement around the whole call."""
        if self.mesh._debug_generation != _crosscheck.GENERATION:
            if not _compile.dynamo_tracing():
                _crosscheck.agree_mode(self.mesh)      # (first call, or set_debug since)
        if not _crosscheck.ENABLED:
            return _call(self, args, kwargs)
        if _compile.dynamo_tracing():
            return _call(self, args, kwargs)
        try:
            return _call(self, args, kwargs)
        except Exception as e:
            # an error on this rank only would leave the others waiting in their next
            # collective: they are told at their next check and raise there too
            _crosscheck.raised(self.mesh, self.name, e)
            raise


def _call(body: _Body, args, kwargs):
    """Stage 2: where the body runs: at the top, or nested in another body."""
    if kwargs:
        raise ShardingError(
            f"shard_map'd function {getattr(body.f, '__name__', body.f)!r} got keyword "
            f"arguments {sorted(kwargs)}; pass them positionally with an in_spec each "
            f"(or close over non-tensor options with functools.partial)")
    outer = _context.top()
    if outer is None:
        if (_watch.ENABLED and not _world.SIMULATING and not _crosscheck.ENABLED
                and not _compile.dynamo_tracing()):
            _watch.entered(body)      # (which call each rank is in: runtime/_watch)
        return _run(body, args)
    _check_nesting(body, outer)
    if outer.tracker is None:
        return _run(body, args, outer)
    with outer.tracker.paused():      # our own bookkeeping is not the user's program
        return _run(body, args, outer)


def _check_nesting(body: _Body, outer: _context.Frame) -> None:
    if outer.mesh is not body.mesh:
        raise ShardingError(
            f"a shard_map over {body.mesh} was called inside one over {outer.mesh}; "
            f"a nested shard_map must use the same mesh")
    both = [a for a in body.axes if a in outer.manual]
    if both:
        raise ShardingError(
            f"a shard_map over axes {body.axes} was called inside one that is already "
            f"manual over {outer.manual}; a nested shard_map takes the axes the outer "
            f"one left whole: give the outer one axis_names without {both[0]!r}, or "
            f"the inner one axis_names without it")


def _run(body: _Body, args, outer: _context.Frame | None = None):
    """Stages 3-6, in order. (Also what a compiled vma body runs, as one opaque call.)"""
    compiling = _compile.dynamo_tracing()
    if compiling and outer is None and body.check_vma:
        return _compile.call_opaque(body._opaque, args, body.name)
    # Dynamo traces this call (a check_vma=False body): no tracking, no caches
    tracing = compiling or _compile.tracing()   # or AOTAutograd does
    leaves, treespec = optree.tree_flatten(args)
    plan, blocks, specs = _check_inputs(body, args, leaves, treespec, compiling)
    tracker = (outer.tracker if outer is not None
               else Tracker(body.mesh, tracing) if body.check_vma and not compiling
               else None)
    rules = body.vma_rules if tracker is not None else body.sum_rules
    try:
        local, manual = _enter(body, plan, list(blocks), specs, rules, tracker, outer,
                               tracing)
        out = _run_body(body, treespec, local, tracker, outer, manual, compiling)
        if _lazy._state.on:   # a result pending: the exit reads outside the body's hooks
            _lazy.settle()
        out = _exit(body, out, rules, tracker, outer is not None, compiling, tracing)
    except BaseException:
        if _lazy._state.on:       # no collective left in flight (the error is this one)
            _lazy.settle(quiet=True)
        raise
    finally:
        if tracker is not None and outer is None:
            tracker.forget([blocks[i] for i in plan.tensors])
    if _lazy._state.on:    # launched by the exit (a nested body's gather back)
        _lazy.settle()
    return out


# -- stage 3: check the inputs ---------------------------------------------------------
def _check_inputs(body: _Body, args, leaves: list, treespec, compiling: bool):
    """The input tree's plan (cached by structure and leaf types), this rank's
    blocks (a DTensor's local block) and their specs, checked against the leaves:
    ``(plan, blocks, specs)``."""
    # (while Dynamo traces, a treespec cannot be a key, and a trace runs once)
    key = None if compiling else (treespec, tuple(map(type, leaves)))
    plan = None if compiling else body._in_plans.get(key)
    if plan is None:
        plan = _in_plan(body, args, leaves)
        if not compiling:
            body._in_plans[key] = plan
    specs = plan.specs
    if plan.dtensors:        # a DTensor argument is a global value: take its block
        specs, leaves = list(specs), list(leaves)
        for i in plan.dtensors:
            leaves[i] = dtensor_to_local(leaves[i], body.mesh, plan.specs_raw[i], plan.paths[i])
            specs[i] = _spec(body, plan.specs_raw[i], f"in_specs for {plan.paths[i]}",
                                  leaves[i].shape)
    for i, n in zip(plan.tensors, plan.spec_lens):
        x = leaves[i]
        if n > x.ndim:       # the same tree with a lower-rank tensor
            _spec(body, specs[i], f"in_specs for {plan.paths[i]}", x.shape)
        # an uneven block made by functp.shard (Dynamo cannot trace __dict__)
        if (getattr(x, GLOBAL_SHAPE, None) is not None if compiling
                else GLOBAL_SHAPE in x.__dict__):
            check_even_block(x, specs[i], body.mesh, plan.paths[i])
    return plan, leaves, specs


def _in_plan(body: _Body, args, leaves) -> _InPlan:
    from torch.distributed.tensor import DTensor
    paths, _, specs, _ = match_specs(body.in_specs, args, "in_specs", "args")
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    dtensors = [i for i in tensors if isinstance(leaves[i], DTensor)]
    norm = [None] * len(leaves)
    for i in tensors:
        if i not in dtensors:
            norm[i] = _spec(body, specs[i], f"in_specs for {paths[i]}", leaves[i].shape)
    return _InPlan(paths, norm, tensors, dtensors, specs)


# -- stage 4: enter the manual axes ----------------------------------------------------
def _enter(body: _Body, plan: _InPlan, local: list, specs: list, rules, tracker, outer,
           tracing: bool) -> tuple[list, tuple]:
    """The blocks as the body gets them (``local`` changed in place): a nested
    body's blocks taken from the outer body's whole values, the check mode's entry
    checks, mixed precision's casts, and the boundary rules' tags and aliases
    (cached in ``plan`` by the leaves' dtypes). Returns them with the manual axes."""
    base = None
    if outer is None:
        manual = body.axes
    else:   # the inputs are whole along our axes: take this rank's blocks
        manual = tuple(a for a in body.mesh.axis_names if a in body.axes or a in outer.manual)
        if tracker is not None:
            base = [tracker.get(x) if s is not None else None for x, s in zip(local, specs)]
        for i in plan.tensors:
            local[i] = _take_block(body, plan.paths[i], local[i], specs[i])
    if _crosscheck.ENABLED and not tracing:    # ranks agree on the blocks
        _crosscheck.boundary(body.mesh, body.name, "entry", plan.paths, local)
        if outer is None:     # (a nested body's blocks carry the outer vma tags)
            _fingerprint.check_inputs(body.mesh, body.axes, body.name, plan.paths,
                                      local, specs)
            local = _crosscheck.mark(body.mesh, body.name, "backward done", local)
    mp = body.precision
    if mp is not None and mp.reduction_dtype is not None:   # the reduction's dtype
        local = [x.to(mp.reduction_dtype) if floating(x) else x for x in local]
    # the rules' plan depends on the leaves' dtypes (and, for a nested body or
    # DTensor inputs, on more than the tree: not cached)
    key = hit = None
    if base is None and not plan.dtensors:
        key = (rules.check_vma, tuple([local[i].dtype for i in plan.tensors]))
        hit = plan.boundary.get(key)
    if hit is None:
        hit = rules.plan(specs, [isinstance(x, torch.Tensor) and inexact(x)
                                 for x in local], base)
        if key is not None:
            plan.boundary[key] = hit
    _overlap._rank.paths = plan.paths      # (gradient buckets name inputs by them)
    rules.enter(tracker, local, hit)
    if mp is not None and mp.param_dtype is not None:    # then the body's
        rules.cast(tracker, local, mp.param_dtype)
    return local, manual


# -- stage 5: run the body -------------------------------------------------------------
def _run_body(body: _Body, treespec, local: list, tracker, outer, manual: tuple,
              compiling: bool):
    """``f`` on the blocks, with the manual axes bound (and vma tracked)."""
    # (not while Dynamo traces: filling a cache it guards on would recompile)
    groups = {} if compiling else body._axis_groups.setdefault(manual, {})
    with _context.frame(body.mesh, body.check_vma, tracker, manual, groups):
        if tracker is None:
            out = body.f(*optree.tree_unflatten(treespec, local))
        elif outer is not None:
            with tracker.resumed():
                out = body.f(*optree.tree_unflatten(treespec, local))
        else:
            with UnionRule(tracker):     # (it becomes tracker.mode)
                out = body.f(*optree.tree_unflatten(treespec, local))
    if tracker is not None and tracker.mode is not None:
        tracker.mode.finish(out)   # a custom Function's output returned as it is
    return out


# -- stage 6: check and assemble the outputs -------------------------------------------
def _exit(body: _Body, out, rules, tracker, nested: bool, compiling: bool, tracing: bool):
    """The output tree matched with out_specs (cached by structure and leaf types),
    each tensor through the boundary rules' exit (a nested body's gathered back to
    whole along its axes), then the check mode's exit checks."""
    oleaves, otree = optree.tree_flatten(out)
    key = None if compiling else (otree, tuple(map(type, oleaves)))
    hit = None if compiling else body._out_plans.get(key)
    if hit is None:
        paths, _, specs, _ = match_specs(body.out_specs, out, "out_specs", "output")
        specs = [_spec(body, s, f"out_specs for {p}", y.shape)
                 if isinstance(y, torch.Tensor) else None
                 for p, y, s in zip(paths, oleaves, specs)]
        hit = (paths, specs)
        if not compiling:
            body._out_plans[key] = hit
    paths, specs = hit
    for i, (y, spec) in enumerate(zip(oleaves, specs)):
        if spec is None:
            continue
        if len(spec) > y.ndim:
            _spec(body, spec, f"out_specs for {paths[i]}", y.shape)
        y = rules.exit(tracker, paths[i], y, spec)
        oleaves[i] = _gather_back(body, y, spec, tracker) if nested else y
    out = optree.tree_unflatten(otree, oleaves)
    if _crosscheck.ENABLED and not tracing:
        out = _check_outputs(body, out, None if nested else specs)
    return out


def _check_outputs(body: _Body, out, specs: list | None):
    """The check mode at the exit: ranks agree on the output blocks (and, for a
    top-level body, given its outputs' ``specs``, on the values declared
    replicated), and the backward starts on every rank together."""
    paths, leaves, treespec = optree.tree_flatten_with_path(out)
    paths = [keystr("output", p) for p in paths]
    _crosscheck.boundary(body.mesh, body.name, "exit", paths, leaves)
    if specs is not None:
        _fingerprint.check_outputs(body.mesh, body.axes, body.name, paths, leaves, specs,
                                   body.check_vma)
        leaves = _crosscheck.mark(body.mesh, body.name, "backward start", leaves)
    return optree.tree_unflatten(treespec, leaves)


# -- helpers of the stages -------------------------------------------------------------
def _gather_back(body: _Body, y: torch.Tensor, spec: P, tracker) -> torch.Tensor:
    """A nested body's output, back to whole along its axes for the outer body
    (a packed dimension gathered block by block, through its packed view)."""
    vma = tracker.get(y) if tracker is not None else None
    view = _layout.view_spec(spec) if spec.packed else spec
    y = _layout.view(y, spec) if spec.packed else y
    for d in range(len(view)):
        axes = view.dim_axes(d)
        if axes:
            y = _ops.all_gather(y, body.mesh.axis_group(axes).key, d, True, True)
    y = _layout.unview(y, spec) if spec.packed else y
    if tracker is not None:
        tracker.set(y, vma - frozenset(body.axes))
    return y


def _spec(body: _Body, spec, where: str, shape) -> P:
    spec = normalize_spec(spec, body.mesh.axis_names, where, shape)
    auto = [a for a in spec.axes if a not in body.axes]
    if auto:
        raise ShardingError(
            f"{where} (shape {tuple(shape)}): {spec!r} names mesh axis {auto[0]!r}, but "
            f"this shard_map is manual only over {body.axes} (axis_names); add "
            f"{auto[0]!r} to axis_names or drop it from the spec")
    return spec


def _take_block(body: _Body, path: str, x: torch.Tensor, spec: P) -> torch.Tensor:
    """This rank's block of ``x``, whole along our axes (a packed dimension: this
    rank's slice of each of its blocks, through its packed view)."""
    if spec.packed:
        _layout.check_packed(f"in_specs for {path}", x.shape, spec, body.mesh)
        view = _layout.view_spec(spec)
        return _layout.unview(_take_block(body, path, _layout.view(x, spec), view), spec)
    dims = [(d, body.mesh.axis_group(spec.dim_axes(d)))
            for d in range(len(spec)) if spec.dim_axes(d)]
    if any(_layout.uneven(x.shape[d], g.size) for d, g in dims):
        # (checked here first: this runs at every call of a nested body)
        _layout.require_divisible(
            f"in_specs for {path}", x.shape, spec, body.mesh,
            "with functp.pad_to_multiple in the outer body (functp.unpad the results): "
            "a nested shard_map splits the outer body's whole values into equal blocks")
    return _ops.take_block(x, [d for d, _ in dims], [g.key for _, g in dims]) if dims else x
