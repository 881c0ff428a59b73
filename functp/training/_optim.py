"""torch.optim over local blocks: the specs of an optimizer's state, its state made
before a first step (to load a checkpoint into), and gradients from a functp
gradient tree.

An elementwise optimizer (SGD, Adam, AdamW, ...) stepping on this rank's blocks
updates them exactly as it would update the full tensors, so torch.optim needs no
change; what it needs is ``.grad`` set from the tree ``torch.func.grad`` returns,
and, to checkpoint it, the layout of its per-parameter state.
"""
from __future__ import annotations

from typing import Any

import torch

from ..runtime._errors import ShardingError, leaf_text
from ..mesh._spec import P

__all__ = ["optimizer_specs", "init_optimizer_state", "set_grads"]


def optimizer_specs(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
                    specs: dict[str, Any]) -> dict:
    """The spec tree of ``optimizer.state_dict()``, for :func:`save` / :func:`load`.

    **Arguments:** ``optimizer`` – built over (some of) the local blocks ``params``;
    ``params`` / ``specs`` – the blocks and their specs by name (as
    :func:`parallelize` or :func:`shard` give them).

    **Returns:** ``{"state": {index: {key: spec}}, "param_groups": P()}``, one entry
    per parameter that has state. Each state tensor's spec comes from its shape
    against its parameter's block:

    - shaped like the block (Adam's moments, SGD's momentum): the parameter's spec;
    - a scalar (a step count): ``P()``;
    - the block with some dimensions reduced to 1 (Adafactor's row and column
      statistics, ``(..., rows, 1)`` and ``(..., 1, cols)``): the parameter's spec,
      with ``None`` at the reduced dimensions, which must not be split (a statistic
      over a split dimension differs per rank and is no block of one global tensor:
      ``ShardingError``);
    - any other shape: ``P()`` for a replicated parameter, else ``ShardingError``.

    A fresh optimizer has no state yet, so its spec tree holds none either: to load
    a checkpoint into one, call :func:`init_optimizer_state` first. Example::

        functp.save(path, {"params": params, "opt": opt.state_dict()}, mesh,
                    {"params": specs, "opt": functp.optimizer_specs(opt, params, specs)})
    """
    by_id = {id(t): n for n, t in params.items() if isinstance(t, torch.Tensor)}
    state: dict[int, dict] = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = by_id.get(id(p))
            if name is None:
                raise ShardingError(
                    f"optimizer_specs: the optimizer holds {leaf_text('a tensor', p.shape)} "
                    f"that is not one of params' values; pass the dict of blocks the "
                    f"optimizer was built over")
            st = optimizer.state.get(p)
            if st:     # state_dict() leaves out a parameter without state: so do its specs
                state[index] = {k: _state_spec(name, k, v, p, specs[name])
                                for k, v in st.items()}
            index += 1
    return {"state": state, "param_groups": P()}


