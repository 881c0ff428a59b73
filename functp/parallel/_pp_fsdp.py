"""FSDP beside a pipeline: each stage's parameters stored as this rank's block over the
``fsdp`` axis, gathered once a step, their gradients reduce-scattered once a step.

A pipeline runs each stage once per microbatch. FSDP's gather at every module call
(:class:`functp.FullyShard`) would gather each weight M times a step in the forward
and reduce-scatter its gradient M times in the backward. torchtitan's FSDP + PP
defers both to once a step (``reshard_after_forward=False``, the gradient sync on the
last microbatch only), and so does this: the step gathers the stage's blocks when it
starts (one all-gather per dtype), runs the schedule on the whole weights of its stage
(1/pp of the model, held for the step), and reduce-scatters the gradients, summed
over the microbatches and the data-parallel rows, when it ends (one per dtype). Between
steps a rank holds 1/fsdp of its stage's parameters, and so of their optimizer state.

The ranks of ``fsdp`` are data-parallel rows too: each pipes its own rows of the
batch. A parameter is split on its first dimension that the plan leaves unsplit and
that ``fsdp``'s size divides; one without such a dimension stays whole on every rank
of ``fsdp``, its gradient all-reduced as data parallelism's are.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..mesh._spec import P
from ..ops._collectives import all_gather, psum, psum_scatter

__all__ = ["split_dims", "fsdp_blocks", "cut", "only_fsdp", "gathered", "reduced",
           "around_step"]


def split_dims(local: dict, specs: dict, size: int) -> dict[str, int | None]:
    """Each parameter's dimension split over ``fsdp`` (of ``size`` ranks), or None: the
    first dimension the plan leaves unsplit whose local length ``size`` divides."""
    out = {}
    for k, t in local.items():
        spec = specs[k]
        out[k] = next((d for d in range(t.ndim) if not spec.dim_axes(d)
                       and t.shape[d] % size == 0 and t.shape[d] >= size), None)
    return out


def _with_axis(spec: P, d: int | None, axis: str) -> P:
    if d is None:
        return spec
    entries = list(spec) + [None] * (d + 1 - len(spec))
    entries[d] = axis
    return P(*entries, packed=dict(spec.packed) or None)


def fsdp_blocks(local: dict, specs: dict, axis: str, size: int, index: int
                ) -> tuple[dict, dict, dict]:
    """``(blocks, specs, dims)``: this rank's (``index`` along ``axis``) block of each
    parameter, the specs with ``axis`` on the split dimension, and :func:`split_dims`."""
    dims = split_dims(local, specs, size)
    blocks = {k: t if dims[k] is None else t.chunk(size, dims[k])[index].clone()
              for k, t in local.items()}
    return blocks, {k: _with_axis(specs[k], dims[k], axis) for k in specs}, dims


def cut(stages: Any, chunks: list) -> list:
    """A :class:`~functp.PipelineStages`'s chunks of the plan's blocks -> this rank's
    blocks over ``fsdp``; the stages' specs and split dimensions set on first use (a
    checkpoint's blocks, read later, are cut alike)."""
    mesh = stages.stage_mesh
    size, me = mesh.axis_size("fsdp"), mesh.coordinate["fsdp"]
    if not hasattr(stages, "_plan_specs"):
        stages._plan_specs = stages.specs
    out = [fsdp_blocks(c, s, "fsdp", size, me) for c, s in zip(chunks, stages._plan_specs)]
    stages.specs = [specs for _, specs, _ in out]
    stages.fsdp_dims = [dims for _, _, dims in out]
    return [blocks for blocks, _, _ in out]


def around_step(stages: Any, spec: Any, summed: Callable) -> tuple[Callable, Callable]:
    """``(whole, reduce)`` for the step of ``stages``, whose chunk specs are ``spec``
    (a list with virtual stages): ``whole(params)`` the weights the schedule runs on,
    ``reduce(grads)`` the step's gradients summed over the batch axes. Without
    ``fsdp``: the blocks themselves, and ``summed``."""
    dims = stages.fsdp_dims
    if dims is None:
        return (lambda params: params), summed
    v, size = stages.virtual_stages, stages.stage_mesh.axis_size("fsdp")
    batch = stages.batch_axes
    rows = stages.stage_mesh.axis_size(batch)

    def each(f, *trees):
        return [f(*t) for t in zip(*trees)] if v > 1 else f(*trees)
    dims = dims if v > 1 else dims[0]
    return (lambda params: each(lambda p, s, d: gathered(p, s, d, "fsdp", size),
                                params, spec, dims),
            lambda grads: each(lambda g, s, d: reduced(g, s, d, "fsdp", size, batch, 1 / rows),
                               grads, spec, dims))


