"""transformers' plans in functp's terms: the styles only its plans need, its style
names, its models' tensor- and expert-parallel plans read as functp plans (``"auto"``),
the plans functp ships for models that come without one, and its
``DistributedConfig`` resolved into sizes, a mesh and plan overrides.
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

from ..runtime import _world
from ..ops._collectives import axis_size, psum, pvary
from ..runtime._errors import ShardingError, leaf_text
from ..mesh._mesh import Mesh
from ..mesh._layout import uneven
from ..mesh._spec import P
from ._ep import ExpertDispatch
from ._rules import match_plan, matches_rule
from ._style import STYLES, Acts, Style, _own_hooks, register_style
from ._tp import _local_attributes

__all__ = ["LocalSizes", "TensorParallelExperts", "ParameterRules", "SumOutput",
           "ScaleInputByAxisSize"]


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

    def acts(self, module, axis):
        if not _own_hooks(self, TensorParallelExperts):
            return super().acts(module, axis)
        return Acts(None, self.prepare_output, call=False)

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



# -- transformers' style names and plans --------------------------------------------

# transformers' style names -> functp's, where they differ (its old and new names
# are registered functp styles too); None: no functp style yet.
# 'replicated_with_grad_allreduce' and 'mla_kv_a_proj' need nothing more than
# replication: vma sums the gradient of a replicated value that meets split ones.
_HF_STYLES = {
    "rowwise_rep": "rowwise_split_input", "colwise_rep": "colwise_gather_output",
    "replicated_with_grad_allreduce": "replicated", "replicate": "replicated",
    "mla_kv_a_proj": "replicated", "local_params": "replicated",
    "grouped_gemm": None, "ep_dispatch_experts": None,
}
# module styles of transformers' plans that, over rules for the module's own
# parameters, say whether its output is a partial sum (True) or not (False)
_OWNER_STYLES = {"moe_tp_experts": True, "all_reduce": True, "local_params": False}


# Plans functp ships for transformers classes that come without one (GPT-2's Conv1D
# layers store their weights [in, out]: colwise/rowwise split them accordingly).
_GPT2_BLOCKS = {"h.*.attn": "gpt2_attention", "h.*.attn.c_attn": "packed_colwise_qkv",
                "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise",
                "h.*.mlp.c_proj": "rowwise", "wte": "embedding_rowwise"}
_SHIPPED = {"GPT2Model": _GPT2_BLOCKS,
            "GPT2LMHeadModel": {**{f"transformer.{k}": v for k, v in _GPT2_BLOCKS.items()},
                                "lm_head": "colwise_gather_output"}}


def _auto_plan(module: nn.Module, size: int | None = None, override: Any = None,
               exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """transformers' own tensor-parallel plan of ``module`` in functp's styles
    (``override``: a config's ``tp_plan`` dict; ``exclude``: patterns of modules another
    plan family lays out, whose rules and their children's are dropped).

    Rules that name a parameter (``experts.gate_up_proj``, ``self_attn.sinks``) are
    gathered into one :class:`ParameterRules` style for their module, which sums its
    output when the module's own rule says so (``moe_tp_experts``, ``all_reduce``).
    """
    kind = type(module).__name__
    plan = getattr(module, "_tp_plan", None)
    if plan is not None:
        plan = {k: v for k, v in _overridden(plan, override).items()
                if not any(k == e or k.startswith(e + ".") for e in exclude)}
    if plan is None:
        if importlib.util.find_spec("transformers") is None:
            why = "transformers is not installed, and 'auto' reads its models' plans"
        else:
            why = (f"{kind} carries no transformers tensor-parallel plan (the "
                   f"'_tp_plan' a transformers PreTrainedModel has)")
        raise ShardingError(f"parallelize(..., 'auto'): {why}; pass a plan dict "
                            f"{{module-name pattern: style}} instead")
    if not plan and kind in _SHIPPED:
        return dict(_SHIPPED[kind])
    if not plan:
        raise ShardingError(
            f"parallelize(..., 'auto'): transformers gives {kind} no tensor-parallel plan "
            f"(its config's base_model_tp_plan is empty), and functp ships none for it; "
            f"pass a plan dict {{module-name pattern: style}}")
    modules = dict(module.named_modules())
    params = dict(module.named_parameters())
    out: dict[str, Any] = {}
    owned: dict[str, dict[str, str]] = {}        # owner pattern -> {parameter: layout}
    missing = []
    for pattern, style in plan.items():
        on_module = any(matches_rule(pattern, m) for m in modules)
        if not on_module and any(matches_rule(pattern, n) for n in params):
            owner, _, short = pattern.rpartition(".")
            if style in ParameterRules.KINDS:
                if "gate_up" in short and not style.startswith("packed"):
                    # a fused [gate; up] weight: a plain split would give one rank
                    # all of gate (Inkling's plan says 'colwise' for it)
                    style = f"packed_{style}"
                owned.setdefault(owner, {})[short] = style
            else:
                missing.append(f"{pattern!r}: {style!r} (a parameter)")
            continue
        if not on_module:
            continue         # (a rule for layers this configuration lacks is ignored)
        name = _HF_STYLES.get(style, style)
        if name is None or (name not in STYLES and name not in _OWNER_STYLES):
            missing.append(f"{pattern!r}: {style!r}")
        elif name != "local_params":
            out[pattern] = name
    for owner, rules in owned.items():
        reduce = _OWNER_STYLES.get(plan.get(owner))
        contracts = any(k.endswith("rowwise") for k in rules.values())
        if reduce is None and contracts:
            missing.append(f"{owner!r}: its parameters' rules {rules} split a dimension "
                           f"it contracts, and no rule of the plan sums its output")
            continue
        out[owner] = ParameterRules(rules, reduce_output=bool(reduce), strict=False)
    if missing:
        raise ShardingError(
            f"parallelize(..., 'auto'): {kind}'s transformers plan has rules functp cannot "
            f"apply yet: {', '.join(missing)}; pass a plan dict that covers these modules "
            f"with functp styles (see functp.parallelize)")
    out.update(_whole_statistics(module, out))
    out.update(_local_heads(module, out))
    if size is not None:
        out.update(_left_out(module, out, size))
    return out


def _covered(name: str, plan: dict[str, Any]) -> bool:
    return any(matches_rule(r, name) for r in plan)


def _left_out(module: nn.Module, plan: dict[str, Any], size: int) -> dict[str, str]:
    """Megatron rules for the standard parts a transformers plan leaves out, where
    they split exactly over ``size`` ranks: an attention module whose only
    projections are ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (and per-head
    norms), none with a rule, whose heads divide; a shared expert or shared MLP
    (``gate_proj``, ``up_proj``, ``down_proj``) without rules."""
    extra: dict[str, str] = {}
    for name, sub in module.named_modules():
        prefix = name + "." if name else ""
        kids = dict(sub.named_children())
        proj = [kids.get(k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")]
        hd = getattr(sub, "head_dim", None)
        if (all(isinstance(k, nn.Linear) for k in proj) and isinstance(hd, int) and hd > 0
                and not any(_covered(prefix + k, plan) for k in ("q_proj", "k_proj", "v_proj",
                                                                    "o_proj"))
                and not any(p.numel() > hd for k, m in kids.items()
                            if k not in ("q_proj", "k_proj", "v_proj", "o_proj")
                            for p in m.parameters())
                and not any(True for _ in sub.parameters(recurse=False))
                and all(not uneven(m.out_features, hd * size) for m in proj[:3])):
            extra.update({prefix + "q_proj": "colwise", prefix + "k_proj": "colwise",
                          prefix + "v_proj": "colwise", prefix + "o_proj": "rowwise"})
            continue
        last = name.rpartition(".")[2]
        mlp = [kids.get(k) for k in ("gate_proj", "up_proj", "down_proj")]
        if (last in ("shared_expert", "shared_experts", "shared_mlp")
                and all(isinstance(k, nn.Linear) for k in mlp) and len(kids) <= 4
                and not any(_covered(prefix + k, plan) for k in ("gate_proj", "up_proj", "down_proj"))
                and not uneven(mlp[2].in_features, size)):
            extra.update({prefix + "gate_proj": "colwise", prefix + "up_proj": "colwise",
                          prefix + "down_proj": "rowwise"})
    return extra


def _local_heads(module: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """Rules that give a per-head side path of an attention module this rank's heads.

    Doge's attention maps its (split) value heads through a row-parallel ``dt_proj``
    to one number per key/value head, scales it by its own ``A`` (one per head)
    and masks the attention weights of every head with it: ``dt_proj``'s output is
    reduce-scattered over the heads, and ``A`` split, so both match this rank's
    heads."""
    extra: dict[str, Any] = {}
    for name, sub in module.named_modules():
        a, dt = getattr(sub, "A", None), getattr(sub, "dt_proj", None)
        if not (isinstance(a, nn.Parameter) and a.ndim == 1 and isinstance(dt, nn.Linear)
                and dt.out_features == a.shape[0]):
            continue
        rule = next((r for r in plan if matches_rule(r, f"{name}.dt_proj")), None)
        if rule is not None and plan[rule] == "rowwise":
            extra[f"{name}.dt_proj"] = "rowwise_scatter_output"
            extra[name] = ParameterRules({"A": "colwise"})
    return extra


def _whole_statistics(module: nn.Module, plan: dict[str, Any]) -> dict[str, str]:
    """Rules that keep a plan from splitting a dimension a module reduces over.

    Gemma-3n's MLP with ``activation_sparsity > 0`` cuts ``gate_proj``'s output at
    its mean plus a multiple of its standard deviation, taken over the whole
    intermediate dimension: ``gate_proj`` then gathers its output (the statistic is
    global), and ``act_fn``'s output goes back to this rank's columns for the
    column-parallel ``up_proj`` it is multiplied with."""
    extra: dict[str, str] = {}
    for name, sub in module.named_modules():
        if not getattr(sub, "activation_sparsity", 0) or not all(
                isinstance(getattr(sub, c, None), nn.Module) for c in ("gate_proj", "act_fn")):
            continue
        gate = f"{name}.gate_proj"
        rule = next((r for r in plan if matches_rule(r, gate)), None)
        if rule is not None and plan[rule] == "colwise":
            extra[gate] = "colwise_gather_output"
            extra[f"{name}.act_fn"] = "local_columns"
    return extra


# -- transformers' DistributedConfig -------------------------------------------------------

_FSDP_STYLES = ("free_full_weight", "keep_full_weight")
_SIZES = ("tp_size", "ep_size", "fsdp_size", "dp_replicate_size", "pp_size")
_CONFIG_FIELDS = (*_SIZES, "tp_plan", "ep_plan", "fsdp_plan", "enable_expert_parallel",
                  "enable_sequence_parallel", "fsdp_cpu_offload", "fsdp_mixed_precision",
                  "ep_implementation")


def _resolve_config(dc: Any) -> dict[str, Any]:
    """transformers' ``DistributedConfig`` (or a dict of its fields) -> its sizes and plan
    overrides, resolved as transformers resolves them, and checked for what functp does."""
    if isinstance(dc, dict):
        unknown = sorted(set(dc) - set(_CONFIG_FIELDS))
        if unknown:
            raise ShardingError(f"distributed_config: unknown fields {unknown}; the fields of "
                                f"transformers' DistributedConfig are {list(_CONFIG_FIELDS)}")
        raw = dict(dc)
    else:
        raw = {f: getattr(dc, f) for f in _CONFIG_FIELDS if hasattr(dc, f)}
    c = {f: raw.get(f) for f in _CONFIG_FIELDS}
    for f in _SIZES:
        if c[f] is not None and (not isinstance(c[f], int) or c[f] < 1):
            raise ShardingError(f"distributed_config: {f} must be an int >= 1, got {c[f]!r}")
    for f, ok in (("tp_plan", "a dict of rules, 'auto' or None"),
                  ("ep_plan", "a dict of rules or None"), ("fsdp_plan", "a dict of rules or None")):
        if not (c[f] is None or isinstance(c[f], dict) or (f == "tp_plan" and c[f] == "auto")):
            raise ShardingError(f"distributed_config: {f} must be {ok} (transformers' "
                                f"DistributedConfig), got {c[f]!r}")
    for f in ("fsdp_size", "dp_replicate_size", "pp_size"):
        c[f] = c[f] or 1
    if c["tp_size"] is None:      # transformers: the rest of the world when a tp_plan is set
        c["tp_size"] = (_world.process_count() // (c["fsdp_size"] * c["dp_replicate_size"])
                        if c["tp_plan"] is not None else 1)
    if c["enable_expert_parallel"] and c["ep_size"] is None:
        c["ep_size"], c["tp_plan"] = c["tp_size"], {} if c["tp_plan"] is None else c["tp_plan"]
    c["ep_size"] = c["ep_size"] or 1
    refuse = [f"{f}={c[f]!r}" for f in ("fsdp_cpu_offload", "fsdp_mixed_precision") if c[f]]
    # transformers' FSDP styles say whether a module frees its gathered weights after
    # the forward (FullyShard's free=, under tape autograd) or keeps them
    fp = c["fsdp_plan"]
    bad = ({k: v for k, v in fp.items() if v not in _FSDP_STYLES} if isinstance(fp, dict)
           else fp)
    if bad:
        refuse.append(f"fsdp_plan rules {bad!r} (a dict of module patterns to "
                      f"{' or '.join(_FSDP_STYLES)})")
    if c["pp_size"] > 1:
        refuse.append(f"pp_size={c['pp_size']} (functp's pipeline is examples/pipeline.py)")
    if c["ep_implementation"] not in (None, "auto", "all_to_all"):
        refuse.append(f"ep_implementation={c['ep_implementation']!r} (functp dispatches with "
                      f"a ragged all-to-all: 'auto' or 'all_to_all')")
    if refuse:
        raise ShardingError(f"distributed_config: functp does not apply {', '.join(refuse)}; "
                            f"use functp.MixedPrecision for mixed precision")
    tp, ep = c["tp_size"], c["ep_size"]
    if ep > 1 and (ep % tp or (c["fsdp_size"] * tp) % ep):
        raise ShardingError(
            f"distributed_config: ep_size={ep} must be a multiple of tp_size={tp} and divide "
            f"fsdp_size * tp_size = {c['fsdp_size'] * tp} (as in transformers)")
    return c


def _efsdp(c: dict[str, Any]) -> int:
    """transformers' ``efsdp_size``: the ranks holding the same experts, which
    FSDP-shard them (``fsdp_size x tp_size / ep_size``)."""
    return c["fsdp_size"] * c["tp_size"] // c["ep_size"]


def _mesh_for_config(c: dict[str, Any]) -> Mesh:
    """The mesh of a resolved config: without expert parallelism, transformers' axes
    ``("dp_replicate", "fsdp", "tp")``; with it, both of transformers' views of the
    world in one mesh, ``("dp_replicate", "efsdp", "ep", "tp")`` of sizes
    ``(dp_replicate, efsdp, ep / tp, tp)``: transformers' dense ``fsdp`` axis is
    ``("efsdp", "ep")`` and its expert ``ep`` axis is ``("ep", "tp")``, the same
    ranks in the same order as its two row-major device meshes."""
    from ..mesh._mesh import make_mesh
    tp, ep = c["tp_size"], c["ep_size"]
    world = c["dp_replicate_size"] * c["fsdp_size"] * tp
    if world != _world.process_count():
        raise ShardingError(
            f"distributed_config: dp_replicate_size x fsdp_size x tp_size = {world}, but "
            f"{_world.process_count()} processes run; make the sizes multiply to the world size")
    if ep == 1:
        return make_mesh((c["dp_replicate_size"], c["fsdp_size"], tp),
                         ("dp_replicate", "fsdp", "tp"))
    return make_mesh((c["dp_replicate_size"], _efsdp(c), ep // tp, tp),
                     ("dp_replicate", "efsdp", "ep", "tp"))


def _overridden(base: dict | None, override: Any) -> dict:
    """transformers' rule: a dict override updates the model's plan; ``{}`` empties it."""
    base = dict(base or {})
    if isinstance(override, dict):
        return {} if not override else {**base, **override}
    return base



def _check_expert_shards(module: nn.Module, ep_plan: dict, c: dict) -> None:
    """Every expert parameter must split into ``ep_size x efsdp_size`` shards on its
    expert dimension: transformers' FSDP2 pads a short shard, functp does not."""
    shards = c["ep_size"] * _efsdp(c)
    for name, _ in match_plan(module, ep_plan)[0].items():
        for short, p in module.get_submodule(name).named_parameters(recurse=False):
            if p.shape[0] % shards:
                raise ShardingError(
                    f"distributed_config: {leaf_text(f'{name}.{short}', p.shape)} holds "
                    f"{p.shape[0]} experts, which do not split into ep_size x efsdp_size = "
                    f"{c['ep_size']} x {_efsdp(c)} = {shards} shards (efsdp_size = fsdp_size "
                    f"x tp_size / ep_size = {c['fsdp_size']} x {c['tp_size']} / "
                    f"{c['ep_size']}); transformers pads the short FSDP shard, functp does "
                    f"not: pick ep_size and fsdp_size so that {p.shape[0]} divides by "
                    f"fsdp_size x tp_size (ep_size = fsdp_size x tp_size makes efsdp_size 1)")


def _auto_ep_plan(module: nn.Module, style: ExpertDispatch, override: Any) -> dict[str, Any]:
    """transformers' expert-parallel plan in functp's styles: an ``ep_dispatch_experts``
    module is ``style`` (an :class:`ExpertDispatch`, whose parameters, the
    ``grouped_gemm`` rules, it splits on the expert dimension)."""
    kind = type(module).__name__
    plan = _overridden(getattr(module, "_ep_plan", None), override)
    if not plan:
        raise ShardingError(
            f"parallelize(..., 'auto'): the mesh has an 'ep' axis, but {kind} has no "
            f"expert-parallel plan (transformers' base_model_ep_plan); use a mesh without "
            f"'ep' (name a data-parallel axis 'dp'), or pass plan families {{'ep': ...}}")
    dispatch = {p for p, s in plan.items() if s == "ep_dispatch_experts"}
    out, missing = {}, []
    for pattern, name in plan.items():
        if name == "ep_dispatch_experts":
            out[pattern] = style
        elif not (name == "grouped_gemm" and pattern.rpartition(".")[0] in dispatch):
            missing.append(f"{pattern!r}: {name!r}")
    if missing:
        raise ShardingError(
            f"parallelize(..., 'auto'): {kind}'s expert-parallel plan has rules functp cannot "
            f"apply yet: {', '.join(missing)} (functp applies 'ep_dispatch_experts' and the "
            f"'grouped_gemm' parameters of such a module); pass plan families instead")
    return out


for _name, _style in {
    "moe_tp_experts": TensorParallelExperts(),
    "gpt2_attention": LocalSizes("split_size"),
    "all_reduce": SumOutput(),
    "moe_identity_expert": ScaleInputByAxisSize(),
}.items():
    register_style(_name, _style)
