"""``shard`` (full values -> this rank's blocks), ``unshard`` (blocks -> full) and the
padding helpers that make uneven sizes fit ``shard_map``.

Sizes need not divide the axis sizes: blocks follow ``torch.chunk`` (see
``_layout.py`` for the layout model), so 10 rows over 4 ranks are 3, 3, 3, 1 rows.
``shard_map`` itself needs even blocks; :func:`pad_to_multiple` and :func:`unpad`
bridge the two.
"""
from __future__ import annotations

import pickle
from typing import Any

import optree
import torch

from ..ops import _context
from ..runtime import _crosscheck
from ..runtime import _fingerprint
from ..runtime import _world
from ..runtime._errors import ShardingError, leaf_text
from ..mesh._mesh import Mesh
from ..mesh._layout import block, layout, local_of, mark_uneven, pad_dim, padded_shape
from ._reshard import _RawOps, full_of, run_plan
from ._reshard_shapes import check_block, given_shapes, shapes_for
from ..mesh._tree import leaf_specs
from ..mesh._spec import P

__all__ = ["shard", "unshard", "pad_to_multiple", "pad_batch", "unpad"]


def local_block(x: torch.Tensor, spec: P, mesh: Mesh, path: str = "value") -> torch.Tensor:
    """This rank's block of the full tensor ``x`` under ``spec`` (a copy); sizes that
    do not divide follow torch.chunk."""
    return local_of(x, spec, mesh, path).clone(memory_format=torch.contiguous_format)


def shard(tree: Any, mesh: Mesh, specs: Any, *, src_rank: int | None = None) -> Any:
    """Full tensors -> this rank's local blocks, laid out by ``specs``.

    **Arguments:** ``tree`` – a pytree of full (global) tensors, the same on every
    rank; ``specs`` – a pytree prefix of ``tree`` (one ``P`` covers everything);
    ``src_rank`` – if given, only that rank's ``tree`` is read (others may pass
    ``None``) and it is broadcast first.

    Without ``src_rank`` no communication happens, and nothing checks that the ranks'
    tensors are the same (each rank would take its block of its own tensor): the
    check mode (``FUNCTP_DEBUG=1``) compares them and raises if they differ. Sizes need not be divisible:
    blocks follow ``torch.chunk`` (10 rows over 4 ranks: 3, 3, 3, 1). Example (4
    simulated ranks)::

        def blocks():
            mesh = functp.make_mesh((4,), ("tp",))
            local = functp.shard({"w": torch.zeros(10, 4)}, mesh, {"w": P("tp")})
            return tuple(local["w"].shape)

        print(functp.simulate(blocks, 4))
        # prints:
        # [(3, 4), (3, 4), (3, 4), (1, 4)]
    """
    if src_rank is not None:
        with _world.peers(f"functp.shard(..., src_rank={src_rank})", src_rank):
            tree = _broadcast_tree(tree, mesh, src_rank)
    items, treespec = leaf_specs(tree, mesh, specs, "tree")
    if _crosscheck.ENABLED and src_rank is None:
        _fingerprint.check_full(mesh, [p for p, _, _ in items], [x for _, x, _ in items],
                                "functp.shard")
    return optree.tree_unflatten(treespec, [
        mark_uneven(local_block(x, s, mesh, p), x.shape, layout(s, x.ndim), mesh)
        if isinstance(x, torch.Tensor) else x for p, x, s in items])


@torch.no_grad()
def unshard(tree: Any, mesh: Mesh, specs: Any, *, shapes: Any = None) -> Any:
    """Local blocks -> full tensors on every rank (one all-gather per split leaf).

    The inverse of :func:`shard`: ``unshard(shard(t, mesh, s), mesh, s)`` equals
    ``t``, for uneven sizes too. ``shapes`` – a tree of global shapes (tuples,
    ``torch.Size`` or tensors); without it the global shapes are learned, and the
    layout checked, with one small all-gather of the block shapes. Gradients from a
    shard_map'd function unshard with the in_specs of the inputs they belong to.
    """
    items, treespec = leaf_specs(tree, mesh, specs, "tree")
    n_list = shapes_for(items, treespec, mesh, shapes, "functp.unshard")
    ops = _RawOps(mesh)
    out = []
    for (path, x, spec), n in zip(items, n_list):
        if isinstance(x, torch.Tensor):
            x = full_of(x, n, spec, mesh, ops, f"functp.unshard: {path}")
        out.append(x)
    return optree.tree_unflatten(treespec, out)


