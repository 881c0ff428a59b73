"""Styles: what a plan rule names, and the activation layouts its hooks move between.

A style is what a plan rule names (``"colwise"``, ``"rowwise"``, ...). It says three
things about the module it is applied to:

- ``param_specs``: the spec of each of the module's own parameters over the plan's
  axis (``P("tp", None)`` for a column-parallel weight, ``P()`` for a replicated one);
- ``shard_param`` / ``unshard_param``: how a full parameter becomes this rank's block
  and back (only packed weights need more than :func:`functp.shard`'s blocks);
- ``prepare_input`` / ``prepare_output``: forward pre-/post-hooks, run only while the
  plan's ``apply`` runs, that call functp's collectives at the module's boundary;
  ``acts`` says, once per module when ``parallelize`` lays the plan out, which of them
  do anything there (a module whose style does nothing at its boundary gets no hook).

Activation layouts are DTensor placements over the plan's axis (``Shard(d)``,
``Replicate()``, ``Partial()`` from ``torch.distributed.tensor``) or a ``P``;
:func:`relayout` moves an activation between two of them. The registry maps style
names to instances; each family of styles (``_tp``, ``_ep``, ``_hf``) registers its own.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..ops._collectives import (all_gather, all_gather_invariant, all_to_all, axis_index,
                           axis_size, psum, psum_scatter, pvary)
from ..ops._context import current
from ..runtime._errors import ShardingError, leaf_text
from ..mesh._mesh import Mesh
from ..mesh._layout import axis_placement, chunk, require_divisible, uneven
from ..mapping._sharding import local_block
from ..mesh._spec import P

__all__ = ["Style", "Call", "Acts", "Layout", "relayout", "register_style", "get_style",
           "STYLES"]

Layout = Placement | P


@dataclasses.dataclass
class Call:
    """What a style's hooks see during one call of one module inside ``apply``.

    ``params`` are the module's own local blocks by short name (``"weight"``), those
    the style withholds from the module included; ``state`` carries values from
    ``prepare_input`` to ``prepare_output`` of the same call; functions passed to
    ``on_exit`` run when ``apply`` returns (or raises), to undo temporary changes.
    """
    name: str
    axis: str
    params: dict[str, torch.Tensor]
    state: dict[str, Any]
    _exits: list[Callable[[], None]]

    def on_exit(self, fn: Callable[[], None]) -> None:
        self._exits.append(fn)


@dataclasses.dataclass(frozen=True)
class Acts:
    """What a style does at one module's boundary during ``apply``, decided once by
    :meth:`Style.acts` when ``parallelize`` lays the plan out.

    ``pre`` / ``post``: called as ``prepare_input(module, args, kwargs, call)`` /
    ``prepare_output(module, args, kwargs, output, call)`` are, on every call of the
    module inside ``apply``; ``None``: nothing to do there (no hook is registered).
    ``call``: whether they read the per-call parts of their :class:`Call`
    (``params``, ``state``, ``on_exit``); ``False``: they get one ``Call`` made once
    for the module (its ``name`` and ``axis``; ``params`` and ``state`` empty).
    ``identity_over_one``: whether what they do is the identity where the axis has
    one rank (moving activations between layouts with :func:`relayout`), so that a
    replayed call (``docs/fast.md``) need not run them there. (Not a vocabulary-parallel
    embedding's hooks: over one rank they still check every id against the vocabulary,
    and raise for one outside it as the plain embedding does.)
    """
    pre: Callable | None
    post: Callable | None
    call: bool = True
    identity_over_one: bool = False


class Style:
    """Base class of parallel styles; subclass it to write your own.

    The defaults describe a module whose parameters are all replicated and whose
    inputs and outputs pass unchanged. Override what differs; register an instance
    with :func:`register_style` to use it by name in plans, or put the instance in
    the plan directly. Example (a column-parallel layer that always gathers)::

        class GatheredColwise(functp.Style):
            def param_specs(self, module, axis):
                return {"weight": P(axis, None), "bias": P(axis)}
            def prepare_output(self, module, args, kwargs, output, call):
                return functp.all_gather_invariant(output, call.axis, axis=-1, tiled=True)

        functp.register_style("gathered_colwise", GatheredColwise())
    """

    def param_specs(self, module: nn.Module, axis: str) -> dict[str, P]:
        """Specs (over ``axis``) of the module's own parameters, by short name. A
        parameter left out is replicated and counts as not covered by the plan; a
        fused weight says so with ``P(..., packed={dim: blocks})``."""
        return {n: P() for n, _ in module.named_parameters(recurse=False)}

    def withheld(self, module: nn.Module) -> tuple[str, ...]:
        """Parameters the module must not use itself during ``apply`` (the hooks get
        them in ``call.params``): a row-parallel bias is added after the reduction."""
        return ()

    def shard_param(self, name: str, full: torch.Tensor, spec: P, mesh: Mesh,
                    axis: str) -> torch.Tensor:
        """This rank's block of the full parameter ``name`` (no communication)."""
        return local_block(full, spec, mesh, name)

    def unshard_param(self, name: str, gathered: torch.Tensor, spec: P, size: int) -> torch.Tensor:
        """The canonical full parameter from the concatenated blocks."""
        return gathered

    def prepare_input(self, module: nn.Module, args: tuple, kwargs: dict,
                      call: Call) -> tuple[tuple, dict]:
        return args, kwargs

    def prepare_output(self, module: nn.Module, args: tuple, kwargs: dict, output: Any,
                       call: Call) -> Any:
        return output

    def has_hooks(self) -> bool:
        cls = type(self)
        return (cls.prepare_input is not Style.prepare_input
                or cls.prepare_output is not Style.prepare_output)

    def acts(self, module: nn.Module, axis: Any) -> Acts:
        """What this style does at ``module``'s boundary over ``axis``, asked once when
        ``parallelize`` lays the plan out (``module`` holds its full parameters, or
        meta ones). By default the hooks this class overrides, each given a fresh
        :class:`Call`; a style whose hooks do nothing on some modules, or read nothing
        of the call but its name and axis, says so here (hooks cost on every call).

        **Returns:** an :class:`Acts`.
        """
        cls = type(self)
        return Acts(self.prepare_input if cls.prepare_input is not Style.prepare_input
                    else None,
                    self.prepare_output if cls.prepare_output is not Style.prepare_output
                    else None)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _own_hooks(style: Style, cls: type) -> bool:
    """Whether ``style``'s hooks are those of ``cls``, whose ``acts`` knows them (a
    subclass that overrides one gets :meth:`Style.acts`: its hooks on every call)."""
    t = type(style)
    return t.prepare_input is cls.prepare_input and t.prepare_output is cls.prepare_output


