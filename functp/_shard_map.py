"""``shard_map``: run a per-shard program on every rank's local blocks."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import optree
import torch

from . import _context
from ._collectives import _apply
from ._errors import ShardingError
from ._mesh import Mesh
from ._spec import P, normalize_spec
from ._tree import match_specs
from ._vma import Tracker, tracking

__all__ = ["shard_map"]


def shard_map(f: Callable | None = None, mesh: Mesh | None = None, in_specs: Any = None,
              out_specs: Any = None, *, check_vma: bool = True) -> Callable:
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
                                 out_specs=out_specs, check_vma=check_vma)
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
    body = _Body(f, mesh, in_specs, out_specs, check_vma)

    @functools.wraps(f)
    def mapped(*args, **kwargs):
        return body(*args, **kwargs)
    return mapped


class _Body:
    def __init__(self, f, mesh: Mesh, in_specs, out_specs, check_vma: bool):
        self.f, self.mesh, self.check_vma = f, mesh, check_vma
        self.in_specs, self.out_specs = in_specs, out_specs

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise ShardingError(
                f"shard_map'd function {getattr(self.f, '__name__', self.f)!r} got keyword "
                f"arguments {sorted(kwargs)}; pass them positionally with an in_spec each "
                f"(or close over non-tensor options with functools.partial)")
        if _context.active():
            raise ShardingError(
                "shard_map was called inside another shard_map body; nesting is not "
                "supported yet: call the inner function directly")
        paths, leaves, specs, treespec = match_specs(self.in_specs, args, "in_specs", "args")
        specs = [self._in_spec(p, x, s) for p, x, s in zip(paths, leaves, specs)]
        local = list(leaves)
        tracker = None
        if self.check_vma and not torch.compiler.is_compiling():
            tracker = self._track_inputs(local, specs)
        else:
            self._pvary_replicated(local, specs)
        with _context.frame(self.mesh, self.check_vma, tracker):
            if tracker is None:
                out = self.f(*optree.tree_unflatten(treespec, local))
            else:
                with tracking(tracker):
                    out = self.f(*optree.tree_unflatten(treespec, local))
        opaths, oleaves, ospecs, otree = match_specs(self.out_specs, out, "out_specs", "output")
        return optree.tree_unflatten(
            otree, [self._exit(p, y, s, tracker) for p, y, s in zip(opaths, oleaves, ospecs)])

    def _track_inputs(self, local: list, specs: list) -> Tracker:
        """Each input varies over the axes its spec mentions."""
        tracker = Tracker(self.mesh)
        seen: set[int] = set()
        for i, (x, spec) in enumerate(zip(local, specs)):
            if spec is not None:
                if id(x) in seen:     # one tensor passed twice: give each use its own tag
                    local[i] = x.view_as(x)
                seen.add(id(local[i]))
        tracker.enter(local, specs)
        return tracker

    def _in_spec(self, path: str, x, spec) -> P | None:
        if not isinstance(x, torch.Tensor):
            return None
        from torch.distributed.tensor import DTensor
        if isinstance(x, DTensor):
            raise ShardingError(
                f"in_specs for {path}: got a DTensor; pass its local block "
                f"(x.to_local()) with the spec that matches its placements")
        return normalize_spec(spec, self.mesh.axis_names, f"in_specs for {path}", x.shape)

    def _pvary_replicated(self, local: list, specs: list) -> None:
        """check_vma=False: every input becomes varying over the axes its spec omits,
        so the gradients of replicated inputs are summed over those axes (one
        bucketed all-reduce per group of leaves replicated over the same axes)."""
        buckets: dict[tuple[str, ...], list[int]] = {}
        for i, (x, spec) in enumerate(zip(local, specs)):
            if spec is not None:
                missing = tuple(a for a in self.mesh.axis_names if a not in spec.axes)
                if missing and (x.is_floating_point() or x.is_complex()):
                    buckets.setdefault(missing, []).append(i)
        for axes, idx in buckets.items():
            g = self.mesh.axis_group(axes)
            for i, y in zip(idx, _apply("_Pvary", g, True, *[local[i] for i in idx])):
                local[i] = y

    def _exit(self, path: str, y, spec, tracker: Tracker | None):
        if not isinstance(y, torch.Tensor):
            return y
        spec = normalize_spec(spec, self.mesh.axis_names, f"out_specs for {path}", y.shape)
        if tracker is not None:
            with tracker.paused():
                vma = tracker.get(y)
                for a in self.mesh.axis_names:
                    if a in vma and a not in spec.axes:
                        raise ShardingError(
                            f"{path} varies over mesh axis '{a}' but out_specs {spec!r} says "
                            f"it is replicated over '{a}'; reduce it with "
                            f"functp.psum/pmean(..., '{a}') or mention '{a}' in out_specs")
                # an out_spec may split over an axis the value is invariant over: its
                # blocks then carry separate cotangents, summed by this pvary
                return tracker.pvary(y, frozenset(spec.axes) - vma)
        else:
            # Each rank's copy of a replicated output counts once in the global value,
            # so its cotangent (arriving on every rank) is split between the copies.
            n = math.prod([self.mesh.shape[a] for a in self.mesh.axis_names
                           if a not in spec.axes])
            if n > 1 and (y.is_floating_point() or y.is_complex()):
                y = _apply("_ScaleGrad", y, 1.0 / n)
        return y
