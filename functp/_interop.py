"""DTensor interop: local blocks + specs <-> ``torch.distributed.tensor.DTensor``.

A functp spec and a DTensor placement list say the same thing when every dimension
split over several mesh axes lists them in mesh order (DTensor nests them left to
right); blocks follow the same torch.chunk rule on both sides, uneven sizes included.
DTensor does not work inside ``torch.func`` transforms, so use these at boundaries.
"""
from __future__ import annotations

from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from . import _world
from ._errors import ShardingError
from ._mesh import Mesh
from ._reshard import GLOBAL_SHAPE, is_even, layout, leaf_specs, move_block
from ._sharding import _shapes_for
from ._spec import P, normalize_spec, placements_to_spec

__all__ = ["to_dtensor", "from_dtensor", "dtensor_to_local", "spec_to_placements"]


def _strides(shape) -> tuple[int, ...]:
    out, s = [], 1
    for n in reversed(tuple(shape)):
        out.append(s)
        s *= max(n, 1)
    return tuple(reversed(out))


def spec_to_placements(spec: P, mesh: Mesh, ndim: int, where: str) -> list[Placement]:
    """``P('dp', 'tp')`` on mesh ``(dp, tp)`` -> ``[Shard(0), Shard(1)]``.

    The axes of a dimension split over several must be in mesh order, which is
    DTensor's nesting (axes of size 1 may stand anywhere: they split nothing)."""
    place: list[Placement] = [Replicate()] * len(mesh.axis_names)
    for d, axes in enumerate(layout(spec, ndim)):
        pos = [mesh.axis_names.index(a) for a in axes]
        real = [i for i in pos if mesh.axis_sizes[i] > 1]
        if real != sorted(real):
            ordered = tuple(sorted(axes, key=mesh.axis_names.index))
            raise ShardingError(
                f"{where}: {spec!r} splits dimension {d} over {axes}, against the mesh "
                f"order of {mesh} (axes {mesh.axis_names}); DTensor nests the axes of one "
                f"dimension in mesh order, so it has no placements for this layout. "
                f"functp.reshard it to P({ordered!r}) on that dimension first")
        for i in pos:
            place[i] = Shard(d)
    return place


def to_dtensor(tree: Any, mesh: Mesh, specs: Any, *, shapes: Any = None) -> Any:
    """Local blocks laid out by ``specs`` -> DTensors on ``mesh.device_mesh``.

    The global shape is passed to ``DTensor.from_local`` (with contiguous strides), so
    uneven blocks give the right DTensor; without ``shapes=`` it is learned with one
    small all-gather of the block shapes when some leaf is split. Non-tensor leaves
    pass through. Example (4 ranks, mesh ``(dp=2, tp=2)``)::

        local = functp.shard(torch.randn(10, 4), mesh, P(("dp", "tp")))
        dt = functp.to_dtensor(local, mesh, P(("dp", "tp")))
        dt.placements        # (Shard(dim=0), Shard(dim=0));  dt.shape == (10, 4)
    """
    _world.require_torch_distributed("functp.to_dtensor")
    items, treespec = leaf_specs(tree, mesh, specs, "tree")
    for path, x, s in items:      # before any communication: the same on every rank
        if s is not None and s.packed:
            raise ShardingError(
                f"functp.to_dtensor: {path} is laid out by {s!r}, whose packed blocks "
                f"have no public DTensor placement; unshard it (functp.unshard) and "
                f"distribute the full tensor, or leave it out of the tree")
        if s is not None:
            spec_to_placements(s, mesh, x.ndim, f"functp.to_dtensor: {path}")
    n_list = _shapes_for(tree, items, treespec, mesh, shapes, "functp.to_dtensor")
    out = []
    for (path, x, s), n in zip(items, n_list):
        if s is not None:
            x = DTensor.from_local(x, mesh.device_mesh,
                                   spec_to_placements(s, mesh, x.ndim, path), run_check=False,
                                   shape=torch.Size(n), stride=_strides(n))
        out.append(x)
    return optree.tree_unflatten(treespec, out)


