"""Parallel styles: how one module's parameters are split over a mesh axis, and which
collectives its inputs and outputs need inside a ``shard_map`` body.

A style is what a plan rule names (``"colwise"``, ``"rowwise"``, ...). It says three
things about the module it is applied to:

- ``param_specs``: the spec of each of the module's own parameters over the plan's
  axis (``P("tp", None)`` for a column-parallel weight, ``P()`` for a replicated one);
- ``shard_param`` / ``unshard_param``: how a full parameter becomes this rank's block
  and back (only packed weights need more than :func:`functp.shard`'s blocks);
- ``prepare_input`` / ``prepare_output``: forward pre-/post-hooks, run only while the
  plan's ``apply`` runs, that call functp's collectives at the module's boundary.

Activation layouts are DTensor placements over the plan's axis (``Shard(d)``,
``Replicate()``, ``Partial()`` from ``torch.distributed.tensor``) or a ``P``. Because
functp tracks vma, a replicated parameter or activation that meets a sharded one is
``pvary``'d implicitly: Megatron's "f" operator (identity forward, all-reduce
backward) and the gradient all-reduce of replicated norm weights need no hook.
"""
from __future__ import annotations

import fnmatch
import math
import threading
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..ops._collectives import (all_gather, all_gather_invariant, all_to_all, axis_index,
                           axis_size, psum, pvary)
from ..runtime._errors import ShardingError
from ..mesh._layout import packed_slice, uneven
from ..mesh._spec import P
from ..ops._ragged import ragged_all_to_all      # (ops layer: below the styles)
from ._flat import gather_group
from ._style import Call, Layout, Style, _layout, register_style, relayout

__all__ = ["Replicated", "Colwise", "Rowwise", "VocabParallelEmbedding",
           "SequenceParallel", "PrepareInput", "PrepareOutput", "ExpertRouter",
           "ExpertParallel", "ExpertDispatch", "ParameterRules", "SumOutput",
           "ScaleInputByAxisSize"]


def matches_rule(rule: str, name: str) -> bool:
    """Whether a plan's module pattern (transformers' ``tp_plan``/``ep_plan``/
    ``fsdp_plan`` keys: dotted names, ``*`` standing for one name) matches the dotted
    module or parameter ``name``. Example: ``matches_rule("layers.*.mlp", "layers.3.mlp")``."""
    r, n = rule.split(".") if rule else [], name.split(".") if name else []
    return len(r) == len(n) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n, r))


# ---------------------------------------------------------------------------------
# the styles

def _weight_of(module: nn.Module, style: str) -> torch.Tensor:
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ShardingError(
            f"style {style!r} needs a module with a 2-d `weight` (nn.Linear, nn.Embedding "
            f"or one laid out like them), but {type(module).__name__} has "
            f"{None if w is None else tuple(w.shape)}; apply it to such a module, or use "
            f"'replicated' / a custom functp.Style")
    return w


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): an affine map whose weight is stored
    ``[in, out]``, the transpose of ``nn.Linear``'s, with ``nf`` output features."""
    w = getattr(module, "weight", None)      # (during apply: this rank's block)
    return (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and isinstance(w, torch.Tensor) and w.dim() == 2)


