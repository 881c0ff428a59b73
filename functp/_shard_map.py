"""``shard_map``: run a per-shard program on every rank's local blocks."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import optree
import torch

from . import _context
from . import _ops
from ._errors import ShardingError
from ._interop import dtensor_to_local
from ._mesh import Mesh
from ._sharding import check_even_block
from ._spec import P, normalize_spec
from ._tree import match_specs
from ._vma import Tracker
from ._vma_mode import tracking

__all__ = ["shard_map"]


def shard_map(f: Callable | None = None, mesh: Mesh | None = None, in_specs: Any = None,
              out_specs: Any = None, *, check_vma: bool = True,
              axis_names: Any = None) -> Callable:
    """Maps ``f``, written for one rank's local blocks, over the mesh.

    **Arguments:** ``f`` – the per-shard program; it may call functp's collectives.
    ``mesh`` – a :class:`Mesh`. ``in_specs`` – a pytree prefix of the positional
    arguments (a tuple, one entry per argument, or one spec for all), each leaf a
    ``P`` or a DTensor placement list. ``out_specs`` – the same for ``f``'s result.
    ``check_vma`` – track which mesh axes every value varies over (JAX's vma): the
    fewest backward collectives, and an error when an output declared replicated is
    not. ``False`` skips tracking and uses sum-semantics boundary rules instead (same
    gradients, some extra backward all-reduces). Under ``torch.compile`` the body
    always runs with the ``False`` rules (Dynamo cannot trace the tracking mode).
    ``axis_names`` – the mesh axes the body is manual over (default: all). Specs and
    collectives may name only these; along the others values stay whole. A
    shard_map called inside another body must name axes the outer one does not:
    its inputs are whole along them and it splits them by its in_specs itself.

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
                                 axis_names=axis_names)
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
    body = _Body(f, mesh, in_specs, out_specs, check_vma, _manual_axes(mesh, axis_names))

    @functools.wraps(f)
    def mapped(*args, **kwargs):
        return body(*args, **kwargs)
    return mapped


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


