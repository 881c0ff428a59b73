"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) that load on any mesh.

``save`` writes every split leaf as a DTensor built from its block (global shape
given, so uneven blocks are fine) and every whole leaf as a plain tensor; DCP stores
the global tensors' pieces and reassembles whatever pieces another mesh asks for. Keys
are the leaves' paths joined by dots (``params.fc1.weight``), as in a torch state
dict, so plain DCP can read them too. The tree's structure and its non-tensor leaves
(step counters, names) go into ``.functp_tree.json``: data, never a pickle.

A checkpoint cannot load wrong: ``save`` records the CRC32 of every byte range DCP
stored (and of ``.metadata`` and the tree file) in ``.functp_checksums.json``, written
last, which also marks the save as finished; ``load`` checks the ranges it reads before
DCP reads them. Every failure is a :class:`CheckpointError` raised on every rank
together: the ranks agree after each step that could fail on some of them only, so
none goes on alone into DCP's collectives and waits there forever.

Loading runs no code from the folder: ``.metadata`` is unpickled by functp with an
allowlist of DCP's own classes (``_safe_pickle``) and handed to DCP already read, so DCP
never unpickles it; non-tensor values stored as DCP bytes (older checkpoints, plain
DCP) are read as plain data only; every file the metadata names must lie inside the
folder. ``trusted=True`` reads an older checkpoint as DCP would, to convert it once.
"""
from __future__ import annotations

import collections
import functools
import importlib.util
import json
import math
import os
import pickle
import re
import zlib
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from ..runtime import _crosscheck
from . import _safe_pickle
from ..runtime import _world
from ..runtime._errors import CheckpointError, ShardingError, first_line, keystr
from ..mesh._layout import (layout, local_of, local_shape, mark_uneven, mesh_order,
                      spec_to_placements, strides)
from ..mesh._mesh import Mesh
from ..mapping._reshard import _RawOps, full_of, run_plan
from ..mapping._reshard_plan import plan
from ..mapping._reshard_shapes import leaf_specs, shapes_for
from ..mapping._sharding import _broadcast_pickled
from ..mesh._spec import P
from ..runtime._torch_compat import (CheckpointException, DefaultLoadPlanner, FileSystemReader, Metadata,
                            MetadataWriter, StorageMeta, TensorStorageMetadata)

__all__ = ["save", "load", "full_state_dict"]

_FORMAT = 2                              # of the files functp writes beside DCP's
# in every checkpoint of format 2 on: a one-element tensor holding the format. Its
# presence in .metadata says the tree file and the checksums must be there too.
_FORMAT_KEY = "__functp_format__"
# what format 1 stored in DCP (still read): the tree's structure as a pickle (read
# only with trusted=True) and, when the save wrote checksums, this mark
_TREE_KEY = "__functp_treespec__"
_CHECKED_KEY = "__functp_checksummed__"
_OWN = {_FORMAT_KEY, _TREE_KEY, _CHECKED_KEY}
_OBJECT = object()                     # placeholder leaf for a non-tensor value
_SUMS = ".functp_checksums.json"       # CRC32s of the stored bytes; the mark of a finished save
_TREE = ".functp_tree.json"            # the tree's structure and non-tensor leaves, as JSON
_METADATA = ".metadata"                # DCP's metadata file (filesystem.py: _metadata_fn)
_TRUST = ("if you wrote this checkpoint yourself and trust the folder, load it once with "
          "trusted=True (which unpickles as DCP does) and save it again: the new files "
          "load without it")

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
        if isinstance(cause, CheckpointError):     # functp's own, raised inside DCP
            raise CheckpointError(str(cause)) from e
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


def _record_checksums(what: str, path: str, meta, device: torch.device, tree: bytes) -> None:
    """After ``dcp.save``: each rank computes the CRC32s of the ranges in the files it
    wrote (still in its page cache), one all-reduce collects them, rank 0 writes the
    tree file (``tree``, rank 0's) and then :data:`_SUMS`."""
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
        _write_whole(os.path.join(path, _TREE), tree)
        with open(os.path.join(path, _METADATA), "rb") as f:
            record = {"metadata": zlib.crc32(f.read()), "tree": zlib.crc32(tree), "entries": [
                [i.fqn, None if i.offset is None else list(i.offset), s.relative_path,
                 s.offset, s.length, c] for (i, s), c in zip(entries, crcs)]}
        _write_whole(os.path.join(path, _SUMS), json.dumps(record).encode())
    _all_ok(what, path, device, write)     # and no rank returns before the mark is there


def _write_whole(file: str, data: bytes) -> None:
    """``data`` into ``file``, whole or not at all."""
    tmp = file + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)