def from_dtensor(tree: Any) -> tuple[Any, Any]:
    """DTensors -> ``(local blocks, specs)``; no communication.

    Each DTensor leaf gives its local tensor and the ``P`` of its placements; other
    tensors count as whole (``P()``), other leaves pass through with ``P()``. A
    ``Partial`` placement raises (reduce it first with ``redistribute``). Example::

        local, specs = functp.from_dtensor({"w": dt})
        specs            # {'w': P(('dp', 'tp'))}
    """
    paths, leaves, treespec = optree.tree_flatten_with_path(tree)
    local, specs = [], []
    for path, x in zip(paths, leaves):
        if isinstance(x, DTensor):
            names = x.device_mesh.mesh_dim_names
            where = "functp.from_dtensor: tree" + "".join(f"[{k!r}]" for k in path)
            if not names:
                raise ShardingError(
                    f"{where}: the DTensor's DeviceMesh has no dimension names; build it "
                    f"with init_device_mesh(..., mesh_dim_names=(...)) (functp names axes)")
            spec = placements_to_spec(x.placements, names, f"{where} (shape {tuple(x.shape)})")
            block = x.to_local()
            sizes = dict(zip(names, x.device_mesh.mesh.shape))
            if any(n % _prod(sizes, spec.dim_axes(d)) for d, n in enumerate(x.shape)):
                setattr(block, GLOBAL_SHAPE, torch.Size(x.shape))
            local.append(block)
            specs.append(spec)
        else:
            local.append(x)
            specs.append(P())
    return optree.tree_unflatten(treespec, local), optree.tree_unflatten(treespec, specs)


def _prod(sizes: dict, axes) -> int:
    out = 1
    for a in axes:
        out *= int(sizes[a])
    return out


def dtensor_to_local(x: DTensor, mesh: Mesh, spec: Any, path: str) -> torch.Tensor:
    """A DTensor given to ``shard_map`` as a *global* value -> this rank's block
    under ``spec`` (redistributed first if its placements differ).

    Raises ShardingError, naming ``path``, when the DTensor lives on another mesh or
    its shape does not split evenly (shard_map needs equal blocks: pad the value with
    :func:`functp.pad_to_multiple`). Every check uses only global facts, so every rank
    decides the same way. Differentiable with tape autograd (DTensor's redistribute),
    except from an unevenly split DTensor (moved without autograd); DTensor does not
    run inside ``torch.func`` transforms.
    """
    where = f"in_specs for {path}"
    dm = x.device_mesh
    if dm is not mesh.device_mesh and dm != mesh.device_mesh:
        raise ShardingError(
            f"{where}: got a DTensor (shape {tuple(x.shape)}) on {dm}, but the shard_map "
            f"runs on {mesh} (DeviceMesh {mesh.device_mesh}); redistribute it onto that "
            f"mesh first, or pass its local block (x.to_local()) with a matching spec")
    spec = normalize_spec(spec, mesh.axis_names, where, x.shape)
    lay = layout(spec, x.ndim, mesh)
    if not is_even(x.shape, lay, mesh):
        d = next(d for d, a in enumerate(lay) if a and x.shape[d] % mesh.axis_size(a))
        k = mesh.axis_size(lay[d])
        raise ShardingError(
            f"{where}: the DTensor has shape {tuple(x.shape)} and {spec!r} splits "
            f"dimension {d} of size {x.shape[d]} over {lay[d]} of size {k}, which does not "
            f"divide it; shard_map needs equal blocks on every rank: pad it to a multiple "
            f"of {k} (functp.pad_to_multiple on the full value, then to_dtensor) and "
            f"functp.unpad the result (mesh {mesh})")
    # DTensor moves it when it can express the target (differentiable); functp moves
    # it from an uneven layout (torch 2.13 gathers uneven shards nested over several
    # axes wrongly once the mesh has flattened groups, which functp's Mesh makes) and
    # into axis orders DTensor cannot express.
    ordered = mesh_order(spec, x.ndim, mesh)
    src = None
    if not any(isinstance(p, Partial) for p in x.placements):
        src = layout(placements_to_spec(x.placements, mesh.axis_names, where), x.ndim, mesh)
    if src is not None and not is_even(x.shape, src, mesh):
        block = x.to_local()
    else:
        placements = spec_to_placements(ordered, mesh, x.ndim, where)
        if tuple(x.placements) != tuple(placements):
            x = x.redistribute(dm, placements)
        block, src = x.to_local(), layout(ordered, x.ndim, mesh)
    return move_block(block, x.shape, src, lay, mesh) if src != lay else block


def mesh_order(spec: P, ndim: int, mesh: Mesh) -> P:
    """``spec`` with the axes of every dimension in mesh order (DTensor's nesting)."""
    lay = layout(spec, ndim)
    return P(*[None if not a else a[0] if len(a) == 1 else
               tuple(sorted(a, key=mesh.axis_names.index)) for a in lay])
