"""``parallelize``, the entry point of plans: checks the plan against the unsharded
module when asked (``_verify``), then lays it out (``_plans``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..mesh._mesh import Mesh
from ..mesh._spec import P
from ._kept import guard_kept
from ._pp import lay_out_stages, pipelined
from ._plans import Parallelized, _checked_mesh, lay_out_plan
from ._verify import verify_plan

__all__ = ["parallelize"]


def parallelize(module: nn.Module, mesh: Mesh | None = None, plan: dict[str, Any] | str = "auto",
                *, axis: str = "tp", verify: bool = False, distributed_config: Any = None,
                keep_module: bool = True, stages: list[int] | None = None
                ) -> tuple[Parallelized, dict[str, torch.Tensor], dict[str, P]]:
    """Applies a tensor- (and expert-) parallel ``plan`` to ``module`` over ``mesh``.

    **Arguments:** ``module`` – an ordinary ``torch.nn.Module``, the same on every
    rank (its parameters are read, never changed); ``mesh`` – a :class:`Mesh`;
    ``plan`` – ``{module-name pattern: style}``, styles by registered name
    (``"colwise"``, ``"rowwise"``, ``"packed_colwise"``, ``"embedding_rowwise"``,
    ``"sequence_parallel"``, ``"replicated"``, ``"ep_router"``, ...) or as
    ``functp.Style`` objects, all over ``axis``; or plan families by mesh axis,
    ``{"tp": tp_plan, "ep": ep_plan}`` (an axis tuple as key splits over those axes
    together; a module matched in two families is an error); or ``"auto"``: a
    transformers model's own plans: its tensor-parallel plan (``model._tp_plan``,
    style names translated; for GPT-2, which has none, a plan functp ships) over
    ``axis`` when the mesh has it, and, when the mesh has an ``ep`` axis, its
    expert-parallel plan (``model._ep_plan``: the experts as
    :class:`functp.ExpertDispatch` over ``ep``, each tensor-parallel rank
    dispatching its slice of the tokens; the tensor-parallel rules on the experts
    dropped, as transformers does); ``axis`` – the axis of a single plan dict and of
    the tensor-parallel family; ``verify`` – first run :func:`functp.verify_plan`
    on random token ids (a transformers language model): a plan that makes any
    module's output or any gradient differ from the unsharded module raises a
    ``ShardingError`` naming the first such module (with a ``pp`` axis: the plan on
    the whole model over the other axes, before the split into stages);
    ``distributed_config`` –
    transformers' ``DistributedConfig`` (or a dict of its fields) instead of a mesh:
    without ``ep_size`` the mesh is ``("dp_replicate", "fsdp", "tp")``, with FSDP over
    ``fsdp`` (HSDP with ``dp_replicate``); with ``ep_size`` > 1 it is
    ``("dp_replicate", "efsdp", "ep", "tp")``, transformers' dense and expert meshes
    in one: the experts split over ``("ep", "tp")`` (``ep_size`` shards) and
    FSDP-sharded over ``efsdp`` (``fsdp_size x tp_size / ep_size``), the other
    parameters FSDP-sharded over ``("efsdp", "ep")`` (transformers' ``fsdp``), the
    batch over ``("dp_replicate", "efsdp", "ep")``; the plans are ``"auto"``, the
    config's ``tp_plan`` / ``ep_plan`` dicts overriding rules as in transformers.
    FSDP, also as the plan family ``{"fsdp": "auto"}`` and in ``"auto"`` on a mesh
    with an ``fsdp`` axis: every module owning parameters no other family covers gets
    :class:`FullyShard`: each parameter stored split over ``fsdp`` (dim 0 where it
    divides, else its first dimension that does, else replicated:
    ``apply.fsdp_replicated`` says why), all-gathered in the module's forward
    pre-hook; its gradient is the block's, reduce-scattered (and, over
    ``dp_replicate``, all-reduced). ``fsdp`` and ``dp_replicate`` stay batch axes.
    ``fsdp_plan``'s ``free_full_weight``: see :class:`FullyShard` (tape autograd only).
    ``keep_module`` – True (default): the blocks are copies and ``module`` keeps its
    weights, for reference checks against the unsharded model (``verify_plan`` runs
    it). False: parameters held once: a replicated parameter's block *is* the
    module's tensor, a split one's full tensor is released (made meta), and calling
    ``module`` itself raises (``apply`` runs it). A module on the meta device is
    always so: its blocks come back on the meta device with their shapes, for
    :func:`functp.init_blocks` or :func:`functp.from_pretrained` to fill. (An optimizer
    stepping the module's parameters raises, naming the blocks: they never train.)

    **Returns:** ``(apply, params, specs)``: this rank's local blocks (a dict keyed
    by the module's dotted parameter names), their specs, and
    ``apply(params, *args, **kwargs)``, which runs the module with
    ``torch.func.functional_call`` and, only during that call, the plan's hooks.
    Call it inside a ``shard_map`` body; split the batch over ``apply.batch_axes``.
    Parameters no rule covers are replicated; rank 0 warns about them and about
    rules that matched nothing. A module without a rule that shares a weight with
    one the plan splits (a tied embedding) gets the style that splits it the same
    way (``embedding_rowwise`` for an LM head split over the vocabulary), or a
    clear error. Other mesh axes (``dp``) are left to you (replicated over them); a
    ``pp`` axis splits a transformers model into stages (``stages``: layers per stage;
    ``apply`` is then a :class:`functp.PipelineStages`: ``docs/pipelines.md``).

    Model code must take local sizes from tensors (``view(b, s, -1, head_dim)``),
    as transformers' models do, since a rank holds only its heads.

    Example (``torchrun --nproc-per-node 2``)::

        mesh = functp.make_mesh((2,), ("tp",))
        mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        apply, params, specs = functp.parallelize(mlp, mesh, {"0": "colwise", "2": "rowwise"})
        loss = functp.shard_map(lambda p, x: apply(p, x).square().mean(), mesh,
                                in_specs=(specs, P()), out_specs=P())
        grads = torch.func.grad(loss)(params, torch.randn(4, 8))
        apply.unshard(grads)["0.weight"].shape       # (32, 8): the full gradient
    """
    return _laid_out(module, mesh, plan, axis, verify, distributed_config, keep_module, stages)


def _laid_out(module, mesh, plan, axis, verify, distributed_config, keep_module, stages):
    """parallelize's steps: the mesh; pipeline stages on a ``pp`` axis (``_pp``), else
    the plan verified when asked and laid out."""
    mesh, _ = _checked_mesh(module, mesh, distributed_config)
    if pipelined(mesh, stages, distributed_config):
        return lay_out_stages(module, mesh, plan, axis, stages, keep_module, verify)
    if verify:
        verify_plan(module, mesh, plan, axis=axis, distributed_config=distributed_config)
    return guard_kept(*lay_out_plan(module, mesh, plan, axis, distributed_config, keep_module))
