"""``shard`` (full values -> this rank's blocks) and ``unshard`` (blocks -> full)."""
from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist

from . import _primitives as prim
from ._errors import ShardingError
from ._mesh import Mesh
from ._spec import P, normalize_spec
from ._tree import match_specs

__all__ = ["shard", "unshard"]


def _leaf_specs(tree, mesh: Mesh, specs, root: str):
    paths, leaves, leaf_specs, treespec = match_specs(specs, tree, "specs", root)
    out = []
    for path, x, spec in zip(paths, leaves, leaf_specs):
        if isinstance(x, torch.Tensor):
            spec = normalize_spec(spec, mesh.axis_names, f"specs for {path}", x.shape)
        out.append((path, x, spec))
    return out, treespec


def _split_dims(spec: P, mesh: Mesh):
    """(dim, axes, size, index) for every split dimension of ``spec``."""
    for d in range(len(spec)):
        axes = spec.dim_axes(d)
        if axes:
            yield d, axes, mesh.axis_size(axes), mesh.axis_index(axes)


def local_block(x: torch.Tensor, spec: P, mesh: Mesh, path: str = "value") -> torch.Tensor:
    """This rank's block of the full tensor ``x`` under ``spec`` (a copy)."""
    for d, axes, n, i in _split_dims(spec, mesh):
        if x.shape[d] % n:
            raise ShardingError(
                f"specs for {path} (shape {tuple(x.shape)}): {spec!r} splits dimension {d} "
                f"of size {x.shape[d]} over {axes} of size {n}, which does not divide "
                f"it; pad that dimension to a multiple of {n} or split another one "
                f"(mesh {mesh})")
        b = x.shape[d] // n
        x = x.narrow(d, i * b, b)
    return x.clone(memory_format=torch.contiguous_format)


def shard(tree: Any, mesh: Mesh, specs: Any, *, src_rank: int | None = None) -> Any:
    """Full tensors -> this rank's local blocks, laid out by ``specs``.

    **Arguments:** ``tree`` – a pytree of full (global) tensors, the same on every
    rank; ``specs`` – a pytree prefix of ``tree`` (one ``P`` covers everything);
    ``src_rank`` – if given, only that rank's ``tree`` is read (others may pass
    ``None``) and it is broadcast first.

    Without ``src_rank`` no communication happens. Example::

        local = functp.shard({"w": torch.randn(8, 4)}, mesh, {"w": P("tp")})
        local["w"].shape      # (8 // mesh.shape["tp"], 4)
    """
    if src_rank is not None:
        tree = _broadcast_tree(tree, mesh, src_rank)
    items, treespec = _leaf_specs(tree, mesh, specs, "tree")
    return optree.tree_unflatten(treespec, [
        local_block(x, s, mesh, p) if isinstance(x, torch.Tensor) else x
        for p, x, s in items])


@torch.no_grad()
def unshard(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """Local blocks -> full tensors on every rank (all-gathers over the split axes).

    The inverse of :func:`shard`: ``unshard(shard(t, mesh, s), mesh, s)`` equals
    ``t``. Gradients from a shard_map'd function unshard with the in_specs of the
    inputs they belong to.
    """
    items, treespec = _leaf_specs(tree, mesh, specs, "tree")
    out = []
    for path, x, spec in items:
        if isinstance(x, torch.Tensor):
            for d, axes, n, i in _split_dims(spec, mesh):
                x = prim.all_gather(x, mesh.axis_group(axes), d)
        out.append(x)
    return optree.tree_unflatten(treespec, out)


def _broadcast_tree(tree, mesh: Mesh, src: int):
    """Broadcasts a pytree of tensors from global rank ``src`` to every rank."""
    if not 0 <= src < dist.get_world_size():
        raise ShardingError(f"shard: src_rank={src} is not a rank of the world "
                            f"(size {dist.get_world_size()})")
    device = torch.device(mesh.device_type) if mesh.device_type != "cpu" else None
    meta = [None]
    if dist.get_rank() == src:
        leaves, treespec = optree.tree_flatten(tree)
        meta = [(treespec, [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor)
                            else ("value", t) for t in leaves])]
    dist.broadcast_object_list(meta, src=src)
    treespec, info = meta[0]
    out = []
    for k, item in enumerate(info):
        if item[0] == "value":
            out.append(item[1])
            continue
        t = leaves[k].contiguous() if dist.get_rank() == src else torch.empty(item[0], dtype=item[1])
        if device is not None:
            t = t.to(device)
        dist.broadcast(t, src=src)
        out.append(t)
    return optree.tree_unflatten(treespec, out)