def _unmark(path: str) -> None:
    """Removes the finished-save mark, so that an overwrite that fails midway leaves
    a checkpoint that ``load`` calls incomplete rather than a mix of two saves."""
    try:
        os.remove(os.path.join(path, _SUMS))
    except (FileNotFoundError, NotADirectoryError):
        pass     # nothing to unmark; DCP reports a path it cannot write to


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


# ---------------------------------------------------------------------------------
# the tree's structure and non-tensor leaves, as data (JSON)


class _Leaf:
    """A leaf of the tree file: what is stored under ``key``, a tensor or a value."""

    def __init__(self, key: str, tensor: bool):
        self.key, self.tensor = key, tensor


_VALUE_TYPES = ("None, bool, int, float, complex, str, bytes, torch.dtype, torch.device "
                "or torch.Size")


def _encode(x: Any) -> Any:
    """A non-tensor leaf (or a dict key) as JSON: scalars as they are, the rest tagged
    (``{"bytes": "00ff"}``); ``TypeError`` for any other type."""
    if x is None or type(x) is bool:
        return x
    if isinstance(x, str):
        return str(x)
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else {"float": repr(float(x))}
    if isinstance(x, complex):
        return {"complex": [_encode(x.real), _encode(x.imag)]}
    if isinstance(x, bytes):
        return {"bytes": x.hex()}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.Size):
        return {"size": [int(i) for i in x]}
    if type(x) is tuple:                   # a dict key such as (0, 'w')
        return {"tuple": [_encode(v) for v in x]}
    raise TypeError(type(x).__qualname__)


def _decode(v: Any) -> Any:
    """What :func:`_encode` gave; ``ValueError`` for JSON it does not write."""
    if not isinstance(v, dict):
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        raise ValueError(f"a {type(v).__name__} where a value belongs")
    if len(v) != 1:
        raise ValueError("a value with more than one tag")
    (tag, arg), = v.items()
    if tag == "float" and arg in ("inf", "-inf", "nan"):
        return float(arg)
    if tag == "complex" and isinstance(arg, list) and len(arg) == 2:
        return complex(*(float(_decode(a)) for a in arg))
    if tag == "bytes" and isinstance(arg, str):
        return bytes.fromhex(arg)
    if tag == "dtype" and isinstance(arg, str):
        dtypes = {k: d for k, d in vars(torch).items() if isinstance(d, torch.dtype)}
        if arg in dtypes:
            return dtypes[arg]
    if tag == "device" and isinstance(arg, str):
        return torch.device(arg)
    if tag == "size" and isinstance(arg, list) and all(type(i) is int for i in arg):
        return torch.Size(arg)
    if tag == "tuple" and isinstance(arg, list):
        return tuple(_decode(a) for a in arg)
    raise ValueError(f"an unknown value {json.dumps(v)[:80]}")


_NODES = {dict: "dict", collections.OrderedDict: "ordered_dict", list: "list", tuple: "tuple"}


def _node(x: Any) -> Any:
    """A node of a skeleton (containers of :class:`_Leaf`) as JSON; ``TypeError``
    naming a container the file does not hold (a namedtuple, a custom pytree node)."""
    if x is None:
        return None
    if isinstance(x, _Leaf):
        return {"tensor" if x.tensor else "value": x.key}
    tag = _NODES.get(type(x))
    if tag in ("dict", "ordered_dict"):
        return {tag: [[_encode(k), _node(v)] for k, v in x.items()]}
    if tag is not None:
        return {tag: [_node(v) for v in x]}
    raise TypeError(type(x).__qualname__)


