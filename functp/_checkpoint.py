"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) that load on any mesh.

``save`` writes every split leaf as a DTensor built from its block (global shape
given, so uneven blocks are fine) and every whole leaf as a plain tensor; DCP stores
the global tensors' pieces and reassembles whatever pieces another mesh asks for. Keys
are the leaves' paths joined by dots (``params.fc1.weight``), as in a torch state
dict, so plain DCP can read them too.

A checkpoint cannot load wrong: ``save`` records the CRC32 of every byte range DCP
stored (and of ``.metadata``) in ``.functp_checksums.json``, written last, which also
marks the save as finished; ``load`` checks the ranges it reads before DCP reads them.
Every failure is a :class:`CheckpointError` raised on every rank together: the ranks
agree after each step that could fail on some of them only, so none goes on alone into
DCP's collectives and waits there forever.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import zlib
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from . import _world
from ._errors import CheckpointError, ShardingError, first_line
from ._interop import _strides, mesh_order, spec_to_placements
from ._mesh import Mesh
from ._reshard import (_RawOps, full_of, layout, leaf_specs, local_of, local_shape, mark_uneven,
                       plan, run_plan)
from ._sharding import _broadcast_pickled, _shapes_for
from ._spec import P
from ._tree import keystr

__all__ = ["save", "load", "full_state_dict"]

_TREE_KEY = "__functp_treespec__"     # the tree's structure, for load(like=None)
# in every checkpoint whose save writes checksums: one without them and without
# _SUMS is an older functp's, loaded unchecked, not an unfinished save
_CHECKED_KEY = "__functp_checksummed__"
_OBJECT = object()                     # placeholder leaf for a saved non-tensor value
_SUMS = ".functp_checksums.json"       # CRC32s of the stored bytes; the mark of a finished save
_METADATA = ".metadata"                # DCP's metadata file (filesystem.py: _metadata_fn)


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


# ---------------------------------------------------------------------------------
# failing on every rank together


def _need_numpy(what: str) -> None:
    """DCP's object collectives call ``Tensor.numpy()``, and torch's CPU wheel does not
    install numpy: without it they fail mid-save on some step. Checked before any
    communication (the ranks share one environment, so all of them raise)."""
    if importlib.util.find_spec("numpy") is None:
        raise CheckpointError(f"{what} needs numpy (torch.distributed.checkpoint uses it); "
                              f"pip install numpy")


def _cause(e: BaseException) -> str:
    """``Type: first line`` of an error this one reports."""
    line = first_line(e)
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def _dcp(what: str, path: str, fn: Callable[[], Any], ranks: bool = True) -> Any:
    """``fn()`` (a DCP call) with its failures raised as :class:`CheckpointError`.

    DCP gathers a failure on any rank into a ``CheckpointException`` raised on every
    rank: a ``BaseException`` whose text starts ``CheckpointException ranks:...``; its
    ``failures`` maps each failed rank to ``(exception, traceback)``. The first failed
    rank's exception is the cause the message names; DCP's report is chained.
    """
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        cause, where, more = e, "", ""
        if isinstance(e, CheckpointException) and e.failures:
            failures = {r: (f.exc if hasattr(f, "exc") else f[0] if isinstance(f, tuple) else f)
                        for r, f in e.failures.items()}
            me = dist.get_rank() if ranks and dist.is_initialized() else 0
            if isinstance(failures.get(me), (KeyboardInterrupt, SystemExit)):
                raise failures[me] from None     # DCP wrapped this rank's own interrupt
            cause = failures[min(failures)]
            if ranks:
                where = f" on rank {min(failures)}"
            if ranks and len(failures) > 1:
                more = (f"\nranks {sorted(failures)} failed; every rank's traceback is in "
                        f"the chained CheckpointException")
        raise CheckpointError(f"{what}: {_cause(cause)}{where} ({path}){more}") from e