def pad_to_multiple(tree: Any, mesh: Mesh, specs: Any, *, shapes: Any = None) -> Any:
    """Zero-pads every split dimension at its end to a multiple of its axes' size, so
    that the blocks are even and ``shard_map`` can take them.

    Without ``shapes``, ``tree`` holds full tensors (no communication). With
    ``shapes`` (the global shapes), ``tree`` holds uneven local blocks, and the result
    is the blocks of the padded tensors: a local pad where one axis splits the
    dimension, one all-gather where several do. :func:`unpad` undoes it. Example
    (4 simulated ranks)::

        def padded():
            mesh = functp.make_mesh((4,), ("x",))
            full = {"emb": torch.randn(10, 8)}
            local = functp.shard(functp.pad_to_multiple(full, mesh, {"emb": P("x")}),
                                 mesh, {"emb": P("x")})         # 3 rows on every rank
            ...                                                 # shard_map(...)(local)
            back = functp.unshard(local, mesh, {"emb": P("x")})
            return tuple(local["emb"].shape), functp.unpad(back, {"emb": (10, 8)})["emb"].shape

        print(functp.simulate(padded, 4)[0])
        # prints:
        # ((3, 8), torch.Size([10, 8]))
    """
    return _repad(tree, mesh, specs, shapes, to_padded=True)


