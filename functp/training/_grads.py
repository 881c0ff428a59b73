"""Whole-tree gradient operations over sharded blocks: the global norm, clipping by it,
and the one reduction of gradients left unreduced over microbatches.

Each works on a tree of *local blocks* and needs to know, per leaf, the mesh axes its
block is split over: inside a ``shard_map`` body with vma tracking that is the value's
vma (a gradient varies over the axes its parameter is split over); otherwise the leaf's
spec. A leaf's sum of squares is summed over the axes it is split over and counted
once along the axes it is replicated over — the two mistakes a hand-written global
norm makes. Leaves split over the same axes share one all-reduce.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any

import optree
import torch

from ..ops import _collectives
from ..ops import _context
from ..ops import _primitives as prim
from ..runtime._errors import ShardingError
from ..mesh._mesh import Mesh
from ..runtime._precision import inexact
from ..mesh._tree import leaf_specs

__all__ = ["global_norm", "clip_by_global_norm", "reduce_unreduced"]


def _split_axes(tree: Any, mesh: Mesh | None, specs: Any, what: str):
    """``(leaves, axes per leaf, frame)``; ``axes`` in mesh order, ``None`` for a
    non-tensor leaf; ``frame`` is the enclosing body's, or ``None``."""
    fr = _context.top()
    if fr is not None and specs is None:
        if fr.tracker is None:
            raise ShardingError(
                f"functp.{what} inside a shard_map body with check_vma=False cannot see "
                f"how the leaves are split: pass specs= (the body's in_specs for them)")
        leaves = optree.tree_leaves(tree)
        axes = [tuple(a for a in fr.mesh.axis_names if a in fr.tracker.get(x))
                if isinstance(x, torch.Tensor) else None for x in leaves]
        return leaves, axes, fr
    if fr is None and (mesh is None or specs is None):
        raise ShardingError(
            f"functp.{what} outside a shard_map body needs mesh= and specs= (how each "
            f"leaf's block is laid out)")
    m = fr.mesh if fr is not None else mesh
    items, _ = leaf_specs(tree, m, specs, "tree")
    axes = [tuple(a for a in m.axis_names if a in s.axes) if isinstance(x, torch.Tensor)
            else None for _, x, s in items]
    return [x for _, x, _ in items], axes, fr


def _sum_over(t: torch.Tensor, axes: tuple[str, ...], mesh: Mesh, fr, op: str) -> torch.Tensor:
    if not axes:
        return t
    if fr is not None:
        return (_collectives.psum if op == "sum" else _collectives.pmax)(t, axes)
    return prim.all_reduce(t, mesh.axis_group(axes), op)


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    # low-precision gradients are summed in float32, as clip_grad_norm_ users expect
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _stage_axes(tree: Any, pipeline: Any) -> tuple[list, list, list]:
    """A pipeline stage's gradients as ``(leaves, axes per leaf, the axes' groups)``
    over the whole mesh: each leaf's split axes within its stage, and ``pp`` (every
    stage holds its own parameters); a tied head left out on the last stage (it holds
    the same summed gradient as the first stage's embedding: counted once). The groups
    are the same on every stage, in one order (a stage's leaves meet other splits
    first, or not at all: each group's sum is a collective every stage joins)."""
    if _context.top() is not None:
        raise ShardingError("functp.global_norm(pipeline=...) takes the step's gradients "
                            "outside a shard_map body (where apply.pipeline's step returns them)")
    chunks = tree if pipeline.virtual_stages > 1 else [tree]
    head = pipeline._tied_holders()[1]          # (rank, chunk) holding the tied head
    leaves, axes = [], []
    for j, chunk in enumerate(chunks):
        spec = pipeline.specs[j]
        if pipeline.tied is not None and (pipeline.stage, j) == head:
            chunk = {k: t for k, t in chunk.items() if k != pipeline.tied[1]}
            spec = {k: s for k, s in spec.items() if k != pipeline.tied[1]}
        if pipeline.stage_mesh is None:
            items = [(None, x, None) for x in optree.tree_leaves(chunk)]
        else:
            items, _ = leaf_specs(chunk, pipeline.stage_mesh, spec, "tree")
        for _, x, s in items:
            split = s.axes if s is not None else ()
            leaves.append(x)
            axes.append(tuple(a for a in pipeline.mesh.axis_names if a in split or a == "pp")
                        if isinstance(x, torch.Tensor) else None)
    mesh, tp = pipeline.mesh, pipeline.axis
    # (the axes a stage's blocks may be split over: the plan's tp, fsdp and a MoE's ep
    # beside pp; a group for each combination, in one order on every stage)
    can = [a for a in (tp, "fsdp", "ep") if a in mesh.axis_names and mesh.axis_size(a) > 1]
    order = [tuple(a for a in mesh.axis_names if a == "pp" or a in combo)
             for n in range(len(can) + 1) for combo in itertools.combinations(can, n)]
    for x, a in zip(leaves, axes):
        if a is not None and a not in order:      # (parallelize refuses such a split)
            raise ShardingError(f"functp.global_norm(pipeline=...): a gradient of shape "
                                f"{tuple(x.shape)} is split over {list(a)}, not {order}")
    return leaves, axes, order


