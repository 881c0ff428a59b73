"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) that load on any mesh:
``save``, ``load`` and ``full_state_dict``.

``save`` writes every split leaf as a DTensor built from its block (global shape
given, so uneven blocks are fine) and every whole leaf as a plain tensor; DCP stores
the global tensors' pieces and reassembles whatever pieces another mesh asks for. Keys
are the leaves' paths joined by dots (``params.fc1.weight``), as in a torch state
dict, so plain DCP can read them too. The tree's structure and its non-tensor leaves
(step counters, names) go into ``.functp_tree.json``: data, never a pickle
(``_tree_file``).

A checkpoint cannot load wrong: ``save`` records a CRC32 of every stored byte range,
written last as the mark of a finished save, and ``load`` checks the ranges it reads
before DCP reads them (``_checksums``). Every failure is a :class:`CheckpointError`
raised on every rank together (``_failures``). Loading runs no code from the folder
(``_folder``); ``trusted=True`` reads an older checkpoint as DCP would, to convert it
once.
"""
from __future__ import annotations

import os
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from ..mapping._reshard import _RawOps, full_of, run_plan
from ..mapping._reshard_plan import plan
from ..mapping._reshard_shapes import shapes_for
from ..mapping._state_dict import module_state_dict
from ..mesh._tree import leaf_specs
from ..mesh._layout import layout, local_of, local_shape, mark_uneven, strides
from ..mesh._mesh import Mesh
from ..mesh._spec import P, mesh_order, spec_to_placements
from ..runtime import _crosscheck
from ..runtime import _world
from ..runtime._errors import CheckpointError, ShardingError, keystr, leaf_text
from ..runtime._torch_compat import MetadataWriter, TensorStorageMetadata
from ._checksums import record_checksums, unmark, verify
from ._failures import all_ok, dcp_call, need_numpy, peer_loss
from ._folder import Reader, Saved, ValuesAsData, open_folder
from ._format import FORMAT, FORMAT_KEY, OWN, TREE_KEY, TRUST
from ._replicas import check_replicas, same_tree
from ._stage_trees import union_of_trees
from ._tree_file import checkpoint_keys, tree_record

__all__ = ["save", "load", "full_state_dict"]

_OBJECT = object()                     # placeholder leaf for a non-tensor value


def _check_like(what: str, path: str, where: str, key: str, x: Any, saved, spec,
                mesh: Mesh | None, convert: bool) -> None:
    """A tensor leaf of ``like`` against what ``key`` holds: the saved global shape, or
    this rank's block of it under ``spec``; the saved dtype unless ``convert``."""
    if not isinstance(x, torch.Tensor):
        return                                   # a placeholder
    if not isinstance(saved, TensorStorageMetadata):
        raise CheckpointError(f"{what}: {where} is a tensor but key '{key}' holds a "
                              f"non-tensor value ({path}); use a placeholder such as 0")
    n, dtype = tuple(saved.size), saved.properties.dtype
    lay = layout(spec, len(n), mesh) if mesh is not None and spec is not None else ()
    block = local_shape(n, lay, mesh) if any(lay) else n
    if tuple(x.shape) not in (n, block):
        mine = f", a block of {block} on rank {dist.get_rank()}" if block != n else ""
        raise CheckpointError(
            f"{what}: {leaf_text(where, x.shape, spec, mesh)}: key '{key}' was saved with "
            f"shape {n}{mine} ({path})\ngive it that shape, or a placeholder such as 0")
    if x.dtype != dtype and not convert:
        raise CheckpointError(
            f"{what}: {where} is {x.dtype}, but key '{key}' was saved as {dtype} ({path})\n"
            f"pass convert=True to load it as {x.dtype}")


