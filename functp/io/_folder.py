"""Reading a checkpoint folder that may come from someone else, running no code from
it: ``.metadata`` is unpickled by functp with an allowlist of DCP's own classes
(``_safe_pickle``) and handed to DCP already read, so DCP never unpickles it;
non-tensor values stored as DCP bytes (older checkpoints, plain DCP) are read as plain
data only; every file the metadata names must lie inside the folder."""
from __future__ import annotations

import json
import os
import pickle
import zlib
from typing import Any

import optree

from ..runtime._errors import CheckpointError, ShardingError
from ..runtime._torch_compat import (DefaultLoadPlanner, FileSystemReader, Metadata,
                                     StorageMeta, TensorStorageMetadata)
from . import _safe_pickle
from ._failures import describe_cause
from ._format import CHECKED_KEY, FORMAT, FORMAT_KEY, METADATA, OWN, SUMS, TREE, TREE_KEY, TRUST
from ._tree_file import checkpoint_keys, decode, read_skeleton

__all__ = ["Saved", "open_folder", "Reader", "ValuesAsData"]

class Saved:
    """What a checkpoint folder holds, read and checked by :func:`open_folder`: DCP's
    ``meta``, the ``sums`` (``None`` without), the ``tensors`` (key -> DCP's entry),
    the non-tensor ``values`` of the tree file, the keys DCP holds as ``pickled``
    bytes, the ``skeleton`` of the saved tree (``None`` when it cannot be read as
    data: ``why`` says so) and ``old`` (format 1: the tree is a pickle)."""

    def __init__(self, meta, sums):
        smeta = meta.state_dict_metadata
        self.meta, self.sums = meta, sums
        self.tensors = {k: m for k, m in smeta.items()
                        if k not in OWN and isinstance(m, TensorStorageMetadata)}
        self.pickled = {k for k, m in smeta.items() if k not in OWN and k not in self.tensors}
        self.values: dict[str, Any] = {}
        self.skeleton: Any = None
        self.old = TREE_KEY in smeta
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
                f"{what}: {METADATA} stores key '{index.fqn}' in {rel!r}, which is outside the "
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
            f"{what}: {METADATA} was refused: {e}; nothing from it was run ({path})\nloading "
            f"a pickle runs the code it names, so functp loads only the classes DCP's metadata "
            f"is made of; {TRUST}") from None
    except Exception as e:     # noqa: BLE001 - any unpickling failure means garbled
        raise CheckpointError(f"{what}: {METADATA} is unreadable ({describe_cause(e)}) "
                              f"({path})") from e


def open_folder(what: str, path: str, trusted: bool = False) -> Saved:
    """Reads and checks the checkpoint folder at ``path``: checksums, metadata (as data
    unless ``trusted``), the paths it names, and the tree file."""
    if not os.path.isdir(path):
        kind = " (a file, not a directory)" if os.path.exists(path) else ""
        raise CheckpointError(f"{what}: no checkpoint at {path}{kind}")
    root = os.path.realpath(path)
    raw_sums = _read(what, path, root, SUMS)
    meta_crc = tree_crc = sums = None
    if raw_sums is not None:
        try:
            record = json.loads(raw_sums)
            meta_crc, tree_crc = int(record["metadata"]), record.get("tree")
            sums = {(fqn, None if off is None else tuple(off)): (file, start, length, crc)
                    for fqn, off, file, start, length, crc in record["entries"]}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{what}: {SUMS} is unreadable ({describe_cause(e)}) ({path})"
                                  ) from e
    raw = _read(what, path, root, METADATA)
    if raw is None:
        raise CheckpointError(f"{what}: no checkpoint at {path} (no {METADATA}: not a "
                              f"checkpoint, or its save did not finish)")
    if meta_crc is not None and zlib.crc32(raw) != meta_crc:
        raise CheckpointError(f"{what}: {METADATA} is unreadable (it fails its checksum: "
                              f"truncated or garbled) ({path})")
    meta = _metadata(what, path, raw, trusted)
    _check_paths(what, path, root, meta)
    smeta = meta.state_dict_metadata
    if (FORMAT_KEY in smeta or CHECKED_KEY in smeta) and sums is None:
        raise CheckpointError(
            f"{what}: incomplete: the save that wrote it did not finish ({path})\n"
            f"({SUMS}, written last, is missing); save it again")
    saved = Saved(meta, sums)
    if FORMAT_KEY in smeta:
        _read_tree(what, path, _read(what, path, root, TREE), tree_crc, saved)
    return saved


def _read_tree(what: str, path: str, raw: bytes | None, crc, saved: Saved) -> None:
    """The tree file into ``saved``: the values, and the skeleton checked against the
    keys DCP holds."""
    if raw is None:
        raise CheckpointError(f"{what}: {TREE} is missing: the checkpoint was damaged "
                              f"after its save ({path}); restore it or save again")
    if zlib.crc32(raw) != crc:
        raise CheckpointError(f"{what}: {TREE} is unreadable (it fails its checksum: "
                              f"truncated or garbled) ({path})")
    try:
        record = json.loads(raw)
        if not isinstance(record, dict) or type(record.get("format")) is not int:
            raise ValueError("no format")
        if record["format"] > FORMAT:
            raise CheckpointError(
                f"{what}: written by a newer functp (format {record['format']}; this one "
                f"reads up to {FORMAT}) ({path})\nupgrade functp to load it")
        saved.values = {str(k): decode(v) for k, v in dict(record["values"]).items()}
        both = sorted(set(saved.values) & set(saved.tensors) | set(saved.values) & saved.pickled)
        if both:
            raise ValueError(f"it holds a value under key '{both[0]}', which {METADATA} "
                             f"holds too")
        if record["tree"] is None:
            saved.why = f"{record['unkept']}" if isinstance(record.get("unkept"), str) \
                else "no tree structure recorded"
            return
        skeleton = read_skeleton(record["tree"])
        treespec = optree.tree_structure(skeleton)
        leaves = optree.tree_leaves(skeleton)
        for k, leaf in zip(checkpoint_keys(treespec.paths(), what), leaves):
            if leaf.key != k or not (k in saved.tensors if leaf.tensor else k in saved.values):
                raise ValueError(f"its leaf '{leaf.key}' is not what {METADATA} holds")
        saved.skeleton = skeleton
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError, ShardingError) as e:
        raise CheckpointError(f"{what}: {TREE} is unreadable ({describe_cause(e)}) ({path})") from e


class Reader(FileSystemReader):
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


class ValuesAsData(DefaultLoadPlanner):
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
                f"({self._path})\n{TRUST}") from None
        except Exception as e:     # noqa: BLE001 - garbled bytes
            raise CheckpointError(f"{self._what}: key '{key}' is unreadable ({describe_cause(e)}) "
                                  f"({self._path})") from e
