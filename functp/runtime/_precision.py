"""Mixed precision at a ``shard_map`` boundary: compute in one dtype, reduce the
gradients of replicated inputs in another (FSDP2's ``MixedPrecisionPolicy``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ._errors import ShardingError

__all__ = ["MixedPrecision"]


@dataclass(frozen=True)
class MixedPrecision:
    """What ``shard_map(..., mixed_precision=MixedPrecision(...))`` does to floating inputs.

    **Arguments:** ``param_dtype`` – the dtype the body sees every floating input in
    (``None``: as given); ``reduce_dtype`` – the dtype the boundary's gradient
    all-reduces (the sum over the axes an input is replicated along: DP's reduction)
    run in (``None``: ``param_dtype``'s, as without a policy).

    Each input is cast to ``reduce_dtype``, enters the body (the gradient reduction
    sits here), then is cast to ``param_dtype``; its gradient comes back in its own
    dtype, so fp32 master weights get fp32 gradients reduced in fp32 from bf16
    compute. Collectives the body itself calls run in the dtype it gives them.
    Example::

        policy = functp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        step = functp.shard_map(loss, mesh, in_specs=(specs, P("dp")), out_specs=P(),
                                mixed_precision=policy)
    """
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    @property
    def reduction_dtype(self) -> torch.dtype | None:
        """The dtype inputs enter in: ``reduce_dtype``, else ``param_dtype``."""
        return self.reduce_dtype or self.param_dtype

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype"):
            d = getattr(self, name)
            if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
                raise ShardingError(f"MixedPrecision: {name} must be a floating torch.dtype "
                                    f"or None, got {d!r}")


def floating(x) -> bool:
    """A tensor of a floating dtype: what a precision policy casts."""
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def inexact(x: torch.Tensor) -> bool:
    """A floating or complex dtype (JAX's ``inexact``): a tensor that has gradients
    to reduce. (No isinstance here: a boundary calls it per output on tensors.)"""
    return x.is_floating_point() or x.is_complex()
