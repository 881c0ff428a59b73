"""``functionalize``: a ``torch.nn.Module`` as a pure function of a parameter dict."""
from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call

from ..mapping._param_swap import ParamSwap, recompute_within, reparametrized

__all__ = ["functionalize"]


def functionalize(module: torch.nn.Module, *, with_buffers: bool = False):
    """Splits ``module`` into a pure function and its parameters.

    **Returns:** ``(apply, params)`` where ``params`` maps the module's own dotted
    parameter names to tensors (detached: plain data, ready for ``shard``) and
    ``apply(params, *args, **kwargs) == module(*args, **kwargs)``. Buffers stay in
    the module and are used as they are. With ``with_buffers=True`` the result is
    ``(apply, params, buffers)`` and ``apply(params, buffers, *args, **kwargs)``
    takes them explicitly (in-place buffer updates, such as BatchNorm's running
    stats, land in the tensors you pass).

    Tied parameters appear once, under their first name, and stay tied.

    Example::

        apply, params = functp.functionalize(torch.nn.Linear(3, 2))
        sorted(params)            # ['bias', 'weight']
        apply(params, torch.ones(1, 3)).shape      # (1, 2)
    """
    params = {k: v.detach() for k, v in module.named_parameters()}
    if not with_buffers:
        swap = ParamSwap(module)

        def apply(params: dict[str, torch.Tensor], *args: Any, **kwargs: Any):
            # (a functp.checkpoint inside the module swaps them in again to recompute)
            return swap.call(params, args, kwargs,
                             lambda s: swap.swapped({k: s(v) for k, v in params.items()}))
        return apply, params

    buffers = {k: v.detach() for k, v in module.named_buffers()}

    def apply_b(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
                *args: Any, **kwargs: Any):
        with recompute_within(lambda swap: reparametrized(module, (params, buffers), swap)):
            return functional_call(module, (params, buffers), args, kwargs, tie_weights=True,
                                   strict=False)
    return apply_b, params, buffers