def _local_attributes(module: nn.Module, names: tuple[str, ...], call: "Call",
                      where: str) -> None:
    """Divides the integer attributes ``names`` of ``module`` by the axis size until
    the call ends: the module reads its local sizes from them (``Conv1D.nf``)."""
    n = axis_size(call.axis)
    for a in names:
        full = getattr(module, a)
        if uneven(full, n):
            raise ShardingError(
                f"{where}: {type(module).__name__}.{a} = {full} does not split over the "
                f"{n} ranks of {call.axis!r}; choose sizes divisible by {n}")
        setattr(module, a, full // n)
        call.on_exit(lambda a=a, full=full: setattr(module, a, full))


def _packed_split(full: torch.Tensor, dim: int, blocks: int, n: int, i: int) -> torch.Tensor:
    """Rank ``i``'s slice of each of ``blocks`` equal blocks along ``dim``, concatenated."""
    return packed_slice(full, dim, blocks, n, i).contiguous()


def _packed_merge(gathered: torch.Tensor, dim: int, blocks: int, n: int) -> torch.Tensor:
    """Inverse of gathering ``_packed_split``'s slices: ``[g0 u0 g1 u1]`` -> ``[g0 g1 u0 u1]``."""
    shape = gathered.shape
    x = gathered.unflatten(dim, (n, blocks, shape[dim] // (n * blocks)))
    return x.transpose(dim, dim + 1).reshape(shape).contiguous()


class _Linearish(Style):
    """Shared by Colwise/Rowwise: which weight dimension is split, and packing."""

    def __init__(self, blocks: int):
        if blocks < 1:
            raise ShardingError(f"{type(self).__name__}: packed must be >= 1, got {blocks}")
        self.blocks = blocks

    def _spec(self, *entries) -> P:
        """``P(*entries)``, its split dimension packed when the weight is fused."""
        d = next(i for i, e in enumerate(entries) if e is not None)
        return P(*entries, packed={d: self.blocks} if self.blocks > 1 else None)


class Colwise(_Linearish):
    """Column-parallel ``nn.Linear`` (output features split) or ``nn.Embedding``
    (embedding dimension split): the output is sharded on its last dimension.

    ``input_layout``: how the input arrives (default ``Replicate()``; ``Shard(1)`` to
    all-gather a sequence-sharded input first). ``output_layout``: ``Shard(-1)``
    (default: the local columns, for a following row-parallel layer) or
    ``Replicate()`` (all-gathered: transformers' ``gather_output``). ``packed``: the
    number of fused blocks in the output features (2 for a ``gate_up`` weight), so
    that every rank gets matching slices of each.

    A replicated input needs no hook: meeting the sharded weight makes it varying,
    and its gradient is summed over the axis (Megatron's ``f``).
    """

    def __init__(self, *, input_layout: Layout = Replicate(), output_layout: Layout = Shard(-1),
                 packed: int = 1):
        super().__init__(packed)
        self.input_layout, self.output_layout = input_layout, output_layout

    def param_specs(self, module, axis):
        _weight_of(module, "colwise")
        emb = isinstance(module, nn.Embedding) or _is_conv1d(module)   # [*, out] weights
        specs = {n: P() for n, _ in module.named_parameters(recurse=False)}
        specs["weight"] = self._spec(None, axis) if emb else self._spec(axis, None)
        if "bias" in specs and getattr(module, "bias", None) is not None:
            specs["bias"] = self._spec(axis)
        return specs

    def prepare_input(self, module, args, kwargs, call):
        if _is_conv1d(module):
            _local_attributes(module, ("nf",), call, f"colwise on {call.name!r}")
        src = _layout(self.input_layout, call.axis, "Colwise input_layout")
        if not args or isinstance(src, Replicate):
            return args, kwargs
        # the local matmul that follows varies over the axis: a plain all_gather
        return (relayout(args[0], src, Replicate(), call.axis, varying=True), *args[1:]), kwargs

    def prepare_output(self, module, args, kwargs, output, call):
        dst = _layout(self.output_layout, call.axis, "Colwise output_layout")
        if self.blocks > 1 and isinstance(dst, Replicate):
            # gathered [g0 u0 g1 u1] must become [g0 g1 u0 u1]
            out = all_gather_invariant(output, call.axis, axis=output.ndim - 1, tiled=True)
            return _packed_merge(out, out.ndim - 1, self.blocks, axis_size(call.axis))
        return relayout(output, Shard(-1), dst, call.axis)


class Rowwise(_Linearish):
    """Row-parallel ``nn.Linear``: input features split, partial outputs summed.

    ``input_layout``: ``Shard(-1)`` (default: the local columns coming out of a
    column-parallel layer, no communication) or ``Replicate()`` (transformers'
    ``split_input``: this rank keeps its slice). ``output_layout``: ``Replicate()``
    (default, one all-reduce) or ``Shard(1)`` (reduce-scatter into a sequence-parallel
    region). The bias is replicated and added once, after the reduction.
    ``packed``: fused blocks in the input features, as for :class:`Colwise`.
    """

    def __init__(self, *, input_layout: Layout = Shard(-1), output_layout: Layout = Replicate(),
                 packed: int = 1):
        super().__init__(packed)
        self.input_layout, self.output_layout = input_layout, output_layout

    def param_specs(self, module, axis):
        if isinstance(module, nn.Embedding):
            raise ShardingError(
                "style 'rowwise' on an nn.Embedding: use 'embedding_rowwise' "
                "(vocab-parallel, functp.VocabParallelEmbedding) to split its rows")
        _weight_of(module, "rowwise")
        specs = {n: P() for n, _ in module.named_parameters(recurse=False)}
        specs["weight"] = self._spec(axis, None) if _is_conv1d(module) else self._spec(None, axis)
        if "bias" in specs and self._scatters_features():
            specs["bias"] = P(axis)     # added to this rank's output features
        return specs

    def _scatters_features(self) -> bool:
        """Whether the output is reduce-scattered over its last dimension (features)."""
        out = self.output_layout
        return isinstance(out, Shard) and out.dim == -1

    def withheld(self, module):
        return ("bias",) if getattr(module, "bias", None) is not None else ()

    def prepare_input(self, module, args, kwargs, call):
        src = _layout(self.input_layout, call.axis, "Rowwise input_layout")
        if not args or (isinstance(src, Shard) and src.dim % args[0].ndim == args[0].ndim - 1):
            return args, kwargs         # already this rank's columns (from a colwise layer)
        x = args[0]
        if isinstance(src, Replicate) and self.blocks > 1:
            n, i = axis_size(call.axis), axis_index(call.axis)
            x = _packed_split(pvary(x, call.axis), x.ndim - 1, self.blocks, n, i)
        else:
            x = relayout(x, src, Shard(-1), call.axis)
        return (x, *args[1:]), kwargs

    def prepare_output(self, module, args, kwargs, output, call):
        dst = _layout(self.output_layout, call.axis, "Rowwise output_layout")
        out = relayout(output, Partial(), dst, call.axis)
        bias = call.params.get("bias")
        return out if bias is None else out + bias


class VocabParallelEmbedding(Style):
    """``nn.Embedding`` with its rows (the vocabulary) split over the axis.

    Each rank looks up the ids that fall in its rows, zeroes the others, and the
    partial embeddings are summed: ``output_layout`` ``Replicate()`` (default, one
    all-reduce) or ``Shard(1)`` (reduce-scatter into a sequence-parallel region).
    A ``padding_idx`` keeps its meaning (no gradient for that row).
    """

    def __init__(self, *, output_layout: Layout = Replicate()):
        self.output_layout = output_layout

    def param_specs(self, module, axis):
        if not isinstance(module, nn.Embedding):
            _weight_of(module, "embedding_rowwise")
        specs = {n: P() for n, _ in module.named_parameters(recurse=False)}
        specs["weight"] = P(axis, None)
        return specs

    def prepare_input(self, module, args, kwargs, call):
        rows = call.params["weight"].shape[0]
        start = axis_index(call.axis) * rows
        # the local ids differ between ranks: say so (ids are ints: no gradient)
        ids = pvary(args[0], call.axis) - start
        outside = (ids < 0) | (ids >= rows)
        call.state["outside"] = outside
        pad = getattr(module, "padding_idx", None)
        if pad is not None:      # the global padding row, in local numbering (or none here)
            call.on_exit(lambda: setattr(module, "padding_idx", pad))
            module.padding_idx = pad - start if 0 <= pad - start < rows else None
        return (ids.masked_fill(outside, 0), *args[1:]), kwargs

    def prepare_output(self, module, args, kwargs, output, call):
        out = output.masked_fill(call.state["outside"].unsqueeze(-1), 0)
        return relayout(out, Partial(), _layout(self.output_layout, call.axis,
                                                "VocabParallelEmbedding output_layout"),
                        call.axis)


class Replicated(Style):
    """Every parameter replicated, inputs and outputs unchanged (norms, small
    layers). The gradient is still right where the module's output meets sharded
    values: vma makes its parameters vary there, and their gradients are summed
    over the axis (transformers needs a gradient all-reduce hook for this)."""


class SequenceParallel(Style):
    """A module (a norm, dropout) that runs on sequence-sharded activations.

    Parameters are replicated; the input arrives split along ``sequence_dim`` (from a
    reduce-scattering row-parallel layer or embedding). With ``gather_output=True``
    (default) the output is all-gathered along the sequence for the tensor-parallel
    region it feeds (attention, MLP, the LM head); the gather's backward is a
    reduce-scatter. With ``False`` it stays sharded.
    """

    def __init__(self, *, sequence_dim: int = 1, gather_output: bool = True):
        self.sequence_dim, self.gather_output = sequence_dim, gather_output

    def prepare_output(self, module, args, kwargs, output, call):
        if not self.gather_output:
            return output
        return relayout(output, Shard(self.sequence_dim), Replicate(), call.axis, varying=True)


def _layouts(x) -> tuple:
    """One layout or a sequence of them (``None`` entries leave a value alone)."""
    return (x,) if isinstance(x, (Placement, P)) else tuple(x or ())


def _paired_layouts(style: str, name: str, given: Any, desired: Any) -> tuple[tuple, tuple]:
    """``given`` and ``desired`` layouts as tuples of the same length (``name`` and
    ``desired_<name>`` are the arguments' names, for the error)."""
    given, desired = _layouts(given), _layouts(desired)
    if len(given) != len(desired):
        raise ShardingError(f"{style}: {name} {given} and desired_{name} {desired} must "
                            f"have the same length")
    return given, desired


class PrepareInput(Style):
    """Reshards a module's inputs: positional input ``i`` from ``input_layouts[i]`` to
    ``desired_input_layouts[i]`` (``None`` leaves it alone), keyword inputs likewise
    by name. The module's own parameters are replicated. Example: ``PrepareInput(
    Shard(1), Replicate())`` all-gathers a sequence-sharded input."""

    def __init__(self, input_layouts: Any = None, desired_input_layouts: Any = None, *,
                 input_kwarg_layouts: dict | None = None,
                 desired_input_kwarg_layouts: dict | None = None):
        self.input_layouts, self.desired_input_layouts = _paired_layouts(
            "PrepareInput", "input_layouts", input_layouts, desired_input_layouts)
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})

    def prepare_input(self, module, args, kwargs, call):
        if len(args) < len(self.input_layouts):
            raise ShardingError(
                f"PrepareInput on '{call.name}': {len(self.input_layouts)} input layouts but "
                f"the module got {len(args)} positional inputs")
        lay = lambda v: _layout(v, call.axis, f"PrepareInput on '{call.name}'")
        moved = [relayout(a, lay(s), lay(d), call.axis) for a, s, d in
                 zip(args, self.input_layouts, self.desired_input_layouts)]
        kwargs = {k: relayout(v, lay(self.input_kwarg_layouts.get(k)),
                              lay(self.desired_input_kwarg_layouts.get(k)), call.axis)
                  for k, v in kwargs.items()}
        return (*moved, *args[len(moved):]), kwargs


class PrepareOutput(Style):
    """Reshards a module's output(s) from ``output_layouts`` to
    ``desired_output_layouts`` (one each, or tuples for a tuple output). The module's
    own parameters are replicated. Example: ``PrepareOutput(Replicate(), Shard(0))``
    keeps this rank's rows of a replicated output (position embeddings entering a
    sequence-parallel region)."""

    def __init__(self, output_layouts: Any, desired_output_layouts: Any):
        self.output_layouts, self.desired_output_layouts = _paired_layouts(
            "PrepareOutput", "output_layouts", output_layouts, desired_output_layouts)

    def prepare_output(self, module, args, kwargs, output, call):
        single = not isinstance(output, tuple)
        outs = (output,) if single else output
        if len(outs) != len(self.output_layouts):
            raise ShardingError(
                f"PrepareOutput on '{call.name}': {len(self.output_layouts)} output layouts "
                f"but the module returned {len(outs)} outputs")
        lay = lambda v: _layout(v, call.axis, f"PrepareOutput on '{call.name}'")
        new = tuple(relayout(o, lay(s), lay(d), call.axis)
                    for o, s, d in zip(outs, self.output_layouts, self.desired_output_layouts))
        return new[0] if single else new


# ---------------------------------------------------------------------------------
# mixture of experts

def _num_experts(module: nn.Module, call: Call) -> int:
    n = getattr(module, "num_experts", None)
    if n is None:
        n = call.params["weight"].shape[0] if "weight" in call.params else None
    if n is None:
        raise ShardingError(
            f"style 'ep_router' on '{call.name}': cannot tell the number of experts; give "
            f"the router a `num_experts` attribute or a `weight` of shape [experts, hidden]")
    return int(n)


class ExpertRouter(Style):
    """The router of an expert-parallel MoE block whose tokens are replicated over
    the axis (tensor-parallel regions). Parameters are replicated; the last output
    (the top-k expert indices) is renumbered to this rank's experts, ``-1`` for an
    expert held elsewhere, so that the experts module computes only its own."""

    def prepare_output(self, module, args, kwargs, output, call):
        n, i = axis_size(call.axis), axis_index(call.axis)
        e = _num_experts(module, call)
        if uneven(e, n):
            raise ShardingError(
                f"style 'ep_router' on '{call.name}': {e} experts do not divide over "
                f"'{call.axis}' (size {n}); use a number of experts divisible by {n}")
        local = e // n
        idx = pvary(output[-1], call.axis) - i * local      # ints: differs per rank
        idx = idx.masked_fill((idx < 0) | (idx >= local), -1)
        return (*output[:-1], idx)


class ExpertParallel(Style):
    """Experts whose parameters are stacked on dimension 0 (``[experts, ...]``), split
    over the axis; tokens are replicated over it. With :class:`ExpertRouter`
    renumbering the routes, each rank applies its experts to the tokens routed to
    them and the partial outputs are summed: ``output_layout`` ``Replicate()``
    (all-reduce) or ``Shard(1)`` (reduce-scatter into a sequence-parallel region).

    Every rank already holds every token here, so this costs one all-reduce per MoE
    layer, like a row-parallel layer, with no token dispatch; use
    :class:`ExpertDispatch` when tokens are sharded over the axis.
    """

    def __init__(self, *, output_layout: Layout = Replicate()):
        self.output_layout = output_layout

    def param_specs(self, module, axis):
        return {n: P(axis) for n, _ in module.named_parameters(recurse=False)}

    def prepare_output(self, module, args, kwargs, output, call):
        return relayout(output, Partial(), _layout(self.output_layout, call.axis,
                                                   "ExpertParallel output_layout"), call.axis)


class ExpertDispatch(Style):
    """Expert parallelism over an axis that also shards the tokens (data parallel
    ranks that each hold some experts, as in GShard / DeepSpeed-MoE / Megatron).

    The experts module is called as ``experts(x, weights, indices)`` (functp's
    models) or ``experts(x, indices, weights)`` (transformers' experts modules) with
    ``x`` of shape ``[..., hidden]`` and global top-k ``indices`` (the router is
    replicated). The pre-hook sends every (token, choice) pair to the rank holding its
    expert with one :func:`functp.ragged_all_to_all`, grouped by expert; the experts
    run on exactly the rows they received (weight 1, local expert numbers); the
    post-hook sends the results back with a second one and combines them with the
    routing weights. Traffic is exact: the rows a rank sends are the pairs it routes.

    **Arguments:** ``capacity_factor`` – ``None`` (default): no pair is dropped. A
    number ``c``: each expert takes at most ``ceil(c * tokens * top_k / experts)``
    pairs from each rank, ``tokens`` this rank's tokens (Megatron-Core's
    ``moe_expert_capacity_factor``, computed on the local batch before dispatch);
    the others are dropped (their expert output is zero, as a residual layer
    passes the token on) and counted in ``dropped``. ``drop_policy``: which pairs an
    expert over capacity keeps: ``"probs"`` (the highest routing weights, Megatron's
    default) or ``"position"`` (the earliest tokens, as Switch Transformers).
    ``pad_to_capacity``: with a ``capacity_factor``, every expert receives exactly its
    capacity of rows from each rank, the unused ones zero (Megatron's
    ``moe_pad_expert_input_to_capacity``): the exchanges' and the experts' shapes no
    longer depend on the routing (for ``torch.compile`` and CUDA graphs), at the
    price of sending and computing the padding: ``local experts x capacity`` rows to
    each peer, each way.
    ``dispatch``: ``"ragged"`` (default) or ``"padded"``: the earlier equal-block
    ``all_to_all`` that pads every (source, destination) block to the worst case
    (all of a rank's pairs to one destination; ``axis_size`` times the traffic of a
    balanced dispatch; kept for comparison). ``shared``: axes of the style's axis
    tuple over which the tokens are replicated (tensor-parallel ranks holding one
    batch): each of those ranks dispatches its slice of the tokens (``torch.chunk``'s
    blocks: a count that does not divide leaves the last slices shorter, or empty),
    and the outputs are gathered back, so that no token is computed twice
    (transformers' EP with ``tp_size > 1``). ``fsdp``: an axis (or axes) over which
    the experts' parameters are also sharded, on the expert dimension after the
    expert-parallel split (``P(("ep", "efsdp"))``), and all-gathered in the pre-hook
    (transformers' expert FSDP over ``efsdp``; the gradient comes back
    reduce-scattered); ``replicate``: axes over which those shards are replicated
    (HSDP's ``dp_replicate``), whose gradients are all-reduced on the shard.

    Host syncs: one per call, for the counts (one all-gather of ``axis_size x
    experts`` ints); none per expert. ``dropped[name]``: the pairs this rank dropped
    in the last call of the module ``name`` (per thread, so per simulated rank).

    Example (experts over ``ep``, tokens sharded over it)::

        plan = {"moe.experts": functp.ExpertDispatch(capacity_factor=1.25)}
        apply, params, specs = functp.parallelize(model, mesh, plan, axis="ep")
    """

    POLICIES = ("probs", "position")

    def __init__(self, *, capacity_factor: float | None = None, drop_policy: str = "probs",
                 dispatch: str = "ragged", shared: tuple[str, ...] = (),
                 fsdp: str | tuple[str, ...] | None = None, replicate: tuple[str, ...] = (),
                 pad_to_capacity: bool = False):
        if capacity_factor is not None and not capacity_factor > 0:
            raise ShardingError(f"ExpertDispatch: capacity_factor must be a positive number "
                                f"or None (no drops), got {capacity_factor!r}")
        if drop_policy not in self.POLICIES:
            raise ShardingError(f"ExpertDispatch: drop_policy must be one of {self.POLICIES}, "
                                f"got {drop_policy!r}")
        if dispatch not in ("ragged", "padded"):
            raise ShardingError(f"ExpertDispatch: dispatch must be 'ragged' or 'padded', got "
                                f"{dispatch!r}")
        if dispatch == "padded" and capacity_factor is not None:
            raise ShardingError("ExpertDispatch: the padded dispatch never drops; use "
                                "dispatch='ragged' with a capacity_factor")
        if pad_to_capacity and capacity_factor is None:
            raise ShardingError("ExpertDispatch: pad_to_capacity=True pads each expert's rows "
                                "to its capacity, which needs a capacity_factor (Megatron's "
                                "moe_expert_capacity_factor); give one, e.g. 1.0")
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.pad_to_capacity = pad_to_capacity
        self.dispatch, self.shared = dispatch, tuple(shared)
        self.fsdp = (fsdp,) if isinstance(fsdp, str) else tuple(fsdp or ())
        if replicate and not self.fsdp:
            raise ShardingError(f"ExpertDispatch: replicate={replicate!r} names the axes an "
                                f"FSDP shard is replicated over; give fsdp= too")
        self.replicate = (replicate,) if isinstance(replicate, str) else tuple(replicate)
        self._local = threading.local()

    def __repr__(self) -> str:
        extra = (f", fsdp={self.fsdp!r}, replicate={self.replicate!r}" if self.fsdp else "")
        extra += ", pad_to_capacity=True" if self.pad_to_capacity else ""
        return (f"ExpertDispatch(capacity_factor={self.capacity_factor!r}, drop_policy="
                f"{self.drop_policy!r}, dispatch={self.dispatch!r}, shared={self.shared!r}"
                f"{extra})")

    @property
    def dropped(self) -> dict[str, int]:
        if not hasattr(self._local, "dropped"):
            self._local.dropped = {}
        return self._local.dropped

    def param_specs(self, module, axis):
        # experts split on dimension 0 over the axis, then (FSDP) over ``fsdp``: a
        # rank's shard is a slice of its experts, as FSDP2's dim-0 shard of them
        dim0 = axis if not self.fsdp else (*(axis if isinstance(axis, tuple) else (axis,)),
                                           *self.fsdp)
        return {n: P(dim0) for n, _ in module.named_parameters(recurse=False)}

    def _gather_experts(self, module, call) -> int:
        """FSDP: this rank's experts whole from their shards over ``fsdp`` (the module
        sees them until its forward returns); the number of this rank's experts."""
        blocks = call.params
        if self.fsdp:
            restore = call.state["restore"] = {}
            # one all-gather per dtype for all the experts' weights (one reduce-scatter
            # of their gradients); HSDP: the gradient all-reduced on the shard
            fulls = gather_group({s: (b, 0) for s, b in blocks.items()}, self.fsdp,
                                 self.replicate)
            for short, full in fulls.items():
                restore[short] = module._parameters[short]
                module._parameters[short] = full
            return next(iter(blocks.values())).shape[0] * axis_size(self.fsdp)
        return next(iter(blocks.values())).shape[0]

    def prepare_input(self, module, args, kwargs, call):
        x, a, b = args[:3]
        idx_at = 2 if a.is_floating_point() else 1     # transformers: (x, indices, weights)
        idx, weights = args[idx_at], args[3 - idx_at]
        hidden, k = x.shape[-1], idx.shape[-1]
        local = self._gather_experts(module, call)
        tokens, idx = x.reshape(-1, hidden), idx.reshape(-1, k)
        weights = weights.reshape(-1, k)
        call.state["rows"] = []                # the rows at each shared axis, for the gather
        tokens, idx, weights = (_take_slice(t, self.shared, call) for t in (tokens, idx, weights))
        call.state.update(weights=weights, shape=x.shape, k=k)
        if self.dispatch == "padded":
            recv_x, recv_e = _padded_dispatch(tokens, idx.reshape(-1), local, call)
        else:
            recv_x, recv_e = self._ragged_dispatch(tokens, idx.reshape(-1), weights.reshape(-1),
                                                   local, call)
        n_experts = getattr(module, "num_experts", None)
        if isinstance(n_experts, int) and n_experts == local * axis_size(call.axis):
            # transformers' experts read their count from it (MoEParamShard sets it too)
            module.num_experts = local
            call.on_exit(lambda: setattr(module, "num_experts", n_experts))
        call.state["empty"] = recv_x.shape[0] == 0
        if call.state["empty"]:
            # one zero row for expert 0, dropped after: the experts' output stays
            # connected to the exchange and the parameters, so that this rank's
            # backward runs the same collectives as its peers' (as transformers does)
            recv_x, recv_e = recv_x.sum(0, keepdim=True), recv_e.new_zeros(1)
        ones = torch.ones(recv_x.shape[0], 1, dtype=weights.dtype)
        routed = (ones, recv_e.unsqueeze(1)) if idx_at == 2 else (recv_e.unsqueeze(1), ones)
        return (recv_x, *routed, *args[3:]), kwargs

    def _ragged_dispatch(self, tokens, idx, weights, local, call):
        n = axis_size(call.axis)
        experts = n * local
        bad = (idx < 0) | (idx >= experts)                       # reported with the counts
        key = torch.where(bad, experts, idx)
        if self.pad_to_capacity:
            return self._capacity_dispatch(tokens, key, weights, bad, local, call)
        if self.capacity_factor is not None:     # dropped pairs sort last, and stay
            place, cap = self._place(key, weights, experts)
            key = torch.where(place < cap, key, experts)
        order = torch.argsort(key, stable=True)                  # grouped by expert
        counts = torch.cat([torch.bincount(key, minlength=experts + 1)[:experts],
                            bad.sum().reshape(1)])
        plan = _expert_plan(counts, local, call)                 # the one host sync
        self.dropped[call.name] = idx.numel() - sum(plan.send)
        call.state.update(order=order, plan=plan)
        rows = tokens[torch.div(order, call.state["k"], rounding_mode="floor")]
        recv_x = ragged_all_to_all(rows, rows.new_zeros(plan.recv_total, tokens.shape[1]),
                                   plan.in_off, plan.send, plan.out_off, plan.recv, call.axis,
                                   recv_offsets=plan.recv_off)
        return recv_x, plan.recv_experts

    def _capacity_dispatch(self, tokens, key, weights, bad, local, call):
        """Pad to capacity: the pairs each expert keeps go to its ``cap`` rows of an
        ``experts x cap`` buffer (the dropped ones to a last row, cut off), which is
        sent in blocks of ``local x cap`` rows per peer; the counts still travel, for
        the route check, the peers' capacities and the dropped pairs."""
        experts = axis_size(call.axis) * local
        place, cap = self._place(key, weights, experts)
        kept = (place < cap) & (key < experts)
        counts = torch.cat([torch.full((experts,), cap), bad.sum().reshape(1),
                            kept.sum().reshape(1)])
        plan = _expert_plan(counts, local, call)                 # the one host sync
        self.dropped[call.name] = key.numel() - plan.extra[0]
        slot = torch.where(kept, key * cap + place, experts * cap)
        rows = tokens[torch.div(torch.arange(key.numel()), call.state["k"],
                                rounding_mode="floor")]
        buf = tokens.new_zeros(experts * cap + 1, tokens.shape[1]).index_add(0, slot, rows)
        call.state.update(plan=plan, slot=slot, sent_rows=experts * cap)
        recv_x = ragged_all_to_all(buf[:experts * cap], buf.new_zeros(plan.recv_total,
                                                                      tokens.shape[1]),
                                   plan.in_off, plan.send, plan.out_off, plan.recv, call.axis,
                                   recv_offsets=plan.recv_off)
        return recv_x, plan.recv_experts

    def _place(self, idx, weights, experts):
        """Each pair's place among its expert's pairs (by weight or position) and the
        capacity (Megatron's ``get_capacity``, on this rank's pairs): the pairs placed
        below it fit; ``idx`` is ``experts`` for a pair that names no expert."""
        cap = math.ceil(idx.numel() / experts * self.capacity_factor)
        order = torch.arange(idx.numel())
        if self.drop_policy == "probs":          # highest weight first within an expert
            order = torch.argsort(-weights.detach(), stable=True)
        order = order[torch.argsort(idx[order], stable=True)]
        counts = torch.bincount(idx, minlength=experts + 1)
        start = counts.cumsum(0) - counts
        rank = torch.arange(idx.numel()) - start[idx[order]]     # place within its expert
        return torch.empty_like(rank).scatter_(0, order, rank), cap

    def prepare_output(self, module, args, kwargs, output, call):
        st = call.state
        for short, block in st.get("restore", {}).items():
            module._parameters[short] = block
        if st["empty"]:
            output = output[:0]
        if self.dispatch == "padded":
            back = all_to_all(output, call.axis, 0, 0, tiled=True)
            pairs = back[st["slot"]]
        else:
            plan, padded = st["plan"], self.pad_to_capacity
            rows = st["sent_rows"] if padded else st["order"].numel()
            back = ragged_all_to_all(output, output.new_zeros(rows, output.shape[1]),
                                     plan.recv_off, plan.recv, plan.back_off, plan.send,
                                     call.axis, recv_offsets=plan.in_off)
            pairs = (torch.nn.functional.pad(back, (0, 0, 0, 1))[st["slot"]] if padded
                     else torch.zeros_like(back).index_copy(0, st["order"], back))
        w = st["weights"].unsqueeze(-1)
        out = (pairs.unflatten(0, (-1, st["k"])) * w).sum(1).to(output.dtype)
        return _gather_slice(out, self.shared, call).reshape(st["shape"])


class _ExpertPlan(NamedTuple):
    """A ragged dispatch's sizes (Python ints, per peer in axis-index order)."""
    in_off: list[int]       # where the rows for peer j start in this rank's sorted pairs
    send: list[int]         # pairs this rank sends to peer j
    out_off: list[int]      # where they land in peer j's buffer
    recv: list[int]         # pairs peer j sends here
    recv_off: list[int]     # where they land here
    back_off: list[int]     # where the results for peer j land in its sorted pairs
    recv_total: int
    recv_experts: torch.Tensor     # the local expert of every received row
    extra: list[int]        # this rank's counts after its bad routes' (as given)


def _expert_plan(counts: torch.Tensor, local: int, call: Call) -> _ExpertPlan:
    """Every rank's pairs per expert, and its count of routes to no expert (one
    all-gather, one host sync) -> the sizes of the dispatch and of its return, and
    each received row's local expert. A bad route is an error on every rank."""
    axis = call.axis
    n, me = axis_size(axis), axis_index(axis)
    table = all_gather(counts, axis).tolist()     # [source][expert] + [bad routes, ...]
    bad = {s: row[n * local] for s, row in enumerate(table) if row[n * local]}
    if bad:
        raise ShardingError(
            f"ExpertDispatch on {call.name!r}: routing indices outside 0..{n * local - 1} "
            f"({n * local} experts, {local} on each of the {n} ranks of {axis!r}): "
            f"{sum(bad.values())} (token, choice) pairs on ranks {sorted(bad)} of {axis!r}; "
            f"the router must give global expert numbers")
    per_dest = [[sum(row[j * local:(j + 1) * local]) for j in range(n)] for row in table]
    send = per_dest[me]
    recv = [per_dest[s][me] for s in range(n)]

    def starts(sizes):
        return [sum(sizes[:j]) for j in range(len(sizes))]
    mine = [c for s in range(n) for c in table[s][me * local:(me + 1) * local]]
    experts = torch.arange(local).repeat(n).repeat_interleave(
        torch.tensor(mine, dtype=torch.int64), output_size=sum(recv))
    return _ExpertPlan(starts(send), send, [sum(per_dest[s][j] for s in range(me))
                                            for j in range(n)],
                       recv, starts(recv), [starts(per_dest[s])[me] for s in range(n)],
                       sum(recv), experts, table[me][n * local + 1:])


def _padded_dispatch(tokens, idx, local, call):
    """Equal blocks of the worst case: every (source, destination) block holds all of
    a rank's pairs; slots no pair fills carry expert ``-1``."""
    n, hidden, k = axis_size(call.axis), tokens.shape[-1], call.state["k"]
    dest = torch.div(idx, local, rounding_mode="floor")
    cap = idx.numel()
    onehot = torch.nn.functional.one_hot(dest, n)
    pos = (onehot.cumsum(0) - 1).gather(1, dest.unsqueeze(1)).squeeze(1)
    slot = dest * cap + pos
    send_x = tokens.new_zeros(n * cap, hidden).index_put(
        (slot,), tokens.repeat_interleave(k, dim=0))
    send_e = torch.full((n * cap,), -1, dtype=idx.dtype).index_put((slot,), idx % local)
    call.state["slot"] = slot
    return (all_to_all(send_x, call.axis, 0, 0, tiled=True),
            all_to_all(send_e, call.axis, 0, 0, tiled=True))


def _take_slice(t: torch.Tensor, shared: tuple[str, ...], call: Call) -> torch.Tensor:
    """This rank's slice of rows replicated over ``shared`` (Replicate -> Shard(0)), in
    ``torch.chunk``'s blocks: ``ceil(rows / n)`` each, the last ones shorter (or
    empty) when ``n`` does not divide the rows, as DTensor's ``Shard(0)``."""
    record = len(call.state["rows"]) < len(shared)
    for a in shared:
        n, i = axis_size(a), axis_index(a)
        rows = t.shape[0]
        if record:
            call.state["rows"].append(rows)
        chunk = -(-rows // n)
        start = min(i * chunk, rows)
        t = (pvary(t, a) if t.is_floating_point() else t).narrow(
            0, start, min(chunk, rows - start))
    return t


def _gather_slice(t: torch.Tensor, shared: tuple[str, ...], call: Call) -> torch.Tensor:
    """The inverse of :func:`_take_slice`: every rank's slice, each padded to the
    chunk for an equal-block gather, the padding cut off after (its gradient is
    never used)."""
    for a, rows in zip(reversed(shared), reversed(call.state["rows"])):
        chunk = -(-rows // axis_size(a))
        t = torch.nn.functional.pad(t, (0, 0, 0, chunk - t.shape[0]))
        t = all_gather_invariant(t, a, axis=0, tiled=True).narrow(0, 0, rows)
    return t


class LocalSizes(Style):
    """Leaves a module's parameters to the rules of its submodules and, during its
    call, divides the integer attributes ``names`` by the axis size: for a module
    that reads sizes of split tensors from attributes instead of the tensors (GPT-2's
    attention splits its fused qkv output with ``split_size``)."""

    def __init__(self, *names: str):
        self.names = names

    def param_specs(self, module, axis):
        return {}

    def prepare_input(self, module, args, kwargs, call):
        _local_attributes(module, self.names, call, f"LocalSizes on {call.name!r}")
        return args, kwargs


class TensorParallelExperts(Style):
    """transformers' experts module (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj``
    ``[E, H, I]``, as in Mixtral and Qwen3-MoE) with every expert's intermediate
    dimension split over the axis: ``gate_up_proj`` packed column-parallel (each rank
    gets its slice of gate and of up), ``down_proj`` row-parallel, the output summed
    over the axis (transformers' ``moe_tp_experts``). Every rank runs every expert on
    the tokens routed to it, as on one device; no tokens move.
    """

    def param_specs(self, module, axis):
        own = dict(module.named_parameters(recurse=False))
        if (set(own) != {"gate_up_proj", "down_proj"} or own["gate_up_proj"].ndim != 3
                or own["down_proj"].ndim != 3):
            shapes = {n: tuple(p.shape) for n, p in own.items()}
            raise ShardingError(
                f"style 'moe_tp_experts' on {type(module).__name__} (parameters {shapes}): "
                f"it needs exactly 3-d 'gate_up_proj' [experts, 2 x intermediate, hidden] "
                f"and 'down_proj' [experts, hidden, intermediate] (transformers' experts "
                f"modules); write a functp.Style for this module")
        return {"gate_up_proj": P(None, axis, None, packed={1: 2}),   # [gate; up] rows
                "down_proj": P(None, None, axis)}

    def prepare_output(self, module, args, kwargs, output, call):
        return psum(output, call.axis)      # each rank holds a part of every expert's sum


class ParameterRules(Style):
    """A module whose own parameters are laid out one by one, as transformers' plans
    do with rules that name a parameter (``"layers.*.mlp.experts.gate_up_proj":
    "packed_colwise"``, ``"layers.*.self_attn.sinks": "colwise"``) rather than a module.

    ``rules`` maps a parameter's short name to how it is split: ``"colwise"``
    (the output features: dimension ``ndim - 2`` of a weight, 0 of a vector),
    ``"rowwise"`` (the input features: the last dimension; a ``bias`` stays
    replicated), ``"packed_colwise"`` / ``"packed_rowwise"`` (the same, of a fused
    ``[gate; up]`` weight: each rank gets its slice of both). Parameters without a
    rule are replicated. ``reduce_output``: the module's output is a partial sum
    (it contracts a split dimension, like an experts module whose ``down_proj`` is
    row-parallel), summed over the axis after the call. ``strict``: a rule for a
    parameter the module lacks is an error (``False``: skipped, for plans whose
    rules cover layers of several kinds). Example (Llama-4's experts,
    stored ``[experts, in, out]``)::

        ParameterRules({"gate_up_proj": "packed_rowwise", "down_proj": "colwise"},
                       reduce_output=True)
    """

    KINDS = ("colwise", "rowwise", "packed_colwise", "packed_rowwise")

    def __init__(self, rules: dict[str, str], *, reduce_output: bool = False,
                 strict: bool = True):
        bad = {k: v for k, v in rules.items() if v not in self.KINDS}
        if bad:
            raise ShardingError(
                f"ParameterRules: {bad} are not parameter layouts; use one of {self.KINDS}")
        self.rules, self.reduce_output, self.strict = dict(rules), reduce_output, strict

    def param_specs(self, module, axis):
        own = dict(module.named_parameters(recurse=False))
        missing = sorted(set(self.rules) - set(own))
        if missing and self.strict:
            raise ShardingError(
                f"ParameterRules on {type(module).__name__}: rules for {missing}, which are "
                f"not parameters of it (it has {sorted(own)})")
        specs = {}
        for name, p in own.items():
            kind = self.rules.get(name)
            if kind is None or (kind.endswith("rowwise") and (name == "bias" or p.ndim == 1)):
                specs[name] = P()
                continue
            d = p.ndim - 1 if kind.endswith("rowwise") else max(p.ndim - 2, 0)
            entries = [None] * p.ndim
            entries[d] = axis
            specs[name] = P(*entries, packed={d: 2} if kind.startswith("packed") else None)
        return specs

    def prepare_output(self, module, args, kwargs, output, call):
        if not self.reduce_output:
            return output
        if isinstance(output, tuple):        # (a module that also returns its logits)
            return (_sum_partial(output[0], call.axis), *output[1:])
        return _sum_partial(output, call.axis)


def _sum_partial(x: torch.Tensor, axis: str) -> torch.Tensor:
    """All-reduces a partial sum. Each rank's value is its own term even where it
    happens to be the same on every rank (a layer whose tokens all went to an
    identity expert scaled by 1/size): hence the explicit pvary."""
    return psum(pvary(x, axis), axis)


class SumOutput(Style):
    """A module whose output is a partial sum over the axis (its parameters are laid
    out by other rules): the output is all-reduced (transformers' ``all_reduce``)."""

    def prepare_output(self, module, args, kwargs, output, call):
        return _sum_partial(output, call.axis)


class ScaleInputByAxisSize(Style):
    """A module inside a region whose output is summed over the axis, that sees the
    same value on every rank (an identity expert among tensor-parallel experts): its
    input is divided by the axis size, so that the sum counts it once
    (transformers' ``moe_identity_expert``)."""

    def prepare_input(self, module, args, kwargs, call):
        if not args:
            return args, kwargs
        return (args[0] / axis_size(call.axis), *args[1:]), kwargs




_SEQ = Shard(1)        # [batch, sequence, hidden]: the sequence-parallel split
for _name, _style in {
    "replicated": Replicated(),
    "colwise": Colwise(),
    "colwise_gather_output": Colwise(output_layout=Replicate()),
    "rowwise": Rowwise(),
    "rowwise_split_input": Rowwise(input_layout=Replicate()),
    "rowwise_sp": Rowwise(output_layout=_SEQ),
    "rowwise_scatter_output": Rowwise(output_layout=Shard(-1)),
    "packed_colwise": Colwise(packed=2),
    "packed_rowwise": Rowwise(packed=2),
    "packed_colwise_qkv": Colwise(packed=3),
    "embedding_rowwise": VocabParallelEmbedding(),
    "embedding_rowwise_sp": VocabParallelEmbedding(output_layout=_SEQ),
    "embedding_colwise": Colwise(output_layout=Replicate()),
    "sequence_parallel": SequenceParallel(),
    "ep_router": ExpertRouter(),
    "ep_experts": ExpertParallel(),
    "ep_experts_sp": ExpertParallel(output_layout=_SEQ),
    "ep_experts_all_to_all": ExpertDispatch(),
    "moe_tp_experts": TensorParallelExperts(),
    "gpt2_attention": LocalSizes("split_size"),
    "all_reduce": SumOutput(),
    "local_columns": PrepareOutput(Replicate(), Shard(-1)),
    "moe_identity_expert": ScaleInputByAxisSize(),
    # transformers' names, old and new, for the same layouts
    "colwise_rep": Colwise(output_layout=Replicate()),
    "rowwise_rep": Rowwise(input_layout=Replicate()),
    "replicate": Replicated(),
    "replicated_with_grad_allreduce": Replicated(),
    # MLA's kv_a_proj is replicated: its rope part meets split heads, and vma sums
    # its gradient over the axis there (transformers needs a hook for that)
    "mla_kv_a_proj": Replicated(),
}.items():
    register_style(_name, _style)
