"""The fully sharded (FSDP / ZeRO-3, and HSDP) parallel style.

Each parameter of the module is stored as this rank's block over the ``fsdp`` axis and
all-gathered when the module runs, in its forward pre-hook: a layer's gather happens
at that layer. The transpose of the tiled ``all_gather`` is a reduce-scatter, so each
rank's gradient comes back as the gradient of its own block, summed over ``fsdp``.
With ``replicate`` axes (HSDP's ``dp_replicate``) the block is first marked varying
over them, so its gradient is also all-reduced over them, on the block (1/fsdp of
the weight), after the reduce-scatter, as HSDP orders them.
"""
from __future__ import annotations

from torch import nn

from ..ops._collectives import all_gather, pvary
from ..mesh._layout import uneven
from ..mesh._spec import P
from ._styles import Style

__all__ = ["FullyShard"]


class FullyShard(Style):
    """Shards every own parameter of a module over the plan axis; gathers it per call.

    **Arguments:** ``size`` – the size of the plan axis (a parameter is split on dim 0
    when ``size`` divides it, else on its first dimension it divides, else kept
    replicated: :meth:`reason` says why); ``replicate`` – mesh axes over which the
    shards are replicated (HSDP: ``("dp_replicate",)``), whose gradients are summed
    on the block.

    Example (what ``parallelize(model, mesh, {"fsdp": "auto"})`` applies to each module)::

        style = FullyShard(4)
        style.param_specs(torch.nn.Linear(8, 6), "fsdp")    # weight P(None, 'fsdp'), bias P()
    """

    def __init__(self, size: int, replicate: tuple[str, ...] = ()):
        self.size, self.replicate = size, tuple(replicate)
        self._dims: dict[int, dict[str, int]] = {}     # id(module) -> {parameter: dim}

    def dim(self, shape: tuple[int, ...]) -> int | None:
        """The dimension a parameter of ``shape`` is split on, or None (replicated)."""
        return next((d for d, n in enumerate(shape) if not uneven(n, self.size)), None)

    def reason(self, shape: tuple[int, ...]) -> str:
        """Why a parameter of ``shape`` stays replicated over the plan axis."""
        return (f"no dimension of shape {tuple(shape)} divides into {self.size} fsdp "
                f"shards; pad one of them to a multiple of {self.size}")

    def param_specs(self, module: nn.Module, axis):
        specs, dims = {}, {}
        for name, p in module.named_parameters(recurse=False):
            d = self.dim(tuple(p.shape))
            specs[name] = P() if d is None else P(*([None] * d), axis)
            if d is not None:
                dims[name] = d
        self._dims[id(module)] = dims
        return specs

    def prepare_input(self, module, args, kwargs, call):
        # the module sees each whole weight from here until its forward returns;
        # functional_call puts the caller's tensors back when apply ends
        restore = call.state.setdefault("restore", {})
        for short, d in self._dims.get(id(module), {}).items():
            block = call.params.get(short)
            if block is None:
                continue
            if self.replicate:
                block = pvary(block, self.replicate)
            restore[short] = module._parameters[short]
            module._parameters[short] = all_gather(block, call.axis, axis=d, tiled=True)
        return args, kwargs

    def prepare_output(self, module, args, kwargs, output, call):
        for short, block in call.state.get("restore", {}).items():
            module._parameters[short] = block
        return output

    def __repr__(self) -> str:
        return f"FullyShard(size={self.size}, replicate={self.replicate})"