def _skeleton(v: Any) -> Any:
    """The skeleton a JSON node describes; ``ValueError`` for JSON :func:`_node` does
    not write."""
    if v is None:
        return None
    if not (isinstance(v, dict) and len(v) == 1):
        raise ValueError(f"a {type(v).__name__} where a tree node belongs")
    (tag, arg), = v.items()
    if tag in ("tensor", "value") and isinstance(arg, str):
        return _Leaf(arg, tag == "tensor")
    if tag in ("dict", "ordered_dict") and isinstance(arg, list):
        cls = dict if tag == "dict" else collections.OrderedDict
        if not all(isinstance(kv, list) and len(kv) == 2 for kv in arg):
            raise ValueError(f"a {tag} whose items are not [key, node] pairs")
        return cls((_decode(k), _skeleton(n)) for k, n in arg)
    if tag in ("list", "tuple") and isinstance(arg, list):
        return (list if tag == "list" else tuple)(_skeleton(n) for n in arg)
    raise ValueError(f"an unknown tree node {tag!r}")


def _tree_file(what: str, path: str, items, treespec, keys) -> bytes:
    """The tree file's bytes: the structure (leaves name their keys) and the non-tensor
    leaves' values by key. Raises (on this rank; the caller agrees) for a leaf that is
    not data. A structure the file cannot hold is written as ``null`` with the reason:
    such a checkpoint loads with ``like=``."""
    values = {}
    for (p, x, _), k in zip(items, keys):
        if isinstance(x, torch.Tensor):
            continue
        try:
            values[k] = _encode(x)
        except TypeError:
            raise CheckpointError(
                f"{what}: leaf {p} is a {type(x).__qualname__}; a checkpoint keeps non-tensor "
                f"leaves as data ({_VALUE_TYPES}), never as a pickle ({path})\nconvert it "
                f"(to a str, a number or a tensor), or leave it out of the saved tree") from None
    skeleton = optree.tree_unflatten(treespec, [
        _Leaf(k, isinstance(x, torch.Tensor)) for (_, x, _), k in zip(items, keys)])
    try:
        structure, unkept = _node(skeleton), None
        if optree.tree_structure(_skeleton(json.loads(json.dumps(structure)))) != treespec:
            raise TypeError("a container optree flattens another way")
    except TypeError as e:        # a namedtuple, a custom pytree node: a class is code
        structure = None
        unkept = f"no saved tree structure: the tree holds a {e}, whose class is not saved"
    record = {"format": _FORMAT, "tree": structure, "unkept": unkept, "values": values}
    return json.dumps(record, allow_nan=False).encode()


# ---------------------------------------------------------------------------------
# reading a folder that may come from someone else


class _Saved:
    """What a checkpoint folder holds, read and checked by :func:`_open`: DCP's
    ``meta``, the ``sums`` (``None`` without), the ``tensors`` (key -> DCP's entry),
    the non-tensor ``values`` of the tree file, the keys DCP holds as ``pickled``
    bytes, the ``skeleton`` of the saved tree (``None`` when it cannot be read as
    data: ``why`` says so) and ``old`` (format 1: the tree is a pickle)."""

    def __init__(self, meta, sums):
        smeta = meta.state_dict_metadata
        self.meta, self.sums = meta, sums
        self.tensors = {k: m for k, m in smeta.items()
                        if k not in _OWN and isinstance(m, TensorStorageMetadata)}
        self.pickled = {k for k, m in smeta.items() if k not in _OWN and k not in self.tensors}
        self.values: dict[str, Any] = {}
        self.skeleton: Any = None
        self.old = _TREE_KEY in smeta
        self.why = ("written by an older functp, its tree structure is a pickle" if self.old
                    else "no saved tree structure: not written by functp.save")

    def holds(self, key: str) -> bool:
        return key in self.tensors or key in self.values or key in self.pickled


def _inside(root: str, file: str) -> bool:
    """Whether ``file``, links followed, lies inside the folder ``root`` (a real path)."""
    real = os.path.realpath(file)
    return real != root and os.path.commonpath([root, real]) == root


