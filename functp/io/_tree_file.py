"""The tree's structure and its non-tensor leaves as data: ``.functp_tree.json``.

A leaf's checkpoint key is its path joined by dots (``params.fc1.weight``), as in a
torch state dict. Non-tensor leaves are kept as JSON values (tagged where JSON has no
type for them: bytes, dtypes, devices, sizes, complex numbers, non-finite floats) and
the structure as nested containers whose leaves name their keys; never a pickle."""
from __future__ import annotations

import collections
import json
import math
from typing import Any

import optree
import torch

from ..runtime._errors import CheckpointError, ShardingError, keystr
from ._format import FORMAT

__all__ = ["checkpoint_keys", "encode", "decode", "read_skeleton", "tree_record"]

def checkpoint_keys(paths, root: str) -> list[str]:
    """The checkpoint key of each leaf path (its entries joined by dots; ``"_"`` for a
    lone leaf); raises naming both leaves when two paths give one key."""
    keys = [".".join(str(k) for k in p) if p else "_" for p in paths]
    seen: dict[str, tuple] = {}
    for k, p in zip(keys, paths):
        if k in seen:
            raise ShardingError(
                f"{root}: leaves {keystr('tree', seen[k])} and {keystr('tree', p)} both "
                f"become checkpoint key '{k}' (paths are joined with dots); rename one")
        seen[k] = p
    return keys


class _Leaf:
    """A leaf of the tree file: what is stored under ``key``, a tensor or a value."""

    def __init__(self, key: str, tensor: bool):
        self.key, self.tensor = key, tensor


_VALUE_TYPES = ("None, bool, int, float, complex, str, bytes, torch.dtype, torch.device "
                "or torch.Size")


def encode(x: Any) -> Any:
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
        return {"complex": [encode(x.real), encode(x.imag)]}
    if isinstance(x, bytes):
        return {"bytes": x.hex()}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if isinstance(x, torch.Size):
        return {"size": [int(i) for i in x]}
    if type(x) is tuple:                   # a dict key such as (0, 'w')
        return {"tuple": [encode(v) for v in x]}
    raise TypeError(type(x).__qualname__)


def decode(v: Any) -> Any:
    """What :func:`encode` gave; ``ValueError`` for JSON it does not write."""
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
        return complex(*(float(decode(a)) for a in arg))
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
        return tuple(decode(a) for a in arg)
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
        return {tag: [[encode(k), _node(v)] for k, v in x.items()]}
    if tag is not None:
        return {tag: [_node(v) for v in x]}
    raise TypeError(type(x).__qualname__)


def read_skeleton(v: Any) -> Any:
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
        return cls((decode(k), read_skeleton(n)) for k, n in arg)
    if tag in ("list", "tuple") and isinstance(arg, list):
        return (list if tag == "list" else tuple)(read_skeleton(n) for n in arg)
    raise ValueError(f"an unknown tree node {tag!r}")


def tree_record(what: str, path: str, items, treespec, keys) -> bytes:
    """The tree file's bytes: the structure (leaves name their keys) and the non-tensor
    leaves' values by key. Raises (on this rank; the caller agrees) for a leaf that is
    not data. A structure the file cannot hold is written as ``null`` with the reason:
    such a checkpoint loads with ``like=``."""
    values = {}
    for (p, x, _), k in zip(items, keys):
        if isinstance(x, torch.Tensor):
            continue
        try:
            values[k] = encode(x)
        except TypeError:
            raise CheckpointError(
                f"{what}: leaf {p} is a {type(x).__qualname__}; a checkpoint keeps non-tensor "
                f"leaves as data ({_VALUE_TYPES}), never as a pickle ({path})\nconvert it "
                f"(to a str, a number or a tensor), or leave it out of the saved tree") from None
    skeleton = optree.tree_unflatten(treespec, [
        _Leaf(k, isinstance(x, torch.Tensor)) for (_, x, _), k in zip(items, keys)])
    try:
        structure, unkept = _node(skeleton), None
        if optree.tree_structure(read_skeleton(json.loads(json.dumps(structure)))) != treespec:
            raise TypeError("a container optree flattens another way")
    except TypeError as e:        # a namedtuple, a custom pytree node: a class is code
        structure = None
        unkept = f"no saved tree structure: the tree holds a {e}, whose class is not saved"
    record = {"format": FORMAT, "tree": structure, "unkept": unkept, "values": values}
    return json.dumps(record, allow_nan=False).encode()