def global_norm(tree: Any, mesh: Mesh | None = None, specs: Any = None, *,
                norm_type: float = 2.0, pipeline: Any = None) -> torch.Tensor:
    """The norm of the *global* tensors whose local blocks ``tree`` holds.

    **Arguments:** ``tree`` – a pytree of local blocks (e.g. gradients); ``mesh`` and
    ``specs`` – their layout (a spec pytree prefix, as for :func:`shard`). Inside a
    ``shard_map`` body both may be omitted when vma tracking is on: each leaf's vma
    says which axes its block is split over. ``norm_type`` – 2 (default), any p > 0,
    or ``inf``. ``pipeline`` – instead of ``mesh`` and ``specs``, the ``apply`` that
    ``parallelize`` returns on a mesh with a ``pp`` axis, for the gradients its step
    returns (this rank's stage): the norm is then the whole model's, every stage's
    gradients in it and a tied embedding's once.

    **Returns:** a 0-d tensor, the same on every rank: what
    ``torch.nn.utils.clip_grad_norm_`` computes on the unsharded tensors. Example::

        norm = functp.global_norm(grads, mesh, specs)    # e.g. specs = {"w": P("tp")}
        norm = functp.global_norm(grads, pipeline=apply)  # a pipelined step's gradients
    """
    order = None
    if pipeline is not None:
        (leaves, axes, order), fr, m = _stage_axes(tree, pipeline), None, pipeline.mesh
    else:
        if getattr(mesh, "_stage_of", None) is not None and _context.top() is None:
            raise ShardingError(
                f"functp.global_norm: {mesh} is a pipeline stage's mesh (apply.stage_mesh): "
                f"over it the norm is that stage's gradients' alone, and each stage would "
                f"clip by its own; pass pipeline=apply (global_norm(grads, pipeline=apply), "
                f"clip_by_global_norm(grads, max_norm, pipeline=apply)) for the whole "
                f"model's norm")
        leaves, axes, fr = _split_axes(tree, mesh, specs, "global_norm")
        m = fr.mesh if fr is not None else mesh
    p = float(norm_type)
    if not p > 0:
        raise ShardingError(f"functp.global_norm: norm_type must be > 0 or inf, got {norm_type}")
    groups: dict[tuple[str, ...], list[torch.Tensor]] = {}
    dtype = torch.float32
    for x, a in zip(leaves, axes):
        if a is None or x.numel() == 0:
            continue
        d = _stat_dtype(x)
        dtype = torch.promote_types(dtype, d)
        v = x.detach() if fr is None else x
        v = v.to(d).abs()
        groups.setdefault(a, []).append(v.amax() if math.isinf(p) else (v ** p).sum())
    if order is not None:
        groups = {a: groups.get(a, [torch.zeros((), dtype=dtype)]) for a in order}
    if not groups:
        return torch.zeros((), dtype=dtype)
    op = "max" if math.isinf(p) else "sum"
    with torch.no_grad() if fr is None else contextlib.nullcontext():
        parts = []
        for a, stats in groups.items():
            s = torch.stack([t.to(dtype) for t in stats])
            parts.append(_sum_over(s.amax() if op == "max" else s.sum(), a, m, fr, op))
        total = torch.stack(parts)
        return total.amax() if op == "max" else total.sum() ** (1.0 / p)