def _read(what: str, path: str, root: str, name: str) -> bytes | None:
    """The bytes of the folder's file ``name``; ``None`` if there is none."""
    file = os.path.join(path, name)
    if os.path.lexists(file) and not _inside(root, file):
        raise CheckpointError(f"{what}: {name} is a link that leaves the checkpoint folder "
                              f"({path}); nothing was read from it")
    try:
        with open(file, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _check_paths(what: str, path: str, root: str, meta) -> None:
    """Every file ``meta`` names lies inside the folder: relative, no ``..`` out, no link
    out (DCP would open whatever the metadata names)."""
    seen: set[str] = set()
    for index, info in meta.storage_data.items():
        rel = getattr(info, "relative_path", None)
        if rel in seen:
            continue
        ok = (isinstance(rel, str) and rel and "\0" not in rel and not os.path.isabs(rel)
              and _inside(root, os.path.join(root, rel)))
        if not ok:
            raise CheckpointError(
                f"{what}: {_METADATA} stores key '{index.fqn}' in {rel!r}, which is outside the "
                f"checkpoint folder ({path})\nDCP writes its files inside the folder: this "
                f"metadata was written by hand or by someone else, and nothing was read from it")
        seen.add(rel)


def _metadata(what: str, path: str, raw: bytes, trusted: bool):
    """DCP's metadata from ``.metadata``'s bytes: through the allowlist, or as DCP
    itself reads it when ``trusted``."""
    try:
        if trusted:
            meta = pickle.loads(raw)        # what FileSystemReader.read_metadata does
            if not isinstance(meta, Metadata):
                raise TypeError(f"it holds a {type(meta).__name__}, not DCP's Metadata")
            return meta
        return _safe_pickle.load_metadata(raw)
    except _safe_pickle.Refused as e:
        raise CheckpointError(
            f"{what}: {_METADATA} was refused: {e}; nothing from it was run ({path})\nloading "
            f"a pickle runs the code it names, so functp loads only the classes DCP's metadata "
            f"is made of; {_TRUST}") from None
    except Exception as e:     # noqa: BLE001 - any unpickling failure means garbled
        raise CheckpointError(f"{what}: {_METADATA} is unreadable ({_cause(e)}) "
                              f"({path})") from e


def _open(what: str, path: str, trusted: bool = False) -> _Saved:
    """Reads and checks the checkpoint folder at ``path``: checksums, metadata (as data
    unless ``trusted``), the paths it names, and the tree file."""
    if not os.path.isdir(path):
        kind = " (a file, not a directory)" if os.path.exists(path) else ""
        raise CheckpointError(f"{what}: no checkpoint at {path}{kind}")
    root = os.path.realpath(path)
    raw_sums = _read(what, path, root, _SUMS)
    meta_crc = tree_crc = sums = None
    if raw_sums is not None:
        try:
            record = json.loads(raw_sums)
            meta_crc, tree_crc = int(record["metadata"]), record.get("tree")
            sums = {(fqn, None if off is None else tuple(off)): (file, start, length, crc)
                    for fqn, off, file, start, length, crc in record["entries"]}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{what}: {_SUMS} is unreadable ({_cause(e)}) ({path})"
                                  ) from e
    raw = _read(what, path, root, _METADATA)
    if raw is None:
        raise CheckpointError(f"{what}: no checkpoint at {path} (no {_METADATA}: not a "
                              f"checkpoint, or its save did not finish)")
    if meta_crc is not None and zlib.crc32(raw) != meta_crc:
        raise CheckpointError(f"{what}: {_METADATA} is unreadable (it fails its checksum: "
                              f"truncated or garbled) ({path})")
    meta = _metadata(what, path, raw, trusted)
    _check_paths(what, path, root, meta)
    smeta = meta.state_dict_metadata
    if (_FORMAT_KEY in smeta or _CHECKED_KEY in smeta) and sums is None:
        raise CheckpointError(
            f"{what}: incomplete: the save that wrote it did not finish ({path})\n"
            f"({_SUMS}, written last, is missing); save it again")
    saved = _Saved(meta, sums)
    if _FORMAT_KEY in smeta:
        _read_tree(what, path, _read(what, path, root, _TREE), tree_crc, saved)
    return saved


