"""A transformers model split into pipeline stages over a ``pp`` axis by its plan.

``parallelize(model, mesh, plan)`` on a mesh whose ``pp`` axis has more than one rank
comes here. transformers' ``_pp_plan`` names the model's parts in order: the
embedding (it reads ``input_ids``), the decoder layers (a ``ModuleList``), and what
follows them (the final norm, the LM head). Each rank builds its own *stage module*:
a shallow copy of the model holding only its stage's decoder layers (under their
global names: ``model.layers.5`` stays ``model.layers.5``), the embedding on the
first stage only, the norm and head on the last only (an ``nn.Identity`` elsewhere,
so the model's own ``forward`` runs unchanged: a later stage is called with
``inputs_embeds=``, the hidden states the previous stage sent). The model's tensor-
parallel plan is laid out on that stage module over the other axes, as
``parallelize`` does for a whole model.

Data-parallel axes beside ``pp`` (``batch_axes``): each row of the mesh along them
pipes its own rows of the batch; the stages' backward leaves their gradients
unreduced over those axes (``shard_map(..., unreduced=)``), and the step sums them
once at its end, a bucket per dtype and split.

An ``fsdp`` axis beside ``pp`` is a data-parallel axis whose ranks also split each
stage's parameters: gathered once a step, reduce-scattered once (``_pp_fsdp.py``).

A tied embedding lives on two stages (the first's embedding, the last's head): each
computes its own use's gradient, and the step adds the two (one exchange between the
first and last rank of ``pp``), so both hold the gradient the unsplit model has.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import optree
import torch
from torch import nn

from ..mesh._mesh import Mesh
from ..mesh._spec import P
from ..ops._collectives import psum, pvary
from ..pipelines._pipeline import pipeline as _pipeline
from ..pipelines._transfer import exchange, gather_rows
from ..runtime._errors import ShardingError
from ..mapping._param_swap import ParamSwap
from ..mapping._sharding import shard, unshard
from . import _pp_fsdp as _fsdp

__all__ = ["PipelineStages", "split_layers", "lay_out_stages", "pipelined"]

_ORDER = ("first", "layers", "last")
# axes whose ranks hold their own part of each sequence (cp), or transformers' config
# name for FSDP (dp_shard; a mesh's is fsdp): not beside pp yet. ``fsdp`` is
# (_pp_fsdp.py), and ``ep``: its ranks pipe their own rows, each its own experts
_NOT_BESIDE = ("dp_shard", "cp")


def pipelined(mesh: Mesh, stages: Any, distributed_config: Any) -> bool:
    """Whether ``parallelize`` splits the model into stages: a ``pp`` axis of more
    than one rank (or ``stages`` given); raises for what pipelines do not take yet."""
    if "pp" not in mesh.axis_names or (mesh.axis_size("pp") == 1 and stages is None):
        return False
    if distributed_config is not None:
        raise ShardingError("parallelize on a mesh with a 'pp' axis: distributed_config= "
                            "is not built for pipelines yet; give the mesh and the plan")
    return True


def split_layers(n: int, stages: int, sizes: Sequence[int] | None = None
                 ) -> list[tuple[int, int]]:
    """The decoder layers ``[start, end)`` of each of ``stages`` (virtual) stages:
    ``sizes`` (layers per stage, as given) or balanced (the first ``n % stages``
    stages one more).

    **Example:** ``split_layers(5, 2)`` is ``[(0, 3), (3, 5)]``."""
    if sizes is None:
        base, extra = divmod(n, stages)
        if base == 0:
            raise ShardingError(
                f"parallelize: {n} decoder layers cannot fill {stages} pipeline stages (each "
                f"needs at least one); use a smaller pp (or virtual stages), or give "
                f"stages= a split with empty stages explicitly")
        sizes = [base + (1 if i < extra else 0) for i in range(stages)]
    sizes = list(sizes)
    if (len(sizes) != stages or any(not isinstance(s, int) or s < 0 for s in sizes)
            or sum(sizes) != n):
        raise ShardingError(
            f"parallelize: stages={sizes!r} must give the number of decoder layers of each "
            f"of the {stages} pipeline stages (pp x virtual stages; non-negative ints) "
            f"summing to the model's {n} layers")
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [(s, s + k) for s, k in zip(starts, sizes)]


def _parts(model: nn.Module) -> dict[str, list[str]]:
    """The model's ``_pp_plan`` as ``{"first": [...], "layers": [name], "last": [...]}``."""
    plan = getattr(model, "_pp_plan", None)
    kind = type(model).__name__
    if not plan:
        raise ShardingError(
            f"parallelize on a mesh with a 'pp' axis: {kind} has no transformers pipeline "
            f"plan (the '_pp_plan' a transformers PreTrainedModel has) to split it into "
            f"stages; write the stage function yourself and run functp.pipeline")
    modules = dict(model.named_modules())
    out: dict[str, list[str]] = {k: [] for k in _ORDER}
    for name, (inputs, _) in plan.items():
        mod = modules.get(name)
        if mod is None:
            raise ShardingError(f"parallelize: {kind}'s _pp_plan names {name!r}, which is "
                                f"not a module of it")
        key = ("layers" if isinstance(mod, nn.ModuleList) else
               "first" if "input_ids" in inputs else "last")
        out[key].append(name)
    if len(out["layers"]) != 1:
        raise ShardingError(f"parallelize: {kind}'s _pp_plan must name one ModuleList of "
                            f"decoder layers, got {out['layers']}")
    return out


