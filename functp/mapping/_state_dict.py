"""A module's state dict from full parameters keyed as ``named_parameters`` keys them:
the blocks ``parallelize`` and ``functionalize`` hand out hold a tied parameter once,
under its first name, and no buffers, while ``module.load_state_dict`` (strict) wants
every key ``module.state_dict()`` has."""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from ..runtime._errors import ShardingError

__all__ = ["module_state_dict", "reading"]


class _Reading(threading.local):
    on = 0      # inside module_state_dict: its module.state_dict() is functp's own


_reading = _Reading()


def reading() -> bool:
    """Is functp itself reading a module's state dict (for its keys) on this thread?"""
    return _reading.on > 0


def module_state_dict(module: nn.Module, full: dict[str, Any], what: str) -> dict[str, Any]:
    """``full`` under every key of ``module.state_dict()``, in its order.

    **Arguments:** ``full`` – ``{parameter name: full tensor}`` with the names of
    ``module.named_parameters()`` (a tied parameter once); ``what`` – the caller, for
    the error.

    **Returns:** a dict for ``module.load_state_dict(..., strict=True)``: a tied
    name maps to the same full tensor as the name it is tied to (as in
    ``module.state_dict()``), a buffer (or extra state) to the module's own value.
    **Raises:** ``ShardingError`` when ``full`` lacks a parameter of ``module`` or
    holds a name that is none of its parameters.
    """
    canonical = {id(p): n for n, p in module.named_parameters()}
    unknown = [k for k in full if k not in canonical.values()]
    missing = [n for n in canonical.values() if n not in full]
    if unknown or missing:
        raise ShardingError(
            f"{what}: a state dict of {type(module).__name__} needs a block of each of its "
            f"parameters, named as module.named_parameters() names them"
            + (f"; missing: {missing[:6]}" if missing else "")
            + (f"; not parameters of the module: {unknown[:6]}" if unknown else ""))
    # every name of each parameter (a tied one has several) -> its first name
    names = {n: canonical[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
    out = {}
    _reading.on += 1        # (its keys only: a kept module's stale weights are not read)
    try:
        sd = module.state_dict(keep_vars=True)
    finally:
        _reading.on -= 1
    for key, v in sd.items():
        if key in names:
            out[key] = full[names[key]]
        else:           # a buffer: the module's own (the blocks hold none)
            out[key] = v.detach() if isinstance(v, torch.Tensor) else v
    return out