def _read_tree(what: str, path: str, raw: bytes | None, crc, saved: _Saved) -> None:
    """The tree file into ``saved``: the values, and the skeleton checked against the
    keys DCP holds."""
    if raw is None:
        raise CheckpointError(f"{what}: {_TREE} is missing: the checkpoint was damaged "
                              f"after its save ({path}); restore it or save again")
    if zlib.crc32(raw) != crc:
        raise CheckpointError(f"{what}: {_TREE} is unreadable (it fails its checksum: "
                              f"truncated or garbled) ({path})")
    try:
        record = json.loads(raw)
        if not isinstance(record, dict) or type(record.get("format")) is not int:
            raise ValueError("no format")
        if record["format"] > _FORMAT:
            raise CheckpointError(
                f"{what}: written by a newer functp (format {record['format']}; this one "
                f"reads up to {_FORMAT}) ({path})\nupgrade functp to load it")
        saved.values = {str(k): _decode(v) for k, v in dict(record["values"]).items()}
        both = sorted(set(saved.values) & set(saved.tensors) | set(saved.values) & saved.pickled)
        if both:
            raise ValueError(f"it holds a value under key '{both[0]}', which {_METADATA} "
                             f"holds too")
        if record["tree"] is None:
            saved.why = f"{record['unkept']}" if isinstance(record.get("unkept"), str) \
                else "no tree structure recorded"
            return
        skeleton = _skeleton(record["tree"])
        treespec = optree.tree_structure(skeleton)
        leaves = optree.tree_leaves(skeleton)
        for k, leaf in zip(_keys(treespec.paths(), what), leaves):
            if leaf.key != k or not (k in saved.tensors if leaf.tensor else k in saved.values):
                raise ValueError(f"its leaf '{leaf.key}' is not what {_METADATA} holds")
        saved.skeleton = skeleton
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, ShardingError) as e:
        raise CheckpointError(f"{what}: {_TREE} is unreadable ({_cause(e)}) ({path})") from e


class _Reader(FileSystemReader):
    """DCP's file reader, handed the metadata functp has read and checked already: DCP
    never unpickles ``.metadata`` itself (and reads no other copy of it)."""

    def __init__(self, path: str, meta):
        super().__init__(path)
        self._meta = meta

    def read_metadata(self, *args: Any, **kwargs: Any):
        if self._meta.storage_meta is None:
            self._meta.storage_meta = StorageMeta()
        # as DCP's own reader records it (for its logs)
        self._meta.storage_meta.load_id = getattr(self, "load_id", None)
        return self._meta


class _ValuesAsData(DefaultLoadPlanner):
    """DCP's load planner, except that a value DCP stored as bytes (``torch.save`` of a
    non-tensor: older functp checkpoints, plain DCP ones) is read as plain data,
    never unpickled as it stands."""

    def __init__(self, what: str, path: str):
        super().__init__()
        self._what, self._path = what, path

    def load_bytes(self, read_item, value) -> None:
        # functp's state dicts are flat: a key is its own path in the dict given to load
        key = read_item.dest_index.fqn
        try:
            self.original_state_dict[key] = _safe_pickle.load_value(value.read())
        except _safe_pickle.Refused as e:
            raise CheckpointError(
                f"{self._what}: key '{key}' was refused: {e}; nothing from it was run "
                f"({self._path})\n{_TRUST}") from None
        except Exception as e:     # noqa: BLE001 - garbled bytes
            raise CheckpointError(f"{self._what}: key '{key}' is unreadable ({_cause(e)}) "
                                  f"({self._path})") from e


# ---------------------------------------------------------------------------------
# check mode: replicated leaves must agree before one copy is saved


def _fingerprint(x: Any) -> int:
    """CRC32 of a leaf's dtype, shape and bytes (of its data encoding, for a value)."""
    if not isinstance(x, torch.Tensor):
        return zlib.crc32(json.dumps(_encode(x)).encode())
    crc = zlib.crc32(f"{x.dtype} {tuple(x.shape)}".encode())
    data = x.detach().resolve_conj().resolve_neg().contiguous().cpu().reshape(-1)
    data = data.view(torch.uint8)
    return zlib.crc32(memoryview(data.numpy()), crc)