def pad_batch(batch: Any, mesh: Mesh, axis: str | tuple[str, ...] = "dp") -> tuple[Any, torch.Tensor]:
    """A batch whose rows (dimension 0) do not divide by ``axis`` (a data set's last
    batch), zero-padded to a multiple of it, and a weight per row: 1 for a real row,
    0 for padding. Weighting each row's loss so keeps the mean exact (accelerate's
    ``even_batches`` repeats rows instead, which a mean would count twice):
    ``psum((row_loss * w).sum(), axis) / psum(w.sum(), axis)`` is the unpadded batch's
    mean. Shard both with ``P(axis)`` as usual.

    **Arguments:** ``batch`` – full tensors with the same number of rows (a tensor or
    a pytree); ``mesh``; ``axis`` – the batch axis (or axes).
    **Returns:** ``(padded batch, weights)``, ``weights`` of dtype float32 with the
    padded row count. Example (2 simulated ranks)::

        def last_batch():
            mesh = functp.make_mesh((2,), ("dp",))
            x = torch.arange(3.0)                      # 3 rows over 2 ranks
            (xp,), w = functp.pad_batch((x,), mesh, "dp")
            loss = functp.shard_map(
                lambda x, w: functp.psum((x * w).sum(), "dp") / functp.psum(w.sum(), "dp"),
                mesh, in_specs=(P("dp"), P("dp")), out_specs=P())
            return loss(*functp.shard((xp, w), mesh, P("dp"))).item()

        print(functp.simulate(last_batch, 2)[0])
        # prints:
        # 1.0
    """
    leaves = [x for x in optree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    rows = {x.shape[0] if x.dim() else None for x in leaves}
    if len(rows) != 1 or None in rows:
        raise ShardingError(f"functp.pad_batch: every tensor of the batch needs the same "
                            f"number of rows (dimension 0); got {sorted(map(str, rows))}")
    n = rows.pop()
    spec = P(axis)
    weights = torch.ones(n, dtype=torch.float32, device=leaves[0].device)
    return (pad_to_multiple(batch, mesh, optree.tree_map(lambda _: spec, batch)),
            pad_to_multiple(weights, mesh, spec))


def unpad(tree: Any, shapes: Any, *, mesh: Mesh | None = None, specs: Any = None) -> Any:
    """Undoes :func:`pad_to_multiple`: keeps the leading ``shapes`` of every tensor.

    Without ``mesh``/``specs``, ``tree`` holds full tensors (e.g. after
    :func:`unshard`). With them, ``tree`` holds the even blocks of the padded tensors
    and the result is the (possibly uneven) blocks of tensors of global ``shapes``.
    Example::

        print(functp.unpad({"emb": torch.zeros(12, 8)}, {"emb": (10, 8)})["emb"].shape)
        # prints:
        # torch.Size([10, 8])
    """
    if mesh is None:
        leaves, treespec = optree.tree_flatten(tree)
        items = [("tree" + "".join(f"[{k!r}]" for k in p), x, None)
                 for p, x in zip(optree.tree_paths(tree), leaves)]
        n_list = given_shapes(treespec, shapes, items, "functp.unpad")
        out = []
        for (p, x, _), n in zip(items, n_list):
            if n is not None:
                if any(a > b for a, b in zip(n, x.shape)):
                    raise ShardingError(
                        f"functp.unpad: {leaf_text(p, x.shape)} is smaller than the shape "
                        f"{tuple(n)} to keep; pass the shapes from before padding")
                for d, s in enumerate(n):
                    x = x.narrow(d, 0, s)
            out.append(x)
        return optree.tree_unflatten(treespec, out)
    if specs is None:
        raise ShardingError("functp.unpad: with mesh= give specs= too (the blocks' layout)")
    return _repad(tree, mesh, specs, shapes, to_padded=False)


def _repad(tree, mesh: Mesh, specs, shapes, to_padded: bool):
    what = "functp.pad_to_multiple" if to_padded else "functp.unpad"
    items, treespec = leaf_specs(tree, mesh, specs, "tree")
    if shapes is None:             # full tensors: pad them
        out = []
        for path, x, s in items:
            if isinstance(x, torch.Tensor):
                lay = layout(s, x.ndim)
                for d, n in enumerate(padded_shape(x.shape, lay, mesh)):
                    x = pad_dim(x, d, n)
            out.append(x)
        return optree.tree_unflatten(treespec, out)
    if _context.active():
        raise ShardingError(
            f"{what} with shapes= works on the blocks outside shard_map; call it before "
            f"(or after) the shard_map'd function")
    n_list = given_shapes(treespec, shapes, items, what)
    ops = _RawOps(mesh)
    out = []
    with torch.no_grad():
        for (path, x, s), n in zip(items, n_list):
            if n is None:
                out.append(x)
                continue
            lay = layout(s, x.ndim, mesh)
            big = padded_shape(n, lay, mesh)
            check_block(path, x, s, n if to_padded else big, mesh, what)
            # one axis: the block of the padded tensor is the torch.chunk block plus
            # zero rows at its end; several axes nest, so those dimensions move data
            nested = [d for d, a in enumerate(lay) if len(a) > 1 and big[d] != n[d]]
            for d, a in enumerate(lay):
                if a and d not in nested:
                    want = block(big[d] if to_padded else n[d], a, mesh.shape, mesh.coordinate)[1]
                    x = pad_dim(x, d, want) if to_padded else x.narrow(d, 0, want)
            if nested:
                src, dst = (n, big) if to_padded else (big, n)
                cur = tuple(() if d in nested else a for d, a in enumerate(lay))
                x = run_plan(x, src, lay, (("gather", tuple((d, lay[d]) for d in nested)),),
                             mesh, ops)
                for d in nested:
                    x = pad_dim(x, d, dst[d]) if to_padded else x.narrow(d, 0, dst[d])
                x = run_plan(x, dst, cur, tuple(("slice", d, lay[d]) for d in nested), mesh, ops)
            x = x.clone(memory_format=torch.contiguous_format)
            out.append(x if to_padded else mark_uneven(x, n, lay, mesh))
    return optree.tree_unflatten(treespec, out)


def _broadcast_tree(tree, mesh: Mesh, src: int):
    """Broadcasts a pytree of tensors from global rank ``src`` to every rank."""
    if not 0 <= src < _world.process_count():
        raise ShardingError(f"shard: src_rank={src} is not a rank of the world "
                            f"(size {_world.process_count()})")
    device = torch.device(mesh.device_type) if mesh.device_type != "cpu" else None
    meta = None
    mine = _world.process_index() == src
    if mine:
        leaves, treespec = optree.tree_flatten(tree)
        meta = (treespec, [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor)
                           else ("value", t) for t in leaves])
    treespec, info = _broadcast_pickled(meta, src, device)
    out = []
    for k, item in enumerate(info):
        if item[0] == "value":
            out.append(item[1])
            continue
        t = leaves[k].contiguous() if mine else torch.empty(item[0], dtype=item[1])
        if device is not None:
            t = t.to(device)
        out.append(_world.broadcast(t, src))
    return optree.tree_unflatten(treespec, out)


def _broadcast_pickled(obj, src: int, device) -> Any:
    """``obj`` from global rank ``src`` on every rank, pickled into a byte tensor (the
    others' ``obj`` is ignored). Not ``dist.broadcast_object_list``: torch's object
    collectives call ``Tensor.numpy()``, and torch's CPU wheel does not install numpy."""
    mine = _world.process_index() == src
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if mine else None
    n = torch.tensor([data.numel() if mine else 0], dtype=torch.int64, device=device)
    n = _world.broadcast(n, src)
    buf = data.to(device) if mine else torch.empty(int(n), dtype=torch.uint8, device=device)
    buf = _world.broadcast(buf, src)
    return obj if mine else pickle.loads(bytes(buf.cpu().tolist()))
