"""A transformers checkpoint folder of safetensors files, read block by block.

A folder holds ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
:class:`Folder` reads every file's header once (names, shapes, dtypes; a truncated
file fails here) and then reads slices through ``safetensors.safe_open(...).get_slice``,
so a rank touches only the bytes of its own block. A model parameter maps to a
*source*: one stored tensor, or, where transformers converts the checkpoint's layout
on load (per-expert weights stacked, gate and up concatenated), a tree of them
(:class:`Stack`, :class:`Cat`) built from transformers' own conversion mapping, read
without assembling the full parameter. Nothing here unpickles: safetensors only.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from typing import Any, NamedTuple, Sequence

import torch

from ..runtime._errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_NOT_FLOAT = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")


def require_hf(what: str) -> None:
    """Raises naming the ``hf`` extra when safetensors or transformers is missing."""
    missing = [m for m in ("safetensors", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(
            f"{what} needs {' and '.join(missing)}: pip install 'functp[hf]'")


class Stored(NamedTuple):
    """A tensor as stored in the folder."""
    key: str
    shape: tuple[int, ...]


class Stack(NamedTuple):
    """``torch.stack(children, dim)``: per-expert tensors stacked."""
    children: tuple
    dim: int
    shape: tuple[int, ...]


class Cat(NamedTuple):
    """``torch.cat(children, dim)``: gate and up concatenated."""
    children: tuple
    dim: int
    shape: tuple[int, ...]


class Folder:
    """The tensors of a checkpoint folder: ``entries[key] = (file, shape, dtype)``.

    With an index, each tensor it names is read from the file it names it in (a copy
    in another file is ignored); a tensor it does not name, from the file holding it.

    **Arguments:** ``path`` – the folder; ``what`` – the caller's name, for messages.
    **Raises:** :class:`CheckpointError` for a folder without safetensors (naming
    safetensors' converter when it holds ``pytorch_model.bin``), a damaged or
    truncated file, or an index naming a tensor its file lacks. Every rank reads the
    same headers, so every rank raises the same error. Example::

        folder = Folder("ckpt", "from_pretrained")
        folder.read("model.norm.weight", [(0, 4)])      # the first 4 entries
    """

    def __init__(self, path: str | os.PathLike, what: str):
        self.path, self.what = os.fspath(path), what
        self.entries: dict[str, tuple[str, tuple[int, ...], str]] = {}
        files = self._files()
        # the file the index names for each tensor (none without an index)
        self._named = {k: file for file, keys in files.items() for k in keys or ()}
        for file, keys in files.items():
            self._header(file, keys)

    def _files(self) -> dict[str, list[str] | None]:
        """File name -> the keys the index says it holds (None: no index)."""
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{self.what}: {index} is not a safetensors index "
                                      f"(a 'weight_map' of tensor -> file): {e}") from None
            files: dict[str, list[str]] = {}
            for key, file in weight_map.items():
                files.setdefault(file, []).append(key)
            return files
        if os.path.isfile(os.path.join(self.path, SINGLE)):
            return {SINGLE: None}
        found = sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []
        pickled = [f for f in found if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
        hint = (f"; it holds {pickled}, pickled weights functp never loads (loading a "
                f"pickle can run code): convert them to safetensors first, with "
                f"safetensors' converter (safetensors.torch.save_file on a state dict you "
                f"trust, or the hub's convert.py space)" if pickled else "")
        raise CheckpointError(f"{self.what}: {self.path!r} holds neither {SINGLE} nor "
                              f"{INDEX}{hint}")

    def _header(self, file: str, keys: list[str] | None) -> None:
        from safetensors import SafetensorError, safe_open
        full = os.path.join(self.path, file)
        if os.path.basename(file) != file or not os.path.isfile(full):
            raise CheckpointError(f"{self.what}: {full} is missing (the index lists it for "
                                  f"tensors {(keys or [])[:4]})")
        try:
            with safe_open(full, "pt") as f:
                names = list(f.keys())
                for k in names:
                    # the index decides: a copy of a tensor in a file the index does not
                    # name for it (a leftover of an earlier save) is ignored, not refused,
                    # since transformers' save_pretrained writes the index as the record
                    # of where each tensor lives and its loader refuses no such folder
                    # either (it reads every listed file, the last copy winning)
                    if self._named.get(k, file) != file:
                        continue
                    sl = f.get_slice(k)
                    self.entries[k] = (full, tuple(sl.get_shape()), sl.get_dtype())
        except SafetensorError as e:
            raise CheckpointError(
                f"{self.what}: {full} is damaged or truncated ({e}); its tensors "
                f"{(keys or ['(all of them)'])[:4]} cannot be read: copy the file again") from None
        lost = sorted(set(keys or ()) - set(names))
        if lost:
            raise CheckpointError(f"{self.what}: {INDEX} puts tensors {lost[:4]} in {full}, "
                                  f"which does not hold them")

    def read(self, key: str, box: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``key``'s entries in ``box`` (``(offset, size)`` per dimension)."""
        from safetensors import safe_open
        file = self.entries[key][0]
        # a file opened per read: its mapped pages leave the resident set when it closes
        with safe_open(file, "pt") as f:
            t = (f.get_slice(key)[tuple(slice(o, o + n) for o, n in box)] if box
                 else f.get_tensor(key))
        # a slice is a view of the whole stored tensor (mapped from the file): a copy of
        # the slice alone, so that a block never keeps the rest of the tensor alive
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone(memory_format=torch.contiguous_format)
        return t


def read_box(folder: Folder, src: Any, box: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The entries of source ``src`` in ``box``, reading only those of each stored tensor."""
    if isinstance(src, Stored):
        return folder.read(src.key, box)
    off, size = box[src.dim]
    if isinstance(src, Stack):
        rest = [*box[:src.dim], *box[src.dim + 1:]]
        parts = [read_box(folder, c, rest) for c in src.children[off:off + size]]
        if not parts:
            return torch.empty([n for _, n in box])
        return torch.stack(parts, src.dim)
    parts, start = [], 0
    for c in src.children:
        n = c.shape[src.dim]
        lo, hi = max(off, start), min(off + size, start + n)
        if lo < hi:
            sub = list(box)
            sub[src.dim] = (lo - start, hi - lo)
            parts.append(read_box(folder, c, sub))
        start += n
    return parts[0] if len(parts) == 1 else torch.cat(parts, src.dim)


def read_block(folder: Folder, src: Any, ranges: list[list[tuple[int, int]]],
               dtype: torch.dtype) -> torch.Tensor:
    """The block whose per-dimension ranges are ``ranges`` (:func:`block_ranges`: a
    packed dimension has one range per packed piece), converted to ``dtype`` piece
    by piece."""
    def rec(d: int, box: list) -> torch.Tensor:
        if d == len(ranges):
            return read_box(folder, src, box).to(dtype)
        parts = [rec(d + 1, [*box, r]) for r in ranges[d]]
        return parts[0] if len(parts) == 1 else torch.cat(parts, d)
    return rec(0, []).contiguous()


# -- model parameter -> source ----------------------------------------------------------


class Merge(NamedTuple):
    """A transformers conversion functp reads lazily: ``sources`` (patterns with ``*``
    for the expert number) each stacked on ``stack_dim``, then concatenated on
    ``cat_dim`` into the parameter named by ``target``."""
    target: str
    sources: tuple[str, ...]
    stack_dim: int | None
    cat_dim: int | None


def merges(model: torch.nn.Module) -> tuple[list[Merge], list[str]]:
    """transformers' checkpoint conversions of ``model`` that functp reads lazily, and
    the targets of those it does not (their parameters must be stored as they are)."""
    from transformers import conversion_mapping as cm
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter
    try:
        transforms = cm.get_model_conversion_mapping(model, add_legacy=False)
    except Exception:      # noqa: BLE001 - a model transformers has no mapping for
        return [], []
    out, other = [], []
    for t in transforms:
        if not isinstance(t, WeightConverter):
            continue
        targets = [t.target_patterns] if isinstance(t.target_patterns, str) else list(t.target_patterns)
        sources = [t.source_patterns] if isinstance(t.source_patterns, str) else list(t.source_patterns)
        ops = list(t.operations)
        kinds = [type(o) for o in ops]
        if (len(targets) == 1 and kinds in ([MergeModulelist], [MergeModulelist, Concatenate])
                and not re.search(r"[\^$\\()\[\]|+?]", targets[0] + "".join(sources))):
            out.append(Merge(targets[0], tuple(sources), ops[0].dim,
                             ops[1].dim if len(ops) > 1 else None))
        else:
            other.extend(targets)
    return out, other


def source_of(folder: Folder, names: Sequence[str], shape: Sequence[int], floating: bool,
              conversions: list[Merge]) -> Any:
    """The source of the parameter stored under one of ``names`` (its tied aliases),
    checked: present, of ``shape``, of a dtype that converts. Raises CheckpointError."""
    src = next((Stored(n, folder.entries[n][1]) for n in names if n in folder.entries), None)
    if src is None:
        src = _merged(folder, names[0], shape, conversions)
    _check(folder, names[0], src, tuple(shape), floating)
    return src


def _merged(folder: Folder, name: str, shape: Sequence[int], conversions: list[Merge]) -> Any:
    for m in conversions:
        if not (name == m.target or name.endswith("." + m.target)):
            continue
        prefix = name[:len(name) - len(m.target)]
        count = shape[m.stack_dim] if m.stack_dim is not None else 1
        parts = []
        for pattern in m.sources:
            keys = [prefix + pattern.replace("*", str(e)) for e in range(count)]
            kids = tuple(_stored(folder, name, k) for k in keys)
            first = kids[0].shape
            bad = next((k for k in kids if k.shape != first), None)
            if bad is not None:
                raise CheckpointError(
                    f"{folder.what}: {folder.entries[bad.key][0]}: tensor {bad.key!r} has "
                    f"shape {bad.shape}, but {kids[0].key!r} has {first}; the experts of "
                    f"{name!r} must have one shape")
            d = m.stack_dim
            parts.append(Stack(kids, d, (*first[:d], count, *first[d:])))
        if m.cat_dim is None:
            return parts[0]
        d = m.cat_dim
        total = sum(p.shape[d] for p in parts)
        return Cat(tuple(parts), d, (*parts[0].shape[:d], total, *parts[0].shape[d + 1:]))
    raise CheckpointError(f"{folder.what}: {folder.path}: the checkpoint holds no tensor "
                          f"{name!r}, which the model needs (tensors it holds: "
                          f"{sorted(folder.entries)[:6]}...)")


def _stored(folder: Folder, name: str, key: str) -> Stored:
    if key not in folder.entries:
        raise CheckpointError(f"{folder.what}: {folder.path}: the checkpoint holds no tensor "
                              f"{key!r}, a part of the model's {name!r}")
    return Stored(key, folder.entries[key][1])


def _leaves(src: Any) -> list[Stored]:
    return [src] if isinstance(src, Stored) else [x for c in src.children for x in _leaves(c)]


def _check(folder: Folder, name: str, src: Any, shape: tuple, floating: bool) -> None:
    if src.shape != shape:
        keys = [s.key for s in _leaves(src)]
        raise CheckpointError(
            f"{folder.what}: {folder.entries[keys[0]][0]}: tensor {keys[0]!r}"
            f"{' (and its experts)' if len(keys) > 1 else ''} gives {name!r} shape "
            f"{src.shape}, but the model built from config.json has {shape}; the "
            f"checkpoint and its config.json do not match")
    for s in _leaves(src):
        file, _, dtype = folder.entries[s.key]
        if floating == (dtype in _NOT_FLOAT):
            raise CheckpointError(
                f"{folder.what}: {file}: tensor {s.key!r} is stored as {dtype}, which does "
                f"not convert to the model's {'floating' if floating else 'integer'} "
                f"parameter {name!r}; the file does not hold this model's weights")