@peer_loss("functp.save")
def save(path: str | os.PathLike, tree: Any, mesh: Mesh, specs: Any, *,
         shapes: Any = None) -> None:
    """Saves the local blocks ``tree`` (laid out by ``specs`` on ``mesh``) with DCP.

    Call it on every rank. ``tree`` may hold parameters, optimizer state
    (``opt.state_dict()``) and non-tensor values: None, bool, int, float, complex,
    str, bytes, torch.dtype, torch.device or torch.Size, stored as data (JSON, in
    ``.functp_tree.json`` with the tree's structure), never as a pickle; any other
    leaf is refused. :func:`load` reads the result on any mesh, or on one process.
    Needs numpy (DCP does).

    **Arguments:** ``path`` – a directory (made if missing; a checkpoint there is
    overwritten); ``shapes`` – global shapes; without it they are learned with one
    small all-gather when some leaf is split.

    A leaf is stored once for all the ranks that replicate it (those its spec does
    not tell apart), from one of them: in the check mode (``FUNCTP_DEBUG=1``) the
    ranks first compare a CRC32 of each leaf and raise if replicas differ; without
    it a difference is not noticed. The CRC32 of every stored byte range goes into
    ``.functp_checksums.json``, written last: without it :func:`load` calls the
    checkpoint incomplete. Ranks may save different trees (a pipeline's stages, each
    its own layers): the checkpoint is then their union, refused unless each key is
    the same leaf on every rank holding it and every block of a split leaf is held.
    A failure on any rank raises :class:`CheckpointError` on every rank, its first
    line the cause. Example::

        functp.save("ckpt/step100", {"params": local, "opt": opt.state_dict()}, mesh,
                    {"params": specs, "opt": opt_specs})
    """
    _world.require_torch_distributed("functp.save")
    what = "functp.save"
    need_numpy(what)
    path = os.fspath(path)
    device = torch.device(mesh.device_type)

    def prepare():
        items, treespec = leaf_specs(tree, mesh, specs, "tree")
        keys = checkpoint_keys(optree.tree_paths(tree), what)
        for (p, _, _), k in zip(items, keys):
            if k in OWN:
                raise CheckpointError(f"{what}: leaf {p} has the key '{k}', which functp "
                                      f"keeps for itself ({path}); rename it")
        tree_file = tree_record(what, path, items, treespec, keys)
        if shapes is None:
            return items, treespec, keys, tree_file, None
        # given shapes are checked against this rank's blocks only: agree on them too
        return (items, treespec, keys, tree_file,
                shapes_for(items, treespec, mesh, shapes, what))
    items, treespec, keys, tree_file, n_list = all_ok(what, path, device, prepare)
    tree_file, n_list = _agreed(what, path, items, treespec, keys, tree_file, n_list, mesh,
                                device)
    ops = _RawOps(mesh)
    state: dict[str, Any] = {}
    with torch.no_grad():
        for (p, x, s), n, key in zip(items, n_list, keys):
            if s is None:
                continue                  # a value: in the tree file
            if s.packed:
                # stored whole, in its canonical order: a packed block is not one
                # contiguous piece of the tensor, and so loads on any mesh
                x, s = full_of(x, n, s, mesh, ops), P()
            if any(layout(s, x.ndim, mesh)):
                ordered = mesh_order(s, x.ndim, mesh)
                src, dst = layout(s, x.ndim, mesh), layout(ordered, x.ndim, mesh)
                if src != dst:       # DTensor nests in mesh order: move the blocks there
                    x = run_plan(x, n, src, plan(src, dst), mesh, ops).contiguous()
                x = DTensor.from_local(x, mesh.device_mesh,
                                       spec_to_placements(ordered, mesh, x.ndim, p),
                                       run_check=False, shape=torch.Size(n), stride=strides(n))
            state[key] = x
    state[FORMAT_KEY] = torch.tensor([FORMAT], dtype=torch.int64, device=device)
    all_ok(what, path, device, lambda: unmark(path) if dist.get_rank() == 0 else None)
    meta = dcp_call(what, path, lambda: dcp.save(state, storage_writer=MetadataWriter(path)))
    record_checksums(what, path, meta, device, tree_file)


def _agreed(what: str, path: str, items, treespec, keys, tree_file: bytes, n_list, mesh,
            device) -> tuple[bytes, list]:
    """The tree file and the leaves' global shapes, agreed by the ranks: one tree (the
    check mode compares its replicas) or, where the ranks' trees differ (a pipeline's
    stages), their union, checked to be one checkpoint."""
    if not same_tree(keys, device):
        tree_file, union_shapes = union_of_trees(what, path, items, keys, tree_file, mesh,
                                                 device)
        return tree_file, union_shapes if n_list is None else n_list
    if _crosscheck.ENABLED:
        check_replicas(what, path, items, keys, mesh)
    if n_list is None:      # one all-gather; every rank checks the same table
        n_list = shapes_for(items, treespec, mesh, None, what)
    return tree_file, n_list