def _all_ok(what: str, path: str, device: torch.device | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank, then one flag all-reduce over the world.

    If ``fn`` raised on some rank, every rank raises: that rank its own error (a
    :class:`ShardingError` as it is, anything else as a :class:`CheckpointError`), the
    others a :class:`CheckpointError` naming the first failed rank and its error's
    first line. ``device`` – where the flag lives (the mesh's device); ``None`` – one
    process, no communication.
    """
    err = None
    out = None
    try:
        out = fn()
    except ShardingError as e:
        err = e
    except Exception as e:     # noqa: BLE001 - an OSError, say: a CheckpointError here
        err = CheckpointError(f"{what}: {_cause(e)} ({path})")
        err.__cause__ = e
    if device is None:
        if err is not None:
            raise err
        return out
    world = dist.get_world_size()
    flag = torch.tensor([world if err is None else dist.get_rank()], dtype=torch.int64,
                        device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    first = int(flag)
    if first == world:
        return out
    line = _broadcast_pickled(str(err).split("\n", 1)[0] if err is not None else "", first,
                              device)
    if err is not None:
        raise err
    line = line.removeprefix(f"{what}: ")
    raise CheckpointError(f"{what}: rank {first} failed: {line}"
                          + ("" if path in line else f" ({path})"))


# ---------------------------------------------------------------------------------
# checksums


def _entries(meta, fqns=None) -> list[tuple[Any, Any]]:
    """``[(MetadataIndex, _StorageInfo)]`` of the stored byte ranges (of the keys
    ``fqns``; all by default), in one order on every rank."""
    items = [(i, s) for i, s in meta.storage_data.items() if fqns is None or i.fqn in fqns]
    return sorted(items, key=lambda e: (e[0].fqn, tuple(e[0].offset or ())))


def _entry_key(index) -> tuple[str, tuple[int, ...] | None]:
    # DCP's own key of a byte range: MetadataIndex hashes (fqn, offset) only
    return index.fqn, None if index.offset is None else tuple(index.offset)


def _crc(file: str, start: int, length: int) -> int:
    crc = 0
    with open(file, "rb") as f:
        f.seek(start)
        while length:
            b = f.read(min(length, 1 << 24))
            if not b:
                raise EOFError(f"{file} ends before byte {start + length}")
            crc, length = zlib.crc32(b, crc), length - len(b)
    return crc


def _writer(relative_path: str, world: int) -> int:
    """The rank that wrote a data file: DCP names them ``__{rank}_{n}.distcp``
    (filesystem.py, ``_FileSystemWriter.prepare_global_plan`` and ``write_data``).
    Any other name falls to rank 0, so every range gets a checksum."""
    m = re.match(r"__(\d+)_", relative_path)
    return int(m.group(1)) if m and int(m.group(1)) < world else 0


def _record_checksums(what: str, path: str, meta, device: torch.device) -> None:
    """After ``dcp.save``: each rank computes the CRC32s of the ranges in the files it
    wrote (still in its page cache), one all-reduce collects them, rank 0 writes
    :data:`_SUMS`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    entries = _entries(meta)
    mine = _all_ok(what, path, device, lambda: {
        i: _crc(os.path.join(path, s.relative_path), s.offset, s.length)
        for i, (_, s) in enumerate(entries) if _writer(s.relative_path, world) == rank})
    crcs = torch.zeros(len(entries), dtype=torch.int64)
    for i, c in mine.items():
        crcs[i] = c
    crcs = crcs.to(device)
    dist.all_reduce(crcs)          # each range is summed by one rank: the sum is its CRC
    crcs = crcs.tolist()

    def write() -> None:
        if rank != 0:
            return
        with open(os.path.join(path, _METADATA), "rb") as f:
            record = {"metadata": zlib.crc32(f.read()), "entries": [
                [i.fqn, None if i.offset is None else list(i.offset), s.relative_path,
                 s.offset, s.length, c] for (i, s), c in zip(entries, crcs)]}
        tmp = os.path.join(path, _SUMS + ".tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, _SUMS))    # whole or absent, never half
    _all_ok(what, path, device, write)     # and no rank returns before the mark is there


def _unmark(path: str) -> None:
    """Removes the finished-save mark, so that an overwrite that fails midway leaves
    a checkpoint that ``load`` calls incomplete rather than a mix of two saves."""
    try:
        os.remove(os.path.join(path, _SUMS))
    except (FileNotFoundError, NotADirectoryError):
        pass     # nothing to unmark; DCP reports a path it cannot write to


def _open(what: str, path: str):
    """The DCP metadata of the checkpoint at ``path`` and its checksums
    (``{(fqn, offset): (file, start, length, crc)}``; ``None`` for plain DCP)."""
    if not os.path.isdir(path):
        kind = " (a file, not a directory)" if os.path.exists(path) else ""
        raise CheckpointError(f"{what}: no checkpoint at {path}{kind}")
    try:
        with open(os.path.join(path, _SUMS)) as f:
            record = json.load(f)
        meta_crc = int(record["metadata"])
        sums = {(fqn, None if off is None else tuple(off)): (file, start, length, crc)
                for fqn, off, file, start, length, crc in record["entries"]}
    except FileNotFoundError:
        meta_crc = sums = None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{what}: {_SUMS} is unreadable ({_cause(e)}) ({path})"
                              ) from e
    try:
        with open(os.path.join(path, _METADATA), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{what}: no checkpoint at {path} (no {_METADATA}: not a "
                              f"checkpoint, or its save did not finish)") from None
    if meta_crc is not None and zlib.crc32(raw) != meta_crc:
        raise CheckpointError(f"{what}: {_METADATA} is unreadable (it fails its checksum: "
                              f"truncated or garbled) ({path})")
    try:
        meta = pickle.loads(raw)        # what FileSystemReader.read_metadata does
        if not isinstance(meta, Metadata):
            raise TypeError(f"it holds a {type(meta).__name__}, not DCP's Metadata")
    except Exception as e:     # noqa: BLE001 - any unpickling failure means garbled
        raise CheckpointError(f"{what}: {_METADATA} is unreadable ({_cause(e)}) "
                              f"({path})") from e
    if _CHECKED_KEY in meta.state_dict_metadata and sums is None:
        raise CheckpointError(
            f"{what}: incomplete: the save that wrote it did not finish ({path})\n"
            f"({_SUMS}, written last, is missing); save it again")
    return meta, sums


def _verify(what: str, path: str, meta, sums, fqns, device: torch.device | None) -> None:
    """Checks every stored range of the keys ``fqns`` against its checksum, before DCP
    reads it. With ``device`` the ranks share the work (rank r the ranges i with
    ``i % world == r``) and agree on the first bad range in one all-reduce, so every
    rank raises the same error; without, this process checks them all."""
    if sums is None:
        return               # plain DCP: nothing to check against
    entries = _entries(meta, fqns)
    mine = (range(len(entries)) if device is None
            else range(dist.get_rank(), len(entries), dist.get_world_size()))
    bad = len(entries)
    for i in mine:
        index, s = entries[i]
        rec = sums.get(_entry_key(index))
        try:
            ok = (rec is not None and tuple(rec[:3]) == (s.relative_path, s.offset, s.length)
                  and _crc(os.path.join(path, s.relative_path), s.offset, s.length) == rec[3])
        except (OSError, EOFError):
            ok = False
        if not ok:
            bad = i
            break
    if device is not None:
        flag = torch.tensor([bad], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        bad = int(flag)
    if bad < len(entries):
        index, s = entries[bad]
        raise CheckpointError(
            f"{what}: key '{index.fqn}' is corrupted: bytes {s.offset}..{s.offset + s.length}"
            f" of {s.relative_path} fail their checksum ({path})\n"
            f"the file was changed, truncated or lost after the save; restore it or save again")


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
        mine = (f" (a block of {block} on rank {dist.get_rank()} under {spec!r})"
                if block != n else "")
        raise CheckpointError(
            f"{what}: {where} has shape {tuple(x.shape)}, but key '{key}' was saved with "
            f"shape {n}{mine} ({path})\ngive it that shape, or a placeholder such as 0")
    if x.dtype != dtype and not convert:
        raise CheckpointError(
            f"{what}: {where} is {x.dtype}, but key '{key}' was saved as {dtype} ({path})\n"
            f"pass convert=True to load it as {x.dtype}")


# ---------------------------------------------------------------------------------
# save and load


def save(path: str | os.PathLike, tree: Any, mesh: Mesh, specs: Any, *,
         shapes: Any = None) -> None:
    """Saves the local blocks ``tree`` (laid out by ``specs`` on ``mesh``) with DCP.

    Call it on every rank. ``tree`` may hold parameters, optimizer state
    (``opt.state_dict()``) and non-tensor values. :func:`load` reads the result on
    any mesh, or on one process. Needs numpy (DCP does).

    **Arguments:** ``path`` – a directory (made if missing; a checkpoint there is
    overwritten); ``shapes`` – global shapes; without it they are learned with one
    small all-gather when some leaf is split.

    The CRC32 of every stored byte range goes into ``.functp_checksums.json``,
    written last: without it :func:`load` calls the checkpoint incomplete. A failure
    on any rank raises :class:`CheckpointError` on every rank, its first line the
    cause. Example::

        functp.save("ckpt/step100", {"params": local, "opt": opt.state_dict()}, mesh,
                    {"params": specs, "opt": opt_specs})
    """
    _world.require_torch_distributed("functp.save")
    what = "functp.save"
    _need_numpy(what)
    path = os.fspath(path)
    device = torch.device(mesh.device_type)

    def prepare():
        items, treespec = leaf_specs(tree, mesh, specs, "tree")
        keys = _keys(optree.tree_paths(tree), what)
        if shapes is None:
            return items, treespec, keys, None
        # given shapes are checked against this rank's blocks only: agree on them too
        return items, treespec, keys, _shapes_for(tree, items, treespec, mesh, shapes, what)
    items, treespec, keys, n_list = _all_ok(what, path, device, prepare)
    if n_list is None:      # one all-gather; every rank checks the same table
        n_list = _shapes_for(tree, items, treespec, mesh, None, what)
    ops = _RawOps(mesh)
    state: dict[str, Any] = {}
    with torch.no_grad():
        for (p, x, s), n, key in zip(items, n_list, keys):
            if s is not None and s.packed:
                # stored whole, in its canonical order: a packed block is not one
                # contiguous piece of the tensor, and so loads on any mesh
                x, s = full_of(x, n, s, mesh, ops), P()
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
    state[_CHECKED_KEY] = 1
    _all_ok(what, path, device, lambda: _unmark(path) if dist.get_rank() == 0 else None)
    meta = _dcp(what, path, lambda: dcp.save(state, checkpoint_id=path))
    _record_checksums(what, path, meta, device)


def load(path: str | os.PathLike, mesh: Mesh | None = None, specs: Any = None, *,
         like: Any = None, convert: bool = False) -> Any:
    """Loads a checkpoint written by :func:`save` as local blocks laid out by ``specs``
    on ``mesh`` (any mesh: DCP reads just the pieces each rank needs).

    **Arguments:** ``like`` – a tree with the structure to load (a subset of the saved
    tree is fine); by default, the saved structure. Its non-tensor leaves are
    placeholders; a tensor leaf (e.g. this mesh's freshly built block) must have the
    saved global shape or this rank's block of it under ``specs``, and the saved dtype
    unless ``convert=True``, which casts to its dtype. ``mesh=None`` loads the full
    tensors on this process alone (no process group needed, nor numpy; ``specs`` is
    ignored). Call it on every rank of ``mesh``.

    **Returns:** the tree of blocks. Every range read is checked against the checksum
    :func:`save` recorded (checkpoints of plain DCP have none and are read as they
    are). A missing, incomplete or damaged checkpoint, or a ``like`` leaf that does not
    fit, raises :class:`CheckpointError` on every rank. Example::

        state = functp.load("ckpt/step100", mesh4, {"params": specs4, "opt": opt_specs4})
        opt.load_state_dict(state["opt"])
    """
    _world.require_torch_distributed("functp.load")
    what = "functp.load"
    path = os.fspath(path)
    if mesh is not None:
        _need_numpy(what)
    device = None if mesh is None else torch.device(mesh.device_type)

    def open_():
        meta, sums = _open(what, path)
        if like is None and _TREE_KEY not in meta.state_dict_metadata:
            raise CheckpointError(
                f"{what}: no saved tree structure: not written by functp.save ({path})\n"
                f"pass like= with the tree to load")
        if like is None:    # tiny, and torch.load must not unpickle damaged bytes
            _verify(what, path, meta, sums, {_TREE_KEY}, None)
        return meta, sums
    meta, sums = _all_ok(what, path, device, open_)
    smeta = meta.state_dict_metadata
    if like is None:
        box = {_TREE_KEY: None}
        _dcp(what, path, lambda: dcp.load(box, checkpoint_id=path, no_dist=mesh is None),
             ranks=mesh is not None)
        treespec = box[_TREE_KEY]
    else:
        treespec = optree.tree_structure(like)

    def prepare():
        paths = treespec.paths()
        keys = _keys(paths, what)
        missing = [k for k in keys if k not in smeta]
        if missing:
            saved = sorted(k for k in smeta if k not in (_TREE_KEY, _CHECKED_KEY))
            raise CheckpointError(
                f"{what}: no entry {missing[0]!r} (leaf "
                f"{keystr('like', paths[keys.index(missing[0])])}) ({path})\nit holds "
                f"{saved[:8]}{' ...' if len(saved) > 8 else ''}")
        # placeholders: meta tensors of the saved global shapes, so specs can be checked
        holders = [torch.empty(smeta[k].size, dtype=smeta[k].properties.dtype, device="meta")
                   if isinstance(smeta[k], TensorStorageMetadata) else _OBJECT for k in keys]
        skeleton = optree.tree_unflatten(treespec, holders)
        items = (leaf_specs(skeleton, mesh, specs if specs is not None else P(), "tree")[0]
                 if mesh is not None else [(p, h, None) for p, h in zip(paths, holders)])
        casts = [None] * len(keys)
        if like is not None:
            for i, ((_, _, s), k, x) in enumerate(zip(items, keys, optree.tree_leaves(like))):
                _check_like(what, path, keystr("like", paths[i]), k, x, smeta[k], s, mesh,
                            convert)
                if isinstance(x, torch.Tensor) and x.dtype != smeta[k].properties.dtype:
                    casts[i] = x.dtype
        # allocating may fail on one rank only (out of memory): part of what is agreed
        return (keys, items, casts) + _targets(keys, items, mesh, device)
    keys, items, casts, state, blocks, fix = _all_ok(what, path, device, prepare)
    _verify(what, path, meta, sums, set(keys), device)
    _dcp(what, path, lambda: dcp.load(state, checkpoint_id=path, no_dist=mesh is None),
         ranks=mesh is not None)
    if mesh is None:
        return optree.tree_unflatten(treespec, [
            state[k] if c is None else state[k].to(c) for k, c in zip(keys, casts)])
    out = []
    ops = _RawOps(mesh)
    with torch.no_grad():
        for (p, h, s), k, c in zip(items, keys, casts):
            if h is _OBJECT:
                out.append(state[k])
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
    return optree.tree_unflatten(treespec, out)


def _targets(keys, items, mesh: Mesh | None, device) -> tuple[dict, dict, dict]:
    """What DCP loads into: ``{key: full tensor, DTensor over this rank's new block, or
    None for a non-tensor}``; the blocks; and ``{key: (layout DCP fills, layout
    wanted)}`` for the specs a DTensor nests differently (moved after the load)."""
    state, blocks, fix = {}, {}, {}
    for (p, h, s), k in zip(items, keys):
        if h is _OBJECT:
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
                                      run_check=False, shape=h.shape, stride=_strides(h.shape))
        if layout(s, h.ndim, mesh) != lay:
            fix[k] = (lay, layout(s, h.ndim, mesh))
    return state, blocks, fix


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
    _world.require_torch_distributed("functp.full_state_dict")
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
            if s is not None:       # every rank takes part in the gathers; one keeps them
                x = full_of(x, n, s, mesh, ops)
                x = x if mine else None
            out.append(x)
    return optree.tree_unflatten(treespec, out) if mine else None
