"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) that load on any mesh.

``save`` writes every split leaf as a DTensor built from its block (global shape
given, so uneven blocks are fine) and every whole leaf as a plain tensor; DCP stores
the global tensors' pieces and reassembles whatever pieces another mesh asks for. Keys
are the leaves' paths joined by dots (``params.fc1.weight``), as in a torch state
dict, so plain DCP can read them too.
"""
from __future__ import annotations

import os
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ._errors import ShardingError
from ._interop import _strides, mesh_order, spec_to_placements
from ._mesh import Mesh
from ._reshard import _RawOps, layout, leaf_specs, local_shape, mark_uneven, plan, run_plan
from ._sharding import _shapes_for
from ._spec import P
from ._tree import keystr

__all__ = ["save", "load", "full_state_dict"]

_TREE_KEY = "__functp_treespec__"     # the tree's structure, for load(like=None)
_OBJECT = object()                     # placeholder leaf for a saved non-tensor value


def _keys(paths, root: str) -> list[str]:
    keys = [".".join(str(k) for k in p) if p else "_" for p in paths]
    seen: dict[str, tuple] = {}
    for k, p in zip(keys, paths):
        if k in seen:
            raise ShardingError(
                f"{root}: leaves {keystr('tree', seen[k])} and {keystr('tree', p)} both "
                f"become checkpoint key '{k}' (paths are joined with dots); rename one")
        seen[k] = p
    return keys


def save(path: str | os.PathLike, tree: Any, mesh: Mesh, specs: Any, *,
         shapes: Any = None) -> None:
    """Saves the local blocks ``tree`` (laid out by ``specs`` on ``mesh``) with DCP.

    Call it on every rank. ``tree`` may hold parameters, optimizer state
    (``opt.state_dict()``) and non-tensor values. :func:`load` reads the result on
    any mesh, or on one process. ``shapes`` – global shapes; without it they are
    learned with one small all-gather when some leaf is split. Example::

        functp.save("ckpt/step100", {"params": local, "opt": opt.state_dict()}, mesh,
                    {"params": specs, "opt": opt_specs})
    """
    items, treespec = leaf_specs(tree, mesh, specs, "tree")
    paths = optree.tree_paths(tree)
    keys = _keys(paths, "functp.save")
    n_list = _shapes_for(tree, items, treespec, mesh, shapes, "functp.save")
    ops = _RawOps(mesh)
    state: dict[str, Any] = {}
    with torch.no_grad():
        for (p, x, s), n, key in zip(items, n_list, keys):
            if s is not None and any(layout(s, x.ndim, mesh)):
                ordered = mesh_order(s, x.ndim, mesh)
                src, dst = layout(s, x.ndim, mesh), layout(ordered, x.ndim, mesh)
                if src != dst:       # DTensor nests in mesh order: move the blocks there
                    x = run_plan(x, n, src, plan(src, dst), mesh, ops).contiguous()
                x = DTensor.from_local(x, mesh.device_mesh,
                                       spec_to_placements(ordered, mesh, x.ndim, p),
                                       run_check=False, shape=torch.Size(n), stride=_strides(n))
            state[key] = x
    state[_TREE_KEY] = treespec
    dcp.save(state, checkpoint_id=path)


def load(path: str | os.PathLike, mesh: Mesh | None = None, specs: Any = None, *,
         like: Any = None) -> Any:
    """Loads a checkpoint written by :func:`save` as local blocks laid out by ``specs``
    on ``mesh`` (any mesh: DCP reads just the pieces each rank needs).

    ``like`` – a tree with the structure to load (its leaves are only placeholders,
    e.g. this mesh's freshly built blocks; a subset of the saved tree is fine); by
    default, the saved structure. Shapes and dtypes come from the checkpoint.
    ``mesh=None`` loads the full tensors on this process alone (no process group
    needed; ``specs`` is ignored). Call it on every rank of ``mesh``. Example::

        state = functp.load("ckpt/step100", mesh4, {"params": specs4, "opt": opt_specs4})
        opt.load_state_dict(state["opt"])
    """
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    no_dist = mesh is None
    if like is None:
        if _TREE_KEY not in meta:
            raise ShardingError(
                f"functp.load: {path} has no saved tree structure (not written by "
                f"functp.save); pass like= with the tree to load")
        box = {_TREE_KEY: None}
        dcp.load(box, checkpoint_id=path, no_dist=no_dist)
        treespec = box[_TREE_KEY]
    else:
        treespec = optree.tree_structure(like)
    paths = treespec.paths()
    keys = _keys(paths, "functp.load")
    missing = [k for k in keys if k not in meta]
    if missing:
        saved = sorted(k for k in meta if k != _TREE_KEY)
        raise ShardingError(
            f"functp.load: {path} has no entry {missing[0]!r} (leaf "
            f"{keystr('like', paths[keys.index(missing[0])])}); it holds {saved[:8]}"
            f"{' ...' if len(saved) > 8 else ''}")
    # placeholders: meta tensors of the saved global shapes, so specs can be checked
    holders = [torch.empty(meta[k].size, dtype=meta[k].properties.dtype, device="meta")
               if isinstance(meta[k], TensorStorageMetadata) else _OBJECT for k in keys]
    skeleton = optree.tree_unflatten(treespec, holders)
    if mesh is None:
        state = {k: (torch.empty(h.shape, dtype=h.dtype) if h is not _OBJECT else None)
                 for k, h in zip(keys, holders)}
        dcp.load(state, checkpoint_id=path, no_dist=True)
        return optree.tree_unflatten(treespec, [state[k] for k in keys])

    items, _ = leaf_specs(skeleton, mesh, specs if specs is not None else P(), "tree")
    device = torch.device(mesh.device_type)
    state, blocks, fix = {}, {}, {}
    for (p, h, s), k in zip(items, keys):
        if h is _OBJECT:
            state[k] = None
            continue
        ordered = mesh_order(s, h.ndim, mesh)
        lay = layout(ordered, h.ndim, mesh)
        if not any(lay):
            state[k] = blocks[k] = torch.empty(h.shape, dtype=h.dtype, device=device)
            continue
        # DCP writes into this block (through the DTensor's view of it)
        blocks[k] = torch.empty(local_shape(h.shape, lay, mesh), dtype=h.dtype, device=device)
        state[k] = DTensor.from_local(blocks[k], mesh.device_mesh,
                                      spec_to_placements(ordered, mesh, h.ndim, p),
                                      run_check=False, shape=h.shape, stride=_strides(h.shape))
        if layout(s, h.ndim, mesh) != lay:
            fix[k] = (lay, layout(s, h.ndim, mesh))
    dcp.load(state, checkpoint_id=path)
    out = []
    ops = _RawOps(mesh)
    with torch.no_grad():
        for (p, h, s), k in zip(items, keys):
            if h is _OBJECT:
                out.append(state[k])
                continue
            x = blocks[k]
            if k in fix:
                src, dst = fix[k]
                x = run_plan(x, h.shape, src, plan(src, dst), mesh, ops).contiguous()
            out.append(mark_uneven(x, h.shape, layout(s, h.ndim, mesh), mesh))
    return optree.tree_unflatten(treespec, out)


def full_state_dict(tree: Any, mesh: Mesh, specs: Any, *, shapes: Any = None,
                    rank: int = 0) -> Any:
    """The full tensors of ``tree`` on global rank ``rank``, ``None`` on the others.

    Same structure and keys as ``tree`` (a ``{name: block}`` dict gives a
    ``{name: full tensor}`` dict, ready for ``module.load_state_dict``); non-tensor
    leaves are kept. Call it on every rank: each leaf is all-gathered in turn (one
    full leaf at a time in memory). Example::

        sd = functp.full_state_dict(local, mesh, specs)
        if sd is not None:
            torch.save(sd, "model.pt")
    """
    if not 0 <= rank < dist.get_world_size():
        raise ShardingError(f"functp.full_state_dict: rank={rank} is not a rank of the "
                            f"world (size {dist.get_world_size()})")
    items, treespec = leaf_specs(tree, mesh, specs, "tree")
    n_list = _shapes_for(tree, items, treespec, mesh, shapes, "functp.full_state_dict")
    mine = dist.get_rank() == rank
    ops = _RawOps(mesh)
    out = []
    with torch.no_grad():
        for (p, x, s), n in zip(items, n_list):
            if s is not None and any(layout(s, x.ndim, mesh)):
                src = layout(s, x.ndim, mesh)
                x = run_plan(x, n, src, plan(src, ((),) * x.ndim), mesh, ops)
                x = x.contiguous() if mine else None
            out.append(x)
    return optree.tree_unflatten(treespec, out) if mine else None