def _check_replicas(what: str, path: str, items, keys, mesh: Mesh) -> None:
    """Check mode: every leaf's blocks are equal on the ranks that replicate it (those
    at the same place along the axes its spec mentions; every rank, for a non-tensor
    leaf): a checkpoint keeps one copy, so a rank that differs would be lost without a
    word. One small all-gather of a CRC32 per leaf; every rank raises the same error."""
    check = mesh.check
    fps = _all_ok(what, path, torch.device(mesh.device_type),
                  lambda: [_fingerprint(x) for _, x, _ in items])
    gather = lambda t: _crosscheck._gather(t.to(check.device), check, f"{what} (check of "
                                           f"replicated leaves)").view(check.size, -1).cpu()
    heads = gather(torch.tensor([len(keys), zlib.crc32("\n".join(keys).encode())]))
    if not bool((heads == heads[0]).all()):
        raise CheckpointError(f"{what}: the ranks save different trees (other keys) on "
                              f"{check.mesh} ({path}) [FUNCTP_DEBUG check]")
    if not keys:
        return
    table = gather(torch.tensor(fps, dtype=torch.int64))
    positions = [mesh._positions[r] for r in check.ranks]
    bad = []
    for i, (p, x, s) in enumerate(items):
        mentioned = set(s.axes) if s is not None else set()
        replicas: dict[tuple, list[int]] = {}
        for row, (r, pos) in enumerate(zip(check.ranks, positions)):
            place = tuple(c for a, c in zip(mesh.axis_names, pos) if a in mentioned)
            replicas.setdefault(place, []).append(row)
        for rows in replicas.values():
            kinds: dict[int, list[int]] = {}
            for row in rows:
                kinds.setdefault(int(table[row, i]), []).append(check.ranks[row])
            if len(kinds) > 1:
                bad.append((p, keys[i], x, s, mentioned, list(kinds.values())))
                break
    if not bad:
        return
    p, key, x, s, mentioned, groups = bad[0]
    over = [a for a in mesh.axis_names if a not in mentioned]
    differ = "; ".join(f"ranks {g} hold {'one' if j == 0 else 'another'}"
                       for j, g in enumerate(groups))
    more = f" (and {len(bad) - 1} more leaves)" if len(bad) > 1 else ""
    if isinstance(x, torch.Tensor):
        fix = (f"make them equal first (a functp.pmean/psum over {tuple(over)} inside the "
               f"step, or a copy of one rank's value), or give it a spec that mentions "
               f"{over[0]!r} if its blocks are meant to differ")
        kind = f"is saved under {s!r}, replicated over {tuple(over)}"
    else:
        fix = "make the ranks agree on it, or keep it out of the saved tree"
        kind = "is a non-tensor value, saved once for all ranks"
    raise CheckpointError(
        f"{what}: leaf {p} (key '{key}') {kind} on {check.mesh}, but its "
        f"{'blocks' if isinstance(x, torch.Tensor) else 'values'} differ: "
        f"{differ}{more} [FUNCTP_DEBUG check] ({path})\nthe checkpoint would keep one "
        f"rank's copy only; {fix}")


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


def _peer_loss(what: str) -> Callable:
    """``save``/``load`` with a lost or stalled peer (gloo's raw error from one of the
    world's flag all-reduces or broadcasts) raised as a :class:`CheckpointError`
    naming the operation and the timeout (``_world.peers``)."""
    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with _world.peers(what, cls=CheckpointError):
                return fn(*args, **kwargs)
        return wrapped
    return deco


@_peer_loss("functp.save")
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
    checkpoint incomplete. A failure on any rank raises :class:`CheckpointError` on
    every rank, its first line the cause. Example::

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
        for (p, _, _), k in zip(items, keys):
            if k in _OWN:
                raise CheckpointError(f"{what}: leaf {p} has the key '{k}', which functp "
                                      f"keeps for itself ({path}); rename it")
        tree_file = _tree_file(what, path, items, treespec, keys)
        if shapes is None:
            return items, treespec, keys, tree_file, None
        # given shapes are checked against this rank's blocks only: agree on them too
        return (items, treespec, keys, tree_file,
                shapes_for(items, treespec, mesh, shapes, what))
    items, treespec, keys, tree_file, n_list = _all_ok(what, path, device, prepare)
    if _crosscheck.ENABLED:
        _check_replicas(what, path, items, keys, mesh)
    if n_list is None:      # one all-gather; every rank checks the same table
        n_list = shapes_for(items, treespec, mesh, None, what)
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
    state[_FORMAT_KEY] = torch.tensor([_FORMAT], dtype=torch.int64, device=device)
    _all_ok(what, path, device, lambda: _unmark(path) if dist.get_rank() == 0 else None)
    meta = _dcp(what, path, lambda: dcp.save(state, storage_writer=MetadataWriter(path)))
    _record_checksums(what, path, meta, device, tree_file)