@peer_loss("functp.load")
def load(path: str | os.PathLike, mesh: Mesh | None = None, specs: Any = None, *,
         like: Any = None, convert: bool = False, trusted: bool = False) -> Any:
    """Loads a checkpoint written by :func:`save` as local blocks laid out by ``specs``
    on ``mesh`` (any mesh: DCP reads just the pieces each rank needs).

    **Arguments:** ``like`` – a tree with the structure to load (a subset of the saved
    tree is fine, and may differ between ranks: a pipeline's stages); by default, the
    saved structure. Its non-tensor leaves are
    placeholders; a tensor leaf (e.g. this mesh's freshly built block) must have the
    saved global shape or this rank's block of it under ``specs``, and the saved dtype
    unless ``convert=True``, which casts to its dtype. ``mesh=None`` loads the full
    tensors on this process alone (no process group needed, nor numpy; ``specs`` is
    ignored). Call it on every rank of ``mesh``. ``trusted=True`` unpickles what the
    folder holds as DCP itself does, which runs any code the files name: only for a
    folder you trust, to read (and save again) a checkpoint of an older functp
    without ``like=``, or one whose metadata holds classes DCP's own do not.

    **Returns:** the tree of blocks. Every range read is checked against the checksum
    :func:`save` recorded (checkpoints of plain DCP have none and are read as they
    are). Loading runs no code from the folder: ``.metadata`` and non-tensor values
    are read as data only, and a file named outside the folder is refused. A missing,
    incomplete, damaged or refused checkpoint, or a ``like`` leaf that does not fit,
    raises :class:`CheckpointError` on every rank. Example::

        state = functp.load("ckpt/step100", mesh4, {"params": specs4, "opt": opt_specs4})
        opt.load_state_dict(state["opt"])
    """
    _world.require_torch_distributed("functp.load")
    what = "functp.load"
    path = os.fspath(path)
    if mesh is not None:
        need_numpy(what)
    device = None if mesh is None else torch.device(mesh.device_type)
    saved = all_ok(what, path, device, lambda: _open_to_load(what, path, like, trusted))
    treespec = _load_structure(what, path, like, saved, mesh)
    keys, items, casts, state, blocks, fix = all_ok(
        what, path, device,
        lambda: _prepare_load(what, path, treespec, saved, mesh, specs, like, convert, device))
    verify(what, path, saved.meta, saved.sums, set(keys), device)
    # DCP reads the tensors (and the values it holds as bytes) with the metadata read
    # above, never with its own unpickling of the folder's files
    reader = {} if trusted else {"storage_reader": Reader(path, saved.meta),
                                 "planner": ValuesAsData(what, path)}
    dcp_call(what, path, lambda: dcp.load(state, checkpoint_id=path, no_dist=mesh is None,
                                      **reader), ranks=mesh is not None)
    values = [saved.values[k] if k in saved.values else None for k in keys]
    if mesh is None:
        return optree.tree_unflatten(treespec, [
            v if k not in state else state[k] if c is None else state[k].to(c)
            for k, c, v in zip(keys, casts, values)])
    return optree.tree_unflatten(treespec, _loaded_blocks(items, keys, casts, values, state,
                                                          blocks, fix, mesh))


def _open_to_load(what: str, path: str, like: Any, trusted: bool) -> Saved:
    """The checkpoint's metadata, checked; refused when there is no tree to load."""
    saved = open_folder(what, path, trusted)
    if like is None and saved.skeleton is None:
        if not (saved.old and trusted):
            raise CheckpointError(f"{what}: {saved.why} ({path})\npass like= with the tree "
                                  f"to load" + (f"; or {TRUST}" if saved.old else ""))
        # tiny, and torch.load must not unpickle damaged bytes
        verify(what, path, saved.meta, saved.sums, {TREE_KEY}, None)
    return saved


def _load_structure(what: str, path: str, like: Any, saved: Saved, mesh: Mesh | None):
    """The tree structure to load: ``like``'s, the saved one, or (format 1, trusted)
    its pickled structure as DCP reads it."""
    if like is not None:
        return optree.tree_structure(like)
    if saved.skeleton is not None:
        return optree.tree_structure(saved.skeleton)
    box = {TREE_KEY: None}
    dcp_call(what, path, lambda: dcp.load(box, checkpoint_id=path, no_dist=mesh is None),
         ranks=mesh is not None)
    return box[TREE_KEY]


def _prepare_load(what: str, path: str, treespec, saved: Saved, mesh: Mesh | None, specs,
                  like: Any, convert: bool, device):
    """Keys, leaves with their specs, dtype casts, and the targets DCP loads into (all
    of it may fail on one rank only, e.g. allocating: ``load`` agrees on it)."""
    paths = treespec.paths()
    keys = checkpoint_keys(paths, what)
    missing = [k for k in keys if not saved.holds(k)]
    if missing:
        held = sorted([*saved.tensors, *saved.values, *saved.pickled])
        raise CheckpointError(
            f"{what}: no entry {missing[0]!r} (leaf "
            f"{keystr('like', paths[keys.index(missing[0])])}) ({path})\nit holds "
            f"{held[:8]}{' ...' if len(held) > 8 else ''}")
    # placeholders: meta tensors of the saved global shapes, so specs can be checked
    tensors = saved.tensors
    holders = [torch.empty(tensors[k].size, dtype=tensors[k].properties.dtype,
                           device="meta") if k in tensors else _OBJECT for k in keys]
    skeleton = optree.tree_unflatten(treespec, holders)
    items = (leaf_specs(skeleton, mesh, specs if specs is not None else P(), "tree")[0]
             if mesh is not None else [(p, h, None) for p, h in zip(paths, holders)])
    casts = [None] * len(keys)
    if like is not None:
        for i, ((_, _, s), k, x) in enumerate(zip(items, keys, optree.tree_leaves(like))):
            _check_like(what, path, keystr("like", paths[i]), k, x, tensors.get(k), s,
                        mesh, convert)
            if isinstance(x, torch.Tensor) and x.dtype != tensors[k].properties.dtype:
                casts[i] = x.dtype
    return (keys, items, casts) + _targets(keys, items, mesh, device, saved.values)


