"""Plans applied: ``parallelize`` lays a plan's rules (``_rules``) out over a mesh as
parameter specs, this rank's blocks and module hooks, and returns the
:class:`Parallelized` ``apply`` that runs the module under them.

A plan is one dict of rules over one axis or plan families by mesh axis
(``{"tp": ..., "ep": ..., "fsdp": "auto"}``); ``"auto"`` reads a transformers
model's own plans (``_hf``).
"""
from __future__ import annotations

import contextlib
import functools
import re
import warnings
from typing import Any

import torch
from torch import nn

from ..runtime import _compile, _world
from ..ops import _context
from ..ops._collectives import axis_size
from ..runtime._errors import ShardingError, leaf_text
from ..runtime._torch_compat import peek_interpreter_stack
from ..mesh._mesh import Mesh
from ..mesh._layout import require_divisible, uneven
from ..mapping._param_swap import ParamSwap
from ..mapping._sharding import unshard
from ..mapping._state_dict import module_state_dict
from ..mesh._spec import P, normalize_spec
from . import _replayed
from ._fsdp_style import FullyShard
from ._hooks import CallState, PlanHook
from ._kept import changed_error, structure
from ._style import Style
from ._ep import ExpertDispatch
from ._rules import _param_specs, _tied_styles, match_plan, matches_rule
from ._hf import (_auto_ep_plan, _auto_plan, _check_expert_shards, _efsdp, _mesh_for_config,
                  _overridden, _resolve_config)
from ._tp import OUTSIDE_VOCAB, Replicated
from ._cp import context_parallel_of

__all__ = ["Parallelized", "lay_out_plan"]


def _generic(name: str) -> str:
    """``layers.3.mlp.weight`` -> ``layers.*.mlp.weight``: one line per layer kind."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)


def _warn_plan(module: nn.Module, unused: list[str], uncovered: list[str], axis: str,
               params: dict) -> None:
    if _world.process_index() != 0:
        return
    kind = type(module).__name__
    if unused:
        hints = [r for r in unused if any(matches_rule(r, p) for p in params)]
        hint = (f" (rules name modules, not parameters: {hints} name parameters; "
                f"drop the last component)" if hints else "")
        warnings.warn(f"functp.parallelize: plan rules that matched no module of {kind}: "
                      f"{unused}{hint}", stacklevel=3)
    if uncovered:
        names = list(dict.fromkeys(_generic(n) for n in uncovered))
        warnings.warn(f"functp.parallelize: parameters of {kind} that no plan rule covers "
                      f"(kept replicated over '{axis}'; add a rule such as 'replicated' to "
                      f"silence this): {names}", stacklevel=3)


def _refuse_released(apply, module: nn.Module, args: Any) -> None:
    """Calling the module itself once its weights were released would run on meta
    tensors and return shapes without values: an error instead."""
    if apply.released and apply._call.params is None:
        raise ShardingError(
            f"{type(module).__name__} was called directly, but its weights were "
            f"released: they live in the blocks that parallelize/from_pretrained "
            f"returned; call apply(params, ...) inside a shard_map body, or keep a "
            f"full model for reference checks")


def _batch_axes(mesh: Mesh, specs: dict, owners: dict, hooked: list) -> tuple:
    """The mesh axes whose ranks hold their own tokens: those no rule splits a
    parameter over, or only an expert dispatch or FSDP does, less the axes an expert
    dispatch's tokens are shared over."""
    # an expert dispatch or a fully sharded module splits its parameters over an
    # axis whose ranks hold their own tokens: those stay batch axes
    batchlike = (ExpertDispatch, FullyShard)
    model = {a for n in owners if not isinstance(owners[n][1], batchlike)
             for a in specs[n].axes}
    model |= {a for h in hooked if not isinstance(h[2], batchlike) for a in _axes_of(h[4])}
    # the axes an expert dispatch's tokens are replicated over (tp) hold one batch
    model |= {a for h in hooked if isinstance(h[2], ExpertDispatch) for a in h[2].shared}
    return tuple(a for a in mesh.axis_names if a not in model)


