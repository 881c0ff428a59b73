"""Tensor (and sequence) parallelism: the styles that split a module's weights over a
mesh axis, Megatron-style, and reshard activations at module boundaries.

:class:`Colwise` / :class:`Rowwise` split ``nn.Linear`` (and GPT-2's ``Conv1D``)
weights by output / input features, packed fused weights included;
:class:`VocabParallelEmbedding` splits an embedding's rows; :class:`SequenceParallel`,
:class:`PrepareInput` and :class:`PrepareOutput` move activations between layouts;
:class:`Replicated` keeps a module whole. Because functp tracks vma, a replicated
parameter or activation that meets a sharded one is ``pvary``'d implicitly:
Megatron's "f" operator (identity forward, all-reduce backward) and the gradient
all-reduce of replicated norm weights need no hook.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..ops._collectives import all_gather_invariant, axis_index, axis_size, pvary
from ..runtime import _compile
from ..runtime._errors import ShardingError
from ..runtime._torch_compat import DisableFuncTorch, is_functorch_wrapped, unwrap_functorch
from ..mesh._layout import packed_slice, uneven
from ..mesh._spec import P
from ._style import (Acts, Call, Layout, Style, _layout, _own_hooks, register_style,
                     relayout)

__all__ = ["Replicated", "Colwise", "Rowwise", "VocabParallelEmbedding",
           "SequenceParallel", "PrepareInput", "PrepareOutput"]


_COLUMNS = Shard(-1)       # this rank's columns (output features) of a split layer
_PARTIAL = Partial()       # partial sums, to be summed over the axis
#: how the vocabulary-parallel embedding's error for an id outside the vocabulary
#: starts (``apply`` passes it on as it is: the plan is not the cause)
OUTSIDE_VOCAB = "functp: an id outside the vocabulary"


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
    number of equal fused blocks in the output features, so that every rank gets its
    slice of each: a plain split gives rank 0 the first columns of the whole, and a
    model that then splits the output by width (``q, k, v = c_attn(x).split(n_embd,
    -1)``) gets wrong blocks, silently. ``Colwise(packed=3)`` (registered as
    ``"packed_colwise_qkv"``, GPT-2's ``c_attn`` in its shipped plan) for a fused
    ``[q; k; v]``, each rank holding its heads of q, of k and of v; ``packed=2``
    (``"packed_colwise"``) for a fused ``[gate; up]``. The specs say so (an
    ``nn.Linear``'s weight ``P(axis, None, packed={0: 3})``): ``apply.unshard`` and
    checkpoints give the weight back in its own order. (The model must take local
    sizes from the tensors, ``.chunk(3, -1)``, or through :class:`functp.LocalSizes`.)

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

    def acts(self, module, axis):
        if not _own_hooks(self, Colwise):
            return super().acts(module, axis)
        # the layouts resolved once; a Replicate() input of nn.Linear and its local
        # columns as the output (the defaults) need no hook
        conv = _is_conv1d(module)
        src = _layout(self.input_layout, axis, "Colwise input_layout")
        dst = _layout(self.output_layout, axis, "Colwise output_layout")
        pre = (functools.partial(self._input, conv, src)
               if conv or not isinstance(src, Replicate) else None)
        post = (functools.partial(self._output, dst)
                if dst != _COLUMNS or (self.blocks > 1 and isinstance(dst, Replicate)) else None)
        # (Conv1D's nf is restored on exit; packed blocks are merged after the gather)
        return Acts(pre, post, call=conv, identity_over_one=not conv and self.blocks == 1)

    def prepare_input(self, module, args, kwargs, call):
        return self._input(_is_conv1d(module),
                           _layout(self.input_layout, call.axis, "Colwise input_layout"),
                           module, args, kwargs, call)

    def _input(self, conv, src, module, args, kwargs, call):
        if conv:
            _local_attributes(module, ("nf",), call, f"colwise on {call.name!r}")
        if not args or isinstance(src, Replicate):
            return args, kwargs
        # the local matmul that follows varies over the axis: a plain all_gather
        return (relayout(args[0], src, Replicate(), call.axis, varying=True), *args[1:]), kwargs

    def prepare_output(self, module, args, kwargs, output, call):
        return self._output(_layout(self.output_layout, call.axis, "Colwise output_layout"),
                            module, args, kwargs, output, call)

    def _output(self, dst, module, args, kwargs, output, call):
        if self.blocks > 1 and isinstance(dst, Replicate):
            # gathered [g0 u0 g1 u1] must become [g0 g1 u0 u1]
            out = all_gather_invariant(output, call.axis, axis=output.ndim - 1, tiled=True)
            return _packed_merge(out, out.ndim - 1, self.blocks, axis_size(call.axis))
        return relayout(output, _COLUMNS, dst, call.axis)


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

    def acts(self, module, axis):
        if not _own_hooks(self, Rowwise):
            return super().acts(module, axis)
        # the layouts resolved once; an input of local columns (the default) needs no
        # pre-hook (Shard(d) with d >= 0 is the last dimension only for some inputs);
        # only a withheld bias is read from the call
        src = _layout(self.input_layout, axis, "Rowwise input_layout")
        dst = _layout(self.output_layout, axis, "Rowwise output_layout")
        pre = None if src == _COLUMNS else functools.partial(self._input, src)
        bias = bool(self.withheld(module))       # (added after the reduction)
        return Acts(pre, functools.partial(self._output, dst), call=bias,
                    identity_over_one=not bias and self.blocks == 1)

    def prepare_input(self, module, args, kwargs, call):
        return self._input(_layout(self.input_layout, call.axis, "Rowwise input_layout"),
                           module, args, kwargs, call)

    def _input(self, src, module, args, kwargs, call):
        if not args or (isinstance(src, Shard) and src.dim % args[0].ndim == args[0].ndim - 1):
            return args, kwargs         # already this rank's columns (from a colwise layer)
        x = args[0]
        if isinstance(src, Replicate) and self.blocks > 1:
            n, i = axis_size(call.axis), axis_index(call.axis)
            x = _packed_split(pvary(x, call.axis), x.ndim - 1, self.blocks, n, i)
        else:
            x = relayout(x, src, _COLUMNS, call.axis)
        return (x, *args[1:]), kwargs

    def prepare_output(self, module, args, kwargs, output, call):
        return self._output(_layout(self.output_layout, call.axis, "Rowwise output_layout"),
                            module, args, kwargs, output, call)

    def _output(self, dst, module, args, kwargs, output, call):
        out = relayout(output, _PARTIAL, dst, call.axis)
        bias = call.params.get("bias")
        return out if bias is None else out + bias


@functools.lru_cache(maxsize=256)     # (made once per embedding, not per call)
def _outside_message(vocab: int, name: str) -> str:
    return (f"{OUTSIDE_VOCAB} [0, {vocab}) reached the vocabulary-parallel embedding "
            f"{name!r}, where the unsharded nn.Embedding raises IndexError (index out of "
            f"range)")


def _check_ids(ids: torch.Tensor, vocab: int, name: str) -> None:
    """Fails, as ``nn.Embedding`` does, for an id outside ``[0, vocab)``: the masks
    below would turn it into a zero row. Checked on the device (``_assert_async``: on
    a GPU no host sync, the error comes at the next one) on the global ids, which
    every rank holds alike; under torch.func's transforms on the plain tensor beneath
    them (vmap has no rule for the assert; torch.compile traces the plain call)."""
    ok = ((ids >= 0) & (ids < vocab)).all()
    msg = _outside_message(vocab, name)
    if not _compile.tracing() and is_functorch_wrapped(ok):
        ok = unwrap_functorch(ok)        # (under vmap: one entry per example)
        with DisableFuncTorch():
            torch._assert_async(ok.all(), msg)
    else:
        torch._assert_async(ok, msg)


class VocabParallelEmbedding(Style):
    """``nn.Embedding`` with its rows (the vocabulary) split over the axis.

    Each rank looks up the ids that fall in its rows, zeroes the others, and the
    partial embeddings are summed: ``output_layout`` ``Replicate()`` (default, one
    all-reduce) or ``Shard(1)`` (reduce-scatter into a sequence-parallel region).
    A ``padding_idx`` keeps its meaning (no gradient for that row). An id outside
    the vocabulary raises, as the unsharded ``nn.Embedding`` does: checked on the
    device, a ``RuntimeError`` on CPU, a device-side assert at the next sync on a GPU.
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
        _check_ids(args[0], getattr(module, "num_embeddings", None)
                   or rows * axis_size(call.axis), call.name)
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
        return relayout(out, _PARTIAL, _layout(self.output_layout, call.axis,
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

    def acts(self, module, axis):
        if not _own_hooks(self, SequenceParallel):
            return super().acts(module, axis)
        return Acts(None, self.prepare_output if self.gather_output else None, call=False,
                    identity_over_one=True)

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

    def acts(self, module, axis):
        if not _own_hooks(self, PrepareInput):
            return super().acts(module, axis)
        return Acts(self.prepare_input, None, call=False)

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

    def acts(self, module, axis):
        if not _own_hooks(self, PrepareOutput):
            return super().acts(module, axis)
        return Acts(None, self.prepare_output, call=False)

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
    "local_columns": PrepareOutput(Replicate(), Shard(-1)),
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
