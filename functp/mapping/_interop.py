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
from torch.distributed.tensor.placement_types import Partial

from ..runtime import _world
from ..runtime._errors import ShardingError, leaf_text
from ..mesh._layout import GLOBAL_SHAPE, check_even_dtensor, is_even, layout, strides, uneven_dim
from ..mesh._mesh import Mesh
from ._reshard import move_block
from ._reshard_shapes import shapes_for
from ..mesh._tree import leaf_specs
from ..mesh._spec import P, mesh_order, normalize_spec, placements_to_spec, spec_to_placements

__all__ = ["to_dtensor", "from_dtensor", "dtensor_to_local"]


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
                f"functp.to_dtensor: {leaf_text(path, x.shape, s)}: packed blocks have no "
                f"public DTensor placement; unshard it (functp.unshard) and distribute the "
                f"full tensor, or leave it out of the tree")
        if s is not None:
            spec_to_placements(s, mesh, x.ndim, f"functp.to_dtensor: {leaf_text(path, x.shape)}")
    n_list = shapes_for(items, treespec, mesh, shapes, "functp.to_dtensor")
    out = []
    for (path, x, s), n in zip(items, n_list):
        if s is not None:
            x = DTensor.from_local(x, mesh.device_mesh,
                                   spec_to_placements(s, mesh, x.ndim, path), run_check=False,
                                   shape=torch.Size(n), stride=strides(n))
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
            spec = placements_to_spec(x.placements, names, leaf_text(where, x.shape))
            block = x.to_local()
            sizes = dict(zip(names, x.device_mesh.mesh.shape))
            if uneven_dim(x.shape, layout(spec, x.ndim), sizes) is not None:
                setattr(block, GLOBAL_SHAPE, torch.Size(x.shape))
            local.append(block)
            specs.append(spec)
        else:
            local.append(x)
            specs.append(P())
    return optree.tree_unflatten(treespec, local), optree.tree_unflatten(treespec, specs)


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
            f"{leaf_text(where, x.shape)}: got a DTensor on {dm}, but the shard_map runs "
            f"on {mesh} (DeviceMesh {mesh.device_mesh}); redistribute it onto that mesh "
            f"first, or pass its local block (x.to_local()) with a matching spec")
    spec = normalize_spec(spec, mesh.axis_names, where, x.shape)
    check_even_dtensor(where, x.shape, spec, mesh)
    lay = layout(spec, x.ndim, mesh)
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