def _state_spec(name: str, key: str, value: Any, param: torch.Tensor, spec: Any) -> Any:
    """The spec of ``optimizer.state[param][key]``, from its shape against the block."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return P()
    if value.shape == param.shape:
        return spec
    split = not isinstance(spec, P) or bool(spec.axes)
    if not split:
        return P()          # every rank holds the same parameter, so the same state

    def refuse(why: str) -> ShardingError:
        return ShardingError(
            f"optimizer_specs: {leaf_text(f'state {key!r}', value.shape)} of "
            f"{leaf_text(f'the block of parameter {name!r}', param.shape, spec)}: "
            f"{why}; shard {name!r} only on dimensions the optimizer keeps (Adafactor "
            f"reduces the last two of a matrix and keeps the leading ones), or keep it "
            f"replicated (P())")
    if not isinstance(spec, P):
        raise refuse("give the parameter's spec as P(...) so that the state's can be "
                     "derived from it")
    if value.dim() != param.dim() or any(v not in (b, 1) for v, b in zip(value.shape, param.shape)):
        raise refuse("no spec can be derived for a state of another shape")
    entries = list(spec) + [None] * (param.dim() - len(spec))
    for d, (v, b) in enumerate(zip(value.shape, param.shape)):
        if v != b:                       # reduced over dimension d
            if spec.dim_axes(d):
                raise refuse(
                    f"it is reduced over dimension {d}, which is split over "
                    f"{spec.dim_axes(d)}, so each rank holds a statistic of its own block, "
                    f"not a block of one global tensor")
            entries[d] = None
    packed = {d: k for d, k in spec.packed if value.shape[d] == param.shape[d]}
    return P(*entries, packed=packed or None)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Makes the per-parameter state a first step would make, without changing any
    parameter: what a fresh optimizer needs before it can load a checkpoint.

    ``optimizer.load_state_dict`` fills whatever state it is given, but
    :func:`load` needs the layout first, and :func:`optimizer_specs` reads it from
    the state, which a fresh optimizer does not have. This takes one step with zero
    gradients and a zero learning rate, then puts the parameters and their ``.grad``
    back as they were: the state gets its real keys, shapes and dtypes (its values
    are whatever that step leaves; loading replaces them). Parameters that already
    have state are left alone.

    Covers the optimizers that make their state inside ``step`` from the parameter
    and its gradient: those of ``torch.optim`` (SGD with momentum, Adam, AdamW,
    Adafactor, RMSprop, Adagrad, ...). Not LBFGS (its step needs a closure, and its
    state is not per parameter).

    **Arguments:** ``optimizer`` – a torch optimizer over local blocks.

    **Returns:** ``optimizer``. Example, resuming in a fresh process::

        opt = torch.optim.AdamW(params.values(), lr=1e-3)
        functp.init_optimizer_state(opt)
        layout = {"params": specs, "opt": functp.optimizer_specs(opt, params, specs)}
        state = functp.load(path, mesh, layout)
        opt.load_state_dict(state["opt"])
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ShardingError("init_optimizer_state: LBFGS is not supported (its step needs "
                            "a closure and its state is not per parameter)")
    fresh = [p for g in optimizer.param_groups for p in g["params"] if not optimizer.state.get(p)]
    if not fresh:
        return optimizer
    ids = {id(p) for p in fresh}
    values = [(p, p.detach().clone()) for p in fresh]
    grads = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]]
    rates = [g["lr"] for g in optimizer.param_groups]
    try:
        with torch.no_grad():
            for group in optimizer.param_groups:
                # a tensor learning rate stays a tensor (capturable/fused steps want one)
                lr = group["lr"]
                group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
                for p in group["params"]:
                    # a parameter that has state gets no gradient: the step skips it
                    p.grad = torch.zeros_like(p) if id(p) in ids else None
            optimizer.step()
    finally:
        with torch.no_grad():
            for group, lr in zip(optimizer.param_groups, rates):
                group["lr"] = lr
            for p, value in values:
                p.copy_(value)
            for p, grad in grads:
                p.grad = grad
    return optimizer


def set_grads(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
    """Sets ``params[name].grad = grads[name]`` (cast to the parameter's dtype) for an
    optimizer step over local blocks.

    **Arguments:** ``params`` – the blocks the optimizer steps on, a flat dict by
    name; ``grads`` – the gradient tree of the same keys (``torch.func.grad`` of a
    ``shard_map``'d loss), a tensor for each. Example::

        grads = torch.func.grad(step)(params, batch)
        functp.set_grads(params, grads)
        opt.step()
    """
    missing = sorted(set(params) - set(grads))
    if missing:
        raise ShardingError(f"set_grads: no gradient for {missing[:4]}"
                            f"{' ...' if len(missing) > 4 else ''}")
    for name, p in params.items():
        g = grads[name]
        if not isinstance(p, torch.Tensor):
            raise ShardingError(
                f"set_grads: params[{name!r}] is a {type(p).__name__}, not a tensor; pass "
                f"a flat dict of tensors by name (as functionalize and parallelize give), "
                f"e.g. flatten a nested tree with optree.tree_flatten_with_path")
        if g is None:
            raise ShardingError(
                f"set_grads: the gradient for {name!r} is None (the loss does not reach "
                f"it, or it was not differentiated); leave {name!r} out of params (and "
                f"out of the optimizer), or give a zero gradient: torch.zeros_like(p)")
        if not isinstance(g, torch.Tensor):
            raise ShardingError(
                f"set_grads: the gradient for {name!r} is a {type(g).__name__}, not a "
                f"tensor; params and grads must be flat dicts of tensors with the same "
                f"keys (differentiate the loss with respect to the flat params dict)")
        if g.shape != p.shape:
            raise ShardingError(
                f"set_grads: {leaf_text(f'the gradient for {name!r}', g.shape)} does not "
                f"fit {leaf_text(f'parameter {name!r}', p.shape)}; give each parameter the "
                f"gradient of its block")
        p.grad = g.detach().to(p.dtype)