def only_fsdp(dims: dict, axis: str) -> dict[str, P]:
    """Specs naming ``axis`` alone, on each parameter's split dimension (``functp.unshard``
    of the fsdp blocks back to the plan's blocks)."""
    return {k: P() if d is None else P(*([None] * d), axis) for k, d in dims.items()}


def _groups(tree: dict, specs: dict, dims: dict) -> dict:
    """The floating-point leaves by dtype, split or not, and axes: a flat buffer's
    type is its blocks' (a plan-split block and a replicated one go apart)."""
    out: dict = {}
    for k, d in dims.items():
        t = tree[k]
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            # (colwise P("tp", "fsdp") and rowwise P("fsdp", "tp") vary alike: one buffer)
            out.setdefault((t.dtype, d is not None, frozenset(specs[k].axes)), []).append(k)
    return out


def gathered(params: dict, specs: dict, dims: dict, axis: str, size: int) -> dict:
    """Inside the stage's ``shard_map``: the whole weights of the blocks split over
    ``axis``, one all-gather of a flat buffer per dtype. Typed varying over ``axis``,
    as an ``unreduced`` input is: the schedule's backward of each microbatch then
    leaves their gradients unreduced over it, for one reduce-scatter a step (the
    step's gradients are the schedule's, not this gather's transpose)."""
    out = dict(params)
    for (_, split, _), names in _groups(params, specs, dims).items():
        if not split:
            continue
        flat = torch.cat([params[k].reshape(-1) for k in names])
        every = all_gather(flat, axis, axis=0, tiled=True).view(size, -1)
        for k, piece in zip(names, every.split([params[k].numel() for k in names], dim=1)):
            d, shape = dims[k], params[k].shape
            # rank r's block is piece[r]: laid end to end along d, rank order
            out[k] = piece.reshape(size, *shape).movedim(0, d).flatten(d, d + 1)
    return out


def reduced(grads: dict, specs: dict, dims: dict, axis: str, size: int, batch: tuple,
            scale: float) -> dict:
    """Inside the stage's ``shard_map``: whole-weight gradients, unreduced over the
    data-parallel axes ``batch`` (``axis`` among them), summed over them and scaled,
    one collective per dtype and kind: a reduce-scatter over ``axis`` (then an
    all-reduce over the other ``batch`` axes, on 1/size of the bytes, HSDP's order) for
    the split blocks, an all-reduce over ``batch`` for the parameters left whole."""
    out = dict(grads)
    for (_, split, axes), names in _groups(grads, specs, dims).items():
        # (a block split over a batch axis, an expert over ep, holds its whole gradient
        # over it already)
        rest = tuple(a for a in batch if a not in axes)
        if not split:
            flat = torch.cat([grads[k].reshape(-1) for k in names])
            flat = (psum(flat, rest) if rest else flat) * scale
            for k, piece in zip(names, flat.split([grads[k].numel() for k in names])):
                out[k] = piece.view(grads[k].shape)
            continue
        # the buffer rank r keeps is every gradient's r-th block, in one order on all
        rows = [grads[k].unflatten(dims[k], (size, -1)).movedim(dims[k], 0).reshape(size, -1)
                for k in names]
        mine = psum_scatter(torch.cat(rows, dim=1).reshape(-1), axis, scatter_dimension=0,
                            tiled=True)
        if rest:
            mine = psum(mine, rest)
        mine = mine * scale
        for k, piece in zip(names, mine.split([r.shape[1] for r in rows])):
            d = dims[k]
            shape = list(grads[k].shape)
            shape[d] //= size
            out[k] = piece.view(shape)
    return out