# ---------------------------------------------------------------------------------
# activation layouts

def _layout(x: Layout | None, axis: str, where: str) -> Placement | None:
    """A ``P`` or a placement -> ``Shard(d)``, ``Replicate()`` or ``Partial()``."""
    if x is None or isinstance(x, (Shard, Replicate)):
        return x
    if isinstance(x, Partial):
        if x.reduce_op != "sum":
            raise ShardingError(f"{where}: only Partial('sum') layouts are supported, got {x}")
        return x
    if isinstance(x, P):
        return axis_placement(x, axis)
    raise ShardingError(
        f"{where}: a layout must be Shard(d), Replicate() or Partial() (from "
        f"torch.distributed.tensor) or a P(...), got {x!r}")


def relayout(x: Any, src: Placement | None, dst: Placement | None, axis: str, *,
             varying: bool = False) -> Any:
    """Moves activation ``x`` from layout ``src`` to ``dst`` over mesh ``axis``.

    Shard -> Replicate all-gathers: invariantly (backward keeps this rank's slice) by
    default, or with ``varying=True`` as a plain ``all_gather`` whose backward is a
    reduce-scatter, the cheaper choice when the result feeds a tensor-parallel
    region (whose values vary anyway). Replicate -> Shard takes this rank's slice;
    Shard -> Shard is an all-to-all; Partial -> Replicate / Shard is a psum /
    psum_scatter. Non-tensors and ``None`` layouts pass through.
    """
    if not isinstance(x, torch.Tensor) or src is None or dst is None or src == dst:
        return x
    moves = (isinstance(dst, Shard) and isinstance(src, (Shard, Replicate, Partial))
             or isinstance(dst, Replicate) and isinstance(src, (Shard, Partial)))
    if moves and axis_size(axis) == 1:
        tr = current("relayout").tracker
        if tr is None or tr.replay is not None and tr.replay.recorder is None:
            # over one rank every move is the identity, forward and backward: no
            # collective op, no autograd node (as Megatron's reductions return their
            # input at a tensor-parallel size of 1). Only the vma type would change,
            # and nothing reads it without tracking, nor inside a replayed planned
            # module (its next boundary and its result are tagged as recorded)
            return x
    if isinstance(src, Shard):
        d = src.dim % x.ndim
        if isinstance(dst, Replicate):
            gather = all_gather if varying else all_gather_invariant
            return gather(x, axis, axis=d, tiled=True)
        if isinstance(dst, Shard):
            return all_to_all(x, axis, dst.dim % x.ndim, d, tiled=True)
    elif isinstance(src, Replicate) and isinstance(dst, Shard):
        d = dst.dim % x.ndim
        n, i = axis_size(axis), axis_index(axis)
        if uneven(x.shape[d], n):
            require_divisible(
                f"an activation moved from {src!r} to {dst!r}", x.shape,
                P(*[axis if k == d else None for k in range(x.ndim)]), current("relayout").mesh,
                "(a batch or sequence length divisible by {k}), or keep it Replicate() there")
        # every rank keeps a different slice: mark the value varying first, so the
        # slices' cotangents are summed back into the replicated value's gradient
        return pvary(x, axis).narrow(d, *chunk(x.shape[d], n, i))
    elif isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return psum(x, axis)
        if isinstance(dst, Shard):
            return psum_scatter(x, axis, scatter_dimension=dst.dim % x.ndim, tiled=True)
    raise ShardingError(
        f"cannot move {leaf_text('an activation', x.shape)} from layout {src} to "
        f"{dst} over '{axis}'; supported: Shard->Replicate/Shard, Replicate->Shard, "
        f"Partial->Replicate/Shard")


# ---------------------------------------------------------------------------------
# the registry

STYLES: dict[str, Style] = {}


def register_style(name: str, style: Style, *, overwrite: bool = False) -> None:
    """Makes ``style`` usable by ``name`` in plans. Registering a taken name raises
    unless ``overwrite=True``."""
    if not isinstance(style, Style):
        raise ShardingError(
            f"register_style({name!r}, ...): expected a functp.Style instance, got "
            f"{type(style).__name__}; subclass functp.Style")
    if name in STYLES and not overwrite:
        raise ShardingError(
            f"register_style: a style named {name!r} exists ({STYLES[name]!r}); pass "
            f"overwrite=True to replace it, or pick another name")
    STYLES[name] = style


def get_style(name: str) -> Style:
    """The registered style called ``name``."""
    try:
        return STYLES[name]
    except KeyError:
        raise ShardingError(
            f"unknown parallel style {name!r}; registered styles: {sorted(STYLES)}. "
            f"Register your own with functp.register_style(name, style)") from None
