"""torch.optim over local blocks: the specs of an optimizer's state, and gradients
from a functp gradient tree.

An elementwise optimizer (SGD, Adam, AdamW, ...) stepping on this rank's blocks
updates them exactly as it would update the full tensors, so torch.optim needs no
change; what it needs is ``.grad`` set from the tree ``torch.func.grad`` returns,
and, to checkpoint it, the layout of its per-parameter state.
"""
from __future__ import annotations

from typing import Any

import torch

from ._errors import ShardingError
from ._spec import P

__all__ = ["optimizer_specs", "set_grads"]


def optimizer_specs(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
                    specs: dict[str, Any]) -> dict:
    """The spec tree of ``optimizer.state_dict()``, for :func:`save` / :func:`load`.

    **Arguments:** ``optimizer`` – built over (some of) the local blocks ``params``;
    ``params`` / ``specs`` – the blocks and their specs by name (as
    :func:`parallelize` or :func:`shard` give them).

    **Returns:** ``{"state": {index: {key: spec}}, "param_groups": P()}``: a state
    tensor shaped like its parameter (Adam's moments) gets the parameter's spec,
    anything else (a step count) ``P()``. Call it after a first step, when the
    state exists (before it, the state is empty and so is its spec). Example::

        functp.save(path, {"params": params, "opt": opt.state_dict()}, mesh,
                    {"params": specs, "opt": functp.optimizer_specs(opt, params, specs)})
    """
    by_id = {id(t): n for n, t in params.items()}
    state: dict[int, dict] = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = by_id.get(id(p))
            if name is None:
                raise ShardingError(
                    f"optimizer_specs: the optimizer holds a tensor of shape "
                    f"{tuple(p.shape)} that is not one of params' values; pass the dict "
                    f"of blocks the optimizer was built over")
            st = optimizer.state.get(p, {})
            state[index] = {k: (specs[name] if isinstance(v, torch.Tensor) and v.shape == p.shape
                                and v.dim() > 0 else P()) for k, v in st.items()}
            index += 1
    return {"state": state, "param_groups": P()}


def set_grads(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
    """Sets ``params[name].grad = grads[name]`` (cast to the parameter's dtype) for an
    optimizer step over local blocks.

    **Arguments:** ``params`` – the blocks the optimizer steps on; ``grads`` – the
    gradient tree of the same keys (``torch.func.grad`` of a ``shard_map``'d loss).
    Example::

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
        if g.shape != p.shape:
            raise ShardingError(f"set_grads: gradient for {name!r} has shape "
                                f"{tuple(g.shape)}, the block {tuple(p.shape)}")
        p.grad = g.detach().to(p.dtype)