def _copy(module: nn.Module) -> nn.Module:
    """A shallow copy whose module, parameter, buffer and hook tables are its own
    (a submodule replaced in the copy is not replaced in ``module``)."""
    new = copy.copy(module)
    for k, v in vars(module).items():
        if isinstance(v, dict):
            new.__dict__[k] = type(v)(v) if not hasattr(v, "default_factory") else copy.copy(v)
    return new


def _stage_module(model: nn.Module, parts: dict, span: tuple[int, int], first: bool,
                  last: bool) -> tuple[nn.Module, list[str]]:
    """This stage's shallow copy of ``model``, and the names of the parts it replaced
    by an ``nn.Identity`` (their plan rules do not apply here)."""
    root = _copy(model)
    copied = {"": root}

    def parent_of(name: str) -> tuple[nn.Module, str]:
        path, _, short = name.rpartition(".")
        mod, walked = root, ""
        for part in (path.split(".") if path else []):
            walked = f"{walked}.{part}" if walked else part
            if walked not in copied:
                copied[walked] = _copy(mod._modules[part])
                mod._modules[part] = copied[walked]
            mod = copied[walked]
        return mod, short

    layers_name = parts["layers"][0]
    parent, short = parent_of(layers_name)
    held = nn.ModuleList()
    for i, layer in enumerate(parent._modules[short]):
        if span[0] <= i < span[1]:
            held.add_module(str(i), layer)       # its global index: names stay the model's
    parent._modules[short] = held
    replaced = []
    for name in parts["first"] if not first else []:
        p, s = parent_of(name)
        p._modules[s] = None                     # the later stages are given inputs_embeds
    for name in parts["last"] if not last else []:
        p, s = parent_of(name)
        p._modules[s] = nn.Identity()
        replaced.append(name)
    return root, replaced


def _check_layer_kinds(model: nn.Module, span: tuple[int, int]) -> None:
    """A model whose decoder loop indexes per-layer kinds by the loop's position
    (``config.layer_types[i]``) would read layer 0's kind for the stage's first layer:
    refused unless the stage's kinds equal those the loop would read."""
    kinds = getattr(getattr(model, "config", None), "layer_types", None)
    if not kinds or span[0] == 0:
        return
    mine, read = list(kinds[span[0]:span[1]]), list(kinds[:span[1] - span[0]])
    if mine != read:
        raise ShardingError(
            f"parallelize: the stage holding decoder layers {span[0]}..{span[1] - 1} of "
            f"{type(model).__name__} has layer kinds {mine}, but the model's forward reads "
            f"kinds by position ({read}); choose stages= so that each stage's layer kinds "
            f"repeat the model's first ones, or write the stage function for functp.pipeline")


def _filtered(families: list, module: nn.Module, replaced: list[str]) -> list:
    """The plan families without the rules that match only the parts this stage
    replaced by an Identity (a head's gather on an Identity would gather activations)."""
    from ._rules import matches_rule
    names = [n for n, _ in module.named_modules()
             if not any(n == r or n.startswith(r + ".") for r in replaced)]
    out = []
    for ax, plan, auto in families:
        if isinstance(plan, dict):
            plan = {k: v for k, v in plan.items() if any(matches_rule(k, n) for n in names)}
        out.append((ax, plan, auto))
    return out