class Parallelized:
    """The ``apply`` returned by :func:`parallelize`: ``apply(params, *args, **kwargs)``
    runs the module on local blocks inside a ``shard_map`` body, with the plan's
    collectives at module boundaries.

    ``apply.specs`` / ``apply.styles`` give each parameter's spec and rule;
    ``apply.axes`` the plan axis (or axis tuple) of each covered parameter;
    ``apply.batch_axes`` the mesh axes to split the batch over (those no rule splits
    a parameter over, or only an expert dispatch or FSDP does, less the axes an
    expert dispatch's tokens are ``shared`` over);
    ``apply.split_share`` the share of parameter elements the plan splits;
    ``apply.shard(full)`` turns canonical full parameters into this rank's blocks and
    ``apply.unshard(blocks)`` (parameters or their gradients) turns blocks back into
    canonical full tensors: packed weights come back as ``[gate; up]``, not as the
    per-rank interleaving that a plain :func:`functp.unshard` would give;
    ``apply.state_dict(blocks)`` has every key ``module.state_dict()`` has (tied ones).
    ``apply.replay``: vma decided once per call signature and replayed at the plan's
    boundaries (``docs/fast.md``; False: every op tracked on every call).
    """

    def __init__(self, module: nn.Module, mesh: Mesh, axis: Any, specs: dict[str, P],
                 owners: dict[str, tuple[str, Style]], hooked: list, withheld: list[str],
                 axes: dict[str, Any] | None = None, planned: list | None = None):
        self.module, self.mesh, self.axis, self.specs = module, mesh, axis, specs
        #: the plan axis (or axis tuple) of each covered parameter
        self.axes = dict(axes or {n: axis for n in owners})
        # (each checked against the shard_map's mesh on every call)
        self._plan_axes = tuple(a for a in dict.fromkeys([axis, *self.axes.values(), *(
            h[4] for h in (hooked if planned is None else planned))]) if a is not None)
        #: the mesh axes to split the batch over: those that only an expert dispatch
        #: or FSDP uses, or none (tensor-parallel axes hold the same tokens)
        self.batch_axes = _batch_axes(mesh, specs, owners, hooked)
        self.styles = {n: owners[n][0] if n in owners else "not covered" for n in specs}
        sizes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        #: parameters an FSDP family kept replicated, with the reason
        self.fsdp_replicated = {n: owners[n][1].reason(sizes[n]) for n in owners
                                if isinstance(owners[n][1], FullyShard) and not specs[n].axes}
        self._owners, self._hooked = owners, hooked
        sizes = {n: p.numel() for n, p in module.named_parameters()}
        split = sum(sizes[n] for n, s in specs.items() if n in sizes and s.axes)
        #: the share of the module's parameter elements the plan splits over ``axis``
        self.split_share = split / max(sum(sizes.values()), 1)
        self._withheld = withheld
        #: the first call records the union rule's decisions, later calls replay them
        self.replay = True
        self._records = _replayed.Records(module)
        # (a transformers config's output fields key a replay; a module changed since
        # it was laid out is refused)
        self._config_key, self._structure = _replayed.config_key(module), structure(module)
        # the hooks are registered once, here, and act only while __call__ runs:
        # registering them per call cannot be traced by torch.compile. Each planned
        # module gets a PlanHook, which registers a module hook only where its style
        # acts (Style.acts) or an action is added (add_pre)
        self._call = CallState()
        self._released = self._refusing = False
        #: name -> the :class:`PlanHook` of each module a plan rule covers: where
        #: its boundary work during ``apply`` happens
        self.plan_hooks: dict[str, PlanHook] = {}
        for name, mod, style, pmap, ax in (hooked if planned is None else planned):
            self.plan_hooks.setdefault(name, PlanHook(name, mod, style, pmap, ax, self._call,
                                                      ax and mesh.axis_size(ax)))
        # the parameters' places in the module, found once (functional_call's work)
        self._swap = ParamSwap(module)
        # (parallel/_replayed: the modules owning each parameter slot, found once, and
        # those given a pre-hook that makes their parameters' gradient launch points)
        self._owner_of: dict | None = None
        self._hooked_use: set = set()
        self.context_parallel = None      #: parallel/_cp's ContextParallel on a cp axis

    def __repr__(self) -> str:
        return (f"Parallelized({type(self.module).__name__} over '{self.axis}' of {self.mesh}, "
                f"{len(self.specs)} parameters, {len(self._hooked)} hooked modules, "
                f"{self.split_share:.0%} of parameter elements split)")

    @property
    def released(self) -> bool:
        """The module's split parameters were released (made meta): only ``apply`` runs
        it; calling the module itself raises (see :func:`functp.from_pretrained`)."""
        return self._released

    @released.setter
    def released(self, value: bool) -> None:
        self._released = bool(value)
        if self._released and not self._refusing:
            # (registered only now: a module hook, even one doing nothing, takes every
            # call of the module through torch's slower hook path)
            self.module.register_forward_pre_hook(functools.partial(_refuse_released, self))
            self._refusing = True

    def replay_status(self) -> list[str]:
        """How the calls so far decide vma, one line per call signature (grad mode and
        the arguments' vmas): ``"replayed"`` where later calls replay the first call's
        decisions at the plan's boundaries, else ``"decided per op: "`` and why.

        Example::

            apply.replay_status()     # ['replayed'] after one step of a plain TP model
        """
        return ["replayed" if r.why is None else f"decided per op: {r.why}"
                for r in self._records.values()]

    def _style(self, name: str) -> Style:
        return self._owners[name][1] if name in self._owners else _REPLICATED

    def __call__(self, params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        _check_call(self)
        if self.context_parallel is not None:       # (whole sequences in: parallel/_cp)
            return self.context_parallel(self, params, args, kwargs)
        return _replayed.call(self, params, args, kwargs, lambda p: self._run(p, args, kwargs))

    def _run(self, params: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """The module on ``params`` with the plan's hooks on."""
        call_params = dict(params)
        for name, zero in self._withheld:      # (a module that cannot take None: zeros)
            call_params[name] = torch.zeros_like(params[name]) if zero else None
        state = self._call
        state.params, state.exits = params, []
        try:
            # (the parameters swapped in where they were found at the first call)
            return self._swap.call(call_params, args, kwargs,
                                   functools.partial(self._again, params, call_params))
        except ShardingError:
            raise
        except (RuntimeError, ValueError, IndexError) as e:
            if str(e).startswith(OUTSIDE_VOCAB):
                raise           # the input's fault, as in the unsharded model
            raise _failure(self, e) from e
        finally:
            exits = state.exits
            state.params, state.exits, state.stacks = None, None, {}
            for fn in reversed(exits):
                fn()

    @contextlib.contextmanager
    def _again(self, params: dict, call_params: dict, swap):
        """For a ``functp.checkpoint`` inside the module, whose recompute runs in the
        backward, after this call returned: the call's parameters swapped in again
        (each through the recompute's ``swap``) and the hooks on while it runs."""
        state = self._call
        was = state.params, state.exits, state.stacks
        state.params, state.exits, state.stacks = (
            {k: swap(v) for k, v in params.items()}, [], {})
        try:
            with self._swap.swapped({k: swap(v) for k, v in call_params.items()}):
                yield
        finally:
            exits = state.exits
            state.params, state.exits, state.stacks = was
            for fn in reversed(exits):
                fn()

    def shard(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical full tensors (keyed by parameter name) -> this rank's blocks."""
        return {k: self._style(k).shard_param(k, v, self.specs[k], self.mesh,
                                              self.axes.get(k, self.axis))
                for k, v in full.items()}

    def unshard(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Blocks (parameters or gradients) -> canonical full tensors (tied: once)."""
        gathered = unshard(local, self.mesh, {k: self.specs[k] for k in local})
        return {k: self._style(k).unshard_param(
                    k, v, self.specs[k], self.mesh.axis_size(self.axes.get(k, self.axis))
                    if k in self.axes or self.axis is not None else 1)
                for k, v in gathered.items()}

    def state_dict(self, local: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The blocks of every parameter -> every key of ``module.state_dict()`` (a tied
        name: its parameter's full tensor; a buffer: the module's), on every rank, for
        ``module.load_state_dict(apply.state_dict(params))`` (strict)."""
        return module_state_dict(self.module, self.unshard(local), "apply.state_dict")


def _check_call(apply: Parallelized) -> None:
    """Raises unless ``apply`` may run here: in a shard_map over its mesh, on the
    module it laid out, not inside itself."""
    kind = type(apply.module).__name__
    fr = _context.top()
    if fr is not None and fr.mesh is not apply.mesh:
        _same_mesh(apply, fr.mesh)
    # (not while torch.compile traces, Dynamo or AOTAutograd running the body on fake
    # tensors: the module's identity is fixed there, a guard on it would recompile
    # nothing but cost, and a kept parameter's .grad is not the eager one's)
    if apply._structure is not None and not _compile.tracing():
        what = apply._structure.changed()
        if what is not None:
            raise changed_error(apply.module, what)
    for ax in apply._plan_axes:
        # raises a clear error outside a shard_map body, or where ``ax`` is not manual
        # (its size is the mesh's: the mesh was checked above)
        axis_size(ax)
    if apply._call.params is not None:
        raise ShardingError(f"apply of parallelize({kind}) was called from inside itself; "
                            f"call it once per forward")


def _same_mesh(apply: Parallelized, mesh: Mesh) -> None:
    """Raises unless ``mesh`` (the running shard_map's) lays the ranks out as the mesh
    ``apply`` was built on: the plan's groups and the replay's record are that mesh's;
    a mesh with the same sizes and its axes in another order puts other ranks
    together under each name."""
    built = apply.mesh
    if (mesh.axis_names == built.axis_names and mesh.axis_sizes == built.axis_sizes
            and mesh._positions == built._positions):
        return
    raise ShardingError(
        f"apply of parallelize({type(apply.module).__name__}) was built on the mesh "
        f"{built!r} (axes {built.axis_names}) but runs in a shard_map over the mesh "
        f"{mesh!r} (axes {mesh.axis_names}), which lays the ranks out otherwise; "
        f"parallelize with the shard_map's mesh, or run the shard_map over the mesh "
        f"apply was built on")


def _release(apply: Parallelized) -> dict[str, torch.Tensor]:
    """Blocks held once: a replicated parameter's block is the module's own tensor;
    a split one's block is cut out and the module's parameter (under every tied
    name) made meta, so that the full tensor can be freed. The module then runs
    only under ``apply``."""
    local, meta = {}, {}
    for name, p in apply.module.named_parameters():
        spec = apply.specs[name]
        if p.is_meta or not spec.axes:
            local[name] = p.detach()
            if p.is_meta:
                local[name] = apply.shard({name: local[name]})[name]
            continue
        local[name] = apply.shard({name: p.detach()})[name]
        meta[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for mod in apply.module.modules():
        for short, p in list(mod._parameters.items()):
            if p is not None and id(p) in meta:
                mod._parameters[short] = meta[id(p)]
    apply.released = True
    return local


def _failure(apply: Parallelized, e: BaseException) -> ShardingError:
    """A raw error from inside the module under the plan, as a ShardingError
    naming the innermost module of ``apply.module`` that was running and the
    plan's rules inside it (a shape mismatch there means the plan split one of
    the values it combines and not the other)."""
    names = {id(m): n for n, m in apply.module.named_modules()}
    where, tb = None, e.__traceback__
    while tb is not None:
        obj = tb.tb_frame.f_locals.get("self")
        if id(obj) in names:
            where = names[id(obj)]
        tb = tb.tb_next
    if where is None:
        where = ""
    prefix = where + "." if where else ""
    rules = {}
    for pname, (desc, _) in apply._owners.items():
        if pname.startswith(prefix):
            rules.setdefault(pname.rpartition(".")[0], desc)
    shown = "; ".join(f"{m!r}: {r}" for m, r in list(rules.items())[:8]) or "none"
    mod = apply.module.get_submodule(where) if where else apply.module
    raised = (f"module {where or '(the root)'!r} ({type(mod).__name__}) raised "
              f"{type(e).__name__} under the plan: "
              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}. ")
    if "saved tensor hooks" in str(e) and peek_interpreter_stack() is not None:
        # torch.utils.checkpoint (and other saved-tensor hooks) under torch.func: the
        # plan is not the cause, the unsharded model raises the same
        return ShardingError(
            raised + "torch.func's grad/vjp/jacrev take no saved-tensor hooks, which "
            "torch.utils.checkpoint (use_reentrant=False) records with; the plan is "
            "not the cause (the unsharded model raises the same). Use "
            "functp.checkpoint(fn)(x) for the checkpointed layers (it recomputes under "
            "torch.func, FSDP's gathers included), or differentiate with tape autograd "
            "(loss.backward())")
    return ShardingError(
        raised + f"The plan's rules inside it: {shown}. A module that combines a value "
        f"the plan splits (its heads, its columns) with one it does not fails so; give "
        f"that module's children rules that split both the same way, or 'replicated' "
        f"(if the unsharded module raises the same error, the plan is not the cause)"
        + (_local_sizes_advice(apply, mod, where) if rules else ""))


def _local_sizes_advice(apply: Parallelized, mod: nn.Module, where: str) -> str:
    """The other cause of a shape error in a module whose children the plan splits:
    its code reads a full size where a rank holds a part (what :class:`LocalSizes`
    fixes for sizes kept in attributes)."""
    prefix = where + "." if where else ""
    sizes = {apply.mesh.axis_size(a) for n, a in apply.axes.items()
             if n.startswith(prefix) and isinstance(a, str)}
    # integer attributes a split would divide: candidates for LocalSizes
    names = [k for k, v in vars(mod).items() if type(v) is int and v > 1
             and not k.startswith("_") and all(v % n == 0 for n in sizes)][:4]
    example = ", ".join(repr(k) for k in names) or "'n_embd', 'n_head'"
    return (f". A module that reads a full size where a rank holds a part fails so too: "
            f"`B, T, C = x.size()` of its replicated input, or size attributes "
            f"(`self.n_embd`, `self.n_head`) used to split or view the split values; read "
            f"local sizes from the split tensors (`.view(B, T, -1)`, `.chunk(3, dim=-1)`), "
            f"or, for sizes kept in attributes, give the module itself the rule "
            f"functp.LocalSizes({example}): it divides them by the axis size during the "
            f"module's call")


_REPLICATED = Replicated()


def _axes_of(ax: Any) -> tuple:
    return ax if isinstance(ax, tuple) else () if ax is None else (ax,)


def _check_heads(root: nn.Module, name: str, x: torch.Tensor, spec: P, mesh: Mesh,
                 desc: str) -> None:
    """A projection inside an attention module (one with an integer ``head_dim``, as
    transformers' and functp's have) must split whole heads: 2 key/value heads of 64
    rows each do divide 128 rows over 4 ranks, but each rank would hold half a head."""
    mname = name.rpartition(".")[0]
    parent = root.get_submodule(mname.rpartition(".")[0]) if "." in mname else root
    hd = getattr(parent, "head_dim", None)
    if not isinstance(hd, int) or hd < 1:
        return
    for d in range(len(spec)):
        axes = spec.dim_axes(d)
        if not axes or uneven(x.shape[d], hd):
            continue
        heads, n = x.shape[d] // hd, mesh.axis_size(axes)
        if uneven(heads, n):
            raise ShardingError(
                f"{leaf_text(f'parameter {name!r}', x.shape, spec)}, plan rule {desc}: "
                f"dimension {d} holds {heads} heads of {hd} (head_dim of "
                f"{mname.rpartition('.')[0] or 'the model'!r}), which do not split over "
                f"{n} ranks of {axes}; use a '{'/'.join(axes)}' size that divides {heads}, "
                f"or give {mname!r} the 'replicated' style (key/value heads of GQA often "
                f"need it)")


def _check_divisible(name: str, x: torch.Tensor, spec: P, mesh: Mesh, desc: str) -> None:
    # (a packed dimension, a fused gate/up or qkv, splits each of its blocks)
    fix = ("(each block's heads, experts or hidden size divisible by {n})" if spec.packed else
           "(a vocabulary padded so, as Megatron's make-vocab-size-divisible-by), or choose "
           "heads, experts or hidden sizes divisible by {k}")
    require_divisible(f"parameter {name!r}", x.shape, spec, mesh,
                      f"{fix}, or give that module the 'replicated' style; plan rule {desc}")


def lay_out_plan(module: nn.Module, mesh: Mesh | None, plan: dict[str, Any] | str,
                 axis: str = "tp", distributed_config: Any = None, keep_module: bool = True
                 ) -> tuple[Parallelized, dict[str, torch.Tensor], dict[str, P]]:
    """:func:`functp.parallelize` without its ``verify`` step (which runs this)."""
    mesh, config = _checked_mesh(module, mesh, distributed_config)
    rules, cp = context_parallel_of(module, mesh, plan)
    families = _families(module, mesh, rules, axis, config)
    apply, local, specs = _lay_out(module, mesh, families, keep_module)
    if cp is not None:       # the sequence split over cp: not a batch axis
        apply.context_parallel = cp.bind(module, mesh, specs)
        apply.batch_axes = tuple(a for a in apply.batch_axes if a != cp.axis)
    # (what laid it out: functp.resize_token_embeddings lays the resized module out so)
    apply._laid_out = dict(plan=plan, axis=axis, distributed_config=distributed_config,
                           keep_module=keep_module)
    return apply, local, specs


def _checked_mesh(module: nn.Module, mesh: Mesh | None, distributed_config: Any
                  ) -> tuple[Mesh, dict | None]:
    """parallelize's mesh (given, or made from the config) and resolved config."""
    if not isinstance(module, nn.Module):
        raise ShardingError(f"parallelize: expected a torch.nn.Module, got {type(module).__name__}")
    config = None
    if distributed_config is not None:
        config = _resolve_config(distributed_config)
        mesh = mesh if mesh is not None else _mesh_for_config(config)
    if not isinstance(mesh, Mesh):
        raise ShardingError(f"parallelize: mesh must be a functp.Mesh (functp.make_mesh), got "
                            f"{mesh!r}; or pass distributed_config=")
    return mesh, config


def _families(module: nn.Module, mesh: Mesh, plan: Any, axis: str, config: dict | None
              ) -> list[tuple[Any, dict, bool]]:
    """``[(axis or axis tuple, plan dict, auto)]``: the plan families to apply."""
    if isinstance(plan, str) and plan == "auto":
        return _auto_families(module, mesh, axis, config)
    if config is not None:
        raise ShardingError("parallelize(..., distributed_config=...): the plans come from the "
                            "config (its tp_plan / ep_plan) and the model; pass plan='auto'")
    if isinstance(plan, str):
        raise ShardingError(f"parallelize: plan must be a dict of rules or 'auto', got {plan!r}")
    if isinstance(plan, dict) and plan and all(isinstance(v, (dict, FullyShard)) or v == "auto"
                                               for v in plan.values()):
        for ax in plan:
            for a in (ax if isinstance(ax, tuple) else (ax,)):
                if a not in mesh.axis_names:
                    raise ShardingError(
                        f"parallelize: plan family {ax!r} names no axis of {mesh}; key plan "
                        f"families by mesh axes ({mesh.axis_names}) or axis tuples")
            if isinstance(plan[ax], FullyShard) and plan[ax].size != mesh.axis_size(ax):
                raise ShardingError(
                    f"parallelize: plan family {ax!r}: {plan[ax]!r} is for an axis of size "
                    f"{plan[ax].size}, but {ax!r} has size {mesh.axis_size(ax)} in {mesh}")
            if plan[ax] == "auto" and ax != "fsdp":
                raise ShardingError(
                    f"parallelize: plan family {ax!r}: 'auto' is the FSDP family's value "
                    f"({{'fsdp': 'auto'}}); give {ax!r} a dict of rules, or pass plan='auto'")
        return [(ax, _fsdp_style(mesh, module) if fam == "auto" else fam, False)
                for ax, fam in plan.items()]
    _need_axis(mesh, axis)
    return [(axis, plan, False)]


def _fsdp_style(mesh: Mesh, module: nn.Module | None = None, override: Any = None
                ) -> FullyShard:
    """The FSDP family's style over ``fsdp``, replicated over ``dp_replicate`` (HSDP)
    when the mesh has it, freeing gathered weights where the model's ``fsdp_plan``
    (transformers', with a config's ``fsdp_plan`` over it) says ``free_full_weight``."""
    return FullyShard(mesh.axis_size("fsdp"), ("dp_replicate",)
                      if "dp_replicate" in mesh.axis_names else (),
                      free=_fsdp_plan(module, override))


def _fsdp_plan(module: nn.Module | None, override: Any) -> dict:
    """The model's ``fsdp_plan`` (transformers'), with a config's ``fsdp_plan`` over it."""
    return _overridden(getattr(module, "fsdp_plan", None), override)


def _fsdp_rules(module: nn.Module, style: FullyShard, matched: dict) -> dict[str, Style]:
    """The FSDP family: every module that owns parameters and that no other family's
    rule splits (no rule, or 'replicated'), nor a parameter tied to one such a rule
    lays out -> ``style``."""
    split = {m for m, v in matched.items() if not _plain_replicated(v[2])}
    taken = {id(p) for m in split for p in module.get_submodule(m).parameters(recurse=False)}
    rules = {}
    for name, mod in module.named_modules():
        own = list(mod.parameters(recurse=False))
        if own and name not in split and not any(id(p) in taken for p in own):
            rules[name] = style
    return rules


def _plain_replicated(style: Style) -> bool:
    return type(style) is Replicated


def _need_axis(mesh: Mesh, axis: str) -> None:
    if axis not in mesh.axis_names:
        raise ShardingError(
            f"parallelize: axis {axis!r} is not an axis of {mesh}; pass axis= one of "
            f"{mesh.axis_names}")


def _match_families(module: nn.Module, families) -> tuple[dict, list]:
    """name -> (rule, label, style, axis) over all families; a module two families
    match is an error. Also the (family axis, unused rules) pairs."""
    matched: dict[str, tuple] = {}
    unused = []
    # the FSDP family covers what the others leave: matched last
    for ax, plan, auto in sorted(families, key=lambda f: isinstance(f[1], FullyShard)):
        if isinstance(plan, FullyShard):
            plan = _fsdp_rules(module, plan, matched)
        got, left = match_plan(module, plan)
        for name, (rule, label, style) in got.items():
            if name in matched and not (isinstance(style, FullyShard)
                                        and _plain_replicated(matched[name][2])):
                raise ShardingError(
                    f"module {name!r} is matched by rule {matched[name][0]!r} of the "
                    f"{matched[name][3]!r} plan and by rule {rule!r} of the {ax!r} plan; a "
                    f"module takes one rule: drop one of them")
            matched[name] = (rule, label, style, ax)
        if not auto:
            unused.append((ax, left))
    return matched, unused


class _Layout:
    """The specs, owners, hooks and withheld parameters ``parallelize`` builds."""

    def __init__(self, module: nn.Module, mesh: Mesh):
        self.module, self.mesh = module, mesh
        self.full = dict(module.named_parameters())                 # tied parameters once
        self.canon = {id(p): n for n, p in self.full.items()}
        self.specs: dict[str, P] = {}
        self.owners: dict[str, tuple[str, Style]] = {}
        self.axes: dict[str, Any] = {}
        self.hooked: list = []
        self.planned: list = []
        self.withheld: list = []

    def take(self, mname: str, rule: str, label: str, style: Style, axis) -> None:
        mod = self.module.get_submodule(mname)
        prefix = mname + "." if mname else ""
        own = dict(mod.named_parameters(recurse=False))
        pspecs = _param_specs(style, mod, axis, own, f"plan rule {rule!r} -> {label} on "
                              f"module {mname!r}")
        for short, spec in pspecs.items():
            c = self.canon[id(own[short])]
            spec = normalize_spec(spec, self.mesh.axis_names,
                                  f"plan rule {rule!r} -> {label} for parameter {prefix + short!r}",
                                  own[short].shape)
            if c in self.specs and self.specs[c] != spec:
                raise ShardingError(
                    f"{leaf_text(f'parameter {c!r}', own[short].shape)} is tied to "
                    f"{prefix + short!r}, and the plan lays it out as {self.specs[c]!r} "
                    f"({self.owners[c][0]}) there but {spec!r} ({label}) here; give both "
                    f"modules styles that split the shared weight the same way")
            self.specs[c] = spec
            self.owners.setdefault(c, (f"{rule!r} -> {label}", style))
            self.axes.setdefault(c, axis)
        self.withheld.extend((prefix + s, not isinstance(mod, nn.Linear))
                             for s in style.withheld(mod))
        planned = (mname, mod, style, {s: self.canon[id(p)] for s, p in own.items()}, axis)
        self.planned.append(planned)
        if style.has_hooks():
            self.hooked.append(planned)


def _lay_out(module: nn.Module, mesh: Mesh, families, keep_module: bool = True
             ) -> tuple[Parallelized, dict, dict]:
    matched, unused = _match_families(module, families)
    lay = _Layout(module, mesh)
    for mname, (rule, label, style, ax) in matched.items():
        lay.take(mname, rule, label, style, ax)
    by_axis: dict[Any, dict] = {}
    for mname, m in matched.items():
        by_axis.setdefault(m[3], {})[mname] = m[:3]
    for ax, group in by_axis.items():
        for mname, (rule, label, style) in _tied_styles(module, group, lay.specs, lay.canon,
                                                        mesh, ax).items():
            lay.take(mname, rule, label, style, ax)
    uncovered = [n for n in lay.full if n not in lay.specs]
    specs = {n: lay.specs.get(n, P()) for n in lay.full}
    for style in {id(h[2]): h[2] for h in lay.hooked if isinstance(h[2], FullyShard)}.values():
        style.plan_groups(module)       # (its gather groups: the FSDP units of this model)
    for n, p in lay.full.items():
        desc = lay.owners[n][0] if n in lay.owners else "(none)"
        _check_divisible(n, p, specs[n], mesh, desc)
        if not isinstance(lay.owners.get(n, (None, None))[1], FullyShard):
            _check_heads(module, n, p, specs[n], mesh, desc)    # (FSDP gathers whole heads)
    for i, (ax, left) in enumerate(unused):     # not for "auto": transformers replicates
        _warn_plan(module, left, uncovered if i == 0 else [], ax, lay.full)
    first = families[0][0] if families else None
    apply = Parallelized(module, mesh, first, specs, lay.owners, lay.hooked, lay.withheld,
                         lay.axes, lay.planned)
    if not keep_module or any(p.is_meta for p in lay.full.values()):
        return apply, _release(apply), dict(specs)
    local = apply.shard({n: p.detach() for n, p in lay.full.items()})
    return apply, local, dict(specs)


def _auto_families(module: nn.Module, mesh: Mesh, axis: str, config: dict | None
                   ) -> list[tuple[Any, dict, bool]]:
    """"auto"'s plan families: the tensor-parallel plan over ``axis`` when the mesh has
    it, the expert-parallel plan over ``ep`` (or, from a config, ``("ep", "tp")``), and
    FSDP over ``fsdp`` (every parameter the others leave)."""
    if config is not None:
        return _config_families(module, mesh, config)
    use_tp, use_ep = axis in mesh.axis_names, "ep" in mesh.axis_names
    use_fsdp = "fsdp" in mesh.axis_names
    if not (use_tp or use_ep or use_fsdp or "cp" in mesh.axis_names):
        _need_axis(mesh, axis)
    families = []
    ep_plan = _auto_ep_plan(module, ExpertDispatch(shared=(axis,) if use_tp else ()),
                            None) if use_ep else {}
    if use_tp:
        # transformers: EP rules win over TP rules on the experts and inside them
        families.append((axis, _auto_plan(module, mesh.shape[axis], None, tuple(ep_plan)),
                         True))
    if ep_plan:
        families.append(("ep", ep_plan, True))
    if use_fsdp:
        families.append(("fsdp", _fsdp_style(mesh, module, config and config["fsdp_plan"]),
                         True))
    return families


def _config_families(module: nn.Module, mesh: Mesh, c: dict[str, Any]
                     ) -> list[tuple[Any, dict, bool]]:
    """A config's plan families on :func:`_mesh_for_config`'s mesh, as transformers
    applies them: TP over ``tp``; the experts over ``("ep", "tp")`` (each tp rank
    dispatching its slice of the shared tokens) and FSDP-sharded over ``efsdp``; every
    other parameter FSDP-sharded over the dense ``fsdp`` axis, ``("efsdp", "ep")``
    with expert parallelism; HSDP replicas over ``dp_replicate``."""
    tp, ep = c["tp_size"] > 1, c["ep_size"] > 1
    replicate = ("dp_replicate",) if c["dp_replicate_size"] > 1 else ()
    families = []
    ep_plan = {}
    if ep:
        efsdp = ("efsdp",) if _efsdp(c) > 1 else None
        style = ExpertDispatch(shared=("tp",) if tp else (), fsdp=efsdp,
                               replicate=replicate if efsdp else ())
        ep_plan = _auto_ep_plan(module, style, c["ep_plan"])
        _check_expert_shards(module, ep_plan, c)
    if tp and c["tp_plan"] != {}:
        families.append(("tp", _auto_plan(module, mesh.shape["tp"], c["tp_plan"],
                                          tuple(ep_plan)), True))
    if ep_plan:
        families.append((("ep", "tp") if tp else "ep", ep_plan, True))
    if c["fsdp_size"] > 1 and not ep:
        families.append(("fsdp", _fsdp_style(mesh, module, c["fsdp_plan"]), True))
    elif c["fsdp_size"] > 1:
        families.append((("efsdp", "ep"), FullyShard(c["fsdp_size"], replicate,
                                                     free=_fsdp_plan(module, c["fsdp_plan"])),
                         True))
    return families