class _Body:
    def __init__(self, f, mesh: Mesh, in_specs, out_specs, check_vma: bool,
                 axes: tuple[str, ...]):
        self.f, self.mesh, self.check_vma, self.axes = f, mesh, check_vma, axes
        self.in_specs, self.out_specs = in_specs, out_specs

    def __call__(self, *args, **kwargs):
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

    def _run(self, args, outer: _context.Frame | None):
        paths, leaves, specs, treespec = match_specs(self.in_specs, args, "in_specs", "args")
        leaves = [self._from_dtensor(p, x, s) for p, x, s in zip(paths, leaves, specs)]
        specs = [self._in_spec(p, x, s) for p, x, s in zip(paths, leaves, specs)]
        local = list(leaves)
        if outer is None:
            manual = self.axes
            tracker = (Tracker(self.mesh) if self.check_vma and not torch.compiler.is_compiling()
                       else None)
            base = None
        else:   # the inputs are whole along our axes: take this rank's blocks
            manual = tuple(a for a in self.mesh.axis_names if a in self.axes or a in outer.manual)
            tracker = outer.tracker
            base = [tracker.get(x) if tracker and s is not None else None
                    for x, s in zip(local, specs)]
            for i, (p, x, s) in enumerate(zip(paths, local, specs)):
                if s is not None:
                    local[i] = self._take_block(p, x, s)
        if tracker is not None:
            _dedupe(local, specs)
            tracker.enter(local, specs, self.axes, base)
        else:
            self._pvary_replicated(local, specs)
        with _context.frame(self.mesh, self.check_vma, tracker, manual):
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
            opaths, oleaves, ospecs, otree = match_specs(self.out_specs, out, "out_specs", "output")
            return optree.tree_unflatten(otree, [self._exit(p, y, s, tracker, outer is not None)
                                                 for p, y, s in zip(opaths, oleaves, ospecs)])
        finally:
            if tracker is not None and outer is None:
                tracker.forget(leaves)

    def _in_spec(self, path: str, x, spec) -> P | None:
        if not isinstance(x, torch.Tensor):
            return None
        spec = self._spec(spec, f"in_specs for {path}", x.shape)
        check_even_block(x, spec, self.mesh, path)   # uneven blocks made by functp.shard
        return spec

    def _from_dtensor(self, path: str, x, spec):
        """A DTensor argument is a global value: this rank's block under its spec."""
        from torch.distributed.tensor import DTensor
        if isinstance(x, DTensor):
            return dtensor_to_local(x, self.mesh, spec, path)
        return x

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
        dims = []
        for d in range(len(spec)):
            axes = spec.dim_axes(d)
            if axes:
                g = self.mesh.axis_group(axes)
                if x.shape[d] % g.size:
                    raise ShardingError(
                        f"in_specs for {path} (shape {tuple(x.shape)}): {spec!r} splits "
                        f"dimension {d} of size {x.shape[d]} over {axes} of size {g.size}, "
                        f"which does not divide it; pad it to a multiple of {g.size}")
                dims.append((d, g))
        return _ops.take_block(x, [d for d, _ in dims], [g.key for _, g in dims]) if dims else x

    def _pvary_replicated(self, local: list, specs: list) -> None:
        """check_vma=False: every input becomes varying over the axes its spec omits,
        so the gradients of replicated inputs are summed over those axes (one
        bucketed all-reduce per group of leaves replicated over the same axes)."""
        buckets: dict[tuple[str, ...], list[int]] = {}
        for i, (x, spec) in enumerate(zip(local, specs)):
            if spec is not None:
                missing = tuple(a for a in self.axes if a not in spec.axes)
                if missing and (x.is_floating_point() or x.is_complex()):
                    buckets.setdefault(missing, []).append(i)
        for axes, idx in buckets.items():
            g = self.mesh.axis_group(axes)
            for i, y in zip(idx, _ops.pvary([local[i] for i in idx], g.key, True)):
                local[i] = y

    def _exit(self, path: str, y, spec, tracker: Tracker | None, nested: bool):
        if not isinstance(y, torch.Tensor):
            return y
        spec = self._spec(spec, f"out_specs for {path}", y.shape)
        if tracker is not None:
            vma = tracker.get(y)
            for a in self.axes:
                if a in vma and a not in spec.axes:
                    raise ShardingError(
                        f"{path} varies over mesh axis '{a}' but out_specs {spec!r} says "
                        f"it is replicated over '{a}'; reduce it with "
                        f"functp.psum/pmean(..., '{a}') or mention '{a}' in out_specs")
            # an out_spec may split over an axis the value is invariant over: its
            # blocks then carry separate cotangents, summed by this pvary
            y = tracker.pvary(y, frozenset(spec.axes) - vma)
        else:
            # Each rank's copy of a replicated output counts once in the global value,
            # so its cotangent (arriving on every rank) is split between the copies.
            n = math.prod([self.mesh.shape[a] for a in self.axes if a not in spec.axes])
            if n > 1 and (y.is_floating_point() or y.is_complex()):
                y = _ops.scale_grad(y, 1.0 / n)
        if nested:   # back to whole along our axes, for the enclosing body
            vma = tracker.get(y) if tracker is not None else None
            for d in range(len(spec)):
                axes = spec.dim_axes(d)
                if axes:
                    y = _ops.all_gather(y, self.mesh.axis_group(axes).key, d, True, True)
            if tracker is not None:
                tracker.set(y, vma - frozenset(self.axes))
        return y


def _dedupe(local: list, specs: list) -> None:
    """One tensor passed twice gets a separate alias per use (each gets its own tag)."""
    seen: set[int] = set()
    for i, (x, spec) in enumerate(zip(local, specs)):
        if spec is not None:
            if id(x) in seen:
                local[i] = x.view_as(x)
            seen.add(id(local[i]))
