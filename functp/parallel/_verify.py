"""``verify_plan`` and its engine: a plan's forward and backward against the unsharded
module, module by module, on a tiny input: a plan that splits a dimension some module
reduces over as a whole (a mean, a norm, a softmax over split columns) shows up as
the first module whose output differs, instead of as a silently wrong loss.
``parallelize(verify=True)`` runs it before laying the plan out."""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Shard
from torch.func import functional_call

from ..ops._collectives import all_gather_invariant, axis_size, pmean
from ..runtime._errors import ShardingError, leaf_text
from ..mesh._mesh import Mesh
from ..mapping._shard_map import shard_map
from ..mesh._spec import P
from ._fsdp_style import FullyShard
from ._ep import ExpertDispatch
from ._plans import lay_out_plan
from ._style import _layout
from ._tp import Colwise, Rowwise, _packed_merge

__all__ = ["verify_plan", "check_plan"]


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        for v in x:
            t = _first_tensor(v)
            if t is not None:
                return t
    if hasattr(x, "to_tuple"):            # transformers' ModelOutput
        return _first_tensor(x.to_tuple())
    return None


def _record(module: nn.Module, into: list, transform=None, skip: tuple[str, ...] = ()) -> list:
    """Forward hooks on every submodule (but those under a prefix in ``skip``)
    appending ``(name, first output tensor, first input tensor or None)``: the input
    tells a module that computes wrongly from one whose parent's code handed it a
    wrong input."""
    handles = []
    for name, sub in module.named_modules():
        if name.startswith(skip) and skip:
            continue
        def hook(m, args, kwargs, output, name=name):
            t = _first_tensor(output)
            if t is not None and t.is_floating_point():
                x = _first_tensor(args)
                x = _first_tensor(kwargs) if x is None else x
                x = x if x is not None and x.is_floating_point() else None
                if transform:
                    into.append((name, *transform(name, t, x)))
                else:
                    into.append((name, t.detach(), None if x is None else x.detach()))
        handles.append(sub.register_forward_hook(hook, with_kwargs=True))
    return handles


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _example_args(module: nn.Module) -> tuple[tuple, dict]:
    vocab = getattr(getattr(module, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise ShardingError(
            f"verify_plan({type(module).__name__}): give example inputs (verify_plan(model, "
            f"mesh, plan, *args)); only a module with a config.vocab_size (a transformers "
            f"language model) gets random token ids by default")
    g = torch.Generator().manual_seed(0)           # the same ids on every rank
    return (torch.randint(vocab, (2, 8), generator=g),), {"use_cache": False}


def check_plan(module: nn.Module, apply: Any, local: dict, specs: dict, args: tuple,
               kwargs: dict, rtol: float | None = None) -> dict[str, Any]:
    """:func:`functp.verify_plan`'s comparison, for a plan already applied
    (``apply, local, specs`` from ``parallelize``): every module's output, then every
    gradient, against the unsharded module on ``args``/``kwargs``."""
    full = {n: p.detach() for n, p in module.named_parameters()}
    if rtol is None:
        rtol = 1e-6 if all(p.dtype == torch.float64 for p in full.values()) else 1e-4
    was_training = module.training
    module.eval()                              # no dropout: the two runs must agree
    try:
        worst, n = _compare_outputs(module, full, apply, local, specs, args, kwargs, rtol)
        worst2, grads = _compare_grads(module, full, apply, local, specs, args, kwargs, rtol)
    finally:
        module.train(was_training)
    return {"modules": n, "parameters": grads, "max_error": max(worst, worst2)}


def _inside_dispatch(apply) -> tuple[str, ...]:
    """Prefixes of the modules inside an expert dispatch: they run on the pairs this
    rank received, whose number no unsharded module has (their sum is compared)."""
    return tuple(h[0] + "." for h in apply._hooked if isinstance(h[2], ExpertDispatch))


def _run_recorded(module, full, args, kwargs, skip) -> list:
    reference: list = []
    handles = _record(module, reference, skip=skip)
    try:
        with torch.no_grad():
            functional_call(module, full, args, kwargs, tie_weights=True, strict=False)
    finally:
        for h in handles:
            h.remove()
    return reference


def _whole_fn(apply, reference):
    """The global values of a submodule's output and input: each gathered along the
    dimension the plan split (the one that is the axis size times smaller than
    unsharded); an input that is no such split is None (it differs)."""
    axis = apply.axis
    packed = {h[0]: h[2].blocks for h in apply._hooked if getattr(h[2], "blocks", 1) > 1}

    def gathered(name, t, want, merge):
        if t.shape == want or axis is None:
            return t.detach()
        n = axis_size(axis)
        dims = [d for d in range(t.ndim) if t.ndim == len(want) and t.shape[d] * n == want[d]
                and all(t.shape[e] == want[e] for e in range(t.ndim) if e != d)]
        if not dims:
            return None
        g = all_gather_invariant(t.detach(), axis, axis=dims[0], tiled=True)
        if merge and name in packed and dims[0] == t.ndim - 1:
            g = _packed_merge(g, dims[0], packed[name], n)
        return g

    def whole(i: int, name: str, t: torch.Tensor, x: torch.Tensor | None) -> tuple:
        ref_out, ref_in = reference[i][1:] if i < len(reference) else (t, x)
        out = gathered(name, t, ref_out.shape, True)
        if out is None:
            raise ShardingError(
                f"verify_plan: module {name!r} returns shape {tuple(t.shape)} under the plan "
                f"but {tuple(ref_out.shape)} unsharded, which is not a split over {axis!r} "
                f"(size {axis_size(axis)}); the plan changes what this module computes")
        # (the same shapes on every rank: every rank gathers, or none)
        inp = (gathered(name, x, ref_in.shape, isinstance(_style_of(apply, name), Rowwise))
               if x is not None and ref_in is not None else None)
        return out, inp
    return whole


def _style_of(apply, name: str):
    """The style of the planned module ``name`` (None if the plan has no rule for it)."""
    hook = apply.plan_hooks.get(name)
    return None if hook is None else hook.style


def _plain_colwise(apply, name: str) -> bool:
    """Whether the plan splits module ``name``'s output features plainly (no packed
    blocks) and leaves its output split."""
    style = _style_of(apply, name)
    return (isinstance(style, Colwise) and style.blocks == 1 and isinstance(
        _layout(style.output_layout, apply.plan_hooks[name].axis, "Colwise output_layout"),
        Shard))


def _advice(module, apply, reference, i: int, name: str, input_differs: bool) -> str:
    """Why module ``name`` (call ``i``), the first whose output differs, does, and
    the fix: a fused weight split plainly column-wise before it in its parent's code
    (its output matches once gathered, but the parent splits it into blocks by width,
    and each rank holds a contiguous slice of the whole, not a slice of each block)."""
    # whose code went wrong: the parent's, which computed this module's input, or
    # (the input matching) this module's own, from what its children returned
    owner = name.rpartition(".")[0] if input_differs else name
    before = [n for n, *_ in reference[:i] if n and n.rpartition(".")[0] == owner]
    plain = [n for n in dict.fromkeys(before) if _plain_colwise(apply, n)]
    pmod = module.get_submodule(owner) if owner else module
    who = (f"the code of its parent {owner or '(the root)'!r} ({type(pmod).__name__})"
           if input_differs else f"its own code ({type(pmod).__name__})")
    if plain:
        return (f"{'its input already differs: ' if input_differs else ''}{who} computes "
                f"{'it' if input_differs else 'its output'} from the output of "
                f"{plain[-1]!r}, which the plan splits by plain 'colwise' (each rank: a "
                f"contiguous slice of its output features). "
                f"If that code splits or chunks the output into blocks by width (a fused q, "
                f"k, v; a fused gate and up), each rank must hold its slice of every block: "
                f"give {plain[-1]!r} Colwise(packed=3) (the style 'packed_colwise_qkv'; "
                f"packed=2, 'packed_colwise', for a fused gate_up)")
    if input_differs:
        return (f"its input already differs: {who}, which computes it, reduces "
                f"over a dimension the plan splits (a mean, norm or softmax over split "
                f"columns or heads), or combines split and unsplit values; give the modules "
                f"before it rules that keep that dimension whole (a gathering style such as "
                f"'colwise_gather_output', or 'replicated')")
    return (f"it, or its parent's code that computes its input, reduces over a dimension "
            f"the plan splits (a mean, norm or softmax over split columns or heads), or "
            f"combines split and unsplit values; give it or its children rules that keep "
            f"that dimension whole (a gathering style such as 'colwise_gather_output', or "
            f"'replicated')")


def _compare_outputs(module, full, apply, local, specs, args, kwargs, rtol):
    skip = _inside_dispatch(apply)
    reference = _run_recorded(module, full, args, kwargs, skip)
    whole = _whole_fn(apply, reference)
    sharded: list = []

    def body(p):
        handles = _record(module, sharded,
                          lambda name, t, x: whole(len(sharded), name, t, x), skip)
        try:
            with torch.no_grad():
                apply(p, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        return torch.zeros(())

    shard_map(body, apply.mesh, in_specs=(specs,), out_specs=P())(local)
    worst = 0.0
    for i, ((name, ref, ref_in), (name2, got, got_in)) in enumerate(zip(reference, sharded)):
        if name != name2 or got.shape != ref.shape:
            raise ShardingError(
                f"verify_plan: under the plan the modules ran in another order or shape "
                f"(call {i}: {name2!r} {tuple(got.shape)} where the unsharded module ran "
                f"{name!r} {tuple(ref.shape)})")
        err = _error(got, ref)
        worst = max(worst, err)
        if err > rtol:
            mod = module.get_submodule(name) if name else module
            input_differs = ref_in is not None and (
                got_in is None or got_in.shape != ref_in.shape or _error(got_in, ref_in) > rtol)
            raise ShardingError(
                f"verify_plan: the first module whose output differs under the plan is "
                f"{name or '(the root)'!r} ({type(mod).__name__}), by {err:.1e} relative "
                f"(allowed {rtol:.0e}); "
                + _advice(module, apply, reference, i, name, input_differs))
    return worst, len(reference)


def _compare_grads(module, full, apply, local, specs, args, kwargs, rtol):
    def scalar(out):
        t = _first_tensor(out)
        return (t.double() ** 2).mean()

    ref_grads = torch.func.grad(
        lambda p: scalar(functional_call(module, p, args, kwargs, tie_weights=True,
                                         strict=False)))(full)
    # the inputs are replicated: ranks that would hold other tokens (an expert
    # dispatch's, FSDP's) hold the same ones, and the mean over them is the same scalar
    batch = tuple(dict.fromkeys(
        a for h in apply._hooked if isinstance(h[2], (ExpertDispatch, FullyShard))
        for a in (*(h[4] if isinstance(h[4], tuple) else (h[4],)),
                  *getattr(h[2], "replicate", ()))))
    step = shard_map(lambda p: pmean(scalar(apply(p, *args, **kwargs)), batch)
                     if batch else scalar(apply(p, *args, **kwargs)), apply.mesh,
                     in_specs=(specs,), out_specs=P())
    grads = apply.unshard(torch.func.grad(step)(local))
    scale = max((g.abs().max().item() for g in ref_grads.values()), default=0.0)
    worst = 0.0
    for name, ref in ref_grads.items():
        err = ((grads[name].double() - ref.double()).abs().max()
               / max(ref.abs().max().item(), 1e-6 * scale, 1e-30)).item()
        worst = max(worst, err)
        if err > rtol:
            raise ShardingError(
                f"verify_plan: every module's output matches, but the gradient of "
                f"{leaf_text(f'parameter {name!r}', ref.shape, specs[name])} (rule "
                f"{apply.styles[name]}) differs by {err:.1e} relative (allowed {rtol:.0e})")
    return worst, len(ref_grads)


def verify_plan(module: nn.Module, mesh: Mesh | None, plan: dict[str, Any] | str, *args: Any,
                axis: str = "tp", rtol: float | None = None, distributed_config: Any = None,
                **kwargs: Any) -> dict[str, Any]:
    """Checks ``plan`` on ``module`` against the unsharded module, in seconds.

    Runs the module on ``args`` once unsharded and once under the plan (inside a
    ``shard_map``, inputs replicated), gathers each submodule's output where the plan
    split it and compares them in execution order; then compares the gradients of
    every parameter of a scalar of the output. Call it on every rank, as
    :func:`parallelize`; it changes nothing.

    **Arguments:** ``module``, ``mesh``, ``plan``, ``axis``, ``distributed_config`` – as
    :func:`parallelize`;
    ``*args``/``**kwargs`` – a small example input (default, for a transformers
    language model: random token ids of shape ``(2, 8)``); ``rtol`` – allowed error
    relative to each tensor's largest entry (default 1e-6 for float64 parameters,
    1e-4 otherwise: models that compute a part in float32 round there).

    **Returns:** ``{"modules": n, "parameters": n, "max_error": e}`` when everything
    matches. **Raises:** ``ShardingError`` naming the first module whose output
    differs (and by how much), or the first parameter whose gradient does.

    Example::

        report = functp.verify_plan(model, mesh, "auto")
        # ShardingError: ... first module whose output differs under the plan:
        #   'model.layers.0.mlp.act_fn' (GELUTanh), by 3.1e-01 ...
    """
    if not args and not kwargs:
        args, kwargs = _example_args(module)
    with warnings.catch_warnings():      # (the user's own parallelize call warns)
        warnings.simplefilter("ignore")
        apply, local, specs = lay_out_plan(module, mesh, plan, axis, distributed_config)
    return check_plan(module, apply, local, specs, args, kwargs, rtol)
