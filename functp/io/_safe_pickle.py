"""Reading the pickles inside a checkpoint folder without running code from them.

A pickle names the functions it calls to rebuild its objects (``module.name``), and
``pickle.loads`` imports and calls whatever it names: a checkpoint folder from
someone else could run anything while DCP reads its ``.metadata``. Here every name a
pickle asks for is looked up in an allowlist — the classes DCP's metadata is made
of, ``torch.Size``, dtypes, layouts and paths for :func:`load_metadata`; plain data for
:func:`load_value` — and anything else raises :class:`Refused` before it is called.
Persistent ids (tensor storages) are refused too.

The allowlists were checked against the ``.metadata`` that torch 2.13 and 2.14.1
write (``tests/test_checkpoint.py`` rechecks them on the torch it runs with).
"""
from __future__ import annotations

import collections
import io
import pathlib
import pickle
import zipfile
from typing import Any

import torch

__all__ = ["Refused", "load_metadata", "load_value"]


class Refused(pickle.UnpicklingError):
    """A pickle asked for a global outside the allowlist; nothing was called.
    ``name`` is what it asked for, ``module.qualname``."""

    def __init__(self, name: str, why: str):
        super().__init__(f"it asks for {name}, {why}")
        self.name = name


# ---------------------------------------------------------------------------------
# what a global may be replaced with: each checks its arguments, then builds the value


def _table(kind: type) -> dict[str, Any]:
    # read from torch's namespace dict, never through getattr (no lazy imports run)
    return {k: v for k, v in vars(torch).items() if isinstance(v, kind)}


def _size(sizes=()) -> torch.Size:
    if not (isinstance(sizes, (tuple, list)) and all(type(i) is int for i in sizes)):
        raise pickle.UnpicklingError(f"torch.Size of {type(sizes).__name__}, not of ints")
    return torch.Size(sizes)


def _layout(name) -> torch.layout:
    layouts = {str(v): v for v in _table(torch.layout).values()}
    if name not in layouts:
        raise pickle.UnpicklingError(f"unknown torch.layout {name!r}")
    return layouts[name]


def _device(kind, index=None) -> torch.device:
    if not isinstance(kind, str) or not (index is None or type(index) is int):
        raise pickle.UnpicklingError("torch.device of other than a str and an int")
    return torch.device(kind) if index is None else torch.device(kind, index)


def _latin1(text, encoding="latin1") -> bytes:
    # protocol 2 writes bytes as _codecs.encode(str, 'latin1')
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode of other than a latin1 str")
    return text.encode("latin1")


def _complex(real=0.0, imag=0.0) -> complex:
    if not all(type(v) in (int, float) for v in (real, imag)):
        raise pickle.UnpicklingError("complex of other than two numbers")
    return complex(real, imag)