@_peer_loss("functp.load")
def load(path: str | os.PathLike, mesh: Mesh | None = None, specs: Any = None, *,
         like: Any = None, convert: bool = False, trusted: bool = False) -> Any:
    """Loads a checkpoint written by :func:`save` as local blocks laid out by ``specs``
    on ``mesh`` (any mesh: DCP reads just the pieces each rank needs).

    **Arguments:** ``like`` – a tree with the structure to load (a subset of the saved
    tree is fine); by default, the saved structure. Its non-tensor leaves are
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
        _need_numpy(what)
    device = None if mesh is None else torch.device(mesh.device_type)
    saved = _all_ok(what, path, device, lambda: _open_to_load(what, path, like, trusted))
    treespec = _load_structure(what, path, like, saved, mesh)
    keys, items, casts, state, blocks, fix = _all_ok(
        what, path, device,
        lambda: _prepare_load(what, path, treespec, saved, mesh, specs, like, convert, device))
    _verify(what, path, saved.meta, saved.sums, set(keys), device)
    # DCP reads the tensors (and the values it holds as bytes) with the metadata read
    # above, never with its own unpickling of the folder's files
    reader = {} if trusted else {"storage_reader": _Reader(path, saved.meta),
                                 "planner": _ValuesAsData(what, path)}
    _dcp(what, path, lambda: dcp.load(state, checkpoint_id=path, no_dist=mesh is None,
                                      **reader), ranks=mesh is not None)
    values = [saved.values[k] if k in saved.values else None for k in keys]
    if mesh is None:
        return optree.tree_unflatten(treespec, [
            v if k not in state else state[k] if c is None else state[k].to(c)
            for k, c, v in zip(keys, casts, values)])
    return optree.tree_unflatten(treespec, _loaded_blocks(items, keys, casts, values, state,
                                                          blocks, fix, mesh))


def _open_to_load(what: str, path: str, like: Any, trusted: bool) -> _Saved:
    """The checkpoint's metadata, checked; refused when there is no tree to load."""
    saved = _open(what, path, trusted)
    if like is None and saved.skeleton is None:
        if not (saved.old and trusted):
            raise CheckpointError(f"{what}: {saved.why} ({path})\npass like= with the tree "
                                  f"to load" + (f"; or {_TRUST}" if saved.old else ""))
        # tiny, and torch.load must not unpickle damaged bytes
        _verify(what, path, saved.meta, saved.sums, {_TREE_KEY}, None)
    return saved


def _load_structure(what: str, path: str, like: Any, saved: _Saved, mesh: Mesh | None):
    """The tree structure to load: ``like``'s, the saved one, or (format 1, trusted)
    its pickled structure as DCP reads it."""
    if like is not None:
        return optree.tree_structure(like)
    if saved.skeleton is not None:
        return optree.tree_structure(saved.skeleton)
    box = {_TREE_KEY: None}
    _dcp(what, path, lambda: dcp.load(box, checkpoint_id=path, no_dist=mesh is None),
         ranks=mesh is not None)
    return box[_TREE_KEY]


def _prepare_load(what: str, path: str, treespec, saved: _Saved, mesh: Mesh | None, specs,
                  like: Any, convert: bool, device):
    """Keys, leaves with their specs, dtype casts, and the targets DCP loads into (all
    of it may fail on one rank only, e.g. allocating: ``load`` agrees on it)."""
    paths = treespec.paths()
    keys = _keys(paths, what)
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
    return optree.tree_unflatten(treespec, out) if mine else None
