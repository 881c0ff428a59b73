"""The leaves of a call's arguments: the one walk that both the replay's key
(``parallel/_replayed._key``) and its recorder (``_replay.Recorder``, the tags a
replay gives a planned module's arguments) read, so that what the key compares and
what a record decides over can never be two different lists of tensors.

A leaf is a tensor, a plain value, or an object no pytree opens (a cache). Containers
are opened all the way down: tuples, lists, dicts, namedtuples and transformers'
``ModelOutput`` (torch's pytrees), then optree's registered nodes, dataclasses by
their fields.
"""
from __future__ import annotations

import dataclasses

import optree
import torch

from ..runtime._torch_compat import torch_tree_flatten

__all__ = ["flatten_call", "call_tensors", "output_tensors", "PLAIN"]

#: the values a key takes as they are (configuration that may choose a path)
PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
# classes seen so far, by kind (set membership costs no Python call; isinstance does)
_PLAIN_TYPES = set(PLAIN)
_TENSOR_TYPES = {torch.Tensor, torch.nn.Parameter}


def _kind(cls) -> int:
    """0: a plain value's class (an ``IntEnum`` too), 1: a tensor class, 2: anything
    else (a container, or an object no pytree opens); learnt once per class."""
    if cls in _TENSOR_TYPES:
        return 1
    if cls in _PLAIN_TYPES:
        return 0
    if issubclass(cls, torch.Tensor):
        _TENSOR_TYPES.add(cls)
        return 1
    if issubclass(cls, PLAIN):
        _PLAIN_TYPES.add(cls)
        return 0
    return 2


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, object]:
    """The leaves and the structure of ``(args, kwargs)``.

    **Arguments:** a call's positional and keyword arguments. **Returns:** ``(leaves,
    structure)``: every leaf in order, and a value that compares equal for two calls
    exactly when their containers are alike. Plain tensors and values take no pytree
    walk (the usual call). Example::

        flatten_call(({"x": x, "m": [m]},), {})[0]    # [x, m]
    """
    flat = [*args, *kwargs.values()] if kwargs else list(args)
    for v in flat:
        cls = v.__class__
        if cls not in _TENSOR_TYPES and cls not in _PLAIN_TYPES and _kind(cls) == 2:
            return _flatten_tree((args, kwargs))
    return flat, (len(args), *kwargs)


def _flatten_tree(tree) -> tuple[list, object]:
    leaves, spec = torch_tree_flatten(tree)
    for v in leaves:         # (a model's output: tensors and values, no call per leaf)
        cls = v.__class__
        if cls not in _TENSOR_TYPES and cls not in _PLAIN_TYPES and _kind(cls) == 2:
            break
    else:
        return leaves, spec
    out, specs = [], [spec]
    for v in leaves:
        if _kind(v.__class__) < 2:
            out.append(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            sub, sub_spec = _flatten_tree([getattr(v, f.name) for f in dataclasses.fields(v)])
            out.extend(sub)
            specs.append((type(v), sub_spec))
        else:
            sub, sub_spec = optree.tree_flatten(v, none_is_leaf=True)
            if len(sub) == 1 and sub[0] is v:
                out.append(v)           # (opaque: the key describes it, no tag reaches it)
            else:
                sub, sub_spec = _flatten_tree(sub) if any(
                    _kind(x.__class__) == 2 for x in sub) else (sub, sub_spec)
                out.extend(sub)
                specs.append((type(v), sub_spec))
    return out, tuple(specs)


def call_tensors(args: tuple, kwargs: dict) -> list:
    """The tensor leaves of a call's arguments, in :func:`flatten_call`'s order.

    **Arguments:** positional and keyword arguments. **Returns:** a list of tensors.
    Example::

        call_tensors((x, {"cos": c, "sin": s}), {"mask": None})    # [x, c, s]
    """
    out = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        cls = a.__class__
        if cls in _TENSOR_TYPES:
            out.append(a)
        elif cls not in _PLAIN_TYPES:
            kind = _kind(cls)
            if kind == 1:
                out.append(a)
            elif kind == 2:          # a container: the whole walk
                return [t for t in flatten_call(args, kwargs)[0]
                        if t.__class__ in _TENSOR_TYPES or (
                            t.__class__ not in _PLAIN_TYPES and isinstance(t, torch.Tensor))]
    return out


def output_tensors(out) -> list:
    """A module's output tensors, in order (the same walk: a ``ModelOutput``, a
    dataclass, a tuple of them). Example: ``output_tensors((y, {"aux": a}))`` is
    ``[y, a]``."""
    if out.__class__ in _TENSOR_TYPES:
        return [out]
    return call_tensors((out,), {})
