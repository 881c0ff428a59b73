"""functp's differentiable collectives as registered torch operators (``functp::*``).

One banner section per collective holds all of its rules, found together:

- its **forward**: the raw kernel (``CompositeExplicitAutograd``, over
  ``_primitives``) and a fake kernel (shapes only), so ``torch.compile`` traces it
  into one graph;
- its **transpose**: ``backward`` (and ``jvp``), which call these ops again, so every
  nesting depth (grad of grad, jvp of grad, vmap of grad, jacrev) is differentiated
  by the same rules;
- its **vma rule** (a :class:`VmaRule`): what its input must vary over and what its
  result varies over; ``_collectives.py`` (the public functions) applies it;
- its **batching rule** (``register_vmap``): torch's generated one would skip the
  communication.

``_torch_op._define`` registers each (and says why its Autograd kernel is cheap under
``torch.func``).

The forward's docstring draws forward and backward in the types of
docs/architecture.md ("vma types and the autodiff contract"): ``V[a]`` is a value
varying over the mesh axes ``a`` (each rank along them holds its own), ``I[a]`` one
invariant over them (every rank holds the same, and it counts once).

``group`` arguments are ``AxisGroup.key`` strings (an op schema has no place for a
Python object); ``_mesh.group_of`` resolves them.

Two transposition regimes exist (the same section). With ``sum_mode`` a cotangent is
each rank's contribution and must be summed (psumᵀ = psum); with vma tracking, the
cotangent of an invariant value is already the full cotangent (psumᵀ = pvary).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..runtime import _compile
from . import _primitives as prim
from ..mesh._mesh import group_of
from ..runtime._torch_compat import (forward_ad as _fwd_ad, get_unwrapped as _unwrap_one,
                            layer_stack_depth as _stack_depth, peek_interpreter_stack as _peek)
from ._torch_op import _define

__all__ = ["psum", "pextremum", "pvary", "all_gather", "psum_scatter", "all_to_all",
           "ppermute", "take_block", "scale_grad", "VmaRule"]


def _differentiated(ct: torch.Tensor) -> bool:
    """Can something still differentiate the backward that computes with ``ct``?
    Tape autograd with ``create_graph``, or a torch.func level above another (grad of
    grad, jvp of grad) or above tensors that need gradients. A single
    ``torch.func.grad`` or a plain ``backward()`` never looks at it."""
    if not torch.is_grad_enabled() and _fwd_ad._current_level < 0:
        return False
    return not (_peek() is not None and _stack_depth() == 1
                and not _unwrap_one(ct).requires_grad)


def _vary(ct: torch.Tensor, group: str) -> torch.Tensor:
    """pvary of a cotangent inside a vma-mode backward (psumᵀ): the identity, whose
    own transpose is a psum; only where the backward may be differentiated. (Every
    psum's backward runs it: ``_differentiated`` is written out, to save a call.)"""
    if not torch.is_grad_enabled() and _fwd_ad._current_level < 0:
        return ct
    if _peek() is not None and _stack_depth() == 1 and not _unwrap_one(ct).requires_grad:
        return ct
    return pvary([ct], group, False)[0]


def _bdim0(x: torch.Tensor, bdim: int | None) -> torch.Tensor:
    return x if bdim in (None, 0) else x.movedim(bdim, 0)


def _none(n: int) -> tuple:
    return (None,) * n


class VmaRule(NamedTuple):
    """A collective's vma rule over the mesh axes ``a`` it runs on (the table of
    docs/architecture.md, "vma types and the autodiff contract").

    ``needs_varying``: its input must vary over ``a``; a value invariant over some of
    them is refused (a sum of identical copies is ``|a|`` times the value, which is
    seldom meant). Otherwise such an input is first ``pvary``'d over the missing axes,
    as any op's input is (the union rule). ``reduces``: the result is invariant over
    ``a`` (``vma(x) − a``); otherwise it varies over them (``vma(x) ∪ a``).
    """
    needs_varying: bool
    reduces: bool

    def result(self, vma: frozenset, axes: frozenset) -> frozenset:
        """The result's vma, for an input varying over ``vma`` (``axes`` included)."""
        return vma - axes if self.reduces else vma | axes


# -- psum / pmean ----------------------------------------------------------------------

def _psum_raw(x, group, mean, sum_mode):
    """``psum`` (and ``pmean``: ``mean``) over the axes ``a`` of ``group``::

        forward    x: V[a]   ->  Σₐ x: I[a]                pmean: Σₐ x / |a|
        backward   ct: I[a]  ->  pvary(ct): V[a]           pmean: pvary(ct) / |a|
        sum mode   ct: each rank's share  ->  psum(ct)     pmean: psum(ct) / |a|

    vma: ``vma(x) − a``; psum refuses an ``x`` invariant over ``a``, pmean pvarys
    it (the mean of copies is the copy). Batching: elementwise, the batch dimension
    stays where it is.
    """
    g = group_of(group)
    if mean:          # (the division reads the sum: waited on at once)
        return prim.all_reduce(x, g, "sum") / g.size
    return prim.all_reduce(x, g, "sum", True)


def _psum_ctx(ctx, args, output):
    _, ctx.group, ctx.mean, ctx.sum_mode = args


def _psum_bwd(ctx, ct):
    if ctx.sum_mode:
        return psum(ct, ctx.group, ctx.mean, True), *_none(3)
    ct = _vary(ct, ctx.group)
    return (ct / group_of(ctx.group).size if ctx.mean else ct), *_none(3)


PSUM_VMA = VmaRule(needs_varying=True, reduces=True)
PMEAN_VMA = VmaRule(needs_varying=False, reduces=True)

psum = _define(
    "psum(Tensor x, str group, bool mean, bool sum_mode) -> Tensor", _psum_raw,
    lambda x, group, mean, sum_mode: torch.empty_like(x),
    setup_context=_psum_ctx, backward=_psum_bwd,
    jvp=lambda ctx, t, *_: psum(t, ctx.group, ctx.mean, ctx.sum_mode),
    vmap=lambda info, dims, x, *a: (psum(x, *a), dims[0]))


# -- pmax / pmin -------------------------------------------------------------------------

def _pext_raw(x, group, op, sum_mode):
    """``pmax`` / ``pmin`` (``op``) over the axes ``a`` of ``group``::

        forward    x: V[a]   ->  y = maxₐ x: I[a]
        backward   ct: I[a]  ->  pvary(ct) · [x == y] / #ties: V[a]
        sum mode   ct: each rank's share  ->  psum(ct) · [x == y] / #ties
        jvp        ẋ         ->  Σₐ ẋ · [x == y] / #ties

    The gradient goes to the ranks holding the extremum, split evenly among ties
    (JAX has no rule here). vma: ``vma(x) − a`` (an invariant ``x`` is pvary'd: the
    max of copies is the copy). Batching: elementwise.
    """
    return prim.all_reduce(x, group_of(group), op, True)


def _pext_ctx(ctx, args, output):
    x, ctx.group, ctx.op, ctx.sum_mode = args
    ctx.save_for_backward(x, output)
    ctx.save_for_forward(x, output)


def _pext_bwd(ctx, ct):
    # the gradient goes to the ranks holding the extremum, split evenly among ties
    x, out = ctx.saved_tensors
    mask = (x == out).to(ct.dtype)
    if ctx.sum_mode:      # one collective for both the cotangent sum and the tie count
        both = psum(torch.stack([ct, mask]), ctx.group, False, True)
        return both[0] * mask / both[1], *_none(3)
    count = psum(mask, ctx.group, False, True)
    return _vary(ct, ctx.group) * mask / count, *_none(3)


def _pext_jvp(ctx, t, *_):
    x, out = ctx.saved_tensors
    mask = (x == out).to(t.dtype)
    both = psum(torch.stack([t * mask, mask]), ctx.group, False, True)
    return both[0] / both[1]


PEXTREMUM_VMA = VmaRule(needs_varying=False, reduces=True)

pextremum = _define(
    "pextremum(Tensor x, str group, str op, bool sum_mode) -> Tensor", _pext_raw,
    lambda x, *_: torch.empty_like(x),
    setup_context=_pext_ctx, backward=_pext_bwd, jvp=_pext_jvp,
    vmap=lambda info, dims, x, *a: (pextremum(x, *a), dims[0]))


# -- pvary ---------------------------------------------------------------------------------

def _pvary_raw(xs, group, sum_mode):
    """``pvary`` (``pcast(..., to="varying")``) of each of ``xs`` over the axes ``a``::

        forward    x: I[a]   ->  x: V[a]          (the identity)
        backward   ct: V[a]  ->  psum(ct): I[a]   (one all-reduce per dtype for all xs)

    The same in both modes; with sum rules (the shard_map boundary's pvary of a
    replicated input), the summed gradient counts once when it is differentiated
    again. vma: ``vma(x) ∪ a``: ``_vma.Tracker.pvary`` makes these (the union rule's
    implicit pvary) and tags them. Batching: each x keeps its batch dimension.
    """
    return [x.view_as(x) for x in xs]


def _pvary_ctx(ctx, args, output):
    # (the inputs, not saved for backward: only their shapes are read, for the zeros
    # of an unused output; a list kept as it is costs no call on every step)
    ctx.xs, ctx.group, ctx.sum_mode = args
    ctx.set_materialize_grads(False)


def _pvary_bwd(ctx, *cts):
    # the cotangents of every differentiated input, summed in one all-reduce per
    # dtype (a gradient bucket, as DDP does). An output this rank did not use (an
    # expert no token reached here) adds zeros, so that the bucket holds the same
    # inputs on every rank (DDP's find_unused_parameters); a rank that used none of
    # them has nothing to send, and no peer that shares its program or data does.
    needs = ctx.needs_input_grad[-len(cts):]
    want = [i for i, c in enumerate(cts) if c is not None and needs[i]]
    # (not ``None in cts``: that compares each tensor with None through torch's
    # __eq__, ~14 us a tensor, 1 ms for a 75-parameter bucket)
    if want and any([c is None for c in cts]):
        cts = [c if c is not None or not needs[i] else torch.zeros_like(ctx.xs[i])
               for i, c in enumerate(cts)]
        want = [i for i, c in enumerate(cts) if c is not None and needs[i]]
    grads: list[Any] = [None] * len(cts)
    summed = bucketed_psum([cts[i] for i in want], ctx.group, ctx.sum_mode)
    if ctx.sum_mode and want and _differentiated(cts[want[0]]):
        # sum rules (the boundary's pvary, which only they make): the summed gradient
        # of a replicated input is held by every rank but counts once, so the
        # cotangent it gets when this backward is differentiated is divided among
        # the copies, as an out_spec P() output's is (vma rules get this from psumᵀ)
        n = group_of(ctx.group).size
        summed = [scale_grad(g, 1.0 / n) for g in summed]
    for i, gi in zip(want, summed):
        grads[i] = gi
    return grads, None, None


def _pvary_vmap(info, dims, xs, group, sum_mode):
    return pvary(xs, group, sum_mode), list(dims[0])


pvary = _define(
    "pvary(Tensor[] xs, str group, bool sum_mode) -> Tensor[]", _pvary_raw,
    lambda xs, group, sum_mode: [torch.empty_like(x) for x in xs],
    setup_context=_pvary_ctx, backward=_pvary_bwd,
    jvp=lambda ctx, ts, *_: tuple(t.view_as(t) for t in ts), vmap=_pvary_vmap)


# -- psum of a gradient bucket ----------------------------------------------------------
# psum(cat(xs)) as one op: the kernel owns the concatenated buffer, so it reduces it
# in place, as DDP does (an out-of-place all-reduce copies the bucket first, and
# holds two of them at the backward's peak), whatever differentiates it.

def _bucket_raw(xs, group, sum_mode):
    """``psum(cat(xs))`` over the axes ``a``, flat, reduced in place (a gradient bucket):
    forward ``xs: V[a] -> Σₐ cat(xs): I[a]``, backward as ``psum``'s, split back."""
    flat = torch.cat([x.reshape(-1) for x in xs])
    if _compile.tracing():   # (functionalization has no rule for all_reduce_;
        return prim.all_reduce(flat, group_of(group), "sum")   # the compiler plans buffers)
    return prim.all_reduce_inplace(flat, group_of(group))


def _bucket_ctx(ctx, args, output):
    xs, ctx.group, ctx.sum_mode = args
    ctx.shapes = [x.shape for x in xs]
    ctx.dtype, ctx.device = xs[0].dtype, xs[0].device


def _bucket_bwd(ctx, ct):
    ct = psum(ct, ctx.group, False, True) if ctx.sum_mode else _vary(ct, ctx.group)
    return [p.view(s) for p, s in zip(ct.split([s.numel() for s in ctx.shapes]), ctx.shapes)], \
        None, None


def _bucket_jvp(ctx, ts):
    ts = [t if t is not None else torch.zeros(s, dtype=ctx.dtype, device=ctx.device)
          for t, s in zip(ts, ctx.shapes)]
    return bucket_psum(ts, ctx.group, ctx.sum_mode)


def _bucket_vmap(info, dims, xs, group, sum_mode):
    # every block batched along dim 0, flattened per sample: one [B, n] all-reduce
    n = info.batch_size
    flat = [(_bdim0(x, d) if d is not None else x.expand(n, *x.shape)).reshape(n, -1)
            for x, d in zip(xs, dims[0])]
    return psum(torch.cat(flat, 1), group, False, sum_mode), 0


bucket_psum = _define(
    "bucket_psum(Tensor[] xs, str group, bool sum_mode) -> Tensor", _bucket_raw,
    lambda xs, group, sum_mode: xs[0].new_empty(sum(x.numel() for x in xs)),
    setup_context=_bucket_ctx, backward=_bucket_bwd, jvp=_bucket_jvp, vmap=_bucket_vmap)


def bucketed_psum(ts, group: str, sum_mode: bool) -> list[torch.Tensor]:
    """``psum`` of each tensor, with one all-reduce per dtype (a gradient bucket)."""
    out: list[Any] = [None] * len(ts)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(ts):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        if len(idx) == 1:
            out[idx[0]] = psum(ts[idx[0]], group, False, sum_mode)
            continue
        flat = bucket_psum([ts[i] for i in idx], group, sum_mode)
        for i, piece in zip(idx, flat.split([ts[i].numel() for i in idx])):
            out[i] = piece.view(ts[i].shape)
    return out


# -- all_gather / psum_scatter ---------------------------------------------------------------

def _gathered_shape(x, g, dim, tiled):
    shape = list(x.shape)
    if tiled:
        shape[dim] *= g.size
    else:
        shape.insert(dim, g.size)
    return shape


def _ag_raw(x, group, dim, tiled, invariant_T):
    """``all_gather`` and ``all_gather_invariant`` (``invariant_T``) over the axes
    ``a``, rank ``i`` holding ``xᵢ``, the blocks stacked at ``dim`` (``tiled``:
    concatenated along it)::

        all_gather            xᵢ: V[a]   ->  [x₀ … xₙ₋₁]: V[a]
          backward            ct: V[a]   ->  psum_scatter(ct): V[a]
        all_gather_invariant  xᵢ: V[a]   ->  [x₀ … xₙ₋₁]: I[a]
          backward            ct: I[a]   ->  ctᵢ: V[a]   (this rank's block; no communication)
        sum mode              both: backward psum_scatter(ct)

    vma: ``vma(x) ∪ a`` for all_gather, ``vma(x) − a`` for all_gather_invariant (an
    ``x`` invariant over ``a`` is pvary'd first). Batching: the batch dimension goes
    first and ``dim`` moves up by one.
    """
    return prim.all_gather(x if tiled else x.unsqueeze(dim), group_of(group), dim, True)


def _ag_ctx(ctx, args, output):
    _, ctx.group, ctx.dim, ctx.tiled, ctx.invariant_T = args
    d = args[0].__dict__                                # a shard_map input (_overlap)?
    ctx.sink = d["_functp_sink"] if "_functp_sink" in d else None


def _ag_bwd(ctx, ct):
    g, dim = group_of(ctx.group), ctx.dim
    if ctx.invariant_T:     # all_gather_invariant in vma mode: keep this rank's slice
        ct = _vary(ct, ctx.group)
        b = ct.shape[dim] // g.size
        gx = ct.narrow(dim, g.index * b, b) if ctx.tiled else ct.select(dim, g.index)
    elif ctx.sink is not None and ctx.sink[0].defer(
            ctx.sink[1], ct, lambda: psum_scatter(ct, ctx.group, dim, ctx.tiled)):
        return None, *_none(4)      # in flight: added to the input's gradient at its entry
    else:
        gx = psum_scatter(ct, ctx.group, dim, ctx.tiled)
    return gx, *_none(4)


ALL_GATHER_VMA = VmaRule(needs_varying=False, reduces=False)
ALL_GATHER_INVARIANT_VMA = VmaRule(needs_varying=False, reduces=True)

all_gather = _define(
    "all_gather(Tensor x, str group, int dim, bool tiled, bool invariant_T) -> Tensor", _ag_raw,
    lambda x, group, dim, tiled, inv: x.new_empty(_gathered_shape(x, group_of(group), dim, tiled)),
    setup_context=_ag_ctx, backward=_ag_bwd,
    jvp=lambda ctx, t, *_: all_gather(t, ctx.group, ctx.dim, ctx.tiled, ctx.invariant_T),
    vmap=lambda info, dims, x, group, dim, tiled, inv:
        (all_gather(_bdim0(x, dims[0]), group, dim + 1, tiled, inv), 0))


def _scattered_shape(x, g, dim, tiled):
    shape = list(x.shape)
    if tiled:
        shape[dim] //= g.size
    else:
        del shape[dim]
    return shape


def _rs_raw(x, group, dim, tiled):
    """``psum_scatter`` over the axes ``a``: rank ``i`` keeps block ``i`` of ``dim``::

        forward    x: V[a]   ->  (Σₐ x)ᵢ: V[a]        (tiled: the dim shrinks; else it goes)
        backward   ct: V[a]  ->  all_gather(ct): V[a]  (both modes)

    vma: ``vma(x)`` (which holds ``a``); an ``x`` invariant over ``a`` is refused, as
    by psum. Batching: the batch dimension goes first, ``dim`` moves up by one.
    """
    # (lazy where the result is the primitive's own: a squeezed view is not marked)
    y = prim.reduce_scatter(x, group_of(group), dim, tiled)
    return y if tiled else y.squeeze(dim)


def _rs_ctx(ctx, args, output):
    _, ctx.group, ctx.dim, ctx.tiled = args


PSUM_SCATTER_VMA = VmaRule(needs_varying=True, reduces=False)

psum_scatter = _define(
    "psum_scatter(Tensor x, str group, int dim, bool tiled) -> Tensor", _rs_raw,
    lambda x, group, dim, tiled: x.new_empty(_scattered_shape(x, group_of(group), dim, tiled)),
    setup_context=_rs_ctx,
    backward=lambda ctx, ct: (all_gather(ct, ctx.group, ctx.dim, ctx.tiled, False), *_none(3)),
    jvp=lambda ctx, t, *_: psum_scatter(t, ctx.group, ctx.dim, ctx.tiled),
    vmap=lambda info, dims, x, group, dim, tiled:
        (psum_scatter(_bdim0(x, dims[0]), group, dim + 1, tiled), 0))


# -- all_to_all --------------------------------------------------------------------------------

def _a2a_raw(x, group, split, concat, tiled):
    """``all_to_all`` over the axes ``a``: rank ``i`` splits ``split`` into blocks
    ``bᵢ₀ … bᵢₙ₋₁`` and sends ``bᵢⱼ`` to rank ``j``, which lays them along ``concat``::

        forward    xᵢ = [bᵢ₀ … bᵢₙ₋₁]: V[a]  ->  yⱼ = [b₀ⱼ … bₙ₋₁ⱼ]: V[a]
        backward   ct: V[a]  ->  all_to_all(ct, concat, split): V[a]  (both modes)

    vma: ``vma(x) ∪ a`` (an ``x`` invariant over ``a`` is pvary'd first). Batching:
    the batch dimension goes first, both dimensions move up by one.
    """
    g = group_of(group)
    if tiled:
        return prim.all_to_all(x, g, split, concat)
    # untiled: dim `split` (size n) is consumed, a new dim of size n (the source rank)
    # appears at `concat`
    return prim.all_to_all(x, g, split, split).movedim(split, concat)


def _a2a_fake(x, group, split, concat, tiled):
    n = group_of(group).size
    shape = list(x.shape)
    if tiled:
        shape[split] //= n
        shape[concat] *= n
    else:
        del shape[split]
        shape.insert(concat, n)
    return x.new_empty(shape)


def _a2a_ctx(ctx, args, output):
    _, ctx.group, ctx.split, ctx.concat, ctx.tiled = args


ALL_TO_ALL_VMA = VmaRule(needs_varying=False, reduces=False)

all_to_all = _define(
    "all_to_all(Tensor x, str group, int split, int concat, bool tiled) -> Tensor",
    _a2a_raw, _a2a_fake, setup_context=_a2a_ctx,
    backward=lambda ctx, ct: (all_to_all(ct, ctx.group, ctx.concat, ctx.split, ctx.tiled),
                              *_none(4)),
    jvp=lambda ctx, t, *_: all_to_all(t, ctx.group, ctx.split, ctx.concat, ctx.tiled),
    vmap=lambda info, dims, x, group, split, concat, tiled:
        (all_to_all(_bdim0(x, dims[0]), group, split + 1, concat + 1, tiled), 0))


# -- ppermute ------------------------------------------------------------------------------------

def _pairs(perm) -> tuple[tuple[int, int], ...]:
    """``perm`` travels flat (``[s0, d0, s1, d1, ...]``): schemas have no int pairs."""
    return tuple(zip(perm[0::2], perm[1::2]))


def _pp_raw(x, group, perm):
    """``ppermute`` over the axes ``a`` along ``(s, d)`` pairs (``perm``, flat)::

        forward    xₛ: V[a]  ->  y_d = xₛ for each pair, 0 where no s sends: V[a]
        backward   ct: V[a]  ->  ppermute(ct, the (d, s) pairs): V[a]  (both modes)

    vma: ``vma(x) ∪ a`` (an ``x`` invariant over ``a`` is pvary'd first). Batching:
    elementwise.
    """
    return prim.permute(x, group_of(group), _pairs(perm), True)


def _pp_ctx(ctx, args, output):
    _, ctx.group, ctx.perm = args


def _pp_bwd(ctx, ct):
    inverse = [i for s, d in _pairs(ctx.perm) for i in (d, s)]
    return ppermute(ct, ctx.group, inverse), None, None


PPERMUTE_VMA = VmaRule(needs_varying=False, reduces=False)

ppermute = _define(
    "ppermute(Tensor x, str group, int[] perm) -> Tensor", _pp_raw,
    lambda x, group, perm: torch.empty_like(x),
    setup_context=_pp_ctx, backward=_pp_bwd,
    jvp=lambda ctx, t, *_: ppermute(t, ctx.group, ctx.perm),
    vmap=lambda info, dims, x, group, perm: (ppermute(x, group, perm), dims[0]))


# -- axis_index / axis_size -----------------------------------------------------------------
# No registered op: ``axis_index(a)`` is this rank's coordinate along ``a`` and
# ``axis_size(a)`` the product of the sizes, Python ints read from the AxisGroup::
#
#     forward    ->  i (a Python int, known on the host)
#     backward   none: an int has no cotangent
#
# vma: untracked (a Python int); a tensor made from it is invariant until it meets a
# varying value. Batching: the same int for every batch element.


# -- take_block: entering a nested shard_map -------------------------------------------------------

def _tb_raw(x, dims, groups):
    """This rank's block of a value whole along ``groups[i]``'s axes at ``dims[i]``
    (entering a nested shard_map): forward ``x -> xᵢ`` (no communication), backward
    ``ctᵢ -> all_gather(ct)``, the blocks' cotangents gathered back to whole."""
    for d, key in zip(dims, groups):
        g = group_of(key)
        b = x.shape[d] // g.size
        x = x.narrow(d, g.index * b, b)
    return x.clone() if not dims else x


def _tb_fake(x, dims, groups):
    shape = list(x.shape)
    for d, key in zip(dims, groups):
        shape[d] //= group_of(key).size
    return x.new_empty(shape)


def _tb_ctx(ctx, args, output):
    _, ctx.dims, ctx.groups = args


def _tb_bwd(ctx, ct):
    # the blocks' cotangents gathered back to whole
    for d, key in reversed(list(zip(ctx.dims, ctx.groups))):
        ct = all_gather(ct, key, d, True, False)
    return ct, None, None


take_block = _define(
    "take_block(Tensor x, int[] dims, str[] groups) -> Tensor", _tb_raw, _tb_fake,
    setup_context=_tb_ctx, backward=_tb_bwd,
    jvp=lambda ctx, t, *_: take_block(t, ctx.dims, ctx.groups),
    vmap=lambda info, bdims, x, dims, groups:
        (take_block(_bdim0(x, bdims[0]), [d + 1 for d in dims], groups), 0))


# -- scale_grad: identity forward, scaled cotangent ------------------------------------------------

def _sg_ctx(ctx, args, output):
    ctx.factor = args[1]


def _sg_raw(x, factor):
    """The identity forward; backward ``ct -> ct · factor`` (the sum rules' count-once
    of a replicated value's cotangent)."""
    return x.view_as(x)


scale_grad = _define(
    "scale_grad(Tensor x, float factor) -> Tensor", _sg_raw, lambda x, factor: torch.empty_like(x),
    setup_context=_sg_ctx, backward=lambda ctx, ct: (ct * ctx.factor, None),
    jvp=lambda ctx, t, _: t.view_as(t),
    vmap=lambda info, dims, x, factor: (scale_grad(x, factor), dims[0]))


# -- pvary in place -----------------------------------------------------------------------------

class PvaryInplace(torch.autograd.Function):
    """pvary of a tensor about to be mutated in place by a more varying value: marks
    it dirty, so its later uses (and its views) see the new autograd history.

    A plain ``autograd.Function`` (an op cannot mutate through ``mark_dirty``): this
    path is rare — an in-place op mixing vma — so functorch's generic handling of
    Functions is fast enough.
    """

    @staticmethod
    def forward(x, group: str):
        return x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_dirty(inputs[0])
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, ct):
        return psum(ct, ctx.group, False, False), None

    @staticmethod
    def jvp(ctx, t, _):
        return t

    @staticmethod
    def vmap(info, in_dims, x, group):
        return PvaryInplace.apply(x, group), in_dims[0]
