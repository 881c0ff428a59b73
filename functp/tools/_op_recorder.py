"""The operator recorder of an estimate's trace: every operator the program dispatches,
with its FLOPs (torch's formulas, as ``FlopCounterMode`` counts them) and the bytes it
moves, for the totals and the time model (``_estimate``, ``_host_time``)."""
from __future__ import annotations

import functools
from typing import Any

import optree
import torch
from torch.utils.flop_counter import flop_registry

from ..runtime._torch_compat import TorchDispatchMode, can_decompose

__all__ = ["_OpRecorder"]

# operators that move or relabel data but compute nothing: not "uncounted"
_NO_COMPUTE = {"aten.detach", "aten.clone", "aten.copy_", "aten._to_copy", "aten.copy",
               "aten.lift_fresh", "aten.lift_fresh_copy", "aten._local_scalar_dense",
               "aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like",
               "aten.new_empty", "aten.new_zeros", "aten.new_ones", "aten.new_full",
               "aten.empty_strided", "aten.zero_", "aten.fill_", "aten.cat", "aten.stack",
               "aten.index", "aten.index_select", "aten.gather", "aten.constant_pad_nd",
               "aten.slice_scatter", "aten.select_scatter", "aten.clone", "aten.contiguous"}


class _OpRecorder(TorchDispatchMode):
    """Every operator the program dispatches, decomposed as ``FlopCounterMode``
    decomposes it, with the FLOPs torch's formula (``flop_registry``, the counter's
    own) gives this call and the bytes the call reads and writes (for the time model);
    ``flops``: their totals per operator, as ``FlopCounterMode`` counts them. (One mode
    in place of FlopCounterMode over a recorder: every mode on the stack costs each
    operator of a trace ~10 us, and the counter evaluated each formula a second time.)"""

    def __init__(self, host: "_Host | None" = None) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, int, str]] = []   # (operator, flops, bytes, dtype)
        self.flops: dict[Any, int] = {}                    # operator packet -> FLOPs
        self.uncounted: dict[str, int] = {}
        self.host = host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, formula, decomposes, moves, may_compute = _facts(func)
        # FlopCounterMode's rule: an operator without a formula (as it looks one up)
        # is decomposed where torch can, its parts dispatched here again
        if decomposes:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        if formula is not None:
            packet = func._overloadpacket
            self.flops[packet] = self.flops.get(packet, 0) + flops
        tensors = [t for t in optree.tree_leaves((args, kwargs, out), none_is_leaf=True)
                   if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors) if moves else 0
        dtype = _dtype_name(tensors[0].dtype) if tensors else "float32"
        self.calls.append((name, flops, nbytes, dtype))
        if flops and self.host is not None and self.host.start is None:
            self.host.begin(len(self.calls) - 1)
        if may_compute and any(isinstance(t, torch.Tensor) for t in optree.tree_leaves(args)):
            self.uncounted[name] = self.uncounted.get(name, 0) + 1
        return out


@functools.lru_cache(maxsize=None)
def _facts(func) -> tuple:
    """What the recorder needs of an operator, which does not change, found at its
    first call: (name, FLOP formula or None, decomposed first?, counts the bytes it
    reads and writes?, computes without a formula?)."""
    packet = func._overloadpacket
    name = str(packet)
    formula = flop_registry.get(packet)
    decomposes = (func not in flop_registry and func is not torch.ops.prim.device.default
                  and can_decompose(func))
    # a view moves nothing; a collective's time is the comm model's, not memory's
    moves = not func.is_view and func.namespace == "aten"
    may_compute = formula is None and moves and name not in _NO_COMPUTE
    return name, formula, decomposes, moves, may_compute


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