def _torch_globals() -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {("torch", k): v for k, v in _table(torch.dtype).items()}
    out.update({("torch", k): v for k, v in _table(torch.layout).items()})
    out[("torch", "Size")] = _size
    out[("torch.serialization", "_get_layout")] = _layout     # how torch pickles a layout
    return out


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """DCP's ``.metadata``: its dataclasses (built field by field, no code of theirs runs
    but ``TensorProperties.__setstate__``, which only assigns), the memory-format
    enum (by value), and the ``checkpoint_id`` path a save records."""
    from ..runtime._torch_compat import dcp_filesystem as filesystem, dcp_metadata as md
    enc = md._MEM_FORMAT_ENCODING
    out = _torch_globals()
    for cls in (md.Metadata, md.MetadataIndex, md.TensorStorageMetadata,
                md.BytesStorageMetadata, md.ChunkStorageMetadata, md.TensorProperties,
                md.StorageMeta):
        out[(md.__name__, cls.__name__)] = cls
    out[(md.__name__, enc.__name__)] = lambda value: enc(value)
    out[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    paths = {"PosixPath": pathlib.PurePosixPath, "PurePosixPath": pathlib.PurePosixPath,
             "WindowsPath": pathlib.PureWindowsPath, "PureWindowsPath": pathlib.PureWindowsPath}
    for module in ("pathlib", "pathlib._local"):       # Python 3.13 moved the classes
        out.update({(module, k): v for k, v in paths.items()})
    return out


def _value_globals() -> dict[tuple[str, str], Any]:
    """A non-tensor value a DCP checkpoint holds as bytes (``torch.save``, protocol 2):
    numbers, strings, bytes, containers, dtypes, devices and sizes."""
    out = _torch_globals()
    out.update({("torch", "device"): _device, ("_codecs", "encode"): _latin1,
                ("collections", "OrderedDict"): collections.OrderedDict})
    builtins = {"complex": _complex, "set": set, "frozenset": frozenset,
                "bytearray": bytearray}
    for module in ("builtins", "__builtin__"):     # protocol 2 writes Python 2's name
        out.update({(module, k): v for k, v in builtins.items()})
    return out


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, allowed: dict[tuple[str, str], Any], what: str):
        super().__init__(file)
        self._allowed, self._what = allowed, what

    def find_class(self, module: str, name: str) -> Any:
        # every global a pickle names comes through here (GLOBAL, STACK_GLOBAL, INST,
        # OBJ and the copyreg extension codes): the allowlist is all it can reach
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise Refused(f"{module}.{name}", f"which is not part of {self._what}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise Refused("a persistent id (a tensor's storage)", f"which is not part of "
                      f"{self._what}")


def _loads(raw: bytes, allowed: dict, what: str) -> Any:
    return _Unpickler(io.BytesIO(raw), allowed, what).load()


# ---------------------------------------------------------------------------------
# DCP's metadata


def load_metadata(raw: bytes):
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file, checked field by field.

    **Returns:** the ``Metadata``. Raises :class:`Refused` for a global outside the
    allowlist, ``pickle.UnpicklingError`` (or what unpickling garbage raises) for
    bytes that are not a pickle, and ``TypeError`` for a pickle of the allowed classes
    that is not the metadata DCP writes. Example::

        meta = load_metadata(open("ckpt/.metadata", "rb").read())
    """
    meta = _loads(raw, _metadata_globals(), "DCP's checkpoint metadata")
    _check_metadata(meta)
    return meta


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise TypeError(f"{what}: not what DCP writes")


def _is_size(x: Any, n: int | None = None) -> bool:
    return isinstance(x, torch.Size) and (n is None or len(x) == n)


def _is_count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _check_metadata(meta: Any) -> None:
    """The fields DCP's reader and functp use have the types DCP gives them, so a
    crafted file fails here with its field named, not later inside DCP."""
    from ..runtime._torch_compat import dcp_filesystem as filesystem, dcp_metadata as md
    _expect(isinstance(meta, md.Metadata), f"it holds a {type(meta).__name__}, not a Metadata")
    sdm = getattr(meta, "state_dict_metadata", None)
    _expect(isinstance(sdm, dict), "state_dict_metadata")
    for key, m in sdm.items():
        _expect(isinstance(key, str), f"state_dict_metadata key {key!r}")
        if isinstance(m, md.BytesStorageMetadata):
            continue
        _expect(isinstance(m, md.TensorStorageMetadata), f"the entry of {key!r}")
        size = getattr(m, "size", None)
        props = getattr(m, "properties", None)
        chunks = getattr(m, "chunks", None)
        _expect(_is_size(size) and all(_is_count(i) for i in size), f"the size of {key!r}")
        _expect(isinstance(props, md.TensorProperties)
                and isinstance(getattr(props, "dtype", None), torch.dtype),
                f"the dtype of {key!r}")
        _expect(isinstance(chunks, list) and all(
            isinstance(c, md.ChunkStorageMetadata)
            and _is_size(getattr(c, "offsets", None), len(size))
            and _is_size(getattr(c, "sizes", None), len(size)) for c in chunks),
            f"the chunks of {key!r}")
    storage = getattr(meta, "storage_data", None)
    _expect(isinstance(storage, dict), "storage_data")
    for index, info in storage.items():
        _expect(isinstance(index, md.MetadataIndex) and isinstance(getattr(index, "fqn", None), str)
                and (getattr(index, "offset", None) is None or _is_size(index.offset)),
                f"the storage index {index!r}")
        _expect(isinstance(info, filesystem._StorageInfo), f"the storage of {index.fqn!r}")
        _expect(isinstance(getattr(info, "relative_path", None), str)
                and _is_count(getattr(info, "offset", None))
                and _is_count(getattr(info, "length", None)), f"the storage of {index.fqn!r}")
        descriptors = getattr(info, "transform_descriptors", None)
        _expect(descriptors is None or (isinstance(descriptors, (list, tuple))
                                        and all(isinstance(d, str) for d in descriptors)),
                f"the transforms of {index.fqn!r}")
    _expect(getattr(meta, "storage_meta", None) is None
            or isinstance(meta.storage_meta, md.StorageMeta), "storage_meta")


# ---------------------------------------------------------------------------------
# non-tensor values


def load_value(raw: bytes) -> Any:
    """A non-tensor value from DCP's bytes of it (what ``torch.save`` wrote), as data.

    **Returns:** the value. Raises :class:`Refused` for anything that is not plain data
    (an object of another class, a tensor), ``pickle.UnpicklingError`` or
    ``zipfile.BadZipFile`` for garbled bytes. Example::

        load_value(buf.getvalue())     # buf: torch.save(7, buf)
    """
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        names = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(names) != 1:
            raise pickle.UnpicklingError("not what torch.save writes (no single data.pkl)")
        data = z.read(names[0])
    return _loads(data, _value_globals(), "plain data")