def clip_by_global_norm(grads: Any, max_norm: float, mesh: Mesh | None = None,
                        specs: Any = None, *, norm_type: float = 2.0,
                        pipeline: Any = None) -> tuple[Any, torch.Tensor]:
    """Scales ``grads`` so that their global norm is at most ``max_norm``.

    **Arguments:** as :func:`global_norm`, plus ``max_norm``.

    **Returns:** ``(clipped grads, the global norm before clipping)``. The scale is
    ``torch.nn.utils.clip_grad_norm_``'s: ``min(1, max_norm / (norm + 1e-6))``, the
    same on every rank (of every pipeline stage, with ``pipeline=``). Example::

        grads, norm = functp.clip_by_global_norm(grads, 1.0, mesh, specs)
    """
    norm = global_norm(grads, mesh, specs, norm_type=norm_type, pipeline=pipeline)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return optree.tree_map(lambda g: g * coef.to(g.dtype) if isinstance(g, torch.Tensor)
                           and g.is_floating_point() else g, grads), norm


def reduce_unreduced(tree: Any, mesh: Mesh, specs: Any, axes: Any) -> Any:
    """Sums over ``axes`` the gradients a ``shard_map(..., unreduced=axes)`` left as
    each rank's own contribution: one all-reduce per set of axes and dtype.

    **Arguments:** ``tree`` – local blocks (e.g. gradients summed over microbatches);
    ``mesh``, ``specs`` – their layout; ``axes`` – the unreduced axes (a name or a
    tuple). A leaf is summed over the axes of ``axes`` its spec does not split it over
    (a block split over an axis holds its own part, not a contribution).

    **Returns:** the reduced tree, the same structure. Outside a body, or inside one
    over the same mesh. Example (k microbatches, one gradient all-reduce)::

        step = functp.shard_map(loss, mesh, in_specs=(specs, P("dp")), out_specs=P(),
                                unreduced="dp")
        g = sum_trees(torch.func.grad(step)(params, mb) for mb in microbatches)
        g = functp.reduce_unreduced(g, mesh, specs, "dp")
    """
    names = {axes} if isinstance(axes, str) else set(axes)
    fr = _context.top()
    m = fr.mesh if fr is not None else mesh
    unknown = sorted(names - set(m.axis_names))
    if unknown:
        raise ShardingError(f"functp.reduce_unreduced: axes {unknown} are not axes of {m}")
    items, treespec = leaf_specs(tree, m, specs, "tree")
    out = [x for _, x, _ in items]
    buckets: dict[tuple, list[int]] = {}
    for i, (_, x, s) in enumerate(items):
        if isinstance(x, torch.Tensor) and inexact(x):
            red = tuple(a for a in m.axis_names if a in names and a not in s.axes)
            if red:
                buckets.setdefault((red, x.dtype), []).append(i)
    with torch.no_grad() if fr is None else contextlib.nullcontext():
        for (red, _), idx in buckets.items():
            flat = torch.cat([out[i].reshape(-1) for i in idx])
            flat = _sum_over(flat, red, m, fr, "sum")
            for i, piece in zip(idx, flat.split([out[i].numel() for i in idx])):
                out[i] = piece.view(out[i].shape)
    return optree.tree_unflatten(treespec, out)