def lay_out_stages(model: nn.Module, mesh: Mesh, plan: Any, axis: str,
                   stages: Sequence[int] | None, keep_module: bool, verify: bool = False
                   ) -> tuple["PipelineStages", Any, Any]:
    """:func:`functp.parallelize` on a mesh with a ``pp`` axis of more than one rank:
    this rank's stage(s) of ``model``, laid out by ``plan`` over the other axes (with
    ``verify``, the plan checked on the whole model over them first)."""
    from ._plans import _families, _lay_out
    parts = _parts(model)
    pp = mesh.axis_size("pp")
    n = len(model.get_submodule(parts["layers"][0]))
    if stages is not None and (not isinstance(stages, (list, tuple)) or len(stages) % pp):
        raise ShardingError(
            f"parallelize: stages={stages!r} must list the decoder layers of each pipeline "
            f"stage: pp={pp} entries (or pp x v, v virtual stages per rank)")
    total = len(stages) if stages is not None else pp
    spans = split_layers(n, total, stages)
    others = [a for a in mesh.axis_names if a != "pp" and a != axis and mesh.axis_size(a) > 1]
    if [a for a in others if a in _NOT_BESIDE]:
        raise ShardingError(
            f"parallelize: a mesh with a 'pp' axis may have the plan's {axis!r} (tensor "
            f"parallel) and data-parallel axes beside it, today; {mesh} has "
            f"{[a for a in others if a in _NOT_BESIDE]}: context parallelism beside a "
            f"pipeline is not built yet ('fsdp' and 'ep' are)")
    me = mesh.coordinate["pp"]
    inner = _stage_mesh(mesh)
    if verify and inner is not None:
        # (the plan on the whole model over the stage's axes, before the split: each
        # stage's modules are the model's own, laid out by the same plan; the stages'
        # sends and receives are exact by construction. On pp alone nothing is split)
        from ._verify import verify_plan
        verify_plan(model, inner, plan, axis=axis)
    applies, params, specs, modules = [], [], [], []
    for j in range(total // pp):
        vs = me + j * pp
        _check_layer_kinds(model, spans[vs])
        module, replaced = _stage_module(model, parts, spans[vs], vs == 0, vs == total - 1)
        if any(a in mesh.axis_names and mesh.axis_size(a) > 1 for a in (axis, "ep")):
            # (FSDP beside pp shards the stage's blocks itself, gathered once a step:
            # not per microbatch, as the FullyShard family would)
            families = [f for f in _families(module, inner, plan, axis, None)
                        if f[0] != "fsdp"]
            families = _filtered(families, module, replaced)
            apply, local, spec = _lay_out(module, inner, families, keep_module)
        else:
            apply, local = _plain(module)
            spec = {k: P() for k in local}
        applies.append(apply)
        modules.append(module)
        params.append(local)
        specs.append(spec)
    split = sorted({a for spec in specs for sp in spec.values() for a in sp.axes}
                   & set(others) - {"ep"})
    if split:
        raise ShardingError(
            f"parallelize: the plan splits parameters over {split}, which a pipeline takes "
            f"as data-parallel axes (each rank its own rows of the batch); beside 'pp' "
            f"only the plan's {axis!r} may split them today")
    out = PipelineStages(model, mesh, inner, applies, spans, axis, specs)
    out.batch_axes = tuple(a for a in mesh.axis_names if a in others)
    out.modules = modules
    if "fsdp" in others:
        params = _fsdp.cut(out, params)
    out._check_tied(params)
    if len(applies) == 1:
        return out, params[0], out.specs[0]
    return out, params, out.specs


def _summed(grads: Any, specs: Any, axes: tuple, scale: float) -> Any:
    """``grads`` summed over ``axes`` and scaled: one all-reduce per dtype and split
    (the blocks split over the same axes flattened into one buffer, as DDP's
    buckets; a buffer's type is its blocks', so split and replicated blocks go apart)."""
    leaves, treedef = optree.tree_flatten(grads)
    kinds = treedef.flatten_up_to(specs)
    by_kind: dict = {}
    for i, (t, spec) in enumerate(zip(leaves, kinds)):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            by_kind.setdefault((t.dtype, spec.axes), []).append(i)
    for (_, split), idx in by_kind.items():
        # (a block split over a batch axis, an expert over ep, holds its whole gradient)
        over = tuple(a for a in axes if a not in split)
        flat = torch.cat([leaves[i].reshape(-1) for i in idx])
        flat = (psum(flat, over) if over else flat) * scale
        for i, piece in zip(idx, flat.split([leaves[i].numel() for i in idx])):
            leaves[i] = piece.view(leaves[i].shape)
    return optree.tree_unflatten(treedef, leaves)


def _plain(module: nn.Module):
    """A stage without a plan: its function over its parameters (functionalize's)."""
    swap = ParamSwap(module)

    def apply(params, *args, **kwargs):
        return swap.call(params, args, kwargs,
                         lambda s: swap.swapped({k: s(v) for k, v in params.items()}))
    return apply, {k: v.detach() for k, v in module.named_parameters()}


def _stage_mesh(mesh: Mesh) -> Mesh | None:
    """The mesh of this rank's stage: the axes other than ``pp`` at this rank's ``pp``
    coordinate, over the full mesh's own groups (no group is made). The stage's plan
    runs in a ``shard_map`` over it: its boundaries and collectives are compared (the
    check mode) among the ranks of one stage, which hold the same blocks, while the
    stages, which hold different ones, meet only in the pipeline's transfers.
    None for a mesh of ``pp`` alone."""
    names = tuple(a for a in mesh.axis_names if a != "pp")
    if not names:
        return None
    from ..mesh._mesh import _agree_check_mode, _subsets
    grid = torch.empty(mesh.axis_sizes, dtype=torch.int64)
    for rank, pos in mesh._positions.items():
        grid[pos] = rank
    grid = grid.select(mesh.axis_names.index("pp"), mesh.coordinate["pp"])
    sub = Mesh.__new__(Mesh)
    dm = mesh.device_mesh[names] if mesh.device_mesh is not None else None
    sub._setup(names, grid, tuple(mesh.coordinate[a] for a in names),
               {frozenset(s): mesh._groups[frozenset(s)] for s in _subsets(names)},
               mesh.device_type, dm)
    sub.timeout = mesh.timeout
    # (a subset of the mesh's ranks: agreed where the mesh is, as in estimate's trace)
    sub._debug_generation = mesh._debug_generation
    # (a norm over it is one stage's: functp.global_norm refuses it, pipeline= is the
    # whole model's)
    sub._stage_of = mesh
    _agree_check_mode(sub)
    return sub


def _tied_names(model: nn.Module, parts: dict) -> tuple[str, str] | None:
    """``(embedding's parameter, head's parameter)`` where the two are one tensor."""
    first = {id(p): f"{m}.{n}" for m in parts["first"]
             for n, p in model.get_submodule(m).named_parameters()}
    for m in parts["last"]:
        for n, p in model.get_submodule(m).named_parameters():
            if id(p) in first:
                return first[id(p)], f"{m}.{n}"
    return None


def _by_rows(fn: Callable, stage_mesh: Mesh, dp: tuple, rows: int) -> Callable:
    """``fn`` given the whole batch: with data-parallel axes ``dp`` beside pp, each of
    their ``rows`` rows of the mesh is handed its own sequences."""
    def run(params, ids, labels):
        if not dp:
            return fn(params, ids, labels)
        n = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.ndim else -1
        if n % rows:
            raise ShardingError(
                f"apply.pipeline: the batch's {n} sequences (input_ids of shape "
                f"{tuple(getattr(ids, 'shape', ()))}) must split evenly over the "
                f"data-parallel axes {list(dp)} ({rows} rows of the mesh), each "
                f"row piping its own; give a batch that is a multiple of {rows}")
        return fn(params, *shard((ids, labels), stage_mesh, P(dp)))   # this row's rows
    return run


class PipelineStages:
    """What :func:`functp.parallelize` returns as ``apply`` on a mesh with a ``pp``
    axis: this rank's stage of the model (``v`` stages with virtual stages).

    **Attributes:** ``stage`` – this rank's index along ``pp``; ``spans`` – every
    virtual stage's decoder layers ``[start, end)`` (virtual stage ``r + j * pp`` is
    chunk ``j`` of rank ``r``); ``chunks`` – this rank's laid-out stage module(s), a
    :class:`Parallelized` each (or a plain function without a tensor-parallel axis);
    ``specs`` – their parameter specs; ``tied`` – the embedding's and head's names of
    a tied embedding, or None; ``batch_axes`` – the data-parallel axes beside ``pp``
    (each of their rows pipes its own rows of the batch; ``fsdp`` among them also
    splits the blocks, ``ep`` the experts), or ``()``; ``fsdp_dims`` – per chunk, each parameter's
    dimension split over ``fsdp`` (None: whole), or None; ``modules`` –
    the stage modules (the model's shallow copies holding the chunks' layers).

    ``apply.pipeline(microbatches=M, loss_fn=..., schedule=...)`` gives the step:
    ``loss, grads = step(params, input_ids, labels)``.
    """

    def __init__(self, model, mesh, inner, applies, spans, axis, specs):
        self.model, self.mesh, self.chunks, self.spans = model, mesh, applies, spans
        #: the mesh of this rank's stage (the axes besides pp), or None
        self.stage_mesh = inner
        self.axis, self.specs = axis, specs
        self.stage = mesh.coordinate["pp"]
        self.virtual_stages = len(applies)
        self.tied = _tied_names(model, _parts(model))
        self.batch_axes = ()
        #: per chunk, each parameter's dimension split over ``fsdp`` (or None), or None
        #: without an ``fsdp`` axis (``_pp_fsdp.py``)
        self.fsdp_dims: list | None = None
        self._transformers = hasattr(model, "config") and hasattr(model, "generation_config")

    def __repr__(self) -> str:
        pp = self.mesh.axis_size("pp")
        mine = [self.spans[self.stage + j * pp] for j in range(self.virtual_stages)]
        return (f"PipelineStages({type(self.model).__name__}, stage {self.stage} of {pp}, "
                f"decoder layers {', '.join(f'{a}..{b - 1}' for a, b in mine)})")

    def __call__(self, params, x, stage: int):
        """Virtual stage ``stage`` on one microbatch: token ids on the first stage,
        hidden states on the others; **Returns:** the next stage's hidden states, or
        the logits on the last. (The ``stage_fn`` of :func:`functp.pipeline`.)"""
        apply = self.chunks[stage // self.mesh.axis_size("pp")]
        if not self._transformers:         # (functp.models.Llama: ids, or inputs_embeds)
            return apply(params, x) if stage == 0 else apply(params, inputs_embeds=x)
        kw = {"input_ids": x} if stage == 0 else {"inputs_embeds": x}
        return apply(params, use_cache=False, **kw).logits

    def _tied_holders(self) -> tuple[int, int]:
        """(rank, chunk) of the embedding's stage and of the head's."""
        pp = self.mesh.axis_size("pp")
        return (0, 0), (pp - 1, self.virtual_stages - 1)

    def _check_tied(self, params: list) -> None:
        """Both holders of a tied embedding must lay out its block alike (the same
        local shape and split dimensions), checked on every rank of ``pp``."""
        if self.tied is None:
            return
        g = self.mesh.axis_group("pp", "parallelize")
        row = [-1.0] * 6
        for (r, j), name in zip(self._tied_holders(), self.tied):
            if r == self.stage:
                t, spec = params[j][name], self.specs[j][name]
                row = [float(t.ndim), *map(float, t.shape[:2]), *[
                    float(bool(spec.dim_axes(d))) for d in range(2)]]
                row += [0.0] * (6 - len(row))
                row[5] = 0.0 if r == 0 else 1.0
        got = [x for x in gather_rows(row, g) if x[0] >= 0]
        if len(got) == 2 and got[0][:5] != got[1][:5]:
            raise ShardingError(
                f"parallelize: the tied embedding {self.tied[0]!r} (first stage) and head "
                f"{self.tied[1]!r} (last stage) are laid out differently over "
                f"{self.axis!r} (local shapes {got[0][1:3]} and {got[1][1:3]}); give both "
                f"the same split (embedding_rowwise with a vocabulary-split head)")

    def pipeline(self, *, microbatches: int, loss_fn: Callable, schedule: str = "1f1b",
                 backward: str = "tape") -> Callable:
        """The training step of this pipeline.

        **Arguments:** as :func:`functp.pipeline` (``loss_fn(logits, labels)``: one
        microbatch's mean loss; ``schedule="interleaved"`` needs the model laid out
        with virtual stages, ``stages=`` of ``pp x v`` entries).

        **Returns:** ``step``; ``loss, grads = step(params, input_ids, labels)`` with
        the whole batch on every rank: the batch's mean loss, and the gradients of
        this rank's blocks (a tied embedding's the sum of both its uses). With
        data-parallel axes (``batch_axes``) each of their rows pipes its own rows of
        the batch (``microbatches`` of those), which must split evenly over them.
        ``step.evaluate(params, input_ids, labels)``: the same loss, forward only
        (:meth:`Pipeline.evaluate`: no activations kept, no backward).

        Example (2 ranks, a transformers Llama)::

            apply, params, specs = functp.parallelize(model, functp.make_mesh((2,), ("pp",)))
            step = apply.pipeline(microbatches=4, loss_fn=lm_loss)
            loss, grads = step(params, ids, labels)
            eval_loss = step.evaluate(params, held_out_ids, held_out_labels)
        """
        v = self.virtual_stages
        if (schedule == "interleaved") != (v > 1):
            raise ShardingError(
                f"apply.pipeline(schedule={schedule!r}): the model was laid out with {v} "
                f"virtual stage(s) per rank; " + (
                    "'interleaved' needs parallelize(..., stages=) with pp x v entries"
                    if v == 1 else "use schedule='interleaved' with virtual stages"))
        inner = _pipeline(self, self.mesh, microbatches=microbatches, schedule=schedule,
                          loss_fn=loss_fn, virtual_stages=v, backward=backward)

        dp = self.batch_axes
        rows = self.stage_mesh.axis_size(dp) if dp else 1
        spec = self.specs if v > 1 else self.specs[0]

        # (fsdp beside pp: the stage's whole weights once a step, and the gradients'
        # one reduce-scatter)
        whole, reduce = _fsdp.around_step(self, spec, lambda g: _summed(g, spec, dp, 1 / rows))

        def body(params, ids, labels):
            loss, grads = inner(whole(params), ids, labels)
            grads = _sum_tied(self, grads)
            if dp:
                # each data-parallel row piped its own rows of the batch: the batch's
                # loss and gradients are the rows' means, the gradients left unreduced
                # by the stages' backward and summed here once (a bucket per dtype)
                # (pvary: the pipeline's closing exchange over pp returns them untyped)
                loss = psum(pvary(loss, dp), dp) / rows
                grads = reduce(pvary(grads, dp))
            return loss, grads

        def evaluated(params, ids, labels):        # (forward only: Pipeline.evaluate)
            loss = inner.evaluate(whole(params), ids, labels)
            return psum(pvary(loss, dp), dp) / rows if dp else loss

        if self.stage_mesh is None:
            body.evaluate = evaluated
            return body
        from ..mapping._shard_map import shard_map
        batch = P(dp) if dp else P()
        mapped = shard_map(body, self.stage_mesh, in_specs=(spec, batch, batch),
                           out_specs=(P(), spec), unreduced=dp)
        mapped_eval = shard_map(evaluated, self.stage_mesh, in_specs=(spec, batch, batch),
                                out_specs=P())
        step = _by_rows(mapped, self.stage_mesh, dp, rows)
        step.evaluate = _by_rows(mapped_eval, self.stage_mesh, dp, rows)
        return step

    def unshard(self, local):
        """This rank's blocks (or their gradients) -> full tensors, per chunk."""
        chunks = local if self.virtual_stages > 1 else [local]
        if self.fsdp_dims is not None:      # the fsdp blocks -> the plan's blocks first
            chunks = [unshard(c, self.stage_mesh, _fsdp.only_fsdp(d, "fsdp"))
                      for c, d in zip(chunks, self.fsdp_dims)]
        out = [a.unshard(c) if hasattr(a, "unshard") else dict(c)
               for a, c in zip(self.chunks, chunks)]
        return out if self.virtual_stages > 1 else out[0]


def _sum_tied(self: PipelineStages, grads):
    """The tied embedding's two gradients added, on both of its holders (``self``: the
    stages)."""
    if self.tied is None:
        return grads
    chunks = grads if self.virtual_stages > 1 else [grads]
    g = self.mesh.axis_group("pp", "functp.pipeline")
    (r0, j0), (r1, j1) = self._tied_holders()
    sends, recvs, mine = [], [], None
    if self.stage in (r0, r1):
        j, name = (j0, self.tied[0]) if self.stage == r0 else (j1, self.tied[1])
        mine = (j, name)
        t = chunks[j][name]
        peer = r1 if self.stage == r0 else r0
        sends, recvs = [(peer, t.detach())], [(peer, tuple(t.shape))]
    # (every rank of pp joins the exchange, in one dtype: its parameters')
    dtype = next((t.dtype for c in chunks for t in optree.tree_leaves(c)
                  if isinstance(t, torch.Tensor) and t.is_floating_point()),
                 torch.get_default_dtype())
    got = exchange(sends, recvs, g, dtype)
    if mine:
        chunks[mine[0]] = dict(chunks[mine[0]])
        chunks[mine[0]][mine[1]] = chunks[mine[0]][mine[1]] + got[0]
    return chunks if self.virtual_stages > 1 else chunks[0]