@torch.no_grad()
def _loaded_blocks(items, keys, casts, values, state, blocks, fix, mesh: Mesh) -> list:
    """The leaves as this rank's blocks under their specs: a packed one sliced from
    the whole, one DTensor nested differently moved, each cast as ``like`` asked."""
    out = []
    ops = _RawOps(mesh)
    for (p, h, s), k, c, v in zip(items, keys, casts, values):
        if h is _OBJECT:
            out.append(state[k] if k in state else v)
            continue
        x = blocks[k]
        if s.packed:
            x = local_of(x, s, mesh, p).contiguous()
        if k in fix:
            src, dst = fix[k]
            x = run_plan(x, h.shape, src, plan(src, dst), mesh, ops).contiguous()
        if c is not None:
            x = x.to(c)
        out.append(mark_uneven(x, h.shape, layout(s, h.ndim, mesh), mesh))
    return out


def _targets(keys, items, mesh: Mesh | None, device, values) -> tuple[dict, dict, dict]:
    """What DCP loads into: ``{key: full tensor, DTensor over this rank's new block, or
    None for a value DCP holds}`` (``values``, from the tree file, are not DCP's); the
    blocks; and ``{key: (layout DCP fills, layout wanted)}`` for the specs a DTensor
    nests differently (moved after the load)."""
    state, blocks, fix = {}, {}, {}
    for (p, h, s), k in zip(items, keys):
        if h is _OBJECT:
            if k not in values:
                state[k] = None
            continue
        if mesh is None:
            state[k] = torch.empty(h.shape, dtype=h.dtype)
            continue
        ordered = mesh_order(s, h.ndim, mesh)
        lay = layout(ordered, h.ndim, mesh)
        if not any(lay) or s.packed:     # (a packed block is sliced from the whole)
            state[k] = blocks[k] = torch.empty(h.shape, dtype=h.dtype, device=device)
            continue
        # DCP writes into this block (through the DTensor's view of it)
        blocks[k] = torch.empty(local_shape(h.shape, lay, mesh), dtype=h.dtype, device=device)
        state[k] = DTensor.from_local(blocks[k], mesh.device_mesh,
                                      spec_to_placements(ordered, mesh, h.ndim, p),
                                      run_check=False, shape=h.shape, stride=strides(h.shape))
        if layout(s, h.ndim, mesh) != lay:
            fix[k] = (lay, layout(s, h.ndim, mesh))
    return state, blocks, fix


def full_state_dict(tree: Any, mesh: Mesh, specs: Any, *, shapes: Any = None,
                    rank: int = 0, module: Any = None) -> Any:
    """The full tensors of ``tree`` on global rank ``rank``, ``None`` on the others.

    Same structure and keys as ``tree`` (a ``{name: block}`` dict gives a
    ``{name: full tensor}`` dict); non-tensor leaves are kept. With ``module`` (the
    module ``tree`` holds every parameter of, as ``parallelize`` returns them): every
    key of ``module.state_dict()`` (a tied name pointing to the same full tensor, the
    buffers the module's own), ready for ``module.load_state_dict`` (strict). Call it
    on every rank: each leaf is all-gathered in turn (one full leaf at a time in
    memory). Example::

        sd = functp.full_state_dict(local, mesh, specs, module=model)
        if sd is not None:
            torch.save(sd, "model.pt")
    """
    _world.require_torch_distributed("functp.full_state_dict")
    if not 0 <= rank < dist.get_world_size():
        raise ShardingError(f"functp.full_state_dict: rank={rank} is not a rank of the "
                            f"world (size {dist.get_world_size()})")
    items, treespec = leaf_specs(tree, mesh, specs, "tree")
    n_list = shapes_for(items, treespec, mesh, shapes, "functp.full_state_dict")
    mine = dist.get_rank() == rank
    ops = _RawOps(mesh)
    out = []
    with torch.no_grad():
        for (p, x, s), n in zip(items, n_list):
            if s is not None:       # every rank takes part in the gathers; one keeps them
                x = full_of(x, n, s, mesh, ops)
                x = x if mine else None
            out.append(x)
    if not mine:
        return None
    full = optree.tree_unflatten(treespec, out)
    return full if module is None else module_state_dict(module, full, "functp.full_state_dict")
