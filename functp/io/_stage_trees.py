"""Ranks that save different trees: a pipeline's stages, each holding its own layers
under the model's own names. The checkpoint holds their union, one tree file for all:
:func:`functp.load` reads it whole on one process, or each rank its own part of it on
any mesh (``like=`` the part), so a model saved on ``pp=2`` loads on ``pp=4`` or on
no pipeline at all.

The union must be a checkpoint, whole and unambiguous: a key held on several ranks is
the same leaf there (dtype, dimensions, split), every block of a split leaf is held by
some rank, and the trees merge (a key is a leaf or a container on all ranks that have
it). One ``all_gather_object`` of each rank's keys, block shapes and splits (taken only
when the trees differ), checked alike on every rank, so each raises the same error.
Example (2 ranks, stage 0 holds ``embed``, stage 1 ``head``)::

    functp.save("ckpt", {"params": stage_params}, mesh, {"params": stage_specs})
    functp.load("ckpt")["params"].keys()      # both stages' keys: the whole model
"""
from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.distributed as dist

from ..mesh._layout import layout, size_from_blocks
from ..mesh._mesh import Mesh
from ..runtime import _crosscheck
from ..runtime._errors import CheckpointError
from ._failures import all_ok
from ._replicas import fingerprint

__all__ = ["union_of_trees"]


def _leaf_row(x: Any, s, mesh: Mesh, check: bool) -> list:
    """What the other ranks need of one leaf: its split per dimension (None for a
    value), block shape, dtype and (check mode) CRC32."""
    fp = fingerprint(x) if check else None
    if not isinstance(x, torch.Tensor):
        return [None, None, None, fp]
    lay = [list(a) for a in layout(s, x.ndim, mesh)] if s is not None else None
    return [lay, list(x.shape), str(x.dtype), fp]


def _merge(a: Any, b: Any, where: str) -> Any:
    """Two tree-file nodes as one (``_tree_file``'s JSON: dicts merge by key, lists and
    tuples entry by entry); ``ValueError`` naming where they differ otherwise."""
    if a == b:
        return a
    (ta, va), = a.items()
    (tb, vb), = b.items()
    if ta != tb or ta in ("tensor", "value"):
        raise ValueError(f"{where or 'the root'} is {ta} {va!r} on one rank, {tb} {vb!r} "
                         f"on another")
    if ta in ("dict", "ordered_dict"):
        out = {json.dumps(k): [k, n] for k, n in va}
        for k, n in vb:
            j = json.dumps(k)
            out[j] = [k, _merge(out[j][1], n, f"{where}.{k}") if j in out else n]
        return {ta: list(out.values())}
    if len(va) != len(vb):
        raise ValueError(f"{where or 'the root'} is a {ta} of {len(va)} entries on one "
                         f"rank, {len(vb)} on another")
    return {ta: [_merge(x, y, f"{where}.{i}") for i, (x, y) in enumerate(zip(va, vb))]}


def _global_shape(key: str, rows: list, mesh: Mesh) -> tuple[int, ...]:
    """The global shape of ``key`` from its holders' ``(coordinate, row)``; raises
    naming what is inconsistent or missing."""
    (c0, (lay, shape, dtype, _)) = rows[0]
    for c, (l2, s2, d2, _) in rows[1:]:
        if (l2, d2, len(s2)) != (lay, dtype, len(shape)):
            raise ValueError(f"'{key}' is a {dtype} of {len(shape)} dimensions split "
                             f"{lay} at {c0}, a {d2} of {len(s2)} split {l2} at {c}")
    split = sorted({a for axes in lay for a in axes})
    places: dict[tuple, tuple] = {}
    for c, (_, s, _, _) in rows:
        c1, s1 = places.setdefault(tuple(c[a] for a in split), (c, s))
        if s1 != s:                       # (the same block on two ranks)
            raise ValueError(f"'{key}' has the shape {tuple(s1)} at {c1}, {tuple(s)} at "
                             f"{c}")
    want = math.prod(mesh.shape[a] for a in split)
    if len(places) != want:
        raise ValueError(f"'{key}' is split over {split} but only {len(places)} of its "
                         f"{want} blocks is saved (held at {sorted(places)})")
    n = []
    cs = [{a: c[a] for a in split} for c, _ in places.values()]   # (each block once)
    for d, axes in enumerate(lay):
        total = size_from_blocks([s[d] for _, s in places.values()], cs, axes, mesh.shape)
        if total is None:
            raise ValueError(f"'{key}' has blocks along dimension {d} that are not "
                             f"torch.chunk-style blocks over {axes}")
        n.append(total)
    return tuple(n)


def _replicas_differ(key: str, rows: list) -> str | None:
    """Check mode: the holders at one place along the split axes hold equal bytes."""
    lay = rows[0][1][0]
    split = sorted({a for axes in lay or () for a in axes})
    seen: dict[tuple, tuple] = {}
    for c, (_, _, _, fp) in rows:
        place = tuple(c[a] for a in split)
        if place in seen and seen[place][1] != fp:
            return (f"'{key}' differs between its replicas at {seen[place][0]} and {c} "
                    f"[FUNCTP_DEBUG check]; make them equal first")
        seen.setdefault(place, (c, fp))
    return None


def union_of_trees(what: str, path: str, items, keys: list[str], tree_file: bytes,
                   mesh: Mesh, device: torch.device) -> tuple[bytes, list]:
    """The tree file of every rank's trees together and this rank's leaves' global
    shapes; every rank raises the same :class:`CheckpointError` if the union is not a
    whole, unambiguous checkpoint (or, in the check mode, replicas differ)."""
    check = _crosscheck.ENABLED
    mine = all_ok(what, path, device, lambda: [_leaf_row(x, s, mesh, check)
                                               for _, x, s in items])
    record = json.loads(tree_file)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dict(mesh.coordinate), keys, mine, record))
    holders: dict[str, list] = {}
    tree, values = None, {}
    try:
        for coord, ks, rows, rec in every:
            for k, row in zip(ks, rows):
                holders.setdefault(k, []).append((coord, row))
            for k, v in rec["values"].items():
                if values.setdefault(k, v) != v:
                    raise ValueError(f"the value '{k}' is {values[k]!r} on one rank, "
                                     f"{v!r} on another")
            if rec["tree"] is None:
                raise ValueError(rec["unkept"])
            tree = rec["tree"] if tree is None else _merge(tree, rec["tree"], "")
        shapes = {k: _global_shape(k, rows, mesh) for k, rows in holders.items()
                  if rows[0][1][0] is not None}
        differ = [m for k, rows in holders.items() if check
                  for m in [_replicas_differ(k, rows)] if m]
        if differ:
            raise ValueError(differ[0])
    except ValueError as e:
        raise CheckpointError(
            f"{what}: the ranks save different trees (a pipeline's stages), but together "
            f"they are not one checkpoint: {e} ({path})\neach key must be the same leaf "
            f"on every rank that holds it, every block of a split leaf held by some rank. "
            f"An optimizer's state_dict() numbers each stage's parameters from 0: save "
            f"the states by parameter name instead (docs/pipelines.md)") from None
    union = dict(record, tree=tree, values=values, unkept=None)
    n_list = [shapes.get(k) if isinstance(x, torch.Tensor) else None
              for (_, x, _), k in zip(items, keys)]
    return json.dumps(union, allow_nan=False).encode(), n_list
